r"""Tangent statistics, the projector onto the tangent space, and saturation scores.

Everything here is computed on the *empirical measure* of a probe of ``n`` examples:
for functions of the site tensor, ``⟨u, v⟩ = (1/n) Σ_x Σ_{units of x} u·v``
(theory/definitions.md, def-setting, the intensity measure), so that ``b`` below is exactly autograd's
gradient of the per-example-mean loss.  With ``g`` the activation gradient of the
per-example loss (nats per example):

.. math::

    K = E[A^T A], \quad b = E[A^T g], \quad s = \lVert Π g \rVert
      = \sqrt{b^T K^+ b} = \sup_{Av \neq 0} \frac{b^T v}{\lVert A v \rVert}.

For zero-output feature families ``K = I_d ⊗ Σ`` and ``b = vec(G)`` with the
cross-gradient ``G = E[Σ_r g_r φ̃_rᵀ]`` and ``Σ = E[Σ_r φ̃_r φ̃_rᵀ]``, so
``s² = tr(G Σ⁺ Gᵀ)`` (theory label ``thm-cross-gradient``); no Jacobian is formed.
Statistics stream in float64: memory is ``O(d k̃ + k̃²)`` per site whatever the
probe size (``O(p²)`` for general families), except the optional exact-tie pooling
for the raw score ``r`` which stores one ``d``-vector per distinct unit.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from depthsat_theory.families import ResidualFamily, to_rows
from depthsat_theory.statistics.linalg import (
    NOISE_ALPHA,
    Spectrum,
    dropped_score,
    gradient_rounding,
    noise_threshold,
    over_budget,
    score_error,
    unit_roundoff,
)
from depthsat_theory.statistics.protocol import Reduction, StreamingStatistic, TiePool
from depthsat_theory.statistics.result import SaturationResult, StatisticsError
from depthsat_theory.vocabulary import Layout, Verdict

__all__ = ["TANGENT_GRAM_MAX_ELEMENTS", "TangentStatistics", "check_pair"]

#: Largest number of entries :meth:`FeatureStatistics.tangent_gram` forms (128 MiB of float64).
TANGENT_GRAM_MAX_ELEMENTS = 1 << 24


def _check_pair_shapes(z: Tensor, g: Tensor) -> None:
    """The shape and dtype part of :func:`check_pair` (no pass over the values)."""
    if z.shape != g.shape:
        raise StatisticsError(
            f"activations z {tuple(z.shape)} and activation gradients g {tuple(g.shape)} must have the same shape"
        )
    if z.shape[0] == 0:
        raise StatisticsError("empty batch: the probe has no examples")
    for name, t in (("z", z), ("g", g)):
        if not torch.is_floating_point(t):
            raise StatisticsError(f"{name} must be a floating tensor, got {t.dtype}")


def check_pair(z: Tensor, g: Tensor) -> None:
    """Validate a batch of activations ``z`` and activation gradients ``g`` before it is streamed.

    Args:
        z: activations ``(B, *shape)``, floating.
        g: activation gradients, same shape and floating.

    Raises:
        StatisticsError: if ``z`` and ``g`` differ in shape, the batch is empty, or either is not
            a floating tensor or contains NaN or Inf.
    """
    _check_pair_shapes(z, g)
    for name, t in (("z", z), ("g", g)):
        if not torch.isfinite(t).all():
            raise StatisticsError(f"{name} contains NaN or Inf; fix the probe before scoring")


#: ``forward_eps`` state value → the dtype of the forward passes seen (``0``: none yet).
_EPS_DTYPES = {float(torch.finfo(t).eps): t for t in (torch.bfloat16, torch.float16, torch.float32, torch.float64)}


def _significant_dropped(spec: Spectrum, mass: np.ndarray, noise_moment: np.ndarray, n: int, alpha: float):
    """Which dropped directions in :attr:`Spectrum.band` carry a gradient the noise test calls real.

    For a dropped direction ``u = D^{-1/2} v`` the statistic ``n ‖E_n[X u]‖² / E_n‖X u‖²`` is the noise
    test's ratio on that direction alone (scale-free, so a tiny amplitude does not hide it); it is
    compared with ``χ²_{1, 1−α/m}`` over the ``m`` band directions. A direction created by rounding
    (e.g. the exact dependency of a LayerNorm output) carries gradient uncorrelated with it and
    passes with probability about ``α/m``.
    """
    flagged = np.zeros(mass.shape, dtype=bool)
    idx = np.flatnonzero(spec.band)
    if n < 2 or not idx.size:
        return flagged
    u = spec.dropped[:, idx] * spec.scale[:, None]
    var = np.einsum("ij,ij->j", noise_moment @ u, u)
    ratio = np.where(var > 0, n * mass[idx] ** 2 / np.where(var > 0, var, 1.0), 0.0)
    flagged[idx] = ratio > noise_threshold(alpha / idx.size)
    return flagged


class TangentStatistics(StreamingStatistic):
    """Shared streaming state: counts, ‖g‖², max ‖g‖, ‖z‖², the forward dtype, tie pooling.

    State fields (:class:`~depthsat_theory.statistics.protocol.StreamingStatistic`):
    ``n``, ``units``, ``g_sq``, ``z_sq``, ``batches`` (sums), ``g_max``, ``batch_units_max`` (the
    largest batch, in units: with ``batches`` the length of the float64 sums) and ``forward_eps`` (maxima:
    the machine epsilon of the coarsest dtype of the site tensors seen, so float16 wins over
    float32 and float32 over float64; bfloat16 is coarsest; ``feature_eps`` likewise for the site tensors ``z``
    alone, which set the features' resolution), and the child ``ties``
    (:class:`~depthsat_theory.statistics.protocol.TiePool`).
    """

    family: ResidualFamily

    def __init__(self, family: ResidualFamily, shape, layout: str, *, pool_ties: bool):
        super().__init__()
        family.check_site(tuple(shape), layout)
        self.family = family
        self.shape = tuple(int(s) for s in shape)
        self.layout = Layout(layout)
        self.pool_ties = pool_ties
        scalar = torch.zeros((), dtype=torch.float64)
        for name in ("n", "units", "g_sq", "z_sq"):
            self.add_state(name, scalar, Reduction.SUM)
        self.add_state("batches", scalar, Reduction.SUM)
        for name in ("g_max", "forward_eps", "batch_units_max", "feature_eps"):
            self.add_state(name, scalar, Reduction.MAX)
        self.ties = TiePool()
        self.add_child("ties", self.ties)

    # read-only views of the state, in the units of the docstrings
    @property
    def n(self) -> int:
        """Number of probe examples accumulated."""
        return round(float(self.states["n"]))

    @property
    def units(self) -> int:
        """Number of units (rows, or whole tensors) accumulated."""
        return round(float(self.states["units"]))

    @property
    def g_sq(self) -> float:
        """``Σ_x ‖g(x)‖_F²`` over the probe (a sum, not a mean)."""
        return float(self.states["g_sq"])

    @property
    def z_sq(self) -> float:
        """``Σ_x ‖z(x)‖_F²`` over the kept units of the probe (a sum, not a mean)."""
        return float(self.states["z_sq"])

    @property
    def g_max(self) -> float:
        """``max_x ‖g(x)‖_F`` over the probe."""
        return float(self.states["g_max"])

    @property
    def dtype(self) -> torch.dtype | None:
        """The coarsest dtype of the forward passes seen (``None`` before any batch)."""
        return _EPS_DTYPES.get(float(self.states["forward_eps"]))

    @property
    def feature_dtype(self) -> torch.dtype | None:
        """The coarsest dtype of the site tensors ``z`` seen (``None`` before any batch): the features' resolution.

        A float64 ``z`` with a float32 ``g`` keeps float64 features (theory/numerics.md, ``def-resolution``).
        """
        return _EPS_DTYPES.get(float(self.states["feature_eps"]))

    def load_state_dict(self, state, *, strict: bool = True) -> None:
        """:meth:`StreamingStatistic.load_state_dict`, also for a state saved before ``feature_eps`` existed.

        Such a state gets ``feature_eps = forward_eps``: the coarser dtype, which set the features' resolution then.

        Args:
            state: name → tensor (a checkpoint's statistic).
            strict: require every declared field, ``feature_eps`` excepted as above.

        Raises:
            KeyError: a missing field under ``strict``; ValueError: a field of the wrong size.
        """
        if "feature_eps" not in state and "forward_eps" in state:
            state = {**state, "feature_eps": state["forward_eps"]}  # the coarser dtype: the former, safe reading
        super().load_state_dict(state, strict=strict)

    def check_compatible(self, other: StreamingStatistic) -> None:
        """Raise unless ``other`` has the same family, site shape, layout and tie pooling.

        Args:
            other: the statistic to merge.

        Raises:
            StatisticsError: naming what differs (merging shards of different configurations
                would silently give wrong numbers: e.g. a tie pool holding part of the probe).
        """
        if not isinstance(other, TangentStatistics):
            raise StatisticsError(f"cannot merge a {type(other).__name__} into {type(self).__name__}")
        mine = {"family": self.family.spec, "shape": self.shape, "layout": self.layout, "pool_ties": self.pool_ties}
        theirs = {
            "family": other.family.spec,
            "shape": other.shape,
            "layout": other.layout,
            "pool_ties": other.pool_ties,
        }
        diff = [f"{k} {theirs[k]!r} != {mine[k]!r}" for k in mine if theirs[k] != mine[k]]
        if diff:
            raise StatisticsError(f"cannot merge statistics of another configuration: {'; '.join(diff)}")
        try:
            super().check_compatible(other)
        except (TypeError, ValueError) as exc:
            raise StatisticsError(f"cannot merge statistics of another configuration: {exc}") from None

    def _row_mask(self, z: Tensor, g: Tensor, mask: Tensor | None) -> Tensor | None:
        """Validate a padding mask; ``None`` when there is nothing to drop.

        Padded rows can be dropped at sequence sites for row-wise families and for
        sequence-level families that honour the mask themselves (``family.masks_padding``,
        e.g. ``attention``: padded keys excluded); for other families only an all-``True``
        mask is accepted.

        Raises:
            StatisticsError: a mask of the wrong dtype or shape, ``g ≠ 0`` at a padded
                position, padding at a site or family that cannot drop it, or padding with
                tie pooling for a sequence-level family.
        """
        if mask is None:
            return None
        mask = torch.as_tensor(mask, device=z.device)
        if mask.dtype != torch.bool:
            raise StatisticsError(f"the padding mask must be bool (True at real tokens), got {mask.dtype}")
        if self.layout != Layout.SEQUENCE or tuple(mask.shape) != tuple(z.shape[:2]):
            raise StatisticsError(
                f"the padding mask {tuple(mask.shape)} does not match the site tensors' (B, T) = "
                f"{tuple(z.shape[:2])} of a sequence site (this site has layout '{self.layout}')"
            )
        if bool((g.detach()[~mask] != 0).any()):
            raise StatisticsError(
                "the activation gradient is nonzero at padded positions: the model "
                "or the loss reads padding (theory/definitions.md, def-setting: padding is excluded)"
            )
        if bool(mask.all()):
            return None
        if self.family.unit != "row" and not getattr(self.family, "masks_padding", False):
            raise StatisticsError(
                f"family {self.family.spec!r} (unit {self.family.unit!r}) cannot drop padded rows: "
                f"use a row-wise family or one that masks padding (attention), or pad no example"
            )
        if self.family.unit != "row" and self.pool_ties:
            raise StatisticsError(
                f"tie pooling (realizability, --rho) of the sequence-level family {self.family.spec!r} "
                f"needs unpadded batches (a unit is a whole sequence): drop realizability or pad no example"
            )
        return mask

    def _common(
        self, z: Tensor, g: Tensor, mask: Tensor | None = None, *, to_float64: bool = True
    ) -> tuple[Tensor, Tensor]:
        """Validate a batch and add its counts and norms; returns ``g`` and ``‖g(x)‖_F²`` ``(B,)`` float64.

        ``g`` is returned detached, in float64 (``to_float64``, default) or in its own dtype; the norms are
        float64 sums either way.  The value checks read reductions the statistics need anyway (one fused
        pass per tensor); the elementwise scans that name the fault run only when a reduction is not finite
        or tiny.
        """
        _check_pair_shapes(z, g)
        if tuple(z.shape[1:]) != self.shape:
            raise StatisticsError(
                f"site tensors have per-example shape {tuple(z.shape[1:])}, the statistics were set up for {self.shape}"
            )
        g64 = g.detach().to(torch.float64) if to_float64 else g.detach()
        per_ex = torch.linalg.vector_norm(g64.flatten(1), dim=1, dtype=torch.float64).square()
        z_kept = z.detach() if mask is None else z.detach()[mask].unsqueeze(1)
        z_sq = float(torch.linalg.vector_norm(z_kept, dtype=torch.float64).square())
        g_sq = float(per_ex.sum())
        if not (math.isfinite(g_sq) and math.isfinite(z_sq)):
            check_pair(z, g)  # NaN or Inf names itself; finite overflow is caught by result()
        for name, t, sq in (("z", z, z_sq), ("g", g, g_sq)):
            if sq < 1e-250 and 0.0 < float(t.detach().abs().max()) < 1e-150:
                raise StatisticsError(
                    f"{name} is below ~1e-150 everywhere: its squares underflow float64; rescale it "
                    f"(s is homogeneous of degree 1 in g, and T is unchanged by rescaling z for the linear family)"
                )
        if bool((per_ex == 0).any()) and bool((g64.flatten(1)[per_ex == 0] != 0).any()):
            raise StatisticsError(
                "activation gradients underflow when squared in float64 (|g| below ~1e-154); "
                "rescale g (every score is homogeneous of degree 1 in g)"
            )
        st = self.states
        st["batches"] += 1
        coarsest = max(torch.finfo(z.dtype).eps, torch.finfo(g.dtype).eps)
        st["forward_eps"] = torch.clamp_min(st["forward_eps"], coarsest)
        st["feature_eps"] = torch.clamp_min(st["feature_eps"], float(torch.finfo(z.dtype).eps))
        st["g_sq"] += g_sq
        st["g_max"] = torch.clamp_min(st["g_max"], float(per_ex.max().sqrt()))
        st["z_sq"] += z_sq
        st["n"] += int(z.shape[0])
        if self.pool_ties:
            g_pool = g64.to(torch.float64)
            self._pool(z_kept, g_pool if mask is None else g_pool[mask].unsqueeze(1))
        return g64, per_ex

    def _pool(self, z: Tensor, g64: Tensor) -> None:
        if self.family.unit == "row":
            zu = to_rows(z, self.layout)
            zu = zu.reshape(-1, zu.shape[-1])
            gu = to_rows(g64, self.layout).reshape(zu.shape[0], -1)
        else:
            zu = z.reshape(z.shape[0], -1)
            gu = g64.reshape(g64.shape[0], -1)
        self.ties.update(zu, gu)

    def _project_units(self, units: Tensor) -> Tensor:
        """``(Π g)`` evaluated at pooled units ``(N, *)`` (flattened like the pooled ``g``)."""
        raise NotImplementedError

    def _pooled_quantities(self) -> tuple[float, float]:
        """``(r̂², ‖m̂ − Π m̂‖²)`` from the pooled units (``Π m̂ = Π g``, theory/definitions.md)."""
        units, means, counts = self.ties.result()
        pooled = round(float(counts.sum()))
        seen = self.n if self.family.unit == "tensor" else self.units  # a tensor unit is a whole example
        if pooled != seen:
            raise StatisticsError(
                f"the tie pool holds {pooled} of the {seen} units seen: it was merged with or loaded "
                f"from a statistic without pool_ties=True, so r̂ and ρ̂ cannot be computed"
            )
        r2 = float((counts * means.pow(2).sum(1)).sum()) / self.n
        resid = means - self._project_units(units).to(torch.float64).cpu().reshape(means.shape)
        defect2 = float((counts * resid.pow(2).sum(1)).sum()) / self.n
        return r2, defect2

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

    def _count_units(self, added: int) -> None:
        """Add a batch's ``added`` units (and keep the largest batch, for the rounding bound)."""
        self.states["units"] += added
        self.states["batch_units_max"] = torch.clamp_min(self.states["batch_units_max"], float(added))

    def _summands(self) -> int:
        """Length of the float64 sums: the largest batch in units plus the number of batches."""
        return round(float(self.states["batch_units_max"]) + float(self.states["batches"]))

    def _rounding_inputs(self) -> tuple[torch.dtype, int, int]:
        """``(u_in's dtype, L, L_32)`` of thm-score-error for what was streamed.

        Float32 products round ``z``, ``φ̃`` and ``g`` to float32, so ``u_in ≥ u32`` then.
        """
        dtype = self.dtype or torch.float64
        fast = self._product_summands()
        if fast and unit_roundoff(dtype) < unit_roundoff(torch.float32):
            dtype = torch.float32
        return dtype, self._summands(), fast

    def _features_dtype(self) -> torch.dtype:
        """The dtype of ``u_in`` for the features (``ε_M`` and the data resolution).

        ``z``'s, at least float32 with float32 products (which round the features to float32).
        """
        dtype = self.feature_dtype or torch.float64
        if self._product_summands() and unit_roundoff(dtype) < unit_roundoff(torch.float32):
            dtype = torch.float32
        return dtype

    def _product_summands(self) -> int:
        """Length ``L_32`` of the longest float32 sum of the per-batch products (``0``: none)."""
        return round(float(self.states["product_units_max"])) if "product_units_max" in self.states else 0

    def _unresolved(
        self, spec: Spectrum, grad_rows, noise_moment, ag_rms: float, alpha: float, budget: float = 0.0
    ) -> int:
        """How many dropped directions could carry score the verdict cannot absorb (:meth:`_finish`).

        theory/numerics.md, ``lem-dropped-score``: a dropped direction above the data's rounding level (rounding
        cannot have created it) could add ``c_v`` (:func:`~depthsat_theory.statistics.linalg.dropped_score`) to the
        score; the largest of them count until the rest fit in ``budget``.  On a float64 Gram, whose eigenvalues
        carry errors far above that level, every dropped direction may be such a one.  Below the level a direction
        counts when it carries activation gradient beyond rounding or passes the noise test on its own.  With float32
        products every dropped direction counts: that Gram cannot tell a real one from its own rounding.
        """
        if grad_rows is None:
            return spec.unresolved
        if not spec.dropped.shape[1]:
            return 0
        _, summands, fast = self._rounding_inputs()
        if fast:
            return int(spec.dropped.shape[1])
        fdtype = self._features_dtype()
        mass = np.linalg.norm((grad_rows * spec.scale) @ spec.dropped, axis=0)
        contribution, real = dropped_score(spec, mass, ag_rms=ag_rms, dtype=fdtype, summands=summands)
        flagged = over_budget(contribution, budget)
        level = gradient_rounding(ag_rms=ag_rms, dtype=fdtype, summands=summands, k=spec.scale.size, product_summands=0)
        flagged |= ~real & (mass > level)
        if noise_moment is not None and spec.band.any():
            flagged |= _significant_dropped(spec, mass, noise_moment, self.n, alpha)
        return int(flagged.sum())

    def _finish(
        self,
        spec: Spectrum,
        score2: float,
        b: np.ndarray,
        p: int,
        tol: float | None,
        *,
        rank: int | None = None,
        q_trace: float = math.nan,
        alpha: float = NOISE_ALPHA,
        grad_rows: np.ndarray | None = None,
        noise_moment: np.ndarray | None = None,
        q_trace_upper: float | None = None,
    ) -> SaturationResult:
        """Assemble the :class:`SaturationResult` (theory/numerics.md: error bound and noise test).

        Args:
            spec: the resolved spectrum of the unit-diagonal Gram.
            score2: ``ŝ² = tr(G Σ⁻ Gᵀ)`` (or ``bᵀ K⁻ b``).
            b: the gradient ``b``.
            p: number of tangent coordinates.
            tol: an explicit saturation threshold (default: the rounding bound).
            rank: the tangent rank (default ``spec.rank``).
            q_trace: ``v̂ = tr(Σ⁻ E[XᵀX])`` of the noise test (``nan``: not streamed).
            alpha: level of the noise test.
            grad_rows: the gradient as rows over the Gram's coordinates (``G`` ``(d, k)`` or ``b``
                ``(1, p)``): dropped directions that could add more score than ``(tol + e)² − (ŝ + e)²`` allows
                (``lem-dropped-score``: every dropped direction of a float64 Gram may), or, at rounding-level
                amplitude, carry more of it than rounding, are unresolved.
            noise_moment: ``E[XᵀX]`` over the Gram's coordinates (``(k, k)`` or ``(p, p)``): a dropped
                direction the arithmetic resolves (:attr:`Spectrum.band`) whose gradient passes the
                noise test (Bonferroni over those directions) is unresolved too, however small its
                amplitude (``thm-noise-test`` on that direction alone).
            q_trace_upper: an upper bound on the exact-arithmetic ``v̂`` (``None``: ``v̂`` itself), which the noise
                test uses in place of ``v̂``; with float32 products the test also uses ``ŝ − e``: ``n (ŝ − e)₊² / v̂_up``,
                so that rounding cannot make the score significant where the exact-arithmetic test would not
                (theory/numerics.md).  A streamed ``v̂`` or bound that is not a positive finite number while ``ŝ > 0``
                leaves no test: the verdict cannot be *improvable* (:attr:`SaturationResult.noise_unusable`).
        """
        self._require_examples()
        dtype, summands, fast = self._rounding_inputs()
        ag_rms = math.sqrt(self.g_sq / self.n)
        score = math.sqrt(max(score2, 0.0))
        err = score_error(
            spec,
            score=score,
            ag_rms=ag_rms,
            dtype=dtype,
            summands=summands,
            product_summands=fast,
            feature_dtype=self._features_dtype(),
        )
        tol = err if tol is None else float(tol)
        raw = rho = float("nan")
        if self.pool_ties:
            r2, defect2 = self._pooled_quantities()
            # r̂ ≤ AG_rms holds exactly on the probe (Jensen on each tie class); the two are
            # summed in different orders, so clamp a rounding-level excess (|Δ| ≤ 1e-12 r̂)
            raw = math.sqrt(r2)
            if ag_rms < raw <= ag_rms * (1 + 1e-12):
                raw = ag_rms
            if raw > 0:
                rho = math.sqrt(defect2) / raw
        # s ≤ r̂ ≤ AG_rms holds exactly on the probe (Π is a contraction; Jensen on tie classes):
        # rounding past these bounds moves ŝ away from the truth, so it is clipped back
        score = min(score, ag_rms, raw) if raw == raw else min(score, ag_rms)
        # "saturated" promises s ≤ tol + e: the kept part is within ŝ + e, the dropped part may add the rest
        budget = math.sqrt(max((tol + err) ** 2 - (score + err) ** 2, 0.0)) if math.isfinite(tol + err) else 0.0
        unresolved = self._unresolved(spec, grad_rows, noise_moment, ag_rms, alpha, budget)
        rank = spec.rank if rank is None else int(rank)
        n = self.n
        v_test = q_trace if q_trace_upper is None else max(q_trace, q_trace_upper)
        noise: dict[str, Any] = dict(
            noise_variance=q_trace,
            noise_variance_upper=math.nan if q_trace_upper is None else float(v_test),
            alpha=float(alpha),
            noise_threshold=noise_threshold(alpha),
        )
        if n < 2 or (q_trace == 0 and score == 0):  # one example, or nothing to test (g = 0, or T = {0})
            noise.update(noise_ratio=0.0)
        elif q_trace > 0 and math.isfinite(q_trace) and math.isfinite(v_test):
            s2u = (n * score * score - q_trace) / (n - 1)
            s_test = max(score - err, 0.0) if fast else score  # float32 products: lower ŝ as well as upper v̂
            noise.update(
                noise_ratio=n * s_test * s_test / v_test,
                score_squared_unbiased=s2u,
                score_squared_se=q_trace * math.sqrt(4 * max(s2u, 0.0) / (n * q_trace) + 2 / (n * (n - 1))),
            )
        # else: v̂ not streamed (nan), or not a positive finite number: no ratio (noise_unusable demotes)
        res = SaturationResult(
            score=score,
            raw_score=raw,
            ag_rms=ag_rms,
            ag_max=self.g_max,
            realizability_defect=rho,
            relative_score=score / ag_rms if ag_rms > 0 else float("nan"),
            activation_scaled_score=score * math.sqrt(self.z_sq / n),
            tangent_rank=rank,
            tangent_dim=int(p),
            degenerate=rank == 0,
            saturated=False,
            tol=tol,
            cutoff=float(spec.cutoff),
            rtol=float(spec.rtol),
            n=n,
            units=self.units,
            family=self.family.spec,
            unit=self.family.unit,
            dtype=str(dtype).replace("torch.", ""),
            gradient=b,
            score_error=err,
            unresolved=unresolved,
            **noise,
        )
        res.saturated = res.verdict is Verdict.SATURATED
        return res
