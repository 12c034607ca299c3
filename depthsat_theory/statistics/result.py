"""The result type of every engine (:class:`SaturationResult`) and the statistics' input error."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from depthsat_theory.vocabulary import Verdict

__all__ = ["SaturationResult", "StatisticsError"]

#: What decides a signal below a probe dtype's resolution (:attr:`SaturationResult.verdict_reason`).
_FINER = {
    "bfloat16": "rerun in float32",
    "float16": "rerun in float32",
    "float32": "rerun in float64",
}


class StatisticsError(ValueError):
    """Bad input to the statistics (shape mismatch, NaN/Inf, empty probe)."""


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
        saturated: :attr:`verdict` is ``SATURATED``: ``score <= tol``, not degenerate and no
            unresolved direction.
        tol: the saturation threshold used: the rounding bound :attr:`score_error` unless given.
        cutoff: absolute eigenvalue cutoff used for the unit-diagonal ``Σ̃`` / ``K̃``.
        rtol: relative cutoff (``cutoff / λ̃_max``).
        n: number of probe examples; ``units``: number of units (rows) seen.
        family: family spec; ``unit``: ``"row"`` or ``"tensor"``.
        dtype: dtype of the forward pass the statistics came from.
        gradient: ``b`` as a float64 numpy vector (``vec_row(G)`` for feature
            families, in the order of the block's tangent parameters).
        score_error: first-order rounding bound on ``|ŝ − s|`` (theory/numerics.md,
            ``thm-score-error``; ``inf`` when the Gram is too ill-conditioned for first order).
        unresolved: dropped directions that may matter (``def-resolution``): above the data
            resolution but below the factorization's, or carrying more activation gradient than
            rounding explains; when nonzero, ``score`` is a lower bound and never grounds "saturated".
        noise_variance: ``v̂ = tr(Σ⁻ E[Xᵀ X])`` with ``X`` an example's cross-gradient (the
            plug-in bias of ``ŝ²`` is ``v̂ / n``; ``nan`` when not streamed).
        noise_variance_upper: the upper bound on the exact-arithmetic ``v̂`` that the noise test used
            (theory/numerics.md, ``thm-noise-factor`` and "Float32 products"; ``nan``: ``v̂`` itself).
        noise_ratio: ``n ŝ² / v̂`` (with ``v̂_up`` for ``v̂``); the noise test calls the signal significant above
            ``χ²_{1,1−α}`` (``thm-noise-test``).
        score_squared_unbiased: the U-statistic ``(n ŝ² − v̂)/(n − 1)`` of ``s²`` (can be negative).
        score_squared_se: an upper bound of its standard error,
            ``sqrt(4 v̂ max(ŝ²_U, 0)/n + 2 v̂²/(n(n−1)))``.
        alpha: level of the noise test.
        noise_threshold: ``χ²_{1,1−α}``.
        kink_ties: exact ties at kinks (``relu``/``abs`` at ``0``, max ties, …) in the operations
            after the site (:mod:`depthsat_theory.capture.kinks`; ``None``: not counted).  When
            positive, ``J`` may not be differentiable at the origin and autograd's ``b`` is a
            one-sided convention (``thm-gradient``): the verdict is ``UNDETERMINED``.
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
    score_error: float = 0.0
    unresolved: int = 0
    noise_variance: float = float("nan")
    noise_variance_upper: float = float("nan")
    noise_ratio: float = float("nan")
    score_squared_unbiased: float = float("nan")
    score_squared_se: float = float("nan")
    alpha: float = 0.05
    noise_threshold: float = float("nan")
    kink_ties: int | None = None

    @property
    def probe_verdict(self) -> Verdict:
        """The verdict on the probe's own empirical measure, numerical error only.

        ``DEGENERATE`` when ``T = {0}`` (never "saturated", T4); ``UNDETERMINED`` when
        ``ŝ ≤ tol`` but a direction was unresolved (``ŝ`` is only a lower bound), the
        rounding bound is infinite, or ``2 tol ≥ AG_rms`` (the bound says nothing); ``SATURATED``
        when ``ŝ ≤ tol`` otherwise; else ``IMPROVABLE``: the
        probe's loss decreases to first order (theory labels ``thm-iff``, ``thm-score-error``).
        This is what the theorem checker tests on the probe.
        """
        if self.degenerate:
            return Verdict.DEGENERATE
        if self.kink_ties:
            return Verdict.UNDETERMINED
        if not math.isfinite(self.tol):
            return Verdict.UNDETERMINED
        if self.score <= self.tol:
            return Verdict.UNDETERMINED if self.unresolved or self._vacuous_bound else Verdict.SATURATED
        return Verdict.IMPROVABLE

    @property
    def _vacuous_bound(self) -> bool:
        """``2 tol ≥ AG_rms``: "s ≤ ŝ + tol ≤ 2 tol" would say no more than ``s ≤ AG_rms`` always does."""
        return self.tol > 0 and 2 * self.tol >= self.ag_rms

    @property
    def noise_unusable(self) -> bool:
        """``v̂`` was streamed (``n ≥ 2``) but it, or its bound, is not a positive finite number: no noise test.

        ``v̂ = tr(Σ⁻ E[XᵀX])`` is exactly ``≥ 0``, and ``0`` only when every example's cross-gradient vanishes on the
        kept directions (then ``ŝ = 0``); a computed ``v̂ ≤ 0``, ``∞`` or an infinite bound next to ``ŝ > 0`` is
        the arithmetic's (theory/numerics.md, ``thm-noise-factor``), and the verdict cannot be ``IMPROVABLE``.
        """
        if self.n < 2 or math.isnan(self.noise_variance) or (self.noise_variance == 0 and self.score == 0):
            return False
        upper = self.noise_variance if math.isnan(self.noise_variance_upper) else self.noise_variance_upper
        return not (0 < self.noise_variance < math.inf and 0 < upper < math.inf)

    @property
    def significant(self) -> bool | None:
        """Whether the noise test rejects ``s = 0`` at level ``alpha`` (``None``: not streamed)."""
        if math.isnan(self.noise_ratio):
            return None
        return self.noise_ratio > self.noise_threshold

    @property
    def verdict(self) -> Verdict:
        """The verdict (:class:`~depthsat_theory.vocabulary.Verdict`): four honest outcomes.

        :attr:`probe_verdict`, except that ``IMPROVABLE`` also needs the noise test
        (``thm-noise-test``): when ``n ŝ² / v̂ ≤ χ²_{1,1−α}`` the probe's score is within what
        an activation gradient independent of the features would give, so the verdict is
        ``UNDETERMINED`` (the reason says how many examples would decide).  What ``alpha``
        promises on probes with population score ``0`` (``rem-noise-test-level``): a rate of
        ``IMPROVABLE`` at most ``alpha`` as ``n → ∞`` for every gradient law with finite variance
        (``thm-noise-test``, proved); at a finite ``n``, exactly at most ``alpha`` (0.05 or 0.01) for a
        Gaussian ``g`` on a constant feature (``prop-noise-test-constant-feature``), and with ``n/k̃`` in
        ``[0.1, 100]`` at most ``alpha = 0.05`` within Monte Carlo error on the domain of ``num-noise-test``
        (``g`` independent of the features, a symmetric cross-gradient without atoms, or centred
        exponential ``g`` with a bias), which is evidence, not a theorem; not for a Rademacher ``g`` on a
        constant feature (``1/8`` at ``n = 4``) or a skewed ``g`` along a feature of nonzero mean without a
        bias (up to 0.09); for other laws no finite-``n`` level is promised, and none can be
        (``prop-noise-no-uniform-level``: a gradient whose mean rides on rare large values looks
        constant on a probe that misses them).  A finite-sample guarantee for every law with
        ``‖g‖ ≤ γ`` is the interval of :mod:`depthsat_theory.bounds` with given ``γ`` and ``L``
        ("certified improvable" at level ``δ``).  ``SATURATED`` states saturation of the probe's
        measure within :attr:`tol`; the population needs that interval too.  A probe whose ``ŝ`` is within
        :attr:`tol` while its noise test rejects ``s = 0`` is ``UNDETERMINED``: the signal lies below the
        probe's resolution (theory/numerics.md, *Verdict on the probe*), and a finer dtype decides it.
        """
        pv = self.probe_verdict
        if pv is Verdict.IMPROVABLE and (self.significant is False or self.noise_unusable):
            return Verdict.UNDETERMINED
        if pv is Verdict.SATURATED and self.significant:
            return Verdict.UNDETERMINED  # a signal the noise test sees, inside the rounding bound: below resolution
        return pv

    @property
    def examples_needed(self) -> int | None:
        """Probe size at which the noise test would reject ``s = 0`` if ``s² = ŝ²_U``.

        ``None`` when there is no signal, or when that size is not above :attr:`n`: the probe is already that
        large, so its size is not what is missing (the rounding bound or an unresolved direction is).
        """
        # ŝ²_U cancels n ŝ² against v̂: below ~1e-8 of their scale its sign is rounding
        if not (self.noise_variance > 0 and self.score_squared_unbiased > 1e-8 * self.noise_variance / self.n):
            return None
        need = math.ceil(self.noise_threshold * self.noise_variance / self.score_squared_unbiased)
        return need if need > self.n else None

    @property
    def verdict_reason(self) -> str:
        """One line saying why :attr:`verdict` is what it is (what would decide an undetermined one)."""
        v = self.verdict
        if v is Verdict.DEGENERATE:
            return "the tangent space is {0} (rank K = 0): the family cannot move the output at first order"
        if v is Verdict.SATURATED:
            return f"s = {self.score:.3g} is within the rounding bound {self.tol:.3g}"
        if v is Verdict.IMPROVABLE:
            if self.significant is None:
                return f"s = {self.score:.3g} exceeds the rounding bound {self.tol:.3g} (no noise test: v̂ not streamed)"
            return (
                f"s = {self.score:.3g} exceeds the rounding bound {self.tol:.3g} and the noise test "
                f"(n ŝ²/v̂ = {self.noise_ratio:.3g} > {self.noise_threshold:.3g}; level α = {self.alpha:g} as n grows, "
                f"at this n only measured, at α = 0.05, for symmetric g without atoms: rem-noise-test-level; "
                f"a finite-sample guarantee needs --delta with --grad-max and --leverage-max)"
            )
        if self.kink_ties:
            return (
                f"{self.kink_ties} exact tie(s) at kinks (relu/abs at 0, max ties) after the site: J may not be "
                f"differentiable at the origin and autograd's b is a one-sided convention (thm-gradient); "
                f"the one-sided derivatives decide (thm-directional)"
            )
        if not math.isfinite(self.tol):
            return (
                "the Gram is too ill-conditioned for the first-order rounding bound; rescale or drop features (at "
                "float64 sites of more than 1024 features, --gram units factors the rows and resolves far finer)"
            )
        if self.probe_verdict is Verdict.UNDETERMINED and not self.unresolved:
            return (
                f"the rounding bound {self.tol:.3g} is not below AG_rms/2 = {self.ag_rms / 2:.3g}: the arithmetic "
                f"cannot decide (features too ill-conditioned for this dtype)"
            )
        if self.probe_verdict is Verdict.UNDETERMINED:
            return (
                f"{self.unresolved} dropped direction(s) of the Gram could carry more score than the rounding bound "
                f"allows (real directions below what this probe's arithmetic resolves, or carrying activation "
                f"gradient beyond rounding): s = {self.score:.3g} is only a lower bound (use fewer or "
                f"better-conditioned features, a finer probe dtype, or at float64 sites of more than 1024 features "
                f"--gram units, which factors the rows)"
            )
        if self.probe_verdict is Verdict.SATURATED:
            return (
                f"s = {self.score:.3g} is within the rounding bound {self.tol:.3g}, yet the noise test finds signal "
                f"(n ŝ²/v̂ = {self.noise_ratio:.3g} > {self.noise_threshold:.3g}): below {self.dtype} resolution: "
                f"{_FINER.get(self.dtype, 'rerun with better-conditioned features (or a rescaled probe)')}"
            )
        if self.noise_unusable:
            return (
                f"the noise variance v̂ = {self.noise_variance:.3g} (bound {self.noise_variance_upper:.3g}) is not a "
                f"positive finite number, which tr(Σ⁻ E[XᵀX]) is whenever ŝ > 0: the noise moment along the kept "
                f"directions is below the arithmetic's resolution, so the noise test cannot run (a float64 probe "
                f"with k̃ ≤ 1024 computes v̂ from its triangular factor; or use better-conditioned features)"
            )
        return (
            f"n ŝ²/v̂ = {self.noise_ratio:.3g} ≤ {self.noise_threshold:.3g} (noise test, α = {self.alpha:g}): "
            f"the score is within sampling noise on {self.n} example{'s' if self.n != 1 else ''}; {self._noise_hint()}"
        )

    def _noise_hint(self) -> str:
        """What would decide a verdict the noise test left undetermined (:attr:`verdict_reason`)."""
        hint = self._sample_hint()
        if self.unresolved:  # ŝ is a lower bound: the dropped directions may hold the signal the test misses
            hint += (
                f"; and {self.unresolved} dropped direction(s) could carry more score than ŝ shows "
                f"(lem-dropped-score: a finer dtype, or --gram units at float64 sites of more than 1024 features)"
            )
        return hint

    def _sample_hint(self) -> str:
        """The noise test's part of :meth:`_noise_hint`: how many examples, or why more would not decide."""
        need = self.examples_needed
        if need:
            return f"about {need} examples would decide if s² ≈ {self.score_squared_unbiased:.3g}"
        if self.noise_variance > 0 and self.score_squared_unbiased > 1e-8 * self.noise_variance / self.n:
            return (
                "a larger probe alone would not decide: this many examples already suffice for s² ≈ "
                f"{self.score_squared_unbiased:.3g}, and the test is held back by the rounding bound (float32 "
                f"products test ŝ − e against an upper bound of v̂): rerun with float64 products"
            )
        return "the unbiased estimate of s² is not positive: no evidence of signal"

    def to_dict(self, *, with_gradient: bool = False) -> dict:
        """JSON-ready dictionary (``nan`` becomes ``None``), with the ``verdict`` as its string.

        Args:
            with_gradient: also include ``gradient`` (``b`` as a list of floats).

        Returns:
            The fields as a ``dict`` with ``verdict``/``probe_verdict`` as strings, ``verdict_reason`` and
            ``examples_needed`` added; non-finite floats as ``None``.
        """
        d = asdict(self)
        d["verdict"] = self.verdict.value
        d["probe_verdict"] = self.probe_verdict.value
        d["verdict_reason"] = self.verdict_reason
        d["examples_needed"] = self.examples_needed
        grad = d.pop("gradient")
        if with_gradient:
            d["gradient"] = grad.tolist()
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}
