r"""The numerical error model: resolution cutoffs, the score's rounding bound, the noise test.

Everything here implements ``theory/numerics.md`` (labels ``def-resolution``,
``thm-score-error``, ``thm-noise-test``).  Conventions: ``u`` is the unit roundoff of a
dtype (``eps / 2``: ``2⁻⁵³`` for float64, ``2⁻²⁴`` float32, ``2⁻¹¹`` float16, ``2⁻⁸``
bfloat16); the Gram ``Σ`` (or ``K``) is first scaled to unit diagonal,
``Σ̃ = D^{-1/2} Σ D^{-1/2}`` (``T``, ``Π`` and ``s`` do not change, T4), and ``k̃`` is its
size.  Cutoffs are stated on *amplitudes* (singular values of the data, ``σ = sqrt(λ)``):

- the **data resolution** ``σ ≤ C_RES · sqrt(k̃) · u_in · σ_max``: rounding the site tensor
  in the forward dtype moves every feature by a relative ``u_in``, so a direction of
  smaller amplitude can be created or removed by the forward pass's own rounding; it is
  not part of the resolvable tangent space (``def-resolution``);
- the **factorization resolution**: a float64 Gram resolves amplitudes only down to
  ``sqrt(C_RES · k̃ · u64) · σ_max`` (eigenvalues move by ``≈ k̃ u64 λ_max``); the streamed
  triangular factor of :class:`~depthsat_theory.statistics.FeatureStatistics` (float64
  forward passes) down to ``C_RES · sqrt(k̃) · u64 · σ_max``.

A direction above the data resolution but below the factorization resolution is dropped
and counted as **unresolved**: ``ŝ`` is then a lower bound of the score and can never
ground a "saturated" verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = [
    "ACCUMULATION_FACTOR",
    "EIGH_BATCH_MAX_ELEMENTS",
    "FEATURE_ROUNDING_FACTOR",
    "GRADIENT_ROUNDING_FACTOR",
    "NOISE_ALPHA",
    "RESOLUTION_FACTOR",
    "Spectrum",
    "default_rtol",
    "default_tol",
    "dropped_score",
    "eigh_batched",
    "gradient_rounding",
    "gram_error",
    "noise_threshold",
    "over_budget",
    "pinv_quadratic",
    "resolve_spectrum",
    "scaled_gram",
    "score_error",
    "unit_roundoff",
]

#: ``C_RES``: safety factor of both resolution cutoffs (def-resolution).
RESOLUTION_FACTOR = 8.0
#: ``C_g``: relative rounding of the activation gradient, in units of ``u_in`` (the forward and
#: backward passes in the model's dtype; thm-score-error).
GRADIENT_ROUNDING_FACTOR = 64.0
#: ``C_φ``: relative rounding of the features, in units of ``u_in`` (exact for the linear
#: family, whose features are the site tensor itself; thm-score-error).
FEATURE_ROUNDING_FACTOR = 4.0
#: ``C_acc``: float64 accumulation of ``L`` products loses at most ``C_acc · L · u64`` relative to the sum of
#: the absolute products (recursive summation, worst case; ``L`` = largest batch + number of batches).
ACCUMULATION_FACTOR = 1.0
#: Default level of the noise test (thm-noise-test).
NOISE_ALPHA = 0.05


def unit_roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff ``u = eps / 2`` of a floating dtype (float16 and bfloat16 included).

    Args:
        dtype: a torch dtype.

    Returns:
        ``u`` (``2⁻²⁴`` for float32, ``2⁻⁵³`` for float64).

    Raises:
        TypeError: for a non-floating dtype.
    """
    if not dtype.is_floating_point:
        raise TypeError(f"unit roundoff of a non-floating dtype {dtype}")
    return float(torch.finfo(dtype).eps) / 2.0


def _data_rtol(dtype: torch.dtype, k: int) -> float:
    """Data resolution as a cutoff on eigenvalues relative to ``λ_max`` (``(C_RES sqrt(k̃) u_in)²``)."""
    return (RESOLUTION_FACTOR * math.sqrt(max(int(k), 1)) * unit_roundoff(dtype)) ** 2


def _gram_rtol(k: int) -> float:
    """What a float64 Gram resolves, on eigenvalues relative to ``λ_max`` (``C_RES k̃ u64``)."""
    return RESOLUTION_FACTOR * max(int(k), 1) * unit_roundoff(torch.float64)


def default_rtol(dtype: torch.dtype, k: int) -> float:
    r"""Relative eigenvalue cutoff of a float64 *Gram* of ``k`` features from a ``dtype`` forward pass.

    .. math::

        \mathrm{rtol} = \max\bigl((C_{res}\sqrt{k}\,u_{in})^2,\; C_{res}\,k\,u_{64}\bigr),

    the larger of the data resolution and what a float64 Gram resolves
    (theory/numerics.md, ``def-resolution``): about ``1.5e-11`` for float32 at ``k = 65``
    (amplitudes ``≈ 3.8e-6`` of the largest), ``5.8e-14`` for float64.  Eigenvalues
    ``λ ≤ rtol · λ_max`` of the unit-diagonal Gram are dropped.

    Args:
        dtype: the forward pass's dtype (float16, bfloat16, float32 or float64).
        k: number of features.

    Returns:
        The relative cutoff ``rtol`` (dimensionless).
    """
    return max(_data_rtol(dtype, k), _gram_rtol(k))


@dataclass(frozen=True)
class Spectrum:
    """The resolved spectrum of a unit-diagonal PSD Gram (theory/numerics.md, ``def-resolution``).

    Attributes:
        scale: ``D^{-1/2}`` ``(k,)`` float64 (``0`` for zero-diagonal coordinates, dropped exactly).
        values: kept eigenvalues ``λ̃`` of ``Σ̃`` ``(r,)`` (descending).
        vectors: their eigenvectors in the scaled coordinates ``(k, r)``.
        lam_max: ``λ̃_max`` (``0`` for a zero matrix).
        cutoff: absolute eigenvalue cutoff on ``Σ̃`` (``rtol · λ̃_max``).
        rtol: the relative cutoff used.
        unresolved: dropped directions above the data resolution (``ŝ`` is then a lower bound).
        dropped: eigenvectors of the dropped directions above zero amplitude, scaled coordinates ``(k, m)``.
        band: ``(m,)`` bool, which dropped directions lie above what the arithmetic itself resolves
            (the float64 Gram's ``C_res k̃ u64`` or the factor's ``(C_res sqrt(k̃) u64)²``): dropped by the
            data resolution only, so they may be real directions of tiny amplitude.
        factored: whether the spectrum came from a triangular factor (backward stable in the data)
            rather than from the Gram.
        dropped_values: ``(m,)`` the computed eigenvalues ``λ̃`` of the :attr:`dropped` directions.
        eig_error: what the arithmetic resolves, absolute on ``Σ̃`` (the float64 Gram's ``C_res k̃ u64 λ̃_max``, or
            ``2η`` for a Gram accumulated with error ``η``); ``0`` for a factor, whose backward error is counted
            in the data instead (``thm-score-error``).
    """

    scale: np.ndarray
    values: np.ndarray
    vectors: np.ndarray
    lam_max: float
    cutoff: float
    rtol: float
    unresolved: int
    dropped: np.ndarray
    factored: bool = False
    band: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    dropped_values: np.ndarray = field(default_factory=lambda: np.zeros(0))
    eig_error: float = 0.0

    @property
    def rank(self) -> int:
        """The numerical rank (kept directions)."""
        return int(self.values.size)

    @property
    def lam_min(self) -> float:
        """Smallest kept eigenvalue of ``Σ̃`` (``inf`` when nothing is kept)."""
        return float(self.values.min()) if self.values.size else math.inf

    def pinv(self) -> np.ndarray:
        """``Σ⁻ = D^{-1/2} Q Λ⁻¹ Qᵀ D^{-1/2}`` over the kept directions ``(k, k)``.

        Returns:
            ``Σ⁻``, ``(k, k)`` float64.
        """
        qk = self.vectors * self.scale[:, None]
        return (qk / self.values) @ qk.T

    def _whitened(self, vecs: np.ndarray) -> torch.Tensor:
        """``vecs D^{-1/2} Q Λ^{-1/2}`` ``(m, r)`` (torch matmul: torch's threads, no numpy BLAS pool)."""
        qk = torch.from_numpy(np.ascontiguousarray(self.vectors * (self.scale[:, None] / np.sqrt(self.values))))
        return torch.from_numpy(np.ascontiguousarray(vecs, dtype=np.float64)) @ qk

    def quadratic(self, vecs: np.ndarray) -> float:
        """``tr(vecs Σ⁻ vecsᵀ)`` for rows ``vecs`` ``(m, k)``, without forming ``Σ⁻``.

        Args:
            vecs: rows ``(m, k)`` (converted to float64).

        Returns:
            ``tr(vecs Σ⁻ vecsᵀ)`` (``0.0`` when no direction is kept).
        """
        if not self.values.size:
            return 0.0
        return float(self._whitened(vecs).pow(2).sum())

    def trace_product(self, mat: np.ndarray) -> float:
        """``tr(Σ⁻ M)`` for a symmetric ``M`` ``(k, k)``, without forming ``Σ⁻`` (``O(k² r)``).

        Args:
            mat: a symmetric ``(k, k)`` matrix (converted to float64).

        Returns:
            ``tr(Σ⁻ M)`` (``0.0`` when no direction is kept).
        """
        if not self.values.size:
            return 0.0
        qk = self.vectors * (self.scale[:, None] / np.sqrt(self.values))
        left = torch.from_numpy(np.ascontiguousarray(mat, dtype=np.float64)) @ torch.from_numpy(qk)
        return float((left * torch.from_numpy(qk)).sum())


def _scaling(diag: np.ndarray) -> np.ndarray:
    diag = np.clip(diag, 0.0, None)
    scale = np.zeros_like(diag)
    live = diag > 0
    scale[live] = 1.0 / np.sqrt(diag[live])
    return scale


def _decompose(mat, scale: np.ndarray, factor, eig, device) -> tuple[np.ndarray, np.ndarray, float]:
    """``(λ̃, Q, resolution)`` of the scaled Gram, from the factor's SVD, a given ``eig``, or ``eigh``.

    torch's LAPACK (or the device's solver), on torch's threads: numpy's BLAS pool would compete with them.
    """
    k = scale.size
    if factor is not None:
        scaled = torch.from_numpy(factor * scale[None, :]).to(device)
        sv_t, vt_t = torch.linalg.svd(scaled, full_matrices=False)[1:]
        sv, vt = sv_t.cpu().numpy(), vt_t.cpu().numpy()
        return sv**2, vt.T, (RESOLUTION_FACTOR * math.sqrt(max(k, 1)) * unit_roundoff(torch.float64)) ** 2
    if eig is not None:
        return eig[0], eig[1], _gram_rtol(k)
    assert mat is not None  # checked by the caller: without a factor the Gram is given
    lam_t, q_t = torch.linalg.eigh(torch.from_numpy(mat * np.outer(scale, scale)).to(device))
    return lam_t.cpu().numpy(), q_t.cpu().numpy(), _gram_rtol(k)


def resolve_spectrum(
    mat: np.ndarray | None,
    *,
    dtype: torch.dtype = torch.float64,
    rtol: float | None = None,
    factor: np.ndarray | None = None,
    diag: np.ndarray | None = None,
    device: torch.device | str | None = None,
    gram_error: float = 0.0,
    eig: tuple[np.ndarray, np.ndarray] | None = None,
) -> Spectrum:
    """Scale a PSD Gram to unit diagonal, eigendecompose it and apply the resolution cutoffs.

    Args:
        mat: the Gram ``Σ`` (or ``K``), float64 ``(k, k)``; may be ``None`` when ``factor`` and
            ``diag`` are given.
        dtype: the forward pass's dtype (sets the data resolution).
        rtol: an explicit relative eigenvalue cutoff (then nothing is counted unresolved).
        factor: optionally a factor ``R`` ``(m, k)`` with ``Σ = Rᵀ R``: the streamed triangular
            factor (``m = k``) or the scaled data matrix itself (``m`` = number of units, the unit
            path of theory/numerics.md ``thm-unit-gram``); its singular values resolve amplitudes
            down to ``u64`` instead of ``sqrt(u64)``.
        diag: ``diag Σ`` ``(k,)`` (default: read from ``mat``).
        device: where the float64 eigensolve or SVD runs (default CPU; the statistics pass the device
            their sums live on, e.g. the model's GPU); the result is on the CPU either way.
        gram_error: ``η``, a bound on ``‖δΣ̃‖₂`` of the unit-diagonal Gram as accumulated (e.g. float32
            per-batch products, :func:`gram_error`); with the default cutoffs, eigenvalues ``λ̃ ≤ 2η`` are
            dropped too (what such a Gram resolves; ``thm-score-error`` needs ``η < λ̃_min/2``), and a
            dropped direction above the data resolution is counted unresolved as for the float64 Gram.
        eig: ``(λ̃, Q)``, the eigendecomposition of :func:`scaled_gram` ``(mat)`` when already computed
            (:func:`eigh_batched` over several sites); without a ``factor`` only.

    Returns:
        The :class:`Spectrum`.

    Raises:
        ValueError: if neither ``mat`` nor both ``factor`` and ``diag`` are given.
    """
    if mat is None:
        if factor is None or diag is None:
            raise ValueError("resolve_spectrum needs the Gram mat, or a factor together with its diag")
        k = int(diag.shape[0])
        scale = _scaling(np.asarray(diag, dtype=np.float64).copy())
    else:
        k = mat.shape[0]
        mat = 0.5 * (mat + mat.T)
        scale = _scaling(np.diag(mat).copy() if diag is None else np.asarray(diag, dtype=np.float64).copy())
    lam, q, resolution = _decompose(mat, scale, factor, eig, device)
    lmax = float(lam.max()) if lam.size else 0.0
    data = _data_rtol(dtype, k)
    chosen = max(data, resolution) if rtol is None else float(rtol)
    cutoff = chosen * lmax if lmax > 0 else 0.0
    # what the arithmetic resolves, absolute on Σ̃: the eigensolve's, and 2η for a Gram accumulated with error η
    arith = max(resolution * lmax, 2.0 * float(gram_error))
    if rtol is None and lmax > 0 and arith > cutoff:
        cutoff, chosen = arith, arith / lmax
    keep = lam > cutoff if lmax > 0 else np.zeros(lam.shape, dtype=bool)
    unresolved = 0
    if rtol is None and lmax > 0 and arith > data * lmax:
        unresolved = int(((lam > data * lmax) & ~keep).sum())
    order = np.argsort(-lam[keep])
    live = scale > 0
    dropped, dropped_lam = q[:, ~keep], lam[~keep]
    nonzero = np.abs(dropped[live]).sum(0) > 0 if live.any() else np.zeros(dropped.shape[1], dtype=bool)
    dropped, dropped_lam = dropped[:, nonzero], dropped_lam[nonzero]
    band = dropped_lam > arith if rtol is None and lmax > 0 else np.zeros(dropped_lam.shape, dtype=bool)
    return Spectrum(
        scale=scale,
        values=lam[keep][order],
        vectors=q[:, keep][:, order],
        lam_max=lmax,
        cutoff=cutoff,
        rtol=chosen,
        unresolved=unresolved,
        dropped=dropped,
        factored=factor is not None,
        band=band,
        dropped_values=dropped_lam,
        eig_error=0.0 if factor is not None else float(arith),
    )


def scaled_gram(mat: np.ndarray, diag: np.ndarray | None = None) -> np.ndarray:
    """``Σ̃ = D^{-1/2} ½(Σ + Σᵀ) D^{-1/2}``, exactly the matrix :func:`resolve_spectrum` eigendecomposes.

    Args:
        mat: a ``(k, k)`` Gram matrix.
        diag: the diagonal ``D`` to scale by (default: the diagonal of ``½(Σ + Σᵀ)``); nonpositive entries
            give zero rows and columns.

    Returns:
        ``Σ̃``, ``(k, k)``.
    """
    mat = 0.5 * (mat + mat.T)
    scale = _scaling(np.diag(mat).copy() if diag is None else np.asarray(diag, dtype=np.float64).copy())
    return mat * np.outer(scale, scale)


#: Most float64 entries :func:`eigh_batched` stacks into one batched call (256 MiB).
EIGH_BATCH_MAX_ELEMENTS = 1 << 25


def eigh_batched(
    mats: list[np.ndarray], *, device: torch.device | str | None = None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Eigendecompositions ``(λ, Q)`` of symmetric float64 matrices, batched by size in torch.

    Matrices of the same size are stacked (at most :data:`EIGH_BATCH_MAX_ELEMENTS` entries per call)
    and decomposed by one ``torch.linalg.eigh`` on ``device`` (default CPU): one call per size on a GPU,
    torch's LAPACK and threads on a CPU (no numpy BLAS pool competing with them).  Each decomposition
    is that of ``torch.linalg.eigh`` of the single matrix (the same backward-stable solver; bitwise on CPU).

    Args:
        mats: ``(k_i, k_i)`` float64 numpy arrays (e.g. :func:`scaled_gram` of each site's ``Σ``).
        device: where the solver runs; results are CPU numpy arrays.

    Returns:
        ``[(λ (k_i,), Q (k_i, k_i))]`` in the order of ``mats``, eigenvalues ascending.
    """
    out: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(mats)
    by_size: dict[int, list[int]] = {}
    for i, m in enumerate(mats):
        by_size.setdefault(int(m.shape[0]), []).append(i)
    for k, idx in by_size.items():
        per_call = max(1, EIGH_BATCH_MAX_ELEMENTS // max(k * k, 1))
        for start in range(0, len(idx), per_call):
            part = idx[start : start + per_call]
            stacked = torch.from_numpy(np.stack([mats[i] for i in part])).to(device)
            lam, q = torch.linalg.eigh(stacked)
            lam_np, q_np = lam.cpu().numpy(), q.cpu().numpy()
            for j, i in enumerate(part):
                out[i] = (lam_np[j], q_np[j])
    return [o for o in out if o is not None]


def pinv_quadratic(mat: np.ndarray, vecs: np.ndarray, rtol: float) -> tuple[float, int, float, np.ndarray]:
    """``tr(vecs · mat⁻ · vecsᵀ)`` with a truncated, diagonally scaled generalized inverse.

    ``mat`` (PSD) is scaled to unit diagonal, eigendecomposed, and eigenvalues
    ``≤ rtol · λ_max`` are dropped (:func:`resolve_spectrum` with an explicit ``rtol``).
    Returns the value, the rank, the absolute cutoff (on the scaled matrix) and ``mat⁻``.

    Args:
        mat: a PSD ``(k, k)`` matrix.
        vecs: rows ``(m, k)``.
        rtol: the relative eigenvalue cutoff.

    Returns:
        ``(value, rank, cutoff, pinv)``: ``tr(vecs mat⁻ vecsᵀ)``, the number of kept directions, the absolute
        cutoff on the scaled matrix, and ``mat⁻`` ``(k, k)`` float64.
    """
    spec = resolve_spectrum(mat, rtol=rtol)
    return spec.quadratic(vecs), spec.rank, spec.cutoff, spec.pinv()


def _gamma_acc(summands: int, product_summands: int) -> float:
    """``γ_acc = C_acc (L u64 + L_32 u32)``: float64 sums of length ``L`` of float32 products of length ``L_32``."""
    u64, u32 = unit_roundoff(torch.float64), unit_roundoff(torch.float32)
    return ACCUMULATION_FACTOR * (max(summands, 1) * u64 + max(int(product_summands), 0) * u32)


def gram_error(*, k: int, summands: int, product_summands: int) -> float:
    """``η = k̃ (γ_acc + C_res u64)``: the bound on ``‖δΣ̃‖₂`` of the accumulated unit-diagonal Gram (thm-score-error).

    ``summands`` is the length ``L`` of the float64 sums, ``product_summands`` the length ``L_32`` of the
    float32 per-batch products (``0``: float64 products).

    Args:
        k: ``k̃``, number of features (with the constant).
        summands: ``L``.
        product_summands: ``L_32`` (``0``: float64 products).

    Returns:
        ``η`` (dimensionless: the Gram has unit diagonal).
    """
    return int(k) * (_gamma_acc(summands, product_summands) + RESOLUTION_FACTOR * unit_roundoff(torch.float64))


def gradient_rounding(*, ag_rms: float, dtype: torch.dtype, summands: int, k: int, product_summands: int = 0) -> float:
    """Rounding level of ``‖G̃ v‖`` along a unit direction ``v``: ``A (ε_M + γ_acc sqrt(k̃))`` (thm-score-error).

    ``product_summands`` is the length ``L_32`` of float32 per-batch products (``0``: float64 products).

    A dropped direction whose computed ``‖G̃ v‖`` exceeds this carries activation gradient the
    arithmetic cannot account for: ``ŝ`` may then miss it, and the verdict cannot be "saturated".

    Args:
        ag_rms: ``A = AG_rms`` (loss units per unit step).
        dtype: the dtype of the features.
        summands: the length ``L`` of the float64 sums.
        k: ``k̃``, number of features (with the constant).
        product_summands: ``L_32``.

    Returns:
        The rounding level, in the units of ``ag_rms``.

    Raises:
        TypeError: for a non-floating ``dtype``.
    """
    eps_m = FEATURE_ROUNDING_FACTOR * unit_roundoff(dtype) * math.sqrt(k)
    return ag_rms * (eps_m + _gamma_acc(summands, product_summands) * math.sqrt(k))


def dropped_score(
    spec: Spectrum,
    mass: np.ndarray,
    *,
    ag_rms: float,
    dtype: torch.dtype,
    summands: int,
    product_summands: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    r"""What each dropped direction could add to the score, and which of them rounding cannot have created.

    theory/numerics.md, ``lem-dropped-score``.  A dropped direction ``v`` (unit, scaled coordinates) of computed
    eigenvalue ``λ̂`` has an amplitude ``σ`` in ``[σ_lo, σ_hi] = [sqrt((λ̂ − δλ)₊), sqrt(λ̂ + δλ)]`` with ``δλ`` what the
    arithmetic resolves (:attr:`Spectrum.eig_error`, at least ``η`` of :func:`gram_error`; ``0`` for a factor, whose
    backward error joins the data's). Below the data's rounding level ``ρ = ε_M = C_φ u_in sqrt(k̃)`` (plus
    ``C_res sqrt(k̃) u64`` for a factor) rounding can create or remove a direction (Weyl); above it the direction is
    the probe's own, and it adds ``‖G̃v‖/σ`` to the score, at most

    .. math::

        c_v = \min\Bigl(A,\; \frac{\lVert\hat{\tilde G} v\rVert + A\,γ_{acc}\sqrt{k̃}}{\max(σ_{lo}, ρ)}\Bigr).

    Args:
        spec: the resolved spectrum (:attr:`Spectrum.dropped`, :attr:`Spectrum.dropped_values`).
        mass: ``‖G̃ v‖`` for each dropped direction ``(m,)`` (computed).
        ag_rms: ``A = AG_rms``.
        dtype: the dtype of the features (the site tensor ``z``'s, or float32 with float32 products).
        summands: the length ``L`` of the float64 sums.
        product_summands: ``L_32`` (``0``: float64 products).

    Returns:
        ``(c, real)``: ``c`` ``(m,)`` the bound ``c_v`` (``0`` where ``σ_hi ≤ ρ``), in the units of ``ag_rms``, and
        ``real`` ``(m,)`` bool, ``σ_hi > ρ`` (the direction may lie above the rounding level).
    """
    k = spec.scale.size
    u64 = unit_roundoff(torch.float64)
    rho = FEATURE_ROUNDING_FACTOR * unit_roundoff(dtype) * math.sqrt(k)
    lam = np.asarray(spec.dropped_values, dtype=np.float64)
    if lam.shape != np.shape(mass):  # a hand-built spectrum without the dropped eigenvalues: amplitude 0 computed
        lam = np.zeros(np.shape(mass))
    if spec.factored:
        rho += RESOLUTION_FACTOR * math.sqrt(k) * u64
        err = 0.0
    else:
        err = max(spec.eig_error, gram_error(k=k, summands=summands, product_summands=product_summands))
    lo, hi = np.sqrt(np.clip(lam - err, 0.0, None)), np.sqrt(np.clip(lam + err, 0.0, None))
    real = hi > rho
    slack = ag_rms * _gamma_acc(summands, product_summands) * math.sqrt(k)
    c = np.where(real, np.minimum(ag_rms, (np.asarray(mass) + slack) / np.maximum(lo, rho)), 0.0)
    return c, real


def over_budget(c: np.ndarray, budget: float) -> np.ndarray:
    """Which dropped directions must be resolved before the rest fit in ``budget`` (``lem-dropped-score``).

    The fewest directions, largest ``c_v`` first, whose removal leaves ``Σ c_v² ≤ budget²``.

    Args:
        c: the bounds ``c_v`` ``(m,)`` of :func:`dropped_score`.
        budget: the score the verdict can still absorb (``≥ 0``).

    Returns:
        ``(m,)`` bool.
    """
    c = np.asarray(c, dtype=np.float64)
    order = np.argsort(-c)
    c2 = c[order] ** 2
    tail = np.concatenate([np.cumsum(c2[::-1])[::-1], [0.0]])  # tail[i] = Σ_{j ≥ i} c2[j]
    count = int(np.argmax(tail <= budget * budget))
    flagged = np.zeros(c.shape, dtype=bool)
    flagged[order[:count]] = True
    return flagged


def score_error(
    spec: Spectrum,
    *,
    score: float,
    ag_rms: float,
    dtype: torch.dtype,
    summands: int,
    k: int | None = None,
    product_summands: int = 0,
    feature_dtype: torch.dtype | None = None,
) -> float:
    r"""Rounding bound on ``|ŝ − s|`` (theory/numerics.md, ``thm-score-error``).

    .. math::

        e &= C_g u_{in} A + \frac{A\,ε_M}{σ_{min} − ε_M} + \frac{A\,γ_{acc}\sqrt{k̃}}{σ_{min}}
            + \hat s\,\frac{η}{σ_{min}^2},\\
        ε_M &= C_φ u_{in} \sqrt{k̃},\qquad γ_{acc} = C_{acc} (L\,u_{64} + L_{32}\,u_{32}),\\
        η &= k̃\,(γ_{acc} + C_{res} u_{64}),

    with ``A = AG_rms``, ``L`` the length of the float64 sums (largest batch in units plus the
    number of batches), ``L_32`` the length of the float32 per-batch products (the largest batch
    so multiplied, in units; ``0`` when the products are float64, and then ``u_in ≥ u32``) and
    ``σ_min = sqrt(λ̃_min)`` the smallest kept
    amplitude of the unit-diagonal Gram.  The terms: the gradient's own rounding (``Π`` is a
    contraction); the input rounding of the features, a perturbation of the scaled data
    matrix of norm ``≤ ε_M`` that tilts the projector by ``≤ ε_M/(σ_min − ε_M)`` (Wedin);
    the float64 accumulation of the cross-gradient, amplified by ``Σ̃^{-1/2}``; the
    accumulation and eigensolve of ``Σ̃``, first order in ``η/λ̃_min`` (with the streamed triangular
    factor, a backward error ``C_res sqrt(k̃) u64`` in the data instead: added to ``ε_M``, ``η = 0``).  ``inf`` when
    ``ε_M ≥ σ_min/2`` or ``η ≥ λ̃_min/2`` (first order no longer holds).

    Args:
        spec: the resolved spectrum.
        score: ``ŝ``.
        ag_rms: ``AG_rms``.
        dtype: the forward dtype (coarsest of the site tensors and gradients): ``u_in`` of the gradient's rounding.
        summands: the length ``L`` of the float64 sums (largest batch in units + number of batches).
        k: the Gram's size ``k̃`` (default: that of ``spec``).
        product_summands: ``L_32``, the length of the float32 per-batch products (``0``: none).
        feature_dtype: the features' dtype, ``u_in`` of ``ε_M`` (default ``dtype``): a float64 ``z`` with a float32
            ``g`` has float64 features.

    Returns:
        The bound, in the units of ``s`` (e.g. nats per example per unit step); ``0`` for an
        empty tangent space (nothing to round).
    """
    if spec.rank == 0:
        return 0.0
    kk = int(k if k is not None else spec.scale.size)
    u_in, u64 = unit_roundoff(dtype), unit_roundoff(torch.float64)
    eps_m = FEATURE_ROUNDING_FACTOR * unit_roundoff(feature_dtype or dtype) * math.sqrt(kk)
    gamma_acc = _gamma_acc(summands, product_summands)
    if spec.factored:  # Householder QR: a backward error C_res sqrt(k̃) u64 in the data, no Gram rounding
        eps_m += RESOLUTION_FACTOR * math.sqrt(kk) * u64
        eta = 0.0
    else:
        eta = gram_error(k=kk, summands=summands, product_summands=product_summands)
    lam_min = spec.lam_min
    sigma_min = math.sqrt(lam_min)
    if eps_m >= 0.5 * sigma_min or eta >= 0.5 * lam_min:
        return math.inf
    return (
        GRADIENT_ROUNDING_FACTOR * u_in * ag_rms
        + ag_rms * eps_m / (sigma_min - eps_m)
        + ag_rms * gamma_acc * math.sqrt(kk) / sigma_min
        + score * eta / lam_min
    )


def default_tol(dtype: torch.dtype, ag_rms: float) -> float:
    """Rounding of the activation gradient alone: ``C_g · u(dtype) · AG_rms`` (thm-score-error, first term).

    The part of :func:`score_error` that does not depend on the conditioning of the Gram: a
    perturbation ``δg`` moves ``s`` by at most ``‖δg‖`` (``Π`` is a contraction).  Used where the
    projection is computed without a streamed Gram (the dense reference engine) and as the
    rounding level of ``b`` (:class:`~depthsat_theory.capture.Insertion`).

    Args:
        dtype: the dtype of the activation gradients.
        ag_rms: ``AG_rms`` (loss units per unit step).

    Returns:
        The threshold, in the units of ``ag_rms``.

    Raises:
        TypeError: for a non-floating ``dtype``.
    """
    return GRADIENT_ROUNDING_FACTOR * unit_roundoff(dtype) * float(ag_rms)


def noise_threshold(alpha: float) -> float:
    """``χ²₁`` upper ``α`` quantile: the noise test calls ``n ŝ² / v̂`` above it significant.

    By Székely and Bakirov (2003), a Gaussian quadratic form ``Σ λ_j Z_j²`` exceeds
    ``χ²_{1,1−α} · Σ λ_j`` with probability at most ``α`` for every ``α ≤ 0.215``
    (theory/numerics.md, ``thm-noise-test``).

    Args:
        alpha: the test's level ``α ∈ (0, 0.215]``.

    Returns:
        ``χ²_{1,1−α}``.

    Raises:
        ValueError: for ``α`` outside ``(0, 0.215]``.
    """
    if not 0.0 < alpha <= 0.215:
        raise ValueError(f"alpha = {alpha!r}: the noise test is valid for 0 < alpha <= 0.215")
    from scipy.stats import chi2

    return float(chi2.isf(alpha, 1))
