"""Tangent statistics, the projector onto the tangent space, and saturation scores.

Everything here is computed on the *empirical measure* of a probe of ``n`` examples:
for functions of the site tensor, ``⟨u, v⟩ = (1/n) Σ_x Σ_{units of x} u·v``
(theory/definitions.md, def-setting, the intensity measure), so that ``b`` below is exactly autograd's
gradient of the per-example-mean loss.  With ``g`` the activation gradient of the
per-example loss (nats per example):

.. math::

    K = E[A^T A], \\quad b = E[A^T g], \\quad s = \\lVert Π g \\rVert
      = \\sqrt{b^T K^+ b} = \\sup_{Av \\neq 0} \\frac{b^T v}{\\lVert A v \\rVert}.

For zero-output feature families ``K = I_d ⊗ Σ`` and ``b = vec(G)`` with the
cross-gradient ``G = E[Σ_r g_r φ̃_rᵀ]`` and ``Σ = E[Σ_r φ̃_r φ̃_rᵀ]``, so
``s² = tr(G Σ⁺ Gᵀ)`` (theory label ``thm-cross-gradient``); no Jacobian is formed.
Statistics stream in float64: memory is ``O(d k̃ + k̃²)`` per site whatever the
probe size (``O(p²)`` for general families), except the optional exact-tie pooling
for the raw score ``r`` which stores one ``d``-vector per distinct unit.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import scipy.sparse.linalg as spla
import torch
from torch import Tensor

from depthsat_theory.families import FamilyError, FeatureFamily, GeneralFamily, ResidualFamily, from_rows, to_rows

__all__ = [
    "GRAM_FACTOR",
    "TANGENT_GRAM_MAX_ELEMENTS",
    "TOL_FACTOR",
    "FeatureStatistics",
    "GeneralStatistics",
    "SaturationResult",
    "StatisticsError",
    "TangentProjector",
    "default_rtol",
    "default_tol",
    "pinv_quadratic",
    "statistics_for",
]

#: Safety factor of the saturation threshold ``tol = TOL_FACTOR · eps(dtype) · AG_rms``.
TOL_FACTOR = 1.0e3


class StatisticsError(ValueError):
    """Bad input to the statistics (shape mismatch, NaN/Inf, empty probe)."""


#: Largest number of entries :meth:`FeatureStatistics.tangent_gram` forms (128 MiB of float64).
TANGENT_GRAM_MAX_ELEMENTS = 1 << 24

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


@dataclass
class SaturationResult:
    """Saturation quantities of one (site, family) on a probe (theory/definitions.md).

    All norms use the empirical measure of the probe; ``score``, ``raw_score``,
    ``ag_rms`` and ``ag_max`` are in (loss units) per unit function-space step,
    e.g. nats per example.

    Attributes:
        score: ``s = ‖Π g‖``, the saturation score.
        raw_score: ``r̂ = ‖m̂‖`` with ``m̂`` pooling exactly equal units (``nan`` when
            pooling was off).  Exact on finite/discrete populations; for continuous
            units ``r̂ = AG_rms`` (biased upward against the population ``r``).
        ag_rms: ``sqrt(E ‖g‖_F²)`` over whole site tensors.
        ag_max: ``max_x ‖g(x)‖_F`` over the probe (a lower bound of the ess-sup).
        realizability_defect: ``ρ̂ = ‖m̂ − Π m̂‖ / ‖m̂‖`` (``nan`` if pooling was off
            or ``m̂ = 0``); same caveat as ``raw_score``.
        relative_score: ``s / AG_rms`` ∈ [0, 1], scale-free (``nan`` if ``AG_rms = 0``).
        activation_scaled_score: ``s · z_rms`` with ``z_rms = sqrt(E ‖z‖_F²)``: the
            first-order loss decrease for a step the size of the activations.
        tangent_rank: numerical rank of ``K`` (``d · rank Σ`` for feature families).
        tangent_dim: ``p``, the number of tangent coordinates.
        degenerate: ``tangent_rank == 0`` (``T = {0}``): never "saturated".
        saturated: ``score <= tol`` and not degenerate.
        tol: the saturation threshold used.
        cutoff: absolute eigenvalue cutoff used for ``Σ`` / ``K``.
        rtol: relative cutoff (``cutoff / λ_max``).
        n: number of probe examples; ``units``: number of units (rows) seen.
        family: family spec; ``unit``: ``"row"`` or ``"tensor"``.
        dtype: dtype of the forward pass the statistics came from.
        gradient: ``b`` as a float64 numpy vector (``vec_row(G)`` for feature
            families, in the order of the block's tangent parameters).
    """

    score: float
    raw_score: float
    ag_rms: float
    ag_max: float
    realizability_defect: float
    relative_score: float
    activation_scaled_score: float
    tangent_rank: int
    tangent_dim: int
    degenerate: bool
    saturated: bool
    tol: float
    cutoff: float
    rtol: float
    n: int
    units: int
    family: str
    unit: str
    dtype: str
    gradient: np.ndarray = field(repr=False)

    def to_dict(self, *, with_gradient: bool = False) -> dict:
        """JSON-ready dictionary (``nan`` becomes ``None``)."""
        d = asdict(self)
        grad = d.pop("gradient")
        if with_gradient:
            d["gradient"] = grad.tolist()
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def _check_pair(z: Tensor, g: Tensor) -> None:
    if z.shape != g.shape:
        raise StatisticsError(
            f"activations z {tuple(z.shape)} and activation gradients g {tuple(g.shape)} must have the same shape"
        )
    if z.shape[0] == 0:
        raise StatisticsError("empty batch: the probe has no examples")
    for name, t in (("z", z), ("g", g)):
        if not torch.is_floating_point(t):
            raise StatisticsError(f"{name} must be a floating tensor, got {t.dtype}")
        if not torch.isfinite(t).all():
            raise StatisticsError(f"{name} contains NaN or Inf; fix the probe before scoring")


class _Accumulator:
    """Shared streaming state: counts, ‖g‖², max ‖g‖, ‖z‖², optional tie pooling."""

    family: ResidualFamily

    def __init__(self, family: ResidualFamily, shape, layout: str, *, pool_ties: bool):
        family.check_site(tuple(shape), layout)
        self.family = family
        self.shape = tuple(int(s) for s in shape)
        self.layout = layout
        self.pool_ties = pool_ties
        self.n = 0
        self.units = 0
        self.g_sq = 0.0
        self.z_sq = 0.0
        self.g_max = 0.0
        self.dtype: torch.dtype | None = None
        self._ties: dict[bytes, list] = {}

    def _row_mask(self, z: Tensor, g: Tensor, mask: Tensor | None) -> Tensor | None:
        """Validate a padding mask; ``None`` when there is nothing to drop."""
        if mask is None:
            return None
        mask = torch.as_tensor(mask, device=z.device)
        if mask.dtype != torch.bool:
            raise StatisticsError(f"the padding mask must be bool (True at real tokens), got {mask.dtype}")
        if self.layout != "sequence" or self.family.unit != "row":
            raise StatisticsError(
                f"a padding mask drops rows of sequence sites for row-wise families; this site "
                f"has layout {self.layout!r} and family {self.family.spec!r} (unit "
                f"{self.family.unit!r}): a sequence-level family must mask padding itself"
            )
        if tuple(mask.shape) != tuple(z.shape[:2]):
            raise StatisticsError(
                f"the padding mask {tuple(mask.shape)} does not match the site tensors' (B, T) = {tuple(z.shape[:2])}"
            )
        if bool((g.detach()[~mask] != 0).any()):
            raise StatisticsError(
                "the activation gradient is nonzero at padded positions: the model "
                "or the loss reads padding (theory/definitions.md, def-setting: padding is excluded)"
            )
        return None if bool(mask.all()) else mask

    def _common(self, z: Tensor, g: Tensor, mask: Tensor | None = None) -> None:
        _check_pair(z, g)
        if tuple(z.shape[1:]) != self.shape:
            raise StatisticsError(
                f"site tensors have per-example shape {tuple(z.shape[1:])}, the statistics were set up for {self.shape}"
            )
        dt = z.dtype if z.dtype in (torch.float32, torch.float64) else torch.float32
        self.dtype = (
            dt if self.dtype is None else (torch.float32 if torch.float32 in (dt, self.dtype) else torch.float64)
        )
        g64 = g.detach().to(torch.float64)
        per_ex = g64.flatten(1).pow(2).sum(1)
        if bool((per_ex == 0).any()) and bool((g64.flatten(1)[per_ex == 0] != 0).any()):
            raise StatisticsError(
                "activation gradients underflow when squared in float64 (|g| below ~1e-154); "
                "rescale g (every score is homogeneous of degree 1 in g)"
            )
        self.g_sq += float(per_ex.sum())
        self.g_max = max(self.g_max, float(per_ex.max().sqrt()))
        z_kept = z.detach() if mask is None else z.detach()[mask].unsqueeze(1)
        self.z_sq += float(z_kept.to(torch.float64).pow(2).sum())
        self.n += int(z.shape[0])
        if self.pool_ties:
            self._pool(z_kept, g64 if mask is None else g64[mask].unsqueeze(1))

    def _pool(self, z: Tensor, g64: Tensor) -> None:
        if self.family.unit == "row":
            zu = to_rows(z, self.layout)
            zu = zu.reshape(-1, zu.shape[-1])
            gu = to_rows(g64, self.layout).reshape(zu.shape[0], -1)
        else:
            zu = z.reshape(z.shape[0], -1)
            gu = g64.reshape(g64.shape[0], -1)
        zc = zu.cpu().contiguous()
        uniq, inv = torch.unique(zc, dim=0, return_inverse=True)
        sums = torch.zeros(uniq.shape[0], gu.shape[1], dtype=torch.float64).index_add_(0, inv, gu.cpu())
        counts = torch.bincount(inv, minlength=uniq.shape[0]).tolist()
        for j in range(uniq.shape[0]):
            key = (uniq[j] + 0.0).numpy().tobytes()  # + 0.0 maps -0.0 to 0.0
            slot = self._ties.get(key)
            if slot is None:
                self._ties[key] = [sums[j], counts[j], uniq[j].clone()]
            else:
                slot[0] += sums[j]
                slot[1] += counts[j]

    def _project_units(self, units: Tensor) -> Tensor:
        """``(Π g)`` evaluated at pooled units ``(N, *)`` (flattened like the pooled ``g``)."""
        raise NotImplementedError

    def _pooled_quantities(self) -> tuple[float, float]:
        """``(r̂², ‖m̂ − Π m̂‖²)`` from the pooled units (``Π m̂ = Π g``, theory/definitions.md)."""
        sums = torch.stack([s for s, _, _ in self._ties.values()])
        counts = torch.tensor([c for _, c, _ in self._ties.values()], dtype=torch.float64)
        units = torch.stack([u for _, _, u in self._ties.values()])
        means = sums / counts[:, None]
        r2 = float((counts * means.pow(2).sum(1)).sum()) / self.n
        resid = means - self._project_units(units).to(torch.float64).cpu().reshape(means.shape)
        defect2 = float((counts * resid.pow(2).sum(1)).sum()) / self.n
        return r2, defect2

    def _merge_common(self, other: _Accumulator) -> None:
        if (other.family.spec, other.shape, other.layout) != (self.family.spec, self.shape, self.layout):
            raise StatisticsError("cannot merge statistics of different sites or families")
        self.n += other.n
        self.units += other.units
        self.g_sq += other.g_sq
        self.z_sq += other.z_sq
        self.g_max = max(self.g_max, other.g_max)
        if other.dtype is not None:
            self.dtype = (
                other.dtype
                if self.dtype is None
                else (torch.float32 if torch.float32 in (other.dtype, self.dtype) else torch.float64)
            )
        for key, (s, c, u) in other._ties.items():
            slot = self._ties.get(key)
            if slot is None:
                self._ties[key] = [s.clone(), c, u.clone()]
            else:
                slot[0] += s
                slot[1] += c

    def _require_examples(self) -> None:
        if self.n == 0:
            raise StatisticsError("no examples were accumulated: the probe is empty")

    def _check_finite(self, *arrays) -> None:
        vals = [self.g_sq, self.z_sq, self.g_max] + [float(np.abs(np.asarray(a)).sum()) for a in arrays]
        if not all(math.isfinite(v) for v in vals):
            raise StatisticsError(
                "the statistics overflowed float64 (|z| or |g| too large, e.g. 1e160); rescale the "
                "probe: s scales linearly in g, and T is unchanged by rescaling z for the linear family"
            )

    def _finish(
        self, score2: float, b: np.ndarray, rank: int, p: int, cutoff: float, rtol: float, tol: float | None
    ) -> SaturationResult:
        if self.n == 0:
            raise StatisticsError("no examples were accumulated: the probe is empty")
        dtype = self.dtype or torch.float64
        ag_rms = math.sqrt(self.g_sq / self.n)
        score = math.sqrt(max(score2, 0.0))
        tol = default_tol(dtype, ag_rms) if tol is None else float(tol)
        raw = rho = float("nan")
        if self.pool_ties and self._ties:
            r2, defect2 = self._pooled_quantities()
            # r̂ ≤ AG_rms holds exactly on the probe (Jensen on each tie class); the two are
            # summed in different orders, so clamp a rounding-level excess (|Δ| ≤ 1e-12 r̂)
            raw = math.sqrt(r2)
            if ag_rms < raw <= ag_rms * (1 + 1e-12):
                raw = ag_rms
            if raw > 0:
                rho = math.sqrt(defect2) / raw
        degenerate = rank == 0
        return SaturationResult(
            score=score,
            raw_score=raw,
            ag_rms=ag_rms,
            ag_max=self.g_max,
            realizability_defect=rho,
            relative_score=score / ag_rms if ag_rms > 0 else float("nan"),
            activation_scaled_score=score * math.sqrt(self.z_sq / self.n),
            tangent_rank=int(rank),
            tangent_dim=int(p),
            degenerate=degenerate,
            saturated=(not degenerate) and score <= tol,
            tol=tol,
            cutoff=float(cutoff),
            rtol=float(rtol),
            n=self.n,
            units=self.units,
            family=self.family.spec,
            unit=self.family.unit,
            dtype=str(dtype).replace("torch.", ""),
            gradient=b,
        )


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


def _rows_as_site(rows: Tensor, layout: str) -> Tensor:
    """Pack unit rows ``(N, d)`` into one site tensor so row-wise maps see each row once."""
    if layout == "vector":
        return rows
    if layout == "sequence":
        return rows.unsqueeze(0)
    return rows.T.reshape(1, rows.shape[1], rows.shape[0], 1)


class FeatureStatistics(_Accumulator):
    """Streaming cross-gradient statistics for a :class:`FeatureFamily` at one site.

    Accumulates, in float64, ``Σ = Σ_x Σ_r φ̃_r φ̃_rᵀ`` (``k̃ × k̃``) and
    ``G = Σ_x Σ_r g_r φ̃_rᵀ`` (``d × k̃``), plus counts and norms; divides by ``n`` at
    the end.  Cost per batch ``O(units · (d k̃ + k̃²))``.

    Args:
        family: the feature family.
        shape: per-example site shape.
        layout: site layout.
        pool_ties: also pool exactly equal units to report ``r̂`` and ``ρ̂``
            (memory grows with the number of distinct units).
        device: where features are computed (default: the device of the first batch).

    Raises:
        FamilyError: if the family does not fit the site.
    """

    def __init__(self, family: FeatureFamily, shape, layout: str, *, pool_ties: bool = False, device=None):
        if not isinstance(family, FeatureFamily):
            raise FamilyError(f"{family!r} is not a feature family; use GeneralStatistics")
        super().__init__(family, shape, layout, pool_ties=pool_ties)
        self.d = family.site_dim(self.shape, layout)
        self.k = family.augmented_dim(self.shape, layout)
        self.sigma = torch.zeros(self.k, self.k, dtype=torch.float64)
        self.cross = torch.zeros(self.d, self.k, dtype=torch.float64)
        self._fmap = None
        self._device = device

    def _features(self, z: Tensor) -> Tensor:
        if self._fmap is None:
            dev = self._device if self._device is not None else z.device
            self._fmap = self.family.frozen_feature_map(self.shape, self.layout, dtype=torch.float64, device=dev)
            self.sigma = self.sigma.to(dev)
            self.cross = self.cross.to(dev)
        with torch.no_grad():
            return self.family.augmented_features(self._fmap, z.detach().to(torch.float64))

    def update(self, z: Tensor, g: Tensor, mask: Tensor | None = None) -> None:
        """Add a batch of site tensors ``z`` and activation gradients ``g``.

        Args:
            z: ``(B, *shape)`` activations, float32/float64.
            g: ``(B, *shape)`` gradients of the *per-example* losses w.r.t. ``z``.
            mask: optional padding mask, bool ``(B, T)``, ``True`` at real tokens, for
                sequence sites of row-wise families: padded rows are left out of every
                sum (theory/definitions.md, def-setting, padding excluded); ``n`` still counts examples.

        Raises:
            StatisticsError: on shape mismatch, NaN/Inf, an empty batch, or a mask of the
                wrong shape/dtype/site, or with ``g ≠ 0`` at a padded position.
        """
        mask = self._row_mask(z, g, mask)
        self._common(z, g, mask)
        phi = self._features(z)
        rows_g = to_rows(g.detach().to(torch.float64), self.layout)
        if mask is not None:
            phi, rows_g = phi[mask], rows_g[mask]
        phi2 = phi.reshape(-1, self.k)
        self.sigma += phi2.T @ phi2
        self.cross += rows_g.reshape(-1, self.d).T @ phi2
        self.units += phi2.shape[0]

    def merge(self, other: FeatureStatistics) -> FeatureStatistics:
        """Add another accumulator's sums (e.g. another shard of the probe); returns self."""
        self._merge_common(other)
        self.sigma += other.sigma.to(self.sigma.device)
        self.cross += other.cross.to(self.cross.device)
        return self

    def feature_gram(self) -> np.ndarray:
        """``Σ = E[Σ_r φ̃_r φ̃_rᵀ]``: the per-example mean feature Gram.

        Returns:
            float64 numpy array ``(k̃, k̃)`` (``k̃`` the augmented feature dimension),
            in (feature units)² per example (theory label ``thm-cross-gradient``).

        Raises:
            StatisticsError: if no examples were accumulated.
        """
        self._require_examples()
        return (self.sigma / self.n).cpu().numpy()

    def cross_gradient(self) -> np.ndarray:
        """``G = E[Σ_r g_r φ̃_rᵀ]``: the per-example mean cross-gradient, equal to ``∂J/∂(W, c)``.

        Returns:
            float64 numpy array ``(d, k̃)`` in (loss units)·(feature units) per example
            (theory label ``thm-cross-gradient``).

        Raises:
            StatisticsError: if no examples were accumulated.
        """
        self._require_examples()
        return (self.cross / self.n).cpu().numpy()

    def gradient(self) -> np.ndarray:
        """``b = E[Aᵀ g] = vec(G)`` in the tangent-coordinate order ``(vec_row(W), c)``.

        Returns:
            float64 numpy vector ``(p,)`` with ``p = d · k̃`` (:meth:`theta_vector` of :meth:`cross_gradient`).

        Raises:
            StatisticsError: if no examples were accumulated.
        """
        return self.theta_vector(self.cross_gradient())

    def tangent_gram(self, *, max_elements: int = TANGENT_GRAM_MAX_ELEMENTS) -> np.ndarray:
        """``K = E[AᵀA] = I_d ⊗ Σ`` formed explicitly, in the order of :meth:`gradient`.

        For feature families ``K`` is block diagonal with ``d`` copies of ``Σ``; it has
        ``p² = (d k̃)²`` entries, so it is formed only for small sites (scores never
        need it: ``s² = tr(G Σ⁺ Gᵀ)``, theory label ``thm-cross-gradient``).

        Args:
            max_elements: refuse to form ``K`` with more entries than this
                (default :data:`TANGENT_GRAM_MAX_ELEMENTS`, 128 MiB of float64).

        Returns:
            float64 numpy array ``(p, p)``, ``p = d · k̃``.

        Raises:
            StatisticsError: if no examples were accumulated, or ``p² > max_elements``.
        """
        p = self.d * self.k
        if p * p > max_elements:
            raise StatisticsError(
                f"the tangent Gram K = I_d ⊗ Σ would have p² = {p}² = {p * p} entries, above "
                f"max_elements = {max_elements}; use feature_gram() (Σ, {self.k}×{self.k}) instead"
            )
        kron = np.kron(np.eye(self.d), self.feature_gram())
        order = self.theta_vector(np.arange(p).reshape(self.d, self.k))
        return kron[np.ix_(order, order)]

    def result(self, *, rtol: float | None = None, tol: float | None = None) -> SaturationResult:
        """Compute ``s² = tr(G Σ⁺ Gᵀ)`` and the other quantities.

        Args:
            rtol: relative eigenvalue cutoff for ``Σ`` (default :func:`default_rtol`).
            tol: saturation threshold (default :func:`default_tol`).

        Raises:
            StatisticsError: if no examples were accumulated.
        """
        if self.n == 0:
            raise StatisticsError("no examples were accumulated: the probe is empty")
        rtol = default_rtol(self.dtype, self.k) if rtol is None else float(rtol)
        sig, big_g = self.feature_gram(), self.cross_gradient()
        self._check_finite(sig, big_g)
        s2, rank_sigma, cutoff, inv = pinv_quadratic(sig, big_g, rtol)
        self._coef = big_g @ inv  # Π g (u) = G Σ⁻ φ̃(u)
        return self._finish(s2, self.theta_vector(big_g), self.d * rank_sigma, self.d * self.k, cutoff, rtol, tol)

    def _project_units(self, units: Tensor) -> Tensor:
        coef = torch.from_numpy(self._coef)
        if self.family.unit == "row":
            site = _rows_as_site(units.to(torch.float64), self.layout)
            phi = self._features(site.to(self.sigma.device)).reshape(units.shape[0], -1, self.k).cpu()
            return (phi @ coef.T).reshape(units.shape[0], -1)
        site = units.reshape(units.shape[0], *self.shape)
        phi = self._features(site.to(self.sigma.device)).cpu()
        return from_rows(phi @ coef.T, self.layout, site.shape).reshape(units.shape[0], -1)

    def theta_vector(self, mat: np.ndarray) -> np.ndarray:
        """Flatten a ``(d, k̃)`` matrix in the tangent-coordinate order ``(vec_row(W), c)``."""
        if self.family.bias:
            return np.concatenate([mat[:, :-1].reshape(-1), mat[:, -1]])
        return mat.reshape(-1).copy()

    def projector(self, *, rtol: float | None = None) -> TangentProjector:
        """The orthogonal projector onto ``T`` on this probe's units (see :class:`TangentProjector`)."""
        rtol = default_rtol(self.dtype or torch.float64, self.k) if rtol is None else rtol
        _, rank, _cutoff, inv = pinv_quadratic(self.feature_gram(), np.zeros((0, self.k)), rtol)
        return TangentProjector(self, inv, rank)


class TangentProjector:
    """Orthogonal projector ``Π`` onto the tangent space of a feature family on a probe.

    Acts on functions sampled at the probe's rows: an array ``m`` of shape
    ``(N, d)`` (one row per unit row ``u_i`` of the probe, ``N`` = number of rows, in
    the order of :func:`~depthsat_theory.families.base.to_rows` over the probe) maps to

    .. math::

        (Π m)(u_i) = M Σ^+ φ̃(u_i), \\qquad M = \\tfrac1n \\textstyle\\sum_j m(u_j) φ̃(u_j)^T,

    the least-squares fit of ``m`` by ``V φ̃`` in ``⟨·,·⟩`` (self-adjoint and
    idempotent in that inner product, and in the Euclidean one on ``R^{N d}``).
    Built by :meth:`FeatureStatistics.projector`; ``phi`` (the probe's ``φ̃`` rows) is
    set with :meth:`on`.
    """

    def __init__(self, stats: FeatureStatistics, sigma_pinv: np.ndarray, rank: int):
        self.stats = stats
        self.sigma_pinv = sigma_pinv
        self.rank = rank
        self.phi: np.ndarray | None = None

    def on(self, z: Tensor) -> TangentProjector:
        """Fix the probe's rows: ``z`` are the probe's site tensors ``(n, *shape)``."""
        phi = self.stats._features(z)
        self.phi = phi.reshape(-1, phi.shape[-1]).cpu().numpy()
        self.n = int(z.shape[0])
        return self

    def __call__(self, m: np.ndarray) -> np.ndarray:
        """Apply ``Π`` to ``m`` of shape ``(N, d)``; returns ``(N, d)`` float64."""
        if self.phi is None:
            raise StatisticsError("call .on(z) with the probe's site tensors first")
        m = np.asarray(m, dtype=np.float64)
        if m.shape != (self.phi.shape[0], self.stats.d):
            raise StatisticsError(f"m must have shape {(self.phi.shape[0], self.stats.d)}, got {m.shape}")
        big_m = m.T @ self.phi / self.n
        return self.phi @ (big_m @ self.sigma_pinv).T

    def to_scipy(self) -> spla.LinearOperator:
        """The projector as a :class:`scipy.sparse.linalg.LinearOperator` on ``R^{N d}``."""
        if self.phi is None:
            raise StatisticsError("call .on(z) with the probe's site tensors first")
        size = self.phi.shape[0] * self.stats.d
        shape = (self.phi.shape[0], self.stats.d)

        def mv(v):
            return self(np.asarray(v).reshape(shape)).reshape(-1)

        return spla.LinearOperator((size, size), matvec=mv, rmatvec=mv, dtype=np.float64)


#: Elements of site tensors held at once by the vmapped Gram products of GeneralStatistics.
_CHUNK_ELEMENTS = 1 << 22


class GeneralStatistics(_Accumulator):
    """Matrix-free statistics for a :class:`GeneralFamily` (any ``h(θ, u)``).

    Per batch, ``b += Σ A(u)ᵀ g(u)`` is one ``torch.func.vjp`` and the Gram matrix
    ``K += Σ A(u)ᵀ A(u)`` is formed column by column as ``Aᵀ(A e_i)`` (a ``jvp``
    followed by a ``vjp``, vmapped in chunks), so no Jacobian is stored; memory is
    ``O(p² + chunk · |batch|)``, time ``p`` jvp+vjp pairs per batch.

    Raises:
        FamilyError: if the family does not fit the site.
    """

    def __init__(self, family: GeneralFamily, shape, layout: str, *, pool_ties: bool = False):
        super().__init__(family, shape, layout, pool_ties=pool_ties)
        self.p = family.param_dim(self.shape)
        self.k_mat = torch.zeros(self.p, self.p, dtype=torch.float64)
        self.b = torch.zeros(self.p, dtype=torch.float64)

    def update(self, z: Tensor, g: Tensor, mask: Tensor | None = None) -> None:
        """Add a batch (see :meth:`FeatureStatistics.update`, including ``mask``)."""
        mask = self._row_mask(z, g, mask)
        self._common(z, g, mask)
        z64 = z.detach().to(torch.float64)
        g64 = g.detach().to(torch.float64)
        layout = self.layout
        if mask is not None:  # row-wise family: the kept rows as a batch of vectors
            z64, g64, layout = z64[mask], g64[mask], "vector"
        theta0 = torch.zeros(self.p, dtype=torch.float64, device=z.device)

        def h(theta):
            return self.family.functional(theta, z64, layout)

        _, vjp_fn = torch.func.vjp(h, theta0)
        self.b = self.b.to(z.device) + vjp_fn(g64)[0]

        def gram_column(v: Tensor) -> Tensor:  # Aᵀ(A v): one jvp and one vjp
            return vjp_fn(torch.func.jvp(h, (theta0,), (v,))[1])[0]

        eye = torch.eye(self.p, dtype=torch.float64, device=z.device)
        chunk = max(1, min(self.p, _CHUNK_ELEMENTS // max(z.numel(), 1)))
        cols = torch.func.vmap(gram_column, chunk_size=chunk)(eye)
        if not (bool(torch.isfinite(cols).all()) and bool(torch.isfinite(self.b).all())):
            raise StatisticsError(
                f"the tangent map ∂θ h(θ, u) at θ = 0 of family {self.family.spec!r} is NaN or Inf "
                f"on this batch: the family is not differentiable at the origin (theory label "
                f"asm-differentiable; e.g. sqrt(θ) or u**θ), or its tangent overflows float64"
            )
        self.k_mat = self.k_mat.to(z.device) + 0.5 * (cols + cols.T)
        if mask is not None:
            self.units += int(mask.sum())
        else:
            self.units += int(z.shape[0]) * (to_rows(z, self.layout).shape[1] if self.family.unit == "row" else 1)

    def merge(self, other: GeneralStatistics) -> GeneralStatistics:
        """Add another accumulator's sums; returns self."""
        self._merge_common(other)
        self.k_mat += other.k_mat.to(self.k_mat.device)
        self.b += other.b.to(self.b.device)
        return self

    def tangent_gram(self) -> np.ndarray:
        """``K = E[Σ_u A(u)ᵀ A(u)]``, the per-example mean tangent Gram (def-score).

        Returns:
            float64 numpy array ``(p, p)``, ``p`` the family's number of tangent parameters.

        Raises:
            StatisticsError: if no examples were accumulated.
        """
        self._require_examples()
        return (self.k_mat / self.n).cpu().numpy()

    def gradient(self) -> np.ndarray:
        """``b = E[Σ_u A(u)ᵀ g(u)]``, equal to autograd's gradient of the mean loss at ``θ = 0``.

        Returns:
            float64 numpy vector ``(p,)`` in (loss units) per example per unit of ``θ``.

        Raises:
            StatisticsError: if no examples were accumulated.
        """
        self._require_examples()
        return (self.b / self.n).cpu().numpy()

    def result(self, *, rtol: float | None = None, tol: float | None = None) -> SaturationResult:
        """Compute ``s² = bᵀ K⁺ b`` (eigh with a relative cutoff) and the other quantities."""
        if self.n == 0:
            raise StatisticsError("no examples were accumulated: the probe is empty")
        rtol = default_rtol(self.dtype, self.p) if rtol is None else float(rtol)
        kmat, b = self.tangent_gram(), self.gradient()
        self._check_finite(kmat, b)
        s2, rank, cutoff, inv = pinv_quadratic(kmat, b[None, :], rtol)
        self._coef = torch.from_numpy(inv @ b)  # Π g (u) = A(u) K⁻ b
        return self._finish(s2, b, rank, self.p, cutoff, rtol, tol)

    def _project_units(self, units: Tensor) -> Tensor:
        theta0 = torch.zeros(self.p, dtype=torch.float64)
        if self.family.unit == "row":
            site, layout = units.to(torch.float64), "vector"
        else:
            site, layout = units.reshape(units.shape[0], *self.shape).to(torch.float64), self.layout
        _, out = torch.func.jvp(lambda th: self.family.functional(th, site, layout), (theta0,), (self._coef,))
        return out.reshape(units.shape[0], -1)


def statistics_for(family: ResidualFamily, shape, layout: str, *, pool_ties: bool = False):
    """The right streaming accumulator for a family at a site.

    Returns:
        :class:`FeatureStatistics` for feature families (cross-gradient path),
        :class:`GeneralStatistics` otherwise (matrix-free ``torch.func`` path).
    """
    if isinstance(family, FeatureFamily):
        return FeatureStatistics(family, shape, layout, pool_ties=pool_ties)
    if isinstance(family, GeneralFamily):
        return GeneralStatistics(family, shape, layout, pool_ties=pool_ties)
    raise FamilyError(f"no statistics for family type {type(family).__name__}")
