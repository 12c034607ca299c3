r"""Zero-state first-step maps of optimizers, and the optimizers themselves.

A new residual block inserted into a trained network starts at parameters
:math:`\theta = 0`. Let :math:`b = \nabla_\theta J(0)` be the gradient of the
objective with respect to the new block's parameters (flattened to a 1-D
vector). An optimizer whose state is all zero/neutral (fresh moments, fresh
accumulators, step counter 0) takes the *zero-state update*

.. math::

    \theta_1 = -\eta \, P(b),

where :math:`P` is the optimizer's *first-step map*. :math:`P` is called
*descent-compatible* iff

.. math::

    P(0) = 0 \quad\text{and}\quad \langle b, P(b) \rangle > 0
    \quad \text{for all } b \neq 0 .

For a descent-compatible map the first-order change of :math:`J` along the
step is :math:`J(\theta_1) - J(0) = -\eta \langle b, P(b) \rangle + o(\eta)`,
i.e. strictly negative for small :math:`\eta`.

This module provides

* :class:`ZeroStateUpdate`: the abstract first-step map, with a
  :meth:`~ZeroStateUpdate.make_optimizer` that builds the *real* optimizer
  (a ``torch.optim`` class where torch has one) with the same hyperparameters,
  so the map can be checked against an actual ``.step()``;
* :data:`UPDATES`: a registry of concrete maps (SGD, momentum SGD, Nesterov,
  Adam, AdamW, RMSprop, Adagrad, signSGD, Lion, and the planted
  non-descent-compatible ``"rotation"``);
* :class:`SignSGD`, :class:`Lion`, :class:`RotationOptimizer`:
  ``torch.optim.Optimizer`` subclasses for the maps torch does not ship;
* :func:`threshold`, :func:`is_descent_compatible`: helpers for predictions
  and for a numerical check of the descent-compatibility predicate.

The registered hyperparameters are fixed (see :data:`UPDATES`); variants can
be made with :func:`dataclasses.replace`, e.g.
``dataclasses.replace(get_update("adam"), eps=1e-6)``.

First steps of the torch 2.13 optimizers from zero state (derived from the
algorithm boxes in the ``torch.optim`` documentation):

==========  ==============================================================
name        :math:`P(b)` (elementwise)
==========  ==============================================================
sgd         :math:`b`
momentum    :math:`b` (buffer starts as the gradient; dampening unused)
nesterov    :math:`(1 + \mu) b`
adam(w)     :math:`b / (|b| + \epsilon)` (bias correction:
            :math:`\hat m = b`, :math:`\hat v = b^2`)
rmsprop     :math:`b / (\sqrt{1 - \alpha}\,|b| + \epsilon)`
adagrad     :math:`b / (\sqrt{a_0 + b^2} + \epsilon)`
signsgd     :math:`\operatorname{sign}(b)`
lion        :math:`\operatorname{sign}(b)`
rotation    :math:`(x, y) \mapsto (-y, x)` on coordinate pairs
==========  ==============================================================

Weight decay is inert at :math:`\theta = 0`: coupled decay adds
:math:`\lambda\theta = 0` to the gradient, decoupled decay multiplies
:math:`\theta = 0`.
"""

from __future__ import annotations

import abc
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import torch

_F64_TINY = float(np.finfo(np.float64).tiny)  # smallest normal float64

__all__ = [
    "DESCENT_COMPATIBLE",
    "UPDATES",
    "Lion",
    "RotationOptimizer",
    "SignSGD",
    "ZeroStateUpdate",
    "get_update",
    "is_descent_compatible",
    "threshold",
]


# ---------------------------------------------------------------------------
# validation helpers
# ---------------------------------------------------------------------------


def _check_vector(b: Any, argname: str = "b") -> torch.Tensor:
    """Validate a flat, finite, floating-point vector; return it unchanged."""
    if not isinstance(b, torch.Tensor):
        raise ValueError(f"{argname} must be a torch.Tensor, got {type(b).__name__}")
    if b.dim() != 1:
        raise ValueError(f"{argname} must be a 1-D (flat) tensor, got shape {tuple(b.shape)}")
    if not b.is_floating_point():
        raise ValueError(f"{argname} must have a real floating dtype, got {b.dtype}")
    if not bool(torch.isfinite(b).all()):
        raise ValueError(f"{argname} must be finite (contains NaN or inf)")
    return b


def _check_tau(tau: Any) -> float:
    """Validate a rounding bound ``tau >= 0`` (finite or ``inf``)."""
    if isinstance(tau, bool) or not isinstance(tau, (int, float)):
        raise ValueError(f"tau must be a real number, got {type(tau).__name__}")
    tau = float(tau)
    if not tau >= 0.0:  # also rejects NaN
        raise ValueError(f"tau must be >= 0, got {tau}")
    return tau


def _check_lr(lr: Any) -> float:
    """Validate a learning rate: a finite real number ``>= 0``."""
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise ValueError(f"lr must be a real number, got {type(lr).__name__}")
    lr = float(lr)
    if not (math.isfinite(lr) and lr >= 0.0):
        raise ValueError(f"lr must be finite and >= 0, got {lr}")
    return lr


def _check_beta(beta: Any, argname: str) -> float:
    beta = float(beta)
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"{argname} must be in [0, 1), got {beta}")
    return beta


def _check_nonneg(x: Any, argname: str) -> float:
    x = float(x)
    if not (math.isfinite(x) and x >= 0.0):
        raise ValueError(f"{argname} must be finite and >= 0, got {x}")
    return x


def _exact_dot(b: torch.Tensor, p: torch.Tensor) -> float:
    r"""Return :math:`\langle b, p\rangle` in float64 with an exactly rounded sum.

    The elementwise products are formed in float64 and summed with
    :func:`math.fsum`, so cancellations (e.g. the rotation map, where the
    products come in exact :math:`\pm` pairs) give exactly ``0.0`` regardless
    of summation order.
    """
    prods = b.detach().to(torch.float64) * p.detach().to(torch.float64)
    prods = prods.cpu()
    chunks = (c.tolist() for c in prods.split(1 << 20))
    return math.fsum(itertools.chain.from_iterable(chunks))


def _inner_sign(b: torch.Tensor, p: torch.Tensor) -> int:
    r"""Exact sign of :math:`\langle b, p\rangle` (as real numbers).

    Fast path: if every nonzero product :math:`b_i p_i` is a normal, finite
    float64, the products carry relative error :math:`\le u = 2^{-53}`, and
    :func:`math.fsum` sums them exactly before one final rounding; the sign
    is certified when :math:`|s| > 4u \sum_i |b_i p_i|`. Otherwise (under- or
    overflow, near or exact cancellation) the inner product is evaluated
    exactly in rational arithmetic (:class:`fractions.Fraction`).
    """
    x = b.detach().to("cpu", torch.float64).numpy()
    y = p.detach().to("cpu", torch.float64).numpy()
    nz = (x != 0.0) & (y != 0.0)
    x, y = x[nz], y[nz]
    if x.size == 0:
        return 0
    with np.errstate(all="ignore"):
        t = x * y
    at = np.abs(t)
    if bool(np.all(np.isfinite(at))) and float(at.min()) >= _F64_TINY:
        s = math.fsum(t.tolist())
        if abs(s) > 4.0 * 2.0**-53 * math.fsum(at.tolist()):
            return 1 if s > 0.0 else -1
    exact = sum(
        (Fraction(u) * Fraction(v) for u, v in zip(x.tolist(), y.tolist(), strict=False)),
        Fraction(0),
    )
    return (exact > 0) - (exact < 0)


def _rotate(b: torch.Tensor) -> torch.Tensor:
    """Pairwise quarter turn ``(x, y) -> (-y, x)``; odd trailing entry -> 0."""
    out = torch.zeros_like(b)
    m = (b.numel() // 2) * 2
    out[0:m:2] = -b[1:m:2]
    out[1:m:2] = b[0:m:2]
    return out


# ---------------------------------------------------------------------------
# public helpers
# ---------------------------------------------------------------------------


def threshold(b: torch.Tensor, tau: float) -> torch.Tensor:
    r"""Zero the entries of ``b`` that are not resolvable above a rounding bound.

    Sign-like first-step maps jump at :math:`b_i = 0`, so a gradient entry
    whose magnitude is within the caller's rounding bound :math:`\tau` has an
    undetermined sign. For predictions such entries are set to zero before
    :math:`P` is applied:

    .. math::

        \operatorname{threshold}(b, \tau)_i =
        \begin{cases} 0 & |b_i| \le \tau \\ b_i & |b_i| > \tau \end{cases}

    Args:
        b: Flat gradient vector, shape ``(d,)``, real floating dtype, finite.
        tau: Rounding bound, a real number ``>= 0`` (``float('inf')`` zeroes
            everything). ``tau = 0`` only normalizes ``-0.0`` to ``+0.0``.

    Returns:
        Tensor of shape ``(d,)`` with ``b``'s dtype and device; entries with
        ``|b_i| > tau`` are bitwise copies of ``b_i``, the others are ``+0.0``.

    Raises:
        ValueError: If ``b`` is not a finite 1-D floating tensor, or if
            ``tau`` is negative, NaN or not a real number.
    """
    _check_vector(b, "b")
    tau = _check_tau(tau)
    return torch.where(b.abs() <= tau, torch.zeros_like(b), b)


# ---------------------------------------------------------------------------
# the abstract first-step map
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ZeroStateUpdate(abc.ABC):
    r"""First-step map :math:`P` of an optimizer started from zero state.

    The zero-state update from :math:`\theta = 0` with gradient :math:`b` is
    :math:`\theta_1 = -\eta P(b)`. Concrete subclasses are frozen dataclasses
    holding the optimizer's hyperparameters; they implement :meth:`_map`
    (the math) and :meth:`make_optimizer` (the real optimizer with the same
    hyperparameters).

    Attributes:
        name: Registry name, e.g. ``"adam"``.
        descent_compatible: The declared (proved) property
            :math:`P(0) = 0` and :math:`\langle b, P(b)\rangle > 0` for all
            :math:`b \ne 0`. :func:`is_descent_compatible` checks it
            numerically.
    """

    name: str
    descent_compatible: bool

    @abc.abstractmethod
    def _map(self, b: torch.Tensor) -> torch.Tensor:
        """Apply :math:`P` to a validated flat vector (no validation here)."""

    @abc.abstractmethod
    def make_optimizer(self, params: Iterable[torch.Tensor] | Iterable[dict], lr: float) -> torch.optim.Optimizer:
        r"""Build the real optimizer whose first step from zero state is :math:`P`.

        Args:
            params: Parameters or parameter groups, as for any
                ``torch.optim.Optimizer``.
            lr: Learning rate :math:`\eta`, finite and ``>= 0``.

        Returns:
            A fresh optimizer (``torch.optim`` class where torch has one,
            otherwise :class:`SignSGD`, :class:`Lion` or
            :class:`RotationOptimizer`) with this map's hyperparameters.

        Raises:
            ValueError: If ``lr`` is not finite and ``>= 0``.
        """

    def first_step(self, b: torch.Tensor) -> torch.Tensor:
        r"""Return :math:`P(b)`, the zero-state step direction.

        Args:
            b: Flat gradient :math:`b = \nabla_\theta J(0)`, shape ``(d,)``,
                real floating dtype, finite.

        Returns:
            :math:`P(b)`, shape ``(d,)``, same dtype and device as ``b``.
            The zero-state update is ``-lr * P(b)``.

        Raises:
            ValueError: If ``b`` is not a finite 1-D floating tensor.
        """
        _check_vector(b, "b")
        out = self._map(b)
        if out.shape != b.shape or out.dtype != b.dtype or out.device != b.device:
            raise RuntimeError(  # pragma: no cover - guards subclasses
                f"{type(self).__name__}._map returned shape {tuple(out.shape)}, "
                f"dtype {out.dtype}, device {out.device} for input of shape "
                f"{tuple(b.shape)}, dtype {b.dtype}, device {b.device}"
            )
        return out

    def predicted_change_rate(self, b: torch.Tensor, tau: float = 0.0) -> float:
        r"""First-order rate of change of :math:`J` along the zero-state update.

        .. math::

            \frac{d}{d\eta} J(-\eta P(\tilde b))\Big|_{\eta = 0}
            = -\langle b, P(\tilde b)\rangle,
            \qquad \tilde b = \operatorname{threshold}(b, \tau).

        The inner product is formed in float64 with an exactly rounded sum.

        Args:
            b: Flat gradient, shape ``(d,)``, real floating dtype, finite.
            tau: Rounding bound for :func:`threshold` (``>= 0``).

        Returns:
            :math:`-\langle b, P(\operatorname{threshold}(b, \tau))\rangle`
            as a Python ``float`` (negative means first-order descent).

        Raises:
            ValueError: If ``b`` is invalid or ``tau`` is negative/NaN.
        """
        return -_exact_dot(b, self.first_step(threshold(b, tau)))


# ---------------------------------------------------------------------------
# concrete maps (private classes; instances are exposed through UPDATES)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _SGDUpdate(ZeroStateUpdate):
    r"""Plain SGD: :math:`P(b) = b`.

    Source: ``torch.optim.SGD`` algorithm box, :math:`\theta_t = \theta_{t-1}
    - \gamma g_t` with momentum 0.
    """

    name: str = field(default="sgd", init=False)
    descent_compatible: bool = field(default=True, init=False)
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_nonneg(self.weight_decay, "weight_decay")

    def _map(self, b: torch.Tensor) -> torch.Tensor:
        return b.clone()

    def make_optimizer(self, params, lr):
        return torch.optim.SGD(params, lr=_check_lr(lr), weight_decay=self.weight_decay)


@dataclass(frozen=True)
class _MomentumUpdate(ZeroStateUpdate):
    r"""Heavy-ball SGD, :math:`\mu = 0.9`: :math:`P(b) = b`.

    Source: ``torch.optim.SGD`` algorithm box: at :math:`t = 1` the buffer is
    :math:`\mathbf{b}_1 = g_1` (dampening is not applied on the first step).
    """

    name: str = field(default="momentum", init=False)
    descent_compatible: bool = field(default=True, init=False)
    momentum: float = 0.9
    dampening: float = 0.0

    def __post_init__(self) -> None:
        _check_beta(self.momentum, "momentum")

    def _map(self, b: torch.Tensor) -> torch.Tensor:
        return b.clone()

    def make_optimizer(self, params, lr):
        return torch.optim.SGD(params, lr=_check_lr(lr), momentum=self.momentum, dampening=self.dampening)


@dataclass(frozen=True)
class _NesterovUpdate(ZeroStateUpdate):
    r"""Nesterov SGD, :math:`\mu = 0.9`: :math:`P(b) = (1 + \mu) b`.

    Source: ``torch.optim.SGD`` algorithm box: :math:`\mathbf{b}_1 = g_1`,
    :math:`g_1 \leftarrow g_1 + \mu \mathbf{b}_1`.
    """

    name: str = field(default="nesterov", init=False)
    descent_compatible: bool = field(default=True, init=False)
    momentum: float = 0.9

    def __post_init__(self) -> None:
        _check_beta(self.momentum, "momentum")
        if self.momentum == 0.0:
            raise ValueError("Nesterov momentum requires momentum > 0")

    def _map(self, b: torch.Tensor) -> torch.Tensor:
        return b + self.momentum * b

    def make_optimizer(self, params, lr):
        return torch.optim.SGD(params, lr=_check_lr(lr), momentum=self.momentum, nesterov=True)


@dataclass(frozen=True)
class _AdamUpdate(ZeroStateUpdate):
    r"""Adam, betas (0.9, 0.999), eps 1e-8: :math:`P(b) = b / (|b| + \epsilon)`.

    Source: Kingma & Ba (2015) and the ``torch.optim.Adam`` algorithm box:
    :math:`m_1 = (1-\beta_1) b`, :math:`v_1 = (1-\beta_2) b^2`, bias
    correction gives :math:`\hat m_1 = b`, :math:`\hat v_1 = b^2`.
    Descent-compatible for :math:`\epsilon > 0`:
    :math:`\langle b, P(b)\rangle = \sum_i b_i^2 / (|b_i| + \epsilon)`.
    """

    name: str = field(default="adam", init=False)
    descent_compatible: bool = field(default=True, init=False)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_beta(self.betas[0], "betas[0]")
        _check_beta(self.betas[1], "betas[1]")
        if not (math.isfinite(self.eps) and self.eps > 0.0):
            raise ValueError(f"eps must be finite and > 0, got {self.eps}")
        _check_nonneg(self.weight_decay, "weight_decay")

    def _map(self, b: torch.Tensor) -> torch.Tensor:
        return b / (b.abs() + self.eps)

    def make_optimizer(self, params, lr):
        cls = torch.optim.AdamW if self.name == "adamw" else torch.optim.Adam
        return cls(
            params,
            lr=_check_lr(lr),
            betas=self.betas,
            eps=self.eps,
            weight_decay=self.weight_decay,
        )


@dataclass(frozen=True)
class _AdamWUpdate(_AdamUpdate):
    r"""AdamW, betas (0.9, 0.999), eps 1e-8, weight decay 0.01.

    :math:`P(b) = b / (|b| + \epsilon)`; the decoupled decay
    :math:`\theta \leftarrow \theta(1 - \eta\lambda)` is inert at
    :math:`\theta = 0`. Source: Loshchilov & Hutter (2019) and the
    ``torch.optim.AdamW`` algorithm box.
    """

    name: str = field(default="adamw", init=False)
    weight_decay: float = 0.01


@dataclass(frozen=True)
class _RMSpropUpdate(ZeroStateUpdate):
    r"""RMSprop (not centered), alpha 0.99, eps 1e-8.

    .. math::

        P(b) = \frac{b}{\sqrt{1 - \alpha}\,|b| + \epsilon}

    Source: ``torch.optim.RMSprop`` algorithm box (no bias correction):
    :math:`v_1 = (1 - \alpha) b^2`, step :math:`b / (\sqrt{v_1} + \epsilon)`.
    """

    name: str = field(default="rmsprop", init=False)
    descent_compatible: bool = field(default=True, init=False)
    alpha: float = 0.99
    eps: float = 1e-8

    def __post_init__(self) -> None:
        _check_beta(self.alpha, "alpha")
        if not (math.isfinite(self.eps) and self.eps > 0.0):
            raise ValueError(f"eps must be finite and > 0, got {self.eps}")

    def _map(self, b: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as torch: sqrt((1 - alpha) * b * b) + eps.
        return b / (torch.sqrt((1.0 - self.alpha) * (b * b)) + self.eps)

    def make_optimizer(self, params, lr):
        return torch.optim.RMSprop(params, lr=_check_lr(lr), alpha=self.alpha, eps=self.eps)


@dataclass(frozen=True)
class _AdagradUpdate(ZeroStateUpdate):
    r"""Adagrad, initial_accumulator_value 0.1, eps 1e-10.

    .. math::

        P(b) = \frac{b}{\sqrt{a_0 + b^2} + \epsilon}

    Source: Duchi et al. (2011) and the ``torch.optim.Adagrad`` algorithm box
    (``lr_decay`` is irrelevant at step 1).
    """

    name: str = field(default="adagrad", init=False)
    descent_compatible: bool = field(default=True, init=False)
    initial_accumulator_value: float = 0.1
    eps: float = 1e-10

    def __post_init__(self) -> None:
        a0 = _check_nonneg(self.initial_accumulator_value, "initial_accumulator_value")
        eps = _check_nonneg(self.eps, "eps")
        if a0 == 0.0 and eps == 0.0:
            raise ValueError("initial_accumulator_value and eps cannot both be 0")

    def _map(self, b: torch.Tensor) -> torch.Tensor:
        return b / (torch.sqrt(self.initial_accumulator_value + b * b) + self.eps)

    def make_optimizer(self, params, lr):
        return torch.optim.Adagrad(
            params,
            lr=_check_lr(lr),
            initial_accumulator_value=self.initial_accumulator_value,
            eps=self.eps,
        )


@dataclass(frozen=True)
class _SignSGDUpdate(ZeroStateUpdate):
    r"""signSGD: :math:`P(b) = \operatorname{sign}(b)`.

    :math:`\langle b, P(b)\rangle = \|b\|_1`. Source: Bernstein et al. (2018).
    """

    name: str = field(default="signsgd", init=False)
    descent_compatible: bool = field(default=True, init=False)

    def _map(self, b: torch.Tensor) -> torch.Tensor:
        return torch.sign(b)

    def make_optimizer(self, params, lr):
        return SignSGD(params, lr=_check_lr(lr))


@dataclass(frozen=True)
class _LionUpdate(ZeroStateUpdate):
    r"""Lion, betas (0.9, 0.99), weight decay 0: :math:`P(b) = \operatorname{sign}(b)`.

    From :math:`m = 0`, :math:`c = (1 - \beta_1) b`, so the first step is
    :math:`\operatorname{sign}(b)` (the decay term is inert at 0).
    Source: Chen et al. (2023), Alg. 2.
    """

    name: str = field(default="lion", init=False)
    descent_compatible: bool = field(default=True, init=False)
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_beta(self.betas[0], "betas[0]")
        _check_beta(self.betas[1], "betas[1]")
        _check_nonneg(self.weight_decay, "weight_decay")

    def _map(self, b: torch.Tensor) -> torch.Tensor:
        return torch.sign(b)

    def make_optimizer(self, params, lr):
        return Lion(params, lr=_check_lr(lr), betas=self.betas, weight_decay=self.weight_decay)


@dataclass(frozen=True)
class _RotationUpdate(ZeroStateUpdate):
    r"""Planted non-descent-compatible map (converse evidence).

    Pairs coordinates :math:`(0,1), (2,3), \dots` and maps
    :math:`(x, y) \mapsto (-y, x)`; an odd trailing coordinate maps to 0.
    Hence :math:`\langle b, P(b)\rangle = 0` exactly for every :math:`b`.
    """

    name: str = field(default="rotation", init=False)
    descent_compatible: bool = field(default=False, init=False)

    def _map(self, b: torch.Tensor) -> torch.Tensor:
        return _rotate(b)

    def make_optimizer(self, params, lr):
        return RotationOptimizer(params, lr=_check_lr(lr))


# ---------------------------------------------------------------------------
# optimizers not shipped by torch
# ---------------------------------------------------------------------------


def _closure_loss(closure: Callable[[], Any] | None) -> Any:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class SignSGD(torch.optim.Optimizer):
    r"""signSGD (Bernstein et al., 2018, "signSGD: Compressed Optimisation for
    Non-Convex Problems", Alg. 1).

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
        super().__init__(params, dict(lr=_check_lr(lr)))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one step; ``closure`` re-evaluates and returns the loss."""
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
    r"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization
    Algorithms", Alg. 2).

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
            lr=_check_lr(lr),
            betas=(_check_beta(betas[0], "betas[0]"), _check_beta(betas[1], "betas[1]")),
            weight_decay=_check_nonneg(weight_decay, "weight_decay"),
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one step; ``closure`` re-evaluates and returns the loss."""
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
        super().__init__(params, dict(lr=_check_lr(lr)))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one step; ``closure`` re-evaluates and returns the loss."""
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
        rot = _rotate(flat)
        offset = 0
        for p, lr in entries:
            n = p.numel()
            piece = rot[offset : offset + n].view(p.shape).to(p.dtype)
            p.add_(piece, alpha=-lr)
            offset += n
        return loss


# ---------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------

UPDATES: dict[str, ZeroStateUpdate] = {
    u.name: u
    for u in (
        _SGDUpdate(),
        _MomentumUpdate(),
        _NesterovUpdate(),
        _AdamUpdate(),
        _AdamWUpdate(),
        _RMSpropUpdate(),
        _AdagradUpdate(),
        _SignSGDUpdate(),
        _LionUpdate(),
        _RotationUpdate(),
    )
}
"""Registry of first-step maps, keyed by name.

Hyperparameters: ``sgd`` (none); ``momentum`` :math:`\\mu = 0.9`;
``nesterov`` :math:`\\mu = 0.9`; ``adam`` betas (0.9, 0.999), eps 1e-8;
``adamw`` the same plus weight_decay 0.01; ``rmsprop`` alpha 0.99, eps 1e-8;
``adagrad`` initial_accumulator_value 0.1, eps 1e-10; ``signsgd`` (none);
``lion`` betas (0.9, 0.99), weight_decay 0; ``rotation`` (none, not
descent-compatible).
"""

DESCENT_COMPATIBLE: tuple[str, ...] = tuple(name for name, u in UPDATES.items() if u.descent_compatible)
"""Names in :data:`UPDATES` whose map is declared descent-compatible."""


def get_update(name: str) -> ZeroStateUpdate:
    """Look up a first-step map by name.

    Args:
        name: One of the keys of :data:`UPDATES`.

    Returns:
        The registered :class:`ZeroStateUpdate` instance.

    Raises:
        ValueError: If ``name`` is not a registered name; the message lists
            the valid names.
    """
    if isinstance(name, str) and name in UPDATES:
        return UPDATES[name]
    raise ValueError(f"unknown update {name!r}; valid names: {', '.join(sorted(UPDATES))}")


# ---------------------------------------------------------------------------
# numerical predicate
# ---------------------------------------------------------------------------


def _default_samples(dim: int, n: int, seed: int) -> torch.Tensor:
    """Seeded float64 test gradients, shape ``(n + 2*(n//4) + n//4 + 2*dim, dim)``."""
    gen = torch.Generator().manual_seed(seed)
    dt = torch.float64
    gauss = torch.randn(n, dim, generator=gen, dtype=dt)
    k = max(n // 4, 1)
    # Many exact zeros: ~75 % of the entries zeroed, one entry kept nonzero.
    sparse = torch.randn(k, dim, generator=gen, dtype=dt)
    sparse = sparse * (torch.rand(k, dim, generator=gen, dtype=dt) < 0.25)
    keep = torch.randint(0, dim, (k,), generator=gen)
    v = torch.randn(k, generator=gen, dtype=dt)
    sparse[torch.arange(k), keep] = v + torch.where(v >= 0, 1.0, -1.0).to(dt)
    tiny = torch.randn(k, dim, generator=gen, dtype=dt) * 1e-30
    huge = torch.randn(k, dim, generator=gen, dtype=dt) * 1e30
    eye = torch.eye(dim, dtype=dt)
    return torch.cat([gauss, sparse, tiny, huge, eye, -eye])


def is_descent_compatible(
    update: ZeroStateUpdate,
    samples: torch.Tensor | None = None,
    *,
    dim: int = 8,
    n: int = 256,
    seed: int = 0,
) -> bool:
    r"""Numerically check that a first-step map is descent-compatible.

    Checks :math:`P(0) = 0` (exactly) and, for every nonzero row :math:`b` of
    ``samples``, that :math:`P(b)` is finite and
    :math:`\langle b, P(b)\rangle > 0`. The sign of the inner product of the
    two floating-point vectors is decided *exactly* (certified float64 fast
    path, rational arithmetic as fallback), so tiny/huge rows neither
    underflow nor overflow, and exact cancellations give exactly 0 (which
    fails). What is checked is the map as computed in the samples' dtype:
    e.g. Adagrad/RMSprop, like their torch steps, compute :math:`b_i^2`, which
    overflows for :math:`|b_i| \gtrsim 10^{154}` in float64 and sends
    :math:`P(b)_i` to 0. Zero rows are skipped (the definition quantifies over
    :math:`b \ne 0`).

    This is evidence, not a proof; the proved property is
    ``update.descent_compatible``.

    Args:
        update: The map to check.
        samples: Test gradients, shape ``(m, d)``, real floating dtype,
            finite, ``d >= 1``. Default: seeded float64 rows of width ``dim``:
            ``n`` standard Gaussian rows, ``max(n // 4, 1)`` rows each of
            mostly exact zeros, of scale 1e-30, and of scale 1e30, and the
            ``2 * dim`` signed basis vectors.
        dim: Width of the default samples (``>= 1``); ignored if ``samples``
            is given.
        n: Number of Gaussian default rows (``>= 1``); ignored if ``samples``
            is given.
        seed: Seed of the default samples.

    Returns:
        ``True`` iff every check passed.

    Raises:
        TypeError: If ``update`` is not a :class:`ZeroStateUpdate`.
        ValueError: If ``samples`` is not a finite 2-D floating tensor with
            at least one column, or ``dim``/``n`` is not a positive integer.
    """
    if not isinstance(update, ZeroStateUpdate):
        raise TypeError(f"update must be a ZeroStateUpdate, got {type(update).__name__}")
    if samples is None:
        for val, argname in ((dim, "dim"), (n, "n")):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{argname} must be a positive int, got {val!r}")
        samples = _default_samples(dim, n, int(seed))
    else:
        if not isinstance(samples, torch.Tensor):
            raise ValueError(f"samples must be a torch.Tensor, got {type(samples).__name__}")
        if samples.dim() != 2 or samples.shape[1] < 1:
            raise ValueError(f"samples must have shape (m, d) with d >= 1, got {tuple(samples.shape)}")
        if not samples.is_floating_point():
            raise ValueError(f"samples must have a real floating dtype, got {samples.dtype}")
        if not bool(torch.isfinite(samples).all()):
            raise ValueError("samples must be finite (contains NaN or inf)")

    zero = torch.zeros(samples.shape[1], dtype=samples.dtype, device=samples.device)
    p0 = update.first_step(zero)
    if not bool((p0 == 0).all()):
        return False
    for row in samples:
        if not bool((row != 0).any()):
            continue
        p = update.first_step(row)
        if not bool(torch.isfinite(p).all()):
            return False
        if _inner_sign(row, p) <= 0:
            return False
    return True
