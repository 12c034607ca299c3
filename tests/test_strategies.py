"""Property tests of the built-in families with :mod:`depthsat_theory.strategies`.

References are independent of the streaming statistics in :mod:`depthsat_theory.statistics`:

* the tangent Jacobian ``A`` (``(n·d) × p``) from forward-mode ``torch.func``
  (:func:`~depthsat_theory.strategies.tangent_jacobian`), or in closed form for
  :class:`~depthsat_theory.strategies.PolynomialFamily`;
* ``Π g`` by an SVD least-squares fit of the stacked ``g`` on the column-scaled ``A``,
  truncated with the statistics' relative cutoff (``σ² > rtol σ_max²``; a convention,
  not a computation, shared with the statistics), so ``s = ‖Π g‖ / sqrt(n)``;
* finite measures: weighted sums over the atoms by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from depthsat_theory.capture import SiteRecorder, check_function_preserving, insert_block
from depthsat_theory.families import linear, parse_family
from depthsat_theory.statistics import statistics_for
from depthsat_theory.strategies import (
    PolynomialFamily,
    finite_measures,
    measures,
    polynomial_families,
    probes,
    residual_families,
    small_models,
    tangent_jacobian,
)

FAST = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _stats(family, z, g, layout="vector"):
    acc = statistics_for(family, tuple(z.shape[1:]), layout, pool_ties=True)
    acc.update(torch.from_numpy(z), torch.from_numpy(g))
    return acc, acc.result()


def _reference(a: np.ndarray, gvec: np.ndarray, n: int, rtol: float) -> tuple[float, int]:
    """``(s, rank)`` by a truncated SVD fit of ``gvec`` on the column-scaled ``a``."""
    norms = np.linalg.norm(a, axis=0)
    live = norms > 0
    if not live.any():
        return 0.0, 0
    u, sv, _ = np.linalg.svd(a[:, live] / norms[live], full_matrices=False)
    keep = sv * sv > rtol * sv[0] ** 2
    proj = u[:, keep] @ (u[:, keep].T @ gvec)
    return float(np.sqrt(proj @ proj / n)), int(keep.sum())


@FAST
@given(fam=residual_families(), probe=probes(d=st.integers(1, 3), n=st.integers(3, 16)))
def test_score_chain_and_projection_match_reference(fam, probe):
    z, g = probe
    n = z.shape[0]
    _, res = _stats(fam, z, g)
    # s ≤ r̂ ≤ AG_rms ≤ AG_max on one probe (theory/definitions.md)
    slack = 1 + 1e-10
    assert res.score <= res.raw_score * slack
    assert res.raw_score <= res.ag_rms * slack and res.ag_rms <= res.ag_max * slack
    a = tangent_jacobian(fam, z)
    s, rank = _reference(a, g.reshape(-1), n, res.rtol)
    assert res.tangent_rank == rank
    # within the engine's stated rounding bound (theory/numerics.md, thm-score-error) or 1e-6 relative
    assert abs(res.score - s) <= max(1e-6 * s + 1e-9 * res.ag_rms, res.score_error)
    if fam.spec.startswith("product"):
        assert res.degenerate and not res.saturated and res.score == 0.0


@FAST
@given(fam=polynomial_families(), probe=probes(d=2, n=st.integers(2, 12), z_scale=1.0))
def test_polynomial_families_against_closed_form_tangent(fam: PolynomialFamily, probe):
    z, g = probe
    _, res = _stats(fam, z, g)
    assert fam.functional(torch.zeros(fam.p, dtype=torch.float64), torch.from_numpy(z), "vector").abs().max() == 0
    cols = fam.tangent_columns(z)  # closed form, no autograd
    s, rank = _reference(cols, g.reshape(-1), z.shape[0], res.rtol)
    assert res.tangent_rank == rank and res.tangent_dim == fam.p
    # within the engine's stated rounding bound (theory/numerics.md, thm-score-error) or 1e-6 relative
    assert abs(res.score - s) <= max(1e-6 * s + 1e-9 * res.ag_rms, res.score_error)
    np.testing.assert_allclose(
        res.gradient, cols.T @ g.reshape(-1) / z.shape[0], rtol=1e-9, atol=1e-12 * max(1.0, float(np.abs(g).max()))
    )


@FAST
@given(fam=residual_families(degenerate=False), data=st.data())
def test_saturated_and_realizable_probes(fam, data):
    """g ⟂ T ⇒ saturated (T2); g ∈ T ⇒ s = AG_rms, so AG_max = 0 ⇔ saturated (T6)."""
    sat = data.draw(probes(d=3, n=12, family=fam, kind="saturated", z_scale=1.0))
    _, res = _stats(fam, *sat)
    assert res.degenerate or res.saturated
    real = data.draw(probes(d=3, n=12, family=fam, kind="realizable", z_scale=1.0))
    _, res = _stats(fam, *real)
    if res.ag_rms > 0:
        assert res.score == pytest.approx(res.ag_rms, rel=1e-6)
        assert res.realizability_defect == pytest.approx(0.0, abs=1e-6)


@FAST
@given(probe=probes(d=4, n=20, rank=st.integers(1, 3), z_scale=1.0))
def test_rank_controlled_probes_reduce_the_linear_tangent_rank(probe):
    """z of rank r (no intercept in its span generically): rank Φ̃ = r + 1, so rank K = d (r + 1)."""
    z, g = probe
    r = np.linalg.matrix_rank(z)
    _, res = _stats(linear(), z, g)
    assert res.tangent_rank == 4 * (r + 1)
    _, res0 = _stats(linear(bias=False), z, g)
    assert res0.tangent_rank == 4 * r


@FAST
@given(mu=finite_measures(2), data=st.data())
def test_finite_measures_make_pooled_quantities_exact(mu, data):
    """Ties: the probe of a finite measure with g = m(atom) + noise (zero-mean per atom).

    By hand: r² = Σ_i w_i |m_i|², and ρ² r² = Σ_i w_i |m_i − (Π m)(x_i)|², with Π the
    weighted least-squares fit of m by φ̃ = (x, 1) over the atoms.
    """
    units = mu.units()
    m_atoms = data.draw(
        st.lists(st.tuples(st.integers(-3, 3), st.integers(-3, 3)), min_size=len(mu.points), max_size=len(mu.points))
    )
    m_atoms = np.array(m_atoms, dtype=np.float64)
    g = np.repeat(m_atoms, mu.counts, axis=0)
    # add ±e noise on atoms with >= 2 copies: pooled means stay m
    start = np.concatenate([[0], np.cumsum(mu.counts)[:-1]])
    for i, c in zip(start, mu.counts, strict=False):
        if c >= 2:
            g[i, 0] += 0.5
            g[i + 1, 0] -= 0.5
    _, res = _stats(linear(), units, g)
    w = mu.weights
    r2 = float(mu.expect(lambda x: (m_atoms**2).sum(axis=1)))
    assert res.raw_score == pytest.approx(np.sqrt(r2), rel=1e-12, abs=1e-15)
    phi = np.hstack([mu.points, np.ones((len(w), 1))]) * np.sqrt(w)[:, None]
    coef, *_ = np.linalg.lstsq(phi, m_atoms * np.sqrt(w)[:, None], rcond=None)
    resid2 = float(((m_atoms * np.sqrt(w)[:, None] - phi @ coef) ** 2).sum())
    if r2 > 0:
        assert res.realizability_defect == pytest.approx(np.sqrt(resid2 / r2), rel=1e-7, abs=1e-7)


@FAST
@given(mu=finite_measures(1, max_atoms=4), fam=polynomial_families(max_terms=3, max_params=2))
def test_symbolic_gram_matches_numeric_on_finite_measures(mu, fam):
    """K = E_μ[AᵀA]: exact symbolic (engine) vs the float64 statistics on the measure's units."""
    engine = pytest.importorskip("depthsat_theory.engines.symbolic.engine")
    from depthsat_theory.engines.symbolic.family import SymbolicFamily

    sym = SymbolicFamily.parse(fam.expression(1), d=1)
    k_exact = np.array(engine.tangent_gram(sym, mu.to_symbolic()).evalf(17).tolist(), dtype=np.float64)
    units = mu.units()
    acc, _ = _stats(fam, units, np.zeros_like(units))
    k_num = (acc.k_mat / acc.n).numpy()
    np.testing.assert_allclose(k_num, k_exact[: fam.p, : fam.p], rtol=1e-12, atol=1e-12)


@settings(max_examples=10, deadline=None)
@given(sm=small_models(), data=st.data())
def test_small_models_gradient_of_inserted_block_is_b(sm, data):
    """T1 on tiny residual MLPs: autograd's ∂J/∂θ of an inserted block equals the statistics' b."""
    site = data.draw(st.sampled_from(sm.sites))
    spec = data.draw(st.sampled_from(["linear", "relu:3:1", "poly:2", "product:1"]))
    fam = parse_family(spec)
    with SiteRecorder(sm.model, [site]) as rec:
        losses = sm.loss(sm.model(sm.inputs), sm.targets)
        rec.backward(losses.sum())
    z, g = rec.z[site], rec.g[site]
    acc = statistics_for(fam, (sm.width,), "vector")
    acc.update(z, g)
    res = acc.result()
    new, blk = insert_block(sm.model, site, fam.block((sm.width,), "vector"))
    assert check_function_preserving(sm.model, new, sm.inputs) == 0.0
    params = fam.tangent_parameters(blk)
    grads = torch.autograd.grad(sm.loss(new(sm.inputs), sm.targets).mean(), params, allow_unused=True)
    b = torch.cat(
        [(torch.zeros_like(p) if gr is None else gr).reshape(-1) for p, gr in zip(params, grads, strict=False)]
    )
    np.testing.assert_allclose(b.detach().numpy(), res.gradient, rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize(
    "kwargs,needle", [({"kind": "saturated"}, "needs a family"), ({"kind": "bogus"}, "kind must be")]
)
def test_probe_kind_errors(kwargs, needle):
    @settings(max_examples=1, deadline=None)
    @given(probes(**kwargs))
    def inner(probe):
        pass

    with pytest.raises(ValueError, match=needle):
        inner()


try:
    import depthsat_theory.engines.symbolic.measures  # noqa: F401

    HAVE_SYMBOLIC = True
except ImportError:  # pragma: no cover - the engine ships with the package
    HAVE_SYMBOLIC = False


@pytest.mark.skipif(not HAVE_SYMBOLIC, reason="symbolic engine not available")
@settings(max_examples=15, deadline=None)
@given(mu=finite_measures(2), sym_mu=measures(1, symbolic=True) if HAVE_SYMBOLIC else st.nothing())
def test_symbolic_measures(mu, sym_mu):
    """Exact conversion: E_μ[u1 + u2²] by the engine equals the weighted sum over the atoms."""
    import sympy as sp

    from depthsat_theory.engines.symbolic.family import unit_symbols

    u1, u2 = unit_symbols(2)
    exact = mu.to_symbolic().expect(u1 + u2**2, (u1, u2))
    assert float(exact) == pytest.approx(float(mu.expect(lambda x: x[:, 0] + x[:, 1] ** 2)), rel=1e-15)
    (v,) = unit_symbols(1)
    assert sp.simplify(sym_mu.expect(sp.Integer(1) + 0 * v, (v,)) - 1) == 0
