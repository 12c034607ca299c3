"""Every field of :func:`interval_from_moments` against a reference written out from theory/finite-sample.md.

The reference recomputes, with dense numpy on the probe's rows and the formulas of
``thm-finite-sample`` / ``thm-empirical-bernstein`` / ``cor-agmax-certificate-finite`` as printed in
the theory page (not the package's helpers): ``ŝ_λ²``, ``v̂``, the U-statistic by its double sum
over pairs, the probe's ``σ̂²`` from the ``Ψ̂_i`` matrices, ``σ̄²`` by bisection of its defining
inequality, the δ split, ``Δ^∓``, ``V̄``, ``ε_n``, both ends, ``AG_rms``'s upper bound, the
certificate and ``n_to_certify`` by a plain scan.  Configurations cover both matrix steps, a user
``V``, the union bound, a ridge with an eigenvalue floor and a vacuous probe (mutation testing of
``bounds/interval.py``; every assertion is a whole-record comparison, so any field
computed from a wrong argument fails).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from depthsat_theory.bounds import BoundError, ProbeMoments, interval_from_moments
from depthsat_theory.bounds.interval import ag_rms_upper, bootstrap_interval, unbiased_score_squared
from depthsat_theory.vocabulary import Certificate, Verdict


def _rows(n=60, d=2, signal=0.6, seed=0):
    rng = np.random.default_rng(seed)
    z = rng.uniform(-1, 1, size=(n, 2))  # leverage 3z₁² + 3z₂² + 1 ≤ 7 on the population
    phi = np.hstack([z, np.ones((n, 1))])
    g = signal * (1 + np.tanh(z @ rng.normal(size=(2, d)))) + 0.5 * rng.normal(size=(n, d))
    return phi, g


def _bern(mean, b2, n, u):
    """One-sided Bernstein upper bound on E Y for 0 ≤ Y ≤ b2 (square of (c + √(c² + 4e))/2), capped at b2."""
    c = math.sqrt(2 * b2 * u / n)
    e = max(mean, 0.0) + 2 * b2 * u / (3 * n)
    return min(b2, (0.5 * (c + math.sqrt(c * c + 4 * e))) ** 2)


def _sigma_bar(sig_hat2, big_l, n, u2, u4):
    """Largest x ∈ [0, L] with √x ≤ c/2 + √(c²/4 + e_0 + σ̂²(1 + Δ^+(x))²), by bisection."""
    c, e0 = big_l * math.sqrt(2 * u4 / n), 2 * big_l**2 * u4 / (3 * n)

    def ok(x):
        dplus = math.sqrt(2 * x * u2 / n) + 2 * big_l * u2 / (3 * n)
        return math.sqrt(x) <= c / 2 + math.sqrt(c * c / 4 + e0 + sig_hat2 * (1 + dplus) ** 2)

    if ok(big_l):
        return big_l
    lo, hi = 0.0, big_l
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _reference(phi, g, delta, *, gam, big_l, dim, var=None, m=1, method="worst-case", ridge=0.0, mu=None, eps=None):
    n, k = phi.shape
    sig = phi.T @ phi / n
    inv = np.linalg.inv(sig + ridge * np.eye(k)) if ridge > 0 else np.linalg.pinv(sig)
    lam, vec = np.linalg.eigh(inv)
    half = (vec * np.sqrt(np.clip(lam, 0, None))) @ vec.T
    xi = np.stack([np.outer(g[i], phi[i]) @ half for i in range(n)])  # ξ_i = G_i Σ̂_λ^{+1/2}
    s2 = float(np.sum(xi.mean(0) ** 2))
    v_hat = float(np.mean(np.sum(xi**2, axis=(1, 2))))
    flat = xi.reshape(n, -1)
    pairs = flat @ flat.T  # ⟨ξ_i, ξ_j⟩ for every pair
    ustat = float(pairs.sum() - np.trace(pairs)) / (n * (n - 1))
    psi = np.stack([half @ np.outer(phi[i], phi[i]) @ half for i in range(n)])
    sig_hat2 = float(np.linalg.eigvalsh(np.mean([p @ p for p in psi], axis=0)).max())
    per = delta / m
    r = gam * math.sqrt(big_l)
    if method == "worst-case":
        d1 = per / 3 if var is None else per / 2
        u1, u2, u3 = math.log(2 / d1), math.log(2 * dim / d1), math.log(1 / d1)
        l1 = max(big_l, 1.0)
        lo_dev = hi_dev = math.sqrt(2 * l1 * u2 / n) + 2 * l1 * u2 / (3 * n)
        sbar = None
    else:
        d1 = per / 4 if var is None else per / 3
        u1, u2, u3 = math.log(2 / d1), math.log(2 * dim / d1), math.log(1 / d1)
        sbar = _sigma_bar(sig_hat2, big_l, n, u2, u3)
        root = math.sqrt(2 * sbar * u2 / n)
        lo_dev, hi_dev = root + 2 * u2 / (3 * n), root + 2 * big_l * u2 / (3 * n)
    vacuous = lo_dev >= 1
    if var is None:
        var = r * r if vacuous else _bern((1 + hi_dev) * v_hat, r * r, n, u3)
    eps_n = math.sqrt(2 * var * u1 / n) + 2 * r * u1 / n
    s_hat = math.sqrt(s2)
    if vacuous:
        lower, upper = 0.0, gam
    else:
        lower = max(0.0, s_hat * math.sqrt(1 - lo_dev) - eps_n)
        upper = min(gam, s_hat * math.sqrt(1 + hi_dev) + eps_n)
    upper_s = upper if ridge == 0 else (None if mu is None else min(gam, upper * math.sqrt(1 + ridge / mu)))
    ag_sq = float(np.mean(np.sum(g**2, axis=1)))
    ag_up = math.sqrt(_bern(ag_sq, gam * gam, n, math.log(1 / per)))
    if lower > 0:
        cert = Certificate.IMPROVABLE
    elif eps is not None and upper_s is not None and upper_s <= eps:
        cert = Certificate.SATURATED
    else:
        cert = Certificate.NOT_CERTIFIED
    if eps is None:
        ag_cert = "not asked (give epsilon)"
    else:
        ag_cert = Certificate.SATURATED if ag_up <= eps else Certificate.NOT_CERTIFIED
    return {
        "score": s_hat,
        "score_lower": lower,
        "score_upper": upper,
        "score_upper_unregularized": upper_s,
        "delta": delta,
        "candidates": m,
        "n": n,
        "ridge": ridge,
        "epsilon_n": eps_n,
        "relative_deviation": max(lo_dev, hi_dev),
        "relative_deviation_lower": lo_dev,
        "relative_deviation_upper": hi_dev,
        "matrix_bound": method,
        "vacuous": vacuous,
        "certificate": cert,
        "saturation_epsilon": eps,
        "score_squared": s2,
        "score_squared_unbiased": ustat,
        "variance_plugin": v_hat,
        "ag_rms_upper": ag_up,
        "ag_certificate": ag_cert,
        "tangent_rank": k,
        "V": var,
        "sigma_bar": sbar,
        "sig_hat2": sig_hat2,
    }


def _n_to_certify_ref(s_hat, v_hat, gam, big_l, dim, per, var=None):
    """First n (a plain scan after a doubling bracket) with ŝ√(1 − Δ_n) − ε_n > 0, worst-case step."""
    d1 = per / 3 if var is None else per / 2
    v = v_hat if var is None else var
    u1, u2 = math.log(2 / d1), math.log(2 * dim / d1)
    l1, r = max(big_l, 1.0), gam * math.sqrt(big_l)

    def lower(n):
        dev = math.sqrt(2 * l1 * u2 / n) + 2 * l1 * u2 / (3 * n)
        return dev < 1 and s_hat * math.sqrt(1 - dev) - math.sqrt(2 * v * u1 / n) - 2 * r * u1 / n > 0

    hi = 1
    while not lower(hi):
        hi *= 2
    return next(n for n in range(hi // 2, hi + 1) if lower(n))


CONFIGS = {
    "worst-case, V from the probe": {},
    "worst-case, user V": {"var": 3.0},
    "worst-case, union bound over 3, epsilon": {"m": 3, "eps": 0.9},
    "empirical Bernstein": {"method": "empirical-bernstein"},
    "empirical Bernstein, user V, union bound over 2": {"method": "empirical-bernstein", "var": 3.0, "m": 2},
    "ridge with an eigenvalue floor, epsilon": {"ridge": 0.3, "mu": 0.2, "eps": 5.0},
    "empirical Bernstein with a ridge": {"method": "empirical-bernstein", "ridge": 0.3},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_field_matches_the_theorem_written_out(name):
    cfg = dict(CONFIGS[name])
    n = 1500 if "ridge" not in cfg else 2500
    phi, g = _rows(n=n, seed=1)
    gam = 1.5 * float(np.linalg.norm(g, axis=1).max())
    big_l, dim, delta = 8.0, 3, 0.2
    if "ridge" in cfg:
        big_l = 3.0 / (cfg["ridge"] + cfg.get("mu", 0.0))  # L = B²/(μ + λ) with B² = 3 would also do
        big_l = max(big_l, 1.2 * float(np.max(np.einsum("ik,kl,il->i", phi, np.linalg.inv(phi.T @ phi / n), phi))))
    ref = _reference(phi, g, delta, gam=gam, big_l=big_l, dim=dim, **cfg)
    it = interval_from_moments(
        ProbeMoments.from_arrays(phi, g),
        delta,
        ridge=cfg.get("ridge", 0.0),
        grad_max=gam,
        leverage_max=big_l,
        eig_floor=cfg.get("mu"),
        variance=cfg.get("var"),
        dim=dim,
        epsilon=cfg.get("eps"),
        candidates=cfg.get("m", 1),
        matrix_bound=cfg.get("method", "worst-case"),
    )
    got = it.to_dict()
    assert (not ref["vacuous"] and ref["score_lower"] > 0) or "ridge" in cfg  # the ends are not clipped
    for key, want in ref.items():
        if key in ("V", "sigma_bar", "sig_hat2"):
            continue
        have = got[key]
        if isinstance(want, float):
            assert have == pytest.approx(want, rel=1e-9, abs=1e-12), key
        else:
            want = want.value if hasattr(want, "value") else want
            assert have == want, key
    assert it.constants["variance"].value == pytest.approx(ref["V"], rel=1e-9)
    assert it.constants["variance"].source == ("user" if "var" in cfg else "probe")
    if ref["sigma_bar"] is not None:
        mv = it.constants["matrix_variance"]
        assert mv.value == pytest.approx(ref["sigma_bar"], rel=1e-7) and mv.source == "probe"
        assert f"{ref['sig_hat2']:.6g}" in mv.note
        assert ref["sigma_bar"] < big_l  # the empirical step is not the sure bound here
    if "ridge" in cfg:
        assert it.constants["ridge"].value == cfg["ridge"] and it.constants["ridge"].source == "user"
    assert it.guaranteed is True and it.label == "(1-δ) confidence interval (thm-finite-sample)"
    assert len(it.assumptions) == 4 + ("var" in cfg)
    assert ("asm-variance" in it.assumptions[-1]) == ("var" in cfg)
    assert it.bootstrap_interval is None and it.looseness is None
    union = [x for x in it.notes if x.startswith("union bound")]
    assert union == (
        [f"union bound over {cfg['m']} candidates: each interval at level δ/{cfg['m']}"] if "m" in cfg else []
    )
    if "ridge" not in cfg:
        per = delta / cfg.get("m", 1)
        want_n = _n_to_certify_ref(ref["score"], ref["variance_plugin"], gam, big_l, dim, per, cfg.get("var"))
        assert it.n_to_certify == want_n and isinstance(it.n_to_certify, int)


def test_plug_in_constants_are_labelled_and_not_capped():
    """γ and L from the probe: the label says plug-in, ``guaranteed`` is false, the constants are the probe's."""
    phi, _ = _rows(n=800, seed=2)
    n = phi.shape[0]
    g = 1 + 0.01 * np.random.default_rng(2).normal(size=(n, 1))  # s ≈ ‖g‖ ≈ AG_max
    it = interval_from_moments(ProbeMoments.from_arrays(phi, g), 0.1, dim=3)
    lev = np.einsum("ik,kl,il->i", phi, np.linalg.pinv(phi.T @ phi / n), phi)
    gmax = float(np.linalg.norm(g, axis=1).max())
    assert it.constants["grad_max"].value == pytest.approx(gmax, rel=1e-12)
    assert it.constants["leverage_max"].value == pytest.approx(float(lev.max()), rel=1e-9)
    assert it.guaranteed is False
    assert it.label == (
        "plug-in interval: γ and/or L from the probe, not a guarantee (thm-finite-sample with estimated constants)"
    )
    ref = _reference(phi, g, 0.1, gam=gmax, big_l=float(lev.max()), dim=3)
    u = ref["score"] * math.sqrt(1 + ref["relative_deviation_upper"]) + ref["epsilon_n"]
    assert u > gmax and it.score_upper == pytest.approx(u, rel=1e-9)  # not capped at the probe's γ


def test_vacuous_probe_gives_zero_to_gamma_and_the_worst_case_variance():
    phi, g = _rows(n=40, seed=3)
    gam, big_l = 3.0 * float(np.linalg.norm(g, axis=1).max()), 6.0
    for method in ("worst-case", "empirical-bernstein"):
        ref = _reference(phi, g, 0.1, gam=gam, big_l=big_l, dim=3, method=method)
        it = interval_from_moments(
            ProbeMoments.from_arrays(phi, g), 0.1, grad_max=gam, leverage_max=big_l, dim=3, matrix_bound=method
        )
        assert ref["vacuous"] and it.vacuous
        assert (it.score_lower, it.score_upper) == (0.0, gam)
        assert it.constants["variance"].value == pytest.approx(gam * gam * big_l, rel=1e-12)
        assert it.constants["variance"].source == "derived"
        u1 = math.log(2 / (0.1 / (3 if method == "worst-case" else 4)))
        r = gam * math.sqrt(big_l)
        assert it.epsilon_n == pytest.approx(math.sqrt(2 * r * r * u1 / 40) + 2 * r * u1 / 40, rel=1e-12)
        assert it.relative_deviation_lower == pytest.approx(ref["relative_deviation_lower"], rel=1e-9)
        want = (
            f"vacuous: Δ_n = {ref['relative_deviation_lower']:.3g} ≥ 1 (n = 40 is too small for the leverage "
            f"bound L = {big_l:.4g}); `depthsat bound` gives the n needed"
        )
        assert want in it.notes


def test_empirical_bernstein_falls_back_to_l_when_the_probe_rank_is_below_d():
    """``ridge = 0`` and ``rank Σ̂ < D``: σ̄² = L (derived), so Δ^∓ are the one-sided sure-bound terms."""
    phi, g = _rows(n=2000, seed=4)
    big_l, dim, delta = 8.0, 4, 0.2  # D = 4 > rank 3
    it = interval_from_moments(
        ProbeMoments.from_arrays(phi, g),
        delta,
        grad_max=5.0 * float(np.linalg.norm(g, axis=1).max()),
        leverage_max=big_l,
        dim=dim,
        matrix_bound="empirical-bernstein",
    )
    mv = it.constants["matrix_variance"]
    assert mv.value == big_l and mv.source == "derived" and "rank Σ̂ = 3 < D" in mv.note
    u2 = math.log(2 * dim / (delta / 4))
    root = math.sqrt(2 * big_l * u2 / 2000)
    assert it.relative_deviation_lower == pytest.approx(root + 2 * u2 / 6000, rel=1e-12)
    assert it.relative_deviation_upper == pytest.approx(root + 2 * big_l * u2 / 6000, rel=1e-12)


def test_unbiased_score_squared_is_the_pair_sum_with_and_without_a_fixed_whitening():
    phi, g = _rows(n=25, seed=5)
    m = ProbeMoments.from_arrays(phi, g)
    for ridge in (0.0, 0.4):
        ref = _reference(phi, g, 0.1, gam=10.0, big_l=10.0, dim=3, ridge=ridge)
        assert unbiased_score_squared(m, ridge=ridge) == pytest.approx(ref["score_squared_unbiased"], rel=1e-10)
    w = np.diag([2.0, 0.5, 1.0]).astype(np.float32)  # any fixed PSD whitening
    wh = np.sqrt(np.diag(w).astype(np.float64))
    xi = np.stack([(np.outer(g[i], phi[i]) * wh).ravel() for i in range(25)])
    pair = (np.sum(xi.sum(0) ** 2) - np.sum(xi**2)) / (25 * 24)
    assert unbiased_score_squared(m, whitening=w) == pytest.approx(pair, rel=1e-12)
    two = ProbeMoments.from_arrays(phi[:2], g[:2])  # n = 2 is the smallest allowed
    x0, x1 = (np.outer(g[i], phi[i]) for i in range(2))  # ξ_i = G_i with W = I
    assert math.isfinite(unbiased_score_squared(two))
    assert unbiased_score_squared(two, whitening=np.eye(3)) == pytest.approx(float(np.sum(x0 * x1)), rel=1e-12)
    with pytest.raises(BoundError, match=r"the U-statistic needs n >= 2 examples"):
        unbiased_score_squared(ProbeMoments.from_arrays(phi[:1], g[:1]))


@pytest.mark.parametrize("method", ["ustat", "basic", "percentile"])
def test_bootstrap_interval_is_the_documented_quantile_rule(method):
    """Resamples are multinomial(n, 1/N) draws of ``default_rng(seed)``; statistics by dense numpy."""
    phi, g = _rows(n=30, seed=6)
    n, delta, reps = 30, 0.2, 40
    m = ProbeMoments.from_arrays(phi, g)
    got = bootstrap_interval(m, delta, resamples=reps, seed=11, method=method)
    rng = np.random.default_rng(11)

    def stats(w):
        sig = (phi * w[:, None]).T @ phi / n
        inv = np.linalg.pinv(sig)
        gx = np.einsum("id,ik->idk", g, phi)
        mean = np.einsum("i,idk->dk", w, gx) / n
        s2 = float(np.trace(mean @ inv @ mean.T))
        v = float(np.einsum("i,idk,kl,idl->", w, gx, inv, gx) / n)
        return s2, (n * s2 - v) / (n - 1)

    s2_0, u_0 = stats(np.ones(n))
    draws = [stats(rng.multinomial(n, np.full(n, 1 / n).astype(float))) for _ in range(reps)]
    vals = np.array([u if method == "ustat" else math.sqrt(s2) for s2, u in draws])
    q_lo, q_hi = np.quantile(vals, [delta / 2, 1 - delta / 2])
    if method == "percentile":
        want = (q_lo, q_hi)
    elif method == "basic":
        s0 = math.sqrt(s2_0)
        want = (max(0.0, 2 * s0 - q_hi), max(0.0, 2 * s0 - q_lo))
    else:
        want = (math.sqrt(max(0.0, u_0 - (q_hi - s2_0))), math.sqrt(max(0.0, u_0 - (q_lo - s2_0))))
    assert got["lower"] == pytest.approx(want[0], rel=1e-9, abs=1e-12)
    assert got["upper"] == pytest.approx(want[1], rel=1e-9, abs=1e-12)
    assert got["lower"] < got["upper"] and got["resamples"] == reps
    names = {
        "ustat": "basic bootstrap of the U-statistic of s², square-rooted",
        "basic": "basic bootstrap of ŝ",
        "percentile": "percentile bootstrap of ŝ",
    }
    assert got["method"] == names[method] + " (resampling examples)"
    assert got["label"] == "bootstrap interval: approximate, not a guarantee (needs the probe in memory)"
    assert got["method"].endswith("(resampling examples)") and got["label"].startswith(
        "bootstrap interval: approximate"
    )
    # through interval_from_moments: the same interval at δ/m, and the looseness ratio
    it = interval_from_moments(m, 2 * delta, candidates=2, bootstrap=reps, seed=11, bootstrap_method=method, dim=3)
    assert it.bootstrap_interval == got
    assert it.looseness == pytest.approx((it.score_upper - it.score_lower) / (want[1] - want[0]), rel=1e-9)


def test_bootstrap_errors_and_a_constant_probe():
    phi, g = _rows(n=10, seed=7)
    m = ProbeMoments.from_arrays(phi, g)
    with pytest.raises(BoundError, match="'ustat', 'basic' or 'percentile', got 'x'"):
        bootstrap_interval(m, 0.1, method="x")
    with pytest.raises(BoundError, match=r"needs the probe's rows in memory \(keep_probe=True\)"):
        bootstrap_interval(ProbeMoments.from_arrays(phi, g, keep=False), 0.1)
    with pytest.raises(BoundError, match="n >= 2 examples"):
        bootstrap_interval(ProbeMoments.from_arrays(phi[:1], g[:1]), 0.1)
    # a probe of one repeated example: every resample is the probe itself, so the interval is a point
    same = ProbeMoments.from_arrays(np.repeat(phi[:1], 5, 0), np.repeat(g[:1], 5, 0))
    s = math.sqrt(float(np.sum(g[0] ** 2)))  # ŝ² = ‖g‖² φᵀΣ̂⁺φ = ‖g‖² (rank one)
    for method in ("basic", "percentile", "ustat"):
        b = bootstrap_interval(same, 0.1, resamples=3, method=method)
        assert b["lower"] == pytest.approx(s, rel=1e-9) and b["upper"] == pytest.approx(s, rel=1e-9), method


def test_degenerate_probe_and_to_dict_cleaning():
    phi, g = _rows(n=50, seed=8)
    it = interval_from_moments(ProbeMoments.from_arrays(np.zeros_like(phi), g), 0.1, grad_max=10.0, leverage_max=3.0)
    assert it.certificate is Verdict.DEGENERATE
    d = it.to_dict()
    assert d["certificate"] == Verdict.DEGENERATE.value
    assert all(isinstance(c, dict) for c in d["constants"].values())
    from depthsat_theory.bounds.interval import _clean

    assert _clean({"a": [float("nan"), 1.0, Certificate.IMPROVABLE], "b": (1,)}) == {
        "a": [None, 1.0, Certificate.IMPROVABLE.value],
        "b": (1,),
    }


_M = None


def _probe_m():
    global _M
    if _M is None:
        phi, g = _rows(n=50, seed=9)
        _M = ProbeMoments.from_arrays(phi, g)
    return _M


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda m: interval_from_moments(m, 0.1, matrix_bound="x"),
            "matrix_bound must be one of ('worst-case', 'empirical-bernstein'), got 'x'",
        ),
        (
            lambda m: interval_from_moments(m, 0.1, candidates=0),
            "candidates must be a positive integer (n >= 1), got 0",
        ),
        (lambda m: interval_from_moments(m, 0.1, epsilon=0.0), "epsilon must be > 0, got 0"),
        (lambda m: interval_from_moments(m, 0.1, bootstrap=-1), "bootstrap must be >= 0, got -1"),
        (lambda m: interval_from_moments(m, 0.1, ridge=-1.0), "ridge must be >= 0, got -1"),
        (
            lambda m: interval_from_moments(m, 0.1, bootstrap=2, bootstrap_method="x"),
            "bootstrap method must be 'ustat', 'basic' or 'percentile', got 'x'",
        ),
        (lambda m: unbiased_score_squared(m, ridge=-1.0), "ridge must be >= 0, got -1"),
        (
            lambda m: unbiased_score_squared(ProbeMoments.from_arrays(m.phi[:1, 0], m.g[:1, 0])),
            "the U-statistic needs n >= 2 examples",
        ),
        (lambda m: bootstrap_interval(m, 0.1, resamples=0), "bootstrap must be a positive integer (n >= 1), got 0"),
        (lambda m: ag_rms_upper(10, 1.0, None, 0.1), "missing constant grad_max"),
        (lambda m: ag_rms_upper(10, None, 1.0, 0.1), "missing constant ag_rms"),
        (lambda m: ag_rms_upper(10, -1.0, 1.0, 0.1), "ag_rms must be >= 0, got -1"),
        (lambda m: ag_rms_upper(10, 1.0, float("nan"), 0.1), "grad_max is NaN"),
        (lambda m: ag_rms_upper(0, 1.0, 1.0, 0.1), "n must be a positive integer (n >= 1), got 0"),
        (lambda m: ag_rms_upper(10, 1.0, 1.0, 1.0), "delta must be in (0, 1), got 1.0"),
    ],
)
def test_bad_arguments_give_these_exact_messages(call, message):
    """Each bad argument is named exactly (the whole message is compared, not a fragment)."""
    with pytest.raises(BoundError) as info:
        call(_probe_m())
    assert str(info.value) == message


def test_epsilon_is_used_as_given_and_the_default_seed_and_method():
    """``epsilon`` passes through unchanged; the bootstrap defaults are seed 0 and the U-statistic method."""
    m = _probe_m()
    it = interval_from_moments(m, 0.2, epsilon=0.37, bootstrap=7, dim=3)
    assert it.saturation_epsilon == 0.37
    assert it.bootstrap_interval == bootstrap_interval(m, 0.2, resamples=7, seed=0, method="ustat")
    assert it.bootstrap_interval != bootstrap_interval(m, 0.2, resamples=7, seed=1, method="ustat")


def test_leverage_derived_from_a_feature_norm_bound_with_a_ridge():
    """``L = B²/(μ + λ)`` from ``feature_norm_max`` (derived): the interval equals the one with that ``L`` given."""
    phi, g = _rows(n=2500, seed=10)
    m = ProbeMoments.from_arrays(phi, g)
    b = 1.01 * float(np.sqrt((phi**2).sum(1).max()))
    lam, mu = 0.3, 0.2
    kw = dict(ridge=lam, grad_max=10.0, eig_floor=mu, dim=3)
    derived = interval_from_moments(m, 0.2, feature_norm_max=b, **kw)
    given = interval_from_moments(m, 0.2, leverage_max=b * b / (mu + lam), **kw)
    assert derived.constants["leverage_max"].value == pytest.approx(b * b / (mu + lam), rel=1e-12)
    assert derived.constants["leverage_max"].source == "derived"
    assert derived.score_lower == pytest.approx(given.score_lower, rel=1e-12)
    assert derived.score_upper == pytest.approx(given.score_upper, rel=1e-12)
    assert derived.guaranteed and derived.constants["feature_norm_max"].value == b


@pytest.mark.parametrize("ridge", [0.0, 0.1])
def test_inverted_interval_message_names_the_constants_to_check(ridge):
    """γ below the lower end (probe maximum tampered so the γ check passes): refused, with the ends in the
    message; also with a ridge and no eigenvalue floor (no upper bound on the unregularized s)."""
    phi, g = _rows(n=1500, seed=1)
    m = ProbeMoments.from_arrays(phi, g)
    s_hat = _reference(phi, g, 0.2, gam=1.0, big_l=8.0, dim=3, ridge=ridge)["score"]
    gam = 0.2 * s_hat
    m.g_max = 0.1 * s_hat
    ref = _reference(phi, g, 0.2, gam=gam, big_l=8.0, dim=3, ridge=ridge)
    lower = ref["score"] * math.sqrt(1 - ref["relative_deviation_lower"]) - ref["epsilon_n"]
    assert lower > gam
    with pytest.raises(BoundError) as info:
        interval_from_moments(m, 0.2, ridge=ridge, grad_max=gam, leverage_max=8.0, dim=3)
    assert str(info.value) == (
        f"inconsistent constants: the interval would be inverted (lower end {lower:.4g} > upper end {gam:.4g}); "
        f"check grad_max, leverage_max, variance and eig_floor against the probe"
    )


def test_guaranteed_needs_both_gamma_and_l_from_outside_the_probe():
    m = _probe_m()
    both = interval_from_moments(m, 0.2, grad_max=50.0, leverage_max=50.0, dim=3)
    only_l = interval_from_moments(m, 0.2, leverage_max=50.0, dim=3)
    only_g = interval_from_moments(m, 0.2, grad_max=50.0, dim=3)
    assert (both.guaranteed, only_l.guaranteed, only_g.guaranteed) == (True, False, False)
    assert only_l.label.startswith("plug-in interval") and only_g.label.startswith("plug-in interval")


def test_saturation_certificate_at_and_just_below_the_upper_end():
    """Pure noise, a large probe: "certified ε-saturated" exactly when ε ≥ the written-out upper end."""
    phi, g = _rows(n=3000, signal=0.0, seed=12)
    g = g - g.mean(0)
    gam = 1.5 * float(np.linalg.norm(g, axis=1).max())
    ref = _reference(phi, g, 0.2, gam=gam, big_l=8.0, dim=3)
    assert ref["score_lower"] == 0.0 and ref["score_upper"] < gam
    m = ProbeMoments.from_arrays(phi, g)
    for factor, want in ((1.000001, Certificate.SATURATED), (0.999999, Certificate.NOT_CERTIFIED)):
        eps = factor * ref["score_upper"]
        it = interval_from_moments(m, 0.2, grad_max=gam, leverage_max=8.0, dim=3, epsilon=eps)
        assert it.certificate == want
    # with a ridge and no eigenvalue floor there is no upper end for s: never certified saturated
    it = interval_from_moments(m, 0.2, ridge=0.3, grad_max=gam, leverage_max=8.0, dim=3, epsilon=10 * gam)
    assert it.score_upper_unregularized is None and it.certificate == Certificate.NOT_CERTIFIED


def test_unbiased_field_is_none_for_one_example_and_the_pair_product_for_two():
    phi, g = _rows(n=2, seed=13)
    one = interval_from_moments(ProbeMoments.from_arrays(phi[:1], g[:1]), 0.2, grad_max=99.0, leverage_max=9.0)
    assert one.score_squared_unbiased is None
    two = interval_from_moments(ProbeMoments.from_arrays(phi, g), 0.2, grad_max=99.0, leverage_max=9.0, dim=3)
    assert two.score_squared_unbiased == pytest.approx(unbiased_score_squared(ProbeMoments.from_arrays(phi, g)))
    ref = _reference(phi, g, 0.2, gam=99.0, big_l=9.0, dim=3)
    assert two.score_squared_unbiased == pytest.approx(ref["score_squared_unbiased"], rel=1e-9, abs=1e-12)


def test_looseness_is_the_width_ratio_on_a_non_vacuous_interval():
    phi, g = _rows(n=1500, seed=1)
    m = ProbeMoments.from_arrays(phi, g)
    it = interval_from_moments(m, 0.2, grad_max=20.0, leverage_max=8.0, dim=3, bootstrap=5)
    assert it.score_lower > 0
    b = it.bootstrap_interval
    assert it.looseness == pytest.approx((it.score_upper - it.score_lower) / (b["upper"] - b["lower"]), rel=1e-12)


def test_constants_records_in_the_dictionary():
    """``to_dict()['constants']`` is each :class:`Constant`'s own record; the keys are the dataclass fields."""
    from dataclasses import fields

    from depthsat_theory.bounds.interval import ScoreInterval

    it = interval_from_moments(_probe_m(), 0.2, grad_max=50.0, leverage_max=50.0, dim=3)
    d = it.to_dict()
    assert set(d) == {f.name for f in fields(ScoreInterval)}
    assert d["constants"] == {k: c.to_dict() for k, c in it.constants.items()}


def test_matrix_and_variance_constants_carry_their_symbols_sources_and_notes():
    """The σ² and V constants name their symbol, source and justification (what `score --delta` prints)."""
    phi, g = _rows(n=1500, seed=1)
    m = ProbeMoments.from_arrays(phi, g)
    kw = dict(grad_max=20.0, leverage_max=8.0, dim=3)
    eb = interval_from_moments(m, 0.2, matrix_bound="empirical-bernstein", **kw)
    mv, var = eb.constants["matrix_variance"], eb.constants["variance"]
    psi = _reference(phi, g, 0.2, gam=20.0, big_l=8.0, dim=3, method="empirical-bernstein")["sig_hat2"]
    assert (mv.symbol, mv.source) == ("σ²", "probe")
    assert mv.note == (
        f"empirical-Bernstein upper bound on ‖E Ψ_x²‖ from σ̂² = {psi:.6g} (thm-empirical-bernstein; "
        f"rigorous given γ, L and D)"
    )
    v_hat = eb.variance_plugin
    assert (var.symbol, var.source) == ("V", "probe")
    assert var.note == (
        f"empirical-Bernstein upper bound on E‖G_x Σ_λ^{{+1/2}}‖² from v̂ = {v_hat:.6g} (rigorous given γ and L)"
    )
    bare = ProbeMoments.from_arrays(phi, g, keep=False)
    fb = interval_from_moments(bare, 0.2, matrix_bound="empirical-bernstein", **kw).constants["matrix_variance"]
    assert (fb.symbol, fb.value, fb.source) == ("σ²", 8.0, "derived")
    assert fb.note == "σ² ≤ L surely (the probe's rows were not kept: no probe estimate)"
    low = interval_from_moments(m, 0.2, matrix_bound="empirical-bernstein", grad_max=20.0, leverage_max=8.0, dim=4)
    assert low.constants["matrix_variance"].note == "σ² ≤ L surely (rank Σ̂ = 3 < D: no probe estimate)"
    vac = interval_from_moments(ProbeMoments.from_arrays(phi[:40], g[:40]), 0.2, **kw).constants["variance"]
    assert (vac.symbol, vac.value, vac.source) == ("V", pytest.approx(400.0 * 8.0), "derived")
    assert vac.note == "worst case R² (the bound is vacuous)"


def test_empirical_bernstein_with_a_small_ridge_uses_the_probe_even_below_full_rank():
    """With ``0 < λ ≤ 1`` and ``D`` above the probe's rank the ridge makes ``Ĉ`` invertible: σ̄² from the probe."""
    phi, g = _rows(n=2500, seed=1)
    it = interval_from_moments(
        ProbeMoments.from_arrays(phi, g),
        0.2,
        ridge=0.3,
        grad_max=20.0,
        leverage_max=8.0,
        dim=4,
        matrix_bound="empirical-bernstein",
    )
    assert it.constants["matrix_variance"].source == "probe" and it.constants["matrix_variance"].value < 8.0


def test_unregularized_upper_end_is_capped_at_a_given_gamma_only():
    phi, g = _rows(n=2500, seed=1)
    m = ProbeMoments.from_arrays(phi, g)
    gam_probe = float(np.linalg.norm(g, axis=1).max())
    kw = dict(ridge=0.3, eig_floor=0.001, leverage_max=8.0, dim=3)
    given = interval_from_moments(m, 0.2, grad_max=1.01 * gam_probe, **kw)
    assert given.score_upper * math.sqrt(1 + 0.3 / 0.001) > 1.01 * gam_probe
    assert given.score_upper_unregularized == 1.01 * gam_probe
    plug = interval_from_moments(m, 0.2, **kw)  # γ from the probe: no cap
    assert plug.score_upper_unregularized == pytest.approx(plug.score_upper * math.sqrt(1 + 0.3 / 0.001), rel=1e-12)
    assert plug.score_upper_unregularized > gam_probe
    notes = interval_from_moments(m, 0.2, ridge=0.3, grad_max=20.0, leverage_max=8.0, dim=3).notes
    assert (
        "with a ridge and no eig_floor, the upper end bounds s_λ only (s ≥ s_λ); give --eig-floor for a "
        "saturation certificate on s"
    ) in notes


def test_certificates_at_exact_equality_with_epsilon():
    """``ε`` equal to the upper end (or to the AG_rms bound) certifies: the rules are ``≤ ε``."""
    phi, g = _rows(n=3000, signal=0.0, seed=12)
    g = g - g.mean(0)
    m = ProbeMoments.from_arrays(phi, g)
    kw = dict(grad_max=30.0, leverage_max=8.0, dim=3)
    first = interval_from_moments(m, 0.2, **kw)
    assert first.score_lower == 0.0
    at = interval_from_moments(m, 0.2, epsilon=first.score_upper, **kw)
    assert at.certificate == Certificate.SATURATED
    ag = interval_from_moments(m, 0.2, epsilon=first.ag_rms_upper, **kw)
    assert ag.ag_certificate == Certificate.SATURATED


def test_bootstrap_of_one_resample_with_a_ridge_and_an_exact_zero_width():
    phi, g = _rows(n=200, seed=14)
    m = ProbeMoments.from_arrays(phi, g)
    it = interval_from_moments(m, 0.2, ridge=0.5, bootstrap=1, seed=3, dim=3)
    assert it.bootstrap_interval == bootstrap_interval(m, 0.2, resamples=1, ridge=0.5, seed=3)
    assert it.bootstrap_interval != bootstrap_interval(m, 0.2, resamples=1, ridge=0.0, seed=3)
    # one repeated example with integer values: every resample's statistic is exactly the same
    same = ProbeMoments.from_arrays(np.ones((6, 1)), np.full((6, 1), 2.0))
    flat = interval_from_moments(same, 0.2, bootstrap=4, grad_max=2.0, leverage_max=1.0, dim=1)
    assert flat.bootstrap_interval["lower"] == flat.bootstrap_interval["upper"] == 2.0
    assert flat.looseness is None


def test_user_bounds_the_probe_contradicts_are_refused():
    """A feature-norm bound below the probe's largest feature norm, or ``D`` below the probe's rank."""
    phi, g = _rows(n=300, seed=15)
    m = ProbeMoments.from_arrays(phi, g)
    b_probe = float(np.sqrt((phi**2).sum(1).max()))
    with pytest.raises(BoundError) as info:
        interval_from_moments(m, 0.2, grad_max=20.0, feature_norm_max=0.9 * b_probe, eig_floor=0.1)
    assert str(info.value) == (
        f"feature_norm_max={0.9 * b_probe:g} is below the probe's own max (Σ_t ‖φ̃_t‖²)^{{1/2}} = {b_probe:.4g}, "
        f"so it is not an almost-sure bound"
    )
    with pytest.raises(BoundError) as info:
        interval_from_moments(m, 0.2, grad_max=20.0, leverage_max=8.0, dim=2)
    assert str(info.value) == "dim=2 is below the probe's rank Σ̂ = 3 ≤ rank Σ, so it does not bound rank Σ"


def test_bootstrap_defaults_messages_and_smallest_probe():
    m = _probe_m()
    dflt = bootstrap_interval(m, 0.2)
    assert dflt == bootstrap_interval(m, 0.2, resamples=200, seed=0, method="ustat") and dflt["resamples"] == 200
    assert dflt != bootstrap_interval(m, 0.2, resamples=200, seed=1)
    phi, g = _rows(n=2, seed=16)
    assert math.isfinite(bootstrap_interval(ProbeMoments.from_arrays(phi, g), 0.2, resamples=5)["upper"])  # n = 2
    with pytest.raises(BoundError) as info:
        bootstrap_interval(ProbeMoments.from_arrays(phi[:1], g[:1]), 0.2)
    assert str(info.value) == (
        "the U-statistic bootstrap needs n >= 2 examples (the probe has n = 1); pass bootstrap=0 for no bootstrap "
        "interval"
    )
    with pytest.raises(BoundError) as info:
        bootstrap_interval(ProbeMoments.from_arrays(phi, g, keep=False), 0.2)
    assert str(info.value) == "the bootstrap needs the probe's rows in memory (keep_probe=True)"


def test_bootstrap_of_a_weighted_probe_resamples_by_multiplicity():
    """A probe of distinct rows with multiplicities: resamples are multinomial(n, w/n) over the rows."""
    phi, g = _rows(n=12, seed=17)
    w0 = np.arange(1, 13, dtype=float)
    n = int(w0.sum())
    m = ProbeMoments.from_arrays(phi, g, w0)
    got = bootstrap_interval(m, 0.2, resamples=30, seed=5, method="percentile")
    rng = np.random.default_rng(5)

    def s_of(w):
        sig = (phi * w[:, None]).T @ phi / n
        mean = (g * w[:, None]).T @ phi / n
        return math.sqrt(float(np.trace(mean @ np.linalg.pinv(sig) @ mean.T)))

    vals = [s_of(rng.multinomial(n, w0 / n).astype(float)) for _ in range(30)]
    lo, hi = np.quantile(vals, [0.1, 0.9])
    assert (got["lower"], got["upper"]) == (pytest.approx(lo, rel=1e-9), pytest.approx(hi, rel=1e-9))


def _dev_wc(n, big_l, dim, per, parts=3):
    u2 = math.log(2 * dim / (per / parts))
    l1 = max(big_l, 1.0)
    return math.sqrt(2 * l1 * u2 / n) + 2 * l1 * u2 / (3 * n)


def test_derived_l_the_probe_contradicts_is_refused_with_its_derivation():
    """``L = B²/(μ + λ)`` with an eigenvalue floor far above the probe's: a probe leverage above
    ``L/(1 − Δ_n)`` is an error naming where ``L`` came from."""
    phi, g = _rows(n=2000, seed=18)
    m = ProbeMoments.from_arrays(phi, g)
    b = 1.01 * float(np.sqrt((phi**2).sum(1).max()))
    lam, mu = 0.01, 2.0
    big_l = b * b / (mu + lam)
    inv = np.linalg.inv(phi.T @ phi / 2000 + lam * np.eye(3))
    lev = float(np.max(np.einsum("ik,kl,il->i", phi, inv, phi)))
    dev = _dev_wc(2000, big_l, 3, 0.2)
    assert lev > big_l / (1 - dev)
    with pytest.raises(BoundError) as info:
        interval_from_moments(m, 0.2, ridge=lam, grad_max=20.0, feature_norm_max=b, eig_floor=mu, dim=3)
    assert str(info.value) == (
        f"L = B²/(μ + λ) = {big_l:.4g} (from feature_norm_max with eig_floor/ridge) is below the probe's own max "
        f"leverage ℓ̂ = {lev:.4g} (with Σ̂; ℓ̂ ≤ L/(1 − Δ_n) = {big_l / (1 - dev):.4g} whenever the interval's "
        f"matrix event holds), so it is not an almost-sure bound"
    )


def test_probe_tension_thresholds_are_exact():
    """A user ``L`` with ``ℓ̂ = L/(1 − Δ_n)``, ``V = v̂`` and ``μ`` = the probe's smallest nonzero eigenvalue
    sit exactly on the thresholds: no error, no V or μ note (only the leverage note, since ``ℓ̂ > L``)."""
    phi, g = _rows(n=2000, seed=19)
    m = ProbeMoments.from_arrays(phi, g)
    lev = float(np.max(np.einsum("ik,kl,il->i", phi, np.linalg.pinv(phi.T @ phi / 2000), phi)))
    lo, hi = 1.0, lev  # L/(1 − Δ(L)) increases in L: solve L/(1 − Δ(L)) = ℓ̂
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if mid / (1 - _dev_wc(2000, mid, 3, 0.2, 2)) < lev else (lo, mid)
    big_l = hi
    assert abs(big_l / (1 - _dev_wc(2000, big_l, 3, 0.2, 2)) / lev - 1) < 1e-13  # V given: δ in two
    v_hat = interval_from_moments(m, 0.2, dim=3).variance_plugin
    ev = np.linalg.eigvalsh(m.sigma)
    it = interval_from_moments(m, 0.2, grad_max=20.0, leverage_max=big_l, dim=3, variance=v_hat)
    assert not any(x.startswith("--variance") for x in it.notes)
    assert any(x.startswith("the probe's largest leverage") for x in it.notes)
    ridge_it = interval_from_moments(m, 0.2, ridge=0.1, eig_floor=float(ev.min()), grad_max=20.0, leverage_max=50.0)
    assert not any(x.startswith("--eig-floor") for x in ridge_it.notes)
    low = interval_from_moments(m, 0.2, ridge=0.1, eig_floor=1.5 * float(ev.min()), grad_max=20.0, leverage_max=50.0)
    assert any(x.startswith("--eig-floor") for x in low.notes)


def test_eigenvalue_floor_note_on_small_and_on_rank_deficient_gram():
    """The μ note compares μ with the smallest eigenvalue above the cutoff ``rtol · λ_max``: on a Gram whose
    eigenvalues are all below 1, and on a rank-deficient Gram whose zero eigenvalue is rounding noise.

    The features are multiples of 1/16 and ``n = 2048``, so every product and partial sum of ``Σ̂`` is a small
    dyadic number: the repeated column gives two exactly equal rows of ``Σ̂`` (an exactly singular Gram) on any
    BLAS, and only ``eigvalsh``'s own rounding (a few ``u · λ_max``, below the cutoff ``24 u · λ_max``) is left."""
    phi, g = _rows(n=2048, seed=20)
    phi = np.round(phi * 16) / 16
    small = ProbeMoments.from_arrays(0.1 * phi, g)
    ev = np.linalg.eigvalsh(small.sigma)
    assert ev.max() < 1
    it = interval_from_moments(small, 0.2, ridge=0.01, eig_floor=2 * float(ev.min()), grad_max=20.0, leverage_max=900.0)
    assert any(x.startswith("--eig-floor") for x in it.notes)
    dup = np.hstack([phi[:, :1], phi[:, :1], phi[:, 1:]]) * 1024.0  # a repeated column, large scale
    m = ProbeMoments.from_arrays(dup, g)
    assert np.array_equal(m.sigma[0], m.sigma[1]) and np.array_equal(m.sigma, np.round(m.sigma))  # exact
    ev = np.linalg.eigvalsh(0.5 * (m.sigma + m.sigma.T))
    real = ev[ev > 1e-6 * ev.max()]
    assert ev.min() < 1e-6 * ev.max() and real.size == 3
    it = interval_from_moments(m, 0.2, ridge=1.0, eig_floor=0.5 * float(real.min()), grad_max=20.0, leverage_max=90.0)
    assert not any(x.startswith("--eig-floor") for x in it.notes)


def test_eigenvalue_floor_note_ignores_directions_below_the_cutoff():
    """The μ note uses eigenvalues above ``rtol · λ_max`` only: a resolved-away direction (eigenvalue
    2⁻³² ≈ 2.3e-10, ten times below the cutoff 2.8e-9 of a Gram with λ_max = 2²⁰) does not trigger it,
    and a Gram that is exactly zero has no nonzero eigenvalue to compare.

    The features are orthogonal ±1 Hadamard columns scaled by powers of two, so every product and
    partial sum of ``Σ̂`` is a small dyadic number: ``Σ̂ = diag(2²⁰, 2⁻³², 1)`` exactly in any summation
    order, and the eigenvalues of a diagonal matrix are its entries on any BLAS/LAPACK."""
    from scipy.linalg import hadamard

    n = 2048
    h = hadamard(n).astype(np.float64)
    near = np.stack([1024.0 * h[:, 1], 2.0**-16 * h[:, 2], h[:, 3]], 1)
    g = _rows(n=n, seed=20)[1]
    m = ProbeMoments.from_arrays(near, g)
    assert np.array_equal(m.sigma, np.diag([2.0**20, 2.0**-32, 1.0]))  # exact, whatever the BLAS
    ev = np.linalg.eigvalsh(0.5 * (m.sigma + m.sigma.T))
    assert np.array_equal(ev, [2.0**-32, 1.0, 2.0**20])
    cut = m.rtol * ev.max()
    assert 10 * m.rtol / ev.max() < ev[0] < 0.1 * cut and cut < ev[1]  # one direction inside (rtol/λ_max, rtol·λ_max)
    it = interval_from_moments(m, 0.2, ridge=1.0, eig_floor=0.5 * float(ev[1]), grad_max=20.0, leverage_max=90.0)
    assert not any(x.startswith("--eig-floor") for x in it.notes)
    zero = ProbeMoments.from_arrays(np.zeros((5, 3)), np.ones((5, 1)))
    it = interval_from_moments(zero, 0.2, ridge=0.1, eig_floor=0.5, grad_max=2.0, leverage_max=3.0, dim=3)
    assert not any(x.startswith("--eig-floor") for x in it.notes)
