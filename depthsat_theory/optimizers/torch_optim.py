"""``torch.optim.Optimizer`` subclasses for the first-step maps torch does not ship.

:class:`SignSGD`, :class:`Lion` and :class:`RotationOptimizer` (the planted
non-descent-compatible map), built by the corresponding
:meth:`~depthsat_theory.optimizers.ZeroStateUpdate.make_optimizer`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from depthsat_theory.optimizers.numerics import check_beta, check_lr, check_nonneg, rotate

__all__ = ["Lion", "RotationOptimizer", "SignSGD"]


def _closure_loss(closure: Callable[[], Any] | None) -> Any:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class SignSGD(torch.optim.Optimizer):
    r"""signSGD (Bernstein et al., 2018, "signSGD: Compressed Optimisation for Non-Convex Problems", Alg. 1).

    .. math::

        \theta \leftarrow \theta - \eta \operatorname{sign}(g)

    Stateless, so every step is its own zero-state step.

    Args:
        params: Parameters or parameter groups (real floating tensors of any
            shape; gradients of the same shape/dtype).
        lr: Step size :math:`\eta`, finite and ``>= 0``.

    Raises:
        ValueError: If ``lr`` is invalid.
        RuntimeError: On ``step()`` with a sparse gradient.
    """

    def __init__(self, params, lr: float = 1e-3) -> None:
        super().__init__(params, dict(lr=check_lr(lr)))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one step; ``closure`` re-evaluates and returns the loss.

        Args:
            closure: optional function that recomputes the loss (run with gradients enabled).

        Returns:
            The closure's loss, or ``None`` without a closure.

        Raises:
            RuntimeError: for a sparse gradient.
        """
        loss = _closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("SignSGD does not support sparse gradients")
                p.add_(torch.sign(p.grad), alpha=-group["lr"])
        return loss


class Lion(torch.optim.Optimizer):
    r"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms", Alg. 2).

    .. math::

        c &= \beta_1 m + (1 - \beta_1) g \\
        \theta &\leftarrow \theta - \eta\,(\operatorname{sign}(c) + \lambda\theta) \\
        m &\leftarrow \beta_2 m + (1 - \beta_2) g

    The momentum ``m`` (state key ``"exp_avg"``, same shape/dtype as the
    parameter) starts at zero, so the first step is
    :math:`\theta_1 = \theta_0 - \eta(\operatorname{sign}(g) + \lambda\theta_0)`.

    Args:
        params: Parameters or parameter groups (real floating tensors).
        lr: Step size :math:`\eta`, finite and ``>= 0``.
        betas: :math:`(\beta_1, \beta_2)`, each in ``[0, 1)``.
        weight_decay: Decoupled decay :math:`\lambda \ge 0`.

    Raises:
        ValueError: If a hyperparameter is invalid.
        RuntimeError: On ``step()`` with a sparse gradient.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        defaults = dict(
            lr=check_lr(lr),
            betas=(check_beta(betas[0], "betas[0]"), check_beta(betas[1], "betas[1]")),
            weight_decay=check_nonneg(weight_decay, "weight_decay"),
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one step; ``closure`` re-evaluates and returns the loss.

        Args:
            closure: optional function that recomputes the loss (run with gradients enabled).

        Returns:
            The closure's loss, or ``None`` without a closure.

        Raises:
            RuntimeError: for a sparse gradient.
        """
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr = group["lr"]
            beta1, beta2 = group["betas"]
            wd = group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m = state["exp_avg"]
                c = m.mul(beta1).add_(g, alpha=1.0 - beta1)
                update = torch.sign(c).add_(p, alpha=wd)
                p.add_(update, alpha=-lr)
                m.mul_(beta2).add_(g, alpha=1.0 - beta2)
        return loss


class RotationOptimizer(torch.optim.Optimizer):
    r"""Real optimizer for the planted ``"rotation"`` map (not a descent method).

    Let :math:`g` be the concatenation of the flattened gradients of all
    parameters that have a gradient, over all groups, in parameter order.
    With :math:`R` the pairwise quarter turn
    :math:`(g_{2k}, g_{2k+1}) \mapsto (-g_{2k+1}, g_{2k})` (an odd trailing
    entry maps to 0), each parameter moves by its slice of :math:`R(g)`:

    .. math::

        \theta \leftarrow \theta - \eta_{\text{group}}\, R(g)\big|_{\theta}

    Pairs may straddle two parameters. Parameters without a gradient are
    skipped (and do not take part in the pairing). Stateless.

    Args:
        params: Parameters or parameter groups (real floating tensors; all
            gradients on one device).
        lr: Step size :math:`\eta`, finite and ``>= 0``.

    Raises:
        ValueError: If ``lr`` is invalid, or (on ``step()``) gradients live
            on different devices.
        RuntimeError: On ``step()`` with a sparse gradient.
    """

    def __init__(self, params, lr: float = 1e-3) -> None:
        super().__init__(params, dict(lr=check_lr(lr)))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one step; ``closure`` re-evaluates and returns the loss.

        Args:
            closure: optional function that recomputes the loss (run with gradients enabled).

        Returns:
            The closure's loss, or ``None`` without a closure.

        Raises:
            RuntimeError: for a sparse gradient.
            ValueError: if the gradients are on more than one device.
        """
        loss = _closure_loss(closure)
        entries = []  # (param, lr)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("RotationOptimizer does not support sparse gradients")
                entries.append((p, group["lr"]))
        if not entries:
            return loss
        devices = {p.grad.device for p, _ in entries}
        if len(devices) > 1:
            raise ValueError(f"RotationOptimizer needs all gradients on one device, got {sorted(map(str, devices))}")
        flat = torch.cat([p.grad.reshape(-1) for p, _ in entries])
        rot = rotate(flat)
        offset = 0
        for p, lr in entries:
            n = p.numel()
            piece = rot[offset : offset + n].view(p.shape).to(p.dtype)
            p.add_(piece, alpha=-lr)
            offset += n
        return loss
