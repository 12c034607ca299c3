"""The sample-size calculator of the finite-sample bound (``thm-finite-sample``).

:func:`plan_bound` gives the half-width ``h_n`` of the interval for ``(n, δ, constants)``,
or the probe size needed for a target half-width (:func:`halfwidth`,
:func:`required_n`); the inverse formulas are the sympy derivation of
:mod:`depthsat_theory.bounds.formula`.  Theory page ``theory/finite-sample.md``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from depthsat_theory.bounds.constants import (
    BoundError,
    Constant,
    argument,
    check_delta,
    check_n,
    check_number,
    resolve_constants,
)
from depthsat_theory.bounds.formula import combined_required_n, formulas
from depthsat_theory.bounds.terms import deviation_halfwidth, epsilon_n, relative_deviation, split_delta

__all__ = ["BoundPlan", "halfwidth", "plan_bound", "required_n"]


@dataclass
class BoundPlan:
    r"""Output of the sample-size calculator (:func:`plan_bound`).

    Attributes:
        n: the probe size the numbers refer to (the required size when ``target`` is set).
        delta: :math:`δ`; ``candidates``: union-bound count ``m``.
        epsilon_n: additive half-width :math:`ε_n`.
        relative_deviation: :math:`Δ_n`.
        halfwidth: :math:`h_n = (ε_n + S Δ_n)/√(1 − Δ_n)`, a bound on :math:`|\hat{s}_λ − s_λ|` for
            every :math:`s_λ ≤ S` (``inf`` when :math:`Δ_n ≥ 1`).
        score_max: ``S``.
        target: the target half-width (``None`` when ``n`` was given).
        n_required: smallest ``n`` with ``h_n ≤ target`` (``None`` when ``n`` was given).
        n_epsilon_only: smallest ``n`` with ``ε_n ≤ target`` (closed form; ``None`` …).
        n_nonvacuous: smallest ``n`` with :math:`Δ_n < 1`.
        constants: each constant with its source.
        formulas: the formulas in words.
        vacuous: :math:`Δ_n ≥ 1` at ``n`` (the half-width is infinite, ``None`` in JSON).
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
        """JSON-ready dictionary (``inf`` becomes ``None``).

        Returns:
            The fields as a ``dict`` (constants as their :meth:`Constant.to_dict`), non-finite floats as ``None``.
        """
        d = asdict(self)
        d["constants"] = {k: c.to_dict() for k, c in self.constants.items()}
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def _plan_constants(delta: float, candidates: int, kw: dict) -> tuple:
    """Constants of the calculator: ``(constants, γ, L, R, V, u_1, u_2)``."""
    const = resolve_constants(probe=None, **kw)
    gam = const["grad_max"].value
    big_l = const["leverage_max"].value
    r = const["whitened_max"].value
    if "variance" not in const:
        const["variance"] = Constant(
            "V", r * r, "derived", "worst case V = R² = γ² L (give --variance for a tighter bound)"
        )
    var = const["variance"].value
    d1, d2, _ = split_delta(delta, candidates, False)
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
    r"""Half-width from ``(n, δ, constants)``, or the probe size needed for a half-width.

    Exactly one of ``n`` and ``epsilon`` is given.  ``V`` defaults to the worst case
    :math:`R^2 = γ^2 L` (then :math:`δ` is split in two, as when ``V`` is given); ``S``
    (``score_max``) defaults to :math:`\min(γ, √V)`, an a-priori bound on :math:`s_λ`.  The
    inverse formulas are the sympy derivation of :mod:`depthsat_theory.bounds.formula`.

    Args:
        delta: :math:`δ ∈ (0, 1)`.
        n: probe size :math:`≥ 1`.
        epsilon: target half-width ``> 0`` (loss units per unit step).
        grad_max: :math:`γ`, an almost-sure bound :math:`γ ≥ ‖g(x)‖_F` (required).
        leverage_max: ``L``, an almost-sure bound :math:`L ≥ ℓ_λ(x) = \operatorname{tr}(Σ_λ^+ Σ_x)`; required unless
            ``B`` is given with :math:`μ`/:math:`λ`.
        feature_norm_max: ``B``, an almost-sure bound on :math:`(Σ_t ‖\tilde{φ}_t‖^2)^{1/2}`, giving
            :math:`L = B^2/(μ + λ)` with :math:`μ` and/or :math:`λ`.
        eig_floor: :math:`μ`, a floor on the nonzero eigenvalues of :math:`Σ`.
        ridge: :math:`λ ≥ 0`, the ridge added to :math:`Σ` (the half-width is then for :math:`s_λ`).
        variance: ``V``, a bound on :math:`E‖G_x Σ_λ^{+1/2}‖_F^2` (default: the worst case :math:`R^2 = γ^2 L`).
        dim: :math:`D ≥ \operatorname{rank} Σ`; when not given, :math:`⌊L⌋` for :math:`λ = 0` (required when
            :math:`λ > 0`).
        score_max: :math:`S ≥ 0`: the half-width holds for every :math:`s_λ ≤ S`.
        candidates: union-bound count :math:`m ≥ 1`.

    Returns:
        The :class:`BoundPlan`: with ``n`` given, its half-width; with ``epsilon`` given, also the
        required probe size ``n_required`` (and ``n`` set to it).

    Raises:
        BoundError: on :math:`δ ∉ (0, 1)`, :math:`n ≤ 0`, ``epsilon ≤ 0``, both or neither of
            ``n``/``epsilon``, or missing/negative/NaN constants.
    """
    delta = check_delta(delta)
    candidates = check_n(candidates, "candidates")
    if (n is None) == (epsilon is None):
        raise BoundError(
            f"give exactly one of {argument('n')} (for the half-width) and {argument('epsilon')} "
            f"(for the probe size needed)"
        )
    if n is not None:
        n = check_n(n)
    target = check_number("epsilon", epsilon, positive=True)
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
    smax = check_number("score_max", score_max)
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
        while deviation_halfwidth(n_req, var, r, u1, l1, u2, smax) > target:  # guard against rounding
            n_req += 1
        while n_req > 1 and deviation_halfwidth(n_req - 1, var, r, u1, l1, u2, smax) <= target:
            n_req -= 1
        n = n_req
    assert n is not None  # exactly one of n and epsilon was given
    eps_n = epsilon_n(n, var, r, u1)
    dev = relative_deviation(n, big_l, u2)
    half = deviation_halfwidth(n, var, r, u1, l1, u2, smax)
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


def halfwidth(n: int, delta: float, **constants: Any) -> float:
    """``h_n`` for ``(n, δ, constants)``: see :func:`plan_bound` (``inf`` when vacuous).

    Args:
        n: probe size :math:`≥ 1`.
        delta: :math:`δ ∈ (0, 1)`.
        **constants: the other keyword arguments of :func:`plan_bound` (``grad_max``, ``leverage_max``, …).

    Returns:
        The half-width ``h_n`` (loss units per unit step), ``inf`` when vacuous.

    Raises:
        BoundError: as :func:`plan_bound`.
    """
    return plan_bound(n=n, delta=delta, **constants).halfwidth


def required_n(epsilon: float, delta: float, **constants: Any) -> int:
    """Smallest probe size with ``h_n ≤ epsilon``: see :func:`plan_bound`.

    Args:
        epsilon: target half-width ``> 0`` (loss units per unit step).
        delta: :math:`δ ∈ (0, 1)`.
        **constants: the other keyword arguments of :func:`plan_bound` (``grad_max``, ``leverage_max``, …).

    Returns:
        The smallest probe size :math:`n ≥ 1` with ``h_n ≤ epsilon``.

    Raises:
        BoundError: as :func:`plan_bound`.
    """
    n = plan_bound(epsilon=epsilon, delta=delta, **constants).n_required
    assert n is not None  # epsilon was given
    return n
