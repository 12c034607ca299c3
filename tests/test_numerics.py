"""The numerical error model and the four-outcome verdict (theory/numerics.md), against exact truth.

Every verdict reproducer is here with its truth computed
independently: the exact score of the stored arrays in rational arithmetic
(:func:`proofs_checks.t8_numerics.exact_score`, Fraction Gauss–Jordan, no engine code), or a
closed form, or a dense numpy reference of the U-statistic.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from depthsat_theory import parse_family
from depthsat_theory.cli import app
from depthsat_theory.families import GeneralFamily
from depthsat_theory.statistics import statistics_for
from depthsat_theory.vocabulary import Verdict
from proofs_checks.t8_numerics import collinear_signal, exact_score, near_threshold_probe


def _result(z, g, family="linear", *, pool_ties=False, layout="vector"):
    stats = statistics_for(parse_family(family), tuple(z.shape[1:]), layout, pool_ties=pool_ties)
    stats.update(z, g)
    return stats.result()


def test_small_real_direction_is_kept_in_float32():
    """Reproducer 1: a float32 direction of amplitude ~1e-4 is resolvable; the site is improvable (exact s = 1)."""
    z, g = collinear_signal(1e-4, torch.float32)
    truth = exact_score(z.double().numpy(), g.double().numpy())
    res = _result(z, g)
    assert truth == pytest.approx(res.ag_rms, rel=1e-6)  # g ∈ T exactly up to float32 storage of g
    assert res.tangent_rank == res.tangent_dim == 6
    assert abs(res.score - truth) <= res.score_error
    assert res.verdict is Verdict.IMPROVABLE and res.probe_verdict is Verdict.IMPROVABLE
    assert res.score > 0.99 * truth  # the old Gram cutoff reported 5e-5


def test_score_cli_reports_the_error_model_fields(tmp_path):
    z, g = collinear_signal(1e-4, torch.float32)
    path = tmp_path / "p.npz"
    np.savez(path, z=z.numpy(), g=g.numpy())
    out = CliRunner().invoke(app, ["score", "--probe", str(path), "--family", "linear", "--json"])
    assert out.exit_code == 0, out.output
    rep = json.loads(out.output)
    assert rep["verdict"] == "improvable" and rep["dtype"] == "float32"
    for key in ("score_error", "score_squared_unbiased", "score_squared_se", "noise_ratio", "verdict_reason"):
        assert rep[key] is not None, key
    assert rep["score"] > rep["score_error"]


@pytest.mark.parametrize("eps", [1e-2, 2e-6])
def test_exactly_cancelling_pairs_are_saturated_with_a_conditioning_aware_bound(eps):
    """Reproducer 2: G = 0 exactly (pairs with equal z, opposite g); nearly collinear float64 features."""
    z, g, _ = near_threshold_probe(np.random.default_rng(3), eps, 500, torch.float64)
    assert exact_score(z.numpy(), g.numpy()) == 0.0
    res = _result(z, g, pool_ties=True)
    assert res.verdict is Verdict.SATURATED and res.saturated
    assert res.raw_score == 0.0 and res.score <= res.raw_score  # the chain s ≤ r̂ holds in the output
    plain = _result(z, g)
    assert plain.verdict is Verdict.SATURATED and plain.score <= plain.score_error
    assert plain.score_error > 1e3 * torch.finfo(torch.float64).eps * plain.ag_rms or eps > 1e-3


def test_planted_signal_three_times_the_bound_is_improvable():
    """Just above the threshold: exact s = 3 e (rational truth) must be improvable (kills a 1000× tolerance)."""
    z, g, v = near_threshold_probe(np.random.default_rng(5), 1e-3, 200, torch.float64)
    base = _result(z, g)
    vv = np.stack([v, v], 1) / np.sqrt(np.mean(2 * v * v))
    g2 = g + torch.from_numpy(3 * base.score_error * vv)
    truth = exact_score(z.numpy(), g2.numpy())
    res = _result(z, g2)
    assert truth > 2 * res.score_error
    assert res.probe_verdict is Verdict.IMPROVABLE
    assert abs(res.score - truth) <= res.score_error


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_uses_its_own_rounding(dtype):
    """Reproducer 3: a least-squares-saturated site stored in half precision is saturated, dtype reported."""
    rng = np.random.default_rng(1)
    n = 400
    z64 = rng.standard_normal((n, 3))
    design = np.concatenate([z64, np.ones((n, 1))], 1)
    y = rng.standard_normal((n, 3))
    resid = y - design @ np.linalg.lstsq(design, y, rcond=None)[0]  # ⟂ [z, 1]: saturated in exact arithmetic
    z, g = torch.from_numpy(z64).to(dtype), torch.from_numpy(resid).to(dtype)
    res = _result(z, g)
    assert res.dtype == str(dtype).replace("torch.", "")
    assert res.verdict is Verdict.SATURATED
    strong = _result(z, torch.from_numpy(resid + 0.5 * z64).to(dtype))
    assert strong.verdict is Verdict.IMPROVABLE


def test_plug_in_noise_is_undetermined_and_says_what_would_decide():
    """Reproducer 4: g independent of z at d = 512, n = 100 (units ≤ k̃: ŝ = AG_rms exactly)."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(100, 512, generator=gen)
    g = torch.randn(100, 512, generator=gen)
    res = _result(z, g)
    assert res.score == pytest.approx(res.ag_rms, rel=1e-6)  # projection onto the sample's own span
    assert res.noise_variance == pytest.approx(res.n * res.score**2, rel=1e-6)  # every leverage is n
    assert res.probe_verdict is Verdict.IMPROVABLE and res.verdict is Verdict.UNDETERMINED
    assert "noise test" in res.verdict_reason


def test_u_statistic_matches_a_dense_pairwise_reference():
    """``ŝ²_U = (1/(n(n−1))) Σ_{i≠j} (g_i·g_j)(φ̃_iᵀ Σ̂⁻¹ φ̃_j)`` computed pair by pair in numpy."""
    rng = np.random.default_rng(2)
    n, d = 60, 3
    z = rng.standard_normal((n, d))
    g = 0.4 * z[:, ::-1] + rng.standard_normal((n, d))
    res = _result(torch.from_numpy(z), torch.from_numpy(g))
    phi = np.concatenate([z, np.ones((n, 1))], 1)
    sinv = np.linalg.inv(phi.T @ phi / n)
    lev = phi @ sinv @ phi.T
    gg = g @ g.T
    pair = gg * lev
    u = (pair.sum() - np.trace(pair)) / (n * (n - 1))
    v = np.trace(pair) / n
    assert res.score_squared_unbiased == pytest.approx(u, rel=1e-9)
    assert res.noise_variance == pytest.approx(v, rel=1e-9)
    assert res.noise_ratio == pytest.approx(n * res.score**2 / v, rel=1e-9)


def test_sequence_noise_moment_matches_a_dense_reference():
    """Token units: ``v̂ = (1/n) Σ_x tr(X_x Σ̂⁻¹ X_xᵀ)`` with ``X_x = Σ_t g_t φ̃_tᵀ``."""
    rng = np.random.default_rng(4)
    n, t, d = 12, 5, 3
    z, g = rng.standard_normal((n, t, d)), rng.standard_normal((n, t, d))
    res = _result(torch.from_numpy(z), torch.from_numpy(g), layout="sequence")
    phi = np.concatenate([z, np.ones((n, t, 1))], 2)
    sig = np.einsum("xtk,xtl->kl", phi, phi) / n
    xs = np.einsum("xtd,xtk->xdk", g, phi)
    v = np.mean([np.trace(x @ np.linalg.inv(sig) @ x.T) for x in xs])
    assert res.noise_variance == pytest.approx(v, rel=1e-9)


def test_general_family_noise_moment_matches_per_example_jacobians():
    """General families: ``v̂ = (1/n) Σ_x b_xᵀ K⁻ b_x`` with ``b_x`` from a dense per-example Jacobian."""
    fam = GeneralFamily(lambda th, u: th[: u.shape[-1]] * torch.tanh(u) + th[u.shape[-1] :] * u**2, lambda d: 2 * d)
    rng = np.random.default_rng(6)
    n, d = 20, 3
    z, g = torch.from_numpy(rng.standard_normal((n, d))), torch.from_numpy(rng.standard_normal((n, d)))
    stats = statistics_for(fam, (d,), "vector")
    stats.update(z, g)
    res = stats.result()
    p = fam.param_dim((d,))
    theta0 = torch.zeros(p, dtype=torch.float64)
    jac = torch.stack(
        [torch.func.jacrev(lambda th, zi=zi: fam.functional(th, zi[None], "vector").reshape(-1))(theta0) for zi in z]
    )  # (n, d, p)
    b = torch.einsum("xdp,xd->xp", jac, g).numpy()
    k = torch.einsum("xdp,xdq->pq", jac, jac).numpy() / n
    v = np.mean([bi @ np.linalg.pinv(k) @ bi for bi in b])
    assert res.noise_variance == pytest.approx(v, rel=1e-8)


def test_verdict_reason_names_each_outcome():
    zero = _result(torch.zeros(8, 2, dtype=torch.float64), torch.ones(8, 2, dtype=torch.float64), "linear-nobias")
    assert zero.verdict is Verdict.DEGENERATE and "rank K = 0" in zero.verdict_reason
    # no kept direction: Σ⁻ = 0, so v̂ = tr(Σ⁻ E[XᵀX]) = 0 exactly (and the noise ratio with it)
    assert (zero.tangent_rank, zero.noise_variance, zero.noise_ratio) == (0, 0.0, 0.0)
    z, g = collinear_signal(1e-1, torch.float64, n=200)
    assert "exceeds" in _result(z, g).verdict_reason
    assert math.isfinite(_result(z, g).score_error)


def test_improvable_reason_states_what_the_noise_level_promises():
    """rem-noise-test-level: the reason of "improvable" gives the statistic against χ²₁ at 0.95 (3.841…, scipy)
    and says the level is asymptotic, measured only at α = 0.05 for symmetric g without atoms, and what certifies."""
    from dataclasses import replace

    from scipy.stats import chi2

    z, g = collinear_signal(1e-1, torch.float64, n=200)
    res = _result(z, g)
    assert res.verdict is Verdict.IMPROVABLE
    reason = res.verdict_reason
    assert f"n ŝ²/v̂ = {res.noise_ratio:.3g} > {chi2.ppf(0.95, 1):.3g}" in reason, reason
    for needle in (
        "level α = 0.05 as n grows",
        "at this n only measured, at α = 0.05, for symmetric g without atoms",
        "rem-noise-test-level",
        "--delta with --grad-max and --leverage-max",
    ):
        assert needle in reason, reason
    bare = replace(res, noise_ratio=float("nan"))  # no noise statistic streamed: no claim about it
    assert bare.verdict is Verdict.IMPROVABLE
    assert bare.verdict_reason.endswith("(no noise test: v̂ not streamed)") and "level" not in bare.verdict_reason


def _paired(z: np.ndarray, rng: np.random.Generator, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every unit twice with opposite ``g``, shuffled: the cross-gradient of *any* family vanishes exactly."""
    g0 = rng.standard_normal(z.shape)
    zz = np.repeat(z, 2, axis=0)
    gg = np.stack([g0, -g0], 1).reshape(zz.shape)
    perm = rng.permutation(zz.shape[0])  # partners apart: the float64 sums do not cancel term by term
    return torch.from_numpy(zz[perm]).to(dtype), torch.from_numpy(gg[perm]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    ("family", "make_z"),
    [
        ("preln:2", lambda r: r.standard_normal((300, 2))),  # LayerNorm of d = 2: features ±1
        ("linear", lambda r: np.stack([r.standard_normal(300) + 1e4, r.standard_normal(300)], 1)),  # mean offset
        ("relu:32", lambda r: r.standard_normal((300, 4)) * np.array([1.0, 1e-3, 1.0, 1e3])),
        ("tanh:12", lambda r: r.standard_normal((300, 1))),  # nearly dependent smooth features
        ("linear", lambda r: np.stack([r.standard_normal(300)] * 2, 1) + np.array([0.0, 2e-6])),  # nearly collinear
    ],
)
def test_exactly_zero_cross_gradient_is_never_improvable(family, make_z, dtype):
    """Pairs with equal z and opposite g: exact s = 0 for every family; the verdict may not say improvable."""
    rng = np.random.default_rng(11)
    z, g = _paired(make_z(rng), rng, dtype)
    res = _result(z, g, family)
    assert res.probe_verdict in (Verdict.SATURATED, Verdict.UNDETERMINED, Verdict.DEGENERATE), (res.score, res.tol)
    assert res.verdict is not Verdict.IMPROVABLE


@pytest.mark.parametrize(
    "make_z",
    [
        lambda r: np.stack([r.standard_normal(400) + 1e4, r.standard_normal(400)], 1),  # a large mean offset
        lambda r: np.stack([r.standard_normal(400)] * 2, 1) + np.array([0.0, 2e-6]) * r.standard_normal((400, 1)),
    ],
    ids=["mean-offset", "nearly-collinear"],
)
def test_least_squares_residual_is_saturated_within_its_exact_score(make_z):
    """Reproducer 2: ``g`` the float64 least-squares residual on ``[z, 1]``; exact s of the stored arrays ≈ 1e-17."""
    rng = np.random.default_rng(12)
    z = make_z(rng)
    design = np.concatenate([z, np.ones((z.shape[0], 1))], 1)
    y = rng.standard_normal(z.shape)
    g = y - design @ np.linalg.lstsq(design, y, rcond=None)[0]
    truth = exact_score(z, g)
    res = _result(torch.from_numpy(z), torch.from_numpy(g))
    assert truth <= 1e-9 * res.ag_rms
    assert abs(res.score - truth) <= res.score_error
    assert res.verdict is Verdict.SATURATED


def test_score_cli_alpha_and_matrix_bound_options(tmp_path):
    z, g = collinear_signal(1e-4, torch.float32)
    path = tmp_path / "p.npz"
    np.savez(path, z=z.numpy(), g=g.numpy())
    run = CliRunner().invoke
    bad = run(app, ["score", "--probe", str(path), "--family", "linear", "--alpha", "0.5"])
    assert bad.exit_code == 2 and "--alpha" in bad.output
    lone = run(app, ["score", "--probe", str(path), "--family", "linear", "--matrix-bound", "empirical-bernstein"])
    assert lone.exit_code == 2 and "--matrix-bound needs --delta" in lone.output
    args = ["score", "--probe", str(path), "--family", "linear", "--delta", "0.05", "--bootstrap", "0", "--json"]
    out = run(app, [*args, "--matrix-bound", "empirical-bernstein", "--alpha", "0.01"])
    rep = json.loads(out.output)
    assert rep["matrix_bound"] == "empirical-bernstein" and rep["alpha"] == 0.01
    from scipy.stats import chi2

    assert rep["noise_threshold"] == pytest.approx(chi2.ppf(0.99, 1), rel=1e-12)
    assert rep["score_lower"] <= rep["score"] <= rep["score_upper"]


# ----------------------------------------------------------------------------- found by the adversarial check
def test_dropped_direction_carrying_gradient_is_not_saturated():
    """powers:2 on float16 activations of mean 10: x² is nearly collinear with (x, 1); g = centred x² ∈ T."""
    torch.manual_seed(0)
    z = (torch.randn(200, 1, dtype=torch.float64) + 10.0).half()
    xs = z.double() - z.double().mean()
    g = (xs**2 - (xs**2).mean()).half()
    res = _result(z, g, "powers:2")
    assert res.probe_verdict is not Verdict.SATURATED and res.unresolved >= 1


def test_vacuous_rounding_bound_is_undetermined():
    """float64 z₂ = z₁ + 1e-14 w with g along the small direction (exact s = AG_rms): not 'saturated'."""
    z, g = collinear_signal(1e-14, torch.float64, n=200)
    res = _result(z, g)
    truth = exact_score(z.numpy(), g.numpy())
    assert truth == pytest.approx(res.ag_rms, rel=1e-3)
    assert res.probe_verdict is not Verdict.SATURATED


def test_systematic_summation_error_is_within_the_bound():
    """A constructed sum whose float64 rounding is systematic (N = 16386 rows): exact s = 0, never improvable."""
    m = 2**13
    eps = 2.0 ** (int(math.log2(m)) - 1 - 52)
    g = np.concatenate([np.full(m, 1 + 0.75 * eps), np.full(m, -(1 + 0.25 * eps)), [-(m * 0.5 * eps) / 2] * 2])
    z = np.ones_like(g)
    z[1::2] = -1.0
    assert exact_score(z[:, None], g[:, None]) == 0.0
    res = _result(torch.from_numpy(z[:, None]), torch.from_numpy(g[:, None]))
    assert res.probe_verdict is not Verdict.IMPROVABLE and abs(res.score) <= res.score_error


def test_extreme_scales_are_one_line_errors_or_finite():
    from depthsat_theory.statistics import StatisticsError

    x = torch.randn(50, 1, dtype=torch.float64)
    with pytest.raises(StatisticsError, match="underflow"):
        _result(x * 1e-170, x)
    with pytest.raises(StatisticsError, match="underflow"):
        _result(x, x * 1e-161)
    big = _result(torch.randn(10, 3, dtype=torch.float64), torch.randn(10, 3, dtype=torch.float64) * 1e77)
    assert math.isfinite(big.score) and math.isfinite(big.score_squared_se)


def _lstsq_score(rows: np.ndarray, g_rows: np.ndarray, n_examples: int, rcond: float) -> float:
    """``‖Π g‖`` on the probe measure by a float64 numpy SVD fit of ``g`` on ``[rows, 1]`` (no engine code)."""
    design = np.concatenate([rows, np.ones((rows.shape[0], 1))], 1)
    u, sv, _ = np.linalg.svd(design, full_matrices=False)
    keep = sv > rcond * sv[0]
    fit = u[:, keep] @ (u[:, keep].T @ g_rows)
    return float(np.sqrt((fit * fit).sum() / n_examples))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_post_layernorm_site_has_exactly_the_layernorm_dependency(dtype):
    """Reproducer (MiniLM layer 0 reported rank 383 of 384 under the old Gram cutoff).

    A post-LN row ``y = γ ⊙ x̂ + β`` satisfies ``Σ_i (y_i − β_i)/γ_i = 0`` exactly, so ``[y, 1]`` has
    rank ``d`` and the linear tangent space has dimension ``d²`` (of ``p = d(d+1)``); without the
    LayerNorm the rank is full. The score matches a float64 SVD fit that drops only that dependency.
    """
    d, n = 12, 600
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64) * torch.linspace(0.2, 3.0, d, dtype=torch.float64)
    ln = torch.nn.LayerNorm(d, dtype=torch.float64)
    with torch.no_grad():
        ln.weight.copy_(torch.rand(d, generator=gen, dtype=torch.float64) + 0.5)
        ln.bias.copy_(torch.randn(d, generator=gen, dtype=torch.float64))
        y = ln(x)
    g = torch.tanh(y @ torch.randn(d, d, generator=gen, dtype=torch.float64)) + 0.3 * torch.randn(n, d, generator=gen)
    z, g = y.to(dtype), g.to(dtype)
    res = _result(z, g)
    assert res.tangent_dim == d * (d + 1) and res.tangent_rank == d * d
    ref = _lstsq_score(z.double().numpy(), g.double().numpy(), n, rcond=1e-5)
    assert abs(res.score - ref) <= res.score_error
    ctrl = _result(x.to(dtype), g)
    assert ctrl.tangent_rank == d * (d + 1)


class _Bottleneck(torch.nn.Module):
    """A ResNet bottleneck block (1×1 reduce, 3×3, 1×1 expand, batch norm, identity skip)."""

    def __init__(self, c: int, mid: int):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(c, mid, 1, bias=False),
            torch.nn.BatchNorm2d(mid),
            torch.nn.ReLU(),
            torch.nn.Conv2d(mid, mid, 3, padding=1, bias=False),
            torch.nn.BatchNorm2d(mid),
            torch.nn.ReLU(),
            torch.nn.Conv2d(mid, c, 1, bias=False),
            torch.nn.BatchNorm2d(c),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


def test_bottleneck_resnet_site_matches_a_float64_least_squares_fit():
    """Reproducer (a Bottleneck ResNet site scored 6% low): a float32 bottleneck site after ReLU.

    Truth: the float64 SVD fit of the site's activation gradient on its pixel rows (plus the bias
    column) with a cutoff far below the float32 data resolution's effect on the score.
    """
    torch.manual_seed(0)
    c = 16
    net = torch.nn.Sequential(torch.nn.Conv2d(3, c, 3, padding=1), _Bottleneck(c, 4), _Bottleneck(c, 4))
    head = torch.nn.Sequential(torch.nn.Conv2d(c, 5, 1), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    net.eval()
    x, t = torch.randn(48, 3, 6, 6), torch.randint(0, 5, (48,))
    z = net(x).detach().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(head(z), t, reduction="sum")
    (g,) = torch.autograd.grad(loss, z)
    stats = statistics_for(parse_family("conv1x1"), tuple(z.shape[1:]), "image")
    stats.update(z.detach(), g)
    res = stats.result()
    rows = z.detach().double().permute(0, 2, 3, 1).reshape(-1, c).numpy()
    g_rows = g.double().permute(0, 2, 3, 1).reshape(-1, c).numpy()
    ref = _lstsq_score(rows, g_rows, x.shape[0], rcond=1e-5)
    assert res.ag_rms == pytest.approx(float(np.sqrt((g_rows**2).sum() / x.shape[0])), rel=1e-6)
    assert res.tangent_rank == c * (c + 1)
    assert abs(res.score - ref) <= res.score_error + 1e-6 * ref


# ----------------------------------------------------------------------------- float32 batch products
def _stats32(z, g, family="linear", batch=None):
    stats = statistics_for(parse_family(family), tuple(z.shape[1:]), "vector", products="float32")
    step = batch or z.shape[0]
    for i in range(0, z.shape[0], step):
        stats.update(z[i : i + step], g[i : i + step])
    return stats


def test_float32_products_systematic_rounding_is_within_the_bound():
    """A float32 batch sum whose rounding is systematic (N = 16386 rows): exact s = 0, never improvable.

    The float32 analogue of :func:`test_systematic_summation_error_is_within_the_bound`: partial sums
    near ``m/2`` have an ulp of ``2^(12−23)``, so the ``±(1 + c 2^-12)`` terms lose their low bits
    one way; the exact score of the stored float32 arrays is 0 (rational arithmetic).  Without the
    ``L₃₂ u₃₂`` term the float64-products bound is about 1e9 times too small for this sum.
    """
    m = 2**13
    eps = 2.0 ** (int(math.log2(m)) - 1 - 23)
    g = np.concatenate([np.full(m, 1 + 0.75 * eps), np.full(m, -(1 + 0.25 * eps)), [-(m * 0.5 * eps) / 2] * 2])
    z = np.ones_like(g)
    z[1::2] = -1.0
    z32, g32 = torch.from_numpy(z[:, None]).float(), torch.from_numpy(g[:, None]).float()
    assert np.array_equal(g32.double().numpy()[:, 0], g)  # stored exactly in float32
    assert exact_score(z[:, None], g[:, None]) == 0.0
    res = _stats32(z32, g32).result()
    assert res.probe_verdict is not Verdict.IMPROVABLE and abs(res.score) <= res.score_error
    assert res.score_error >= 1e-8 * res.ag_rms  # the L₃₂ u₃₂ = 16386 · 2⁻²⁴ term is there


@pytest.mark.parametrize("eps", [1e-1, 1e-2])
def test_float32_products_near_threshold_bound_holds_against_exact_truth(eps):
    """Near-threshold probes (planted signal ``c·v`` on exactly cancelling pairs), float32 products.

    Truth: the exact score of the stored arrays (rational arithmetic); for each planted size the
    computed ``ŝ`` is within the float32-products bound, which is never below the float64-products
    bound on the same arrays, and ``Σ``, ``G`` agree entrywise with a numpy float64 reference
    within ``γ_acc`` times the sums of absolute products.
    """
    rng = np.random.default_rng(5)
    z, g0, v = near_threshold_probe(rng, eps, 200, torch.float32)
    for c in (0.0, 1e-5, 1e-3, 1e-1):
        g = (g0.double() + c * torch.from_numpy(np.stack([v, v], 1))).float()
        truth = exact_score(z.double().numpy(), g.double().numpy())
        stats = _stats32(z, g, batch=100)
        res = stats.result()
        assert abs(res.score - truth) <= res.score_error, (c, res.score, truth, res.score_error)
        assert res.score_error >= _result(z, g).score_error
        phi = np.concatenate([z.double().numpy(), np.ones((z.shape[0], 1))], 1)
        gamma = 100 * 2.0**-24 + (100 + 4) * 2.0**-53
        sig_ref, abs_sig = phi.T @ phi, np.abs(phi).T @ np.abs(phi)
        cross_ref, abs_cross = g.double().numpy().T @ phi, np.abs(g.double().numpy()).T @ np.abs(phi)
        assert np.all(np.abs(stats.sigma.numpy() - sig_ref) <= gamma * abs_sig)
        assert np.all(np.abs(stats.cross.numpy() - cross_ref) <= gamma * abs_cross)


def test_float32_products_agree_with_float64_products_on_a_wide_family():
    """``relu:192`` (block-triangular Σ update, k̃ = 193): float32 and float64 products, same ``ŝ`` within both bounds.

    The float64-products statistics' ``Σ`` also equals a dense numpy ``ΦᵀΦ`` of the family's own
    features to float64 rounding (the block split changes no entry's sum).
    """
    fam = parse_family("relu:192:0")
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(600, 8, generator=gen)
    g = torch.tanh(z @ torch.randn(8, 8, generator=gen)) / 30
    exact = statistics_for(fam, (8,), "vector")
    fast = statistics_for(fam, (8,), "vector", products="float32")
    for i in range(0, 600, 200):
        exact.update(z[i : i + 200], g[i : i + 200])
        fast.update(z[i : i + 200], g[i : i + 200])
    phi = fam.augmented_features(fam.frozen_feature_map((8,), "vector"), z.double()).reshape(600, -1).numpy()
    np.testing.assert_allclose(exact.sigma.numpy(), phi.T @ phi, rtol=1e-12, atol=1e-12 * np.abs(phi).max() ** 2)
    assert np.array_equal(exact.sigma.numpy(), exact.sigma.numpy().T)
    r64, r32 = exact.result(), fast.result()
    assert abs(r64.score - r32.score) <= r64.score_error + r32.score_error
    assert r32.score_error > r64.score_error and r32.verdict in (r64.verdict, Verdict.UNDETERMINED)


def test_unknown_products_dtype_is_a_one_line_error():
    from depthsat_theory.families import FeatureFamily
    from depthsat_theory.statistics import FeatureStatistics, StatisticsError

    fam = parse_family("linear")
    assert isinstance(fam, FeatureFamily)
    with pytest.raises(StatisticsError, match="products='float16'"):
        FeatureStatistics(fam, (3,), "vector", products="float16")


def _tiny_direction_probe(eta: float, *, orthogonal: bool, n: int = 400, d: int = 8, seed: int = 0):
    """float32 ``z`` with ``z₂ = z₁ + η w`` (amplitude η below the float32 data resolution, above the float64
    Gram's) and ``g`` along ``w`` made orthogonal to the other features; ``orthogonal`` also to ``z₂ − z₁``."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, d))
    w = rng.standard_normal(n)
    z[:, 1] = z[:, 0] + eta * w
    zz = z.astype(np.float32).astype(np.float64)
    cols = [zz[:, [0, *range(2, d)]], np.ones((n, 1))] + ([zz[:, [1]] - zz[:, [0]]] if orthogonal else [])
    design = np.concatenate(cols, 1)
    wr = w - design @ np.linalg.lstsq(design, w, rcond=None)[0]
    g = np.zeros((n, d))
    g[:, 0] = wr
    return torch.from_numpy(zz.astype(np.float32)), torch.from_numpy(g.astype(np.float32))


@pytest.mark.parametrize("eta", [3e-7, 1e-6])
def test_a_real_direction_below_the_data_resolution_is_never_grounds_for_saturated(eta):
    """A feature direction of relative amplitude η (5–17 u32) that carries the whole activation gradient:
    the exact score of the stored arrays is ≈ AG_rms, so "saturated" would be false; the direction is
    dropped by the data resolution, its gradient passes the noise test, so it is unresolved. With ``g``
    also orthogonal to that direction (exact score ≈ 0) the site is saturated."""
    z, g = _tiny_direction_probe(eta, orthogonal=False)
    truth = exact_score(z.double().numpy(), g.double().numpy())
    res = _result(z, g)
    assert truth > 0.5 * res.ag_rms and res.tangent_rank < res.tangent_dim
    assert res.unresolved >= 1 and res.verdict is not Verdict.SATURATED
    assert res.probe_verdict is not Verdict.SATURATED
    z, g = _tiny_direction_probe(eta, orthogonal=True)
    truth = exact_score(z.double().numpy(), g.double().numpy())
    res = _result(z, g)
    assert truth <= res.score_error and res.verdict is Verdict.SATURATED


def test_bfloat16_tie_pooling_equals_an_exact_pooling_of_the_same_values():
    """bfloat16 units pool (no raw TypeError from numpy): r̂ exactly, ρ̂ against a dense numpy projection.

    Units repeat (with ``-0.0`` and ``0.0`` as one unit) and every value is dyadic, so the bfloat16 values are
    the intended ones and ``r̂² = Σ_u c_u ‖m̂_u‖² / n`` is exact in ``Fraction`` arithmetic.
    """
    from fractions import Fraction

    rng = np.random.default_rng(7)
    base = np.array([[0.5, -1.0], [1.5, 2.0], [0.0, 0.25], [-3.0, 0.75], [2.0, -0.5]])
    pick = rng.integers(0, len(base), 60)
    z64 = base[pick].copy()
    z64[pick == 2, 0] = np.where(rng.random((pick == 2).sum()) < 0.5, -0.0, 0.0)  # −0.0 and 0.0: one unit
    g64 = rng.integers(-8, 9, (60, 2)) / 4.0  # dyadic, exact in bfloat16
    z, g = torch.from_numpy(z64).to(torch.bfloat16), torch.from_numpy(g64).to(torch.bfloat16)
    assert torch.equal(z.double(), torch.from_numpy(z64)) and torch.equal(g.double(), torch.from_numpy(g64))
    res = _result(z, g, pool_ties=True)
    groups: dict[tuple, list] = {}
    for zr, gr in zip(z64.tolist(), g64.tolist(), strict=True):
        groups.setdefault(tuple(v + 0.0 for v in zr), []).append([Fraction(v) for v in gr])
    assert len(groups) == len(base)
    r2 = sum(sum(sum(col) ** 2 for col in zip(*rows, strict=True)) / len(rows) for rows in groups.values()) / 60
    assert res.raw_score == pytest.approx(float(r2) ** 0.5, rel=1e-12)
    # ρ̂ = ‖m̂ − Π m̂‖/‖m̂‖ with Π g(u) = G Σ⁺ [u, 1] (linear family with bias), dense in float64
    phi = np.concatenate([z64, np.ones((60, 1))], 1)
    proj = (g64.T @ phi / 60) @ np.linalg.pinv(phi.T @ phi / 60)
    defect2 = 0.0
    for unit, rows in groups.items():
        mean = np.array([[float(v) for v in r] for r in rows]).mean(0)
        defect2 += len(rows) * float(np.sum((mean - proj @ np.array([*unit, 1.0])) ** 2)) / 60
    assert res.realizability_defect == pytest.approx(defect2**0.5 / float(r2) ** 0.5, rel=1e-9)


def test_bfloat16_model_diagnoses_with_realizability():
    """``diagnose(..., realizability=True)`` (``diagnose --rho``) on a bfloat16 model: r̂ as the float32 model's."""
    from depthsat_theory.diagnose import diagnose

    def run(dtype):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Identity(), torch.nn.Linear(4, 2))
        with torch.no_grad():  # dyadic weights and inputs: the bfloat16 and float32 forwards agree exactly
            for p in net.parameters():
                p.copy_(torch.round(p * 4) / 4)
        net = net.to(dtype)
        x = (torch.arange(24, dtype=torch.float64).reshape(8, 3) % 5 / 2).to(dtype)
        y = torch.tensor([0, 1] * 4)
        loss = torch.nn.CrossEntropyLoss(reduction="none")
        return diagnose(net, lambda out, t: loss(out.float(), t), [(x, y)], sites=["1"], realizability=True)

    low, ref = run(torch.bfloat16)["1"].result, run(torch.float32)["1"].result
    assert math.isfinite(low.raw_score) and low.dtype == "bfloat16"
    assert low.raw_score == pytest.approx(ref.raw_score, rel=0.05)


def _constant_feature_result(g: np.ndarray):
    """The linear family without a bias on ``z ≡ 1``: the noise ratio is ``(Σ g)²/Σ g²``."""
    stats = statistics_for(parse_family("linear-nobias"), (1,), "vector")
    stats.update(torch.ones(g.size, 1, dtype=torch.float64), torch.from_numpy(g[:, None]))
    return stats.result()


@pytest.mark.parametrize("n", [4, 5, 8])
def test_noise_level_rademacher_on_a_constant_feature_by_exact_enumeration(n):
    """prop-noise-test-constant-feature (2): every one of the 2ⁿ sign vectors is a probe; the engine's rate
    of "improvable" is exactly ``#{signs : (Σ g)² > χ²₁,₀.₉₅ n}/2ⁿ`` — ``1/8`` at ``n = 4`` (the two constant
    sign vectors, ratio 4 > 3.84), ``1/16`` at ``n = 5``, ``18/256`` at ``n = 8`` — above ``α``: this lattice
    law is outside the domain of rem-noise-test-level."""
    import itertools
    from fractions import Fraction

    from scipy.stats import chi2

    from proofs_checks.t8_numerics import in_noise_domain

    c = chi2.ppf(0.95, 1)
    hits = 0
    for signs in itertools.product((-1.0, 1.0), repeat=n):
        g = np.array(signs)
        res = _constant_feature_result(g)
        assert res.noise_ratio == pytest.approx(g.sum() ** 2 / n, rel=1e-12, abs=1e-300)
        assert (res.verdict is Verdict.IMPROVABLE) == (g.sum() ** 2 > c * n)
        hits += res.verdict is Verdict.IMPROVABLE
    # by hand: (2k − n)² > c n holds for k ∈ {0, n} at n = 4, 5 and for k ∈ {0, 1, 7, 8} at n = 8
    assert Fraction(hits, 2**n) == {4: Fraction(1, 8), 5: Fraction(1, 16), 8: Fraction(18, 256)}[n]
    assert hits / 2**n > 0.05 and not in_noise_domain(False, "constant", "rademacher")


def test_noise_level_gaussian_on_a_constant_feature_holds_at_every_n():
    """prop-noise-test-constant-feature (1): the engine's ratio is ``T² = (Σ g)²/Σ g²`` and its verdict is
    "improvable" iff ``T² > χ²₁,₀.₉₅``; with Student's ``t² = (n−1)T²/(n−T²)`` the rate is
    ``P(|t_{n−1}| > √((n−1)c/(n−c)))``, at most ``α`` for every ``n`` from 2 to 20000 at ``α`` = 0.05 and 0.01
    (tending to ``α``), above it at ``α = 0.1`` (so the finite-``n`` claim is made at 0.05 only); the closed
    form agrees with 20000 simulated probes at ``n = 10``."""
    from scipy.stats import chi2
    from scipy.stats import t as student

    from proofs_checks.t8_numerics import in_noise_domain

    c = chi2.ppf(0.95, 1)
    rng = np.random.default_rng(7)
    for n in (4, 10, 57):
        g = rng.standard_normal(n)
        res = _constant_feature_result(g)
        t2 = g.sum() ** 2 / (g * g).sum()
        assert res.noise_ratio == pytest.approx(t2, rel=1e-12)
        tt = math.sqrt(n) * g.mean() / g.std(ddof=1)
        assert tt * tt == pytest.approx((n - 1) * t2 / (n - t2), rel=1e-10)
        assert (res.verdict is Verdict.IMPROVABLE) == (t2 > c)

    def rate(n: np.ndarray, cc: float) -> np.ndarray:
        m = n[n > cc].astype(np.float64)
        out = np.zeros(n.shape)
        out[n > cc] = 2 * student.sf(np.sqrt((m - 1) * cc / (m - cc)), m - 1)
        return out

    ns = np.arange(2, 20_001)
    for alpha in (0.05, 0.01):
        r = rate(ns, chi2.ppf(1 - alpha, 1))
        assert r.max() <= alpha and r[-1] > 0.999 * alpha
    assert (rate(ns[ns >= 13], chi2.ppf(0.9, 1)) > 0.1).all()
    sims = rng.standard_normal((20_000, 10))
    emp = ((sims.sum(1) ** 2 / (sims**2).sum(1)) > c).mean()
    exact = float(rate(np.array([10]), c)[0])
    assert abs(emp - exact) < 4 * math.sqrt(exact * (1 - exact) / 20_000)
    assert in_noise_domain(False, "constant", "gaussian") and in_noise_domain(True, "gaussian", "exponential")
