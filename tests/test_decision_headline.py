"""The headline: bias-corrected score, its interval, the plug-in's chance level (theory/decision.md).

Truth: exact enumeration (every Rademacher sign pattern of a probe with fixed features: ``prop-plugin-chance-level``),
closed forms, and Monte Carlo coverage on fixed designs (the interval is for the Gram as measured).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from depthsat_theory.decision import headline, headline_from_moments
from depthsat_theory.families import parse_family
from depthsat_theory.statistics import StatisticsError, statistics_for


def site_result(z: np.ndarray, g: np.ndarray):
    stats = statistics_for(parse_family("linear"), (z.shape[1],), "vector")
    stats.update(torch.from_numpy(z), torch.from_numpy(g))
    return stats.result()


def test_chance_level_and_unbiasedness_by_exact_enumeration():
    """Fixed dyadic features, ``g`` Rademacher: over all ``2ⁿ`` sign patterns ``E ŝ² = rank/n`` and ``E ŝ²_U = 0``.

    With fixed features the probe's Gram is the population's, so ``prop-plugin-chance-level`` is exact:
    ``E ŝ² = (1/n²) tr(Φ Σ⁻¹ Φᵀ) = rank/n`` (``AG_rms = 1``); ``v̂ = rank`` on every pattern.
    """
    z = np.array([[0.5], [-1.0], [0.25], [2.0], [-0.75], [1.5]])
    n, rank = len(z), 2  # linear family with a bias: features (z, 1)
    s2 = s2u = 0.0
    patterns = list(itertools.product([-1.0, 1.0], repeat=n))
    for signs in patterns:
        res = site_result(z, np.array(signs)[:, None])
        head = headline(res)
        assert res.noise_variance == pytest.approx(rank, rel=1e-12)
        assert head.chance == pytest.approx(math.sqrt(rank / n), rel=1e-12)
        assert head.relative_chance == pytest.approx(math.sqrt(rank / n), rel=1e-12)  # AG_rms = 1
        s2 += res.score**2
        s2u += res.score_squared_unbiased
    assert s2 / len(patterns) == pytest.approx(rank / n, rel=1e-10)
    assert s2u / len(patterns) == pytest.approx(0.0, abs=1e-12)


def test_pure_noise_reads_zero_within_the_interval_not_the_chance_level():
    """Pure noise at ``k̃ = 17``, ``n = 256``: the plug-in reads ``≈ sqrt(k̃/n) = 0.26``, the headline 0 ± interval.

    Over 200 probes: the interval contains ``s = 0`` at least at ``1 − α`` within Monte Carlo error; the
    plug-in's mean relative score is within 10% of the chance level; the headline's mean ``s_U/AG_rms`` is
    below a third of it.
    """
    rng = np.random.default_rng(0)
    d, n, reps = 16, 256, 200
    covered, rel_plugin, rel_head = 0, [], []
    for _ in range(reps):
        res = site_result(rng.standard_normal((n, d)), rng.standard_normal((n, d)) * 0.1)
        head = headline(res)
        covered += head.low == 0.0
        rel_plugin.append(head.relative_plugin)
        rel_head.append(head.relative_score)
    chance = math.sqrt(17 / n)
    assert covered / reps >= 0.95 - 3 * math.sqrt(0.05 * 0.95 / reps)
    assert np.mean(rel_plugin) == pytest.approx(chance, rel=0.1)
    assert np.mean(rel_head) < chance / 3


def test_interval_covers_a_planted_score_on_a_fixed_design():
    """Fixed features, ``g = a z₁ + ε``: the target ``s² = a² · (probe mean of (Π z₁)²)`` is known exactly."""
    rng = np.random.default_rng(1)
    n, d, a, reps = 400, 2, 0.3, 200
    z = rng.standard_normal((n, d))
    e1 = np.zeros((1, d))
    e1[0, 0] = 1.0
    # Π(a z₁ e₁) = a z₁ e₁ (z₁ is a feature): s² = a² · mean z₁²
    s_true = a * math.sqrt(float(np.mean(z[:, 0] ** 2)))
    covered = 0
    for _ in range(reps):
        g = a * z[:, :1] * e1 + rng.standard_normal((n, d))
        head = headline(site_result(z, g))
        covered += head.low <= s_true <= head.high
    assert covered / reps >= 0.95 - 3 * math.sqrt(0.05 * 0.95 / reps)


def test_headline_closed_form_and_errors():
    head = headline_from_moments(score=0.5, noise_variance=1.0, n=101, ag_rms=2.0)
    s2u = (101 * 0.25 - 1.0) / 100
    assert head.score == pytest.approx(math.sqrt(s2u), rel=1e-15)
    assert head.relative_score == pytest.approx(math.sqrt(s2u) / 2, rel=1e-15)
    assert head.chance == pytest.approx(math.sqrt(1 / 101), rel=1e-15)
    assert head.low > 0  # n ŝ²/v̂ = 25.25 > χ²_{1,0.975} = 5.02
    low_noise = headline_from_moments(score=0.05, noise_variance=1.0, n=101, ag_rms=2.0)
    assert low_noise.score == 0.0 and low_noise.low == 0.0 and low_noise.high > 0
    with pytest.raises(StatisticsError, match="at least 2"):
        headline_from_moments(score=0.1, noise_variance=1.0, n=1, ag_rms=1.0)
    with pytest.raises(StatisticsError, match="noise_variance"):
        headline_from_moments(score=0.1, noise_variance=math.nan, n=10, ag_rms=1.0)
    with pytest.raises(StatisticsError, match="alpha"):
        headline_from_moments(score=0.1, noise_variance=1.0, n=10, ag_rms=1.0, alpha=0.5)
    assert set(head.to_dict()) >= {"score", "relative_score", "low", "high", "plugin", "chance"}
