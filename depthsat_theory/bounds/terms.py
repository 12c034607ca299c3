"""The deviation terms of the finite-sample bound (``thm-finite-sample``, theory/finite-sample.md).

With ``u_1 = ln(2/δ_1)``, ``u_2 = ln(2D/δ_2)``, ``L_1 = max(L, 1)`` and ``R = γ√L``::

    ε_n = √(2 V u_1 / n) + 2 R u_1 / n,        Δ_n = √(2 L_1 u_2 / n) + 2 L_1 u_2 / (3n),
    h_n = (ε_n + S Δ_n) / √(1 − Δ_n)   (Δ_n < 1).

The sympy derivation of their inverses is :mod:`depthsat_theory.bounds.formula`.
Units: ``ε_n`` and ``h_n`` in loss units per unit function-space step, ``Δ_n``
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
    """``(δ_1, δ_2, δ_3)`` for the vector, matrix and variance events (after the union bound).

    Args:
        delta: ``δ ∈ (0, 1)``.
        candidates: the union-bound count ``m ≥ 1`` (each candidate gets ``δ/m``).
        empirical_variance: ``V`` is bounded from the probe (a third event, ``δ_3 > 0``).

    Returns:
        ``(δ/(3m), δ/(3m), δ/(3m))`` with ``empirical_variance``, else ``(δ/(2m), δ/(2m), 0)``.
    """
    per = delta / candidates
    return (per / 3, per / 3, per / 3) if empirical_variance else (per / 2, per / 2, 0.0)


def relative_deviation(n: int, big_l: float, u2: float) -> float:
    """``Δ_n = √(2 L_1 u_2 / n) + 2 L_1 u_2 / (3n)`` with ``L_1 = max(L, 1)`` (dimensionless).

    Args:
        n: probe size.
        big_l: ``L``, the leverage bound (``L_1 = max(L, 1)`` is used).
        u2: ``u_2 = ln(2D/δ_2)``.

    Returns:
        ``Δ_n`` (dimensionless).
    """
    l1 = max(big_l, 1.0)
    return math.sqrt(2 * l1 * u2 / n) + 2 * l1 * u2 / (3 * n)


def epsilon_n(n: int, var: float, r: float, u1: float) -> float:
    """``ε_n = √(2 V u_1 / n) + 2 R u_1 / n`` (loss units per unit step).

    Args:
        n: probe size.
        var: ``V``, a bound on ``E‖G_x Σ_λ^{+1/2}‖_F²``.
        r: ``R = γ √L``.
        u1: ``u_1 = ln(2/δ_1)``.

    Returns:
        ``ε_n`` (loss units per unit step).
    """
    return math.sqrt(2 * var * u1 / n) + 2 * r * u1 / n


def deviation_halfwidth(n: int, var: float, r: float, u1: float, l1: float, u2: float, smax: float) -> float:
    """``h_n = (ε_n + S Δ_n)/√(1 − Δ_n)``, a bound on ``|ŝ_λ − s_λ|`` for ``s_λ ≤ S`` (``inf`` if ``Δ_n ≥ 1``).

    Args:
        n: probe size.
        var: ``V`` of ``ε_n``, a bound on ``E‖G_x Σ_λ^{+1/2}‖_F²``.
        r: ``R = γ √L`` of ``ε_n``.
        u1: ``u_1 = ln(2/δ_1)`` of ``ε_n``.
        l1: ``L_1 = max(L, 1)`` of ``Δ_n``.
        u2: ``u_2 = ln(2D/δ_2)`` of ``Δ_n``.
        smax: ``S``.

    Returns:
        ``h_n`` (loss units per unit step), ``inf`` when ``Δ_n ≥ 1``.
    """
    dev = relative_deviation(n, l1, u2)
    if dev >= 1:
        return math.inf
    return (epsilon_n(n, var, r, u1) + smax * dev) / math.sqrt(1 - dev)


def bernstein_mean_upper(mean: float, bound_sq: float, n: int, u: float) -> float:
    """Upper confidence bound on ``E Y`` for ``0 ≤ Y ≤ bound_sq`` (one-sided Bernstein).

    With ``Var Y ≤ bound_sq · E Y``: ``√(E Y) ≤ (c + √(c² + 4e)) / 2`` where
    ``c = √(2 bound_sq u / n)`` and ``e = mean + 2 bound_sq u / (3n)``; returns the
    square, capped at ``bound_sq`` (label ``cor-agmax-certificate-finite``).

    Args:
        mean: the sample mean of ``Y``.
        bound_sq: the almost-sure bound on ``Y``.
        n: sample size.
        u: ``ln(1/δ)``.

    Returns:
        The upper bound on ``E Y``, at most ``bound_sq``.
    """
    c = math.sqrt(2 * bound_sq * u / n)
    e = max(mean, 0.0) + 2 * bound_sq * u / (3 * n)
    root = 0.5 * (c + math.sqrt(c * c + 4 * e))
    return min(root * root, bound_sq)


# ------------------------------------------------ empirical Bernstein (thm-empirical-bernstein)
def matrix_deviations(n: int, sigma2: float, big_l: float, u2: float) -> tuple[float, float]:
    """``(Δ_n^−, Δ_n^+)`` of ``thm-empirical-bernstein`` for a matrix variance bound ``σ²``.

    ``Δ^− = √(2σ²u_2/n) + 2u_2/(3n)`` (lower tail: ``λ_max(EΨ − Ψ_x) ≤ 1``) and
    ``Δ^+ = √(2σ²u_2/n) + 2Lu_2/(3n)`` (upper tail: ``λ_max(Ψ_x − EΨ) ≤ L``).  With
    ``σ² = L`` both are at most the worst-case ``Δ_n`` of :func:`relative_deviation`.

    Args:
        n: probe size.
        sigma2: ``σ² ≥ λ_max(E Ψ_x²)`` (dimensionless).
        big_l: ``L``.
        u2: ``ln(2D/δ_2)``.

    Returns:
        The pair ``(Δ_n^−, Δ_n^+)`` (dimensionless).
    """
    root = math.sqrt(2 * sigma2 * u2 / n)
    return root + 2 * u2 / (3 * n), root + 2 * big_l * u2 / (3 * n)


def matrix_variance_upper(sig_hat2: float, big_l: float, n: int, u2: float, u4: float) -> float:
    """``σ̄²``: the largest ``x ∈ [0, L]`` with ``√x ≤ c/2 + √(c²/4 + e_0 + σ̂²(1 + Δ^+(x))²)``.

    ``c = L√(2u_4/n)``, ``e_0 = 2L²u_4/(3n)`` (``thm-empirical-bernstein``, step B).  With
    ``t = √x`` and ``Δ^+(x) = a t + b``, ``a = √(2u_2/n)``, ``b = 2Lu_2/(3n)``, the condition
    is ``A t² − B t − C ≤ 0`` with ``A = 1 − σ̂²a²``, ``B = c + 2σ̂²a(1 + b)``,
    ``C = e_0 + σ̂²(1 + b)²``; for ``A > 0`` its solutions ``t ≥ 0`` are
    ``[0, (B + √(B² + 4AC))/(2A)]``, for ``A ≤ 0`` every ``t`` (then ``σ̄² = L``).

    Args:
        sig_hat2: ``σ̂² = ‖(1/n) Σ_i Ψ̂_i²‖`` with the probe's whitening.
        big_l: ``L`` (``σ² ≤ L`` surely).
        n: probe size.
        u2: ``ln(2D/δ_2)``.
        u4: ``ln(1/δ_4)``.

    Returns:
        ``σ̄² ∈ [0, L]``.
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
