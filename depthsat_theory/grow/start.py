r"""Start a zero-output block where the criterion points, with a line search (``init="first-order"``).

The steepest first-order move of a new zero-output block is the field
:math:`-t\,\Pi g/\lVert\Pi g\rVert` (``rem-first-order-start``): :math:`\Pi g` is the projection
of the activation gradient on the block family's tangent space, in weights
:math:`\Pi g = G\Sigma^+\tilde\varphi` (``thm-cross-gradient``), the least-squares fit of ``g`` by
the block's features.  :func:`first_order_start` reads ``G`` and ``Σ`` of each new block with the
engine (:func:`~depthsat_theory.grow.copyscore.zeroed_statistics`, the same streamed statistics and
resolved spectrum as the score), sets its zeroed maps to

.. math::

    \tilde W(t) = -\,t\,G\Sigma^{+}/\lVert\Pi g\rVert,

(the field of size ``t``, first-order loss change ``−t‖Πg‖``), and chooses ``t`` by a line search
on a held-out batch among ``0`` and a geometric grid.  ``t = 0`` is the zero-output block itself,
so the start is function-preserving whenever no grid point lowers the held-out loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from depthsat_theory.capture.probe import call_model, unpack_batch
from depthsat_theory.grow.errors import GrowError

__all__ = ["FirstOrderStart", "first_order_start"]


@dataclass
class FirstOrderStart:
    """The outcome of :func:`first_order_start` (loss units per example, as the loss function's).

    Attributes:
        step: the chosen ``t``, the size of the field in the probe's norm (``0``: the blocks stayed at zero output).
        projected_norm: ``‖Πg‖ = (Σ_blocks s²)^{1/2}`` on the gradient batch (the first-order decrease per unit ``t``).
        held_out_loss: the held-out loss at the chosen ``t``.
        searched: ``(t, held-out loss)`` of every point tried, ``t = 0`` first.
    """

    step: float
    projected_norm: float
    held_out_loss: float
    searched: list[tuple[float, float]] = field(default_factory=list)


def _mean(model: nn.Module, loss_fn: Callable, batch: Any) -> torch.Tensor:
    x, y, _ = unpack_batch(batch)
    return loss_fn(call_model(model, x), y).mean()


def _unit_steps(model: nn.Module, zeroed: Mapping[str, Sequence[str]], stats: Mapping, gated) -> tuple[list, float]:
    """``[(parameter, its share of −GΣ⁺/‖Πg‖)]`` over every block, and ``‖Πg‖``."""
    from depthsat_theory.grow.copyscore import zeroed_maps

    steps, s2 = [], 0.0
    for site, st in stats.items():
        big_g = st.cross_gradient()[: st.family.d0]
        spec = st.spectrum()
        coef = torch.from_numpy(big_g @ spec.pinv())  # Πg = G Σ⁺ φ̃: the engine's resolved Σ⁺
        s2 += float(np.sum(coef.numpy() * big_g))  # s² = tr(G Σ⁺ Gᵀ)
        maps, _ = zeroed_maps(model, site, zeroed[site], gated)
        col = 0
        for m in maps:
            if m.weight is not None:
                steps.append((m.weight, m.unblock(coef[:, col : col + m.width])))
                col += m.width
        first_bias = True
        for m in maps:
            if "bias" in m.params:  # the constant column once; the other zeroed biases stay at 0
                steps.append((m.params["bias"], coef[:, -1] if first_bias else torch.zeros_like(coef[:, -1])))
                first_bias = False
    return steps, float(np.sqrt(s2))


def first_order_start(
    model: nn.Module,
    zeroed: Mapping[str, Sequence[str]],
    loss_fn: Callable,
    batch: Any,
    held_out: Any,
    *,
    grid: Sequence[float] | None = None,
    gated: Sequence[tuple[str, str]] = (),
) -> FirstOrderStart:
    r"""Move the new blocks' zeroed maps to ``−t GΣ⁺/‖Πg‖`` with ``t`` from a held-out line search.

    Args:
        model: the grown model, its new blocks at zero output (changed in place).
        zeroed: ``{block module name: its zeroed parameter names}`` (``Expansion.zeroed``): each block is a
            module whose output is the residual stream after it, its zeroed maps row-wise linear maps or
            fused experts' down projections (:func:`~depthsat_theory.grow.copyscore.zeroed_statistics`).
        loss_fn: per-example loss ``loss_fn(output, targets) -> (B,)``.
        batch: the batch of ``G`` and ``Σ``.
        held_out: the batch on which ``t`` is chosen (a different one: the step is not fitted to ``batch``).
        grid: the step sizes ``t`` tried besides ``0`` (the field's size in the probe's norm); default
            ``2^-k``, ``k = 0..11``.
        gated: ``(projection, gate)`` module names relative to a block (``Architecture.gated``).

    Returns:
        A :class:`FirstOrderStart`; the model holds the chosen start.

    Raises:
        GrowError: an unknown or non-zero parameter in ``zeroed``, maps that are not a feature family
            (:func:`~depthsat_theory.grow.copyscore.zeroed_statistics`), or ``Πg = 0`` (no first-order
            direction; the blocks are left at zero).

    Source: ``rem-first-order-start`` (theory/zero-output.md), ``thm-cross-gradient``; the line search is
    GroMo's (Verbockhaven et al., 2024) step choice.
    """
    from depthsat_theory.grow.copyscore import zeroed_statistics

    params = dict(model.named_parameters())
    missing = [n for ns in zeroed.values() for n in ns if n not in params]
    if missing:
        raise GrowError(f"zeroed parameter {missing[0]!r} is not a parameter of the model")
    if any(bool(params[n].detach().any()) for ns in zeroed.values() for n in ns):
        raise GrowError("the zeroed parameters are not zero: first_order_start starts from the zero-output block")
    stats = zeroed_statistics(model, zeroed, loss_fn, [batch], gated=gated)
    steps, norm = _unit_steps(model, zeroed, stats, gated)
    if not norm > 0:
        raise GrowError(
            "the activation gradient has no projection on the blocks' tangent space (Πg = 0): no "
            "first-order direction to start in"
        )
    if grid is None:
        grid = [2.0**-k for k in range(12)]

    def held(t: float) -> float:
        with torch.no_grad():
            for p, v in steps:
                p.copy_((-t / norm) * v.to(p.dtype) if t else torch.zeros_like(p))
            return float(_mean(model, loss_fn, held_out))

    searched = [(0.0, held(0.0))]
    searched += [(float(t), held(float(t))) for t in grid]
    best_t, best = min(searched, key=lambda r: (r[1], r[0]))
    held(best_t)
    return FirstOrderStart(best_t, norm, best, searched)
