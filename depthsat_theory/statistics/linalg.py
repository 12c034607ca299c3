"""Rank cutoffs, saturation tolerances and the pseudo-inverse quadratic form behind ``s² = bᵀK⁺b``."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["GRAM_FACTOR", "TOL_FACTOR", "default_rtol", "default_tol", "pinv_quadratic"]


#: Safety factor of the saturation threshold ``tol = TOL_FACTOR · eps(dtype) · AG_rms``.
TOL_FACTOR = 1.0e3


#: Float64 Gram arithmetic loses ``~ k · eps64 / λ_rel`` of a direction's relative accuracy;
#: directions are kept while that loss stays below ``1 / GRAM_FACTOR``.
GRAM_FACTOR = 1.0e3


def default_rtol(dtype: torch.dtype, k: int) -> float:
    r"""Relative eigenvalue cutoff for the *scaled* Gram ``D^{-1/2} Σ D^{-1/2}`` (or ``K``).

    .. math::

        \mathrm{rtol} = k \cdot \max(\varepsilon_{\text{forward}},\;
                          \mathrm{GRAM\_FACTOR} \cdot \varepsilon_{64}).

    Two rounding sources bound what a Gram matrix can resolve: the features were
    computed in the forward pass's dtype (relative error ``ε_forward``; the numpy
    ``matrix_rank`` convention ``k · ε``), and the float64 eigensolve of a
    Gram matrix (which squares condition numbers) determines an eigendirection of
    relative eigenvalue ``λ_rel`` only to ``~ k ε64 / λ_rel``.  For float32 inputs at
    ``k = 65`` this gives ``≈ 8e-6``, for float64 ``≈ 1.4e-11``.  The Gram is first
    scaled to unit diagonal (``D = diag Σ``), so the cutoff does not depend on the
    units of individual features and ``T`` is unchanged (T4).  Eigenvalues
    ``λ ≤ rtol · λ_max`` are treated as zero.

    The cutoff stays at rounding level on purpose: dropping a real direction can only
    *lower* ``s`` and so could turn an improvable site into a false "saturated".
    """
    eps = max(torch.finfo(dtype).eps, GRAM_FACTOR * torch.finfo(torch.float64).eps)
    return max(int(k), 1) * eps


def default_tol(dtype: torch.dtype, ag_rms: float) -> float:
    """Saturation threshold ``tol = TOL_FACTOR · eps(dtype) · AG_rms`` (nats per example per unit step).

    Rounding analysis: the orthogonal projector is a contraction, so a perturbation
    ``δg`` of the activation gradient changes ``s`` by at most ``‖δg‖``.  Forward and
    backward passes in ``dtype`` perturb ``g`` by a relative ``O(L κ eps)`` (``L`` the
    depth, ``κ`` a conditioning factor); ``TOL_FACTOR = 1e3`` covers ``L κ`` up to
    ``10³``.  ``s ≤ tol`` is reported as *saturated within rounding*.
    """
    return TOL_FACTOR * torch.finfo(dtype).eps * float(ag_rms)


def pinv_quadratic(mat: np.ndarray, vecs: np.ndarray, rtol: float) -> tuple[float, int, float, np.ndarray]:
    """``tr(vecs · mat⁻ · vecsᵀ)`` with a truncated, diagonally scaled generalized inverse.

    ``mat`` (PSD) is scaled to unit diagonal, eigendecomposed, and eigenvalues
    ``≤ rtol · λ_max`` are dropped; ``mat⁻ = D^{-1/2} Q Λ⁻¹ Qᵀ D^{-1/2}`` over the kept
    ones.  For rows of ``vecs`` in the range of ``mat`` this equals the Moore–Penrose
    quadratic form up to the dropped directions.  Returns the value, the rank, the
    absolute cutoff (on the scaled matrix) and ``mat⁻``.
    """
    mat = 0.5 * (mat + mat.T)
    diag = np.clip(np.diag(mat).copy(), 0.0, None)
    live = diag > 0
    scale = np.zeros_like(diag)
    scale[live] = 1.0 / np.sqrt(diag[live])
    scaled = mat * np.outer(scale, scale)
    lam, q = np.linalg.eigh(scaled)
    lmax = float(lam.max()) if lam.size else 0.0
    cutoff = rtol * lmax if lmax > 0 else 0.0
    keep = lam > cutoff if lmax > 0 else np.zeros_like(lam, dtype=bool)
    qk = q[:, keep] * scale[:, None]
    inv = (qk / lam[keep]) @ qk.T
    proj = vecs @ qk
    val = float(np.sum(proj * proj / lam[keep])) if keep.any() else 0.0
    return val, int(keep.sum()), cutoff, inv
