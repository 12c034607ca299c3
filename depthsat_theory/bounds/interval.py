r"""The :math:`(1 − δ)` confidence interval for the saturation score (label ``thm-finite-sample``).

:func:`interval_from_moments` turns a probe's :class:`~depthsat_theory.bounds.moments.ProbeMoments`
into a :class:`ScoreInterval`: the interval ``[score_lower, score_upper]`` for ``s`` (or
the ridge score :math:`s_λ`), the certificate (:class:`~depthsat_theory.vocabulary.Certificate`,
``cor-certified-improvable`` / ``cor-certified-saturated``; a degenerate family gets
:attr:`~depthsat_theory.vocabulary.Verdict.DEGENERATE`), the family-free certificate
from ``AG_rms`` (:func:`ag_rms_upper`, ``cor-agmax-certificate-finite``), the plug-in
:math:`\hat{s}^2` and the U-statistic of :math:`s^2` (:func:`unbiased_score_squared`) and an optional
bootstrap interval (:func:`bootstrap_interval`, approximate, labelled as such).
Theory page ``theory/finite-sample.md``; units: loss units per unit function-space step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

import numpy as np

from depthsat_theory.bounds.constants import (
    SLACK,
    BoundError,
    Constant,
    argument,
    check_delta,
    check_n,
    check_number,
    resolve_constants,
)
from depthsat_theory.bounds.moments import Estimate, ProbeMoments, estimate
from depthsat_theory.bounds.terms import (
    bernstein_mean_upper,
    epsilon_n,
    matrix_deviations,
    matrix_variance_upper,
    relative_deviation,
    split_delta,
)
from depthsat_theory.vocabulary import Certificate, Verdict

__all__ = [
    "MATRIX_BOUNDS",
    "ScoreInterval",
    "ag_rms_upper",
    "bootstrap_interval",
    "interval_from_moments",
    "n_to_certify",
    "unbiased_score_squared",
]


def ag_rms_upper(n: int, ag_rms: float, grad_max: float, delta: float) -> float:
    """:math:`(1 − δ)` upper confidence bound on the population ``AG_rms = (E‖g‖_F²)^{1/2}``.

    Bernstein's inequality for :math:`‖g‖_F^2 ∈ [0, γ^2]` (label ``cor-agmax-certificate-finite``).
    Since ``s ≤ r ≤ AG_rms`` for every family at the site, the result is an upper
    confidence bound on all their scores at once.

    Args:
        n: probe size.
        ag_rms: the probe's ``AG_rms`` (loss units per unit step).
        grad_max: :math:`γ`, an almost-sure bound on :math:`‖g(x)‖_F`.
        delta: :math:`δ ∈ (0, 1)`.

    Returns:
        The upper confidence bound on ``AG_rms`` (loss units per unit step), at most :math:`γ`.

    Raises:
        BoundError: on :math:`δ ∉ (0, 1)`, :math:`n ≤ 0` or a negative/NaN constant.
    """
    n = check_n(n)
    delta = check_delta(delta)
    gam = check_number("grad_max", grad_max, allow_none=False)
    rms = check_number("ag_rms", ag_rms, allow_none=False)
    assert gam is not None and rms is not None  # allow_none=False
    return math.sqrt(bernstein_mean_upper(rms * rms, gam * gam, n, math.log(1 / delta)))


#: The matrix step of the interval, ``"worst-case"`` (``thm-finite-sample``, variance ``L_1``)
#: or ``"empirical-bernstein"`` (``thm-empirical-bernstein``, variance ``σ̄²`` from the probe)
MATRIX_BOUNDS = ("worst-case", "empirical-bernstein")


@dataclass
class ScoreInterval:
    r"""A confidence statement about the saturation score of one (site, family).

    Attributes:
        score: :math:`\hat{s}_λ` on the probe (:math:`\hat{s}` when ``ridge = 0``).
        score_lower, score_upper: the interval for :math:`s_λ` (``thm-finite-sample``);
            :math:`[0, γ]` when the bound is vacuous.
        score_upper_unregularized: with ``ridge > 0`` and an ``eig_floor`` μ, an upper
            bound on the unregularized ``s`` (:math:`s ≤ s_λ √(1 + λ/μ)`); else ``None``
            (equal to ``score_upper`` when ``ridge = 0``).
        delta: :math:`δ`; ``candidates``: ``m`` of the union bound (each interval at :math:`δ/m`).
        n: probe size.
        ridge: :math:`λ`.
        epsilon_n: additive half-width :math:`ε_n` (loss units per unit step).
        relative_deviation: :math:`Δ_n` (dimensionless), the bound on :math:`‖\bar{Ψ} − EΨ‖`
            (:math:`\max(Δ_n^−, Δ_n^+)` with the empirical-Bernstein step).
        relative_deviation_lower, relative_deviation_upper: :math:`Δ_n^−`, :math:`Δ_n^+`, the
            bounds on ``λ_max(EΨ − Ψ̄)`` and ``λ_max(Ψ̄ − EΨ)`` (both :math:`Δ_n` with the
            worst-case step).
        matrix_bound: which matrix step was used (:data:`MATRIX_BOUNDS`): ``"worst-case"``
            (``thm-finite-sample``) or ``"empirical-bernstein"`` (``thm-empirical-bernstein``).
        vacuous: :math:`Δ_n^− ≥ 1` (``n`` too small for the leverage bound).
        certificate: a :class:`~depthsat_theory.vocabulary.Certificate` (``"certified
            improvable"``, ``"certified ε-saturated"``, ``"not certified"``), or
            :attr:`~depthsat_theory.vocabulary.Verdict.DEGENERATE` when :math:`\hat{Σ} = 0`.
        saturation_epsilon: the :math:`ε` of the saturation certificate (``None``: not asked).
        guaranteed: ``True`` when every constant is the user's or derived from the
            user's (then the :math:`1 − δ` coverage is a theorem); ``False`` for plug-ins.
        label: one line saying what kind of interval this is.
        constants: each constant with its source.
        assumptions: the theory labels (``asm-*``) the guarantee rests on, in words.
        score_squared: plug-in :math:`\hat{s}_λ^2` (biased upward by about ``v/n``).
        score_squared_unbiased: :math:`(n \hat{s}^2 − \hat{v})/(n − 1)` (``None`` for ``n = 1``); exactly
            unbiased for :math:`s^2` when the whitening is the population :math:`Σ`, and with the
            probe's :math:`\hat{Σ}` it removes the leading ``v/n`` bias term.
        variance_plugin: :math:`\hat{v} = \operatorname{mean} ‖G_x \hat{Σ}_λ^{+1/2}‖_F^2`.
        ag_rms_upper: :math:`(1 − δ)` upper bound on the population ``AG_rms`` (bounds ``s``
            of every family at the site), ``cor-agmax-certificate-finite``.
        ag_certificate: the verdict of that bound against ``saturation_epsilon``.
        bootstrap_interval: ``None`` or a dict (``lower``, ``upper``, ``method``,
            ``resamples``, ``label``): approximate, not a guarantee.
        looseness: ``(score_upper − score_lower)`` over the bootstrap interval's width.
        n_to_certify: the probe size at which this interval's lower end would exceed 0 if
            :math:`\hat{s}_λ`, :math:`\hat{v}` and the constants :math:`γ, L, D` stayed as measured (worst-case matrix
            step, :math:`V = \hat{v}`): a plan for "certified improvable", not a guarantee; ``None``
            when :math:`\hat{s}_λ = 0` or beyond :math:`10^{15}` examples (see :func:`n_to_certify`).
        tangent_rank: numerical rank of :math:`\hat{Σ}`.
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
    relative_deviation_lower: float
    relative_deviation_upper: float
    matrix_bound: str
    vacuous: bool
    certificate: Certificate | Verdict
    saturation_epsilon: float | None
    guaranteed: bool
    label: str
    constants: dict[str, Constant]
    assumptions: list[str]
    score_squared: float
    score_squared_unbiased: float | None
    variance_plugin: float
    ag_rms_upper: float
    ag_certificate: Certificate | str
    bootstrap_interval: dict | None
    looseness: float | None
    n_to_certify: int | None
    tangent_rank: int
    notes: list[str]

    def to_dict(self) -> dict:
        """JSON-ready dictionary (``nan`` becomes ``None``).

        Returns:
            The fields as a ``dict`` (constants as their :meth:`Constant.to_dict`), non-finite floats as ``None``.
        """
        d = asdict(self)
        d["constants"] = {k: c.to_dict() for k, c in self.constants.items()}
        return _clean(d)


def _clean(obj: Any) -> Any:
    if isinstance(obj, Enum):
        return obj.value
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
    matrix_bound: str = "worst-case",
) -> ScoreInterval:
    r"""The :math:`(1 − δ)` confidence interval for :math:`s_λ` from a probe's moments (``thm-finite-sample``).

    With :math:`u_1 = \ln(2/δ_1)`, :math:`u_2 = \ln(2D/δ_2)`, ``L_1 = max(L, 1)``, :math:`R = γ√L`::

        Δ_n = √(2 L_1 u_2 / n) + 2 L_1 u_2 / (3n),      ε_n = √(2 V u_1 / n) + 2 R u_1 / n,
        s_λ ∈ [ŝ_λ √(1 − Δ_n) − ε_n,  ŝ_λ √(1 + Δ_n) + ε_n]   (when Δ_n < 1),

    where ``V`` is the user's bound, or (``variance=None``) the empirical-Bernstein upper
    bound :math:`((c + √(c^2 + 4e))/2)^2`, :math:`c = √(2R^2u_3/n)`, :math:`e = (1 + Δ_n) \hat{v} + 2R^2u_3/(3n)`,
    :math:`u_3 = \ln(1/δ_3)`.  :math:`δ/m` (``m = candidates``) is split equally over the two
    (three) events.  The upper end is capped at :math:`γ` (``s_λ ≤ AG_rms ≤ γ``).

    Args:
        m: the probe's moments (:class:`ProbeMoments`, or :meth:`BoundStatistics.moments`).
        delta: :math:`δ ∈ (0, 1)`.
        ridge: :math:`λ ≥ 0` (feature² units); ``0`` is the plain score ``s``.
        grad_max: :math:`γ` (default: the probe's ``AG_max``, a plug-in).
        leverage_max: ``L`` (default: derived from ``feature_norm_max``, else the
            probe's largest leverage, a plug-in).
        feature_norm_max: ``B`` with ``eig_floor`` and/or ``ridge``: :math:`L = B^2/(μ + λ)`.
        eig_floor: :math:`μ`, a floor on the nonzero eigenvalues of :math:`Σ`; also turns the
            ridge interval into an upper bound on ``s``.
        variance: ``V`` (default: empirical Bernstein from the probe).
        dim: :math:`D ≥ \operatorname{rank} Σ` (default :math:`\tilde{k}`; :math:`\min(\tilde{k}, ⌊L⌋)` when ``ridge =
            0``).
        epsilon: the :math:`ε` of the saturation certificate (``None``: no such verdict).
        candidates: number :math:`m ≥ 1` of (site, family) candidates judged on this probe
            (union bound).
        bootstrap: number of bootstrap resamples (``0``: none); needs kept rows.
        seed: bootstrap seed.
        bootstrap_method: see :func:`bootstrap_interval` (default ``"ustat"``).
        matrix_bound: the matrix step (:data:`MATRIX_BOUNDS`): ``"worst-case"`` (above) or
            ``"empirical-bernstein"`` (``thm-empirical-bernstein``: :math:`δ` split in four,
            one-sided :math:`Δ_n^∓ = √(2\bar{σ}^2u_2/n) + 2\{1, L\}u_2/(3n)` with :math:`\bar{σ}^2` an upper
            confidence bound on :math:`‖E Ψ_x^2‖` from the probe's :math:`\hat{σ}^2` (needs kept rows and,
            with ``ridge = 0``, :math:`\operatorname{rank} \hat{Σ} = D`; otherwise :math:`\bar{σ}^2 = L`)).

    Returns:
        A :class:`ScoreInterval`.

    Raises:
        BoundError: :math:`δ ∉ (0, 1)`, negative/NaN/missing constants, ``epsilon ≤ 0``,
            ``candidates < 1``, an unknown ``matrix_bound``, or a bootstrap without kept
            rows; the message names the Python arguments.
    """
    delta = check_delta(delta)
    if matrix_bound not in MATRIX_BOUNDS:
        raise BoundError(f"{argument('matrix_bound')} must be one of {MATRIX_BOUNDS}, got {matrix_bound!r}")
    candidates = check_n(candidates, "candidates")
    eps_target = check_number("epsilon", epsilon, positive=True)
    nboot = int(check_number("bootstrap", bootstrap) or 0)
    ridge = check_number("ridge", ridge) or 0.0
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
    const = resolve_constants(
        ridge=ridge,
        grad_max=grad_max,
        leverage_max=leverage_max,
        feature_norm_max=feature_norm_max,
        eig_floor=eig_floor,
        variance=variance,
        dim=dim,
        probe=probe,
    )
    r = const["whitened_max"].value
    s_hat = math.sqrt(est.s2)
    notes: list[str] = []
    steps = _steps(matrix_bound, const, est, n, delta / candidates, ridge, notes)
    dev_lo, dev_hi, u1, u3 = steps
    _probe_checks(const, m, est, dev_lo, notes)
    var = _variance(const, est, (dev_lo, dev_hi), n, u3)
    eps_n = epsilon_n(n, var, r, u1)
    lower, upper = _ends(s_hat, (dev_lo, dev_hi), eps_n, const, n, notes)
    if ridge == 0 and dev_lo < 1:
        lower, upper = _resolved_ends(m, s_hat, (dev_lo, dev_hi), (lower, upper, eps_n), const, n, u1, notes)
    upper_s = _upper_unregularized(upper, ridge, const, notes)
    if lower > upper or (upper_s is not None and lower > upper_s):
        raise BoundError(
            f"inconsistent constants: the interval would be inverted (lower end "
            f"{lower:.4g} > upper end {min(upper, upper_s if upper_s is not None else upper):.4g}); "
            f"check {argument('grad_max')}, {argument('leverage_max')}, {argument('variance')} and "
            f"{argument('eig_floor')} against the probe"
        )
    ag_up = ag_rms_upper(n, math.sqrt(m.g_sq), const["grad_max"].value, delta / candidates)
    guaranteed = const["grad_max"].source != "probe" and const["leverage_max"].source != "probe"
    if candidates > 1:
        notes.append(f"union bound over {candidates} candidates: each interval at level δ/{candidates}")
    boot, loose = _bootstrap(m, delta / candidates, nboot, ridge, seed, bootstrap_method, upper - lower)
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
        relative_deviation=max(dev_lo, dev_hi),
        relative_deviation_lower=dev_lo,
        relative_deviation_upper=dev_hi,
        matrix_bound=matrix_bound,
        vacuous=dev_lo >= 1,
        certificate=_certificate(m, lower, upper_s, eps_target),
        saturation_epsilon=eps_target,
        guaranteed=guaranteed,
        label=_label(guaranteed),
        constants=const,
        assumptions=_assumptions(const),
        score_squared=est.s2,
        score_squared_unbiased=(n * est.s2 - est.v_hat) / (n - 1) if n > 1 else None,
        variance_plugin=est.v_hat,
        ag_rms_upper=ag_up,
        ag_certificate=_ag_certificate(ag_up, eps_target),
        bootstrap_interval=boot,
        looseness=loose,
        n_to_certify=n_to_certify(s_hat, est.v_hat, const, delta / candidates),
        tangent_rank=est.rank,
        notes=notes,
    )


_N_PLAN_MAX = 10**15


def n_to_certify(s_hat: float, v_hat: float, const: dict[str, Constant], delta: float) -> int | None:
    r"""Smallest ``n`` with ``ŝ √(1 − Δ_n) − ε_n > 0`` if ``ŝ``, ``v̂`` and the constants stayed as measured.

    The interval of ``thm-finite-sample`` with the worst-case matrix step and :math:`δ` split over
    three events (``V`` from the probe) or two (``V`` given); ``V`` is the user's bound or the
    plug-in :math:`\hat{v}` (the empirical-Bernstein bound tends to it as ``n`` grows). The lower end is
    increasing in ``n``, so the root is found by doubling and bisection.

    Args:
        s_hat: :math:`\hat{s}_λ ≥ 0` (loss units per unit step).
        v_hat: :math:`\hat{v} = \operatorname{mean} ‖G_x \hat{Σ}_λ^{+1/2}‖_F^2`.
        const: the interval's resolved constants (``grad_max``, ``leverage_max``, ``whitened_max``, ``dim``).
        delta: the level of this one interval (:math:`δ/m` after the union bound).

    Returns:
        The probe size (examples), or ``None`` when :math:`\hat{s} = 0` or above :math:`10^{15}`.
    """
    if not s_hat > 0:
        return None
    given_v = "variance" in const and const["variance"].source == "user"
    var = const["variance"].value if given_v else v_hat
    d1, d2, _ = split_delta(delta, 1, not given_v)
    u1, u2 = math.log(2 / d1), math.log(2 * const["dim"].value / d2)
    big_l, r = const["leverage_max"].value, const["whitened_max"].value

    def certifies(n: int) -> bool:
        dev = relative_deviation(n, big_l, u2)
        return dev < 1 and s_hat * math.sqrt(1 - dev) - epsilon_n(n, var, r, u1) > 0

    hi = 1
    while not certifies(hi):
        if hi > _N_PLAN_MAX:
            return None
        hi *= 2
    lo = hi // 2  # certifies(lo) is False (or lo = 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if certifies(mid) else (mid, hi)
    return hi


def _steps(
    method: str, const: dict[str, Constant], est: Estimate, n: int, per: float, ridge: float, notes: list[str]
) -> tuple[float, float, float, float]:
    """:math:`(Δ^−, Δ^+, u_1, u_3)` of the chosen matrix step (``u_3 = inf`` when ``V`` is given)."""
    empirical_v = "variance" not in const
    dim = const["dim"].value
    big_l = const["leverage_max"].value
    if method == "worst-case":
        d1, d2, d3 = split_delta(per, 1, empirical_v)
        u2 = math.log(2 * dim / d2)
        dev = relative_deviation(n, big_l, u2)
        return dev, dev, math.log(2 / d1), math.log(1 / d3) if d3 > 0 else math.inf
    parts = 4 if empirical_v else 3
    d1 = per / parts  # δ_1 = δ_2 = δ_4 (= δ_3 when V comes from the probe)
    u2, u4 = math.log(2 * dim / d1), math.log(1 / d1)
    usable = math.isfinite(est.psi_sq) and (ridge > 0 or est.rank >= dim)
    if usable:
        sig = matrix_variance_upper(est.psi_sq, big_l, n, u2, u4)
        const["matrix_variance"] = Constant(
            "σ²",
            sig,
            "probe",
            f"empirical-Bernstein upper bound on ‖E Ψ_x²‖ from σ̂² = {est.psi_sq:.6g} "
            f"(thm-empirical-bernstein; rigorous given γ, L and D)",
        )
    else:
        sig = big_l
        why = "the probe's rows were not kept" if not math.isfinite(est.psi_sq) else f"rank Σ̂ = {est.rank} < D"
        const["matrix_variance"] = Constant("σ²", sig, "derived", f"σ² ≤ L surely ({why}: no probe estimate)")
    lo, hi = matrix_deviations(n, sig, big_l, u2)
    notes.append(
        f"matrix step: empirical Bernstein (thm-empirical-bernstein), σ̄² = {sig:.4g} vs L = {big_l:.4g}; "
        f"Δ^− = {lo:.3g}, Δ^+ = {hi:.3g}"
    )
    return lo, hi, math.log(2 / d1), math.log(1 / d1) if empirical_v else math.inf


def _variance(const: dict[str, Constant], est: Estimate, devs: tuple[float, float], n: int, u3: float) -> float:
    r"""``V``: the user's, else empirical Bernstein from :math:`\hat{v}` (recorded in ``const``), else :math:`R^2`."""
    if "variance" in const:
        return const["variance"].value
    r = const["whitened_max"].value
    dev_lo, dev_hi = devs
    if dev_lo < 1:
        var = bernstein_mean_upper((1 + dev_hi) * est.v_hat, r * r, n, u3)
        const["variance"] = Constant(
            "V",
            var,
            "probe",
            "empirical-Bernstein upper bound on E‖G_x Σ_λ^{+1/2}‖² from v̂ = "
            f"{est.v_hat:.6g} (rigorous given γ and L)",
        )
        return var
    const["variance"] = Constant("V", r * r, "derived", "worst case R² (the bound is vacuous)")
    return r * r


def _ends(s_hat: float, devs: tuple[float, float], eps_n: float, const: dict[str, Constant], n: int, notes: list[str]):
    """``(lower, upper)`` for :math:`s_λ`: :math:`[0, γ]` when vacuous, capped at a non-probe :math:`γ`."""
    gam = const["grad_max"].value
    dev_lo, dev_hi = devs
    if dev_lo >= 1:
        notes.append(
            f"vacuous: Δ_n = {dev_lo:.3g} ≥ 1 (n = {n} is too small for the leverage bound "
            f"L = {const['leverage_max'].value:.4g}); `depthsat bound` gives the n needed"
        )
        return 0.0, gam
    lower = max(0.0, s_hat * math.sqrt(1 - dev_lo) - eps_n)
    upper = s_hat * math.sqrt(1 + dev_hi) + eps_n
    if const["grad_max"].source != "probe":
        upper = min(upper, gam)  # s_λ ≤ s ≤ AG_rms ≤ γ
    return lower, upper


def _resolved_ends(
    m: ProbeMoments,
    s_hat: float,
    devs: tuple[float, float],
    ends: tuple[float, float, float],
    const: dict[str, Constant],
    n: int,
    u1: float,
    notes: list[str],
) -> tuple[float, float]:
    r"""The ends widened by the verdict path's rounding bound ``e`` and, with unresolved directions, :math:`[·, γ]`.

    ``|ŝ − ŝ_exact| ≤ e`` (``thm-score-error``), so the ends use :math:`\hat{s} ∓ e`.  With a direction the verdict path
    left unresolved, the computed :math:`\hat{s}` is only a lower bound of the probe's exact score
    (``lem-lower-bound``): the
    upper end is :math:`γ` (``s ≤ AG_rms ≤ γ``), and the lower end uses the worst-case :math:`\bar{V} = R^2` (or the
    user's
    ``V``), which is at least the :math:`\bar{V}` of the untruncated probe, so it stays below that probe's lower end
    (theory/finite-sample.md, ``cor-certified-saturated``).
    """
    e, gam = m.score_error, const["grad_max"].value
    lower, upper, eps_n = ends
    if e == 0 and not m.unresolved:
        return lower, upper
    if not math.isfinite(e):
        notes.append("the rounding bound e of ŝ is infinite (thm-score-error): the interval is [0, γ]")
        return 0.0, gam
    dev_lo, dev_hi = devs
    r = const["whitened_max"].value
    eps_lo = eps_n
    if m.unresolved:
        var = const["variance"].value if const["variance"].source == "user" else r * r
        eps_lo = epsilon_n(n, var, r, u1)
        upper = gam
        notes.append(
            f"{m.unresolved} dropped direction(s) of Σ̂ are unresolved (the verdict's reason): ŝ is only a lower "
            f"bound, so the upper end is γ = {gam:.4g} and the lower end uses V̄ = {var:.4g}"
        )
    else:
        upper = (s_hat + e) * math.sqrt(1 + dev_hi) + eps_n
        upper = min(upper, gam) if const["grad_max"].source != "probe" else upper
    lower = max(0.0, max(s_hat - e, 0.0) * math.sqrt(1 - dev_lo) - eps_lo)
    return lower, upper


def _upper_unregularized(upper: float, ridge: float, const: dict[str, Constant], notes: list[str]) -> float | None:
    """Upper bound on the unregularized ``s``: :math:`s ≤ s_λ √(1 + λ/μ)` (``None`` without :math:`μ`)."""
    if ridge == 0:
        return upper
    if "eig_floor" not in const:
        notes.append(
            "with a ridge and no eig_floor, the upper end bounds s_λ only (s ≥ s_λ); give "
            "--eig-floor for a saturation certificate on s"
        )
        return None
    upper_s = upper * math.sqrt(1 + ridge / const["eig_floor"].value)
    if const["grad_max"].source != "probe":
        upper_s = min(upper_s, const["grad_max"].value)
    return upper_s


def _certificate(m: ProbeMoments, lower: float, upper_s: float | None, eps: float | None) -> Certificate | Verdict:
    if not np.any(m.sigma):
        return Verdict.DEGENERATE
    if lower > 0:
        return Certificate.IMPROVABLE
    if eps is not None and upper_s is not None and upper_s <= eps:
        return Certificate.SATURATED
    return Certificate.NOT_CERTIFIED


def _ag_certificate(ag_up: float, eps: float | None) -> Certificate | str:
    if eps is None:
        return "not asked (give epsilon)"
    return Certificate.SATURATED if ag_up <= eps else Certificate.NOT_CERTIFIED


def _label(guaranteed: bool) -> str:
    if guaranteed:
        return "(1-δ) confidence interval (thm-finite-sample)"
    return "plug-in interval: γ and/or L from the probe, not a guarantee (thm-finite-sample with estimated constants)"


def _assumptions(const: dict[str, Constant]) -> list[str]:
    out = [_ASSUMPTIONS["iid"], _ASSUMPTIONS["grad"], _ASSUMPTIONS["lev"], _ASSUMPTIONS["dim"]]
    if const["variance"].source == "user":
        out.append(_ASSUMPTIONS["var"])
    return out


def _bootstrap(
    m: ProbeMoments, delta: float, nboot: int, ridge: float, seed: int, method: str, width: float
) -> tuple[dict | None, float | None]:
    """The bootstrap interval and the looseness ``width / bootstrap width`` (``None`` when off)."""
    if nboot <= 0:
        return None, None
    boot = bootstrap_interval(m, delta, resamples=nboot, ridge=ridge, seed=seed, method=method)
    bwidth = boot["upper"] - boot["lower"]
    return boot, (width / bwidth if bwidth > 0 else None)


def _probe_checks(const: dict[str, Constant], m: ProbeMoments, est: Estimate, dev: float, notes: list[str]) -> None:
    r"""Compare user constants with the probe: errors for contradictions, notes for plug-in tension.

    - ``L`` (user or derived): on the matrix event of the interval itself (probability
      :math:`≥ 1 − δ_2`), :math:`\hat{Σ}_λ ⪰ (1 − Δ_n) Σ_λ` on :math:`\operatorname{range} Σ`, so every probe leverage
      :math:`\hat{ℓ}(x_i) = \operatorname{tr}(\hat{Σ}_λ^+ Σ_{x_i}) ≤ ℓ_λ(x_i)/(1 − Δ_n) ≤ L/(1 − Δ_n)`; a larger probe
      leverage contradicts ``L`` at the interval's own level (error), one in
      :math:`(L, L/(1 − Δ_n)]` is only noted.
    - ``V`` below the plug-in :math:`\hat{v}` and :math:`μ` above the smallest nonzero eigenvalue of
      :math:`\hat{Σ}`: population assumptions the probe can miss by sampling (notes).
    """
    lev = const["leverage_max"]
    if lev.source != "probe" and est.lev_exact and math.isfinite(est.lev_max):
        big_l = lev.value
        what = (
            argument("leverage_max", f"{big_l:g}")
            if lev.source == "user"
            else (
                f"L = B²/(μ + λ) = {big_l:.4g} (from {argument('feature_norm_max')} with "
                f"{argument('eig_floor')}/{argument('ridge')})"
            )
        )
        if dev < 1 and est.lev_max > big_l / (1 - dev) * (1 + SLACK):
            raise BoundError(
                f"{what} is below the probe's own max leverage ℓ̂ = {est.lev_max:.4g} "
                f"(with Σ̂; ℓ̂ ≤ L/(1 − Δ_n) = {big_l / (1 - dev):.4g} whenever the "
                f"interval's matrix event holds), so it is not an almost-sure bound"
            )
        if est.lev_max > big_l * (1 + SLACK):
            notes.append(
                f"the probe's largest leverage ℓ̂ = {est.lev_max:.4g} (with the probe's Σ̂) "
                f"exceeds L = {big_l:.4g}; ℓ̂ uses Σ̂, not Σ, so this is not a contradiction, "
                f"but check L"
            )
    var = const.get("variance")
    if var is not None and var.source == "user" and var.value < est.v_hat * (1 - SLACK):
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
        if nz.size and float(nz.min()) < mu.value * (1 - SLACK):
            notes.append(
                f"--eig-floor μ = {mu.value:.4g} is above the smallest nonzero eigenvalue of "
                f"the probe's Σ̂ ({float(nz.min()):.4g}): μ is an assumption on the population "
                f"Σ, which the probe does not support"
            )


def unbiased_score_squared(m: ProbeMoments, *, ridge: float = 0.0, whitening: np.ndarray | None = None) -> float:
    r"""The U-statistic :math:`(n \hat{s}^2 − \hat{v})/(n − 1)` of :math:`s^2` (:math:`s_λ^2` with a ridge).

    :math:`\hat{s}^2 = ‖\bar{ξ}‖^2` and :math:`\hat{v} = \operatorname{mean} ‖ξ_x‖^2` with :math:`ξ_x = G_x W^{1/2}`;
    then
    :math:`(n \hat{s}^2 − \hat{v})/(n − 1) = (1/(n(n−1))) Σ_{i≠j} ⟨ξ_i, ξ_j⟩`, exactly unbiased for
    :math:`‖E ξ‖^2 = s^2` when ``W`` is fixed (the population :math:`Σ_λ^+`).  By default ``W`` is
    the probe's :math:`\hat{Σ}_λ^+`; then only the leading ``v/n`` bias of :math:`\hat{s}^2` is removed.

    Args:
        m: the probe's moments.
        ridge: :math:`λ ≥ 0`.
        whitening: a fixed ``(k, k)`` PSD matrix ``W`` (e.g. the population :math:`Σ^+`).

    Returns:
        The U-statistic as a ``float`` (squared loss units per unit step; may be negative).

    Raises:
        BoundError: if ``n < 2``.
    """
    if m.n < 2:
        raise BoundError("the U-statistic needs n >= 2 examples")
    if whitening is None:
        est = estimate(m, check_number("ridge", ridge) or 0.0, leverage=False)
        s2, v_hat = est.s2, est.v_hat
    else:
        w = np.asarray(whitening, dtype=np.float64)
        s2 = float(np.sum((m.cross @ w) * m.cross))
        v_hat = float(np.sum(w * m.q))
    return (m.n * s2 - v_hat) / (m.n - 1)


def bootstrap_interval(
    m: ProbeMoments, delta: float, *, resamples: int = 200, ridge: float = 0.0, seed: int = 0, method: str = "ustat"
) -> dict:
    r"""Bootstrap interval for :math:`s_λ` over the probe's examples (approximate, not a guarantee).

    Resamples ``n`` examples with replacement ``resamples`` times.  Methods:

    - ``"ustat"`` (default): the basic (reverse-percentile) bootstrap of the U-statistic
      :math:`\hat{U}` of :math:`s^2`: :math:`\hat{U}^* − \hat{s}^2` (:math:`\hat{s}^2` is the bootstrap world's
      :math:`s^2`) stands in for
      :math:`\hat{U} − s^2`, giving
      :math:`[\hat{U} − (q_{1−δ/2}(\hat{U}^*) − \hat{s}^2), \hat{U} − (q_{δ/2}(\hat{U}^*) − \hat{s}^2)]`,
      clipped at 0 and square-rooted;
    - ``"basic"``: the same on :math:`\hat{s}` (:math:`[2\hat{s} − q_{1−δ/2}, 2\hat{s} − q_{δ/2}]`, clipped at 0);
    - ``"percentile"``: :math:`[q_{δ/2}(\hat{s}^*), q_{1−δ/2}(\hat{s}^*)]`.

    :math:`\hat{s}` is biased upward (:math:`E \hat{s}^2 ≈ s^2 + v/n`), and at ``s = 0`` the bootstrap
    distribution of :math:`\hat{s}^*` lies above :math:`\hat{s}`: the ``"basic"`` and ``"percentile"``
    intervals then miss ``0`` far more often than :math:`δ` (see the T7 coverage table).
    Needs the probe in memory (:class:`ProbeMoments` with rows).

    Args:
        m: the probe's moments, with the rows kept (``m.phi`` not ``None``).
        delta: :math:`δ ∈ (0, 1)`: the interval has nominal level :math:`1 − δ`.
        resamples: number of bootstrap resamples (:math:`≥ 1`).
        ridge: :math:`λ ≥ 0`.
        seed: seed of the :func:`numpy.random.default_rng` drawing the resamples.
        method: ``"ustat"``, ``"basic"`` or ``"percentile"``.

    Returns:
        A ``dict`` with ``lower`` and ``upper`` (floats, loss units per unit step), ``method``
        (a description), ``resamples`` and ``label``.

    Raises:
        BoundError: on bad :math:`δ`, ``resamples < 1``, an unknown method, ``n < 2`` for
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
            f"pass {argument('bootstrap', 0)} for no bootstrap interval"
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
