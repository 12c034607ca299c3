"""Seed 002's optimal stopping depth: the oracle and a causal threshold policy, as functions of the cost.

The forward pass as a stopping problem (seed 002, Qi, arXiv 2506.16862): after ``l`` blocks one
either halts and predicts from ``z_l`` (paying the exit loss ``ℓ_l(x)``) or runs one more block
at a cost ``c`` per block (in the loss's units: nats per example, or per token).  The total cost
of stopping at ``τ`` is ``ℓ_τ(x) + c·τ``.

* The **oracle** stopping depth ``τ*_c(x) = argmin_l ℓ_l(x) + c·l`` (smallest ``l`` on ties) sees
  every exit's loss, targets included: a lower bound on what any policy can pay, and the quantity
  whose expectation seed 002 proves finite under diminishing returns.
* The **threshold policy** is causal (it uses only what is known at depth ``l``, no target): stop at
  the first ``l`` whose exit's confidence (largest softmax probability) is at least ``τ``, else at
  ``L``; ``τ`` is tuned per cost on a validation split to minimise the mean of ``ℓ_stop + c·stop``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "StoppingSummary",
    "oracle_stopping_depth",
    "stopping_summary",
    "threshold_stopping_depth",
    "tune_threshold",
]


def _check_cost(c: float) -> float:
    c = float(c)
    if not math.isfinite(c) or c < 0:
        raise ValueError(f"the cost per block must be a finite number >= 0, got {c}")
    return c


def _check_table(a: np.ndarray, name: str) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] < 1:
        raise ValueError(f"{name} must be a (L+1, n) table with L+1 >= 1 depths and n >= 1 rows, got {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name}: non-finite entry")
    return a


def oracle_stopping_depth(losses: np.ndarray, c: float) -> np.ndarray:
    """The oracle stopping depth ``argmin_l ℓ_l(x) + c·l`` of every row (first minimum on ties).

    Args:
        losses: float ``(L+1, n)`` exit losses (``ℓ_l`` of row ``i`` at ``[l, i]``).
        c: cost per block, ``>= 0``, in the losses' units.

    Returns:
        int64 ``(n,)`` depths in ``0 … L``.

    Raises:
        ValueError: a table that is not ``(L+1, n)`` with finite entries, or a negative/non-finite cost.
    """
    a = _check_table(losses, "losses")
    c = _check_cost(c)
    return np.argmin(a + c * np.arange(a.shape[0])[:, None], axis=0).astype(np.int64)


def threshold_stopping_depth(confidence: np.ndarray, tau: float) -> np.ndarray:
    """The first depth whose exit confidence is at least ``tau`` (``L`` if none is).

    Args:
        confidence: float ``(L+1, n)`` exit confidences.
        tau: the threshold (``inf``: always run every block).

    Returns:
        int64 ``(n,)`` depths in ``0 … L``.

    Raises:
        ValueError: a bad table, or ``tau`` NaN.
    """
    a = _check_table(confidence, "confidence")
    if math.isnan(tau):
        raise ValueError("tau is NaN")
    hit = a >= tau
    hit[-1] = True
    return np.argmax(hit, axis=0).astype(np.int64)


def _cost(losses: np.ndarray, depths: np.ndarray, c: float) -> float:
    return float(losses[depths, np.arange(losses.shape[1])].mean() + c * depths.mean())


def tune_threshold(losses: np.ndarray, confidence: np.ndarray, c: float, grid: Sequence[float] | None = None) -> float:
    """The confidence threshold minimising the mean ``ℓ_stop + c·stop`` on a (validation) table.

    Args:
        losses: ``(L+1, n)`` exit losses of one split.
        confidence: ``(L+1, n)`` exit confidences of the same split.
        c: cost per block.
        grid: candidate thresholds (default: every distinct confidence of the table when it has at
            most 2,000 entries, else its 0, 0.5, …, 100 % quantiles; and ``inf``).
            Ties go to the largest threshold (the deeper, more conservative policy).

    Returns:
        The best threshold (``inf`` means "never stop early").

    Raises:
        ValueError: tables of different shapes, bad tables or cost.
    """
    a = _check_table(losses, "losses")
    p = _check_table(confidence, "confidence")
    if a.shape != p.shape:
        raise ValueError(f"losses {a.shape} and confidence {p.shape} differ in shape")
    c = _check_cost(c)
    if grid is None:
        vals = p.ravel() if p.size <= 2000 else np.quantile(p, np.linspace(0.0, 1.0, 201))
        cands = sorted(set(np.unique(vals).tolist()) | {math.inf})
    else:
        cands = sorted(set(map(float, grid)))
    if not cands:
        raise ValueError("grid: give at least one threshold")
    best, best_tau = math.inf, cands[-1]
    for tau in reversed(cands):
        v = _cost(a, threshold_stopping_depth(p, tau), c)
        if v < best - 1e-15:
            best, best_tau = v, tau
    return float(best_tau)


@dataclass
class StoppingSummary:
    """One policy at one cost on one split.

    Attributes:
        policy: ``"oracle"`` or ``"threshold"``.
        cost: ``c``, per block, in the loss's units.
        expected_depth: mean stopping depth (blocks executed); ``std_depth`` its spread over rows.
        loss_at_stop: mean exit loss at the stopping depth; ``accuracy_at_stop``: its accuracy.
        risk: ``loss_at_stop + c·expected_depth``.
        histogram: rows stopping at each depth ``0 … L``.
        tau: the threshold (threshold policy; ``None`` for the oracle).
    """

    policy: str
    cost: float
    expected_depth: float
    std_depth: float
    loss_at_stop: float
    accuracy_at_stop: float
    risk: float
    histogram: list[int] = field(default_factory=list)
    tau: float | None = None


def stopping_summary(test, costs: Sequence[float], val=None) -> list[StoppingSummary]:
    """Oracle and threshold stopping on ``test`` for every cost (threshold tuned on ``val``).

    Args:
        test: an :class:`~depthsat_theory.views.exits.ExitTable` (reported split).
        costs: costs per block.
        val: the :class:`~depthsat_theory.views.exits.ExitTable` the threshold is tuned on (default:
            no threshold policy).

    Returns:
        ``[oracle at c₁, threshold at c₁, oracle at c₂, …]``.

    Raises:
        ValueError: tables of different depth, bad costs.
    """
    if val is not None and val.losses.shape[0] != test.losses.shape[0]:
        raise ValueError(f"val has {val.losses.shape[0]} depths, test {test.losses.shape[0]}")
    out = []
    n, L1 = test.losses.shape[1], test.losses.shape[0]
    for c in costs:
        policies: list[tuple[str, np.ndarray, float | None]] = [("oracle", oracle_stopping_depth(test.losses, c), None)]
        if val is not None:
            tau = tune_threshold(val.losses, val.confidence, c)
            policies.append(("threshold", threshold_stopping_depth(test.confidence, tau), tau))
        for name, d, thr in policies:
            idx = np.arange(n)
            out.append(
                StoppingSummary(
                    policy=name,
                    cost=float(c),
                    expected_depth=float(d.mean()),
                    std_depth=float(d.std()),
                    loss_at_stop=float(test.losses[d, idx].mean()),
                    accuracy_at_stop=float(test.correct[d, idx].mean()),
                    risk=_cost(test.losses, d, float(c)),
                    histogram=np.bincount(d, minlength=L1).tolist(),
                    tau=thr,
                )
            )
    return out
