"""Variable-depth against fixed-depth students (seed 003).

Independent checks: the fixed-depth network has no identity path (its block Jacobian differs from
the residual block's by exactly the identity, a block with zero output weights passes nothing of
its input on, and the whole network then computes a constant given by a hand-written closed form);
its forward pass against a formula written here (LayerNorm and erf-GELU by hand); parameter counts
against a hand count; the distillation loss against scipy's ``rel_entr``; distillation that never
reads the labels and lowers its objective; the paired interval against ``scipy.stats.ttest_rel``;
the tiny run's budgets, parameter counts and summary recomputed from its rows; bad input and an
interrupted run that leaves the previous results untouched.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from scipy import special, stats
from torch import nn
from typer.testing import CliRunner

from depthsat_theory.cli.app import app
from depthsat_theory.experiments import ExperimentError, fixed_depth
from depthsat_theory.experiments import recipe as rc
from depthsat_theory.experiments.fixed_depth import (
    CONFIGS,
    METRICS,
    FixedDepthBlock,
    FixedDepthMLP,
    direction,
    distill,
    distillation_loss,
    matched_fit,
    paired_difference,
    run_fixed_depth,
)
from depthsat_theory.tasks.models import MLPBlock, ResidualMLP

runner = CliRunner()


def _read(path):
    with open(path) as fh:
        return list(csv.DictReader(fh))


def _moved(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter randomised (LayerNorm gains away from 1, biases nonzero): no identity by accident."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype) + (1.0 if p.dim() == 1 else 0.0))
    return model.eval()


# ----------------------------------------------------------------------------- no identity path


def test_block_jacobians_differ_by_exactly_the_identity():
    res = _moved(MLPBlock(5, hidden=7).double())
    fixed = FixedDepthBlock(5, hidden=7).double()
    fixed.load_state_dict(res.state_dict())
    x = torch.randn(5, dtype=torch.float64)
    j_res = torch.func.jacrev(lambda v: res(v[None])[0])(x)
    j_fixed = torch.func.jacrev(lambda v: fixed(v[None])[0])(x)
    assert torch.allclose(j_res - j_fixed, torch.eye(5, dtype=torch.float64), atol=1e-12)
    assert j_fixed.abs().max() > 1e-3  # the fixed block is not constant: it transforms its input


def test_a_zeroed_fixed_block_passes_nothing_of_its_input_on():
    res = _moved(MLPBlock(4).double())
    with torch.no_grad():
        res.W2.weight.zero_()
    fixed = FixedDepthBlock(4).double()
    fixed.load_state_dict(res.state_dict())
    x, delta = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    b = res.W2.bias.detach()
    assert torch.equal(fixed(x + delta), b.expand(6, 4))  # closed form: the bias, whatever the input
    assert torch.allclose(res(x + delta) - res(x), delta, atol=1e-14)  # the residual block: the perturbation


def _layer_norm(h, ln):
    mu = h.mean(-1, keepdim=True)
    var = ((h - mu) ** 2).mean(-1, keepdim=True)
    return (h - mu) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias


def _gelu(u):
    return 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))


def test_fixed_depth_forward_against_a_hand_formula():
    model = _moved(FixedDepthMLP(in_dim=6, width=4, depth=3, n_classes=3).double())
    x = torch.randn(10, 6, dtype=torch.float64)
    h = x @ model.embed.weight.T + model.embed.bias
    for blk in model.blocks:  # no "h +": every block replaces the stream
        h = _gelu(_layer_norm(h, blk.ln) @ blk.W1.weight.T + blk.W1.bias) @ blk.W2.weight.T + blk.W2.bias
    ref = _layer_norm(h, model.ln_f) @ model.head.weight.T + model.head.bias
    assert torch.allclose(model(x), ref, atol=1e-12)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_fixed_network_is_constant_when_any_block_is_zeroed(k):
    res = _moved(ResidualMLP(in_dim=6, width=4, depth=3, n_classes=3).double())
    with torch.no_grad():
        res.blocks[k].W2.weight.zero_()
    fixed = FixedDepthMLP.like(res)
    x = torch.randn(8, 6, dtype=torch.float64)
    out = fixed(x)
    # every path crosses block k: the output is the function of block k's bias alone
    h = res.blocks[k].W2.bias.detach()[None]
    for blk in list(fixed.blocks)[k + 1 :]:
        h = _gelu(_layer_norm(h, blk.ln) @ blk.W1.weight.T + blk.W1.bias) @ blk.W2.weight.T + blk.W2.bias
    const = _layer_norm(h, fixed.ln_f) @ fixed.head.weight.T + fixed.head.bias
    assert torch.allclose(out, const.expand(8, 3), atol=1e-12)
    assert (res(x) - res(x).mean(0)).abs().max() > 1e-3  # the residual twin still sees its input


def test_like_copies_the_weights_and_the_parameter_counts_agree_with_a_hand_count():
    in_dim, w, depth, c = 64, 8, 3, 10
    res = ResidualMLP(in_dim, w, depth, c, activation="tanh")
    fixed = FixedDepthMLP.like(res)
    per_block = 2 * w + (w * 2 * w + 2 * w) + (2 * w * w + w)  # LayerNorm, W1, W2
    hand = (in_dim * w + w) + depth * per_block + 2 * w + (w * c + c)
    assert sum(p.numel() for p in res.parameters()) == hand
    assert sum(p.numel() for p in fixed.parameters()) == hand
    for (n1, p1), (n2, p2) in zip(res.named_parameters(), fixed.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2) and p1.data_ptr() != p2.data_ptr()
    assert all(isinstance(b, FixedDepthBlock) and isinstance(b.act, nn.Tanh) for b in fixed.blocks)


@pytest.mark.parametrize("bad", [nn.Linear(3, 3), "fixed"])
def test_like_refuses_what_is_not_a_residual_mlp(bad):
    model = FixedDepthMLP(4, 4, 1, 2) if bad == "fixed" else bad
    with pytest.raises(TypeError, match="ResidualMLP"):
        FixedDepthMLP.like(model)


# ----------------------------------------------------------------------------- distillation


def test_distillation_loss_against_scipy():
    rng = np.random.default_rng(0)
    s, t = rng.normal(size=(7, 5)) * 3, rng.normal(size=(7, 5)) * 3
    ref = special.rel_entr(special.softmax(t, axis=1), special.softmax(s, axis=1)).sum(axis=1)
    got = distillation_loss(torch.tensor(s), torch.tensor(t))
    assert got.shape == (7,)
    assert np.allclose(got.numpy(), ref, rtol=1e-12, atol=1e-14)
    shifted = distillation_loss(torch.tensor(t) + 4.0, torch.tensor(t))  # same softmax: zero divergence
    assert shifted.abs().max() < 1e-12


@pytest.mark.parametrize("shapes", [((3, 4), (3, 5)), ((3,), (3,)), ((2, 3, 4), (2, 3, 4))])
def test_distillation_loss_refuses_bad_shapes(shapes):
    with pytest.raises(ValueError, match=r"\(B, C\)"):
        distillation_loss(torch.zeros(shapes[0]), torch.zeros(shapes[1]))


@pytest.fixture(scope="module")
def small_splits():
    return rc.load_splits("digits", 0, rc.Sizes(train=120, val=40, probe=20, test=60))


def _teacher_logits(splits):
    torch.manual_seed(0)
    teacher = ResidualMLP(64, 6, 1, 10).eval()
    with torch.no_grad():
        return teacher(splits.train.x), teacher(splits.test.x)


def test_distillation_lowers_its_objective_with_the_budget_it_states(small_splits):
    t_train, t_test = _teacher_logits(small_splits)
    torch.manual_seed(1)
    student = FixedDepthMLP(64, 6, 2, 10)
    recipe = rc.Recipe(batch_size=32)
    res = distill(student, small_splits, t_train, t_test, epochs=4, seed=3, recipe=recipe)
    assert [h["epoch"] for h in res.history] == [0, 1, 2, 3, 4]
    assert res.examples_seen == 4 * 120 and res.steps == 4 * math.ceil(120 / 32)
    assert res.history[-1]["train_kl"] < 0.5 * res.history[0]["train_kl"]
    with torch.no_grad():  # the recorded train KL is the mean KL of the returned student, recomputed here
        kl = distillation_loss(res.model(small_splits.train.x).double(), t_train.double()).mean()
    assert res.final["train_kl"] == pytest.approx(float(kl), rel=1e-5)
    assert set(METRICS) <= set(res.final)


def test_distillation_never_reads_the_labels(small_splits):
    t_train, t_test = _teacher_logits(small_splits)
    relabelled = rc.Split(small_splits.train.x, (small_splits.train.y + 1) % 10)  # every label wrong
    shuffled = dataclasses.replace(small_splits, train=relabelled)
    out = []
    for sp in (small_splits, shuffled):
        torch.manual_seed(1)
        student = FixedDepthMLP(64, 6, 2, 10)
        out.append(distill(student, sp, t_train, t_test, epochs=2, seed=3).model.state_dict())
    assert all(torch.equal(out[0][k], out[1][k]) for k in out[0])


def test_distill_refuses_bad_input(small_splits):
    t_train, t_test = _teacher_logits(small_splits)
    student = FixedDepthMLP(64, 6, 1, 10)
    with pytest.raises(ValueError, match="epochs"):
        distill(student, small_splits, t_train, t_test, epochs=0, seed=0)
    with pytest.raises(ValueError, match="teacher logits"):
        distill(student, small_splits, t_train[:-1], t_test, epochs=1, seed=0)


# ----------------------------------------------------------------------------- matched fit, intervals, verdicts


def test_matched_fit_on_hand_made_histories():
    a = [{"epoch": e, "train_kl": v} for e, v in enumerate([2.0, 0.5, 0.2, 0.05])]
    b = [{"epoch": e, "train_kl": v} for e, v in enumerate([2.0, 0.9, 0.3, 0.25])]
    tau, rows = matched_fit({"variable": a, "fixed": b})
    assert tau == 0.25
    assert rows["variable"]["epoch"] == 2 and rows["fixed"]["epoch"] == 3
    with pytest.raises(ValueError, match="non-empty"):
        matched_fit({"variable": a, "fixed": []})


def test_paired_difference_against_scipy_ttest_rel():
    fixed = [0.31, 0.27, 0.40, 0.35, 0.29]
    variable = [0.25, 0.26, 0.33, 0.30, 0.31]
    got = paired_difference(fixed, variable)
    ref = stats.ttest_rel(fixed, variable).confidence_interval(0.95)
    assert got["per_seed"] == pytest.approx([f - v for f, v in zip(fixed, variable, strict=True)], abs=1e-15)
    assert (got["ci_low"], got["ci_high"]) == pytest.approx((ref.low, ref.high), rel=1e-10)
    assert got["std"] == pytest.approx(np.std(np.subtract(fixed, variable), ddof=1), rel=1e-12)
    with pytest.raises(ExperimentError, match="treated values"):
        paired_difference([1.0], [1.0, 2.0])
    with pytest.raises(ExperimentError, match="non-finite"):
        paired_difference([math.nan, 1.0], [1.0, 1.0])


def test_direction_reads_the_interval():
    assert direction({"ci_low": 0.01, "ci_high": 0.2}).startswith("variable-depth better")
    assert direction({"ci_low": -0.2, "ci_high": -0.01}).startswith("fixed-depth better")
    assert direction({"ci_low": -0.1, "ci_high": 0.2}).startswith("undetermined")
    assert direction({"ci_low": math.nan, "ci_high": math.nan}).startswith("undetermined")
    # accuracy: a negative difference (fixed lower) favours the variable-depth student
    assert direction({"ci_low": -0.05, "ci_high": -0.01}, higher_is_better=True).startswith("variable-depth")


# ----------------------------------------------------------------------------- the tiny run


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fd") / "fixed-depth"
    res = runner.invoke(app, ["experiment", "fixed-depth", "--config", "tiny", "--out", str(out)])
    assert res.exit_code == 0, res.output
    return out


def test_tiny_run_budgets_and_parameters_are_equal(tiny_run):
    cfg = CONFIGS["tiny"]
    rows = _read(tiny_run / "runs.csv")
    n_train, w, depth = cfg["sizes"]["digits"]["train"], cfg["width"], cfg["depths"][0]
    hand = (64 * w + w) + depth * (2 * w + 2 * w * w + 2 * w + 2 * w * w + w) + 2 * w + (10 * w + 10)
    assert len(rows) == 3 * len(cfg["seeds"])
    for seed in cfg["seeds"]:
        arm = {r["arm"]: r for r in rows if int(r["seed"]) == seed}
        assert set(arm) == {"teacher", "variable", "fixed"}
        assert int(arm["fixed"]["n_params"]) == int(arm["variable"]["n_params"]) == hand
        budget = cfg["distill_epochs"] * n_train
        assert int(arm["fixed"]["examples_seen"]) == int(arm["variable"]["examples_seen"]) == budget
        assert (
            int(arm["fixed"]["steps"])
            == int(arm["variable"]["steps"])
            == cfg["distill_epochs"] * math.ceil(n_train / rc.RECIPE.batch_size)
        )
        tau = max(float(arm["fixed"]["train_kl"]), float(arm["variable"]["train_kl"]))
        for a in ("fixed", "variable"):
            assert float(arm[a]["matched_tau"]) == pytest.approx(tau, rel=1e-12)
            assert float(arm[a]["matched_train_kl"]) <= tau
            assert 0 < int(arm[a]["matched_epoch"]) <= cfg["distill_epochs"]


def test_tiny_run_curves_show_the_objective_falling(tiny_run):
    curves = _read(tiny_run / "curves.csv")
    cfg = CONFIGS["tiny"]
    for seed in cfg["seeds"]:
        for arm in ("fixed", "variable"):
            kl = [float(c["train_kl"]) for c in curves if int(c["seed"]) == seed and c["arm"] == arm]
            assert len(kl) == cfg["distill_epochs"] + 1
            assert kl[-1] < kl[0]


def test_tiny_run_summary_recomputed_from_its_rows(tiny_run):
    rows = _read(tiny_run / "runs.csv")
    summary = json.loads((tiny_run / "summary.json").read_text())
    cell = summary["summary"]["results"]["digits/depth2"]
    fx = sorted((r for r in rows if r["arm"] == "fixed"), key=lambda r: int(r["seed"]))
    vr = sorted((r for r in rows if r["arm"] == "variable"), key=lambda r: int(r["seed"]))
    for key in ("test_loss", "test_accuracy", "train_kl"):
        diffs = [float(a[key]) - float(b[key]) for a, b in zip(fx, vr, strict=True)]
        ref = stats.ttest_1samp(diffs, 0.0).confidence_interval(0.95)
        got = cell["fixed_minus_variable"][key]
        assert got["mean"] == pytest.approx(np.mean(diffs), rel=1e-9, abs=1e-15)
        assert (got["ci_low"], got["ci_high"]) == pytest.approx((ref.low, ref.high), rel=1e-9)
    assert cell["budgets_equal"] is True
    assert summary["meta"]["seeds"] == CONFIGS["tiny"]["seeds"]
    assert (tiny_run / "fixed_depth.png").is_file() and (tiny_run / "fixed_depth.svg").is_file()


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--config", "huge"], "--config"),
        (["--config", "tiny", "--seeds", "0"], "--seeds"),
        (["--config", "tiny", "--seeds", "1,1"], "--seeds"),
        (["--config", "tiny", "--dataset", "kjv"], "--dataset"),
    ],
)
def test_cli_refuses_bad_input(tmp_path, args, match):
    out = tmp_path / "fd"
    res = runner.invoke(app, ["experiment", "fixed-depth", *args, "--out", str(out)])
    assert res.exit_code == 2
    assert match in res.output
    assert not out.exists()


def test_an_interrupted_run_leaves_the_previous_results_untouched(tmp_path, monkeypatch):
    out = tmp_path / "fd"
    out.mkdir()
    (out / "summary.json").write_text('{"old": true}')

    class Broken:  # the figure fails to save while the new folder is being written
        def savefig(self, *args, **kwargs):
            raise OSError("disk full")

    monkeypatch.setattr(fixed_depth, "_figure", lambda curves, cfg: Broken())
    with pytest.raises(OSError, match="disk full"):
        run_fixed_depth("tiny", out=out, seeds=[0, 1], log=lambda _: None)
    assert (out / "summary.json").read_text() == '{"old": true}'
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fd"]  # no half-written sibling left behind


def test_an_output_path_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "file"
    target.write_text("keep")
    lines = []
    with pytest.raises(ExperimentError, match="not a folder"):
        run_fixed_depth("tiny", out=target, seeds=[0, 1], datasets=["digits"], log=lines.append)
    assert target.read_text() == "keep"
    assert lines == []  # refused before any training
