r"""Train grown parameters from zero optimizer state, and preview the first step (T3).

- :func:`zero_state_param_groups` adds the new parameters to an existing optimizer as a new
  group with empty (hence zero at the first step) state, optionally freezing the old ones
  (LLaMA-Pro's recipe);
- :func:`preview_first_step` puts the criterion's first-order prediction of the first step,
  :math:`J(\eta) - J(0) = -\eta \langle b, P(b)\rangle + O(\eta^2)` (``thm-iff``, ``thm-update-invariance``),
  next to the measured change of a real optimizer step from zero state.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from depthsat_theory.capture.probe import call_model, unpack_batch
from depthsat_theory.grow.errors import GrowError
from depthsat_theory.optimizers import ZeroStateUpdate, resolve_update

__all__ = ["FirstStepPreview", "flat_params", "preview_first_step", "zero_state_param_groups"]


def flat_params(new_params: Mapping[str, Iterable[nn.Parameter]] | Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters of ``{site: [params]}`` (or a plain iterable) as one list without repeats.

    Args:
        new_params: ``{site: [parameters]}`` (e.g. :attr:`Growth.new_params`) or an iterable of parameters.

    Returns:
        The parameters in first-seen order, each once (by identity).
    """
    items = new_params.values() if isinstance(new_params, Mapping) else [new_params]
    out: list[nn.Parameter] = []
    seen: set[int] = set()
    for group in items:
        for p in group:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


#: Scheduler attributes with one entry per parameter group (extended for a new group).
_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas", "min_lrs")


def _check_scheduler(scheduler: Any) -> None:
    subs = getattr(scheduler, "_schedulers", None)
    if subs is not None:
        for sub in subs:
            _check_scheduler(sub)
    elif not hasattr(scheduler, "base_lrs") and not hasattr(scheduler, "min_lrs"):
        raise GrowError(
            f"{type(scheduler).__name__} has no per-group learning rates (base_lrs): not a torch LR scheduler"
        )


def _extend_scheduler(scheduler: Any, like: int, n_old: int, lr: float | None) -> None:
    """Give ``scheduler`` an entry for the new (last) parameter group, copied from group ``like`` (``lr``: its base)."""
    subs = getattr(scheduler, "_schedulers", None)
    if subs is not None:  # SequentialLR, ChainedScheduler
        for sub in subs:
            _extend_scheduler(sub, like, n_old, lr)
    for name in _PER_GROUP:
        vals = getattr(scheduler, name, None)
        if isinstance(vals, list) and len(vals) == n_old:
            vals.append(lr if lr is not None and name in ("base_lrs", "_last_lr") else vals[like])


def zero_state_param_groups(
    optimizer: torch.optim.Optimizer,
    new_params: Mapping[str, Iterable[nn.Parameter]] | Iterable[nn.Parameter],
    *,
    freeze_old: bool = False,
    lr: float | None = None,
    like: int = -1,
    schedulers: Sequence[Any] = (),
) -> dict:
    """Add the new parameters to ``optimizer`` as one group with fresh (zero) state.

    ``torch.optim`` optimizers create a parameter's state (Adam's moments, SGD's momentum
    buffer) as zeros at its first step, so a parameter without state takes the zero-state update
    ``θ₁ = −η P(b)`` (:mod:`depthsat_theory.optimizers`); the old parameters' state is not touched.
    The new group copies every hyperparameter of the existing group ``like`` (its current ``lr``,
    ``initial_lr``, betas, weight decay, ...), and each scheduler in ``schedulers`` (built on this
    optimizer before the call) gets the new group's entries copied from group ``like`` (``base_lrs``,
    ``lr_lambdas``, ...), so it goes on scheduling every group, the new one as group ``like``.

    Args:
        optimizer: an existing optimizer (its groups and state are kept).
        new_params: ``{site: [params]}`` (:attr:`Growth.new_params`, :attr:`Expansion.new_params`) or
            an iterable of parameters.
        freeze_old: set ``requires_grad = False`` on every parameter already in the optimizer
            (they get no gradient, so the optimizer skips them: LLaMA-Pro trains only the new blocks).
        lr: the new group's learning rate (default: group ``like``'s current one); with schedulers,
            it also replaces the copied base learning rate.
        like: the index of the existing group whose hyperparameters (and schedule) the new group copies.
        schedulers: LR schedulers already built on ``optimizer`` (``LambdaLR``, ``CosineAnnealingLR``,
            ``SequentialLR``, ``ReduceLROnPlateau``, ...), extended in place.

    Returns:
        The new parameter group (a dict, as in ``optimizer.param_groups``).

    Raises:
        GrowError: no new parameters, a parameter already in the optimizer, a new parameter that
            already has optimizer state, ``like`` outside the groups, or a scheduler without
            per-group learning rates.
    """
    params = flat_params(new_params)
    if not params:
        raise GrowError("new_params is empty: nothing to add to the optimizer")
    old = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if any(id(p) in old for p in params):
        raise GrowError("a new parameter is already in the optimizer; pass only the grown blocks' parameters")
    if any(p in optimizer.state and len(optimizer.state[p]) for p in params):
        raise GrowError("a new parameter already has optimizer state; it would not start from zero state")
    n_old = len(optimizer.param_groups)
    if not -n_old <= like < n_old:
        raise GrowError(f"like={like} is not a parameter group index (the optimizer has {n_old} groups)")
    like %= n_old
    for sch in schedulers:
        _check_scheduler(sch)
    if freeze_old:
        for g in optimizer.param_groups:
            for p in g["params"]:
                p.requires_grad_(False)
                p.grad = None
    group: dict[str, Any] = {k: copy.deepcopy(v) for k, v in optimizer.param_groups[like].items() if k != "params"}
    group["params"] = params
    if lr is not None:
        group["lr"] = lr
        if "initial_lr" in group:
            group["initial_lr"] = lr
    optimizer.add_param_group(group)
    for sch in schedulers:
        _extend_scheduler(sch, like, n_old, lr)
    return optimizer.param_groups[-1]


@dataclass(frozen=True)
class FirstStepPreview:
    r"""The predicted and measured change of the probe loss over the first zero-state step.

    Attributes:
        update: the zero-state update's name (``"adam"``, ...).
        lr: the step size :math:`\eta`.
        j0: the mean probe loss :math:`J(0)` before the step (loss units per example).
        predicted_change: :math:`-\eta \langle b, P(b)\rangle` (same units).
        observed_change: :math:`J(\eta) - J(0)` after one real optimizer step from zero state.
        gradient_norm: :math:`\|b\|` over the new parameters.
        ratio: ``observed_change / predicted_change`` (``nan`` when the prediction is 0); it tends
            to 1 as :math:`\eta \to 0` (the two agree to :math:`O(\eta^2)`).
    """

    update: str
    lr: float
    j0: float
    predicted_change: float
    observed_change: float
    gradient_norm: float
    ratio: float

    def to_dict(self) -> dict:
        """JSON-ready dictionary.

        Returns:
            The fields as a ``dict``, ``nan`` floats as ``None``.
        """
        return {k: (None if isinstance(v, float) and v != v else v) for k, v in asdict(self).items()}


def _mean_loss(model: nn.Module, loss_fn: Callable, batch: Any) -> Tensor:
    x, y, _ = unpack_batch(batch)
    return loss_fn(call_model(model, x), y).mean()


def preview_first_step(
    model: nn.Module,
    loss_fn: Callable[[Any, Tensor], Tensor],
    batch: Any,
    new_params: Mapping[str, Iterable[nn.Parameter]] | Iterable[nn.Parameter],
    *,
    update: str | ZeroStateUpdate = "adam",
    lr: float = 1e-4,
) -> FirstStepPreview:
    r"""Predict the first zero-state step's loss change from the criterion and measure it.

    .. math::

        J(\eta) - J(0) = -\eta\,\langle b, P(b)\rangle + O(\eta^2),
        \qquad b = \nabla_\theta J(0),

    with :math:`P` the update's zero-state first-step map (T3, ``thm-update-invariance``).  The measured
    side takes one step of the real optimizer (``update.make_optimizer``) on the new parameters
    only, from zero state, evaluates :math:`J` and restores the parameters.

    Args:
        model: the grown model (in eval mode for a deterministic :math:`J`).
        loss_fn: per-example loss ``loss_fn(output, targets) -> (B,)``.
        batch: ``(inputs, targets)`` or a Hugging Face mapping with ``labels``.
        new_params: the new parameters (:attr:`Growth.new_params`).
        update: a zero-state update name (``"adam"``, ``"sgd"``, ``"momentum"``, …) or instance.
        lr: the step size :math:`\eta > 0`.

    Returns:
        A :class:`FirstStepPreview` (losses in the loss's units per example, e.g. nats).

    Raises:
        GrowError: no new parameters, or ``lr`` not positive.
        ValueError: an unknown update name.
    """
    if not lr > 0:
        raise GrowError(f"lr must be > 0, got {lr}")
    upd = resolve_update(update)
    params = flat_params(new_params)
    if not params:
        raise GrowError("new_params is empty: nothing to step")
    flags = [p.requires_grad for p in params]
    saved = [p.detach().clone() for p in params]
    try:
        for p in params:
            p.requires_grad_(True)
        loss0 = _mean_loss(model, loss_fn, batch)
        grads = torch.autograd.grad(loss0, params, allow_unused=True)
        grads = tuple(torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True))
        b = torch.cat([g.detach().reshape(-1).to(torch.float64) for g in grads])
        predicted = lr * upd.predicted_change_rate(b)
        opt = upd.make_optimizer(params, lr)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.detach().clone()
        opt.step()
        with torch.no_grad():
            loss1 = _mean_loss(model, loss_fn, batch)
    finally:
        with torch.no_grad():
            for p, s, f in zip(params, saved, flags, strict=True):
                p.copy_(s)
                p.grad = None
                p.requires_grad_(f)
    j0, j1 = float(loss0.detach()), float(loss1)
    observed = j1 - j0
    return FirstStepPreview(
        update=upd.name,
        lr=float(lr),
        j0=j0,
        predicted_change=predicted,
        observed_change=observed,
        gradient_norm=float(b.norm()),
        ratio=observed / predicted if predicted != 0 else float("nan"),
    )
