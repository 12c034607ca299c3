"""The numeric, dense and symbolic engines agree case by case (engine × case × device).

Cases are data (``tests/cases.py``), expanded by the ``engine``, ``case``,
``exact_case`` and ``case_device`` fixtures of ``conftest.py``.  Every engine's result
is compared with

* the **dense reference** (:func:`depthsat_theory.engines.dense_saturation` on CPU in
  float64: a full ``torch.func`` Jacobian and an SVD least-squares projection,
  independent of the streaming statistics and of sympy), and
* the case's hand-derived ``verdict`` and closed-form ``tangent_rank``/``tangent_dim``,

on ``score``, ``tangent_rank``, ``gradient`` and the verdict.  The three result types
share these field names (``SaturationResult``, ``DenseSaturation``,
``SymbolicSaturation``), so one comparison serves all engines.
"""

from __future__ import annotations

import functools
from dataclasses import fields
from typing import Any

import numpy as np
import pytest
import sympy as sp
import torch

from cases import CASES, Case
from depthsat_theory.engines import dense_saturation
from depthsat_theory.engines import symbolic as S
from depthsat_theory.families import parse_family
from depthsat_theory.optimizers import UPDATES
from depthsat_theory.optimizers import is_descent_compatible as numeric_descent_compatible
from depthsat_theory.statistics import SaturationResult, statistics_for
from depthsat_theory.vocabulary import Verdict

DT = torch.float64
#: relative agreement of float64 engines with the dense reference
RTOL = 1e-9
CASES_BY_NAME = {c.name: c for c in CASES}

_SYMBOLIC_FAMILIES = {
    "linear": lambda d: S.linear(d),
    "linear-nobias": lambda d: S.linear(d, bias=False),
    "poly:2": lambda d: S.polynomial(d, 2),
    "powers:2": lambda d: S.powers(d, 2),
    "product:1": lambda d: S.product(d, 1),
}


def symbolic_family(case: Case) -> S.SymbolicFamily:
    """The symbolic counterpart of the case's numeric family (same coordinate order)."""
    return _SYMBOLIC_FAMILIES[case.family](case.shape[-1])


def verdict_of(res: Any) -> Verdict:
    """The verdict from the shared fields ``degenerate`` and ``saturated`` (any engine's result)."""
    if res.degenerate:
        return Verdict.DEGENERATE
    return Verdict.SATURATED if res.saturated else Verdict.IMPROVABLE


def _orthogonal_gradient(z: torch.Tensor, g0: torch.Tensor) -> torch.Tensor:
    """``g0`` minus its projection on ``{W z + c}``: columns orthogonal to ``[Z, 1]`` (QR)."""
    design = torch.cat([z, torch.ones(z.shape[0], 1, dtype=z.dtype)], dim=1)
    q, _ = torch.linalg.qr(design)
    return g0 - q @ (q.T @ g0)


@functools.cache
def probe(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, g)`` on CPU in float64, shape ``(n, *case.shape)``.

    Exact cases: the measure's support replicated by weight (its uniform row average is
    exactly ``E_μ``) and ``g = m(z)``; random cases: seeded Gaussians.
    """
    if case.exact:
        mu = S.FiniteMeasure(list(case.points), list(case.weights))
        rows = S.replicated_support(mu)
        g = S.lambdify_units(symbolic_family(case), case.m)(rows)
        return torch.from_numpy(rows), torch.from_numpy(np.ascontiguousarray(g))
    gen = torch.Generator().manual_seed(case.seed)
    z = torch.randn(case.n, *case.shape, generator=gen, dtype=DT)
    g = torch.randn(case.n, *case.shape, generator=gen, dtype=DT)
    if case.gradient == "orthogonal":
        g = _orthogonal_gradient(z, g)
    return z, g


@functools.cache
def reference(case: Case):
    """The dense reference on CPU in float64."""
    z, g = probe(case)
    return dense_saturation(parse_family(case.family), z, g, case.layout)


def run_engine(engine: str, case: Case, device: torch.device):
    """The engine's result for the case (numeric and dense on ``device``; sympy is exact)."""
    if engine == "symbolic":
        return S.saturation(symbolic_family(case), S.FiniteMeasure(list(case.points), list(case.weights)), case.m)
    z, g = (t.to(device) for t in probe(case))
    family = parse_family(case.family)
    if engine == "dense":
        return dense_saturation(family, z, g, case.layout)
    stats = statistics_for(family, case.shape, case.layout)
    stats.update(z, g)
    return stats.result()


def _as_vector(gradient: Any) -> np.ndarray:
    if isinstance(gradient, sp.MatrixBase):
        return np.array([float(e) for e in gradient], dtype=np.float64)
    return np.asarray(gradient, dtype=np.float64)


def assert_agrees(res: Any, ref: Any, case: Case) -> None:
    """``score``, ``tangent_rank``, ``tangent_dim``, ``gradient`` and verdict against the reference and the case."""
    assert res.tangent_rank == ref.tangent_rank
    assert res.tangent_dim == ref.tangent_dim
    if case.tangent_rank is not None:
        assert ref.tangent_rank == case.tangent_rank
    if case.tangent_dim is not None:
        assert ref.tangent_dim == case.tangent_dim
    assert verdict_of(res) == verdict_of(ref) == case.verdict
    floor = 1e-12 * max(ref.ag_rms, 1.0)
    assert float(res.score) == pytest.approx(ref.score, rel=RTOL, abs=floor)
    ref_b = _as_vector(ref.gradient)
    np.testing.assert_allclose(_as_vector(res.gradient), ref_b, rtol=RTOL, atol=1e-12 * max(np.abs(ref_b).max(), 1.0))


def test_engine_agrees_with_dense_reference(engine_case: tuple[str, Case, torch.device]) -> None:
    engine, case, case_device = engine_case
    res = run_engine(engine, case, case_device)
    assert_agrees(res, reference(case), case)
    assert res.probe_verdict == case.verdict  # every engine's result carries the shared Verdict on its probe


def test_symbolic_engine_is_exact_on_the_measure(exact_case: Case) -> None:
    """Exact values the float engines can only approximate: ``s = 0`` exactly when saturated,
    ``s = r`` (``ρ = 0``) for the realizable case, ``rank K = 0`` when degenerate."""
    res = run_engine("symbolic", exact_case, torch.device("cpu"))
    assert res.verdict == verdict_of(res) == exact_case.verdict
    if exact_case.verdict == Verdict.SATURATED:
        assert res.score == 0 and res.score_squared == 0 and res.raw_score != 0
    if exact_case.realizable:
        assert res.realizability_defect == 0 and sp.simplify(res.score - res.raw_score) == 0
    if exact_case.verdict == Verdict.DEGENERATE:
        assert res.tangent_rank == 0 and res.tangent_gram == sp.zeros(res.tangent_dim, res.tangent_dim)


def test_result_types_share_field_names() -> None:
    """Dense and symbolic results carry the numeric ``SaturationResult``'s names for what they compute."""
    numeric = {f.name for f in fields(SaturationResult)}
    dense = {f.name for f in fields(type(reference(CASES_BY_NAME["linear-vector"])))}
    symbolic = {f.name for f in fields(S.SymbolicSaturation)}
    shared = {"score", "gradient", "tangent_rank", "tangent_dim", "degenerate", "saturated"}
    assert shared <= numeric & dense & symbolic
    # what only one engine computes has its own name, never a clashing one
    assert dense - numeric <= {"projection", "jacobian"}
    assert symbolic - numeric <= {"score_squared", "tangent_gram", "coefficients", "projection"}


@pytest.mark.parametrize("name", sorted(UPDATES))
def test_descent_compatibility_engines_agree(name: str) -> None:
    """Both ``is_descent_compatible`` take the same arguments and agree with the declaration."""
    declared = UPDATES[name].descent_compatible
    assert numeric_descent_compatible(name) is S.is_descent_compatible(name) is declared
    upd = UPDATES[name]
    assert numeric_descent_compatible(upd, dim=4) is S.is_descent_compatible(upd, dim=4) is declared
