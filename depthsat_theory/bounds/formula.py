r"""Symbolic derivation (sympy) of the finite-sample half-width and the sample-size formula.

The confidence interval of :func:`depthsat_theory.bounds.interval.interval_from_moments`
(theory label ``thm-finite-sample``) is built from two deviation terms of a probe of
``n`` examples,

.. math::

    ε_n = \sqrt{2 V u_1 / n} + 2 R u_1 / n, \qquad
    Δ_n = \sqrt{2 L_1 u_2 / n} + \tfrac{2}{3} L_1 u_2 / n,

(``V`` a bound on ``E‖ξ‖²``, ``R = γ √L`` an almost-sure bound on ``‖ξ‖``,
``L_1 = max(L, 1)``, ``u_1 = ln(2/δ_1)``, ``u_2 = ln(2D/δ_2)``), and the deviation
bound for a score ``s ≤ S``

.. math::

    h_n = \frac{ε_n + S Δ_n}{\sqrt{1 - Δ_n}} \quad (Δ_n < 1).

With ``x = √n``, ``x² ε_n = a x + b`` and ``x² Δ_n = c x + e`` with positive ``a, b,
c, e``, so ``ε_n = E`` and ``Δ_n = D`` are quadratics in ``x`` with one positive root
each: sympy solves them below in closed form (written without cancellation, so the
formulas stay accurate for large ``n``). ``h_n = E`` squares to a quartic in ``x``
whose coefficients have the sign pattern ``+ − − − −``; by Descartes' rule of signs it
has exactly one positive root, the sample size ``n = x²`` (found with ``numpy.roots``
on the lambdified coefficients, polished by Newton steps, and checked against ``h``).

Everything is derived once per process (about 1 s) and cached.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Formulas",
    "combined_required_n",
    "formulas",
]


@dataclass(frozen=True)
class Formulas:
    """Lambdified results of the derivation (plain float functions) and their sympy forms.

    Attributes:
        eps: :math:`ε(n, V, R, u1)`.
        delta_dev: :math:`Δ(n, L1, u2)`.
        halfwidth: ``h(n, V, R, u1, L1, u2, S)``.
        n_for_eps: closed form ``n(E, V, R, u1)`` solving :math:`ε_n = E`.
        n_for_delta: closed form ``n(D, L1, u2)`` solving :math:`Δ_n = D`.
        quartic: coefficients (highest degree first) of the quartic in :math:`x = √n`
            equivalent to ``h_n = E``: ``quartic(E, V, R, u1, L1, u2, S) -> 5 floats``.
        expressions: the sympy expressions, by name (for display and tests).
    """

    eps: Callable[..., float]
    delta_dev: Callable[..., float]
    halfwidth: Callable[..., float]
    n_for_eps: Callable[..., float]
    n_for_delta: Callable[..., float]
    quartic: Callable[..., list]
    expressions: dict


def _positive_root(sp, roots, sample: dict):
    """The root that is positive at a sample point of the (positive) symbols."""
    pos = [r for r in roots if float(r.subs(sample).evalf()) > 0]
    if len(pos) != 1:  # pragma: no cover - guards the derivation itself
        raise RuntimeError(f"expected exactly one positive root, got {pos}")
    return pos[0]


@functools.cache
def formulas() -> Formulas:
    """Derive the half-width, its inverses and the combined quartic with sympy (cached).

    Raises:
        RuntimeError: if a step of the derivation does not verify symbolically (a bug).
    """
    import sympy as sp

    n, x, V, R, L1, u1, u2, S, E, D = sp.symbols("n x V R L1 u1 u2 S E D", positive=True)
    eps = sp.sqrt(2 * V * u1 / n) + 2 * R * u1 / n
    dev = sp.sqrt(2 * L1 * u2 / n) + sp.Rational(2, 3) * L1 * u2 / n
    half = (eps + S * dev) / sp.sqrt(1 - dev)

    # n = x^2 turns x^2·ε and x^2·Δ into linear polynomials in x with positive coefficients.
    eps_x = sp.expand(eps.subs(n, x**2))
    dev_x = sp.expand(dev.subs(n, x**2))
    for term in (eps_x, dev_x):
        if sp.Poly(sp.expand(term * x**2), x).degree() != 1:
            raise RuntimeError("x^2·(deviation term) is not linear in x = sqrt(n)")
    half_ = sp.Rational(1, 2)
    sample = {V: 2, R: 3, u1: 3 * half_, L1: 5, u2: 4, E: sp.Rational(1, 10), D: half_, S: sp.Rational(7, 10)}
    x_eps = _positive_root(sp, sp.solve(sp.Eq(sp.expand(eps_x * x**2), E * x**2), x), sample)
    x_dev = _positive_root(sp, sp.solve(sp.Eq(sp.expand(dev_x * x**2), D * x**2), x), sample)
    n_eps = sp.expand(x_eps**2)
    n_dev = sp.expand(x_dev**2)
    for expr, target, sol in ((eps, E, n_eps), (dev, D, n_dev)):
        # nested radicals: verify at exact rational points in 50-digit arithmetic (cheaper
        # and more reliable than sp.simplify here)
        for point in (sample, {k: sp.Rational(7, 3) * val for k, val in sample.items()}):
            if abs(float((expr.subs(n, sol) - target).subs(point).evalf(50))) > 1e-40:
                raise RuntimeError("closed-form inverse does not solve the bound")  # pragma: no cover

    # h = E with Δ < 1  <=>  (ε + S Δ)^2 = E^2 (1 - Δ)  (both sides >= 0); times x^4 it is a
    # quartic in x with sign pattern + - - - - (exactly one positive root).
    quart = sp.Poly(sp.expand(((eps_x + S * dev_x) ** 2 - E**2 * (1 - dev_x)) * x**4 * -1), x)
    coeffs = quart.all_coeffs()
    if len(coeffs) != 5:  # pragma: no cover
        raise RuntimeError("the squared bound is not a quartic in x")
    signs = [coeffs[0].is_positive] + [(-c).is_nonnegative for c in coeffs[1:]]
    if not all(signs):  # pragma: no cover
        raise RuntimeError("quartic coefficients do not have the sign pattern + - - - -")

    args_eps = (n, V, R, u1)
    args_half = (n, V, R, u1, L1, u2, S)
    return Formulas(
        eps=sp.lambdify(args_eps, eps, "math"),
        delta_dev=sp.lambdify((n, L1, u2), dev, "math"),
        halfwidth=sp.lambdify(args_half, half, "math"),
        n_for_eps=sp.lambdify((E, V, R, u1), n_eps, "math"),
        n_for_delta=sp.lambdify((D, L1, u2), n_dev, "math"),
        quartic=sp.lambdify((E, V, R, u1, L1, u2, S), coeffs, "math"),
        expressions={
            "epsilon": eps,
            "Delta": dev,
            "halfwidth": half,
            "n_for_epsilon": n_eps,
            "n_for_Delta": n_dev,
            "quartic_in_x": quart.as_expr(),
        },
    )


def combined_required_n(E: float, V: float, R: float, u1: float, L1: float, u2: float, S: float) -> float:
    r"""Real ``n > 0`` with ``h_n = E`` (the unique positive root of the quartic in :math:`x = √n`).

    Args:
        E: target half-width (> 0, loss units per unit function-space step).
        V: the bound ``V`` on :math:`E‖ξ‖^2`.
        R: the almost-sure bound :math:`R = γ √L` on :math:`‖ξ‖`.
        u1: :math:`u_1 = \ln(2/δ_1)`.
        L1: ``L_1 = max(L, 1)``.
        u2: :math:`u_2 = \ln(2D/δ_2)`.
        S: the bound ``S`` on the score: ``h_n`` holds for every :math:`s ≤ S`.

    Returns:
        ``n`` as a float (round up for a probe size); ``h`` is decreasing in ``n`` on
        :math:`Δ_n < 1`, so every :math:`n' ≥ n` also has :math:`h_{n'} ≤ E`.
    """
    f = formulas()
    coeffs = [float(c) for c in f.quartic(E, V, R, u1, L1, u2, S)]
    roots = np.roots(coeffs)
    real = [float(r.real) for r in roots if abs(r.imag) <= 1e-7 * max(1.0, abs(r)) and r.real > 0]
    if not real:  # pragma: no cover - excluded by Descartes' rule of signs
        raise RuntimeError("no positive root of the sample-size quartic")
    x = max(real)
    poly = np.poly1d(coeffs)
    dpoly = poly.deriv()
    for _ in range(6):  # Newton polish: companion-matrix roots can lose a few digits
        d = dpoly(x)
        if d == 0:
            break
        step = poly(x) / d
        x -= step
        if abs(step) <= 1e-15 * abs(x):
            break
    return x * x
