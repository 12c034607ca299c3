"""Kink ties, the saddle score, finite-step decreases and the joint score.

Independent truths: hand-counted ties on constructed tensors; the exact example ``ex-saddle``
(``σ = 1/√11``, sympy in proofs_checks); a dense SVD of the whitened cross block; closed forms of
the decrease bounds; ``(Σ s²)^{1/2}`` recomputed from the per-site scores.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from depthsat_theory.capture.kinks import KinkCounter, kink_ties
from depthsat_theory.diagnose import diagnose
from depthsat_theory.diagnose.errors import DiagnoseError
from depthsat_theory.families import parse_family
from depthsat_theory.statistics.decrease import (
    best_decrease_bound,
    cross_entropy_smoothness,
    decrease_upper_bound,
    epsilon_from_nats,
    guaranteed_decrease,
    squared_error_decrease,
)
from depthsat_theory.statistics.secondorder import CrossBlockStatistics, saddle_score_from_blocks
from depthsat_theory.tasks import ResidualMLP, classification_loss
from depthsat_theory.vocabulary import Verdict


def _req(t):
    return t.clone().requires_grad_(True)


def test_kink_ties_count_each_primitive():
    x = _req(torch.tensor([0.0, 1.0, -2.0, 0.0, 3.0]))
    assert kink_ties(F.relu, (x,)) == 2
    assert kink_ties(torch.abs, (x,)) == 2
    assert kink_ties(F.hardtanh, (x, -2.0, 1.0)) == 2  # −2 and 1
    assert kink_ties(torch.clamp, (x, None, 3.0)) == 1
    assert kink_ties(torch.max, (x,)) == 0  # 3 is attained once
    assert kink_ties(torch.maximum, (x, _req(torch.tensor([0.0, 2.0, -2.0, 1.0, 0.0])))) == 2
    assert kink_ties(F.relu, (x.detach(),)) == 0  # no gradient: cannot depend on the site
    pool = _req(torch.tensor([[[[1.0, 1.0, 0.0, 2.0], [0.0, 0.0, 2.0, 2.0]]]]))
    # 2×2 windows: {1,1,0,0} one extra attainment; {0,2,2,2} two extra
    assert kink_ties(F.max_pool2d, (pool, 2)) == 3
    rows = _req(torch.tensor([[1.0, 1.0, 0.0], [2.0, 1.0, 2.0]]))
    assert kink_ties(torch.amax, (rows, 1)) == 2


@pytest.mark.parametrize(
    ("func", "extra"),
    [
        (torch.clamp_min, (0.0,)),
        (torch.Tensor.clamp_min, (0.0,)),
        (torch.clamp_max, (0.0,)),
        (F.prelu, (torch.tensor([0.25]),)),
        (F.rrelu, (0.1, 0.3, False)),
        (F.elu, (0.5,)),
        (F.selu, ()),
        (F.hardshrink, (0.0,)),
        (F.softshrink, (0.0,)),
    ],
)
def test_kink_ties_elementwise_kinks_beyond_relu(func, extra):
    """Each has a kink (or jump) at 0 for these arguments: the zeros of ``x`` are the ties (hand count)."""
    x = _req(torch.tensor([[0.0, 1.0, -2.0], [0.0, 0.0, 3.0]]))
    assert kink_ties(func, (x, *extra)) == 3


def test_kink_ties_smooth_variants_are_not_counted():
    x = _req(torch.zeros(5))
    assert kink_ties(F.elu, (x, 1.0)) == 0  # alpha = 1: C¹ at 0
    assert kink_ties(F.softshrink, (x + 0.5, 0.5)) == 5  # kink at ±λ
    assert kink_ties(F.softshrink, (x, 0.5)) == 0


def _binary_pool_ties(x: torch.Tensor, pool_kw: dict, ndim: int) -> int:
    """Independent count on a 0/1 tensor from torch's sum pooling (avg_pool, divisor 1).

    Per window: the max is 1 iff it holds a one; the extra attainments are (#ones − 1), else
    (#in-bound elements − 1); ``avg_pool`` with zero padding and ``divisor_override=1`` sums them.
    """
    avg = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[ndim]
    mx = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[ndim]
    if ndim == 1:
        ones = F.avg_pool2d(
            x.unsqueeze(-2),
            (1, pool_kw["kernel_size"]),
            (1, pool_kw["stride"]),
            (0, pool_kw["padding"]),
            pool_kw["ceil_mode"],
            True,
            1,
        ).squeeze(-2)
        size = F.avg_pool2d(
            torch.ones_like(x).unsqueeze(-2),
            (1, pool_kw["kernel_size"]),
            (1, pool_kw["stride"]),
            (0, pool_kw["padding"]),
            pool_kw["ceil_mode"],
            True,
            1,
        ).squeeze(-2)
    else:
        kw = dict(pool_kw, count_include_pad=True, divisor_override=1)
        ones, size = avg(x, **kw), avg(torch.ones_like(x), **kw)
    m = mx(x, **pool_kw)
    return int(torch.where(m == 1, ones - 1, size - 1).sum())


@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize(
    ("k", "s", "p", "ceil"), [(2, 2, 0, False), (3, 2, 1, True), (2, 3, 1, True), (3, 1, 1, False)]
)
@pytest.mark.parametrize("indices", [False, True])
def test_kink_ties_max_pool_any_dim_ceil_padding_indices(ndim, k, s, p, ceil, indices):
    gen = torch.Generator().manual_seed(ndim * 100 + k * 10 + s)
    x = _req(torch.randint(0, 2, (2, 3, *([5] * ndim)), generator=gen).double())
    kw = {"kernel_size": k, "stride": s, "padding": p, "ceil_mode": ceil}
    expected = _binary_pool_ties(x.detach(), kw, ndim)
    plain = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[ndim]
    with_idx = {1: F.max_pool1d_with_indices, 2: F.max_pool2d_with_indices, 3: F.max_pool3d_with_indices}[ndim]
    func = with_idx if indices else plain
    assert kink_ties(func, (x, k, s, p, 1, ceil)) == expected


def test_kink_ties_adaptive_max_pool_hand_count():
    """Length 5 into 3: torch's windows [0,2), [1,4), [3,5); constant input: 1 + 2 + 1 extra per row."""
    x = _req(torch.ones(2, 3, 5))
    assert kink_ties(F.adaptive_max_pool1d, (x, 3)) == 4 * 6
    assert kink_ties(F.adaptive_max_pool1d_with_indices, (x, 3)) == 4 * 6
    img = _req(torch.ones(1, 1, 5, 4))
    # rows [0,2),[1,4),[3,5) × columns [0,2),[2,4): sizes 2·2, 3·2, 2·2 → 3 + 5 + 3, twice
    assert kink_ties(F.adaptive_max_pool2d, (img, (3, 2))) == 2 * (3 + 5 + 3)
    assert kink_ties(F.adaptive_max_pool2d, (img, 1)) == 19
    assert kink_ties(F.adaptive_max_pool3d, (_req(torch.ones(1, 2, 2, 2)), 1)) == 7


def test_clamp_kink_ties_stop_a_wrong_improvable_verdict():
    """``clamp_min(z, 0) + clamp_max(z, 0) = z`` exactly, so ``L(z) = z − that ≡ 0``: ``J`` is constant,
    ``b = 0``; autograd passes 1 through both clamps at ``z = 0`` and says ``b = −1`` (improvable)."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.site = nn.Linear(1, 1)
            with torch.no_grad():
                self.site.weight.zero_()
                self.site.bias.zero_()

        def forward(self, x):
            z = self.site(x)
            return z - z.clamp_min(0) - z.clamp_max(0)

    x = torch.randn(8, 1, dtype=torch.float64)
    net = Net().double()
    with torch.no_grad():
        for t in (1e-3, -1e-3):  # J(θ) is constant along the bias family
            net.site.bias.fill_(t)
            assert net(x).abs().max() == 0
        net.site.bias.zero_()
    res = diagnose(net, lambda out, _y: out.sum(1), [(x, torch.zeros(8))], sites=["site"])
    r = res["site"].result
    assert r.kink_ties == 16
    assert r.verdict is Verdict.UNDETERMINED


def test_l1_loss_ties_stop_a_wrong_improvable_verdict():
    """Residuals ``r = (0, 0, −1)`` of a bias family ``θ``: ``J(θ) = (|θ| + |θ| + |θ − 1|)/3``.

    By hand ``J(t) = (1 + t)/3`` and ``J(−t) = (1 + 3t)/3`` for ``0 < t < 1``: the origin is a strict
    minimum (no block helps), but autograd takes ``sign(0) = 0`` and returns ``b = −1/3`` ("improvable").
    """

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.site = nn.Linear(1, 1)
            with torch.no_grad():
                self.site.weight.zero_()
                self.site.bias.zero_()

        def forward(self, x):
            return self.site(x)

    x = torch.zeros(3, 1, dtype=torch.float64)
    y = torch.tensor([[0.0], [0.0], [1.0]], dtype=torch.float64)
    net = Net().double()

    def loss(out, t):
        return F.l1_loss(out, t, reduction="none").sum(1)

    for t, want in ((0.25, (1 + 0.25) / 3), (-0.25, (1 + 3 * 0.25) / 3)):
        with torch.no_grad():
            net.site.bias.fill_(t)
            assert float(loss(net(x), y).mean()) == pytest.approx(want, rel=1e-15) and want > 1 / 3
    with torch.no_grad():
        net.site.bias.zero_()
    res = diagnose(net, loss, [(x, y)], sites=["site"])
    r = res["site"].result
    assert r.kink_ties == 2 and r.verdict is Verdict.UNDETERMINED


def test_kink_ties_when_only_the_second_operand_depends_on_the_site():
    """``maximum(0, z)`` is ``relu(z)``; ``l1_loss(y, out)`` is ``|y − out|``: hand count of the ties."""
    z = _req(torch.tensor([0.0, 1.0, -2.0, 0.0]))
    zeros = torch.zeros(4)
    assert kink_ties(torch.maximum, (zeros, z)) == 2
    assert kink_ties(torch.max, (zeros, z)) == 2
    assert kink_ties(F.l1_loss, (zeros, z)) == 2
    assert kink_ties(torch.maximum, (zeros, z.detach())) == 0


@pytest.mark.parametrize("relu", [lambda: nn.ReLU(), lambda: nn.ReLU(inplace=True)])
def test_max_pool_of_clamped_relu_zeros_is_not_a_tie(relu):
    """relu → max-pool: a window whose maxima are relu zeros of strictly negative inputs is locally
    constant (differentiable) and not counted; a maximum from an input exactly at 0 still is.

    Hand count on 2 × 8 inputs, 2 × 2 windows over column pairs:
    A = (−1, −2 | −3, −4): all clamped → 0;  B = (−1, 0 | −2, −3): the 0 is relu's own tie (1) and the
    window's four zeros are maxima, one of them not locally constant → 3;  C = (1, 1 | −1, ½): two 1s → 1;
    D = (−1, −1 | 2, −1): unique max → 0.  Total 1 + 3 + 1 = 5.
    """
    net = nn.Sequential(nn.Identity(), relu(), nn.MaxPool2d(2))
    x = torch.tensor(
        [[-1.0, -2.0, -1.0, 0.0, 1.0, 1.0, -1.0, -1.0], [-3.0, -4.0, -2.0, -3.0, -1.0, 0.5, 2.0, -1.0]]
    ).reshape(1, 1, 2, 8)
    counter = KinkCounter(net, ["0"])
    with counter:
        counter.wrap_loss(lambda out, _y: out.flatten(1).sum(1))(net(x.clone().requires_grad_(True) * 1.0), None)
    assert counter.ties == {"0": 5}
    # without the relu's mask (a plain max-pool of the same values) the clamped window A counts 3 more
    clamped = torch.relu(x).requires_grad_(True)
    assert kink_ties(F.max_pool2d, (clamped, 2)) == 3 + 3 + 1


def test_global_max_pool_of_clamped_relu_zeros_is_not_a_tie():
    """relu → adaptive (global) max-pool per channel: channel 0 all strictly negative → relu zeros,
    locally constant → 0; channel 1 = (0, −1, −2, −3): relu's tie at the 0 (1) and four tied zeros
    with a non-constant one (3); channel 2 = (2, 2, 1, −1): two 2s (1).  Hand count 5."""
    net = nn.Sequential(nn.Identity(), nn.ReLU(), nn.AdaptiveMaxPool2d(1))
    x = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [0.0, -1.0, -2.0, -3.0], [2.0, 2.0, 1.0, -1.0]]).reshape(1, 3, 2, 2)
    counter = KinkCounter(net, ["0"])
    with counter:
        counter.wrap_loss(lambda out, _y: out.flatten(1).sum(1))(net(x.clone().requires_grad_(True) * 1.0), None)
    assert counter.ties == {"0": 5}


class _TwoSites(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
        with torch.no_grad():
            self.a.weight.copy_(torch.eye(2))
            self.a.bias.zero_()
            self.b.weight.copy_(torch.eye(2))
            self.b.bias.copy_(torch.tensor([-1.0, 0.0]))

    def forward(self, x):
        h = torch.relu(self.a(x))  # before site b, after site a
        return torch.relu(self.b(h))


def test_kink_counter_attributes_ties_downstream_only():
    net = _TwoSites()
    x = torch.tensor([[0.0, 1.0], [1.0, -1.0]])
    counter = KinkCounter(net, ["a", "b"])
    with counter:
        counter.wrap_loss(lambda out, _y: out.sum(1))(net(x), None)
    # relu after a sees a(x) = x: zeros at (0,0); relu after b sees x⁺ − (1, 0): zeros at (0,1)?
    # b(h) = h + (−1, 0): h = [[0,1],[1,0]] → [[−1,1],[0,0]]: two zeros
    assert counter.ties == {"a": 1 + 2, "b": 2}
    assert counter.forwards == 1


def test_kink_ties_make_the_verdict_undetermined():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.site = nn.Linear(1, 1)
            with torch.no_grad():
                self.site.weight.zero_()
                self.site.bias.zero_()

        def forward(self, x):
            z = self.site(x)
            return torch.relu(z) - torch.relu(-z)  # identically z, kinks at z = 0

    x = torch.randn(8, 1, dtype=torch.float64)
    net = Net().double()
    res = diagnose(net, lambda out, _y: out.sum(1), [(x, torch.zeros(8))], sites=["site"])
    r = res["site"].result
    assert r.score == 0.0 and r.kink_ties == 16
    assert r.verdict is Verdict.UNDETERMINED and "kink" in r.verdict_reason
    off = diagnose(net, lambda out, _y: out.sum(1), [(x, torch.zeros(8))], sites=["site"], kinks=False)
    assert off["site"].result.kink_ties is None and off["site"].result.verdict is Verdict.SATURATED


def _example_stats() -> CrossBlockStatistics:
    stats = CrossBlockStatistics(parse_family("relu:1"), (1,), "vector")
    stats.weight = torch.ones(1, 1, dtype=torch.float64)
    stats.bias = torch.zeros(1, dtype=torch.float64)
    stats.update(
        torch.tensor([1.0, 2.0, -1.0, -2.0], dtype=torch.float64).reshape(4, 1),
        torch.tensor([2.0, -1.0, -1.0, 0.0], dtype=torch.float64).reshape(4, 1),
    )
    return stats


def test_saddle_score_of_the_exact_example():
    stats = _example_stats()
    blocks = stats.cross_block()
    assert blocks.shape == (1, 1, 2)
    # C = E[g 1{u > 0} (u, 1)] = ((2·1 − 1·2)/4, (2 − 1)/4) = (0, 1/4): only β moves G
    assert blocks[0, 0] == pytest.approx([0.0, 0.25], abs=1e-15)
    res = stats.result()
    assert res.saddle_score == pytest.approx(1 / math.sqrt(11), rel=1e-12)


def test_saddle_score_iterative_branch_matches_dense_svd():
    rng = np.random.default_rng(1)
    k, d, e = 20, 6, 14  # q = 280 > 256: eigsh
    blocks = rng.standard_normal((k, d, e))
    a = rng.standard_normal((k + 1, 3 * (k + 1)))
    sigma = a @ a.T / a.shape[1]
    w, v = np.linalg.eigh(sigma)
    half = (v / np.sqrt(w)) @ v.T
    mat = np.zeros((d, k + 1, k, e))
    for j in range(k):
        mat[:, :, j, :] = np.einsum("de,m->dme", blocks[j], half[j])
    dense = np.linalg.norm(mat.reshape(d * (k + 1), k * e), 2)
    assert saddle_score_from_blocks(blocks, sigma) == pytest.approx(dense, rel=1e-8)


def test_cross_block_rejects_families_without_feature_parameters():
    with pytest.raises(ValueError, match="elementwise random-feature family"):
        CrossBlockStatistics(parse_family("linear"), (3,), "vector")


def test_decrease_closed_forms():
    assert guaranteed_decrease(0.3, 2.0) == pytest.approx(0.09 / 4)
    assert decrease_upper_bound(0.3, 0.5, 2.0) == pytest.approx(0.15 + 0.25)
    assert best_decrease_bound(0.3, 0.5) == pytest.approx(0.09)
    assert squared_error_decrease(0.3) == pytest.approx(0.045)
    assert epsilon_from_nats(1e-3, 2.0) ** 2 / (2 * 2.0) == pytest.approx(1e-3)
    w = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
    assert cross_entropy_smoothness(w) == pytest.approx(4.5)
    assert cross_entropy_smoothness(w, units_per_example=3) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="beta must be a finite positive"):
        guaranteed_decrease(0.3, 0.0)
    with pytest.raises(ValueError, match="units_per_example"):
        cross_entropy_smoothness(w, units_per_example=0)


def test_ce_smoothness_bounds_the_dense_hessian():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    z = torch.randn(4, generator=gen, dtype=torch.float64) * 3
    for y in range(6):
        h = torch.func.hessian(lambda zz, y=y: F.cross_entropy((w @ zz)[None], torch.tensor([y])))(z)
        assert float(torch.linalg.eigvalsh(h).max()) <= cross_entropy_smoothness(w) * (1 + 1e-12)


def _mlp_probe():
    torch.manual_seed(0)
    model = ResidualMLP(in_dim=6, width=5, depth=2, n_classes=3).to(torch.float64).eval()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (40,), generator=gen)
    return model, [(x[:20], y[:20]), (x[20:], y[20:])]


def test_diagnose_reports_joint_score_decrease_and_saddle():
    model, batches = _mlp_probe()
    res = diagnose(model, classification_loss, batches, family="relu:8", beta=2.0, second_order=True)
    scores = [sd.result.score for sd in res.sites]
    assert res.joint_score == pytest.approx(math.sqrt(sum(s * s for s in scores)), rel=1e-14)
    for sd in res.sites:
        assert sd.guaranteed_decrease == pytest.approx(sd.result.score**2 / 4.0, rel=1e-14)
        assert sd.saddle is not None and sd.saddle.saddle_score > 0
    d = res.to_dict()
    assert d["joint_score"] == pytest.approx(res.joint_score)
    assert d["sites"][0]["saddle"]["saddle_score"] == pytest.approx(res.sites[0].saddle.saddle_score)
    cols = [c.header for c in res.table().columns]
    assert "s²/2β" in cols and "saddle σ" in cols


def test_diagnose_beyond_bad_input():
    model, batches = _mlp_probe()
    with pytest.raises(DiagnoseError, match="beta for site 'embed' must be a positive"):
        diagnose(model, classification_loss, batches, beta={"embed": -1.0})
    with pytest.raises(DiagnoseError, match="unknown site"):
        diagnose(model, classification_loss, batches, beta={"nope": 1.0})
    with pytest.raises(DiagnoseError, match="elementwise random-feature family"):
        diagnose(model, classification_loss, batches, family="linear", second_order=True)


def test_score_cli_reports_decrease_and_saddle(tmp_path):
    import json

    from typer.testing import CliRunner

    from depthsat_theory.cli import app

    rng = np.random.default_rng(0)
    z = rng.standard_normal((120, 3))
    g = 0.1 * z**2 + 0.05 * rng.standard_normal((120, 3))
    path = tmp_path / "probe.npz"
    np.savez(path, z=z, g=g)
    args = ["score", "--probe", str(path), "--family", "relu:6", "--json"]
    out = CliRunner().invoke(app, [*args, "--beta", "0.5", "--second-order"])
    assert out.exit_code == 0, out.output
    d = json.loads(out.output)
    assert d["guaranteed_decrease"] == pytest.approx(d["score"] ** 2 / 1.0, rel=1e-12)
    stats = CrossBlockStatistics(parse_family("relu:6"), (3,), "vector")  # type: ignore[arg-type]
    stats.update(torch.from_numpy(z), torch.from_numpy(g))
    assert d["saddle_score"] == pytest.approx(stats.result().saddle_score, rel=1e-10)
    bad = CliRunner().invoke(app, [*args, "--beta", "-1"])
    assert bad.exit_code == 2 and "--beta -1.0: the smoothness constant must be a positive" in bad.output


def test_measured_curvature_matches_finite_differences():
    model, batches = _mlp_probe()
    res = diagnose(model, classification_loss, batches, sites=["blocks.1"], curvature=True)
    sd = res["blocks.1"]
    cur = sd.curvature
    assert cur is not None
    assert cur.slope == pytest.approx(sd.result.score**2, rel=1e-10)  # J'(0) along Πg is ‖Πg‖²
    # central second difference of J(t) with the field t·Πg really added at the site
    from depthsat_theory.capture.curvature import _flat_to_theta, steepest_field_coefficients
    from depthsat_theory.statistics import statistics_for

    fam = parse_family("linear")
    st = statistics_for(fam, (5,), "vector")
    from depthsat_theory.capture import accumulate

    accumulate(model, ["blocks.1"], batches, classification_loss, {"blocks.1": st})
    theta = torch.from_numpy(
        _flat_to_theta(steepest_field_coefficients(st.cross_gradient(), st.feature_gram()), 5, True)
    )

    def j_of(t: float) -> float:
        h = model.blocks[1].register_forward_hook(lambda _m, _a, out: out + fam.functional(t * theta, out, "vector"))
        try:
            with torch.no_grad():
                return float(sum(classification_loss(model(x), y).sum() for x, y in batches) / 40)
        finally:
            h.remove()

    eps = 1e-3
    fd = (j_of(eps) - 2 * j_of(0.0) + j_of(-eps)) / eps**2
    assert cur.second == pytest.approx(fd, rel=1e-4)
    assert cur.local_decrease == pytest.approx(sd.result.score**2 / (2 * cur.curvature))


@pytest.mark.parametrize(
    ("fn", "r2", "rho"), [(lambda u: u**2, 3.0, math.sqrt(2 / 3)), (lambda u: 2 * u + 1, 5.0, 0.0)]
)
def test_crossfit_recovers_known_r_and_rho(fn, r2, rho, tmp_path):
    """u ~ N(0, 1), g = m(u) + N(0, 1), linear family with bias: r² and ρ in closed form."""
    import json

    from typer.testing import CliRunner

    from depthsat_theory.cli import app

    rng = np.random.default_rng(5)
    u = rng.standard_normal((6000, 1))
    g = fn(u) + rng.standard_normal((6000, 1))
    np.savez(tmp_path / "p.npz", z=u, g=g)
    out = CliRunner().invoke(
        app, ["score", "--probe", str(tmp_path / "p.npz"), "--family", "linear", "--json", "--crossfit"]
    )
    assert out.exit_code == 0, out.output
    d = json.loads(out.output)
    assert abs(d["raw_score_squared_crossfit"] - r2) < 5 * d["standard_error_crossfit"]
    assert d["realizability_defect_crossfit"] == pytest.approx(rho, abs=0.1)
    assert d["raw_score"] > math.sqrt(r2 + 1) - 0.2  # the pooled r̂ tends to AG_rms = sqrt(r² + 1), not r


def test_crossfit_rejects_bad_input():
    from depthsat_theory.statistics.realizability import crossfit_realizability

    with pytest.raises(ValueError, match="same n >= 4"):
        crossfit_realizability(np.zeros((3, 1)), np.zeros((3, 1)))
    with pytest.raises(ValueError, match="neighbours must be in"):
        crossfit_realizability(np.zeros((10, 1)), np.zeros((10, 1)), neighbours=6)


def test_symbolic_and_numeric_saddle_scores_agree():
    """Same feature relu(a u + β) on a random rational finite measure: exact (sympy) vs streamed."""
    import sympy as sp

    from depthsat_theory.engines.symbolic import SymbolicFamily, saddle
    from depthsat_theory.engines.symbolic.measures import FiniteMeasure

    rng = np.random.default_rng(7)
    pts = [int(v) / 4 for v in rng.choice(np.r_[-12:-1, 1:12], 6, replace=False)]
    grads = [int(v) / 2 for v in rng.integers(-4, 5, 6)]
    fam = SymbolicFamily.parse("t1*relu((1 + t4)*u + t2 + 1/8) + t3")
    (u,) = fam.units
    m = sp.interpolate(list(zip([sp.nsimplify(p) for p in pts], [sp.nsimplify(g) for g in grads], strict=True)), u)
    exact = saddle(fam, FiniteMeasure(pts), m)
    assert exact.feature_parameters == (fam.params[1], fam.params[3])
    stats = CrossBlockStatistics(parse_family("relu:1"), (1,), "vector")  # type: ignore[arg-type]
    stats.weight = torch.ones(1, 1, dtype=torch.float64)
    stats.bias = torch.full((1,), 1 / 8, dtype=torch.float64)
    stats.update(
        torch.tensor(pts, dtype=torch.float64).reshape(-1, 1), torch.tensor(grads, dtype=torch.float64).reshape(-1, 1)
    )
    assert stats.result().saddle_score == pytest.approx(float(exact.saddle_score), rel=1e-12)


def test_audit_reports_kink_ties():
    from depthsat_theory.audit import audit_model

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.site = nn.Linear(1, 1)
            with torch.no_grad():
                self.site.weight.zero_()
                self.site.bias.zero_()

        def forward(self, x):
            z = self.site(x)
            return torch.relu(z) - torch.relu(-z)

    x = torch.randn(6, 1, dtype=torch.float64)
    rep = audit_model(
        parse_family("linear"), Net().double(), "site", x, torch.zeros(6), lambda out, _y: out.sum(1), layout="vector"
    )
    assert rep.kink_ties == 12 and rep.status is Verdict.UNDETERMINED
    assert any("kink" in note for note in rep.notes)


def test_cross_block_drops_padded_rows():
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(2, 5, 3, generator=gen, dtype=torch.float64)
    g = torch.randn(2, 5, 3, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    g[1, 3:] = 0
    padded = CrossBlockStatistics(parse_family("relu:4"), (5, 3), "sequence")  # type: ignore[arg-type]
    padded.update(z, g, mask=mask)
    kept = CrossBlockStatistics(parse_family("relu:4"), (5, 3), "sequence")  # type: ignore[arg-type]
    kept.update(z[:1], g[:1])
    kept.update(z[1:, :3], g[1:, :3])
    assert np.allclose(padded.feature_gram() * 2, kept.feature_gram() * 2)
    assert padded.n == 2 and kept.n == 2
    assert padded.result().saddle_score == pytest.approx(kept.result().saddle_score, rel=1e-12)


def test_beta_sets_the_default_epsilon_of_the_certificate():
    model, batches = _mlp_probe()
    res = diagnose(model, classification_loss, batches, sites=["blocks.0"], delta=0.1, beta=3.0)
    iv = res["blocks.0"].interval
    assert iv is not None and iv.saturation_epsilon == pytest.approx(math.sqrt(2 * 3.0 * 1e-3))
    given = diagnose(
        model, classification_loss, batches, sites=["blocks.0"], delta=0.1, beta=3.0, bound_kwargs={"epsilon": 0.5}
    )
    assert given["blocks.0"].interval.saturation_epsilon == 0.5


def test_proofs_json_accepts_numpy_scalars_in_tables(tmp_path):
    import json

    from proofs_checks import Context, Row
    from proofs_checks._registry import write_json_atomic

    row = Row("T7", ["thm-finite-sample"], "c", "coverage", 1, 0, "", "", 0.1, table=("t", ["a"], [[np.int64(3)]]))
    write_json_atomic([row], Context(quick=True), str(tmp_path / "p.json"))
    assert json.loads((tmp_path / "p.json").read_text())["rows"][0]["table"][2] == [[3]]


def test_head_input_curvature_is_below_the_cross_entropy_bound():
    """At the input of a linear CE head, κ (measured) ≤ β = ½‖W‖₂² (lem-ce-smoothness), so s²/2β ≤ s²/2κ."""
    model, batches = _mlp_probe()
    beta = cross_entropy_smoothness(model.head.weight)
    res = diagnose(model, classification_loss, batches, sites=["ln_f"], beta=beta, curvature=True)
    sd = res["ln_f"]
    assert sd.curvature is not None and 0 < sd.curvature.curvature <= beta
    assert sd.guaranteed_decrease <= sd.curvature.local_decrease


def test_saddle_score_equals_a_dense_torch_func_mixed_derivative():
    """σ against an independent reference: ``torch.func`` mixed second derivative of
    ``E[g · (W relu(U u + a) + c)]`` in ``((W, c), (U, a))`` at ``W = 0``, whitened by ``Σ^{-1/2}``
    (``Σ = E[φ̃ φ̃ᵀ]``, ``φ̃ = (relu(U u + a), 1)``) per output coordinate, operator norm."""
    from torch.func import jacrev

    torch.manual_seed(3)
    n, d, k = 40, 3, 4
    u, g = torch.randn(n, d, dtype=torch.float64), torch.randn(n, d, dtype=torch.float64)
    w_in, a = torch.randn(k, d, dtype=torch.float64), torch.randn(k, dtype=torch.float64)
    stats = CrossBlockStatistics(parse_family(f"relu:{k}"), (d,), "vector")
    stats.weight, stats.bias = w_in.clone(), a.clone()
    stats.update(u, g)

    def first_order(wc, psi):
        w, c = wc[: d * k].reshape(d, k), wc[d * k :]
        feats = torch.relu(u @ psi[: k * d].reshape(k, d).T + psi[k * d :])
        return (g * (feats @ w.T + c)).sum(1).mean()

    mixed = jacrev(jacrev(first_order, argnums=0), argnums=1)(
        torch.zeros(d * k + d, dtype=torch.float64), torch.cat([w_in.flatten(), a])
    )
    rows = [r for i in range(d) for r in [*(i * k + j for j in range(k)), d * k + i]]
    phi = torch.cat([torch.relu(u @ w_in.T + a), torch.ones(n, 1, dtype=torch.float64)], 1)
    evals, evecs = torch.linalg.eigh(phi.T @ phi / n)
    inv_half = evecs @ torch.diag(evals**-0.5) @ evecs.T
    dense = torch.linalg.matrix_norm(torch.block_diag(*[inv_half] * d) @ mixed[rows], 2).item()
    assert stats.result().saddle_score == pytest.approx(dense, rel=1e-10)


# ----------------------------------------------------------------------------- curvature at sequence and image sites
class _TinyCNN(nn.Module):
    """Stem conv → site → tanh conv residual → mean pool → linear head (float64, smooth after the site)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(2, 3, 3, padding=1)
        self.site = nn.Identity()
        self.body = nn.Conv2d(3, 3, 3, padding=1)
        self.head = nn.Linear(3, 4)

    def rest(self, z):
        return self.head((torch.tanh(self.body(z)) + z).mean((2, 3)))

    def forward(self, x):
        return self.rest(self.site(self.stem(x)))


class _TinyTransformer(nn.Module):
    """Token embedding → site → one causal encoder layer (GELU) → linear head (float64, dropout 0)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 8)
        self.site = nn.Identity()
        self.layer = nn.TransformerEncoderLayer(
            8, 2, dim_feedforward=16, dropout=0.0, activation="gelu", batch_first=True
        )
        self.head = nn.Linear(8, 7)

    def rest(self, z):
        mask = nn.Transformer.generate_square_subsequent_mask(z.shape[1], dtype=z.dtype)
        return self.head(self.layer(z, src_mask=mask, is_causal=True))

    def forward(self, x):
        return self.rest(self.site(self.embed(x)))


def _image_loss(out, y):
    return F.cross_entropy(out, y, reduction="none")


def _token_loss(out, y):
    return F.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(1)  # per example: mean over its tokens


def _dense_curvature(model, loss_fn, batches, rows):
    """``(s², J''(0))`` along ``t Πg`` from the captured site tensors, with ``torch.func`` and numpy pinv.

    ``rows(z)`` lists the site's rows ``(N, d)`` (pixels or tokens); ``Πg = G Σ⁺ [z_r, 1]`` row by row.
    """
    zs = [model.site(model.stem(x) if hasattr(model, "stem") else model.embed(x)).detach() for x, _ in batches]
    n = sum(z.shape[0] for z in zs)
    cross = sigma = 0.0
    for z, (_, y) in zip(zs, batches, strict=True):
        zz = z.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(loss_fn(model.rest(zz), y).sum(), zz)
        phi = torch.cat([rows(z), torch.ones(rows(z).shape[0], 1, dtype=z.dtype)], 1)
        cross = cross + rows(g).T @ phi
        sigma = sigma + phi.T @ phi
    coef = (cross / n) @ torch.from_numpy(np.linalg.pinv(sigma.numpy() / n))
    s2 = float(torch.trace(coef @ (sigma / n) @ coef.T))

    def j_of(t):
        total = 0.0
        for z, (_, y) in zip(zs, batches, strict=True):
            phi = torch.cat([rows(z), torch.ones(rows(z).shape[0], 1, dtype=z.dtype)], 1)
            field = (phi @ coef.T).reshape(rows(z).shape)
            total = total + loss_fn(model.rest(z + t * _unrows(field, z)), y).sum()
        return total / n

    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # the fused CPU attention kernel has no forward-mode derivative
        second = torch.func.jacfwd(torch.func.grad(j_of))(torch.zeros((), dtype=torch.float64))
    return s2, float(second.detach())


def _pixel_rows(t):
    return t.permute(0, 2, 3, 1).reshape(-1, t.shape[1]) if t.dim() == 4 else t.reshape(-1, t.shape[-1])


def _unrows(field, z):
    if z.dim() == 4:
        b, c, h, w = z.shape
        return field.reshape(b, h, w, c).permute(0, 3, 1, 2)
    return field.reshape(z.shape)


@pytest.mark.parametrize("kind", ["cnn", "transformer"])
def test_curvature_at_image_and_sequence_sites_matches_a_dense_reference(kind):
    """``--curvature`` gave ``null`` at every sequence and image site; now κ matches a ``torch.func`` reference."""
    torch.manual_seed(0)
    if kind == "cnn":
        model, loss_fn, layout = _TinyCNN().double().eval(), _image_loss, "image"
        batches = [(torch.randn(4, 2, 5, 5, dtype=torch.float64), torch.randint(0, 4, (4,))) for _ in range(3)]
    else:
        model, loss_fn, layout = _TinyTransformer().double().eval(), _token_loss, "sequence"
        batches = [(torch.randint(0, 7, (4, 5)), torch.randint(0, 7, (4, 5))) for _ in range(3)]
    res = diagnose(model, loss_fn, batches, sites=["site"], layout=layout, curvature=True, kinks=False)
    sd = res["site"]
    assert sd.layout == layout and sd.curvature is not None
    s2, second = _dense_curvature(model, loss_fn, batches, _pixel_rows)
    assert sd.result.score**2 == pytest.approx(s2, rel=1e-9)
    assert sd.curvature.slope == pytest.approx(s2, rel=1e-9)  # J'(0) along Πg is s²
    assert sd.curvature.second == pytest.approx(second, rel=1e-8)
    assert sd.curvature.curvature == pytest.approx(second / s2, rel=1e-8)
    assert res.to_dict()["sites"][0]["curvature"]["curvature"] == pytest.approx(second / s2, rel=1e-8)
    assert "s²/2κ (local)" in [c.header for c in res.table().columns]


def test_a_site_without_curvature_gets_a_note_and_the_cli_fills_image_sites():
    """``s = 0`` (a zero head: ``g ≡ 0``) has no steepest field: ``curvature`` stays ``None`` and a note says so."""
    torch.manual_seed(1)
    model = _TinyCNN().double().eval()
    with torch.no_grad():
        model.head.weight.zero_()
    batches = [(torch.randn(4, 2, 5, 5, dtype=torch.float64), torch.randint(0, 4, (4,)))]
    res = diagnose(model, _image_loss, batches, sites=["site"], layout="image", curvature=True, kinks=False)
    assert res["site"].result.score == 0 and res["site"].curvature is None
    assert "κ (--curvature) not measured at site (s = 0: no steepest field)" in res.notes
    from typer.testing import CliRunner

    from depthsat_theory.cli import app

    out = CliRunner().invoke(
        app, ["diagnose", "--model", "cnn", "--batches", "1", "--batch-size", "8", "--curvature", "-q", "--json", "-"]
    )
    assert out.exit_code == 0, out.output
    sites = json.loads(out.stdout)["sites"]
    assert sites and all(s["layout"] == "image" for s in sites)
    for s in sites:  # J'(0) by double backward through the model equals s² of the streamed statistics
        assert s["curvature"] is not None and s["curvature"]["slope"] == pytest.approx(s["score"] ** 2, rel=1e-8)
