r"""Start a zero-output block where the criterion points, with a line search (``init="first-order"``).

At the origin the gradient of the mean loss in the block's zeroed coordinates is the criterion's
``b = E[g φᵀ]`` (T1).  :func:`first_order_start` moves those coordinates to

.. math::

    \theta(t) = -\,t\,b/\lVert b\rVert,

the steepest-descent direction of the zeroed coordinates (a zero-state SGD step's direction; the
first-order loss change is :math:`-t\lVert b\rVert`), with ``t`` chosen by a line search on a
held-out batch among ``0`` and a geometric grid.  ``t = 0`` is the zero-output block itself, so
the start is function-preserving whenever no grid point lowers the held-out loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from depthsat_theory.capture.probe import call_model, unpack_batch
from depthsat_theory.grow.errors import GrowError

__all__ = ["FirstOrderStart", "first_order_start"]


@dataclass
class FirstOrderStart:
    """The outcome of :func:`first_order_start` (loss units per example, as the loss function's).

    Attributes:
        step: the chosen ``t`` (``0``: the block stayed at zero output).
        gradient_norm: ``‖b‖`` on the gradient batch.
        held_out_loss: the held-out loss at the chosen ``t``.
        searched: ``(t, held-out loss)`` of every point tried, ``t = 0`` first.
    """

    step: float
    gradient_norm: float
    held_out_loss: float
    searched: list[tuple[float, float]] = field(default_factory=list)


def _mean(model: nn.Module, loss_fn: Callable, batch: Any) -> torch.Tensor:
    x, y, _ = unpack_batch(batch)
    return loss_fn(call_model(model, x), y).mean()


def first_order_start(
    model: nn.Module,
    zeroed: Sequence[str],
    loss_fn: Callable,
    batch: Any,
    held_out: Any,
    *,
    grid: Sequence[float] | None = None,
) -> FirstOrderStart:
    r"""Move the zeroed parameters to ``−t b/‖b‖`` with ``t`` from a held-out line search.

    Args:
        model: the grown model, its new blocks at zero output (changed in place).
        zeroed: names of the zeroed parameters (``Expansion.zeroed`` values, flattened).
        loss_fn: per-example loss ``loss_fn(output, targets) -> (B,)``.
        batch: the batch whose mean loss gives ``b``.
        held_out: the batch on which ``t`` is chosen (a different one: the step is not fitted to ``batch``).
        grid: the step sizes ``t`` tried besides ``0`` (``‖θ(t)‖ = t``); default ``2^-k``, ``k = 0..11``.

    Returns:
        A :class:`FirstOrderStart`; the model holds the chosen start.

    Raises:
        GrowError: an unknown or non-zero parameter in ``zeroed``, or a zero gradient (``b = 0``: no
            first-order direction; the block is left at zero).

    Source: T1 (``thm-gradient``); the line search is GroMo's (Verbockhaven et al., 2024) step choice.
    """
    params = dict(model.named_parameters())
    missing = [n for n in zeroed if n not in params]
    if missing:
        raise GrowError(f"zeroed parameter {missing[0]!r} is not a parameter of the model")
    theta = [params[n] for n in zeroed]
    if any(bool(p.detach().any()) for p in theta):
        raise GrowError("the zeroed parameters are not zero: first_order_start starts from the zero-output block")
    b = torch.autograd.grad(_mean(model, loss_fn, batch), theta, allow_unused=True)
    b = tuple(torch.zeros_like(p) if g is None else g for p, g in zip(theta, b, strict=True))
    norm = float(torch.sqrt(torch.stack([(g.double() ** 2).sum() for g in b]).sum()))
    if not norm > 0:
        raise GrowError("the gradient in the zeroed coordinates is zero: no first-order direction to start in")
    if grid is None:
        grid = [2.0**-k for k in range(12)]

    def held(t: float) -> float:
        with torch.no_grad():
            for p, g in zip(theta, b, strict=True):
                p.copy_(-t * g / norm)
            return float(_mean(model, loss_fn, held_out))

    searched = [(0.0, held(0.0))]
    searched += [(float(t), held(float(t))) for t in grid]
    best_t, best = min(searched, key=lambda r: (r[1], r[0]))
    held(best_t)
    return FirstOrderStart(best_t, norm, best, searched)
