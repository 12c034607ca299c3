r"""Exact unit measures ``μ`` for the symbolic engine (theory/definitions.md, def-setting, intensity measure).

Two kinds of measure on unit vectors ``u ∈ R^d``:

* :class:`FiniteMeasure`: a finite weighted point set (exact rationals);
* :class:`ProductMeasure`: independent ``sympy.stats`` random variables, one per unit
  coordinate (``Normal``, ``Uniform``, and finite ones such as ``Die``,
  ``DiscreteUniform``, ``Bernoulli``, ``FiniteRV``; other single random variables
  are handled through ``sympy.stats.E``).

**Mass convention.**  theory/definitions.md, def-setting uses the *intensity* measure of units, of total mass
``E[#units per example]``.  Both classes hold a probability distribution ``π`` and a
``total_mass`` (default 1) and integrate against ``μ = total_mass · π``:

.. math::

    E_μ[f] = \mathrm{total\_mass} \cdot \int f \, dπ .

With ``total_mass = 1`` (one unit per example, a ``vector`` site) this is what the
numeric engine's row average computes.

Polynomial integrands are expanded into monomials and integrated with closed-form
moments (normal moments by the recursion ``E X^k = μ E X^{k−1} + (k−1) σ² E X^{k−2}``,
uniform moments ``(b^{k+1} − a^{k+1}) / ((k+1)(b−a))``, finite sums), so they are
exact and fast; other integrands are summed exactly over finite supports or passed
to ``sympy.stats.E`` (an unevaluated integral raises :class:`MeasureError`).
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Sequence
from functools import lru_cache

import sympy as sp
import sympy.stats as sps
from sympy.stats.crv_types import NormalDistribution, UniformDistribution
from sympy.stats.rv import RandomSymbol

from depthsat_theory.engines.symbolic.family import exact

__all__ = [
    "FiniteMeasure",
    "Measure",
    "MeasureError",
    "ProductMeasure",
    "as_measure",
    "finite_density",
]


class MeasureError(ValueError):
    """A measure was misspecified, or an expectation has no closed form."""


class Measure(abc.ABC):
    """A measure ``μ = total_mass · π`` on ``R^d`` (``π`` a probability distribution).

    Attributes:
        d: dimension of the unit vectors.
        total_mass: ``μ(R^d)`` (exact, default 1).
    """

    d: int
    total_mass: sp.Expr

    @abc.abstractmethod
    def _expect_scalar(self, expr: sp.Expr, units: Sequence[sp.Symbol]) -> sp.Expr:
        """``∫ expr dπ`` (probability, without the total mass) of a scalar expression."""

    def expect(self, expr, units: Sequence[sp.Symbol]):
        """``E_μ[expr] = total_mass · ∫ expr(u) dπ(u)``, exactly.

        Args:
            expr: a sympy expression or ``Matrix`` in the unit symbols (other free
                symbols are constants).
            units: the ``d`` unit symbols, in the order of the measure's coordinates.

        Returns:
            A sympy expression (or a ``Matrix`` of the same shape), simplified only by
            expansion/rational arithmetic.

        Raises:
            MeasureError: on a dimension mismatch or a non-closed-form expectation.
        """
        units = tuple(units)
        if len(units) != self.d:
            raise MeasureError(f"the measure lives on R^{self.d} but {len(units)} unit symbols were given")
        if isinstance(expr, sp.MatrixBase):
            out = self._expect_matrix(sp.Matrix(expr), units)
            return (out * self.total_mass).applyfunc(_tidy)
        return _tidy(self.total_mass * self._expect_scalar(sp.sympify(expr), units))

    def _expect_matrix(self, mat: sp.Matrix, units) -> sp.Matrix:
        cache: dict = {}

        def one(e):
            if e not in cache:
                cache[e] = self._expect_scalar(e, units)
            return cache[e]

        return mat.applyfunc(one)


def _tidy(e):
    e = sp.sympify(e)
    return e if e.is_Rational else sp.expand(e)


# ----------------------------------------------------------------------------- finite
class FiniteMeasure(Measure):
    """A finite weighted point set ``μ = total_mass · Σ_i π_i δ_{p_i}``.

    Args:
        points: ``N`` points, each a length-``d`` sequence (or a number when
            ``d = 1``); floats are converted to their exact binary rationals.
        weights: ``N`` nonnegative relative weights (default uniform); they are
            normalized to ``π_i = w_i / Σ w``.
        total_mass: ``μ(R^d)`` (default 1; theory/definitions.md, def-setting intensity convention).

    Raises:
        MeasureError: on no points, ragged points, a negative or all-zero weight, or
            a weight count that differs from the point count.
    """

    def __init__(self, points, weights=None, total_mass=1):
        pts = []
        for p in points:
            if isinstance(p, sp.MatrixBase):
                p = list(p)
            elif hasattr(p, "tolist"):
                p = p.tolist()
            if not isinstance(p, (list, tuple)):
                p = [p]
            pts.append(tuple(exact(v) for v in p))
        if not pts:
            raise MeasureError("a finite measure needs at least one point")
        d = len(pts[0])
        if d < 1 or any(len(p) != d for p in pts):
            raise MeasureError("all points of a finite measure must have the same dimension >= 1")
        if weights is None:
            w = [sp.Integer(1)] * len(pts)
        else:
            if hasattr(weights, "tolist"):
                weights = weights.tolist()
            w = [exact(v) for v in weights]
            if len(w) != len(pts):
                raise MeasureError(f"{len(w)} weights for {len(pts)} points")
        if any(bool(v.is_negative) for v in w):
            raise MeasureError("finite-measure weights must be >= 0")
        tot = sum(w, sp.Integer(0))
        if tot == 0:
            raise MeasureError("finite-measure weights sum to zero")
        self.points = pts
        self.probabilities = [v / tot for v in w]
        self.d = d
        self.total_mass = exact(total_mass)

    @property
    def masses(self) -> list[sp.Expr]:
        """``μ({p_i}) = total_mass · π_i`` (exact)."""
        return [self.total_mass * q for q in self.probabilities]

    def _expect_scalar(self, expr, units):
        return sum(
            (
                q * expr.xreplace(dict(zip(units, p, strict=False)))
                for p, q in zip(self.points, self.probabilities, strict=False)
            ),
            sp.Integer(0),
        )

    def _expect_matrix(self, mat, units):
        out = sp.zeros(*mat.shape)
        for p, q in zip(self.points, self.probabilities, strict=False):
            out += q * mat.xreplace(dict(zip(units, p, strict=False)))
        return out

    def __repr__(self) -> str:
        return f"FiniteMeasure(d={self.d}, points={len(self.points)}, total_mass={self.total_mass})"


# ----------------------------------------------------------------------------- product
def finite_density(rv: RandomSymbol) -> dict | None:
    """The probability mass function of a finite ``sympy.stats`` random variable.

    Args:
        rv: a single random variable (``Die``, ``Bernoulli``, ``FiniteRV``, ``Normal``, …).

    Returns:
        ``{value: probability}`` (exact sympy values) when ``rv`` has finite support,
        else ``None``.
    """
    try:
        from sympy.stats.frv import SingleFinitePSpace
    except ImportError:  # pragma: no cover
        return None
    if isinstance(rv.pspace, SingleFinitePSpace):
        return dict(sps.density(rv).dict)
    return None


@lru_cache(maxsize=4096)
def _moment(rv: RandomSymbol, k: int) -> sp.Expr:
    """``E[X^k]`` of a single random variable (exact)."""
    if k == 0:
        return sp.Integer(1)
    dist = getattr(rv.pspace, "distribution", None)
    if isinstance(dist, NormalDistribution):
        mu, sigma = dist.args
        m = [sp.Integer(1), mu]
        for j in range(2, k + 1):
            m.append(sp.expand(mu * m[j - 1] + (j - 1) * sigma**2 * m[j - 2]))
        return m[k]
    if isinstance(dist, UniformDistribution):
        a, b = dist.args
        return sp.cancel((b ** (k + 1) - a ** (k + 1)) / ((k + 1) * (b - a)))
    dens = finite_density(rv)
    if dens is not None:
        return sum((q * sp.sympify(x) ** k for x, q in dens.items()), sp.Integer(0))
    val = sps.E(rv**k)
    if val.has(sp.Integral):
        raise MeasureError(f"E[{rv}^{k}] has no closed form in sympy ({val})")
    return val


class ProductMeasure(Measure):
    """Independent ``sympy.stats`` random variables, coordinate ``i`` of ``u`` ↔ ``rvs[i]``.

    Args:
        rvs: ``d`` single random variables (``sympy.stats.Normal``, ``Uniform``,
            ``Die``, ``DiscreteUniform``, ``Bernoulli``, ``FiniteRV``, …) with
            distinct names (independence is by construction: separate ``pspace``).
        total_mass: ``μ(R^d)`` (default 1).

    Raises:
        MeasureError: on an empty list, a non-random-symbol entry, or repeated variables.
    """

    def __init__(self, rvs, total_mass=1):
        rvs = [rvs] if isinstance(rvs, RandomSymbol) else list(rvs)
        if not rvs:
            raise MeasureError("a product measure needs at least one random variable")
        for rv in rvs:
            if not isinstance(rv, RandomSymbol):
                raise MeasureError(f"{rv!r} is not a sympy.stats random variable (e.g. Normal('X', 0, 1))")
        names = [rv.name for rv in rvs]
        if len(set(names)) != len(names):
            raise MeasureError(f"random variables must be distinct (independent); got names {names}")
        self.rvs = tuple(rvs)
        self.d = len(rvs)
        self.total_mass = exact(total_mass)

    @property
    def is_finite(self) -> bool:
        """All coordinates have finite support."""
        return all(finite_density(rv) is not None for rv in self.rvs)

    def to_finite(self) -> FiniteMeasure:
        """The product of finite supports as a :class:`FiniteMeasure` (exact).

        Returns:
            The :class:`FiniteMeasure` on the product of the supports, with the same ``total_mass``.

        Raises:
            MeasureError: if a coordinate is not finite.
        """
        dens = [dd for dd in (finite_density(rv) for rv in self.rvs) if dd is not None]
        if len(dens) != len(self.rvs):
            raise MeasureError("not every coordinate of this product measure is finite")
        pts, ws = [], []
        for combo in itertools.product(*[list(dd.items()) for dd in dens]):
            pts.append(tuple(sp.sympify(x) for x, _ in combo))
            ws.append(sp.Mul(*[q for _, q in combo]))
        return FiniteMeasure(pts, ws, total_mass=self.total_mass)

    def moment(self, i: int, k: int) -> sp.Expr:
        """``E[u_i^k]`` under ``π`` (0-based coordinate ``i``).

        Args:
            i: 0-based coordinate.
            k: the power.

        Returns:
            ``E[u_i^k]`` as an exact sympy expression.
        """
        return _moment(self.rvs[i], int(k))

    def _expect_scalar(self, expr, units):
        if not expr.has(*units):
            return expr
        try:
            poly = sp.Poly(sp.expand(expr), *units)
        except sp.PolynomialError:
            poly = None
        if poly is not None:
            total = sp.Integer(0)
            for monom, coeff in poly.terms():
                term = coeff
                for i, k in enumerate(monom):
                    if k:
                        term = term * self.moment(i, k)
                total += term
            return total
        if self.is_finite:
            return self.to_finite()._expect_scalar(expr, units)
        val = sps.E(expr.xreplace(dict(zip(units, self.rvs, strict=False))))
        if val.has(sp.Integral):
            raise MeasureError(
                f"E[{expr}] under {[str(rv.pspace.distribution) for rv in self.rvs]} has no "
                f"closed form in sympy; use a finite measure or a polynomial integrand"
            )
        return val

    def __repr__(self) -> str:
        return f"ProductMeasure({', '.join(str(getattr(rv.pspace, 'distribution', rv)) for rv in self.rvs)})"


def as_measure(obj, d: int | None = None) -> Measure:
    """Coerce a measure argument.

    Args:
        obj: a :class:`Measure`, a single ``sympy.stats`` random variable (``d = 1``)
            or a list of them (independent coordinates).
        d: expected dimension (checked when given).

    Returns:
        ``obj`` itself, or a :class:`ProductMeasure` of the random variables.

    Raises:
        MeasureError: on anything else or a dimension mismatch.
    """
    if isinstance(obj, Measure):
        mu = obj
    elif isinstance(obj, RandomSymbol) or (
        isinstance(obj, (list, tuple)) and obj and all(isinstance(x, RandomSymbol) for x in obj)
    ):
        mu = ProductMeasure(obj)
    else:
        raise MeasureError(
            f"cannot use {obj!r} as a measure: pass a FiniteMeasure, a ProductMeasure, or a list "
            f"of independent sympy.stats random variables"
        )
    if d is not None and mu.d != d:
        raise MeasureError(f"the measure lives on R^{mu.d} but the family's units are in R^{d}")
    return mu
