"""The anytime-valid noise test (theory/decision.md, ``thm-anytime-noise-test``, ``rem-anytime-laws``).

Level: Monte Carlo on pure noise under optional stopping (every example of every batch is a look; the stream
stops at the first decision or at the budget), across the laws of the noise test's domain — ``g`` Gaussian,
Rademacher, Student t₃ (symmetric: proved) and centred exponential (skewed: measured only), with ``z``
Gaussian or ``z ≥ 0`` (``|N(0,1)|``), linear family with a bias.  Measured on the last full run
(400 probes per cell, budget 512, batches 16, 16, 32, …, 256): 0 to 3 of 400 per cell, pooled 6/3200 = 0.0019
(Clopper–Pearson 95% upper 0.0037) against α = 0.05, centred exponential included (0/400 in both sites).
With one χ² weight and a look every 16 examples up to 512, the naive loop "fixed-size χ² test after every
batch" rejected 0.27 of 300 pure-noise streams, the anytime test 0.007 of the same streams.  Power:
``g = a z₁ + ε``, decided within the forecast :func:`sequential_examples_needed` (+ the first batch) in 86–92%
of 100 streams and within twice it in all (a = 0.5: forecast 201, median 152; a = 0.25: forecast 512, median
340–350); the fixed-size ``examples_needed`` is 66 and 204: optional stopping costs about 2.5× the examples.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import binom

from depthsat_theory.decision import AnytimeNoiseTest, AnytimeSiteTest, sequential_examples_needed
from depthsat_theory.families import FamilyError, parse_family
from depthsat_theory.statistics import StatisticsError, statistics_for
from depthsat_theory.vocabulary import Verdict

LAWS = {
    "gaussian": lambda r, n: r.standard_normal(n),
    "rademacher": lambda r, n: r.choice([-1.0, 1.0], n),
    "t3": lambda r, n: r.standard_t(3, n),
    "centred exponential": lambda r, n: r.exponential(1.0, n) - 1.0,
}
SITES = {"z gaussian": lambda r, n: r.standard_normal((n, 2)), "z >= 0": lambda r, n: np.abs(r.standard_normal((n, 2)))}
BUDGET, FIRST = 512, 16


def schedule(budget: int = BUDGET, first: int = FIRST) -> list[int]:
    """Batches ``first, first, 2 first, 4 first, …`` up to ``budget``: a geometric schedule of looks."""
    out = [first]
    while sum(out) < budget:
        out.append(min(max(first, sum(out)), budget - sum(out)))
    return out


def stream(rng, law, site, *, signal: float = 0.0, budget: int = BUDGET) -> tuple[AnytimeNoiseTest, list]:
    """Feed batches until the test is done; returns it and the batches (for the naive comparison)."""
    test, seen = AnytimeNoiseTest(max_examples=budget), []
    for b in schedule(budget):
        z = site(rng, b)
        g = (LAWS[law](rng, b) + signal * z[:, 0])[:, None]
        phi = np.c_[z, np.ones(b)]
        seen.append((phi, g))
        test.update(phi, g)
        if test.done:
            break
    return test, seen


def naive_rejects(batches) -> bool:
    """The fixed-size noise test ``n ŝ²/v̂ > χ²_{1,0.95}`` re-run after every batch (numpy, independent)."""
    phi = np.zeros((0, batches[0][0].shape[1]))
    g = np.zeros((0, 1))
    for p, gg in batches:
        phi, g = np.r_[phi, p], np.r_[g, gg]
        n = len(g)
        sinv = np.linalg.pinv(phi.T @ phi / n)
        big_g = g.T @ phi / n
        s2 = float(np.trace(big_g @ sinv @ big_g.T))
        v = float(np.mean(g[:, 0] ** 2 * np.einsum("ik,kl,il->i", phi, sinv, phi)))
        if n * s2 > 3.8415 * v:
            return True
    return False


def _cell_rate(law, site, reps, seed):
    rng = np.random.default_rng(seed)
    return sum(stream(rng, law, SITES[site])[0].decided for _ in range(reps))


def test_level_under_optional_stopping_pooled():
    """Pure noise, every law and site of the domain: the pooled rate of "improvable" stays below α."""
    torch.set_num_threads(1)
    reps, hits, cells = 40, 0, 0
    for i, law in enumerate(LAWS):
        for j, site in enumerate(SITES):
            hits, cells = hits + _cell_rate(law, site, reps, seed=100 + 10 * i + j), cells + 1
    total = reps * cells
    # one-sided binomial test at 1%: the count must not be significantly above α·total
    assert binom.sf(hits - 1, total, 0.05) > 0.01, f"{hits}/{total} improvable on pure noise"


def test_naive_rerun_loop_breaks_the_level_where_the_anytime_test_holds_it():
    """One χ² weight (feature ``z``, no bias), a look every 16 examples up to 512, Gaussian pure noise.

    The fixed-size noise test re-run at every look ("rerun until significant") rejects well above α; the
    anytime test on the same streams does not.
    """
    torch.set_num_threads(1)
    rng = np.random.default_rng(21)
    reps, naive, hits = 60, 0, 0
    for _ in range(reps):
        batches = [(rng.standard_normal((16, 1)), rng.standard_normal((16, 1))) for _ in range(32)]
        naive += naive_rejects(batches)
        test = AnytimeNoiseTest()
        for p, g in batches:
            test.update(p, g)
        hits += test.decided
    assert naive / reps > 0.1, f"naive loop: {naive}/{reps}"
    assert binom.sf(hits - 1, reps, 0.05) > 0.01, f"anytime test: {hits}/{reps}"


@pytest.mark.slow
@pytest.mark.parametrize("law", list(LAWS))
@pytest.mark.parametrize("site", list(SITES))
def test_level_under_optional_stopping_per_cell(law, site):
    """400 pure-noise streams per (law, site): no cell significantly above α (one-sided binomial, 1%/8 cells)."""
    torch.set_num_threads(1)
    reps = 400
    hits = _cell_rate(law, site, reps, seed=sum(map(ord, law + site)))
    assert binom.sf(hits - 1, reps, 0.05) > 0.01 / 8, f"{law}, {site}: {hits}/{reps} improvable"


@pytest.mark.parametrize("a", [0.5, 0.25])
def test_power_decides_within_its_forecast(a):
    """Planted ``g = a z₁ + ε``: ``s² = a²``, ``v = 5a² + 3`` in closed form (z ~ N(0, I₂), bias).

    ``v = E[g² φ̃ᵀΣ⁻¹φ̃] = a² E[z₁²(z₁² + z₂² + 1)] + 3 E[ε²] = 5a² + 3``. Most streams decide within the
    forecast, all within twice it.
    """
    torch.set_num_threads(1)
    forecast = sequential_examples_needed(a * a, 5 * a * a + 3) + FIRST
    rng = np.random.default_rng(int(a * 1000))
    times = []
    for _ in range(40):
        test, _ = stream(rng, "gaussian", SITES["z gaussian"], signal=a, budget=4 * forecast)
        times.append(test.decided_at if test.decided else math.inf)
    times = np.array(times)
    assert np.mean(times <= forecast) >= 0.6, (forecast, np.sort(times))
    assert np.mean(times <= 2 * forecast) >= 0.95, (forecast, np.sort(times))


def test_e_value_matches_an_independent_computation():
    """Two batches: ``W`` from the first batch's ``Ĝ Σ̂⁺`` and ``sqrt(ŝ² v̂)`` (numpy pinv), then ``M`` in closed form."""
    rng = np.random.default_rng(3)
    z1, z2 = rng.standard_normal((20, 2)), rng.standard_normal((30, 2))
    p1, p2 = np.c_[z1, np.ones(20)], np.c_[z2, np.ones(30)]
    g1, g2 = (0.7 * z1[:, :1] + rng.standard_normal((20, 1))), (0.7 * z2[:, :1] + rng.standard_normal((30, 1)))
    test = AnytimeNoiseTest(alpha=1e-9, prior_examples=7.0)
    test.update(p1, g1)
    assert test.log_e == 0.0 and test.weighted == 0  # the first batch only sets the weights
    test.update(p2, g2)
    sinv = np.linalg.pinv(p1.T @ p1 / 20)
    big_g = g1.T @ p1 / 20
    s2 = float(np.trace(big_g @ sinv @ big_g.T))
    v = float(np.mean(g1[:, 0] ** 2 * np.einsum("ik,kl,il->i", p1, sinv, p1)))
    w = (g2[:, 0] * (p2 @ (sinv @ big_g.T))[:, 0]) / math.sqrt(s2 * v)
    s, vv = w.sum(), (w * w).sum()
    log_m = 0.5 * math.log(7.0 / (7.0 + vv)) + s * s / (2 * (7.0 + vv))
    assert test.log_e == pytest.approx(log_m, rel=1e-10)
    assert test.n == 50 and test.weighted == 30


def test_resume_from_state_matches_an_uninterrupted_stream():
    rng = np.random.default_rng(5)
    batches = [(rng.standard_normal((16, 3)), rng.standard_normal((16, 2))) for _ in range(5)]
    whole = AnytimeNoiseTest()
    for p, g in batches:
        whole.update(p, g)
    first = AnytimeNoiseTest()
    for p, g in batches[:2]:
        first.update(p, g)
    resumed = AnytimeNoiseTest()
    resumed.load_state_dict(first.state_dict())
    for p, g in batches[2:]:
        resumed.update(p, g)
    assert resumed.log_e == whole.log_e and resumed.n == whole.n and resumed.decided_at == whole.decided_at


def test_budget_spent_is_undetermined_with_a_reason():
    rng = np.random.default_rng(9)
    test = AnytimeNoiseTest(max_examples=32)
    while not test.done:
        z = rng.standard_normal((16, 2))
        test.update(np.c_[z, np.ones(16)], rng.standard_normal((16, 1)))
    assert test.budget_spent and not test.decided
    assert test.verdict is Verdict.UNDETERMINED
    assert test.reason.startswith("budget spent")


def test_bad_input_is_refused():
    with pytest.raises(StatisticsError, match="alpha"):
        AnytimeNoiseTest(alpha=1.5)
    with pytest.raises(StatisticsError, match="max_examples"):
        AnytimeNoiseTest(max_examples=0)
    t = AnytimeNoiseTest()
    with pytest.raises(StatisticsError, match="differ"):
        t.update(np.ones((4, 2)), np.ones((5, 1)))
    t.update(np.ones((4, 2)), np.ones((4, 1)))
    with pytest.raises(StatisticsError, match="earlier ones"):
        t.update(np.ones((4, 3)), np.ones((4, 1)))


def test_forecast_is_the_first_size_past_the_boundary():
    """``(n μ)²/(ρ + n) ≥ 2 ln(1/α) + ln(1 + n/ρ)`` holds at the forecast and fails one example before."""
    assert sequential_examples_needed(0.0, 1.0) is None
    ok = lambda n, mu2: n * n * mu2 / (100 + n) >= 2 * math.log(20) + math.log(1 + n / 100)  # noqa: E731
    previous = 0
    for s2 in (0.5, 0.1, 0.01, 0.001):
        n = sequential_examples_needed(s2, 1.0)
        assert n is not None and ok(n, s2) and not ok(n - 1, s2) and n > previous
        previous = n


def test_site_test_streams_the_same_sums_as_the_feature_statistics():
    """A padded sequence site, linear family: the site test's ``ŝ²_U`` equals the engine's after the same batches."""
    gen = torch.Generator().manual_seed(4)
    fam = parse_family("linear")
    site = AnytimeSiteTest(fam, (5, 3), "sequence")
    stats = statistics_for(fam, (5, 3), "sequence")
    for _ in range(3):
        z = torch.randn(8, 5, 3, generator=gen, dtype=torch.float64)
        mask = torch.ones(8, 5, dtype=torch.bool)
        mask[:, 3:] = torch.rand(8, 2, generator=gen) < 0.5
        g = torch.randn(8, 5, 3, generator=gen, dtype=torch.float64) * mask[..., None]
        site.update_site(z, g, mask)
        stats.update(z, g, mask)
    res = stats.result()
    assert site.n == res.n == 24
    assert site.score_squared_unbiased == pytest.approx(res.score_squared_unbiased, rel=1e-9, abs=1e-12)
    with pytest.raises(FamilyError, match="feature family"):
        AnytimeSiteTest(object(), (3,), "vector")


def test_level_holds_without_moments_for_symmetric_gradients():
    """Cauchy ``g`` (no mean, no variance), ``z ≥ 0`` with a bias: (S) holds, so the level holds (no moment assumed)."""
    torch.set_num_threads(1)
    rng = np.random.default_rng(33)
    reps, hits = 80, 0
    for _ in range(reps):
        test = AnytimeNoiseTest(max_examples=256)
        for b in schedule(256):
            z = np.abs(rng.standard_normal((b, 2)))
            test.update(np.c_[z, np.ones(b)], rng.standard_cauchy((b, 1)))
        hits += test.decided
    assert binom.sf(hits - 1, reps, 0.05) > 0.01, f"{hits}/{reps} improvable on Cauchy pure noise"
