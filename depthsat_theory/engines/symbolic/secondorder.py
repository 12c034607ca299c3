"""The symbolic engine's second order at the origin: the cross block and the saddle score.

Same names as the numeric engine (:mod:`depthsat_theory.statistics.secondorder`): for a family
``h(θ, u)`` the *feature parameters* ``ψ`` are the coordinates whose tangent column vanishes
identically (they enter only multiplied by others, as ``ψ`` in ``W φ_ψ(u)``), the *output
parameters* ``W`` the others.  The cross block is ``C = E_μ[Σ_i m_i ∂²h_i/∂W∂ψ]`` at ``θ = 0``
(theory/second-order.md, ``def-cross-block``) and the saddle score is
``σ = sqrt(λ_max(Cᵀ K_WW⁺ C))``: ``δW`` in function space, ``δψ`` Euclidean (``thm-strict-saddle``).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from depthsat_theory.engines.symbolic.engine import check_symbolic_family, family_measure, tangent_gram, tangent_map
from depthsat_theory.engines.symbolic.family import SymbolicFamily

__all__ = ["SymbolicSaddle", "saddle"]


@dataclass(frozen=True)
class SymbolicSaddle:
    """Exact second-order quantities of a family at its origin.

    Attributes:
        cross_block: ``C`` (``|W| × |ψ|`` Matrix), rows the output parameters, columns the feature ones.
        output_parameters: the ``W`` symbols; feature_parameters: the ``ψ`` symbols.
        saddle_score: ``σ = sqrt(λ_max(Cᵀ K_WW⁺ C))`` (``0`` without feature parameters).
    """

    cross_block: sp.Matrix
    output_parameters: tuple
    feature_parameters: tuple
    saddle_score: sp.Expr


def saddle(fam: SymbolicFamily, measure, m) -> SymbolicSaddle:
    """Cross block and saddle score of ``fam`` on ``measure`` with conditional gradient ``m``.

    Args:
        fam: a :class:`~depthsat_theory.engines.symbolic.family.SymbolicFamily`.
        measure: the unit measure (as for :func:`~depthsat_theory.engines.symbolic.engine.tangent_gram`).
        m: the conditional activation gradient (``d`` components in the unit symbols).

    Returns:
        A :class:`SymbolicSaddle`.

    Raises:
        FamilyError: a bad family or ``m``; MeasureError: a non-closed-form expectation.
    """
    check_symbolic_family(fam)
    mu = family_measure(fam, measure)
    a = tangent_map(fam)
    feats = [j for j in range(fam.p) if all(sp.simplify(e) == 0 for e in a[:, j])]
    outs = [j for j in range(fam.p) if j not in feats]
    w_syms = tuple(fam.params[j] for j in outs)
    psi_syms = tuple(fam.params[j] for j in feats)
    if not feats or not outs:
        return SymbolicSaddle(sp.zeros(len(outs), len(feats)), w_syms, psi_syms, sp.Integer(0))
    mm = fam.coerce(m)
    zero = dict.fromkeys(fam.params, 0)
    rows = []
    for wj in w_syms:
        row = []
        for pj in psi_syms:
            mixed = sum(
                (mm[i] * sp.diff(fam.expr[i], wj, pj) for i in range(fam.d)),
                sp.Integer(0),
            )
            row.append(sp.expand(sp.sympify(mixed).xreplace(zero).doit()))
        rows.append(row)
    cross = mu.expect(sp.Matrix(rows), fam.units)
    k = tangent_gram(fam, measure, tangent=a)
    k_ww = k.extract(outs, outs)
    gram = (cross.T * k_ww.pinv() * cross).applyfunc(sp.simplify)
    eig = [sp.simplify(e) for e in gram.eigenvals()]
    top = max(eig, key=lambda e: float(sp.N(e)))
    return SymbolicSaddle(cross, w_syms, psi_syms, sp.sqrt(sp.simplify(top)))
