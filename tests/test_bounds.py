"""Finite-sample bounds (``depthsat_theory.bounds``, theory/finite-sample.md).

Expected values are derived independently of the library: the U-statistic by enumerating
every i.i.d. sample of a tiny population, the interval and the estimates by numpy
recomputation of the theorem's formulas, the sample sizes by ``scipy.optimize.brentq``
on a separately coded half-width, coverage by Monte Carlo on finite populations with the
exact score.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from typer.testing import CliRunner

from depthsat_theory.bounds import (
    BoundError,
    BoundStatistics,
    ProbeMoments,
    SequentialCertifier,
    ag_rms_upper,
    bootstrap_interval,
    estimate,
    interval_from_moments,
    interval_from_probe,
    plan_bound,
    required_n,
    spending,
    unbiased_score_squared,
)
from depthsat_theory.cli import app
from depthsat_theory.families import FamilyError, parse_family
from depthsat_theory.statistics import FeatureStatistics
from depthsat_theory.vocabulary import Certificate, Verdict

runner = CliRunner()


def _population(n_pop=200, d=2, signal=0.0, seed=0):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n_pop, d))
    phi = np.hstack([z, np.ones((n_pop, 1))])
    raw = np.tanh(2 * z) + rng.normal(size=(n_pop, d))
    g = raw - phi @ np.linalg.lstsq(phi, raw, rcond=None)[0]  # G = 0 on the population
    if signal:
        g = g + signal * np.tanh(z @ rng.normal(size=(d, d)))
    return phi, g


def _exact(phi, g):
    """Population s, γ, L and v by direct numpy (pinv of the population Gram)."""
    n = phi.shape[0]
    sig = phi.T @ phi / n
    big_g = g.T @ phi / n
    sp = np.linalg.pinv(sig)
    s = math.sqrt(max(float(np.trace(big_g @ sp @ big_g.T)), 0.0))
    lev = np.einsum("ik,kl,il->i", phi, sp, phi)
    gn = np.linalg.norm(g, axis=1)
    return s, float(gn.max()), float(lev.max()), float(np.mean(gn**2 * lev)), sp


# ----------------------------------------------------------------------------- input checks
@pytest.mark.parametrize("delta", [0, 1, -0.1, 1.5, float("nan"), None, "0.1"])
def test_bad_delta(delta):
    phi, g = _population()
    with pytest.raises(BoundError, match="delta"):
        interval_from_moments(ProbeMoments.from_arrays(phi, g), delta)
    with pytest.raises(BoundError, match="delta"):
        plan_bound(delta=delta, n=10, grad_max=1.0, leverage_max=2.0)


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(n=0), "positive integer"),
        (dict(n=-3), "positive integer"),
        (dict(n=2.5), "positive integer"),
        (dict(n=10, grad_max=None), "missing constant grad_max"),
        (dict(n=10, leverage_max=None), "missing constant leverage_max"),
        (dict(n=10, grad_max=-1.0), ">= 0"),
        (dict(n=10, leverage_max=0.0), "> 0"),
        (dict(n=10, variance=float("nan")), "NaN"),
        (dict(n=10, variance=float("inf")), "finite"),
        (dict(n=10, ridge=-0.1), ">= 0"),
        (dict(n=10, leverage_max=None, feature_norm_max=2.0), "only together"),
        (dict(n=10, leverage_max=None, feature_norm_max=2.0, ridge=0.5), "missing constant dim"),
        (dict(n=10, epsilon=0.1), "exactly one"),
        (dict(n=None, epsilon=-0.1), "must be > 0"),
        (dict(n=10, candidates=0), "positive integer"),
    ],
)
def test_bad_constants(kw, needle):
    base = dict(delta=0.1, grad_max=1.0, leverage_max=2.0)
    base.update(kw)
    with pytest.raises(BoundError, match=needle):
        plan_bound(**base)


# ----------------------------------------------------------------------------- estimates
def test_u_statistic_exactly_unbiased_by_enumeration():
    """Over all N^n ordered i.i.d. samples: E U = s², E ŝ² = s² + (v − s²)/n (fixed whitening)."""
    rng = np.random.default_rng(3)
    n_pop, n = 4, 3
    phi = np.hstack([rng.normal(size=(n_pop, 2)), np.ones((n_pop, 1))])
    g = rng.normal(size=(n_pop, 2)) + 0.7 * phi[:, :2]
    s, _, _, v, sp = _exact(phi, g)
    us, sq = [], []
    for idx in itertools.product(range(n_pop), repeat=n):
        m = ProbeMoments.from_arrays(phi, g, np.bincount(idx, minlength=n_pop), keep=False)
        us.append(unbiased_score_squared(m, whitening=sp))
        big_g = g[list(idx)].T @ phi[list(idx)] / n  # Ĝ of this sample, by direct numpy
        sq.append(float(np.trace(big_g @ sp @ big_g.T)))
    assert np.mean(us) == pytest.approx(s**2, rel=1e-12, abs=1e-14)
    assert np.mean(sq) == pytest.approx(s**2 + (v - s**2) / n, rel=1e-12)
    assert np.mean(sq) > s**2 + 1e-3  # the plug-in square is biased upward


def test_streaming_statistics_match_numpy():
    """BoundStatistics over batches: ŝ, v̂ and the leverage equal a direct numpy computation."""
    rng = np.random.default_rng(1)
    z = rng.normal(size=(90, 3))
    g = rng.normal(size=(90, 3)) + z
    fam = parse_family("linear")
    st = BoundStatistics(fam, (3,), "vector", keep_probe=True)
    ref = FeatureStatistics(fam, (3,), "vector")
    for lo in range(0, 90, 25):
        st.update(torch.from_numpy(z[lo : lo + 25]), torch.from_numpy(g[lo : lo + 25]))
        ref.update(torch.from_numpy(z[lo : lo + 25]), torch.from_numpy(g[lo : lo + 25]))
    m = st.moments()
    est = estimate(m, 0.0)
    phi = np.hstack([z, np.ones((90, 1))])
    sp = np.linalg.pinv(phi.T @ phi / 90)
    lev = np.einsum("ik,kl,il->i", phi, sp, phi)
    assert math.sqrt(est.s2) == pytest.approx(ref.result().score, rel=1e-10)
    assert est.v_hat == pytest.approx(np.mean((g**2).sum(1) * lev), rel=1e-10)
    assert est.lev_max == pytest.approx(lev.max(), rel=1e-10)
    assert lev.mean() == pytest.approx(4.0, rel=1e-10)  # mean leverage = rank Σ̂
    streamed = BoundStatistics(fam, (3,), "vector")  # rows not kept: leverage is an upper estimate
    streamed.update(torch.from_numpy(z), torch.from_numpy(g))
    assert estimate(streamed.moments(), 0.0).lev_max >= lev.max() * (1 - 1e-12)
    # ridge: s_λ² = tr(Ĝ (Σ̂ + λI)⁻¹ Ĝᵀ) ≤ ŝ²
    lam = 0.3
    big_g = g.T @ phi / 90
    s_lam = math.sqrt(np.trace(big_g @ np.linalg.inv(phi.T @ phi / 90 + lam * np.eye(4)) @ big_g.T))
    assert math.sqrt(estimate(m, lam).s2) == pytest.approx(s_lam, rel=1e-10)
    assert s_lam < ref.result().score


def test_interval_matches_theorem_formulas():
    """Lower/upper, ε_n and Δ_n recomputed from the theorem's formulas with user constants."""
    phi, g = _population(signal=0.8)
    _s_true, gam, big_l, _v, _ = _exact(phi, g)
    w = np.random.default_rng(5).multinomial(5000, np.full(phi.shape[0], 1 / phi.shape[0]))
    m = ProbeMoments.from_arrays(phi, g, w)
    delta, var = 0.05, 7.5
    it = interval_from_moments(m, delta, grad_max=gam, leverage_max=big_l, variance=var, dim=3)
    sig = (phi * w[:, None]).T @ phi / 5000
    big_g = (g * w[:, None]).T @ phi / 5000
    s_hat = math.sqrt(np.trace(big_g @ np.linalg.pinv(sig) @ big_g.T))
    d1 = delta / 2
    u1, u2 = math.log(2 / d1), math.log(2 * 3 / d1)
    dev = math.sqrt(2 * big_l * u2 / 5000) + 2 * big_l * u2 / 15000
    eps = math.sqrt(2 * var * u1 / 5000) + 2 * gam * math.sqrt(big_l) * u1 / 5000
    assert it.score == pytest.approx(s_hat, rel=1e-10)
    assert it.relative_deviation == pytest.approx(dev, rel=1e-12)
    assert it.epsilon_n == pytest.approx(eps, rel=1e-12)
    assert it.score_lower == pytest.approx(max(0.0, s_hat * math.sqrt(1 - dev) - eps), rel=1e-10)
    assert it.score_upper == pytest.approx(min(s_hat * math.sqrt(1 + dev) + eps, gam), rel=1e-10)
    assert it.guaranteed and it.constants["grad_max"].source == "user"
    assert it.constants["variance"].source == "user"
    plug = interval_from_moments(m, delta)
    assert not plug.guaranteed and plug.constants["grad_max"].source == "probe"
    assert plug.constants["variance"].source == "probe"
    assert "lower bound of the essential supremum" in plug.constants["grad_max"].note


def test_calculator_agrees_with_interval_and_round_trips():
    phi, g = _population(signal=0.5)
    _, gam, big_l, _, _ = _exact(phi, g)
    m = ProbeMoments.from_arrays(phi, g, np.full(phi.shape[0], 20))  # n = 4000
    kw = dict(grad_max=gam, leverage_max=big_l, variance=3.0, dim=3)
    it = interval_from_moments(m, 0.1, **kw)
    plan = plan_bound(delta=0.1, n=m.n, **kw)
    assert plan.epsilon_n == pytest.approx(it.epsilon_n, rel=1e-12)
    assert plan.relative_deviation == pytest.approx(it.relative_deviation, rel=1e-12)
    # the interval's width is what the deviation form allows at s ≤ S
    assert it.score_upper - it.score <= plan.halfwidth * (1 + 1e-12)
    back = plan_bound(delta=0.1, epsilon=plan.halfwidth, **kw)
    assert back.n_required == m.n  # h_n is strictly decreasing: n is the smallest size reaching h_n
    assert required_n(plan.halfwidth, 0.1, **kw) == back.n_required


def _h(n, var, r, u1, l1, u2, smax):
    dev = math.sqrt(2 * l1 * u2 / n) + 2 * l1 * u2 / (3 * n)
    if dev >= 1:
        return math.inf
    return (math.sqrt(2 * var * u1 / n) + 2 * r * u1 / n + smax * dev) / math.sqrt(1 - dev)


@pytest.mark.parametrize("seed", range(6))
def test_sympy_sample_size_matches_root_finding(seed):
    rng = np.random.default_rng(seed)
    gam, big_l = rng.uniform(0.1, 10), rng.uniform(1, 400)
    var, delta, smax = rng.uniform(0.01, 30), rng.uniform(0.01, 0.3), rng.uniform(0, 2)
    target = rng.uniform(0.005, 0.5)
    plan = plan_bound(delta=delta, epsilon=target, grad_max=gam, leverage_max=big_l, variance=var, score_max=smax)
    u1 = math.log(4 / delta)
    u2 = math.log(4 * math.floor(big_l) / delta)  # D = ⌊L⌋ by default when λ = 0 (rank is an integer)
    r = gam * math.sqrt(big_l)
    args = (var, r, u1, big_l, u2, smax)
    lo = brentq(lambda x: math.sqrt(2 * big_l * u2 / x) + 2 * big_l * u2 / (3 * x) - 1, 1e-6, 1e12)
    hi = lo * 2
    while _h(hi, *args) > target:
        hi *= 2
    root = brentq(lambda x: _h(x, *args) - target, lo * (1 + 1e-12), hi, xtol=1e-10, rtol=1e-15)
    assert plan.n_required == math.ceil(root - 1e-7)
    assert _h(plan.n_required, *args) <= target < _h(plan.n_required - 1, *args)
    assert plan.n_nonvacuous == math.floor(lo) + 1
    root_e = brentq(lambda x: math.sqrt(2 * var * u1 / x) + 2 * r * u1 / x - target, 1e-9, 1e16, xtol=1e-12, rtol=1e-15)
    assert plan.n_epsilon_only == math.ceil(root_e - 1e-7)
    # the closed form sympy derived, written by hand: n = (a + sqrt(a² + 4bE))² / (4E²)
    a, b = math.sqrt(2 * var * u1), 2 * r * u1
    assert root_e == pytest.approx((a + math.sqrt(a * a + 4 * b * target)) ** 2 / (4 * target**2), rel=1e-9)


# ----------------------------------------------------------------------------- coverage
def test_coverage_on_small_finite_populations():
    """Exact population constants: coverage ≥ 1 − δ − 3 SE; no false certificates beyond δ."""
    delta, reps = 0.2, 150
    floor = 1 - delta - 3 * math.sqrt(delta * (1 - delta) / reps)
    rng = np.random.default_rng(11)
    for signal in (0.0, 0.6):
        phi, g = _population(n_pop=150, signal=signal, seed=2)
        s_true, gam, big_l, _, _ = _exact(phi, g)
        hits = wrong = 0
        for _ in range(reps):
            w = rng.multinomial(3000, np.full(150, 1 / 150))
            it = interval_from_moments(
                ProbeMoments.from_arrays(phi, g, w, keep=False),
                delta,
                grad_max=gam,
                leverage_max=big_l,
                epsilon=0.5 * max(s_true, 0.2),
            )
            hits += it.score_lower <= s_true <= it.score_upper
            wrong += (it.certificate == Certificate.IMPROVABLE and signal == 0.0) or (
                it.certificate == Certificate.SATURATED and signal > 0
            )
        assert hits / reps >= floor
        assert wrong / reps <= 1 - floor


def test_ag_rms_upper_bound_formula_and_coverage():
    gam, n, delta = 2.0, 500, 0.1
    u = math.log(1 / delta)
    c = math.sqrt(2 * gam**2 * u / n)
    e = 0.8**2 + 2 * gam**2 * u / (3 * n)
    assert ag_rms_upper(n, 0.8, gam, delta) == pytest.approx(0.5 * (c + math.sqrt(c * c + 4 * e)))
    rng = np.random.default_rng(0)
    norms = rng.uniform(0, gam, size=1000)
    pop_rms = math.sqrt(np.mean(norms**2))
    hits = sum(
        ag_rms_upper(n, math.sqrt(np.mean(rng.choice(norms, n) ** 2)), gam, delta) >= pop_rms for _ in range(200)
    )
    assert hits / 200 >= 1 - delta - 3 * math.sqrt(delta * (1 - delta) / 200)
    with pytest.raises(BoundError, match="grad_max"):
        ag_rms_upper(n, 0.8, -1.0, delta)


def test_bootstrap_labelled_and_needs_rows():
    phi, g = _population(signal=0.5)
    m = ProbeMoments.from_arrays(phi, g, keep=False)
    with pytest.raises(BoundError, match="in memory"):
        bootstrap_interval(m, 0.1)
    b = bootstrap_interval(ProbeMoments.from_arrays(phi, g), 0.1, resamples=30)
    assert "not a guarantee" in b["label"] and 0 <= b["lower"] <= b["upper"]
    it = interval_from_moments(ProbeMoments.from_arrays(phi, g), 0.1, bootstrap=30)
    assert it.looseness == pytest.approx(
        (it.score_upper - it.score_lower) / (it.bootstrap_interval["upper"] - it.bootstrap_interval["lower"])
    )


def test_sequential_certifier_levels_and_decision():
    assert sum(spending(j, 0.1) for j in range(1, 100000)) == pytest.approx(0.1, rel=1e-4)
    rng = np.random.default_rng(4)
    fam = parse_family("linear")
    cert = SequentialCertifier(
        0.1, epsilon=0.05, family=fam, shape=(2,), layout="vector", grad_max=6.0, leverage_max=40.0
    )
    sizes = []
    while cert.decision is None and len(cert.history) < 12:
        z = rng.normal(size=(250 * 2 ** len(cert.history), 2))
        g = 0.8 * z + 0.3 * rng.normal(size=z.shape)  # strongly improvable: g ∈ T plus noise
        step = cert.update(torch.from_numpy(z), torch.from_numpy(np.clip(g, -3, 3)))
        sizes.append(step.n)
        assert step.delta == pytest.approx(spending(len(cert.history), 0.1))
    assert cert.decision == Certificate.IMPROVABLE and cert.stopped_at == sizes[-1]
    assert sizes == sorted(sizes)


# ----------------------------------------------------------------------------- CLI
def _probe(tmp_path, n=400, seed=0):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, 3))
    g = 0.5 * np.tanh(z) + rng.normal(size=(n, 3))
    path = tmp_path / "probe.npz"
    np.savez(path, z=z, g=g)
    return path


def test_score_delta_adds_interval_keys(tmp_path):
    path = _probe(tmp_path, n=3000)
    res = runner.invoke(
        app,
        [
            "score",
            "--probe",
            str(path),
            "--family",
            "linear",
            "--json",
            "--delta",
            "0.1",
            "--epsilon",
            "0.05",
            "--grad-max",
            "10",
            "--leverage-max",
            "20",
            "--bootstrap",
            "20",
        ],
    )  # probe's max leverage ≈ 18
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    for key in (
        "score_lower",
        "score_upper",
        "certificate",
        "assumptions",
        "constants",
        "score_squared_unbiased",
        "bootstrap_interval",
        "looseness",
        "score",
    ):
        assert key in out
    assert out["score_lower"] <= out["score"] <= out["score_upper"]
    assert out["certificate"] in ("certified improvable", "certified ε-saturated", "not certified")
    assert out["constants"]["grad_max"]["source"] == "user"
    assert out["constants"]["variance"]["source"] == "probe"  # empirical Bernstein
    assert out["vacuous"] is False and out["guaranteed"] is True
    assert out["certificate"] == "certified improvable"  # s ≈ 0.2 with n = 3000
    assert "not a guarantee" in out["bootstrap_interval"]["label"]
    plain = json.loads(runner.invoke(app, ["score", "--probe", str(path), "--family", "linear", "--json"]).stdout)
    assert "score_lower" not in plain and plain["score"] == out["score"]
    # --delta adds the certificate beside the verdict's fields, never over them: every field of
    # the plain output (verdict, ŝ², ŝ²_U, ...) reads the same with --delta.
    assert {k: out[k] for k in plain} == plain
    assert "bound_score_squared_unbiased" in out


def test_bound_command_round_trip():
    common = ["--delta", "0.05", "--grad-max", "3", "--leverage-max", "20", "--variance", "2", "--json"]
    fwd = runner.invoke(app, ["bound", "--n", "30000", *common])
    assert fwd.exit_code == 0, fwd.output
    h = json.loads(fwd.stdout)["halfwidth"]
    back = runner.invoke(app, ["bound", "--epsilon", repr(h), *common])
    out = json.loads(back.stdout)
    assert out["n_required"] in (29999, 30000) and out["halfwidth"] <= h * (1 + 1e-12)
    assert out["constants"]["leverage_max"]["source"] == "user"


@pytest.mark.parametrize(
    "args,needle",
    [
        (["bound", "--n", "10", "--delta", "0", "--grad-max", "1", "--leverage-max", "2"], "(0, 1)"),
        (["bound", "--n", "10", "--delta", "1.5", "--grad-max", "1", "--leverage-max", "2"], "(0, 1)"),
        (["bound", "--n", "0", "--delta", "0.1", "--grad-max", "1", "--leverage-max", "2"], "positive integer"),
        (["bound", "--n", "10", "--delta", "0.1", "--leverage-max", "2"], "missing constant --grad-max"),
        (["bound", "--n", "10", "--delta", "0.1", "--grad-max", "1"], "missing constant --leverage-max"),
        (["bound", "--n", "10", "--delta", "0.1", "--grad-max", "-1", "--leverage-max", "2"], ">= 0"),
        (["bound", "--n", "10", "--delta", "0.1", "--grad-max", "nan", "--leverage-max", "2"], "NaN"),
        (["score", "--family", "linear", "--delta", "1"], "(0, 1)"),
        (["score", "--family", "linear", "--delta", "0.1", "--leverage-max", "-2"], "> 0"),
        (["score", "--family", "product:2", "--delta", "0.1"], "feature family"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, needle):
    if args[0] == "score":
        args = [*args, "--probe", str(_probe(tmp_path, n=30))]
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], res.stderr


def test_bad_delta_subprocess_one_line():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "depthsat_theory.cli",
            "bound",
            "--n",
            "5",
            "--delta",
            "-0.5",
            "--grad-max",
            "1",
            "--leverage-max",
            "2",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --delta must be in (0, 1)")


def test_bound_statistics_padding_mask_matches_unpadded_examples():
    """Padded rows enter no moment: a masked batch equals its examples fed unpadded.

    Independent expectation: each example's real rows as its own (1, T_i, d) sequence,
    merged; ``g`` is zero at the padded positions.
    """
    from depthsat_theory.bounds import BoundStatistics
    from depthsat_theory.families import parse_family

    gen = torch.Generator().manual_seed(5)
    lengths = [4, 1, 3]
    B, T, d = len(lengths), max(lengths), 2
    z = torch.randn(B, T, d, generator=gen, dtype=torch.float64)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    g = torch.randn(B, T, d, generator=gen, dtype=torch.float64) * mask[..., None]
    fam = parse_family("relu:3:2")
    masked = BoundStatistics(fam, (T, d), "sequence")
    masked.update(z, g, mask=mask)
    parts = []
    for i, t in enumerate(lengths):
        acc = BoundStatistics(fam, (t, d), "sequence")
        acc.update(z[i : i + 1, :t], g[i : i + 1, :t])
        parts.append(acc)
    np.testing.assert_allclose(masked.q_sum, sum(p.q_sum for p in parts), atol=1e-12)
    assert masked.feat_sq_max == pytest.approx(max(p.feat_sq_max for p in parts), rel=1e-12)
    np.testing.assert_allclose(masked.sigma.numpy(), sum(p.sigma.numpy() for p in parts), atol=1e-12)


# ----------------------------------------------------------------------------- constants vs the probe
def _user_probe(tmp_path, n=2000, rows=None):
    """The reported probe: g = 0.1 tanh(z A) + noise; AG_max ≈ 0.29, max leverage ≈ 28, rank 9."""
    r = np.random.default_rng(0)
    z = r.standard_normal((2000, 8))
    g = 0.1 * np.tanh(z @ r.standard_normal((8, 8))) + 0.01 * r.standard_normal((2000, 8))
    z, g = z[:n], g[:n]
    path = tmp_path / "user_probe.npz"
    np.savez(path, z=z, g=g)
    return path, z, g


def _one_line_error(res, *needles):
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "extra,needles",
    [
        (
            ["--grad-max", "0.01", "--leverage-max", "30"],
            ["--grad-max 0.01 is below the probe's own max ‖g(x)‖_F = 0.29", "not an almost-sure bound"],
        ),
        (["--grad-max", "1", "--leverage-max", "1"], ["--leverage-max 1 is below", "rank Σ̂ = 9"]),
        (["--grad-max", "1", "--leverage-max", "10"], ["--leverage-max 10 is below", "max leverage"]),
        (
            ["--grad-max", "1", "--feature-norm-max", "1", "--eig-floor", "0.5"],
            ["--feature-norm-max 1 is below the probe's own max"],
        ),
    ],
)
def test_score_rejects_constants_the_probe_contradicts(tmp_path, extra, needles):
    path, _z, _g = _user_probe(tmp_path)
    res = runner.invoke(
        app,
        [
            "score",
            "--probe",
            str(path),
            "--family",
            "linear",
            "--delta",
            "0.05",
            "--epsilon",
            "0.1",
            "--bootstrap",
            "0",
            "--json",
            *extra,
        ],
    )
    _one_line_error(res, *needles)


def test_score_accepts_constants_above_the_probe_maxima(tmp_path):
    path, _z, g = _user_probe(tmp_path)
    gmax = float(np.linalg.norm(g, axis=1).max())
    res = runner.invoke(
        app,
        [
            "score",
            "--probe",
            str(path),
            "--family",
            "linear",
            "--delta",
            "0.05",
            "--grad-max",
            repr(gmax),
            "--leverage-max",
            "30",
            "--bootstrap",
            "0",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["guaranteed"] is True and out["score_lower"] <= out["score"] <= out["score_upper"]
    assert out["score_upper"] <= gmax * (1 + 1e-12)


def test_probe_tension_notes_for_variance_eig_floor_and_leverage():
    """V below v̂, μ above Σ̂'s smallest nonzero eigenvalue, L in (ℓ̂_max(1 − Δ_n), ℓ̂_max): notes only."""
    phi, g = _population(signal=0.5)
    m = ProbeMoments.from_arrays(phi, g, np.full(phi.shape[0], 50))  # n = 10000
    est = estimate(m, 0.0)
    lam_min = float(np.linalg.eigvalsh(m.sigma).min())
    gam = float(np.linalg.norm(g, axis=1).max())
    it = interval_from_moments(
        m,
        0.1,
        grad_max=gam,
        leverage_max=est.lev_max * 0.99,
        variance=0.5 * est.v_hat,
        eig_floor=2 * lam_min,
        ridge=0.0,
    )
    text = " | ".join(it.notes)
    assert "--variance" in text and "plug-in v̂" in text  # notes keep the CLI spelling
    assert "--eig-floor" in text and "smallest nonzero eigenvalue" in text
    assert "largest leverage" in text
    clean = interval_from_moments(
        m, 0.1, grad_max=gam, leverage_max=est.lev_max, variance=2 * est.v_hat, eig_floor=0.5 * lam_min
    )
    assert clean.notes == []
    with pytest.raises(BoundError, match="max leverage"):  # far below ℓ̂_max: contradiction
        interval_from_moments(m, 0.1, grad_max=gam, leverage_max=0.5 * est.lev_max)
    with pytest.raises(BoundError, match=r"^dim=2 is below the probe's rank"):
        interval_from_moments(m, 0.1, grad_max=gam, leverage_max=est.lev_max, dim=2)


def test_inverted_interval_is_refused():
    """With the probe maximum tampered (so the γ check passes), γ below ŝ would invert the interval."""
    phi, g = _population(signal=0.8)
    m = ProbeMoments.from_arrays(phi, g, np.full(phi.shape[0], 50))
    _, _gam, big_l, _, _ = _exact(phi, g)
    s_hat = math.sqrt(estimate(m, 0.0).s2)
    m.g_max = 0.1 * s_hat
    with pytest.raises(BoundError, match="inconsistent constants"):
        interval_from_moments(m, 0.05, grad_max=0.2 * s_hat, leverage_max=big_l)


@pytest.mark.parametrize(
    "extra,flag",
    [
        (["--grad-max", "1"], "--grad-max needs --delta"),
        (["--epsilon", "0.1"], "--epsilon needs --delta"),
        (["--leverage-max", "3"], "--leverage-max needs --delta"),
        (["--feature-norm-max", "3"], "--feature-norm-max needs --delta"),
        (["--eig-floor", "1"], "--eig-floor needs --delta"),
        (["--ridge", "0.5"], "--ridge needs --delta"),
        (["--variance", "1"], "--variance needs --delta"),
        (["--candidates", "3"], "--candidates needs --delta"),
        (["--bootstrap", "0"], "--bootstrap needs --delta"),
        (["--grad-max", "1", "--epsilon", "0.1"], "--epsilon and --grad-max need --delta"),
    ],
)
def test_score_bound_options_need_delta(tmp_path, extra, flag):
    res = runner.invoke(app, ["score", "--probe", str(_probe(tmp_path, n=30)), "--family", "linear", *extra])
    _one_line_error(res, flag, "only apply to the interval")


@pytest.mark.parametrize("cmd", ["bound", "score"])
def test_leverage_and_feature_norm_not_both(tmp_path, cmd):
    both = ["--leverage-max", "5", "--feature-norm-max", "3", "--eig-floor", "1", "--grad-max", "100"]
    if cmd == "bound":
        args = ["bound", "--delta", "0.05", "--n", "1000", *both]
    else:
        args = ["score", "--probe", str(_probe(tmp_path, n=30)), "--family", "linear", "--delta", "0.05", *both]
    _one_line_error(
        runner.invoke(app, args), "give either --leverage-max or --feature-norm-max with --eig-floor/--ridge, not both"
    )


def test_bound_dim_is_an_integer_floor_of_l():
    base = ["bound", "--delta", "0.05", "--grad-max", "1", "--json"]
    _one_line_error(
        runner.invoke(app, [*base, "--n", "1000", "--leverage-max", "0.5"]), "--leverage-max 0.5 is below 1"
    )
    out = json.loads(runner.invoke(app, [*base, "--n", "100000", "--leverage-max", "5.7"]).stdout)
    assert out["constants"]["dim"]["value"] == 5.0  # rank Σ is an integer ≤ L = 5.7
    out = json.loads(
        runner.invoke(app, [*base, "--n", "100000", "--feature-norm-max", "3", "--eig-floor", "1"]).stdout
    )  # L = 9 exactly
    assert out["constants"]["dim"]["value"] == 9.0
    # with a ridge, E ℓ_λ < rank Σ: no rank bound from L (D must be given)
    _one_line_error(
        runner.invoke(app, [*base, "--n", "1000", "--leverage-max", "5", "--ridge", "0.1"]), "missing constant --dim"
    )


def test_bound_vacuous_flag_and_note():
    base = ["bound", "--delta", "0.05", "--grad-max", "1", "--leverage-max", "5.7", "--json"]
    res = runner.invoke(app, [*base, "--n", "100"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["halfwidth"] is None and out["vacuous"] is True
    n0 = out["n_nonvacuous"]
    assert n0 > 100 and any(f"smallest non-vacuous n is {n0}" in x for x in out["notes"])
    ok = json.loads(runner.invoke(app, [*base, "--n", str(n0)]).stdout)
    assert ok["vacuous"] is False and ok["halfwidth"] is not None and ok["notes"] == []
    prev = json.loads(runner.invoke(app, [*base, "--n", str(n0 - 1)]).stdout)
    assert prev["vacuous"] is True


def test_one_row_probe_suggests_bootstrap_0(tmp_path):
    path, _, _ = _user_probe(tmp_path, n=1)
    args = ["score", "--probe", str(path), "--family", "linear", "--delta", "0.1", "--json"]
    _one_line_error(runner.invoke(app, args), "n >= 2", "--bootstrap 0")
    res = runner.invoke(app, [*args, "--bootstrap", "0"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["n"] == 1 and out["vacuous"] is True and out["score_squared_unbiased"] is None


# ----------------------------------------------------------------------------- library errors name arguments
@pytest.mark.parametrize(
    "call,message",
    [
        (
            lambda m: interval_from_moments(m, 0.1, leverage_max=-2.0),
            "leverage_max must be > 0, got -2",
        ),
        (lambda m: interval_from_moments(m, 1.5), "delta must be in (0, 1), got 1.5"),
        (lambda m: interval_from_moments(m, 0.1, candidates=0), "candidates must be a positive integer"),
        (
            lambda m: interval_from_moments(m, 0.1, leverage_max=3.0, feature_norm_max=2.0, eig_floor=1.0),
            "give either leverage_max or feature_norm_max with eig_floor/ridge, not both",
        ),
        (lambda m: plan_bound(delta=0.1, n=10, leverage_max=2.0), "missing constant grad_max: "),
        (lambda m: plan_bound(delta=0.1, grad_max=1.0, leverage_max=2.0), "give exactly one of n "),
    ],
)
def test_library_errors_name_python_arguments(call, message):
    """A Python caller is told about the argument (``leverage_max``), never a CLI flag."""
    phi, g = _population()
    m = ProbeMoments.from_arrays(phi, g)
    with pytest.raises(BoundError) as info:
        call(m)
    text = str(info.value)
    assert message in text, text
    assert "--" not in text and "⟦" not in text, text
    assert repr(info.value) == f"BoundError({text!r})"


def test_bound_error_render_spells_arguments_with_a_mapping():
    """``render`` respells each argument (and its quoted value) by the mapping given."""
    phi, g = _population()
    m = ProbeMoments.from_arrays(phi, g)
    with pytest.raises(BoundError) as info:
        interval_from_moments(m, 0.1, grad_max=1e-3, leverage_max=50.0)
    assert str(info.value).startswith("grad_max=0.001 is below the probe's own max ‖g(x)‖_F")
    spelled = info.value.render({"grad_max": "GRAD"})
    assert spelled.startswith("GRAD 0.001 is below the probe's own max ‖g(x)‖_F")
    assert info.value.render({"other": "x"}) == str(info.value)


@pytest.mark.parametrize(
    "extra,library,cli",
    [
        (["--leverage-max", "-2"], "leverage_max must be > 0, got -2", "--leverage-max must be > 0, got -2"),
        (["--candidates", "0"], "candidates must be a positive integer", "--candidates must be a positive integer"),
        (["--epsilon", "0"], "epsilon must be > 0, got 0", "--epsilon must be > 0, got 0"),
    ],
)
def test_cli_maps_argument_names_to_flags(tmp_path, extra, library, cli):
    """The same error: the library names the argument, ``depthsat score`` names its flag."""
    path = _probe(tmp_path, n=30)
    data = np.load(path)
    kwargs = {"leverage_max": -2.0} if "--leverage-max" in extra else {}
    kwargs |= {"candidates": 0} if "--candidates" in extra else {}
    kwargs |= {"epsilon": 0.0} if "--epsilon" in extra else {}
    with pytest.raises(BoundError) as info:
        interval_from_probe(data["z"], data["g"], parse_family("linear"), delta=0.1, **kwargs)
    assert str(info.value).startswith(library), str(info.value)
    res = runner.invoke(app, ["score", "--probe", str(path), "--family", "linear", "--delta", "0.1", *extra])
    line = _one_line_error(res, cli)
    assert line.startswith(f"error: {cli}")


def test_interval_from_probe_matches_moments_of_the_rows():
    """The probe-file interval equals the interval of the moments built from the same rows."""
    rng = np.random.default_rng(3)
    z = rng.normal(size=(400, 2))
    g = 0.4 * np.tanh(z) + rng.normal(size=z.shape)
    fam = parse_family("linear")
    got = interval_from_probe(z, g, fam, delta=0.1, epsilon=0.5, bootstrap=0, grad_max=10.0, leverage_max=40.0)
    phi = np.hstack([z, np.ones((400, 1))])  # linear: φ̃ = (z, 1)
    ref = interval_from_moments(ProbeMoments.from_arrays(phi, g), 0.1, epsilon=0.5, grad_max=10.0, leverage_max=40.0)
    assert got.score == pytest.approx(ref.score, rel=1e-10)
    assert got.score_lower == pytest.approx(ref.score_lower, rel=1e-9)
    assert got.score_upper == pytest.approx(ref.score_upper, rel=1e-9)
    assert got.certificate == ref.certificate
    assert isinstance(got.certificate, Certificate)
    with pytest.raises(FamilyError, match="feature family"):
        interval_from_probe(z, g, parse_family("product:2"), delta=0.1)


def test_degenerate_family_gets_the_degenerate_verdict():
    """``Σ̂ = 0`` (every feature row zero): the certificate is ``Verdict.DEGENERATE``, in JSON ``"degenerate"``."""
    rng = np.random.default_rng(0)
    phi = np.zeros((50, 3))
    g = rng.normal(size=(50, 2))
    m = ProbeMoments.from_arrays(phi, g)
    gam = float(np.linalg.norm(g, axis=1).max())
    it = interval_from_moments(m, 0.1, grad_max=gam, leverage_max=1.0, dim=1)
    assert it.certificate is Verdict.DEGENERATE
    assert it.to_dict()["certificate"] == "degenerate"


# ----------------------------------------------------------------------------- pinned constants
def _uniform_probe(phi, g, n, seed):
    w = np.random.default_rng(seed).multinomial(n, np.full(phi.shape[0], 1 / phi.shape[0]))
    return ProbeMoments.from_arrays(phi, g, w)


def test_worst_case_delta_uses_max_of_l_and_1():
    """With a ridge, L < 1 is allowed, but Δ_n's range term is L_1 = max(L, 1) (‖Y_i‖ ≤ max(L, 1))."""
    phi, g = _population(signal=0.5)
    phi = 0.1 * phi
    m = _uniform_probe(phi, g, 4000, 1)
    assert estimate(m, 0.5).lev_max < 0.35  # below L = 0.4 < 1
    gam = float(np.linalg.norm(g, axis=1).max())
    n, delta = 4000, Fraction(1, 10)
    it = interval_from_moments(m, float(delta), ridge=0.5, grad_max=gam, leverage_max=0.4, dim=3)
    u2 = math.log(2 * 3 / float(delta / 3))  # δ split in three (V from the probe)
    expected = math.sqrt(2 * 1 * u2 / n) + 2 * 1 * u2 / (3 * n)  # L_1 = 1, not L = 0.4
    assert it.relative_deviation == pytest.approx(expected, rel=1e-12)
    assert it.relative_deviation > math.sqrt(2 * 0.4 * u2 / n) + 2 * 0.4 * u2 / (3 * n) + 1e-6
    assert it.matrix_bound == "worst-case"
    plan = plan_bound(delta=0.1, n=n, ridge=0.5, grad_max=gam, leverage_max=0.4, dim=3, variance=1.0)
    u2p = math.log(2 * 3 / 0.05)
    assert plan.relative_deviation == pytest.approx(math.sqrt(2 * u2p / n) + 2 * u2p / (3 * n), rel=1e-12)


def _vbar(v_hat, dev, r, n, u3):
    """V̄ = min(R², ((c + √(c² + 4e))/2)²), c = √(2R²u_3/n), e = (1 + Δ) v̂ + 2R²u_3/(3n)."""
    c = math.sqrt(2 * r * r * u3 / n)
    e = (1 + dev) * v_hat + 2 * r * r * u3 / (3 * n)
    return min(r * r, (0.5 * (c + math.sqrt(c * c + 4 * e))) ** 2)


@pytest.mark.parametrize("method", ["worst-case", "empirical-bernstein"])
def test_variance_plugin_carries_its_one_plus_delta_factor(method):
    """ε_n with V̄ from the probe: the plug-in v̂ is inflated by (1 + Δ^+) (step 5)."""
    phi, g = _population(signal=0.5)
    n, delta = 20000, 0.1
    m = _uniform_probe(phi, g, n, 2)
    _, gam, big_l, _, _ = _exact(phi, g)
    it = interval_from_moments(m, delta, grad_max=gam, leverage_max=big_l, matrix_bound=method)
    # v̂ by direct numpy: mean over the probe of ‖g‖² φ̃ᵀ Σ̂⁺ φ̃
    w = np.random.default_rng(2).multinomial(n, np.full(phi.shape[0], 1 / phi.shape[0]))
    sp = np.linalg.pinv((phi * w[:, None]).T @ phi / n)
    v_hat = float(np.sum(w * (g**2).sum(1) * np.einsum("ik,kl,il->i", phi, sp, phi)) / n)
    r = gam * math.sqrt(big_l)
    parts = 3 if method == "worst-case" else 4
    u1, u3 = math.log(2 * parts / delta), math.log(parts / delta)
    var = _vbar(v_hat, it.relative_deviation_upper, r, n, u3)
    assert var < r * r  # not capped: the (1 + Δ) factor matters
    assert it.constants["variance"].value == pytest.approx(var, rel=1e-9)
    assert it.epsilon_n == pytest.approx(math.sqrt(2 * var * u1 / n) + 2 * r * u1 / n, rel=1e-9)
    assert _vbar(v_hat, 0.0, r, n, u3) < var * (1 - 1e-4)  # dropping the factor would be visible


def test_plug_in_upper_end_is_not_capped_at_the_probe_gamma():
    """A probe's AG_max is only a lower bound of γ: the plug-in upper end may exceed it."""
    rng = np.random.default_rng(3)
    z = rng.normal(size=(200, 2))
    phi = np.hstack([z, np.ones((200, 1))])
    g = np.ones((200, 1)) + 0.01 * rng.normal(size=(200, 1))  # s ≈ ‖g‖ ≈ AG_max
    m = _uniform_probe(phi, g, 800, 3)
    it = interval_from_moments(m, 0.1)  # γ and L from the probe (plug-in)
    assert not it.vacuous and it.constants["grad_max"].source == "probe"
    raw = it.score * math.sqrt(1 + it.relative_deviation) + it.epsilon_n
    assert raw > m.g_max * 1.01
    assert it.score_upper == pytest.approx(raw, rel=1e-12)
    # with the same γ given by the user the cap applies (s_λ ≤ AG_rms ≤ γ surely)
    user = interval_from_moments(m, 0.1, grad_max=m.g_max, leverage_max=it.constants["leverage_max"].value)
    assert user.score_upper == pytest.approx(m.g_max, rel=1e-12)


# ----------------------------------------------------------------------------- empirical Bernstein
def test_psi_sq_matches_direct_numpy():
    """σ̂² = ‖(1/n) Σ_i Ψ̂_i²‖; for one unit per example Ψ̂_i² = ℓ̂_i â_i â_iᵀ, â_i = Σ̂^{+1/2} φ̃_i."""
    phi, g = _population(signal=0.5)
    w = np.random.default_rng(4).multinomial(700, np.full(phi.shape[0], 1 / phi.shape[0]))
    est = estimate(ProbeMoments.from_arrays(phi, g, w), 0.0)
    sig = (phi * w[:, None]).T @ phi / 700
    lam, vec = np.linalg.eigh(sig)
    half = vec @ np.diag(lam**-0.5) @ vec.T
    a = phi @ half
    lev = (a * a).sum(1)
    top = np.linalg.eigvalsh((a * (w * lev)[:, None]).T @ a / 700).max()
    assert est.psi_sq == pytest.approx(top, rel=1e-10)
    assert 1.0 <= est.psi_sq <= lev[w > 0].max() * (1 + 1e-12)  # ‖E Ψ²‖ ≥ ‖E Ψ‖² = 1 and ≤ L
    assert math.isnan(estimate(ProbeMoments.from_arrays(phi, g, w, keep=False), 0.0).psi_sq)


@pytest.mark.parametrize(
    "sig_hat2,big_l,n", [(2.0, 8.0, 500), (5.0, 40.0, 100000), (1.0, 3.0, 10**6), (30.0, 40.0, 60)]
)
def test_matrix_variance_upper_is_the_largest_consistent_value(sig_hat2, big_l, n):
    """σ̄² is the sup of {x ≤ L : √x ≤ c/2 + √(c²/4 + e_0 + σ̂²(1 + Δ^+(x))²)}, found by a dense scan."""
    from depthsat_theory.bounds.terms import matrix_variance_upper

    u2, u4 = math.log(2 * 5 / 0.025), math.log(1 / 0.025)
    c, e0 = big_l * math.sqrt(2 * u4 / n), 2 * big_l**2 * u4 / (3 * n)

    def consistent(x):
        dplus = math.sqrt(2 * x * u2 / n) + 2 * big_l * u2 / (3 * n)
        return math.sqrt(x) <= c / 2 + math.sqrt(c * c / 4 + e0 + sig_hat2 * (1 + dplus) ** 2) + 1e-12

    grid = np.linspace(0, big_l, 200001)
    ok = [x for x in grid if consistent(x)]
    got = matrix_variance_upper(sig_hat2, big_l, n, u2, u4)
    assert got == pytest.approx(max(ok), abs=big_l * 1e-5)
    assert consistent(got) and (got == big_l or not consistent(got * (1 + 1e-6)))


def test_empirical_bernstein_interval_is_labelled_narrower_and_covers():
    """On a population with a long leverage tail: Δ narrower at large n, coverage ≥ 1 − δ − 3SE."""
    rng = np.random.default_rng(7)
    n_pop = 300
    z = rng.standard_t(3, size=(n_pop, 2))
    phi = np.hstack([z, np.ones((n_pop, 1))])
    g = np.clip(0.4 * np.tanh(z) + rng.normal(size=(n_pop, 2)), -3, 3)
    s_true, gam, big_l, _, _ = _exact(phi, g)
    delta, reps, n = 0.2, 60, 40000
    floor = 1 - delta - 3 * math.sqrt(delta * (1 - delta) / reps)
    hits = 0
    for r in range(reps):
        m = _uniform_probe(phi, g, n, 100 + r)
        eb = interval_from_moments(m, delta, grad_max=gam, leverage_max=big_l, matrix_bound="empirical-bernstein")
        hits += eb.score_lower <= s_true <= eb.score_upper
    wc = interval_from_moments(m, delta, grad_max=gam, leverage_max=big_l)
    assert hits / reps >= floor
    assert eb.matrix_bound == "empirical-bernstein" and eb.constants["matrix_variance"].source == "probe"
    assert any("empirical Bernstein" in x for x in eb.notes)
    assert eb.relative_deviation < 0.8 * wc.relative_deviation
    assert eb.relative_deviation_lower < eb.relative_deviation_upper
    with pytest.raises(BoundError, match="matrix_bound"):
        interval_from_moments(m, delta, matrix_bound="nope")
    # without kept rows σ² falls back to the sure bound L, and says so
    bare = ProbeMoments.from_arrays(phi, g, np.full(n_pop, 10), keep=False)
    fb = interval_from_moments(bare, delta, grad_max=gam, leverage_max=big_l, matrix_bound="empirical-bernstein")
    assert fb.constants["matrix_variance"].value == big_l and fb.constants["matrix_variance"].source == "derived"


def _lower_end_by_hand(n, s, v, gam, big_l, dim, delta):
    """``ŝ √(1 − Δ_n) − ε_n`` written out from theory/finite-sample.md (δ split over three events)."""
    u1, u2 = math.log(6 / delta), math.log(6 * dim / delta)
    l1 = max(big_l, 1.0)
    dev = math.sqrt(2 * l1 * u2 / n) + 2 * l1 * u2 / (3 * n)
    if dev >= 1:
        return -math.inf
    r = gam * math.sqrt(big_l)
    return s * math.sqrt(1 - dev) - (math.sqrt(2 * v * u1 / n) + 2 * r * u1 / n)


def test_n_to_certify_is_the_first_probe_size_whose_lower_end_is_positive():
    """The plan of an uncertified interval: at ``n*`` the hand-written lower end is > 0, at ``n* − 1`` not;
    a fresh probe of ``2 n*`` examples from the same population is certified improvable."""
    rng = np.random.default_rng(5)

    def draw(n):
        z = rng.uniform(-1, 1, size=(n, 1))
        return z, 0.3 * z + rng.uniform(-1, 1, size=(n, 1))

    z, g = draw(300)
    iv = interval_from_probe(z, g, parse_family("linear"), delta=0.1, bootstrap=0, grad_max=1.3, leverage_max=4.0)
    assert iv.score_lower == 0 and iv.n_to_certify is not None
    n_star, s, v = iv.n_to_certify, iv.score, iv.variance_plugin
    args = (s, v, 1.3, 4.0, 2, 0.1)  # D = min(k̃, ⌊L⌋) = 2
    assert _lower_end_by_hand(n_star, *args) > 0 >= _lower_end_by_hand(n_star - 1, *args)
    big = interval_from_probe(
        *draw(2 * n_star), parse_family("linear"), delta=0.1, bootstrap=0, grad_max=1.3, leverage_max=4.0
    )
    assert big.score_lower > 0 and big.certificate is Certificate.IMPROVABLE


def test_n_to_certify_is_none_without_signal():
    z = np.linspace(-1, 1, 64)[:, None]
    iv = interval_from_probe(
        z, np.zeros_like(z), parse_family("linear"), delta=0.1, bootstrap=0, grad_max=1.0, leverage_max=4.0
    )
    assert iv.score == 0 and iv.n_to_certify is None


def _lower_end_given_v(n, s, v, gam, big_l, dim, delta):
    """As :func:`_lower_end_by_hand` with the user's ``V`` (δ split over two events)."""
    u1, u2 = math.log(4 / delta), math.log(4 * dim / delta)
    l1 = max(big_l, 1.0)
    dev = math.sqrt(2 * l1 * u2 / n) + 2 * l1 * u2 / (3 * n)
    if dev >= 1:
        return -math.inf
    return s * math.sqrt(1 - dev) - (math.sqrt(2 * v * u1 / n) + 2 * gam * math.sqrt(big_l) * u1 / n)


@pytest.mark.parametrize("given_v", [False, True])
def test_n_to_certify_is_minimal_across_signal_strengths(given_v):
    """For a grid of ``ŝ`` the plan is the first ``n`` whose hand-written lower end is positive."""
    from depthsat_theory.bounds import n_to_certify

    rng = np.random.default_rng(6)
    z = rng.uniform(-1, 1, size=(200, 1))
    g = 0.3 * z + rng.uniform(-1, 1, size=(200, 1))
    kw = dict(grad_max=1.3, leverage_max=4.0) | (dict(variance=2.5) if given_v else {})
    iv = interval_from_probe(z, g, parse_family("linear"), delta=0.1, bootstrap=0, **kw)
    hand = _lower_end_given_v if given_v else _lower_end_by_hand
    v = 2.5 if given_v else iv.variance_plugin
    for s in (0.05, 0.1, 0.2, 0.4, 0.8, 1.3):
        n_star = n_to_certify(s, iv.variance_plugin, iv.constants, 0.1)
        args = (s, v, 1.3, 4.0, 2, 0.1)
        assert hand(n_star, *args) > 0 >= hand(n_star - 1, *args), s


# ----------------------------------------------------------------------------- certificates and the vacuous case
def _null_probe(n_total=5000):
    """A population with ``G = 0`` (s = 0), a multinomial probe of ``n_total`` examples, and its exact constants."""
    phi, g = _population(signal=0.0)
    _, gam, big_l, _, _ = _exact(phi, g)
    w = np.random.default_rng(7).multinomial(n_total, np.full(phi.shape[0], 1 / phi.shape[0]))
    return ProbeMoments.from_arrays(phi, g, w), gam, big_l


def test_saturation_certificate_is_issued_exactly_below_the_hand_written_upper_end():
    """``certified ε-saturated`` iff the upper end ŝ√(1+Δ) + ε_n (written out here) is ≤ ε; lower end 0."""
    m, gam, big_l = _null_probe()
    delta, var = 0.05, 7.5
    kw = dict(grad_max=gam, leverage_max=big_l, variance=var, dim=3)
    it = interval_from_moments(m, delta, **kw)
    d1 = delta / 2
    u1, u2 = math.log(2 / d1), math.log(2 * 3 / d1)
    dev = math.sqrt(2 * big_l * u2 / m.n) + 2 * big_l * u2 / (3 * m.n)
    eps_n = math.sqrt(2 * var * u1 / m.n) + 2 * gam * math.sqrt(big_l) * u1 / m.n
    upper = min(it.score * math.sqrt(1 + dev) + eps_n, gam)
    assert it.score_lower == 0.0 and it.score_upper == pytest.approx(upper, rel=1e-12)
    assert it.score_upper_unregularized == it.score_upper  # ridge = 0: the same bound
    above = interval_from_moments(m, delta, epsilon=upper * (1 + 1e-9), **kw)
    below = interval_from_moments(m, delta, epsilon=upper * (1 - 1e-9), **kw)
    assert above.certificate == Certificate.SATURATED
    assert below.certificate == Certificate.NOT_CERTIFIED


def test_ag_rms_certificate_follows_its_upper_bound():
    """The family-free certificate: ``AG_rms ≤ ε`` certified iff the Bernstein upper bound is ≤ ε; unasked without ε."""
    m, gam, big_l = _null_probe()
    kw = dict(grad_max=gam, leverage_max=big_l, dim=3)
    it = interval_from_moments(m, 0.1, **kw)
    up = ag_rms_upper(m.n, math.sqrt(m.g_sq), gam, 0.1)
    assert it.ag_rms_upper == pytest.approx(up, rel=1e-12) and up >= math.sqrt(m.g_sq)
    assert it.ag_certificate == "not asked (give epsilon)"
    assert interval_from_moments(m, 0.1, epsilon=up * (1 + 1e-9), **kw).ag_certificate == Certificate.SATURATED
    assert interval_from_moments(m, 0.1, epsilon=up * (1 - 1e-9), **kw).ag_certificate == Certificate.NOT_CERTIFIED


def test_ridge_upper_bound_on_the_unregularized_score():
    """``s ≤ s_λ √(1 + λ/μ)`` with an eigenvalue floor μ, capped at a given γ; ``None`` without μ."""
    m, gam, _ = _null_probe()
    lam, mu = 0.2, 0.05
    feat = float(np.sqrt(m.feat_sq_max))
    it = interval_from_moments(m, 0.1, ridge=lam, grad_max=gam, feature_norm_max=feat, eig_floor=mu, dim=3)
    assert it.score_upper_unregularized == pytest.approx(min(it.score_upper * math.sqrt(1 + lam / mu), gam), rel=1e-12)
    assert it.score_upper_unregularized > it.score_upper
    plug = interval_from_moments(m, 0.1, ridge=lam, feature_norm_max=feat, eig_floor=mu, dim=3)
    assert plug.constants["grad_max"].source == "probe"
    assert plug.score_upper_unregularized == pytest.approx(plug.score_upper * math.sqrt(1 + lam / mu), rel=1e-12)
    # a tiny floor: the factor √(1 + λ/μ) pushes the bound past γ, which caps it only when γ is given
    tiny = 1e-7
    capped = interval_from_moments(m, 0.1, ridge=lam, grad_max=gam, feature_norm_max=feat, eig_floor=tiny, dim=3)
    assert capped.score_upper * math.sqrt(1 + lam / tiny) > gam and capped.score_upper_unregularized == gam
    loose = interval_from_moments(m, 0.1, ridge=lam, feature_norm_max=feat, eig_floor=tiny, dim=3)
    assert loose.score_upper_unregularized == pytest.approx(loose.score_upper * math.sqrt(1 + lam / tiny), rel=1e-12)
    assert loose.score_upper_unregularized > loose.constants["grad_max"].value
    no_floor = interval_from_moments(m, 0.1, ridge=lam, grad_max=gam, leverage_max=feat**2 / lam, dim=3)
    assert no_floor.score_upper_unregularized is None
    assert any("eig_floor" in note for note in no_floor.notes)


def test_vacuous_interval_uses_the_worst_case_variance():
    """``1 ≤ Δ_n < 2``: the interval is ``[0, γ]`` and ``V`` is the worst case ``R² = γ² L`` (derived)."""
    _, gam, big_l = _null_probe()
    u2 = math.log(2 * 3 / (0.1 / 3))  # δ split in three (V from the probe), D = 3
    m = _null_probe(n_total=math.ceil(big_l * u2 / 0.6))[0]  # √(2x) + 2x/3 ≈ 1.5 at x = L u₂ / n = 0.6
    dev = math.sqrt(2 * big_l * u2 / m.n) + 2 * big_l * u2 / (3 * m.n)
    assert 1 <= dev < 2
    it = interval_from_moments(m, 0.1, grad_max=gam, leverage_max=big_l, dim=3)
    assert it.vacuous and (it.score_lower, it.score_upper) == (0.0, gam)
    v = it.constants["variance"]
    assert (v.symbol, v.source) == ("V", "derived") and v.value == pytest.approx(gam * gam * big_l, rel=1e-12)
    assert "vacuous" in v.note
    u1, r = math.log(2 / (0.1 / 3)), gam * math.sqrt(big_l)
    assert it.epsilon_n == pytest.approx(math.sqrt(2 * r * r * u1 / m.n) + 2 * r * u1 / m.n, rel=1e-12)
    assert any("vacuous" in note for note in it.notes)
    ok = interval_from_moments(_null_probe()[0], 0.1, grad_max=gam, leverage_max=big_l, dim=3)
    assert not ok.vacuous and (ok.constants["variance"].symbol, ok.constants["variance"].source) == ("V", "probe")
