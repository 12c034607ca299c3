r"""The deviation terms of the finite-sample bound (``thm-finite-sample``, theory/finite-sample.md).

With :math:`u_1 = \ln(2/δ_1)`, :math:`u_2 = \ln(2D/δ_2)`, ``L_1 = max(L, 1)`` and :math:`R = γ√L`::

    ε_n = √(2 V u_1 / n) + 2 R u_1 / n,        Δ_n = √(2 L_1 u_2 / n) + 2 L_1 u_2 / (3n),
    h_n = (ε_n + S Δ_n) / √(1 − Δ_n)   (Δ_n < 1).

The sympy derivation of their inverses is :mod:`depthsat_theory.bounds.formula`.
Units: :math:`ε_n` and ``h_n`` in loss units per unit function-space step, :math:`Δ_n`
dimensionless.
"""

from __future__ import annotations

import math

__all__ = [
    "bernstein_mean_upper",
    "deviation_halfwidth",
    "epsilon_n",
    "matrix_deviations",
    "matrix_variance_upper",
    "relative_deviation",
    "split_delta",
]


def split_delta(delta: float, candidates: int, empirical_variance: bool) -> tuple[float, float, float]:
    """:math:`(δ_1, δ_2, δ_3)` for the vector, matrix and variance events (after the union bound).

    Args:
        delta: :math:`δ ∈ (0, 1)`.
        candidates: the union-bound count :math:`m ≥ 1` (each candidate gets :math:`δ/m`).
        empirical_variance: ``V`` is bounded from the probe (a third event, :math:`δ_3 > 0`).

    Returns:
        :math:`(δ/(3m), δ/(3m), δ/(3m))` with ``empirical_variance``, else :math:`(δ/(2m), δ/(2m), 0)`.
    """
    per = delta / candidates
    return (per / 3, per / 3, per / 3) if empirical_variance else (per / 2, per / 2, 0.0)


def relative_deviation(n: int, big_l: float, u2: float) -> float:
    r""":math:`Δ_n = √(2 L_1 u_2 / n) + 2 L_1 u_2 / (3n)` with ``L_1 = max(L, 1)`` (dimensionless).

    Args:
        n: probe size.
        big_l: ``L``, the leverage bound (``L_1 = max(L, 1)`` is used).
        u2: :math:`u_2 = \ln(2D/δ_2)`.

    Returns:
        :math:`Δ_n` (dimensionless).
    """
    l1 = max(big_l, 1.0)
    return math.sqrt(2 * l1 * u2 / n) + 2 * l1 * u2 / (3 * n)


def epsilon_n(n: int, var: float, r: float, u1: float) -> float:
    r""":math:`ε_n = √(2 V u_1 / n) + 2 R u_1 / n` (loss units per unit step).

    Args:
        n: probe size.
        var: ``V``, a bound on :math:`E‖G_x Σ_λ^{+1/2}‖_F^2`.
        r: :math:`R = γ √L`.
        u1: :math:`u_1 = \ln(2/δ_1)`.

    Returns:
        :math:`ε_n` (loss units per unit step).
    """
    return math.sqrt(2 * var * u1 / n) + 2 * r * u1 / n


def deviation_halfwidth(n: int, var: float, r: float, u1: float, l1: float, u2: float, smax: float) -> float:
    r"""``h_n = (ε_n + S Δ_n)/√(1 − Δ_n)``, a bound on ``|ŝ_λ − s_λ|`` for ``s_λ ≤ S`` (``inf`` if ``Δ_n ≥ 1``).

    Args:
        n: probe size.
        var: ``V`` of :math:`ε_n`, a bound on :math:`E‖G_x Σ_λ^{+1/2}‖_F^2`.
        r: :math:`R = γ √L` of :math:`ε_n`.
        u1: :math:`u_1 = \ln(2/δ_1)` of :math:`ε_n`.
        l1: ``L_1 = max(L, 1)`` of :math:`Δ_n`.
        u2: :math:`u_2 = \ln(2D/δ_2)` of :math:`Δ_n`.
        smax: ``S``.

    Returns:
        ``h_n`` (loss units per unit step), ``inf`` when :math:`Δ_n ≥ 1`.
    """
    dev = relative_deviation(n, l1, u2)
    if dev >= 1:
        return math.inf
    return (epsilon_n(n, var, r, u1) + smax * dev) / math.sqrt(1 - dev)


def bernstein_mean_upper(mean: float, bound_sq: float, n: int, u: float) -> float:
    r"""Upper confidence bound on ``E Y`` for ``0 ≤ Y ≤ bound_sq`` (one-sided Bernstein).

    With ``Var Y ≤ bound_sq · E Y``: :math:`√(E Y) ≤ (c + √(c^2 + 4e)) / 2` where
    ``c = √(2 bound_sq u / n)`` and ``e = mean + 2 bound_sq u / (3n)``; returns the
    square, capped at ``bound_sq`` (label ``cor-agmax-certificate-finite``).

    Args:
        mean: the sample mean of ``Y``.
        bound_sq: the almost-sure bound on ``Y``.
        n: sample size.
        u: :math:`\ln(1/δ)`.

    Returns:
        The upper bound on ``E Y``, at most ``bound_sq``.
    """
    c = math.sqrt(2 * bound_sq * u / n)
    e = max(mean, 0.0) + 2 * bound_sq * u / (3 * n)
    root = 0.5 * (c + math.sqrt(c * c + 4 * e))
    return min(root * root, bound_sq)


# ------------------------------------------------ empirical Bernstein (thm-empirical-bernstein)
def matrix_deviations(n: int, sigma2: float, big_l: float, u2: float) -> tuple[float, float]:
    r""":math:`(Δ_n^−, Δ_n^+)` of ``thm-empirical-bernstein`` for a matrix variance bound :math:`σ^2`.

    :math:`Δ^− = √(2σ^2u_2/n) + 2u_2/(3n)` (lower tail: ``λ_max(EΨ − Ψ_x) ≤ 1``) and
    :math:`Δ^+ = √(2σ^2u_2/n) + 2Lu_2/(3n)` (upper tail: ``λ_max(Ψ_x − EΨ) ≤ L``).  With
    :math:`σ^2 = L` both are at most the worst-case :math:`Δ_n` of :func:`relative_deviation`.

    Args:
        n: probe size.
        sigma2: ``σ² ≥ λ_max(E Ψ_x²)`` (dimensionless).
        big_l: ``L``.
        u2: :math:`\ln(2D/δ_2)`.

    Returns:
        The pair :math:`(Δ_n^−, Δ_n^+)` (dimensionless).
    """
    root = math.sqrt(2 * sigma2 * u2 / n)
    return root + 2 * u2 / (3 * n), root + 2 * big_l * u2 / (3 * n)


def matrix_variance_upper(sig_hat2: float, big_l: float, n: int, u2: float, u4: float) -> float:
    r"""``σ̄²``: the largest ``x ∈ [0, L]`` with ``√x ≤ c/2 + √(c²/4 + e_0 + σ̂²(1 + Δ^+(x))²)``.

    :math:`c = L√(2u_4/n)`, :math:`e_0 = 2L^2u_4/(3n)` (``thm-empirical-bernstein``, step B).  With
    :math:`t = √x` and :math:`Δ^+(x) = a t + b`, :math:`a = √(2u_2/n)`, ``b = 2Lu_2/(3n)``, the condition
    is :math:`A t^2 − B t − C ≤ 0` with :math:`A = 1 − \hat{σ}^2a^2`, :math:`B = c + 2\hat{σ}^2a(1 + b)`,
    :math:`C = e_0 + \hat{σ}^2(1 + b)^2`; for ``A > 0`` its solutions :math:`t ≥ 0` are
    :math:`[0, (B + √(B^2 + 4AC))/(2A)]`, for :math:`A ≤ 0` every ``t`` (then :math:`\bar{σ}^2 = L`).

    Args:
        sig_hat2: :math:`\hat{σ}^2 = ‖(1/n) Σ_i \hat{Ψ}_i^2‖` with the probe's whitening.
        big_l: ``L`` (:math:`σ^2 ≤ L` surely).
        n: probe size.
        u2: :math:`\ln(2D/δ_2)`.
        u4: :math:`\ln(1/δ_4)`.

    Returns:
        :math:`\bar{σ}^2 ∈ [0, L]`.
    """
    a = math.sqrt(2 * u2 / n)
    b = 2 * big_l * u2 / (3 * n)
    c = big_l * math.sqrt(2 * u4 / n)
    e0 = 2 * big_l * big_l * u4 / (3 * n)
    s2 = max(sig_hat2, 0.0)
    qa = 1 - s2 * a * a
    if qa <= 0:
        return big_l
    qb = c + 2 * s2 * a * (1 + b)
    qc = e0 + s2 * (1 + b) ** 2
    t = (qb + math.sqrt(qb * qb + 4 * qa * qc)) / (2 * qa)
    return min(big_l, t * t)
