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

The bias ``−‖m̂ − m‖²`` is never positive: ``r̂²`` runs **low** whenever the regression has not
converged (in wide sites at realistic ``n`` it can be far low: the ``k``-NN rate is
``n^{−2/(d+2)}``).  So only one-sided statements are honest without a rate assumption
(``cor-crossfit-interval``): ``r̂² − z SE`` is an asymptotic lower confidence bound for ``r²``
(the bias only makes it more conservative), and ``r² ≤ E‖g‖² = AG_rms²`` (Jensen) gives the upper
end; ``ρ`` gets the interval these imply with the interval of ``s²``.  The point estimates are
reported as lower-biased.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import torch

__all__ = ["CrossFitRealizability", "crossfit_realizability", "knn_regression", "local_linear_regression"]


@dataclass(frozen=True)
class CrossFitRealizability:
    """Cross-fitted estimates of ``r²``, ``r`` and ``ρ`` (per example, units of ``g``).

    Attributes:
        raw_score_squared: ``r̂²`` (can be negative by sampling error when ``m ≈ 0``).
        raw_score: ``sqrt(max(r̂², 0))``.
        realizability_defect: ``ρ̂ = sqrt(max(0, 1 − s²/r̂²))`` (``nan`` when ``r̂² ≤ 0`` or ``s²`` not given).
        standard_error: plug-in standard error of ``r̂²`` (the per-unit terms' spread over ``sqrt(n)``);
            it measures sampling noise only, not the (negative) bias ``−‖m̂ − m‖²``.
        neighbours: ``k`` used; n: units used.
        raw_score_squared_interval: ``(lower, upper)``, an asymptotic ``1 − α`` interval for ``r²``
            valid whatever the regression error (``cor-crossfit-interval``): ``r̂² − z SE`` (the bias
            is ``≤ 0``) and ``AG_rms² + z SE`` (``r² ≤ E‖g‖²``), ``z`` the ``1 − α/2`` normal quantile
            (``α/2`` per end; ``α/4`` per end when ``ρ``'s interval also uses ``s²``'s).
        realizability_defect_interval: ``(lower, upper)`` for ``ρ`` from the intervals of ``r²`` and
            ``s²`` (``nan`` without ``score_squared_se``).
        alpha: ``α`` of the intervals.
    """

    raw_score_squared: float
    raw_score: float
    realizability_defect: float
    standard_error: float
    neighbours: int
    n: int
    raw_score_squared_interval: tuple[float, float] = (float("nan"), float("nan"))
    realizability_defect_interval: tuple[float, float] = (float("nan"), float("nan"))
    alpha: float = 0.05

    def to_dict(self) -> dict:
        """JSON-ready dictionary (``nan`` as ``None``), keys suffixed ``_crossfit``.

        Returns:
            ``{"<field>_crossfit": value}`` (tuples as lists) plus ``note_crossfit``.
        """
        out: dict = {}
        for k, v in self.__dict__.items():
            if isinstance(v, tuple):
                v = [None if not math.isfinite(x) else x for x in v]
            elif isinstance(v, float) and not math.isfinite(v):
                v = None
            out[f"{k}_crossfit"] = v
        out["note_crossfit"] = (
            "r̂² and ρ̂ run low by the regression error ‖m̂ − m‖² (never high); the intervals hold regardless"
        )
        return out


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


def local_linear_regression(
    train_u: np.ndarray, train_g: np.ndarray, query: np.ndarray, k: int, *, ridge: float = 1e-8
) -> np.ndarray:
    """Local-linear fit of ``train_g`` on the ``k`` nearest training units of each query, at the query.

    For each query ``q``, least squares of ``g`` on ``(1, u − q)`` over its ``k`` nearest units (a
    relative ridge ``ridge · tr(XᵀX)/(d+1)`` keeps the solve defined); the prediction is the
    intercept.  Its smoothing bias is second order in the neighbourhood radius (first order for
    :func:`knn_regression`), which is what makes the cross-fitted ``r̂²`` much less low at moderate
    ``d`` (``cor-crossfit-interval``).

    Args:
        train_u: ``(n, d)`` units.
        train_g: ``(n, e)`` responses.
        query: ``(m, d)`` units to predict at.
        k: neighbours, ``d + 2 ≤ k ≤ n``.
        ridge: relative ridge, ``≥ 0``.

    Returns:
        ``(m, e)`` float64 predictions.
    """
    tu = torch.from_numpy(np.ascontiguousarray(train_u, dtype=np.float64))
    tg = torch.from_numpy(np.ascontiguousarray(train_g, dtype=np.float64))
    d = tu.shape[1]
    out = []
    for start in range(0, query.shape[0], 256):
        q = torch.from_numpy(np.ascontiguousarray(query[start : start + 256], dtype=np.float64))
        idx = torch.cdist(q, tu).topk(k, largest=False).indices
        x = torch.cat([torch.ones(q.shape[0], k, 1, dtype=tu.dtype), tu[idx] - q[:, None, :]], dim=-1)
        xtx = x.transpose(1, 2) @ x
        scale = torch.diagonal(xtx, dim1=1, dim2=2).sum(-1) / (d + 1)
        xtx = xtx + ridge * scale[:, None, None] * torch.eye(d + 1, dtype=tu.dtype)
        coef = torch.linalg.solve(xtx, x.transpose(1, 2) @ tg[idx])
        out.append(coef[:, 0, :])
    return torch.cat(out).numpy()


def crossfit_realizability(
    u: np.ndarray,
    g: np.ndarray,
    *,
    score_squared: float | None = None,
    neighbours: int | None = None,
    seed: int = 0,
    score_squared_se: float | None = None,
    alpha: float = 0.05,
    regression: str = "knn",
) -> CrossFitRealizability:
    """Cross-fitted ``k``-NN estimate of ``r²`` and ``ρ`` from units and activation gradients.

    Args:
        u: ``(n, d)`` units (rows of the site tensor; one example per row for vector sites).
        g: ``(n, e)`` activation gradients of the same rows.
        score_squared: ``s²`` of the family (preferably the U-statistic ``score_squared_unbiased``)
            for ``ρ̂``; ``None``: ``ρ̂`` is ``nan``.
        neighbours: ``k`` (default ``⌈sqrt(n/2)⌉`` for ``knn``, four times that (at least ``d + 2``)
            for ``local-linear``: ``k → ∞``, ``k/n → 0``, the consistency regime).
        seed: seed of the random split into two folds.
        score_squared_se: standard error of ``score_squared`` (``score_squared_se`` of the result):
            with it, an interval for ``ρ`` too.
        alpha: the intervals' level ``1 − α`` (asymptotic, normal quantiles), ``0 < α < 1``.
        regression: ``"knn"`` (:func:`knn_regression`) or ``"local-linear"``
            (:func:`local_linear_regression`: much less bias at moderate ``d``, ``d + 2`` neighbours at
            least, cost ``O(k d²)`` per unit).

    Returns:
        A :class:`CrossFitRealizability`.

    Raises:
        ValueError: fewer than 4 rows, mismatched row counts, non-finite values, a bad ``k`` or ``α``.
    """
    u, g = _check_rows(u, g, alpha, regression)
    n = u.shape[0]
    perm = np.random.default_rng(seed).permutation(n)
    folds = (perm[: n // 2], perm[n // 2 :])
    k = _neighbours(neighbours, n, u.shape[1], regression)
    fit_fn = local_linear_regression if regression == "local-linear" else knn_regression
    terms = np.empty(n)
    for fit, ev in (folds, folds[::-1]):
        pred = fit_fn(u[fit], g[fit], u[ev], k)
        terms[ev] = 2 * np.einsum("ij,ij->i", g[ev], pred) - np.einsum("ij,ij->i", pred, pred)
    r2 = float(terms.mean())
    se = float(terms.std(ddof=1) / math.sqrt(n))
    rho = float("nan")
    if score_squared is not None and r2 > 0:
        rho = math.sqrt(max(0.0, 1.0 - max(float(score_squared), 0.0) / r2))
    r2_int, rho_int = _intervals(r2, se, g, score_squared, score_squared_se, alpha)
    return CrossFitRealizability(r2, math.sqrt(max(r2, 0.0)), rho, se, k, n, r2_int, rho_int, alpha)


def _check_rows(u, g, alpha: float, regression: str) -> tuple[np.ndarray, np.ndarray]:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if regression not in ("knn", "local-linear"):
        raise ValueError(f"regression must be 'knn' or 'local-linear', got {regression!r}")
    u, g = np.asarray(u, dtype=np.float64), np.asarray(g, dtype=np.float64)
    if u.ndim != 2 or g.ndim != 2 or u.shape[0] != g.shape[0] or u.shape[0] < 4:
        raise ValueError(f"u and g must be (n, d) and (n, e) with the same n >= 4, got {u.shape} and {g.shape}")
    if not (np.isfinite(u).all() and np.isfinite(g).all()):
        raise ValueError("u or g has NaN/Inf values")
    return u, g


def _neighbours(neighbours: int | None, n: int, d: int, regression: str) -> int:
    local = regression == "local-linear"
    k = math.ceil(math.sqrt(n / 2))
    k = int(neighbours) if neighbours is not None else (min(max(4 * k, d + 2), n // 2) if local else k)
    low = d + 2 if local else 1
    if not low <= k <= n // 2:
        raise ValueError(f"neighbours must be in [{low}, {n // 2}] (half the probe) for {regression}, got {k}")
    return k


def _intervals(
    r2: float, se: float, g: np.ndarray, score_squared: float | None, score_squared_se: float | None, alpha: float
) -> tuple[tuple[float, float], tuple[float, float]]:
    """The ``cor-crossfit-interval`` intervals of ``r²`` and ``ρ`` (``ρ``'s ``nan`` without ``s²``'s SE)."""
    with_rho = score_squared is not None and score_squared_se is not None
    z = float(NormalDist().inv_cdf(1 - alpha / (4 if with_rho else 2)))
    g2 = np.einsum("ij,ij->i", g, g)
    r2_lo = r2 - z * se
    r2_hi = float(g2.mean() + z * g2.std(ddof=1) / math.sqrt(g.shape[0]))
    if score_squared is None or score_squared_se is None:
        return (r2_lo, r2_hi), (float("nan"), float("nan"))
    s2_lo = max(float(score_squared) - z * float(score_squared_se), 0.0)
    s2_hi = float(score_squared) + z * float(score_squared_se)
    lo = math.sqrt(max(0.0, 1.0 - s2_hi / r2_lo)) if r2_lo > 0 else 0.0
    hi = math.sqrt(max(0.0, 1.0 - s2_lo / r2_hi)) if r2_hi > 0 else 1.0
    return (r2_lo, r2_hi), (lo, hi)
