r"""Finite-sample confidence bounds for the saturation score (theory label ``thm-finite-sample``).

A probe of ``n`` examples drawn i.i.d. from the data distribution, independently of
training, gives the estimate ``ŝ`` of the population score ``s`` of a zero-output
feature family at one site (:mod:`depthsat_theory.statistics.tangent`).  This module turns the
estimate into statements users can act on (theory page ``theory/finite-sample.md``):

- :func:`interval_from_moments` / :meth:`BoundStatistics.interval`: a ``(1 − δ)``
  confidence interval ``[score_lower, score_upper]`` for ``s`` (or for the ridge score
  ``s_λ``), label ``thm-finite-sample``, with the verdict *certified improvable*
  (``cor-certified-improvable``), *certified ε-saturated* (``cor-certified-saturated``)
  or *not certified*, the family-free certificate from ``AG_rms`` / ``AG_max``
  (``cor-agmax-certificate-finite``), the plug-in ``ŝ²`` and the unbiased U-statistic
  of ``s²``, an optional bootstrap interval (approximate, labelled as such) and the
  looseness ratio of the bound against it;
- :func:`plan_bound`: the half-width ``h_n`` from ``(n, δ, constants)`` and the probe
  size needed for a target half-width (the sample-size calculator; the formulas are
  derived with sympy in :mod:`depthsat_theory.bounds.formula`);
- :class:`SequentialCertifier`: the union-bound (anytime-valid over checkpoints)
  variant for a probe that grows batch by batch, ``thm-sequential``.

Notation (per example ``x`` with units ``t``): ``G_x = Σ_t g_t φ̃_tᵀ`` (``d × k``),
``Σ_x = Σ_t φ̃_t φ̃_tᵀ`` (``k × k``); ``G = E G_x``, ``Σ = E Σ_x``, ``Σ_λ = Σ + λ I``;
``s_λ² = tr(G Σ_λ⁺ Gᵀ)`` (``s_0 = s``); leverage ``ℓ_λ(x) = tr(Σ_λ⁺ Σ_x)``.
Constants of the bound:

- ``γ`` (``grad_max``): an almost-sure bound on ``‖g(x)‖_F`` (whole site tensor);
- ``L`` (``leverage_max``): an almost-sure bound on ``ℓ_λ(x)``; or derived as
  ``B² / (μ + λ)`` from ``B`` (``feature_norm_max``, a bound on
  ``(Σ_t ‖φ̃_t‖²)^{1/2}``) and ``μ`` (``eig_floor``, a floor on the nonzero eigenvalues
  of ``Σ``) and/or the ridge ``λ > 0``;
- ``V`` (``variance``): a bound on ``E ‖G_x Σ_λ^{+1/2}‖_F² = E[‖g‖² ℓ]``-type second
  moment; when not given it is bounded from the probe by empirical Bernstein
  (rigorous given ``γ`` and ``L``);
- ``D`` (``dim``): a bound on ``rank Σ`` (default: ``k``, and ``min(k, ⌊L⌋)`` for
  ``λ = 0`` because ``rank Σ = E ℓ_0 ≤ L``).

When ``γ`` or ``L`` are not given, the probe's maxima are used instead and the result
says so: a probe maximum is a *lower* bound of the essential supremum (exact only when
the probe enumerates a finite population), so such an interval is a plug-in, not a
guarantee.  Every returned object lists each constant with its source
(``user``, ``probe`` or ``derived``).

Memory: :class:`BoundStatistics` streams ``O(d k + k²)`` per site (the sums of
``Σ_x``, ``G_x`` and ``G_xᵀ G_x``); only the bootstrap and the exact probe maximum of
the leverage need the probe's rows in memory (``keep_probe=True``, ``O(n·units·(d+k))``).
Units: scores in loss units per unit function-space step (e.g. nats per example).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from numbers import Real

import numpy as np
import torch
from torch import Tensor

from depthsat_theory.families import FamilyError, FeatureFamily
from depthsat_theory.statistics import default_rtol, pinv_quadratic

__all__ = [
    "CERTIFIED_IMPROVABLE",
    "CERTIFIED_SATURATED",
    "NOT_CERTIFIED",
    "BoundError",
    "BoundPlan",
    "Constant",
    "Estimate",
    "ProbeMoments",
    "ScoreInterval",
    "SequentialCertifier",
    "ag_rms_upper",
    "bootstrap_interval",
    "bound_report",
    "check_delta",
    "estimate",
    "halfwidth",
    "interval_from_moments",
    "plan_bound",
    "required_n",
    "score_report",
    "spending",
    "unbiased_score_squared",
]

CERTIFIED_IMPROVABLE = "certified improvable"
CERTIFIED_SATURATED = "certified ε-saturated"
NOT_CERTIFIED = "not certified"
DEGENERATE = "degenerate (T = {0})"

#: CLI spelling of each constant, used in error messages.
_FLAGS = {
    "delta": "--delta",
    "n": "--n",
    "epsilon": "--epsilon",
    "grad_max": "--grad-max",
    "leverage_max": "--leverage-max",
    "feature_norm_max": "--feature-norm-max",
    "eig_floor": "--eig-floor",
    "ridge": "--ridge",
    "variance": "--variance",
    "dim": "--dim",
    "score_max": "--score-max",
    "candidates": "--candidates",
    "bootstrap": "--bootstrap",
}

_PROBE_MAX_NOTE = (
    "probe maximum: a lower bound of the essential supremum (exact only when the "
    "probe enumerates a finite population), so the interval is a plug-in, not a "
    "guarantee"
)


class BoundError(ValueError):
    """Bad input to a finite-sample bound (δ, n, ε or a constant out of range or missing)."""


#: relative rounding slack when comparing a user's almost-sure bound with the probe's maximum
_SLACK = 1e-9


# ----------------------------------------------------------------------------- validation
def _name(key: str) -> str:
    return f"{key} ({_FLAGS[key]})" if key in _FLAGS else key


def _number(key: str, value, *, positive: bool = False, allow_none: bool = True) -> float | None:
    """Validate a real constant: finite, ``≥ 0`` (``> 0`` when ``positive``)."""
    if value is None:
        if allow_none:
            return None
        raise BoundError(f"missing constant {_name(key)}")
    if isinstance(value, bool) or not isinstance(value, (Real, np.floating, np.integer)):
        raise BoundError(f"{_name(key)} must be a number, got {value!r}")
    val = float(value)
    if math.isnan(val):
        raise BoundError(f"{_name(key)} is NaN")
    if math.isinf(val):
        raise BoundError(f"{_name(key)} must be finite, got {val}")
    if positive and val <= 0:
        raise BoundError(f"{_name(key)} must be > 0, got {val:g}")
    if val < 0:
        raise BoundError(f"{_name(key)} must be >= 0, got {val:g}")
    return val


def check_delta(delta) -> float:
    """Validate a confidence level ``δ ∈ (0, 1)``.

    Raises:
        BoundError: if ``δ`` is missing, not a number, NaN, or outside ``(0, 1)``.
    """
    if delta is None:
        raise BoundError(f"missing {_name('delta')}")
    if isinstance(delta, bool) or not isinstance(delta, (Real, np.floating, np.integer)):
        raise BoundError(f"{_name('delta')} must be a number in (0, 1), got {delta!r}")
    val = float(delta)
    if not 0.0 < val < 1.0:  # also rejects NaN
        raise BoundError(f"{_name('delta')} must be in (0, 1), got {delta}")
    return val


def check_n(n, key: str = "n") -> int:
    """Validate a probe size (a positive integer).

    Raises:
        BoundError: if ``n`` is not an integer ``≥ 1``.
    """
    if isinstance(n, bool) or not isinstance(n, (Real, np.integer)):
        raise BoundError(f"{_name(key)} must be a positive integer, got {n!r}")
    if isinstance(n, float) and (math.isnan(n) or n != int(n)):
        raise BoundError(f"{_name(key)} must be a positive integer, got {n}")
    if int(n) <= 0:
        raise BoundError(f"{_name(key)} must be a positive integer (n >= 1), got {n}")
    return int(n)


# ----------------------------------------------------------------------------- constants
@dataclass(frozen=True)
class Constant:
    """One constant of the bound, with where it came from.

    Attributes:
        symbol: the symbol in ``theory/finite-sample.md`` (``γ``, ``L``, ``V``, …).
        value: its value.
        source: ``"user"`` (given), ``"probe"`` (estimated from the probe) or
            ``"derived"`` (computed from other constants, rigorously).
        note: what the value means and whether it is a guarantee.
    """

    symbol: str
    value: float
    source: str
    note: str

    def to_dict(self) -> dict:
        """JSON-ready dictionary."""
        return asdict(self)


def _resolve(
    *, ridge, grad_max, leverage_max, feature_norm_max, eig_floor, variance, dim, probe: dict | None
) -> dict[str, Constant]:
    """Constants ``γ, L, D, R`` (and ``V`` when given): from the user, derived, or the probe.

    ``probe`` (when there is one) has ``g_max``, ``lev_max``, ``lev_exact``, ``k`` and
    (optionally) ``feat_max`` (``max (Σ_t ‖φ̃_t‖²)^{1/2}``) and ``rank`` (numerical rank of
    ``Σ̂``); without a probe, ``γ`` and ``L`` (or ``B`` with ``μ``/``λ``) are required.

    A user almost-sure bound the probe itself contradicts is an error: ``γ`` or ``B``
    below the probe's own maximum, and (``λ = 0``) ``L`` or ``D`` below ``rank Σ̂``
    (``rank Σ̂ ≤ rank Σ = E ℓ_0(x) ≤ L``).  ``D`` derived from ``L`` (``λ = 0``) is the
    integer ``⌊L⌋``: ``rank Σ`` is an integer ``≤ L``.
    """
    ridge = _number("ridge", ridge) or 0.0
    gam = _number("grad_max", grad_max)
    lev = _number("leverage_max", leverage_max, positive=True)
    bnorm = _number("feature_norm_max", feature_norm_max, positive=True)
    mu = _number("eig_floor", eig_floor, positive=True)
    var = _number("variance", variance)
    if dim is not None:
        dim = check_n(dim, "dim")
    if lev is not None and bnorm is not None:
        raise BoundError("give either --leverage-max or --feature-norm-max with --eig-floor/--ridge, not both")
    if probe is not None:
        if gam is not None and probe["g_max"] > gam * (1 + _SLACK):
            raise BoundError(
                f"--grad-max {gam:g} is below the probe's own max ‖g(x)‖_F = "
                f"{probe['g_max']:.4g}, so it is not an almost-sure bound"
            )
        fmax = probe.get("feat_max")
        if bnorm is not None and fmax is not None and fmax > bnorm * (1 + _SLACK):
            raise BoundError(
                f"--feature-norm-max {bnorm:g} is below the probe's own max "
                f"(Σ_t ‖φ̃_t‖²)^{{1/2}} = {fmax:.4g}, so it is not an almost-sure bound"
            )
    out: dict[str, Constant] = {}
    if ridge > 0:
        out["ridge"] = Constant("λ", ridge, "user", "ridge added to Σ: the interval is for s_λ ≤ s")
    if mu is not None:
        out["eig_floor"] = Constant("μ", mu, "user", "floor on the nonzero eigenvalues of Σ")
    if gam is not None:
        out["grad_max"] = Constant("γ", gam, "user", "almost-sure bound on ‖g(x)‖_F")
    elif probe is not None:
        out["grad_max"] = Constant("γ", probe["g_max"], "probe", "AG_max of the probe; " + _PROBE_MAX_NOTE)
    else:
        raise BoundError(f"missing constant {_name('grad_max')}: an almost-sure bound γ on ‖g(x)‖_F")
    if lev is not None:
        out["leverage_max"] = Constant("L", lev, "user", "almost-sure bound on the leverage ℓ_λ(x)")
    elif bnorm is not None:
        if mu is None and ridge <= 0:
            raise BoundError(
                f"{_name('feature_norm_max')} bounds the leverage only together with "
                f"{_name('eig_floor')} or {_name('ridge')} > 0 (L = B²/(μ + λ))"
            )
        out["feature_norm_max"] = Constant("B", bnorm, "user", "almost-sure bound on (Σ_t ‖φ̃_t‖²)^{1/2}")
        out["leverage_max"] = Constant("L", bnorm**2 / ((mu or 0.0) + ridge), "derived", "L = B²/(μ + λ) ≥ ℓ_λ(x)")
    elif probe is not None:
        note = (
            ("largest leverage ℓ̂(x_i) = tr(Σ̂_λ⁺ Σ_{x_i}) over the probe (plug-in with the probe's Σ̂; not a guarantee)")
            if probe["lev_exact"]
            else (
                "max_i Σ_t‖φ̃_t‖² · ‖Σ̂_λ⁺‖ over the probe (an upper estimate of the probe's largest "
                "leverage; rows not kept; plug-in, not a guarantee)"
            )
        )
        out["leverage_max"] = Constant("L", probe["lev_max"], "probe", note)
    else:
        raise BoundError(
            f"missing constant {_name('leverage_max')} (or {_name('feature_norm_max')} "
            f"with {_name('eig_floor')} or {_name('ridge')}): an almost-sure bound L on "
            f"the leverage"
        )
    big_l = out["leverage_max"].value
    if big_l <= 0:
        raise BoundError("the leverage bound L is 0: the family is degenerate (Σ = 0) on this probe")
    rank = probe.get("rank") if probe is not None else None
    lev_src = out["leverage_max"].source
    if ridge == 0 and lev_src != "probe":
        what = (
            f"--leverage-max {big_l:g}"
            if lev_src == "user"
            else f"L = B²/μ = {big_l:.4g} (from --feature-norm-max and --eig-floor; --eig-floor is too large)"
        )
        if rank is not None and rank > big_l * (1 + _SLACK):
            raise BoundError(
                f"{what} is below the probe's rank Σ̂ = {rank}, but rank Σ̂ ≤ rank Σ = "
                f"E ℓ_0(x) ≤ L, so it is not an almost-sure bound"
            )
        if big_l * (1 + _SLACK) < 1 and (rank is None or rank >= 1):
            raise BoundError(
                f"{what} is below 1: with --ridge 0, rank Σ = E ℓ_0(x) ≤ L < 1 forces "
                f"Σ = 0 (a degenerate family); a non-degenerate family has L ≥ 1"
            )
    k = probe["k"] if probe is not None else None
    if dim is not None:
        if rank is not None and rank > dim:
            raise BoundError(f"--dim {dim} is below the probe's rank Σ̂ = {rank} ≤ rank Σ, so it does not bound rank Σ")
        out["dim"] = Constant("D", float(dim), "user", "bound on rank Σ")
    elif ridge == 0:
        # rank Σ is an integer ≤ L, hence ≤ ⌊L⌋ (slack against rounding; at least 1)
        fl = max(1, math.floor(big_l * (1 + _SLACK)))
        val = float(min(k, fl)) if k is not None else float(fl)
        out["dim"] = Constant("D", val, "derived", "rank Σ ≤ min(k̃, ⌊L⌋) because rank Σ = E ℓ_0(x) ≤ L is an integer")
    elif k is not None:
        out["dim"] = Constant("D", float(k), "derived", "rank Σ ≤ k̃, the number of features")
    else:
        raise BoundError(
            f"missing constant {_name('dim')}: with {_name('ridge')} > 0 the bound "
            f"needs D ≥ rank Σ (e.g. the number of features k̃)"
        )
    gam_v = out["grad_max"].value
    out["whitened_max"] = Constant("R", gam_v * math.sqrt(big_l), "derived", "R = γ √L ≥ ‖G_x Σ_λ^{+1/2}‖_F")
    if var is not None:
        out["variance"] = Constant("V", var, "user", "bound on E‖G_x Σ_λ^{+1/2}‖_F²")
    return out


def _split(delta: float, candidates: int, empirical_variance: bool) -> tuple[float, float, float]:
    """``(δ_1, δ_2, δ_3)`` for the vector, matrix and variance events (after the union bound)."""
    per = delta / candidates
    return (per / 3, per / 3, per / 3) if empirical_variance else (per / 2, per / 2, 0.0)


def _dev(n: int, big_l: float, u2: float) -> float:
    l1 = max(big_l, 1.0)
    return math.sqrt(2 * l1 * u2 / n) + 2 * l1 * u2 / (3 * n)


def _eps(n: int, var: float, r: float, u1: float) -> float:
    return math.sqrt(2 * var * u1 / n) + 2 * r * u1 / n


def _bernstein_mean_upper(mean: float, bound_sq: float, n: int, u: float) -> float:
    """Upper confidence bound on ``E Y`` for ``0 ≤ Y ≤ bound_sq`` (one-sided Bernstein).

    With ``Var Y ≤ bound_sq · E Y``: ``√(E Y) ≤ (c + √(c² + 4e)) / 2`` where
    ``c = √(2 bound_sq u / n)`` and ``e = mean + 2 bound_sq u / (3n)``; returns the square.
    """
    c = math.sqrt(2 * bound_sq * u / n)
    e = max(mean, 0.0) + 2 * bound_sq * u / (3 * n)
    root = 0.5 * (c + math.sqrt(c * c + 4 * e))
    return min(root * root, bound_sq)


def ag_rms_upper(n: int, ag_rms: float, grad_max: float, delta: float) -> float:
    """``(1 − δ)`` upper confidence bound on the population ``AG_rms = (E‖g‖_F²)^{1/2}``.

    Bernstein's inequality for ``‖g‖_F² ∈ [0, γ²]`` (label ``cor-agmax-certificate-finite``).
    Since ``s ≤ r ≤ AG_rms`` for every family at the site, the result is an upper
    confidence bound on all their scores at once.

    Args:
        n: probe size.
        ag_rms: the probe's ``AG_rms`` (loss units per unit step).
        grad_max: ``γ``, an almost-sure bound on ``‖g(x)‖_F``.
        delta: ``δ ∈ (0, 1)``.

    Raises:
        BoundError: on ``δ ∉ (0, 1)``, ``n ≤ 0`` or a negative/NaN constant.
    """
    n = check_n(n)
    delta = check_delta(delta)
    gam = _number("grad_max", grad_max, allow_none=False)
    rms = _number("ag_rms", ag_rms, allow_none=False)
    return math.sqrt(_bernstein_mean_upper(rms * rms, gam * gam, n, math.log(1 / delta)))


# ----------------------------------------------------------------------------- moments
@dataclass
class ProbeMoments:
    """Sufficient statistics of a probe for the bound (float64, means over examples).

    Attributes:
        n: number of examples (the sum of ``weights`` when given).
        sigma: ``Σ̂ = mean Σ_x``, ``(k, k)``.
        cross: ``Ĝ = mean G_x``, ``(d, k)``.
        q: ``mean G_xᵀ G_x``, ``(k, k)`` (gives ``v̂ = tr(Σ̂⁺ q)``).
        g_sq: ``mean ‖g‖_F²`` (``AG_rms²``).
        g_max: ``max ‖g(x)‖_F`` (``AG_max``).
        feat_sq_max: ``max_x Σ_t ‖φ̃_t‖²``.
        rtol: relative eigenvalue cutoff for ``Σ̂⁺`` (:func:`~depthsat_theory.statistics.tangent.default_rtol`).
        phi: kept feature rows ``(N, units, k)`` of the distinct examples, or ``None``.
        g: kept gradient rows ``(N, units, d)``, or ``None``.
        weights: multiplicity of each kept example (``None``: all 1).
    """

    n: int
    sigma: np.ndarray
    cross: np.ndarray
    q: np.ndarray
    g_sq: float
    g_max: float
    feat_sq_max: float
    rtol: float
    phi: np.ndarray | None = field(default=None, repr=False)
    g: np.ndarray | None = field(default=None, repr=False)
    weights: np.ndarray | None = field(default=None, repr=False)

    @property
    def k(self) -> int:
        return int(self.sigma.shape[0])

    @classmethod
    def from_arrays(
        cls,
        phi: np.ndarray,
        g: np.ndarray,
        weights: np.ndarray | None = None,
        *,
        rtol: float | None = None,
        keep: bool = True,
    ) -> ProbeMoments:
        """Moments from per-example feature and gradient rows.

        Args:
            phi: ``φ̃`` rows, ``(N, k)`` (one unit per example) or ``(N, units, k)``.
            g: gradient rows, ``(N, d)`` or ``(N, units, d)``.
            weights: nonnegative integer multiplicities ``(N,)`` (a probe drawn with
                replacement from a finite population); default all ones.
            rtol: eigenvalue cutoff (default: float64 :func:`default_rtol`).
            keep: keep the rows (for the bootstrap and the exact probe leverage).

        Raises:
            BoundError: on mismatched shapes, non-finite values or an empty probe.
        """
        phi = np.asarray(phi, dtype=np.float64)
        g = np.asarray(g, dtype=np.float64)
        if phi.ndim == 2:
            phi = phi[:, None, :]
        if g.ndim == 2:
            g = g[:, None, :]
        if phi.ndim != 3 or g.ndim != 3 or phi.shape[:2] != g.shape[:2]:
            raise BoundError(f"phi {phi.shape} and g {g.shape} must be (N, units, k) and (N, units, d)")
        if not (np.isfinite(phi).all() and np.isfinite(g).all()):
            raise BoundError("phi or g contains NaN or Inf")
        w = np.ones(phi.shape[0]) if weights is None else np.asarray(weights, dtype=np.float64)
        if w.shape != (phi.shape[0],) or (w < 0).any() or not np.isfinite(w).all():
            raise BoundError("weights must be nonnegative multiplicities, one per example")
        n = round(w.sum())
        if n <= 0:
            raise BoundError("the probe is empty (n = 0)")
        if phi.shape[1] == 1:  # one unit per example: plain weighted matrix products
            p1, g1 = phi[:, 0], g[:, 0]
            pw = p1 * (w / n)[:, None]
            sigma = pw.T @ p1
            cross = g1.T @ pw
            q = (pw * (g1**2).sum(1)[:, None]).T @ p1
        else:
            sigma = np.einsum("i,irk,irl->kl", w, phi, phi, optimize=True) / n
            cross = np.einsum("i,ird,irk->dk", w, g, phi, optimize=True) / n
            gx = np.einsum("ird,irk->idk", g, phi, optimize=True)
            q = np.einsum("i,idk,idl->kl", w, gx, gx, optimize=True) / n
        gn2 = (g**2).sum((1, 2))
        live = w > 0
        return cls(
            n=n,
            sigma=sigma,
            cross=cross,
            q=q,
            g_sq=float((w * gn2).sum() / n),
            g_max=float(np.sqrt(gn2[live].max())),
            feat_sq_max=float((phi**2).sum((1, 2))[live].max()),
            rtol=default_rtol(torch.float64, phi.shape[2]) if rtol is None else float(rtol),
            phi=phi if keep else None,
            g=g if keep else None,
            weights=None if weights is None else w,
        )

    def reweighted(self, weights: np.ndarray) -> ProbeMoments:
        """The moments of the same distinct examples with new multiplicities (bootstrap)."""
        if self.phi is None:
            raise BoundError("the probe's rows were not kept (keep_probe=False): no bootstrap")
        return ProbeMoments.from_arrays(self.phi, self.g, weights, rtol=self.rtol, keep=True)


@dataclass
class Estimate:
    """Probe estimates: ``ŝ_λ²``, ``v̂``, numerical rank, ``Σ̂_λ⁺`` and the probe's largest leverage."""

    s2: float
    v_hat: float
    rank: int
    inv: np.ndarray
    lev_max: float
    lev_exact: bool


def estimate(m: ProbeMoments, ridge: float, *, leverage: bool = True) -> Estimate:
    """``ŝ_λ²``, ``v̂ = mean ‖G_x Σ̂_λ^{+1/2}‖²``, rank, ``Σ̂_λ⁺`` and the probe's max leverage."""
    if ridge > 0:
        sym = 0.5 * (m.sigma + m.sigma.T)
        lam, vec = np.linalg.eigh(sym)
        lam = np.clip(lam, 0.0, None)
        inv = (vec / (lam + ridge)) @ vec.T
        proj = m.cross @ vec
        s2 = float(np.sum(proj * proj / (lam + ridge)))
        lmax = float(lam.max()) if lam.size else 0.0
        rank = int((lam > m.rtol * lmax).sum()) if lmax > 0 else 0
    else:
        s2, rank, _, inv = pinv_quadratic(m.sigma, m.cross, m.rtol)
    v_hat = float(np.sum(inv * m.q))
    lev_max, exact = float("nan"), False
    if leverage:
        if m.phi is not None:
            live = np.ones(m.phi.shape[0], bool) if m.weights is None else m.weights > 0
            ph = m.phi[live]
            lev = np.einsum("irk,kl,irl->i", ph, inv, ph, optimize=True)
            lev_max, exact = float(lev.max()), True
        else:
            opn = float(np.linalg.eigvalsh(0.5 * (inv + inv.T)).max()) if inv.size else 0.0
            lev_max = m.feat_sq_max * opn
    return Estimate(max(s2, 0.0), max(v_hat, 0.0), rank, inv, lev_max, exact)


# ----------------------------------------------------------------------------- results
@dataclass
class ScoreInterval:
    """A confidence statement about the saturation score of one (site, family).

    Attributes:
        score: ``ŝ_λ`` on the probe (``ŝ`` when ``ridge = 0``).
        score_lower, score_upper: the interval for ``s_λ`` (``thm-finite-sample``);
            ``[0, γ]`` when the bound is vacuous.
        score_upper_unregularized: with ``ridge > 0`` and an ``eig_floor`` μ, an upper
            bound on the unregularized ``s`` (``s ≤ s_λ √(1 + λ/μ)``); else ``None``
            (equal to ``score_upper`` when ``ridge = 0``).
        delta: ``δ``; ``candidates``: ``m`` of the union bound (each interval at ``δ/m``).
        n: probe size.
        ridge: ``λ``.
        epsilon_n: additive half-width ``ε_n`` (loss units per unit step).
        relative_deviation: ``Δ_n`` (dimensionless), the bound on ``‖Ψ̄ − EΨ‖``.
        vacuous: ``Δ_n ≥ 1`` (``n`` too small for the leverage bound).
        certificate: ``"certified improvable"``, ``"certified ε-saturated"``,
            ``"not certified"`` or ``"degenerate (T = {0})"``.
        saturation_epsilon: the ``ε`` of the saturation certificate (``None``: not asked).
        guaranteed: ``True`` when every constant is the user's or derived from the
            user's (then the ``1 − δ`` coverage is a theorem); ``False`` for plug-ins.
        label: one line saying what kind of interval this is.
        constants: each constant with its source.
        assumptions: the theory labels (``asm-*``) the guarantee rests on, in words.
        score_squared: plug-in ``ŝ_λ²`` (biased upward by about ``v/n``).
        score_squared_unbiased: ``(n ŝ² − v̂)/(n − 1)`` (``None`` for ``n = 1``); exactly
            unbiased for ``s²`` when the whitening is the population ``Σ``, and with the
            probe's ``Σ̂`` it removes the leading ``v/n`` bias term.
        variance_plugin: ``v̂ = mean ‖G_x Σ̂_λ^{+1/2}‖_F²``.
        ag_rms_upper: ``(1 − δ)`` upper bound on the population ``AG_rms`` (bounds ``s``
            of every family at the site), ``cor-agmax-certificate-finite``.
        ag_certificate: the verdict of that bound against ``saturation_epsilon``.
        bootstrap_interval: ``None`` or a dict (``lower``, ``upper``, ``method``,
            ``resamples``, ``label``): approximate, not a guarantee.
        looseness: ``(score_upper − score_lower)`` over the bootstrap interval's width.
        tangent_rank: numerical rank of ``Σ̂``.
        notes: further remarks.
    """

    score: float
    score_lower: float
    score_upper: float
    score_upper_unregularized: float | None
    delta: float
    candidates: int
    n: int
    ridge: float
    epsilon_n: float
    relative_deviation: float
    vacuous: bool
    certificate: str
    saturation_epsilon: float | None
    guaranteed: bool
    label: str
    constants: dict[str, Constant]
    assumptions: list[str]
    score_squared: float
    score_squared_unbiased: float | None
    variance_plugin: float
    ag_rms_upper: float
    ag_certificate: str
    bootstrap_interval: dict | None
    looseness: float | None
    tangent_rank: int
    notes: list[str]

    def to_dict(self) -> dict:
        """JSON-ready dictionary (``nan`` becomes ``None``)."""
        d = asdict(self)
        d["constants"] = {k: c.to_dict() for k, c in self.constants.items()}
        return _clean(d)


def _clean(obj):
    if isinstance(obj, float):
        return None if math.isnan(obj) else obj
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


_ASSUMPTIONS = {
    "iid": "asm-iid: the probe's examples are i.i.d. from the data distribution and independent "
    "of the network, the site and the family (not the training set)",
    "grad": "asm-bounded-gradient: ‖g(x)‖_F ≤ γ almost surely",
    "lev": "asm-leverage: ℓ_λ(x) = tr(Σ_λ⁺ Σ_x) ≤ L almost surely (given, or L = B²/(μ+λ) from a "
    "feature-norm bound B and an eigenvalue floor μ or ridge λ)",
    "dim": "rank Σ ≤ D",
    "var": "asm-variance: E‖G_x Σ_λ^{+1/2}‖_F² ≤ V (given by the user)",
}


def interval_from_moments(
    m: ProbeMoments,
    delta: float,
    *,
    ridge: float = 0.0,
    grad_max: float | None = None,
    leverage_max: float | None = None,
    feature_norm_max: float | None = None,
    eig_floor: float | None = None,
    variance: float | None = None,
    dim: int | None = None,
    epsilon: float | None = None,
    candidates: int = 1,
    bootstrap: int = 0,
    seed: int = 0,
    bootstrap_method: str = "ustat",
) -> ScoreInterval:
    """The ``(1 − δ)`` confidence interval for ``s_λ`` from a probe's moments (``thm-finite-sample``).

    With ``u_1 = ln(2/δ_1)``, ``u_2 = ln(2D/δ_2)``, ``L_1 = max(L, 1)``, ``R = γ√L``::

        Δ_n = √(2 L_1 u_2 / n) + 2 L_1 u_2 / (3n),      ε_n = √(2 V u_1 / n) + 2 R u_1 / n,
        s_λ ∈ [ŝ_λ √(1 − Δ_n) − ε_n,  ŝ_λ √(1 + Δ_n) + ε_n]   (when Δ_n < 1),

    where ``V`` is the user's bound, or (``variance=None``) the empirical-Bernstein upper
    bound ``((c + √(c² + 4e))/2)²``, ``c = √(2R²u_3/n)``, ``e = (1 + Δ_n) v̂ + 2R²u_3/(3n)``,
    ``u_3 = ln(1/δ_3)``.  ``δ/m`` (``m = candidates``) is split equally over the two
    (three) events.  The upper end is capped at ``γ`` (``s_λ ≤ AG_rms ≤ γ``).

    Args:
        m: the probe's moments (:class:`ProbeMoments`, or :meth:`BoundStatistics.moments`).
        delta: ``δ ∈ (0, 1)``.
        ridge: ``λ ≥ 0`` (feature² units); ``0`` is the plain score ``s``.
        grad_max: ``γ`` (default: the probe's ``AG_max``, a plug-in).
        leverage_max: ``L`` (default: derived from ``feature_norm_max``, else the
            probe's largest leverage, a plug-in).
        feature_norm_max: ``B`` with ``eig_floor`` and/or ``ridge``: ``L = B²/(μ + λ)``.
        eig_floor: ``μ``, a floor on the nonzero eigenvalues of ``Σ``; also turns the
            ridge interval into an upper bound on ``s``.
        variance: ``V`` (default: empirical Bernstein from the probe).
        dim: ``D ≥ rank Σ`` (default ``k̃``; ``min(k̃, ⌊L⌋)`` when ``ridge = 0``).
        epsilon: the ``ε`` of the saturation certificate (``None``: no such verdict).
        candidates: number ``m ≥ 1`` of (site, family) candidates judged on this probe
            (union bound).
        bootstrap: number of bootstrap resamples (``0``: none); needs kept rows.
        seed: bootstrap seed.
        bootstrap_method: see :func:`bootstrap_interval` (default ``"ustat"``).

    Returns:
        A :class:`ScoreInterval`.

    Raises:
        BoundError: ``δ ∉ (0, 1)``, negative/NaN/missing constants, ``epsilon ≤ 0``,
            ``candidates < 1``, or a bootstrap without kept rows.
    """
    delta = check_delta(delta)
    candidates = check_n(candidates, "candidates")
    eps_target = _number("epsilon", epsilon, positive=True)
    nboot = int(_number("bootstrap", bootstrap) or 0)
    ridge = _number("ridge", ridge) or 0.0
    n = check_n(m.n)
    est = estimate(m, ridge)
    probe = {
        "g_max": m.g_max,
        "lev_max": est.lev_max,
        "lev_exact": est.lev_exact,
        "k": m.k,
        "feat_max": math.sqrt(m.feat_sq_max),
        "rank": est.rank,
    }
    const = _resolve(
        ridge=ridge,
        grad_max=grad_max,
        leverage_max=leverage_max,
        feature_norm_max=feature_norm_max,
        eig_floor=eig_floor,
        variance=variance,
        dim=dim,
        probe=probe,
    )
    gam = const["grad_max"].value
    big_l = const["leverage_max"].value
    r = const["whitened_max"].value
    d1, d2, d3 = _split(delta, candidates, "variance" not in const)
    u1, u2 = math.log(2 / d1), math.log(2 * const["dim"].value / d2)
    dev = _dev(n, big_l, u2)
    s_hat = math.sqrt(est.s2)
    notes: list[str] = []
    _probe_checks(const, m, est, dev, notes)
    if "variance" in const:
        var = const["variance"].value
    elif dev < 1:
        var = _bernstein_mean_upper((1 + dev) * est.v_hat, r * r, n, math.log(1 / d3))
        const["variance"] = Constant(
            "V",
            var,
            "probe",
            "empirical-Bernstein upper bound on E‖G_x Σ_λ^{+1/2}‖² from v̂ = "
            f"{est.v_hat:.6g} (rigorous given γ and L)",
        )
    else:
        var = r * r
        const["variance"] = Constant("V", var, "derived", "worst case R² (the bound is vacuous)")
    eps_n = _eps(n, var, r, u1)
    vacuous = dev >= 1
    if vacuous:
        lower, upper = 0.0, gam
        notes.append(
            f"vacuous: Δ_n = {dev:.3g} ≥ 1 (n = {n} is too small for the leverage bound "
            f"L = {big_l:.4g}); `depthsat bound` gives the n needed"
        )
    else:
        lower = max(0.0, s_hat * math.sqrt(1 - dev) - eps_n)
        upper = s_hat * math.sqrt(1 + dev) + eps_n
        if const["grad_max"].source != "probe":
            upper = min(upper, gam)  # s_λ ≤ s ≤ AG_rms ≤ γ
    mu = const["eig_floor"].value if "eig_floor" in const else None
    if ridge == 0:
        upper_s = upper
    elif mu is not None:
        upper_s = upper * math.sqrt(1 + ridge / mu)  # s ≤ s_λ √(1 + λ/μ)
        if const["grad_max"].source != "probe":
            upper_s = min(upper_s, gam)
    else:
        upper_s = None
        notes.append(
            "with a ridge and no eig_floor, the upper end bounds s_λ only (s ≥ s_λ); give "
            "--eig-floor for a saturation certificate on s"
        )
    if lower > upper or (upper_s is not None and lower > upper_s):
        raise BoundError(
            f"inconsistent constants: the interval would be inverted (lower end "
            f"{lower:.4g} > upper end {min(upper, upper_s if upper_s is not None else upper):.4g}); "
            f"check --grad-max, --leverage-max, --variance and --eig-floor against the probe"
        )
    degenerate = not np.any(m.sigma)
    if degenerate:
        cert = DEGENERATE
    elif lower > 0:
        cert = CERTIFIED_IMPROVABLE
    elif eps_target is not None and upper_s is not None and upper_s <= eps_target:
        cert = CERTIFIED_SATURATED
    else:
        cert = NOT_CERTIFIED
    ag_up = ag_rms_upper(n, math.sqrt(m.g_sq), gam, delta / candidates)
    if eps_target is None:
        ag_cert = "not asked (give epsilon)"
    else:
        ag_cert = CERTIFIED_SATURATED if ag_up <= eps_target else NOT_CERTIFIED
    guaranteed = const["grad_max"].source != "probe" and const["leverage_max"].source != "probe"
    label = (
        "(1-δ) confidence interval (thm-finite-sample)"
        if guaranteed
        else "plug-in interval: γ and/or L from the probe, not a guarantee (thm-finite-sample with estimated constants)"
    )
    assumptions = [_ASSUMPTIONS["iid"], _ASSUMPTIONS["grad"], _ASSUMPTIONS["lev"], _ASSUMPTIONS["dim"]]
    if const["variance"].source == "user":
        assumptions.append(_ASSUMPTIONS["var"])
    if candidates > 1:
        notes.append(f"union bound over {candidates} candidates: each interval at level δ/{candidates}")
    u_stat = (n * est.s2 - est.v_hat) / (n - 1) if n > 1 else None
    boot = None
    loose = None
    if nboot > 0:
        boot = bootstrap_interval(
            m, delta / candidates, resamples=nboot, ridge=ridge, seed=seed, method=bootstrap_method
        )
        width = boot["upper"] - boot["lower"]
        loose = (upper - lower) / width if width > 0 else None
    return ScoreInterval(
        score=s_hat,
        score_lower=lower,
        score_upper=upper,
        score_upper_unregularized=upper_s,
        delta=delta,
        candidates=candidates,
        n=n,
        ridge=ridge,
        epsilon_n=eps_n,
        relative_deviation=dev,
        vacuous=vacuous,
        certificate=cert,
        saturation_epsilon=eps_target,
        guaranteed=guaranteed,
        label=label,
        constants=const,
        assumptions=assumptions,
        score_squared=est.s2,
        score_squared_unbiased=u_stat,
        variance_plugin=est.v_hat,
        ag_rms_upper=ag_up,
        ag_certificate=ag_cert,
        bootstrap_interval=boot,
        looseness=loose,
        tangent_rank=est.rank,
        notes=notes,
    )


def _probe_checks(const: dict[str, Constant], m: ProbeMoments, est: Estimate, dev: float, notes: list[str]) -> None:
    """Compare user constants with the probe: errors for contradictions, notes for plug-in tension.

    - ``L`` (user or derived): on the matrix event of the interval itself (probability
      ``≥ 1 − δ_2``), ``Σ̂_λ ⪰ (1 − Δ_n) Σ_λ`` on ``range Σ``, so every probe leverage
      ``ℓ̂(x_i) = tr(Σ̂_λ⁺ Σ_{x_i}) ≤ ℓ_λ(x_i)/(1 − Δ_n) ≤ L/(1 − Δ_n)``; a larger probe
      leverage contradicts ``L`` at the interval's own level (error), one in
      ``(L, L/(1 − Δ_n)]`` is only noted.
    - ``V`` below the plug-in ``v̂`` and ``μ`` above the smallest nonzero eigenvalue of
      ``Σ̂``: population assumptions the probe can miss by sampling (notes).
    """
    lev = const["leverage_max"]
    if lev.source != "probe" and est.lev_exact and math.isfinite(est.lev_max):
        big_l = lev.value
        what = (
            f"--leverage-max {big_l:g}"
            if lev.source == "user"
            else f"L = B²/(μ + λ) = {big_l:.4g} (from --feature-norm-max with --eig-floor/--ridge)"
        )
        if dev < 1 and est.lev_max > big_l / (1 - dev) * (1 + _SLACK):
            raise BoundError(
                f"{what} is below the probe's own max leverage ℓ̂ = {est.lev_max:.4g} "
                f"(with Σ̂; ℓ̂ ≤ L/(1 − Δ_n) = {big_l / (1 - dev):.4g} whenever the "
                f"interval's matrix event holds), so it is not an almost-sure bound"
            )
        if est.lev_max > big_l * (1 + _SLACK):
            notes.append(
                f"the probe's largest leverage ℓ̂ = {est.lev_max:.4g} (with the probe's Σ̂) "
                f"exceeds L = {big_l:.4g}; ℓ̂ uses Σ̂, not Σ, so this is not a contradiction, "
                f"but check L"
            )
    var = const.get("variance")
    if var is not None and var.source == "user" and var.value < est.v_hat * (1 - _SLACK):
        notes.append(
            f"--variance V = {var.value:.4g} is below the probe's plug-in v̂ = {est.v_hat:.4g}: "
            f"possible by sampling, but the probe does not support V (the interval's ε_n "
            f"rests on it)"
        )
    mu = const.get("eig_floor")
    if mu is not None:
        lam = np.linalg.eigvalsh(0.5 * (m.sigma + m.sigma.T)) if m.sigma.size else np.zeros(0)
        top = float(lam.max()) if lam.size else 0.0
        nz = lam[lam > m.rtol * top] if top > 0 else lam[:0]
        if nz.size and float(nz.min()) < mu.value * (1 - _SLACK):
            notes.append(
                f"--eig-floor μ = {mu.value:.4g} is above the smallest nonzero eigenvalue of "
                f"the probe's Σ̂ ({float(nz.min()):.4g}): μ is an assumption on the population "
                f"Σ, which the probe does not support"
            )


def unbiased_score_squared(m: ProbeMoments, *, ridge: float = 0.0, whitening: np.ndarray | None = None) -> float:
    """The U-statistic ``(n ŝ² − v̂)/(n − 1)`` of ``s²`` (``s_λ²`` with a ridge).

    ``ŝ² = ‖ξ̄‖²`` and ``v̂ = mean ‖ξ_x‖²`` with ``ξ_x = G_x W^{1/2}``; then
    ``(n ŝ² − v̂)/(n − 1) = (1/(n(n−1))) Σ_{i≠j} ⟨ξ_i, ξ_j⟩``, exactly unbiased for
    ``‖E ξ‖² = s²`` when ``W`` is fixed (the population ``Σ_λ⁺``).  By default ``W`` is
    the probe's ``Σ̂_λ⁺``; then only the leading ``v/n`` bias of ``ŝ²`` is removed.

    Args:
        m: the probe's moments.
        ridge: ``λ ≥ 0``.
        whitening: a fixed ``(k, k)`` PSD matrix ``W`` (e.g. the population ``Σ⁺``).

    Raises:
        BoundError: if ``n < 2``.
    """
    if m.n < 2:
        raise BoundError("the U-statistic needs n >= 2 examples")
    if whitening is None:
        est = estimate(m, _number("ridge", ridge) or 0.0, leverage=False)
        s2, v_hat = est.s2, est.v_hat
    else:
        w = np.asarray(whitening, dtype=np.float64)
        s2 = float(np.sum((m.cross @ w) * m.cross))
        v_hat = float(np.sum(w * m.q))
    return (m.n * s2 - v_hat) / (m.n - 1)


def bootstrap_interval(
    m: ProbeMoments, delta: float, *, resamples: int = 200, ridge: float = 0.0, seed: int = 0, method: str = "ustat"
) -> dict:
    """Bootstrap interval for ``s_λ`` over the probe's examples (approximate, not a guarantee).

    Resamples ``n`` examples with replacement ``resamples`` times.  Methods:

    - ``"ustat"`` (default): the basic (reverse-percentile) bootstrap of the U-statistic
      ``Û`` of ``s²``: ``Û* − ŝ²`` (``ŝ²`` is the bootstrap world's ``s²``) stands in for
      ``Û − s²``, giving ``[Û − (q_{1−δ/2}(Û*) − ŝ²), Û − (q_{δ/2}(Û*) − ŝ²)]``,
      clipped at 0 and square-rooted;
    - ``"basic"``: the same on ``ŝ`` (``[2ŝ − q_{1−δ/2}, 2ŝ − q_{δ/2}]``, clipped at 0);
    - ``"percentile"``: ``[q_{δ/2}(ŝ*), q_{1−δ/2}(ŝ*)]``.

    ``ŝ`` is biased upward (``E ŝ² ≈ s² + v/n``), and at ``s = 0`` the bootstrap
    distribution of ``ŝ*`` lies above ``ŝ``: the ``"basic"`` and ``"percentile"``
    intervals then miss ``0`` far more often than ``δ`` (see the T7 coverage table).
    Needs the probe in memory (:class:`ProbeMoments` with rows).

    Raises:
        BoundError: on bad ``δ``, ``resamples < 1``, an unknown method, ``n < 2`` for
            ``"ustat"``, or no kept rows.
    """
    delta = check_delta(delta)
    resamples = check_n(resamples, "bootstrap")
    if method not in ("ustat", "basic", "percentile"):
        raise BoundError(f"bootstrap method must be 'ustat', 'basic' or 'percentile', got {method!r}")
    if m.phi is None:
        raise BoundError("the bootstrap needs the probe's rows in memory (keep_probe=True)")
    if method == "ustat" and m.n < 2:
        raise BoundError(
            f"the U-statistic bootstrap needs n >= 2 examples (the probe has n = {m.n}); "
            f"pass --bootstrap 0 (bootstrap=0) for no bootstrap interval"
        )
    rng = np.random.default_rng(seed)
    w = np.ones(m.phi.shape[0]) if m.weights is None else m.weights
    p = w / w.sum()

    def stat(mm: ProbeMoments) -> float:
        est = estimate(mm, ridge, leverage=False)
        if method == "ustat":
            return (mm.n * est.s2 - est.v_hat) / (mm.n - 1)
        return math.sqrt(est.s2)

    center = stat(m)
    # the bootstrap world's true value is the plug-in functional: ŝ² for "ustat", ŝ otherwise
    truth = estimate(m, ridge, leverage=False).s2 if method == "ustat" else center
    reps = np.array([stat(m.reweighted(rng.multinomial(m.n, p))) for _ in range(resamples)])
    lo_q, hi_q = np.quantile(reps, [delta / 2, 1 - delta / 2])
    if method == "percentile":
        lo, hi = float(lo_q), float(hi_q)
    else:
        lo, hi = max(0.0, center - (hi_q - truth)), max(0.0, center - (lo_q - truth))
        if method == "ustat":
            lo, hi = math.sqrt(lo), math.sqrt(hi)
    names = {
        "ustat": "basic bootstrap of the U-statistic of s², square-rooted",
        "basic": "basic bootstrap of ŝ",
        "percentile": "percentile bootstrap of ŝ",
    }
    return {
        "lower": float(lo),
        "upper": float(hi),
        "method": names[method] + " (resampling examples)",
        "resamples": resamples,
        "label": "bootstrap interval: approximate, not a guarantee (needs the probe in memory)",
    }


# ----------------------------------------------------------------------------- streaming
# ----------------------------------------------------------------------------- calculator
@dataclass
class BoundPlan:
    """Output of the sample-size calculator (:func:`plan_bound`).

    Attributes:
        n: the probe size the numbers refer to (the required size when ``target`` is set).
        delta: ``δ``; ``candidates``: union-bound count ``m``.
        epsilon_n: additive half-width ``ε_n``.
        relative_deviation: ``Δ_n``.
        halfwidth: ``h_n = (ε_n + S Δ_n)/√(1 − Δ_n)``, a bound on ``|ŝ_λ − s_λ|`` for
            every ``s_λ ≤ S`` (``inf`` when ``Δ_n ≥ 1``).
        score_max: ``S``.
        target: the target half-width (``None`` when ``n`` was given).
        n_required: smallest ``n`` with ``h_n ≤ target`` (``None`` when ``n`` was given).
        n_epsilon_only: smallest ``n`` with ``ε_n ≤ target`` (closed form; ``None`` …).
        n_nonvacuous: smallest ``n`` with ``Δ_n < 1``.
        constants: each constant with its source.
        formulas: the formulas in words.
        vacuous: ``Δ_n ≥ 1`` at ``n`` (the half-width is infinite, ``None`` in JSON).
        notes: further remarks (e.g. the smallest non-vacuous ``n``).
    """

    n: int
    delta: float
    candidates: int
    epsilon_n: float
    relative_deviation: float
    halfwidth: float
    score_max: float
    target: float | None
    n_required: int | None
    n_epsilon_only: int | None
    n_nonvacuous: int
    constants: dict[str, Constant]
    formulas: dict[str, str]
    vacuous: bool = False
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready dictionary (``inf`` becomes ``None``)."""
        d = asdict(self)
        d["constants"] = {k: c.to_dict() for k, c in self.constants.items()}
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def _plan_constants(delta: float, candidates: int, kw: dict) -> tuple:
    """Constants of the calculator: ``(constants, γ, L, R, V, u_1, u_2)``."""
    const = _resolve(probe=None, **kw)
    gam = const["grad_max"].value
    big_l = const["leverage_max"].value
    r = const["whitened_max"].value
    if "variance" not in const:
        const["variance"] = Constant(
            "V", r * r, "derived", "worst case V = R² = γ² L (give --variance for a tighter bound)"
        )
    var = const["variance"].value
    d1, d2, _ = _split(delta, candidates, False)
    u1, u2 = math.log(2 / d1), math.log(2 * const["dim"].value / d2)
    return const, gam, big_l, r, var, u1, u2


def plan_bound(
    *,
    delta: float,
    n: int | None = None,
    epsilon: float | None = None,
    grad_max: float | None = None,
    leverage_max: float | None = None,
    feature_norm_max: float | None = None,
    eig_floor: float | None = None,
    ridge: float = 0.0,
    variance: float | None = None,
    dim: int | None = None,
    score_max: float | None = None,
    candidates: int = 1,
) -> BoundPlan:
    """Half-width from ``(n, δ, constants)``, or the probe size needed for a half-width.

    Exactly one of ``n`` and ``epsilon`` is given.  ``V`` defaults to the worst case
    ``R² = γ² L`` (then ``δ`` is split in two, as when ``V`` is given); ``S``
    (``score_max``) defaults to ``min(γ, √V)``, an a-priori bound on ``s_λ``.  The
    inverse formulas are the sympy derivation of :mod:`depthsat_theory.bounds.formula`.

    Args:
        delta: ``δ ∈ (0, 1)``.
        n: probe size ``≥ 1``.
        epsilon: target half-width ``> 0`` (loss units per unit step).
        grad_max, leverage_max, feature_norm_max, eig_floor, ridge, variance, dim:
            the constants (see the module docstring); ``γ`` and ``L`` (or ``B`` with
            ``μ``/``λ``) are required.
        score_max: ``S ≥ 0``: the half-width holds for every ``s_λ ≤ S``.
        candidates: union-bound count ``m ≥ 1``.

    Raises:
        BoundError: on ``δ ∉ (0, 1)``, ``n ≤ 0``, ``epsilon ≤ 0``, both or neither of
            ``n``/``epsilon``, or missing/negative/NaN constants.
    """
    from depthsat_theory.bounds.formula import combined_required_n, formulas

    delta = check_delta(delta)
    candidates = check_n(candidates, "candidates")
    if (n is None) == (epsilon is None):
        raise BoundError(
            f"give exactly one of {_name('n')} (for the half-width) and {_name('epsilon')} (for the probe size needed)"
        )
    if n is not None:
        n = check_n(n)
    target = _number("epsilon", epsilon, positive=True)
    kw = dict(
        ridge=ridge,
        grad_max=grad_max,
        leverage_max=leverage_max,
        feature_norm_max=feature_norm_max,
        eig_floor=eig_floor,
        variance=variance,
        dim=dim,
    )
    const, gam, big_l, r, var, u1, u2 = _plan_constants(delta, candidates, kw)
    smax = _number("score_max", score_max)
    if smax is None:
        smax = min(gam, math.sqrt(var))
        const["score_max"] = Constant("S", smax, "derived", "S = min(γ, √V) ≥ s_λ")
    else:
        const["score_max"] = Constant("S", smax, "user", "the half-width holds for s_λ ≤ S")
    f = formulas()
    l1 = max(big_l, 1.0)
    n_nonvac = math.floor(f.n_for_delta(1.0, l1, u2)) + 1
    n_req = n_eps = None
    if target is not None:
        n_eps = max(1, math.ceil(f.n_for_eps(target, var, r, u1) * (1 - 1e-12)))
        n_real = combined_required_n(target, var, r, u1, l1, u2, smax)
        n_req = max(1, math.ceil(n_real * (1 - 1e-12)))
        while _half(n_req, var, r, u1, l1, u2, smax) > target:  # guard against rounding
            n_req += 1
        while n_req > 1 and _half(n_req - 1, var, r, u1, l1, u2, smax) <= target:
            n_req -= 1
        n = n_req
    eps_n = _eps(n, var, r, u1)
    dev = _dev(n, big_l, u2)
    half = _half(n, var, r, u1, l1, u2, smax)
    notes: list[str] = []
    vacuous = not math.isfinite(half)
    if vacuous:
        notes.append(
            f"vacuous: Δ_n = {dev:.3g} ≥ 1 at n = {n} (the leverage bound L = {big_l:.4g} needs "
            f"more examples); the smallest non-vacuous n is {n_nonvac}"
        )
    if eig_floor is not None and leverage_max is not None:
        notes.append("--eig-floor is not used: L is given directly (--leverage-max)")
    return BoundPlan(
        n=n,
        delta=delta,
        candidates=candidates,
        epsilon_n=eps_n,
        relative_deviation=dev,
        halfwidth=half,
        score_max=smax,
        target=target,
        vacuous=vacuous,
        notes=notes,
        n_required=n_req,
        n_epsilon_only=n_eps,
        n_nonvacuous=n_nonvac,
        constants=const,
        formulas={
            "epsilon_n": "sqrt(2 V u1 / n) + 2 R u1 / n,  u1 = ln(2/δ1),  R = γ sqrt(L)",
            "Delta_n": "sqrt(2 L1 u2 / n) + 2 L1 u2 / (3 n),  u2 = ln(2 D/δ2),  L1 = max(L, 1)",
            "D": "given (--dim), else min(k, floor(L)) for λ = 0 (rank Σ = E ℓ_0 ≤ L is an integer)",
            "halfwidth": "(epsilon_n + S Delta_n) / sqrt(1 - Delta_n)  (Delta_n < 1)",
            "split": "δ1 = δ2 = δ / (2 m)",
            "n_required": "unique positive root x of the quartic (ε + SΔ)² = E²(1 − Δ) in x = sqrt(n)"
            " (sympy), rounded up",
        },
    )


def _half(n, var, r, u1, l1, u2, smax) -> float:
    dev = math.sqrt(2 * l1 * u2 / n) + 2 * l1 * u2 / (3 * n)
    if dev >= 1:
        return math.inf
    return (_eps(n, var, r, u1) + smax * dev) / math.sqrt(1 - dev)


def halfwidth(n: int, delta: float, **constants) -> float:
    """``h_n`` for ``(n, δ, constants)``: see :func:`plan_bound` (``inf`` when vacuous)."""
    return plan_bound(n=n, delta=delta, **constants).halfwidth


def required_n(epsilon: float, delta: float, **constants) -> int:
    """Smallest probe size with ``h_n ≤ epsilon``: see :func:`plan_bound`."""
    return plan_bound(epsilon=epsilon, delta=delta, **constants).n_required


# ----------------------------------------------------------------------------- sequential
def spending(j: int, delta: float) -> float:
    """Level ``δ_j = δ / (j (j + 1))`` of checkpoint ``j = 1, 2, …`` (``Σ_j δ_j = δ``)."""
    return delta / (j * (j + 1))


class SequentialCertifier:
    """Certify a site either way from a probe that grows batch by batch (``thm-sequential``).

    Checkpoint ``j`` (after the ``j``-th call of :meth:`update` / :meth:`add_moments`)
    reports the interval of :func:`interval_from_moments` at level ``δ_j = δ/(j(j+1))``.
    Since ``Σ_j δ_j = δ``, all intervals hold simultaneously with probability
    ``≥ 1 − δ``, so stopping at the first checkpoint that certifies the site
    (improvable, or ε-saturated) keeps the guarantee, whatever the stopping rule.  The
    batch sizes must not depend on the data seen (fixed in advance).

    Args:
        delta: overall ``δ ∈ (0, 1)``.
        epsilon: the ``ε`` of the saturation certificate (``None``: stop only on
            "improvable").
        family, shape, layout: the site, for :meth:`update` (``None``: use
            :meth:`add_moments`).
        keep_probe: keep rows (exact probe leverage for plug-in constants).
        **constants: passed to :func:`interval_from_moments` (``grad_max``, …).

    Raises:
        BoundError: on a bad ``δ``, ``ε`` or constant.
    """

    def __init__(
        self,
        delta: float,
        *,
        epsilon: float | None = None,
        family: FeatureFamily | None = None,
        shape=None,
        layout: str = "vector",
        keep_probe: bool = False,
        **constants,
    ):
        self.delta = check_delta(delta)
        self.epsilon = _number("epsilon", epsilon, positive=True)
        self.constants = constants
        self.history: list[ScoreInterval] = []
        self.stats = None
        if family is not None:
            if not isinstance(family, FeatureFamily):
                raise FamilyError("the sequential certifier needs a zero-output feature family")
            from depthsat_theory.bounds.statistics import BoundStatistics

            self.stats = BoundStatistics(family, shape, layout, keep_probe=keep_probe)

    @property
    def decision(self) -> str | None:
        """The first certificate reached (``None`` while not certified)."""
        for step in self.history:
            if step.certificate in (CERTIFIED_IMPROVABLE, CERTIFIED_SATURATED):
                return step.certificate
        return None

    @property
    def stopped_at(self) -> int | None:
        """Probe size at the first certificate (``None`` while not certified)."""
        for step in self.history:
            if step.certificate in (CERTIFIED_IMPROVABLE, CERTIFIED_SATURATED):
                return step.n
        return None

    def add_moments(self, m: ProbeMoments) -> ScoreInterval:
        """Record checkpoint ``j`` with the cumulative probe's moments ``m``."""
        j = len(self.history) + 1
        step = interval_from_moments(m, spending(j, self.delta), epsilon=self.epsilon, **self.constants)
        step.notes.append(f"checkpoint {j}: level δ_j = δ/(j(j+1)) = {spending(j, self.delta):.3g}")
        self.history.append(step)
        return step

    def update(self, z: Tensor, g: Tensor) -> ScoreInterval:
        """Add a batch (site tensors ``z`` and activation gradients ``g``) and report."""
        if self.stats is None:
            raise BoundError("no family was given: use add_moments, or pass family/shape/layout")
        self.stats.update(z, g)
        return self.add_moments(self.stats.moments())


# ----------------------------------------------------------------------------- CLI helpers
def score_report(
    z: np.ndarray,
    g: np.ndarray,
    family: FeatureFamily,
    *,
    delta: float,
    epsilon: float | None = None,
    candidates: int = 1,
    bootstrap: int = 200,
    seed: int = 0,
    **constants,
) -> dict:
    """The keys ``depthsat score --delta`` adds (vector site: rows of ``z``, ``g`` are units).

    Returns:
        ``score_lower``, ``score_upper``, ``certificate``, ``assumptions``, ``constants``,
        ``score_squared``, ``score_squared_unbiased``, ``bootstrap_interval``,
        ``looseness`` and the rest of :class:`ScoreInterval` (prefixed where they would
        clash with ``score``'s own keys).

    Raises:
        BoundError: bad ``δ``/constants; FamilyError: not a feature family.
    """
    check_delta(delta)
    check_n(candidates, "candidates")
    _number("epsilon", epsilon, positive=True)
    _number("bootstrap", bootstrap)
    if not isinstance(family, FeatureFamily):
        raise FamilyError(
            f"confidence bounds need a zero-output feature family, not "
            f"{getattr(family, 'spec', type(family).__name__)!r}"
        )
    from depthsat_theory.bounds.statistics import BoundStatistics

    stats = BoundStatistics(family, (z.shape[1],), "vector", keep_probe=True)
    stats.update(torch.from_numpy(np.ascontiguousarray(z)), torch.from_numpy(np.ascontiguousarray(g)))
    res = stats.interval(
        delta, epsilon=epsilon, candidates=candidates, bootstrap=int(bootstrap), seed=seed, **constants
    )
    d = res.to_dict()
    d.pop("score")
    d["bound_label"] = d.pop("label")
    d["bound_notes"] = d.pop("notes")
    d["bound_tangent_rank"] = d.pop("tangent_rank")
    return d


def bound_report(**kwargs) -> dict:
    """JSON-ready output of ``depthsat bound`` (:func:`plan_bound` with the same arguments)."""
    return plan_bound(**kwargs).to_dict()
