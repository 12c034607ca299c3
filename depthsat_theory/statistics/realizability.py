r"""A consistent estimator of ``r = ‖m‖`` and ``ρ`` for continuous units (theory/raw-score.md).

Pooling exactly equal units (``TiePool``) estimates ``m = E[g | u]`` only on discrete populations;
for continuous units every unit is its own pool and ``r̂ → AG_rms``.  Here ``m`` is estimated by
``k``-nearest-neighbour regression of ``g`` on the unit, *cross-fitted* over two folds, and ``r²``
by the orthogonalised moment (``thm-crossfit-raw-score``)

.. math::

    \widehat{r^2} = \frac1n \sum_i \big(2\langle g_i, \hat m_{-i}(u_i)\rangle
    - \lVert\hat m_{-i}(u_i)\rVert^2\big),

(``m̂_{−i}`` fitted on the other fold), whose bias is ``−‖m̂ − m‖²``: second order in the regression
error.  With ``s²`` from the unbiased U-statistic, ``ρ̂² = max(0, 1 − ŝ²_U / r̂²)`` (Pythagoras,
``Πm = Πg`` under ``asm-unit-tangent``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["CrossFitRealizability", "crossfit_realizability", "knn_regression"]


@dataclass(frozen=True)
class CrossFitRealizability:
    """Cross-fitted estimates of ``r²``, ``r`` and ``ρ`` (per example, units of ``g``).

    Attributes:
        raw_score_squared: ``r̂²`` (can be negative by sampling error when ``m ≈ 0``).
        raw_score: ``sqrt(max(r̂², 0))``.
        realizability_defect: ``ρ̂ = sqrt(max(0, 1 − s²/r̂²))`` (``nan`` when ``r̂² ≤ 0`` or ``s²`` not given).
        standard_error: plug-in standard error of ``r̂²`` (the per-unit terms' spread over ``sqrt(n)``).
        neighbours: ``k`` used; n: units used.
    """

    raw_score_squared: float
    raw_score: float
    realizability_defect: float
    standard_error: float
    neighbours: int
    n: int

    def to_dict(self) -> dict:
        """JSON-ready dictionary (``nan`` as ``None``), keys suffixed ``_crossfit``."""
        return {
            f"{k}_crossfit": (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in self.__dict__.items()
        }


def knn_regression(train_u: np.ndarray, train_g: np.ndarray, query: np.ndarray, k: int) -> np.ndarray:
    """Mean of ``train_g`` over the ``k`` nearest training units of each query (Euclidean), float64.

    Args:
        train_u: ``(n, d)`` units.
        train_g: ``(n, e)`` responses.
        query: ``(m, d)`` units to predict at.
        k: neighbours, ``1 ≤ k ≤ n``.

    Returns:
        ``(m, e)`` predictions.
    """
    tu = torch.from_numpy(np.ascontiguousarray(train_u, dtype=np.float64))
    tg = torch.from_numpy(np.ascontiguousarray(train_g, dtype=np.float64))
    out = []
    for start in range(0, query.shape[0], 1024):
        q = torch.from_numpy(np.ascontiguousarray(query[start : start + 1024], dtype=np.float64))
        idx = torch.cdist(q, tu).topk(k, largest=False).indices
        out.append(tg[idx].mean(dim=1))
    return torch.cat(out).numpy()


def crossfit_realizability(
    u: np.ndarray,
    g: np.ndarray,
    *,
    score_squared: float | None = None,
    neighbours: int | None = None,
    seed: int = 0,
) -> CrossFitRealizability:
    """Cross-fitted ``k``-NN estimate of ``r²`` and ``ρ`` from units and activation gradients.

    Args:
        u: ``(n, d)`` units (rows of the site tensor; one example per row for vector sites).
        g: ``(n, e)`` activation gradients of the same rows.
        score_squared: ``s²`` of the family (preferably the U-statistic ``score_squared_unbiased``)
            for ``ρ̂``; ``None``: ``ρ̂`` is ``nan``.
        neighbours: ``k`` (default ``⌈sqrt(n/2)⌉``: ``k → ∞``, ``k/n → 0``, the consistency regime).
        seed: seed of the random split into two folds.

    Returns:
        A :class:`CrossFitRealizability`.

    Raises:
        ValueError: fewer than 4 rows, mismatched row counts, non-finite values or a bad ``k``.
    """
    u, g = np.asarray(u, dtype=np.float64), np.asarray(g, dtype=np.float64)
    if u.ndim != 2 or g.ndim != 2 or u.shape[0] != g.shape[0] or u.shape[0] < 4:
        raise ValueError(f"u and g must be (n, d) and (n, e) with the same n >= 4, got {u.shape} and {g.shape}")
    if not (np.isfinite(u).all() and np.isfinite(g).all()):
        raise ValueError("u or g has NaN/Inf values")
    n = u.shape[0]
    perm = np.random.default_rng(seed).permutation(n)
    folds = (perm[: n // 2], perm[n // 2 :])
    k = int(neighbours) if neighbours is not None else math.ceil(math.sqrt(n / 2))
    if not 1 <= k <= n // 2:
        raise ValueError(f"neighbours must be in [1, {n // 2}] (half the probe), got {k}")
    terms = np.empty(n)
    for fit, ev in (folds, folds[::-1]):
        pred = knn_regression(u[fit], g[fit], u[ev], k)
        terms[ev] = 2 * np.einsum("ij,ij->i", g[ev], pred) - np.einsum("ij,ij->i", pred, pred)
    r2 = float(terms.mean())
    se = float(terms.std(ddof=1) / math.sqrt(n))
    rho = float("nan")
    if score_squared is not None and r2 > 0:
        rho = math.sqrt(max(0.0, 1.0 - max(float(score_squared), 0.0) / r2))
    return CrossFitRealizability(r2, math.sqrt(max(r2, 0.0)), rho, se, k, n)
