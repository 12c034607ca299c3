"""The unit path of :class:`FeatureStatistics` (theory/numerics.md, ``thm-unit-gram``) against independent truth.

The unit path keeps the feature rows and factors them once (a thin SVD of the scaled rows) instead
of streaming the ``k̃ × k̃`` Gram.  Truth here is the exact score of the stored arrays in rational
arithmetic (:func:`proofs_checks.t8_numerics.exact_score`, no engine code), a float64 least-squares
fit in numpy, or the features path's streamed sums (checked bit for bit where the unit path replays
its batches into them).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from depthsat_theory import parse_family
from depthsat_theory.families import FeatureFamily
from depthsat_theory.statistics import FeatureStatistics, StatisticsError
from depthsat_theory.statistics.feature import UNIT_GRAM_MAX_FRACTION, UNIT_GRAM_MIN_K, _UnitNoiseMoment
from depthsat_theory.vocabulary import Verdict
from proofs_checks.t8_numerics import exact_score, near_threshold_probe


def _stats(family, z, g, gram, *, batch=7, layout="vector", mask=None, **kw):
    fam = parse_family(family)
    assert isinstance(fam, FeatureFamily)
    st = FeatureStatistics(fam, tuple(z.shape[1:]), layout, gram=gram, **kw)
    for i in range(0, z.shape[0], batch):
        st.update(z[i : i + batch], g[i : i + batch], None if mask is None else mask[i : i + batch])
    return st


def _lstsq_score(z: np.ndarray, g: np.ndarray, family: str) -> float:
    """``s`` by a float64 least-squares fit of ``g`` on the features (numpy ``lstsq``; no engine code)."""
    fam = parse_family(family)
    phi = fam.augmented_features(fam.frozen_feature_map((z.shape[1],), "vector"), torch.from_numpy(z)).reshape(
        z.shape[0], -1
    )
    phi = phi.numpy()
    coef = np.linalg.lstsq(phi, g, rcond=None)[0]
    return float(np.sqrt(np.sum((phi @ coef) ** 2) / z.shape[0]))


def _instance(kind: str, n: int, d: int, dtype, seed: int):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, d))
    g = rng.standard_normal((n, d))
    if kind == "duplicates":  # few distinct units, g with a per-unit mean: rank ≤ 5, a real signal
        idx = rng.integers(0, 5, n)
        z = z[idx]
        g = 0.3 * g + rng.standard_normal((5, d))[idx]
    elif kind == "cancelling":  # every unit twice with opposite g: G = 0 exactly, rank-deficient
        z = np.repeat(z[: n // 2], 2, axis=0)
        g = np.stack([g[: n // 2], -g[: n // 2]], 1).reshape(-1, d)
        perm = rng.permutation(z.shape[0])
        z, g = z[perm], g[perm]
    elif kind == "low-rank":  # z in a 2-dimensional subspace: the linear family's Σ has rank 3
        z = rng.standard_normal((n, 2)) @ rng.standard_normal((2, d))
    return torch.from_numpy(z).to(dtype), torch.from_numpy(g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("family", ["linear", "relu:48", "tanh:24"])
@pytest.mark.parametrize(
    ("kind", "n"),
    [("random", 12), ("random", 40), ("random", 150), ("duplicates", 60), ("cancelling", 30), ("low-rank", 90)],
)
def test_unit_path_gives_the_features_path_score_and_verdict(kind, n, family, dtype):
    """Same ``ŝ`` within both rounding bounds, same rank, verdict, ``v̂`` and unresolved count, and
    both within their bound of a float64 least-squares fit (N below, near and above ``k̃``)."""
    z, g = _instance(kind, n, 6, dtype, seed=n)
    feat = _stats(family, z, g, "features").result()
    unit = _stats(family, z, g, "units").result()
    assert abs(unit.score - feat.score) <= unit.score_error + feat.score_error
    assert unit.tangent_rank == feat.tangent_rank
    assert unit.verdict is feat.verdict and unit.probe_verdict is feat.probe_verdict
    assert unit.unresolved == feat.unresolved
    assert unit.noise_variance == pytest.approx(feat.noise_variance, rel=1e-9, abs=1e-12 * unit.ag_rms**2)
    if dtype == torch.float64:
        ref = _lstsq_score(z.numpy(), g.numpy(), family)
        assert abs(unit.score - ref) <= unit.score_error + 1e-9 * unit.ag_rms
    if kind == "cancelling":
        assert unit.verdict is not Verdict.IMPROVABLE
    if kind == "duplicates" and n == 60:
        assert unit.verdict is Verdict.IMPROVABLE  # a real per-unit signal: the noise test sees it


@pytest.mark.parametrize("eps", [1e-2, 2e-6])
def test_unit_path_exactly_cancelling_pairs_are_saturated(eps):
    """G = 0 exactly on the stored arrays (rational truth), nearly collinear float64 features: saturated."""
    z, g, _ = near_threshold_probe(np.random.default_rng(3), eps, 500, torch.float64)
    assert exact_score(z.numpy(), g.numpy()) == 0.0
    res = _stats("linear", z, g, "units", batch=256).result()
    assert res.verdict is Verdict.SATURATED and res.score <= res.score_error


def test_unit_path_planted_signal_is_improvable_within_its_bound():
    """Exact s = 3 e of the features path (rational truth): the unit path is improvable and within its bound."""
    z, g, v = near_threshold_probe(np.random.default_rng(5), 1e-3, 200, torch.float64)
    base = _stats("linear", z, g, "features", batch=400).result()
    vv = np.stack([v, v], 1) / np.sqrt(np.mean(2 * v * v))
    g2 = g + torch.from_numpy(3 * base.score_error * vv)
    truth = exact_score(z.numpy(), g2.numpy())
    res = _stats("linear", z, g2, "units", batch=100).result()
    assert truth > 2 * res.score_error
    assert res.probe_verdict is Verdict.IMPROVABLE
    assert abs(res.score - truth) <= res.score_error


@pytest.mark.parametrize(("eps", "dtype"), [(1e-4, torch.float32), (1e-14, torch.float64)])
def test_unit_path_small_or_vacuous_direction_carrying_the_gradient_is_never_saturated(eps, dtype):
    """``z = (t, t + ε w)``, ``g`` along ``w``: exact ``s ≈ AG_rms`` (rationals). At ``ε = 1e-4`` (float32) the
    direction is resolvable and the site improvable; at ``1e-14`` (float64) it may not be called saturated."""
    rng = np.random.default_rng(0)
    t, w = rng.standard_normal(300), rng.standard_normal(300)
    z = torch.from_numpy(np.stack([t, t + eps * w], 1)).to(dtype)
    zs = z.double().numpy()
    v = zs[:, 1] - zs[:, 0]
    g = torch.from_numpy(np.stack([v, v], 1) / np.sqrt(np.mean(2 * v * v))).to(dtype)
    truth = exact_score(z.double().numpy(), g.double().numpy())
    res = _stats("linear", z, g, "units", batch=100).result()
    assert truth == pytest.approx(res.ag_rms, rel=1e-3)
    assert res.probe_verdict is not Verdict.SATURATED
    if dtype == torch.float32:
        assert res.verdict is Verdict.IMPROVABLE and abs(res.score - truth) <= res.score_error


@pytest.mark.parametrize("orthogonal", [False, True])
def test_unit_path_real_direction_below_the_data_resolution(orthogonal):
    """float32 ``z₂ = z₁ + 3e-7 w`` (below the data resolution): with ``g`` along ``w`` (exact s ≈ AG_rms) the
    unit path may not say saturated; with ``g`` orthogonal to it (exact s ≈ 0) it says saturated."""
    rng = np.random.default_rng(0)
    n, d = 400, 8
    z = rng.standard_normal((n, d))
    w = rng.standard_normal(n)
    z[:, 1] = z[:, 0] + 3e-7 * w
    zz = z.astype(np.float32).astype(np.float64)
    cols = [zz[:, [0, *range(2, d)]], np.ones((n, 1))] + ([zz[:, [1]] - zz[:, [0]]] if orthogonal else [])
    design = np.concatenate(cols, 1)
    wr = w - design @ np.linalg.lstsq(design, w, rcond=None)[0]
    g = np.zeros((n, d))
    g[:, 0] = wr
    zt, gt = torch.from_numpy(zz.astype(np.float32)), torch.from_numpy(g.astype(np.float32))
    truth = exact_score(zt.double().numpy(), gt.double().numpy())
    res = _stats("linear", zt, gt, "units", batch=128).result()
    if orthogonal:
        assert truth <= res.score_error and res.verdict is Verdict.SATURATED
    else:
        assert truth > 0.5 * res.ag_rms and res.verdict is not Verdict.SATURATED


def test_auto_replays_its_batches_into_sigma_bit_for_bit():
    """``gram="auto"`` at a wide site keeps the rows while they are few, then replays them: the state is
    then bitwise the features path's; before that, ``state_dict`` replays too (checkpoints, all-reduce)."""
    fam = "relu:1024:0"
    assert parse_family(fam).augmented_dim((4,), "vector") >= UNIT_GRAM_MIN_K
    gen = torch.Generator().manual_seed(0)
    limit = int(UNIT_GRAM_MAX_FRACTION * 1025)
    z, g = torch.randn(limit + 40, 4, generator=gen), torch.randn(limit + 40, 4, generator=gen)
    few = _stats(fam, z[:100], g[:100], "auto", batch=32)
    assert few._kept  # the unit path: no k̃² work so far
    ref_few = _stats(fam, z[:100], g[:100], "features", batch=32)
    r_unit, r_feat = few.result(), ref_few.result()
    assert abs(r_unit.score - r_feat.score) <= r_unit.score_error + r_feat.score_error
    assert r_unit.verdict is r_feat.verdict
    sd, ref_sd = few.state_dict(), ref_few.state_dict()
    assert not few._kept and sd.keys() == ref_sd.keys()
    assert all(torch.equal(sd[k], ref_sd[k]) for k in sd)
    many = _stats(fam, z, g, "auto", batch=32)
    ref = _stats(fam, z, g, "features", batch=32)
    assert many._kept is None  # past the limit: replayed, then the features path
    assert torch.equal(many.states["sigma"], ref.states["sigma"]) and torch.equal(
        many.states["q_sum"], ref.states["q_sum"]
    )
    assert many.result().score == ref.result().score


def test_unit_path_shards_merge_like_the_features_path():
    gen = torch.Generator().manual_seed(1)
    z, g = torch.randn(60, 5, generator=gen), torch.randn(60, 5, generator=gen)
    a, b = _stats("relu:40", z[:30], g[:30], "units"), _stats("relu:40", z[30:], g[30:], "units")
    fa, fb = _stats("relu:40", z[:30], g[:30], "features"), _stats("relu:40", z[30:], g[30:], "features")
    a.merge(b)
    fa.merge(fb)
    assert torch.equal(a.states["sigma"], fa.states["sigma"]) and a.result().score == fa.result().score


def test_unit_path_padded_sequences_and_the_noise_moment_operator():
    """Sequence site with padding: the unit path's ``ŝ``, ``v̂`` and ``E[XᵀX] u`` equal the features path's."""
    gen = torch.Generator().manual_seed(2)
    b, t, d = 12, 5, 4
    z, g = torch.randn(b, t, d, generator=gen, dtype=torch.float64), torch.randn(b, t, d, generator=gen)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[::3, 3:] = False
    g = (g * mask[..., None]).double()
    feat = _stats("relu:64", z, g, "features", layout="sequence", mask=mask, batch=4)
    unit = _stats("relu:64", z, g, "units", layout="sequence", mask=mask, batch=4)
    op = _UnitNoiseMoment(list(unit._kept or []), unit.n)
    u = np.random.default_rng(0).standard_normal((65, 3))
    np.testing.assert_allclose(op @ u, feat.noise_moment() @ u, rtol=1e-10, atol=1e-12)
    rf, ru = feat.result(), unit.result()
    assert abs(rf.score - ru.score) <= rf.score_error + ru.score_error
    assert ru.noise_variance == pytest.approx(rf.noise_variance, rel=1e-9)
    assert ru.verdict is rf.verdict and ru.units == rf.units == int(mask.sum())


def test_unit_path_with_tie_pooling_gives_the_same_raw_score_and_defect():
    z, g = _instance("duplicates", 40, 3, torch.float64, seed=4)
    rf = _stats("relu:30", z, g, "features", pool_ties=True).result()
    ru = _stats("relu:30", z, g, "units", pool_ties=True).result()
    assert ru.raw_score == pytest.approx(rf.raw_score, rel=1e-12)
    assert ru.realizability_defect == pytest.approx(rf.realizability_defect, rel=1e-6, abs=1e-9)


def test_statistics_for_passes_the_gram_choice():
    from depthsat_theory.statistics import statistics_for

    fam = parse_family("relu:16")
    assert statistics_for(fam, (3,), "vector", gram="units")._kept == []  # type: ignore[union-attr]
    assert statistics_for(fam, (3,), "vector")._kept is None  # type: ignore[union-attr]  # k̃ = 17: Gram path


def test_unknown_gram_is_a_one_line_error():
    fam = parse_family("linear")
    assert isinstance(fam, FeatureFamily)
    with pytest.raises(StatisticsError, match="gram='dense'"):
        FeatureStatistics(fam, (3,), "vector", gram="dense")
