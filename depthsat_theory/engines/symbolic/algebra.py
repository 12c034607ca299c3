"""Exact zero tests and simplification shared by the symbolic engine's modules.

Zero tests are exact for rational/algebraic quantities (polynomial families under
finite, normal or uniform measures with rational parameters); for transcendental
entries they fall back to ``sympy.simplify``.
"""

from __future__ import annotations

import sympy as sp

__all__ = ["is_zero", "simplified"]


def simplified(e) -> sp.Expr:
    """``e`` sympified, and simplified unless it is a rational number or a symbol.

    Args:
        e: a sympy value or anything :func:`sympy.sympify` accepts.

    Returns:
        The simplified sympy expression (rationals and symbols unchanged).
    """
    e = sp.sympify(e)
    if e.is_Rational or e.is_Symbol:
        return e
    return sp.simplify(e)


def is_zero(e) -> bool:
    """Exact zero test of a scalar sympy value.

    Rational arithmetic first, then expansion, a 60-digit numeric screen for nonzero
    constants, then ``cancel``/``simplify``.

    Args:
        e: a sympy value or anything :func:`sympy.sympify` accepts.

    Returns:
        ``True`` iff ``e`` is (provably, by the steps above) zero.
    """
    e = sp.sympify(e)
    if e.is_Rational:
        return e == 0
    ex = sp.expand(e)
    if ex == 0:
        return True
    if ex.is_number:
        try:
            val = complex(ex.evalf(60))
        except (TypeError, ValueError):  # pragma: no cover - unevaluable constants
            val = None
        if val is not None and abs(val) > 1e-30:
            return False
        if sp.cancel(sp.together(ex)) == 0:
            return True
    return sp.simplify(ex) == 0
