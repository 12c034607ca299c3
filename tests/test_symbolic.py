"""Tests for depthsat_theory.engines.symbolic (the exact sympy engine).

Expected values come from outside the module under test:

* closed forms worked out by hand in the docstrings (normal/uniform moments, Gram
  matrices, projections);
* the real ``torch.optim`` classes (first steps from zero state);
* the numeric engine (:mod:`depthsat_theory.statistics`): exact agreement (to rounding,
  ``1e-10``) on finite measures, whose points are replicated in proportion to their
  rational weights so that the engine's row mean integrates exactly; and agreement
  within a stated Monte-Carlo tolerance (5 standard errors estimated from the sample)
  on samples from normal/uniform measures.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import sympy as sp
import sympy.stats as sps
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from depthsat_theory.engines import symbolic as S
from depthsat_theory.engines.symbolic import (
    FiniteMeasure,
    MeasureError,
    SymbolicFamily,
    first_order_change,
    gradient,
    is_degenerate,
    is_descent_compatible,
    is_function_preserving,
    is_regular_reparameterization,
    projection,
    reparameterize,
    saturation,
    tangent_gram,
    tangent_map,
    tangent_rank,
    zero_state_step,
)
from depthsat_theory.families import FamilyError
from depthsat_theory.families import builtin as F
from depthsat_theory.optimizers import UPDATES
from depthsat_theory.statistics import FeatureStatistics, GeneralStatistics

DT = torch.float64
U1 = sp.Symbol("u1", real=True)
U2 = sp.Symbol("u2", real=True)
EXACT_TOL = 1e-10
FAST = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)


def close(a, b, tol=EXACT_TOL) -> bool:
    return abs(float(a) - float(b)) <= tol * max(1.0, abs(float(b)))


# ----------------------------------------------------------------------------- parsing
def test_parse_scalar_and_vector_families():
    f = SymbolicFamily.parse("t1*u1 + t2*u1**2")
    assert (f.d, f.p) == (1, 2)
    t1, t2 = f.params
    assert sp.expand(f.expr[0] - (t1 * U1 + t2 * U1**2)) == 0

    g = SymbolicFamily.parse("[t1*u1 + t2, t3*u2]")
    assert (g.d, g.p) == (2, 3)
    assert g.expr[1] == g.params[2] * U2

    # decimals are exact, theta-aliases and bare u for d = 1
    h = SymbolicFamily.parse("0.5*theta2*u + t1*relu(u)")
    u = h.units[0]
    assert h.expr[0] == h.params[1] * u / 2 + h.params[0] * sp.Max(0, u)
    # unused lower indices are still parameters (zero tangent column)
    k = SymbolicFamily.parse("t3*u1")
    assert k.p == 3 and list(tangent_map(k)) == [0, 0, U1]


@pytest.mark.parametrize(
    "text, culprit",
    [
        ("t1*u1 +", "SyntaxError"),
        ("__import__('os')", "__import__"),
        ("t1*x", "'x'"),
        ("t1*foo(u1)", "'foo'"),
        ("u1.__class__*t1", "'.'"),
        ("t1^2*u1", "**"),
        ("lambda: t1", "'lambda'"),
        ("exp(t1*u1", "unbalanced"),
        ("(t1*u1, t2)", "bracket"),
        ("", "empty"),
        ("u1**2", "no parameters"),
        ("t1*3j", "complex"),
    ],
)
def test_parse_errors_are_one_line_family_errors(text, culprit):
    with pytest.raises(FamilyError) as info:
        SymbolicFamily.parse(text)
    msg = str(info.value)
    assert "\n" not in msg and culprit in msg


def test_parse_dimension_errors():
    with pytest.raises(FamilyError, match="d = 2"):
        SymbolicFamily.parse("t1*u1 + t2*u2")  # scalar output, d = 2
    with pytest.raises(FamilyError, match="u3"):
        SymbolicFamily.parse("[t1*u3, t2*u1]", d=2)
    with pytest.raises(FamilyError, match="components"):
        SymbolicFamily.parse("[t1*u1, t2*u1]", d=1)
    with pytest.raises(FamilyError, match="neither units"):
        SymbolicFamily(sp.Symbol("z") * sp.Symbol("t1"), (U1,), (sp.Symbol("t1"),))
    with pytest.raises(FamilyError, match="undefined"):
        SymbolicFamily(sp.Function("f")(U1) * sp.Symbol("t1"), (U1,), (sp.Symbol("t1"),))
    with pytest.raises(FamilyError, match="parameter"):
        saturation(S.linear(1), FiniteMeasure([1]), S.linear(1).params[0])  # m contains θ


def test_function_preservation():
    ok, res = is_function_preserving(SymbolicFamily.parse("t1*u1 + 1"))
    assert not ok and res == sp.Matrix([1])
    ok, res = is_function_preserving(SymbolicFamily.parse("t1*u1 + u1**2*cos(t2)"))
    assert not ok and res == sp.Matrix([U1**2])
    ok, res = is_function_preserving(SymbolicFamily.parse("exp(t1*u1) - 1 + sin(t2)*u1"))
    assert ok and res == sp.zeros(1, 1)
    for fam in (S.linear(2), S.polynomial(2, 3), S.product(2, 1), S.elementwise_square_param(2)):
        assert is_function_preserving(fam)[0]


# ----------------------------------------------------------------------------- closed forms
def test_linear_bias_normal_closed_form():
    """h = t1 u + t2, u ~ N(0,1), m = u²: A = (u, 1), b = (E u³, E u²) = (0, 1),
    K = [[E u², E u], [E u, 1]] = I, s² = 1, r² = E u⁴ = 3, ρ² = 1 − s²/r² = 2/3."""
    res = saturation(S.linear(1), [sps.Normal("X", 0, 1)], "u1**2")
    assert res.gradient == sp.Matrix([0, 1])
    assert res.tangent_gram == sp.eye(2)
    assert res.score == 1 and res.score_squared == 1
    assert res.raw_score == sp.sqrt(3)
    assert sp.simplify(res.realizability_defect - sp.sqrt(sp.Rational(2, 3))) == 0
    assert (res.tangent_rank, res.tangent_dim, res.degenerate, res.saturated) == (2, 2, False, False)
    assert res.projection == sp.Matrix([1])  # Π u² = E u² · 1 = 1
    d = res.to_dict(with_gradient=True)
    assert d["gradient"] == [0.0, 1.0] and close(d["raw_score"], math.sqrt(3))
    ev = res.evalf()
    assert isinstance(ev.raw_score, sp.Float) and close(ev.raw_score, math.sqrt(3))
    assert float(res) == 1.0
    # m given with assumption-free symbols is matched to the units by name
    same = saturation(S.linear(1), [sps.Normal("X2", 0, 1)], sp.Symbol("u1") ** 2)
    assert same.gradient == res.gradient and same.score == res.score


def test_linear_nobias_uniform_closed_form():
    """h = t1 u, u ~ U(−1, 1), m = u³: b = E u⁴ = 1/5, K = E u² = 1/3, s² = 3/25,
    r² = E u⁶ = 1/7, ρ² = 1 − (3/25)·7 = 4/25."""
    res = saturation(S.linear(1, bias=False), [sps.Uniform("V", -1, 1)], "u1**3")
    assert res.gradient == sp.Matrix([sp.Rational(1, 5)])
    assert res.tangent_gram == sp.Matrix([[sp.Rational(1, 3)]])
    assert res.score == sp.sqrt(3) / 5
    assert res.raw_score == 1 / sp.sqrt(7)
    assert res.realizability_defect == sp.Rational(2, 5)
    assert res.projection == sp.Matrix([sp.Rational(3, 5) * U1])


def test_saturation_score_raw_score_defect_functions_agree_with_bundle():
    mu = FiniteMeasure([-1, 0, 2], [1, 2, 1])
    fam = S.polynomial(1, 2, bias=False)
    m = "u1**3 + 1"
    res = saturation(fam, mu, m)
    s, s2 = S.saturation_score(fam, mu, m)
    assert (s, s2) == (res.score, res.score_squared)
    assert S.raw_score(fam, mu, m) == res.raw_score
    assert S.realizability_defect(fam, mu, m) == res.realizability_defect
    # by hand: points -1, 0, 2 with probabilities 1/4, 1/2, 1/4; A = (u, u²); m = u³ + 1
    # K = [[5/4, 7/4], [7/4, 17/4]], b = E[(u⁴ + u, u⁵ + u²)] = (17/4 + 1/4, 31/4 + 5/4)
    assert res.tangent_gram == sp.Matrix([[5, 7], [7, 17]]) / 4
    assert res.gradient == sp.Matrix([sp.Rational(9, 2), 9])
    kk = sp.Matrix([[5, 7], [7, 17]]) / 4
    assert res.score_squared == (res.gradient.T * kk.inv() * res.gradient)[0, 0]


def test_product_family_is_degenerate_not_saturated():
    fam = S.product(2, 1)
    assert is_degenerate(fam)
    assert tangent_map(fam) == sp.zeros(2, 4)
    assert tangent_rank(fam) == 0
    res = saturation(fam, [sps.Normal("A", 0, 1), sps.Normal("B", 1, 2)], "[u1, u2**2]")
    assert res.tangent_rank == 0 and res.degenerate and not res.saturated
    assert res.score == 0 and res.raw_score != 0


def test_elementwise_square_param_is_degenerate_and_not_regular():
    base = S.linear(2)
    xi = S.param_symbols(base.p, prefix="x")
    chi = [x**2 for x in xi]
    assert not is_regular_reparameterization(base, chi, xi)
    mu = [sps.Normal("A", 0, 1), sps.Uniform("B", 0, 1)]
    assert not is_regular_reparameterization(base, chi, xi, measure=mu)
    sq = S.elementwise_square_param(2)
    assert is_degenerate(sq)
    assert sq.expr == reparameterize(base, chi, xi).expr
    res = saturation(sq, mu, "[u1, u2]")
    assert res.degenerate and not res.saturated


def test_invertible_linear_reparameterization_keeps_s_and_maps_b():
    """θ = C ξ with invertible C: T4 says s unchanged, b ↦ Cᵀ b, K ↦ Cᵀ K C."""
    fam = S.linear(1)
    xi = sp.symbols("x1 x2", real=True)
    c = sp.Matrix([[2, -1], [3, 5]])
    chi = list(c * sp.Matrix(xi))
    mu = [sps.Uniform("W", 0, 2)]
    m = "u1**2 - u1"
    assert is_regular_reparameterization(fam, chi, xi)
    assert is_regular_reparameterization(fam, chi, xi, measure=mu)
    a = saturation(fam, mu, m)
    b = saturation(reparameterize(fam, chi, xi), mu, m)
    assert b.score == a.score and b.score_squared == a.score_squared
    assert b.gradient == c.T * a.gradient
    assert b.tangent_gram == c.T * a.tangent_gram * c
    assert b.gradient.norm() != a.gradient.norm()  # ‖b‖ is not invariant
    # a rank-deficient C loses a direction: not regular
    c1 = sp.Matrix([[1, 2], [2, 4]])
    assert not is_regular_reparameterization(fam, list(c1 * sp.Matrix(xi)), xi)
    # a nonlinear χ with invertible Dχ(0) is regular too
    assert is_regular_reparameterization(fam, [xi[0] + xi[1] ** 2, sp.sin(xi[1]) - xi[0] ** 3], xi)
    with pytest.raises(FamilyError, match="chi\\(0\\)"):
        reparameterize(fam, [xi[0] + 1, xi[1]], xi)


def test_measure_dependent_rank():
    """On μ = δ_0 the linear family without bias has K = 0 although A = u ≠ 0."""
    fam = S.linear(1, bias=False)
    assert tangent_rank(fam) == 1 and not is_degenerate(fam)
    assert tangent_rank(fam, FiniteMeasure([0])) == 0
    assert saturation(fam, FiniteMeasure([0]), "1").degenerate


def test_rank_deficient_gram_min_norm_coefficients():
    """On the support {0, 1}, u = u², so A = (u, u², 1) spans only 2 dimensions:
    K = [[1,1,1],[1,1,1],[1,1,2]]/2 has rank 2.  v* must be the Moore–Penrose solution
    K⁺b (checked against sympy's pinv), Π m = m for m = 3u + 1 ∈ T, s = r."""
    fam = S.polynomial(1, 2)
    mu = FiniteMeasure([0, 1])
    res = saturation(fam, mu, "3*u1 + 1")
    assert res.tangent_gram == sp.Matrix([[1, 1, 1], [1, 1, 1], [1, 1, 2]]) / 2
    assert res.tangent_rank == 2 and tangent_rank(fam) == 3
    assert res.coefficients == res.tangent_gram.pinv() * res.gradient
    assert res.coefficients == sp.Matrix([sp.Rational(3, 2), sp.Rational(3, 2), 1])
    assert res.score == res.raw_score and res.realizability_defect == 0


def test_odd_construction_is_saturated_but_not_degenerate():
    """Even features (u², 1), odd gradient m = u, symmetric measure (theory label ex-saturated):
    b = (E u³, E u) = 0, so s = 0 (saturated) while r > 0 and ρ = 1 (T6 converse)."""
    fam = SymbolicFamily.parse("t1*u**2 + t2")
    for mu in (FiniteMeasure([-2, -1, 1, 2], [1, 3, 3, 1]), [sps.Normal("Z", 0, 3)]):
        res = saturation(fam, mu, "u")
        assert res.gradient == sp.zeros(2, 1)
        assert res.saturated and not res.degenerate and res.tangent_rank == 2
        assert res.raw_score > 0 and res.realizability_defect == 1


def test_realizable_gradient_gives_s_equal_r():
    """T6: m = 3u − 1 ∈ T = span{u, 1} ⇒ Π m = m, s = r, ρ = 0."""
    res = saturation(S.linear(1), [sps.Uniform("Q", 0, 2)], "3*u1 - 1")
    assert res.projection == sp.Matrix([3 * U1 - 1])
    assert res.score == res.raw_score and res.realizability_defect == 0
    # r² = E(3u − 1)² with u ~ U(0, 2): E u = 1, E u² = 4/3 → 12 − 6 + 1 = 7
    assert res.score_squared == 7


def test_projection_is_an_orthogonal_projector():
    mu = FiniteMeasure([(0, 1), (1, -1), (2, 2), (-1, 0)], [1, 2, 1, 3])
    fam = S.polynomial(2, 2, bias=False)
    m = sp.Matrix([U1 * U2 + 1, U2**3])
    v, pm = projection(fam, mu, m)
    a = tangent_map(fam)
    assert pm == (a * v).applyfunc(sp.expand)
    # idempotent, residual ⟂ T, Pythagoras
    _v2, pm2 = projection(fam, mu, pm)
    assert (pm2 - pm).applyfunc(sp.expand) == sp.zeros(2, 1)
    assert gradient(fam, mu, m - pm) == sp.zeros(fam.p, 1)
    res = saturation(fam, mu, m)
    assert sp.simplify(res.raw_score**2 * (1 - res.realizability_defect**2) - res.score_squared) == 0


def test_zero_output_relu_features_match_cross_gradient_formula():
    """T5 / theory/definitions.md: for h = V φ̃, K = I_d ⊗ Σ (in (vec_row V, c) order after
    permutation) and s² = tr(G Σ⁺ Gᵀ) with G = E[m φ̃ᵀ], Σ = E[φ̃ φ̃ᵀ], both summed
    here by hand over the points."""
    w = [[1, -1], [sp.Rational(1, 2), 2], [0, 1]]
    a = [0, sp.Rational(-1, 3), 1]
    fam = S.random_features(2, 3, "relu", w, a)
    pts, wts = [(0, 1), (1, -1), (2, 3), (-1, 0), (1, 1)], [1, 2, 3, 1, 1]
    mu = FiniteMeasure(pts, wts)
    m = sp.Matrix([U1**2 - U2, U1 * U2 + 1])
    tot = sum(wts)
    sig = sp.zeros(4, 4)
    big_g = sp.zeros(2, 4)
    for (p1, p2), wt in zip(pts, wts, strict=False):
        pre = sp.Matrix(w) * sp.Matrix([p1, p2]) + sp.Matrix(a)
        phi = sp.Matrix([max(0, e) for e in pre] + [1])
        sig += sp.Rational(wt, tot) * phi * phi.T
        big_g += sp.Rational(wt, tot) * m.xreplace({U1: p1, U2: p2}) * phi.T
    s2 = (big_g * sig.pinv() * big_g.T).trace()
    res = saturation(fam, mu, m)
    assert sp.simplify(res.score_squared - s2) == 0
    expect_b = list(big_g[:, :3].reshape(1, 6)) + list(big_g[:, 3])
    assert list(res.gradient) == expect_b
    assert res.tangent_rank == 2 * sig.rank()
    assert res.saturated == (big_g == sp.zeros(2, 4))


# ----------------------------------------------------------------------------- measures
def test_measure_moments_and_mass_convention():
    x, v = sps.Normal("Xm", 1, 2), sps.Uniform("Um", -1, 3)
    mu = S.ProductMeasure([x, v])
    for k in range(6):
        assert sp.simplify(mu.moment(0, k) - sps.E(x**k)) == 0
    # uniform on (−1, 3): E u^k = (3^{k+1} − (−1)^{k+1}) / (4 (k+1))
    for k in range(5):
        assert mu.moment(1, k) == sp.Rational(3 ** (k + 1) - (-1) ** (k + 1), 4 * (k + 1))
    # E[u1² u2 + 3] = (1 + 4)·1 + 3
    assert mu.expect(U1**2 * U2 + 3, (U1, U2)) == 8
    die = S.ProductMeasure([sps.Die("D", 6)], total_mass=2)
    assert die.expect(U1, (U1,)) == 7  # 2 · 7/2
    fin = FiniteMeasure([1, 2], [1, 3], total_mass=sp.Rational(1, 2))
    assert fin.masses == [sp.Rational(1, 8), sp.Rational(3, 8)]
    assert fin.expect(sp.Matrix([U1, U1**2]), (U1,)) == sp.Matrix([sp.Rational(7, 8), sp.Rational(13, 8)])
    assert S.ProductMeasure([sps.Bernoulli("Bm", sp.Rational(1, 3))]).expect(sp.Abs(U1 - 1), (U1,)) == sp.Rational(2, 3)
    # non-polynomial integrand under a normal: sympy.stats fallback, E|Z| = sqrt(2/π)
    assert sp.simplify(S.ProductMeasure([sps.Normal("Zm", 0, 1)]).expect(sp.Abs(U1), (U1,)) - sp.sqrt(2 / sp.pi)) == 0


def test_measure_errors():
    with pytest.raises(MeasureError):
        FiniteMeasure([])
    with pytest.raises(MeasureError):
        FiniteMeasure([1, 2], [1, -1])
    with pytest.raises(MeasureError):
        FiniteMeasure([(1, 2), (3,)])
    with pytest.raises(MeasureError, match="R\\^1"):
        saturation(S.linear(2), [sps.Normal("E1", 0, 1)], "[u1, u2]")
    with pytest.raises(MeasureError):
        S.as_measure("normal")
    with pytest.raises(MeasureError, match="distinct"):
        x = sps.Normal("Rep", 0, 1)
        S.ProductMeasure([x, x])


def test_total_mass_matches_sequence_sites():
    """μ of mass 3 = three units per example: a sequence site with T = 3 tokens whose
    tokens, over the probe, are every support row three times (theory/definitions.md, def-setting)."""
    mu1 = FiniteMeasure([(0, 1), (1, -1), (2, 0)], [1, 2, 1])
    mu3 = FiniteMeasure(mu1.points, [1, 2, 1], total_mass=3)
    fam = S.linear(2)
    m = "[u1**2, u2 - u1]"
    r1, r3 = saturation(fam, mu1, m), saturation(fam, mu3, m)
    assert r3.tangent_gram == 3 * r1.tangent_gram and r3.gradient == 3 * r1.gradient
    assert r3.score_squared == 3 * r1.score_squared
    assert r3.realizability_defect == r1.realizability_defect
    rows = S.replicated_support(mu1)  # 4 rows
    n = rows.shape[0]
    z = np.stack([rows[(np.arange(n) + j) % n] for j in range(3)], axis=1)  # (n, 3, 2)
    g = S.lambdify_units(fam, m)(z.reshape(-1, 2)).reshape(z.shape)
    stats = FeatureStatistics(F.linear(), (3, 2), "sequence", pool_ties=True)
    stats.update(torch.from_numpy(z), torch.from_numpy(g))
    out = stats.result()
    assert close(out.score, r3.score) and close(out.raw_score, r3.raw_score)
    np.testing.assert_allclose(out.gradient, r3.gradient_array(), rtol=0, atol=EXACT_TOL)


# ----------------------------------------------------------------------------- optimizers
def _b_values(p: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    b = g.normal(size=p) * np.exp(g.uniform(-3, 3, size=p))
    b[1] = 0.0  # a zero coordinate: sign-like maps must give 0 there
    return b


def _eval_step(name: str, b: np.ndarray) -> np.ndarray:
    bs = sp.symbols(f"b1:{len(b) + 1}", real=True)
    step = zero_state_step(name, bs)
    return np.array([float(e.xreplace({s: sp.Rational(float(v)) for s, v in zip(bs, b, strict=False)})) for e in step])


_TORCH_EXTRA = {"nadam": torch.optim.NAdam, "adamax": torch.optim.Adamax, "radam": torch.optim.RAdam}


def _torch_first_step(name: str, b: np.ndarray, lr: float = 0.01) -> np.ndarray:
    """One real optimizer step from zero state on a float64 parameter at 0 with grad b.

    The default dtype is float64 during the step: NAdam keeps its ``mu_product`` state
    in the default scalar dtype, which in float32 perturbs the step by ~1e-8.
    """
    old = torch.get_default_dtype()
    torch.set_default_dtype(DT)
    try:
        p = torch.zeros(len(b), dtype=DT, requires_grad=True)
        opt = UPDATES[name].make_optimizer([p], lr) if name in UPDATES else _TORCH_EXTRA[name]([p], lr=lr)
        p.grad = torch.from_numpy(b.copy())
        opt.step()
    finally:
        torch.set_default_dtype(old)
    return (-p.detach() / lr).numpy()


@pytest.mark.parametrize("name", S.SYMBOLIC_UPDATES)
def test_first_step_equals_real_optimizer(name):
    b = _b_values(5, seed=len(name))
    np.testing.assert_allclose(_eval_step(name, b), _torch_first_step(name, b), rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize("name", sorted(UPDATES))
def test_first_step_equals_numeric_map(name):
    b = _b_values(4, seed=7)
    num = UPDATES[name].first_step(torch.from_numpy(b)).numpy()
    np.testing.assert_allclose(_eval_step(name, b), num, rtol=1e-12, atol=1e-300)


_STEPS: dict = {}


@FAST
@given(
    st.sampled_from(S.SYMBOLIC_UPDATES),
    st.lists(
        st.one_of(st.just(0.0), st.floats(-1e3, 1e3, allow_nan=False, allow_subnormal=False)), min_size=3, max_size=3
    ),
)
def test_first_step_equals_real_optimizer_random_gradients(name, b):
    if name not in _STEPS:  # derive once per name (NAdam's derivation takes ~0.5 s)
        bs = sp.symbols("b1:4", real=True)
        _STEPS[name] = (bs, zero_state_step(name, bs))
    bs, step = _STEPS[name]
    rep = {x: sp.Rational(v) for x, v in zip(bs, b, strict=False)}
    sym = np.array([float(e.xreplace(rep)) for e in step])
    np.testing.assert_allclose(sym, _torch_first_step(name, np.array(b)), rtol=1e-12, atol=1e-300)


def test_first_step_closed_forms():
    x = sp.Symbol("b1", real=True)
    eps = sp.Rational(1, 10**8)
    forms = {
        "adam": x / (sp.Abs(x) + eps),
        "adamw": x / (sp.Abs(x) + eps),
        "adamax": x / (sp.Abs(x) + eps),
        "rmsprop": x / (sp.sqrt(sp.Rational(1, 100)) * sp.Abs(x) + eps),
        "adagrad": x / (sp.sqrt(sp.Rational(1, 10) + x**2) + sp.Rational(1, 10**10)),
        "nesterov": sp.Rational(19, 10) * x,
        "momentum": x,
        "sgd": x,
        "radam": x,
        "signsgd": sp.sign(x),
        "lion": sp.sign(x),
    }
    for name, form in forms.items():
        assert sp.simplify(zero_state_step(name, [x])[0] - form) == 0, name
    bs = sp.symbols("b1:6", real=True)
    assert list(zero_state_step("rotation", bs)) == [-bs[1], bs[0], -bs[3], bs[2], 0]
    # symbolic hyperparameters: Adam's ε stays a symbol
    e = sp.Symbol("epsilon", positive=True)
    assert sp.simplify(zero_state_step("adam", [x], {"eps": e})[0] - x / (sp.Abs(x) + e)) == 0
    # NAdam's first step is ≈ 1.0565 × Adam's (theory/definitions.md)
    ratio = zero_state_step("nadam", [sp.Integer(1)])[0] / zero_state_step("adam", [sp.Integer(1)])[0]
    assert abs(float(ratio) - 1.0565) < 5e-5


def test_weight_decay_is_inert_only_at_zero():
    th = sp.symbols("th1:3", real=True)
    bs = sp.symbols("b1:3", real=True)
    eta = sp.Symbol("eta", positive=True)
    for name in ("adamw", "lion", "sgd"):
        hyper = {"weight_decay": sp.Rational(1, 10)}
        moved = S.zero_state_update(name, th, bs, eta, hyper)
        at_zero = S.zero_state_update(name, [0, 0], bs, eta, hyper)
        assert any(e.has(th[0]) for e in moved)  # decay acts away from 0 ...
        plain = S.zero_state_update(name, [0, 0], bs, eta, {"weight_decay": 0})
        assert (at_zero - plain).applyfunc(sp.simplify) == sp.zeros(2, 1)  # ... not at 0


@pytest.mark.parametrize("name", S.SYMBOLIC_UPDATES)
def test_first_order_change_is_minus_b_dot_step(name):
    """F(η) = E<m, h(−η P(b), u)> from a family with second-order terms in θ; its
    derivative at 0⁺ must be −bᵀP(b) (b = E[Aᵀm] = (1, 3) here by hand:
    A = (u, u²), m = u + u², E u² = 1, E u³ = 0, E u⁴ = 3)."""
    fam = SymbolicFamily.parse("t1*u1 + t1**2*u1**3 + t2*t1*u1 + t2*u1**2")
    out = first_order_change(fam, [sps.Normal("Xf", 0, 1)], "u1 + u1**2", name)
    assert out.gradient == sp.Matrix([1, 3])
    assert out.agrees and out.differentiable
    b = np.array([1.0, 3.0])
    expect = -float(b @ _eval_step(name, b))
    assert close(out.derivative, expect, 1e-12)
    if name == "rotation":  # b ≠ 0 yet no first-order change (T3)
        assert out.derivative == 0
    else:
        assert out.derivative < 0


def test_first_order_change_nondifferentiable_family():
    """|θ2| enters h: the directional derivative is not linear in the direction, but the
    actual Adam step has P2 = 0 (b2 = 0), so it still agrees with −bᵀP."""
    fam = SymbolicFamily.parse("t1*u1 + Abs(t2)*u1**2")
    out = first_order_change(fam, [sps.Normal("Xa", 0, 1)], "u1 + u1**2", "adam")
    assert out.agrees and not out.differentiable


@pytest.mark.parametrize("name", S.SYMBOLIC_UPDATES)
def test_descent_compatibility_matches_registry(name):
    expected = UPDATES[name].descent_compatible if name in UPDATES else True
    assert is_descent_compatible(name) is expected


def test_descent_compatibility_takes_the_numeric_engines_arguments():
    """Same arguments as :func:`depthsat_theory.optimizers.is_descent_compatible`: a
    ``ZeroStateUpdate`` (its own hyperparameters), ``hyper`` overrides, keyword ``dim``."""
    import dataclasses

    adam = UPDATES["adam"]
    assert is_descent_compatible(adam) is True
    assert is_descent_compatible(adam, {"eps": sp.Rational(1, 2)}, dim=2) is True
    # a variant instance's hyperparameters are used: P(b) = b / (|b| + eps) at eps = 1/2
    half = dataclasses.replace(adam, eps=0.5)
    b = sp.Symbol("b1", real=True)
    step = zero_state_step("adam", [b], S.default_hyper(half))
    assert sp.simplify(step[0] - b / (sp.Abs(b) + sp.Rational(1, 2))) == 0
    assert is_descent_compatible(UPDATES["rotation"], dim=4) is False
    with pytest.raises(TypeError):
        is_descent_compatible(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no hyperparameter"):
        is_descent_compatible("adam", {"epsilon": 1})


# ----------------------------------------------------------------------------- bridge
def _mixed_family() -> SymbolicFamily:
    t1, t2, t3 = S.param_symbols(3)
    expr = [
        t1 * sp.Max(0, U1 - U2) + t2 * sp.tanh(U2) * sp.sign(U1),
        t3 * sp.Abs(U1)
        + sp.Piecewise((t1 * U2, U2 > 0), (t2 * U1**2, True))
        + sp.sqrt(2) * t2 / 3
        + sp.exp(t3 * U1)
        - 1
        + sp.Heaviside(U1) * t1 * sp.erf(U2),
    ]
    return SymbolicFamily(expr, (U1, U2), (t1, t2, t3), name="mixed")


def test_lambdify_family_matches_substitution():
    fam = _mixed_family()
    g = np.random.default_rng(3)
    theta = g.normal(size=3)
    u = g.normal(size=(7, 2))
    u[0, 0] = 0.0  # sign/Heaviside at 0
    exact = np.array([[float(e) for e in fam.at(theta, row)] for row in u])
    np.testing.assert_allclose(S.lambdify_family(fam, "numpy")(theta, u), exact, rtol=1e-13, atol=1e-15)
    out = S.lambdify_family(fam, "torch")(torch.from_numpy(theta), torch.from_numpy(u))
    assert out.shape == (7, 2) and out.dtype == DT
    np.testing.assert_allclose(out.numpy(), exact, rtol=1e-13, atol=1e-15)
    single = S.lambdify_family(fam, "numpy")(theta, u[1])
    np.testing.assert_allclose(single, exact[1], rtol=1e-13)
    with pytest.raises(FamilyError):
        S.lambdify_family(fam, "numpy")(theta[:2], u)
    with pytest.raises(FamilyError, match="backend"):
        S.lambdify_family(fam, "jax")


def test_general_family_tangent_map_via_torch_func():
    """The wrapped family's torch.func Jacobian at θ = 0 equals the symbolic A(u)."""
    fam = _mixed_family()
    gen = S.to_general_family(fam)
    u = torch.from_numpy(np.random.default_rng(5).normal(size=(6, 2)))
    jac = torch.func.jacrev(lambda th: gen.functional(th, u, "vector"))(torch.zeros(3, dtype=DT))
    a = tangent_map(fam)
    expect = np.array(
        [
            [[float(e) for e in a.xreplace({U1: sp.Rational(r[0]), U2: sp.Rational(r[1])}).row(i)] for i in range(2)]
            for r in u.numpy()
        ]
    )
    np.testing.assert_allclose(jac.numpy(), expect, rtol=1e-13, atol=1e-15)
    # vmapped jvp (what GeneralStatistics does) works on the generated code
    vs = torch.eye(3, dtype=DT)
    cols = torch.func.vmap(lambda v: torch.func.jvp(lambda th: gen.fn(th, u), (torch.zeros(3, dtype=DT),), (v,))[1])(vs)
    np.testing.assert_allclose(cols.permute(1, 2, 0).numpy(), expect, rtol=1e-13, atol=1e-15)


def test_random_features_reproduce_numeric_family_exactly():
    """Feed the numeric relu:3 family's seeded weights into the symbolic factory and
    compare the numeric FeatureStatistics with the exact result on a finite measure."""
    num = F.random_features(3, "relu", seed=4)
    proj = num.frozen_feature_map((2,), "vector").proj
    fam = S.random_features(2, 3, "relu", proj.weight.detach().numpy(), proj.bias.detach().numpy())
    mu = FiniteMeasure([(0, 1), (1, -1), (2, 3), (-1, 0), (1, 1), (-2, -1)], [1, 2, 3, 1, 1, 2])
    m = "[u1**2 - u2, u1*u2 + 1]"
    exact = saturation(fam, mu, m)
    rows = S.replicated_support(mu)
    stats = FeatureStatistics(num, (2,), "vector", pool_ties=True)
    stats.update(torch.from_numpy(rows), torch.from_numpy(S.lambdify_units(fam, m)(rows)))
    out = stats.result()
    _assert_agree(exact, out)
    # tanh features: the compiled symbolic map equals the numeric feature module
    num_t = F.random_features(3, "tanh", seed=2)
    proj_t = num_t.frozen_feature_map((2,), "vector").proj
    fam_t = S.random_features(2, 3, "tanh", proj_t.weight.detach().numpy(), proj_t.bias.detach().numpy())
    z = torch.from_numpy(np.random.default_rng(0).normal(size=(9, 2)))
    theta = torch.from_numpy(np.random.default_rng(1).normal(size=fam_t.p))
    np.testing.assert_allclose(
        S.lambdify_family(fam_t, "torch")(theta, z).numpy(),
        num_t.functional(theta, z, "vector").numpy(),
        rtol=1e-13,
        atol=1e-14,
    )


# ----------------------------------------------------------------------------- numeric agreement
def _assert_agree(exact, out, tol=EXACT_TOL):
    assert out.tangent_rank == exact.tangent_rank
    assert out.tangent_dim == exact.tangent_dim
    assert out.degenerate == exact.degenerate
    assert close(out.score, exact.score, tol)
    np.testing.assert_allclose(out.gradient, exact.gradient_array(), rtol=tol, atol=tol)
    r = float(exact.raw_score)
    assert close(out.raw_score, r, tol)
    if r > 0:
        # compare ‖m − Πm‖² (ρ itself is a square root of a rounding-level number when ρ = 0)
        assert abs((out.realizability_defect * r) ** 2 - float(exact.realizability_defect * r) ** 2) <= tol * max(
            1.0, r * r
        )


@pytest.mark.parametrize(
    "sym, num",
    [
        (lambda: S.linear(2), lambda: F.linear()),
        (lambda: S.linear(2, bias=False), lambda: F.linear(bias=False)),
        (lambda: S.polynomial(2, 2), lambda: F.polynomial(2)),
    ],
)
def test_agreement_with_feature_statistics_on_finite_measure(sym, num):
    mu = FiniteMeasure([(0, 1), (1, -1), (2, 3), (-1, 0), (1, 1)], [1, 2, 3, 1, 1])
    fam, nfam = sym(), num()
    m = "[u1**2 - u2, u1*u2 + 1]"
    exact = saturation(fam, mu, m)
    rows = S.replicated_support(mu)
    z = torch.from_numpy(rows)
    g = torch.from_numpy(S.lambdify_units(fam, m)(rows))
    for stats in (
        FeatureStatistics(nfam, (2,), "vector", pool_ties=True),
        GeneralStatistics(S.to_general_family(fam), (2,), "vector", pool_ties=True),
    ):
        stats.update(z, g)
        _assert_agree(exact, stats.result())
    kmat = np.array(tangent_gram(fam, mu).evalf(20).tolist(), dtype=np.float64)
    gs = GeneralStatistics(S.to_general_family(fam), (2,), "vector")
    gs.update(z, g)
    np.testing.assert_allclose((gs.k_mat / gs.n).numpy(), kmat, rtol=1e-12, atol=1e-12)


def test_product_family_agrees_degenerate():
    mu = FiniteMeasure([(0, 1), (1, -1), (2, 3)], [1, 1, 2])
    exact = saturation(S.product(2, 1), mu, "[u1, u2]")
    rows = S.replicated_support(mu)
    stats = GeneralStatistics(F.product(1), (2,), "vector", pool_ties=True)
    stats.update(torch.from_numpy(rows), torch.from_numpy(rows.copy()))
    out = stats.result()
    assert out.degenerate and exact.degenerate and out.tangent_rank == 0 == exact.tangent_rank
    assert not out.saturated and not exact.saturated


@st.composite
def _random_problem(draw):
    d = draw(st.integers(1, 2))
    p = draw(st.integers(1, 3))
    names = [f"u{i}" for i in range(1, d + 1)]

    def monomial():
        exps = [draw(st.integers(0, 2)) for _ in range(d)]
        return "*".join(f"{n}**{e}" for n, e in zip(names, exps, strict=False) if e) or "1"

    comps = [[] for _ in range(d)]
    for _ in range(draw(st.integers(1, 5))):
        j = draw(st.integers(0, d - 1))
        c = draw(st.sampled_from([-3, -2, -1, 1, 2, 3]))
        k = draw(st.integers(1, p))
        theta = f"t{k}"
        if draw(st.booleans()):  # a second-order term (invisible to the tangent map)
            theta += f"*t{draw(st.integers(1, p))}"
        comps[j].append(f"({c})*{theta}*{monomial()}")
    comps[0].append(f"t{p}*{monomial()}")  # make p the largest index
    text = "[" + ", ".join(" + ".join(c) if c else "0" for c in comps) + "]"
    pts = draw(st.lists(st.tuples(*[st.integers(-3, 3)] * d), min_size=1, max_size=6, unique=True))
    wts = draw(st.lists(st.integers(1, 4), min_size=len(pts), max_size=len(pts)))
    m = [" + ".join(f"({draw(st.integers(-3, 3))})*{monomial()}" for _ in range(2)) for _ in range(d)]
    return text, d, pts, wts, "[" + ", ".join(m) + "]"


@FAST
@given(_random_problem())
def test_agreement_with_general_statistics_random_polynomial_families(problem):
    """Random polynomial families (with second-order θ terms) on random finite measures:
    the numeric torch.func engine and the exact engine agree to 1e-10 whenever the
    scaled Gram's nonzero spectrum has condition number < 1e6 (so the float64 rank
    decision and pseudo-inverse are well posed)."""
    text, d, pts, wts, m = problem
    fam = SymbolicFamily.parse(text, d=d)
    mu = FiniteMeasure(pts, wts)
    exact = saturation(fam, mu, m)
    kf = exact.tangent_gram_array()
    diag = np.diag(kf).copy()
    live = diag > 0
    if live.any():
        sc = kf[np.ix_(live, live)] / np.sqrt(np.outer(diag[live], diag[live]))
        lam = np.linalg.eigvalsh(sc)
        nz = lam[lam > 1e-9 * lam.max()]
        assume(nz.max() / nz.min() < 1e6)
        assume(int((lam > 1e-9 * lam.max()).sum()) == exact.tangent_rank)
    rows = S.replicated_support(mu)
    stats = GeneralStatistics(S.to_general_family(fam), (d,), "vector", pool_ties=True)
    stats.update(torch.from_numpy(rows), torch.from_numpy(S.lambdify_units(fam, m)(rows)))
    _assert_agree(exact, stats.result(), tol=1e-9)
    # invariants of the exact result itself: s ≤ r, and T2's s > 0 ⇔ b ≠ 0
    assert exact.score_squared <= exact.raw_score**2
    assert (exact.score_squared == 0) == all(e == 0 for e in exact.gradient)
    assert exact.degenerate == (exact.tangent_rank == 0)


def _mc_check(fam, nfam, measure, m, n=20000, seed=0):
    """Compare the numeric engine on an n-sample with the exact values: every entry of
    b within 5 standard errors (sample std of A_iᵀm_i / sqrt n), and s within 5 delta-
    method standard errors: ŝ² is a smooth function of the means of A_iᵀm_i and A_iᵀA_i
    with influence q_i = 2 (A_i v)·m_i − |A_i v|², v = K⁻¹b, so SE(ŝ) ≈ std(q)/(2 s sqrt n)."""
    exact = saturation(fam, measure, m)
    z = S.sample(measure, n, seed=seed)
    g = S.lambdify_units(fam, m)(z)
    stats = FeatureStatistics(nfam, (fam.d,), "vector")
    stats.update(torch.from_numpy(z), torch.from_numpy(g))
    out = stats.result()
    amap = S.lambdify_matrix(tangent_map(fam).reshape(fam.d * fam.p, 1), fam.units)(z)
    a = amap.reshape(n, fam.d, fam.p)
    contrib = np.einsum("ndp,nd->np", a, g)
    se_b = contrib.std(axis=0, ddof=1) / math.sqrt(n)
    b = exact.gradient_array()
    assert np.all(np.abs(out.gradient - b) <= 5 * se_b + 1e-12), (out.gradient, b, se_b)
    v = np.linalg.solve(exact.tangent_gram_array(), b)
    av = np.einsum("ndp,p->nd", a, v)
    q = 2 * (av * g).sum(1) - (av * av).sum(1)
    se_s = q.std(ddof=1) / (2 * float(exact.score) * math.sqrt(n))
    assert abs(out.score - float(exact.score)) <= 5 * se_s, (out.score, float(exact.score), se_s)
    return exact


def test_monte_carlo_agreement_normal_polynomial():
    """u ~ N(0,1), h = W(u, u²) + c, m = u³ − u/2 + 1.  By hand: with φ̃ = (u, u², 1),
    b = E[φ̃ m] = (3 − 1/2, 0 + 1, 1) = (5/2, 1, 1), K = [[1,0,0],[0,3,1],[0,1,1]].
    Tolerance: 5 standard errors estimated from the n = 20000 sample (see _mc_check)."""
    exact = _mc_check(S.polynomial(1, 2), F.polynomial(2), [sps.Normal("N1", 0, 1)], "u1**3 - u1/2 + 1")
    assert exact.gradient == sp.Matrix([sp.Rational(5, 2), 1, 1])
    assert exact.tangent_gram == sp.Matrix([[1, 0, 0], [0, 3, 1], [0, 1, 1]])


def test_monte_carlo_agreement_uniform_normal_linear():
    """u1 ~ U(−1, 1), u2 ~ N(1, 1/2) independent, linear family with bias, m = (u1 u2,
    u2² − u1).  Tolerance: 5 sample standard errors, n = 20000 (see _mc_check)."""
    exact = _mc_check(
        S.linear(2),
        F.linear(),
        [sps.Uniform("U1", -1, 1), sps.Normal("N2", 1, sp.Rational(1, 2))],
        "[u1*u2, u2**2 - u1]",
        seed=1,
    )
    # b for W[0, :] = E[u1 · u1 u2], E[u2 · u1 u2] = (1/3 · 1, 0)
    assert exact.gradient[0] == sp.Rational(1, 3) and exact.gradient[1] == 0


def test_sample_and_supports():
    mu = FiniteMeasure([(0, 1), (2, 3)], [1, 3])
    pts, masses = S.finite_support(mu)
    np.testing.assert_array_equal(pts, [[0, 1], [2, 3]])
    np.testing.assert_allclose(masses, [0.25, 0.75])
    rows = S.replicated_support(mu)
    assert rows.shape == (4, 2) and (rows[:, 0] == 2).sum() == 3
    z = S.sample(mu, 4000, seed=0)
    assert z.shape == (4000, 2) and abs((z[:, 0] == 2).mean() - 0.75) < 0.03
    zt = S.sample([sps.Normal("Ns", 2, 3), sps.Die("Ds", 4)], 5000, seed=1, backend="torch")
    assert zt.dtype == DT and abs(float(zt[:, 0].mean()) - 2) < 0.2
    assert set(np.unique(zt[:, 1].numpy())) <= {1.0, 2.0, 3.0, 4.0}
    with pytest.raises(MeasureError):
        S.finite_support([sps.Normal("Nf", 0, 1)])
    die2 = S.finite_support([sps.Die("Da", 2), sps.Die("Db", 2)])
    assert die2[0].shape == (4, 2) and np.isclose(die2[1].sum(), 1.0)
