r"""Exact tangent objects and saturation quantities (theory/definitions.md, T1, T2, T4, T6).

For a :class:`~depthsat_theory.engines.symbolic.family.SymbolicFamily` ``h(θ, u)``, a unit
measure ``μ`` (:mod:`~depthsat_theory.engines.symbolic.measures`) and a conditional activation
gradient ``m(u)`` (a ``d``-vector of expressions in the unit symbols):

.. math::

    A(u) = ∂_θ h(θ, u)\big|_{θ=0}, \quad K = E_μ[A^T A], \quad b = E_μ[A^T m],

    v^* = K^+ b, \quad Π m = A v^*, \quad s^2 = b^T K^+ b = \lVert Π m \rVert^2,

    r = \lVert m \rVert, \quad ρ = \lVert m - Π m \rVert / \lVert m \rVert .

Everything is exact sympy arithmetic.  Zero tests (ranks, ``s = 0``) are exact for
rational/algebraic quantities (polynomial families under finite, normal or uniform
measures with rational parameters); for transcendental entries they rely on
``sympy.simplify``.

Functions mirror the numeric engine's names (:mod:`depthsat_theory.statistics`):
:class:`SymbolicSaturation` has the fields of
:class:`~depthsat_theory.statistics.SaturationResult` that apply.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, fields

import numpy as np
import sympy as sp

from depthsat_theory.engines.symbolic.algebra import is_zero, simplified
from depthsat_theory.engines.symbolic.family import SymbolicFamily, to_matrix
from depthsat_theory.engines.symbolic.measures import Measure, MeasureError, as_measure
from depthsat_theory.families import FamilyError
from depthsat_theory.vocabulary import Verdict

__all__ = [
    "SymbolicSaturation",
    "gradient",
    "is_degenerate",
    "is_function_preserving",
    "is_regular_reparameterization",
    "projection",
    "raw_score",
    "realizability_defect",
    "reparameterize",
    "saturation",
    "saturation_score",
    "tangent_gram",
    "tangent_map",
    "tangent_rank",
]


# ----------------------------------------------------------------------------- helpers
def check_symbolic_family(fam) -> SymbolicFamily:
    """Return ``fam`` unchanged if it is a :class:`SymbolicFamily`.

    Raises:
        FamilyError: ``fam`` is another type.
    """
    if not isinstance(fam, SymbolicFamily):
        raise FamilyError(f"expected a SymbolicFamily, got {type(fam).__name__}")
    return fam


def family_measure(fam: SymbolicFamily, measure) -> Measure:
    """The probe measure ``measure`` as a :class:`Measure` on the family's input dimension ``fam.d``."""
    return as_measure(measure, fam.d)


def _rank(mat: sp.Matrix) -> int:
    if mat.rows == 0 or mat.cols == 0:
        return 0
    return int(mat.rank(iszerofunc=is_zero, simplify=True))


# ----------------------------------------------------------------------------- tangent map
def is_function_preserving(fam: SymbolicFamily) -> tuple[bool, sp.Matrix]:
    """Decide ``h(0, u) ≡ 0`` symbolically (theory/definitions.md, def-setting, ``def-family``).

    Args:
        fam: the family.

    Returns:
        ``(ok, residual)``: ``residual`` is the simplified ``d × 1`` Matrix
        ``h(0, u)``; ``ok`` is ``True`` iff every entry simplifies to 0.

    Raises:
        FamilyError: if ``fam`` is not a :class:`SymbolicFamily`.
    """
    check_symbolic_family(fam)
    res = fam.expr.xreplace(dict.fromkeys(fam.params, 0)).applyfunc(simplified)
    return all(e == 0 for e in res), res


def tangent_map(fam: SymbolicFamily) -> sp.Matrix:
    """The tangent map ``A(u) = ∂_θ h(θ, u)|_{θ=0}`` (theory/definitions.md).

    Args:
        fam: the family.

    Returns:
        A ``d × p`` Matrix of expressions in the unit symbols; column ``j`` is the
        tangent direction of ``θ_j`` (zero columns for parameters that enter only at
        higher order).  Where ``h`` has a kink *in θ* at 0 (e.g. ``relu(θ u)``), sympy's
        convention ``Heaviside(0) = 1/2`` applies while torch's autograd uses
        ``relu'(0) = 0``: such a family is not differentiable at the origin (theory/definitions.md, def-setting)
        and the two engines need not agree.

    Raises:
        FamilyError: if ``fam`` is not a :class:`SymbolicFamily`.
    """
    check_symbolic_family(fam)
    if fam.p == 0:
        return sp.zeros(fam.d, 0)
    jac = fam.expr.jacobian(sp.Matrix(fam.params))
    zero = dict.fromkeys(fam.params, 0)
    return jac.xreplace(zero).applyfunc(lambda e: sp.expand(sp.sympify(e).doit()))


def tangent_gram(fam: SymbolicFamily, measure, *, tangent: sp.Matrix | None = None) -> sp.Matrix:
    """``K = E_μ[A(u)^T A(u)]`` (``p × p``, exact, symmetric PSD).

    Args:
        fam: the family.
        measure: a :class:`~depthsat_theory.engines.symbolic.measures.Measure` or a list of
            independent ``sympy.stats`` random variables (coordinate ``i`` ↔ ``u_{i+1}``).
        tangent: a precomputed :func:`tangent_map` (optional).

    Returns:
        ``K`` as an exact symmetric ``p × p`` Matrix.

    Raises:
        MeasureError: on a dimension mismatch or a non-closed-form expectation.
    """
    check_symbolic_family(fam)
    mu = family_measure(fam, measure)
    a = tangent_map(fam) if tangent is None else tangent
    integrand = (a.T * a).applyfunc(sp.expand)
    k = mu.expect(integrand, fam.units)
    return (k + k.T) / 2


def gradient(fam: SymbolicFamily, measure, m, *, tangent: sp.Matrix | None = None) -> sp.Matrix:
    """``b = E_μ[A^T m] = ∇_θ J(0)`` (theory label thm-gradient, ``thm-gradient``).

    Args:
        fam: the family.
        measure: the unit measure (see :func:`tangent_gram`).
        m: the conditional activation gradient, ``d`` components in the unit symbols
            (a string, expression, list or Matrix; see :meth:`SymbolicFamily.coerce`).
        tangent: a precomputed :func:`tangent_map` (optional).

    Returns:
        ``p × 1`` Matrix, in the family's coordinate order.

    Raises:
        FamilyError: if ``m`` has the wrong number of components or contains ``θ``.
        MeasureError: on a non-closed-form expectation.
    """
    check_symbolic_family(fam)
    mu = family_measure(fam, measure)
    a = tangent_map(fam) if tangent is None else tangent
    mm = fam.coerce(m)
    return mu.expect((a.T * mm).applyfunc(sp.expand), fam.units)


def _min_norm_solve(k: sp.Matrix, b: sp.Matrix) -> sp.Matrix:
    """``K⁺ b`` for symmetric PSD ``K`` and ``b ∈ range(K)``: the solution orthogonal to ``null K``."""
    p = k.rows
    if p == 0:
        return sp.zeros(0, 1)
    if all(is_zero(e) for e in b):
        return sp.zeros(p, 1)
    try:
        sol, free = k.gauss_jordan_solve(b)
    except ValueError as exc:
        raise MeasureError(
            f"b is not in the range of K ({exc}); m is not square-integrable or an expectation did not simplify"
        ) from None
    sol = sol.xreplace(dict.fromkeys(free, 0))
    null = k.nullspace(simplify=True, iszerofunc=is_zero)
    if null:
        n = sp.Matrix.hstack(*null)
        sol = sol - n * (n.T * n).inv() * (n.T * sol)
    return sol.applyfunc(simplified)


def projection(fam: SymbolicFamily, measure, m) -> tuple[sp.Matrix, sp.Matrix]:
    r"""The orthogonal projection of ``m`` onto ``T = {A v}`` in ``L²(μ)`` (theory/definitions.md).

    .. math::

        v^* = K^+ b, \qquad Π m = A v^* .

    ``v*`` is the minimum-norm coefficient vector (computed exactly: a particular
    solution of ``K v = b`` made orthogonal to ``null K``); ``Π m`` does not depend on
    that choice ``μ``-a.e.

    Args:
        fam: the family.
        measure: the unit measure (see :func:`tangent_gram`).
        m: the conditional activation gradient, ``d`` components (see :meth:`SymbolicFamily.coerce`).

    Returns:
        ``(v_star, proj)``: ``p × 1`` and ``d × 1`` Matrices (``proj`` in the unit symbols).

    Raises:
        MeasureError: if ``b`` is not in the range of ``K`` (``m ∉ L²(μ)``).
    """
    a = tangent_map(fam)
    k = tangent_gram(fam, measure, tangent=a)
    b = gradient(fam, measure, m, tangent=a)
    v = _min_norm_solve(k, b)
    return v, (a * v).applyfunc(sp.expand)


def saturation_score(fam: SymbolicFamily, measure, m) -> tuple[sp.Expr, sp.Expr]:
    """The saturation score ``s = ‖Π m‖ = sqrt(bᵀ K⁺ b)`` (theory/definitions.md, T2 ``thm-iff``).

    Args:
        fam: the family.
        measure: the unit measure (see :func:`tangent_gram`).
        m: the conditional activation gradient, ``d`` components (see :meth:`SymbolicFamily.coerce`).

    Returns:
        ``(s, s²)`` as exact sympy values.

    Raises:
        FamilyError: if ``fam`` is not a :class:`SymbolicFamily`, or ``m`` is malformed.
        MeasureError: as :func:`tangent_gram` and :func:`gradient`.
    """
    a = tangent_map(fam)
    k = tangent_gram(fam, measure, tangent=a)
    b = gradient(fam, measure, m, tangent=a)
    s2 = simplified((b.T * _min_norm_solve(k, b))[0, 0])
    return simplified(sp.sqrt(s2)), s2


def raw_score(fam: SymbolicFamily, measure, m) -> sp.Expr:
    """``r = ‖m‖ = sqrt(E_μ |m|²)`` (theory/definitions.md).

    Args:
        fam: the family.
        measure: the unit measure (see :func:`tangent_gram`).
        m: the conditional activation gradient, ``d`` components (see :meth:`SymbolicFamily.coerce`).

    Returns:
        ``r`` as an exact (simplified) sympy expression.

    Raises:
        FamilyError: if ``fam`` is not a :class:`SymbolicFamily`, or ``m`` is malformed.
        MeasureError: on a dimension mismatch or a non-closed-form expectation.
    """
    check_symbolic_family(fam)
    mu = family_measure(fam, measure)
    mm = fam.coerce(m)
    return simplified(sp.sqrt(mu.expect(sp.expand((mm.T * mm)[0, 0]), fam.units)))


def realizability_defect(fam: SymbolicFamily, measure, m) -> sp.Expr:
    """``ρ = ‖m − Π m‖ / ‖m‖`` (theory/definitions.md, T6 ``thm-realizability``); ``nan`` if ``m = 0``.

    Args:
        fam: the family.
        measure: the unit measure (see :func:`tangent_gram`).
        m: the conditional activation gradient, ``d`` components (see :meth:`SymbolicFamily.coerce`).

    Returns:
        ``ρ ∈ [0, 1]`` as an exact sympy expression, ``sympy.nan`` when ``‖m‖ = 0``.

    Raises:
        FamilyError: if ``fam`` is not a :class:`SymbolicFamily`, or ``m`` is malformed.
        MeasureError: as :func:`projection`.
    """
    check_symbolic_family(fam)
    mu = family_measure(fam, measure)
    mm = fam.coerce(m)
    _, proj = projection(fam, mu, mm)
    r2 = mu.expect(sp.expand((mm.T * mm)[0, 0]), fam.units)
    if is_zero(r2):
        return sp.nan
    resid = mm - proj
    defect2 = mu.expect(sp.expand((resid.T * resid)[0, 0]), fam.units)
    return simplified(sp.sqrt(defect2 / r2))


# ----------------------------------------------------------------------------- ranks
def _poly_coefficient_matrix(a: sp.Matrix, units) -> sp.Matrix | None:
    """Rows ``(component, monomial)``, columns parameters; ``None`` if not polynomial in ``u``."""
    rows: dict = {}
    for i in range(a.rows):
        for j in range(a.cols):
            e = sp.expand(a[i, j])
            if e == 0:
                continue
            try:
                poly = sp.Poly(e, *units)
            except sp.PolynomialError:
                return None
            for monom, coeff in poly.terms():
                rows.setdefault((i, monom), {})[j] = coeff
    if not rows:
        return sp.zeros(0, a.cols)
    mat = sp.zeros(len(rows), a.cols)
    for r, cols in enumerate(rows.values()):
        for j, c in cols.items():
            mat[r, j] = c
    return mat


def _atom_coefficient_matrix(a: sp.Matrix, units) -> sp.Matrix:
    """Coefficients over the distinct unit-dependent factors of the expanded entries.

    Its rank is an *upper bound* of the function-space rank (equal when those factors
    are linearly independent functions).
    """
    rows: dict = {}
    for i in range(a.rows):
        for j in range(a.cols):
            for term in sp.Add.make_args(sp.expand(a[i, j])):
                if term == 0:
                    continue
                coeff, dep = term.as_independent(*units, as_Add=False)
                rows.setdefault((i, dep), {})
                rows[(i, dep)][j] = rows[(i, dep)].get(j, 0) + coeff
    mat = sp.zeros(len(rows), a.cols)
    for r, cols in enumerate(rows.values()):
        for j, c in cols.items():
            mat[r, j] = c
    return mat


def _evaluated_rank(a: sp.Matrix, units, npts: int, seed: int) -> int:
    """Rank of ``A`` stacked at ``npts`` random rational points (a lower bound)."""
    rng = random.Random(seed)
    blocks = []
    for _ in range(npts):
        pt = {u: sp.Rational(rng.randint(-600, 600), rng.randint(60, 120)) for u in units}
        blocks.append(a.xreplace(pt))
    stacked = sp.Matrix.vstack(*blocks)
    if all(e.is_Rational for e in stacked):
        return _rank(stacked)
    num = np.array(stacked.evalf(30).tolist(), dtype=np.float64)
    if num.size == 0:
        return 0
    sv = np.linalg.svd(num, compute_uv=False)
    return int((sv > max(num.shape) * np.finfo(np.float64).eps * 1e3 * (sv[0] if sv.size else 0)).sum())


def _function_rank(a: sp.Matrix, units) -> int:
    """``dim {u ↦ A(u) v}``: the rank of ``A`` as a linear map into functions of ``u``.

    Exact for entries polynomial in ``u`` (rank of the monomial coefficient matrix);
    otherwise the rank of ``A`` stacked at random rational points, raised towards the
    atom-coefficient upper bound with more points (probabilistic: a piecewise map
    whose pieces lie far outside ``[-10, 10]`` could be under-counted).
    """
    if a.cols == 0:
        return 0
    poly = _poly_coefficient_matrix(a, units)
    if poly is not None:
        return _rank(poly)
    upper = _rank(_atom_coefficient_matrix(a, units))
    lower = 0
    for attempt in range(4):
        lower = max(lower, _evaluated_rank(a, units, a.cols + 4 + 4 * attempt, seed=attempt))
        if lower >= upper:
            return upper
    return lower


def tangent_rank(fam: SymbolicFamily, measure=None) -> int:
    """``dim T``: ``rank K`` for a measure, else the function-space rank of ``A``.

    Without a measure this is the measure-independent column-space dimension of
    ``u ↦ A(u)`` (exact for polynomial tangent maps, see :func:`_function_rank`);
    with one it is ``rank E_μ[AᵀA]`` (smaller when ``μ`` cannot separate directions).

    Args:
        fam: the family.
        measure: optional unit measure (see :func:`tangent_gram`).

    Returns:
        ``dim T`` (an ``int``).

    Raises:
        FamilyError: if ``fam`` is not a :class:`SymbolicFamily`.
        MeasureError: as :func:`tangent_gram` (with a measure).
    """
    check_symbolic_family(fam)
    a = tangent_map(fam)
    if measure is None:
        return _function_rank(a, fam.units)
    return _rank(tangent_gram(fam, measure, tangent=a))


def is_degenerate(fam: SymbolicFamily) -> bool:
    """``A ≡ 0`` symbolically, so ``T = {0}`` (theory label thm-reparameterization).

    Such a family is reported *degenerate*, never saturated.

    Args:
        fam: the family.

    Returns:
        ``True`` if every entry of :func:`tangent_map` is identically zero.

    Raises:
        FamilyError: if ``fam`` is not a :class:`SymbolicFamily`.
    """
    return all(is_zero(e) for e in tangent_map(fam))


# ----------------------------------------------------------------------------- reparameterization
def _chi_matrix(fam: SymbolicFamily, chi, xi) -> tuple[sp.Matrix, tuple]:
    xi = tuple(xi)
    chi_m = to_matrix(chi)
    if chi_m.rows != fam.p:
        raise FamilyError(f"chi has {chi_m.rows} components; the family has p = {fam.p} parameters")
    extra = chi_m.free_symbols - set(xi)
    if extra:
        raise FamilyError(f"chi contains symbols {sorted(map(str, extra))} that are not in xi")
    at0 = chi_m.xreplace(dict.fromkeys(xi, 0))
    if not all(is_zero(e) for e in at0):
        raise FamilyError(
            f"chi(0) = {list(at0)} must be 0 (theory label thm-reparameterization: the origin maps to the origin)"
        )
    return chi_m, xi


def reparameterize(fam: SymbolicFamily, chi, xi) -> SymbolicFamily:
    """The family in new coordinates: ``h̃(ξ, u) = h(χ(ξ), u)`` (theory label thm-reparameterization).

    Args:
        fam: the family.
        chi: ``p`` expressions ``χ(ξ)`` with ``χ(0) = 0``.
        xi: the new parameter symbols ``ξ`` (``q`` of them).

    Returns:
        A new :class:`SymbolicFamily` with parameters ``xi``, named ``"<name>∘χ"``.

    Raises:
        FamilyError: on a wrong length, ``χ(0) ≠ 0``, or stray symbols in ``chi``.
    """
    check_symbolic_family(fam)
    chi_m, xi = _chi_matrix(fam, chi, xi)
    return fam.subs_params(dict(zip(fam.params, chi_m, strict=False)), xi, name=f"{fam.name}∘χ")


def is_regular_reparameterization(fam: SymbolicFamily, chi, xi_symbols, measure=None) -> bool:
    """Whether ``θ = χ(ξ)`` keeps the tangent space: ``range(A·Dχ(0)) = range(A)`` (T4).

    Since ``range(A Dχ) ⊆ range(A)`` always, equality is a rank comparison.  Without a
    measure the ranks are function-space ranks of ``A Dχ(0)`` and ``A`` (independent
    of any measure); with one, ``rank(Dχᵀ K Dχ) = rank K`` for ``K = E_μ[AᵀA]``.

    Args:
        fam: the family (coordinates ``θ``).
        chi: ``p`` expressions in ``xi_symbols`` with ``χ(0) = 0``.
        xi_symbols: the new parameter symbols.
        measure: optional unit measure.

    Returns:
        ``True`` if the rank is kept (the reparameterization is regular).

    Raises:
        FamilyError: as :func:`reparameterize`.
    """
    check_symbolic_family(fam)
    chi_m, xi = _chi_matrix(fam, chi, xi_symbols)
    jac = chi_m.jacobian(sp.Matrix(xi)).xreplace(dict.fromkeys(xi, 0)) if xi else sp.zeros(fam.p, 0)
    a = tangent_map(fam)
    if measure is None:
        return _function_rank((a * jac).applyfunc(sp.expand), fam.units) == _function_rank(a, fam.units)
    k = tangent_gram(fam, measure, tangent=a)
    return _rank(jac.T * k * jac) == _rank(k)


# ----------------------------------------------------------------------------- result
@dataclass
class SymbolicSaturation:
    """Exact saturation quantities of a (family, measure, ``m``) (theory/definitions.md).

    Field names follow :class:`depthsat_theory.statistics.SaturationResult` where they
    apply; values are exact sympy objects.

    Attributes:
        score: ``s = ‖Π m‖ = sqrt(bᵀ K⁺ b)``.
        score_squared: ``s²``.
        raw_score: ``r = ‖m‖``.
        realizability_defect: ``ρ = ‖m − Π m‖ / ‖m‖`` (``nan`` if ``m = 0``).
        tangent_rank: ``rank K``.
        tangent_dim: ``p``.
        degenerate: ``rank K = 0`` (``T = {0}`` on this measure; never "saturated").
        saturated: ``s = 0`` exactly and not degenerate (T2: no descent-compatible
            zero-state update decreases ``J`` at first order).
        gradient: ``b = E[Aᵀ m]`` (``p × 1`` Matrix, the family's coordinate order).
        tangent_gram: ``K = E[AᵀA]`` (``p × p``).
        coefficients: ``v* = K⁺ b``.
        projection: ``Π m = A v*`` (``d × 1`` in the unit symbols).
        family: the family's name.
    """

    score: sp.Expr
    score_squared: sp.Expr
    raw_score: sp.Expr
    realizability_defect: sp.Expr
    tangent_rank: int
    tangent_dim: int
    degenerate: bool
    saturated: bool
    gradient: sp.Matrix = field(repr=False)
    tangent_gram: sp.Matrix = field(repr=False)
    coefficients: sp.Matrix = field(repr=False)
    projection: sp.Matrix = field(repr=False)
    family: str = "symbolic"

    _NUMERIC = ("score", "score_squared", "raw_score", "realizability_defect")

    def evalf(self, n: int = 15) -> SymbolicSaturation:
        """A copy with every sympy value evaluated to ``n`` significant digits.

        Args:
            n: significant digits.

        Returns:
            A new :class:`SymbolicSaturation` with sympy fields as floats; other fields unchanged.
        """
        vals = {}
        for f in fields(self):
            v = getattr(self, f.name)
            vals[f.name] = v.evalf(n) if isinstance(v, (sp.Basic, sp.MatrixBase)) else v
        return SymbolicSaturation(**vals)

    def to_dict(self, *, with_gradient: bool = False) -> dict:
        """Python floats/ints/bools (``nan`` → ``None``); ``gradient`` as a list when asked.

        Args:
            with_gradient: also include ``gradient`` (``b`` as a list of ``p`` floats).

        Returns:
            A ``dict`` of the numeric fields as floats (``nan`` → ``None``) plus ``tangent_rank``,
            ``tangent_dim``, ``degenerate``, ``saturated`` and ``family``.
        """
        out: dict = {}
        for name in self._NUMERIC:
            v = float(getattr(self, name))
            out[name] = None if math.isnan(v) else v
        out.update(
            tangent_rank=self.tangent_rank,
            tangent_dim=self.tangent_dim,
            degenerate=self.degenerate,
            saturated=self.saturated,
            family=self.family,
        )
        if with_gradient:
            out["gradient"] = self.gradient_array().tolist()
        return out

    def gradient_array(self) -> np.ndarray:
        """``b`` as a float64 numpy vector ``(p,)``.

        Returns:
            ``b``, float64 ``(p,)``.
        """
        return np.array([float(e) for e in self.gradient], dtype=np.float64)

    def tangent_gram_array(self) -> np.ndarray:
        """``K`` as a float64 numpy matrix ``(p, p)``.

        Returns:
            ``K``, float64 ``(p, p)`` (entries evaluated to 17 digits).
        """
        return np.array(self.tangent_gram.evalf(17).tolist(), dtype=np.float64).reshape(self.tangent_gram.shape)

    @property
    def probe_verdict(self) -> Verdict:
        """The verdict on this measure itself, equal to :attr:`verdict` (no sampling to test)."""
        return self.verdict

    @property
    def verdict(self) -> Verdict:
        """:attr:`Verdict.DEGENERATE`, :attr:`Verdict.SATURATED` (``s = 0`` exactly) or :attr:`Verdict.IMPROVABLE`."""
        if self.degenerate:
            return Verdict.DEGENERATE
        return Verdict.SATURATED if self.saturated else Verdict.IMPROVABLE

    def __float__(self) -> float:
        return float(self.score)


def saturation(fam: SymbolicFamily, measure, m) -> SymbolicSaturation:
    """All exact saturation quantities at once (theory/definitions.md; T2, T4, T6).

    Args:
        fam: the family.
        measure: the unit measure (a :class:`Measure` or ``sympy.stats`` variables).
        m: the conditional activation gradient (``d`` components in the unit symbols).

    Returns:
        A :class:`SymbolicSaturation`.

    Raises:
        FamilyError: on a bad ``m``.
        MeasureError: on a non-closed-form expectation.
    """
    check_symbolic_family(fam)
    mu = family_measure(fam, measure)
    mm = fam.coerce(m)
    a = tangent_map(fam)
    k = tangent_gram(fam, mu, tangent=a)
    b = gradient(fam, mu, mm, tangent=a)
    v = _min_norm_solve(k, b)
    s2 = simplified((b.T * v)[0, 0])
    proj = (a * v).applyfunc(sp.expand)
    r2 = simplified(mu.expect(sp.expand((mm.T * mm)[0, 0]), fam.units))
    if is_zero(r2):
        rho = sp.nan
    else:
        resid = mm - proj
        rho = simplified(sp.sqrt(mu.expect(sp.expand((resid.T * resid)[0, 0]), fam.units) / r2))
    rank = _rank(k)
    degenerate = rank == 0
    return SymbolicSaturation(
        score=simplified(sp.sqrt(s2)),
        score_squared=s2,
        raw_score=simplified(sp.sqrt(r2)),
        realizability_defect=rho,
        tangent_rank=rank,
        tangent_dim=fam.p,
        degenerate=degenerate,
        saturated=(not degenerate) and is_zero(s2),
        gradient=b,
        tangent_gram=k,
        coefficients=v,
        projection=proj,
        family=fam.name,
    )
