"""Views side by side: the library against independent truth, and the tiny run.

* exits: the logit lens of a model whose last block is zero gives the same loss at the last two
  depths, and the last depth is the model's own token loss (``F.cross_entropy``); a fitted
  readout equals scikit-learn's multinomial logistic regression with the same objective;
* stopping: the oracle against a brute-force loop on random tables and a hand-made table with a
  tie; the threshold policy and its tuning on hand-made tables;
* block influence and update ratios against closed forms (identity, negation, rotation, scaling);
* ``L_depth`` against a hand computation; the recipe option off by default and effective when on;
* the per-curve rules (snap, influence count, agreement) on hand values;
* ``depthsat experiment views --config tiny`` end to end against a hand-made sweep summary,
  bad input (one line, exit 2) and atomic writes.
"""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from depthsat_theory import views as V
from depthsat_theory.cli import app
from depthsat_theory.experiments import ExperimentError
from depthsat_theory.experiments import recipe as R
from depthsat_theory.experiments import sweep as S
from depthsat_theory.experiments import views as EV
from depthsat_theory.tasks.models import CharGPT

runner = CliRunner()


def _rows(path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


class _Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, z):
        return self.fn(z)


class _Stack(nn.Module):
    """A toy residual model: ``blocks`` applied in order (no embedding, no head)."""

    def __init__(self, *fns):
        super().__init__()
        self.blocks = nn.ModuleList(_Lambda(f) for f in fns)

    def forward(self, z):
        for b in self.blocks:
            z = b(z)
        return z


# ----------------------------------------------------------------------------- exits
def test_logit_lens_of_a_zero_last_block_repeats_the_previous_depth():
    torch.manual_seed(0)
    model = CharGPT(vocab_size=11, d_model=16, n_layers=2, n_heads=2, seq_len=8).double().eval()
    last = model.blocks[1]
    with torch.no_grad():  # zero the last block's two residual branches: z_2 = z_1 exactly
        for lin in (last.attn.out, last.mlp[-1]):
            lin.weight.zero_()
            lin.bias.zero_()
    x = torch.randint(0, 11, (5, 8))
    y = torch.randint(0, 11, (5, 8))
    table = V.logit_lens_table(model, x, y, batch_size=2)
    assert table.losses.shape == (3, 40)
    np.testing.assert_allclose(table.losses[2], table.losses[1], rtol=0, atol=1e-12)
    own = torch.nn.functional.cross_entropy(model(x).reshape(-1, 11), y.reshape(-1), reduction="none")
    np.testing.assert_allclose(table.losses[2], own.detach().numpy(), rtol=1e-12, atol=1e-12)
    assert not np.allclose(table.losses[0], table.losses[1])  # the first block does change the stream


def test_fitted_readout_equals_sklearn_logistic_regression():
    sklearn = pytest.importorskip("sklearn.linear_model")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(120, 4, generator=gen, dtype=torch.float64)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long()  # 3 classes, not separable by a margin
    model = _Stack(lambda z: 2 * z)  # z_0 = x, z_1 = 2x: standardised features are the same
    l2 = 1e-2
    ro = V.fit_linear_readouts(model, x, y, 3, l2=l2, max_iter=500)
    table = V.readout_table(model, ro, x, y)
    f = ((x - x.mean(0)) / x.std(0)).numpy()
    # ours: mean CE + l2·‖W‖²  ⇔  sklearn: C·Σ CE + ½‖W‖² with C = 1 / (2 n l2)
    ref = sklearn.LogisticRegression(C=1 / (2 * 120 * l2), tol=1e-12, max_iter=5000).fit(f, y.numpy())
    p = ref.predict_proba(f)[np.arange(120), y.numpy()]
    # L-BFGS stops at its loss-change tolerance: agreement to 1e-4 nats (a ridge off by a factor 2
    # would move these losses by up to 2 nats)
    np.testing.assert_allclose(table.losses[0], -np.log(p), rtol=0, atol=1e-4)
    np.testing.assert_allclose(table.losses[1], table.losses[0], rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- stopping
def test_oracle_stopping_depth_against_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(20):
        L1, n = rng.integers(1, 7), rng.integers(1, 30)
        losses = rng.exponential(size=(L1, n)).round(2)  # rounding makes ties common
        c = float(rng.choice([0.0, 0.01, 0.1, 1.0]))
        expect = []
        for i in range(n):
            best, arg = math.inf, -1
            for k in range(L1):
                v = losses[k, i] + c * k
                if v < best:  # the first minimum, in the same float64 arithmetic
                    best, arg = v, k
            expect.append(arg)
        assert V.oracle_stopping_depth(losses, c).tolist() == expect


def test_oracle_on_a_hand_made_table():
    # rows: keeps improving; improves once by 0.05; flat
    losses = np.array([[1.0, 0.50, 0.3], [0.6, 0.45, 0.3], [0.3, 0.45, 0.3], [0.1, 0.45, 0.3]])
    assert V.oracle_stopping_depth(losses, 0.0).tolist() == [3, 1, 0]
    assert V.oracle_stopping_depth(losses, 0.1).tolist() == [3, 0, 0]  # 0.1+0.3 < 0.3+0.2 < 0.6+0.1
    assert V.oracle_stopping_depth(losses, 0.25).tolist() == [2, 0, 0]  # 0.3+0.5 < 0.1+0.75, 0.6+0.25
    assert V.oracle_stopping_depth(losses, 0.5).tolist() == [0, 0, 0]  # 1.0 < 0.6+0.5


def test_threshold_policy_and_its_tuning_on_hand_made_tables():
    conf = np.array([[0.50, 0.95, 0.1], [0.90, 0.96, 0.2], [0.99, 0.20, 0.3]])
    assert V.threshold_stopping_depth(conf, 0.9).tolist() == [1, 0, 2]
    assert V.threshold_stopping_depth(conf, 0.97).tolist() == [2, 2, 2]
    assert V.threshold_stopping_depth(conf, math.inf).tolist() == [2, 2, 2]
    assert V.threshold_stopping_depth(conf, 0.0).tolist() == [0, 0, 0]
    losses = np.array([[2.0, 0.1, 3.0], [0.2, 0.1, 2.0], [0.1, 0.1, 1.0]])
    # mean loss + c·mean depth for the thresholds that matter (by hand):
    #   τ ≤ 0.1: stop at 0 everywhere -> (2+0.1+3)/3 = 1.7;  τ = 0.9: depths 1,0,2 -> (0.2+0.1+1)/3 + c
    #   τ = 0.95: depths 2,0,2 -> (0.1+0.1+1)/3 + c·4/3;   τ = 0.96: depths 2,1,2 -> 0.4 + c·5/3
    #   τ > 0.99: depths 2,2,2 -> 0.4 + 2c;  τ = 0.3 or 0.5: depths 0,0,2 -> 3.1/3 + c·2/3
    assert V.tune_threshold(losses, conf, 0.0) == math.inf  # ties go to the deepest policy
    assert V.tune_threshold(losses, conf, 0.05) == pytest.approx(0.95)  # 0.4667 < 0.4833 (0.9, 0.96) < 0.5
    assert V.tune_threshold(losses, conf, 0.2) == pytest.approx(0.9)  # 0.6333 < 0.6667 (0.95) < 0.7333
    assert V.tune_threshold(losses, conf, 5.0) <= 0.1  # cost dominates: stop at once


def test_stopping_summary_is_consistent_with_its_histogram():
    rng = np.random.default_rng(3)
    losses = rng.exponential(size=(4, 50))
    conf = rng.uniform(size=(4, 50))
    t = V.ExitTable(losses, conf, rng.uniform(size=(4, 50)) > 0.5)
    for s in V.stopping_summary(t, [0.0, 0.2], val=t):
        hist = np.array(s.histogram)
        assert hist.sum() == 50
        assert s.expected_depth == pytest.approx((hist * np.arange(4)).sum() / 50)
        assert s.risk == pytest.approx(s.loss_at_stop + s.cost * s.expected_depth)
    oracle0 = V.stopping_summary(t, [0.0])[0]
    assert oracle0.loss_at_stop == pytest.approx(losses.min(axis=0).mean())


# ----------------------------------------------------------------------------- block influence, ratios
def test_block_influence_and_update_ratio_closed_forms():
    th = 0.7
    rot = torch.tensor([[math.cos(th), -math.sin(th)], [math.sin(th), math.cos(th)]], dtype=torch.float64)
    model = _Stack(lambda z: z, lambda z: -z, lambda z: z @ rot.T, lambda z: 1.5 * z)
    z = torch.randn(7, 2, dtype=torch.float64)
    _, st = V.capture_stream(model, z)
    assert st.depth == 4
    np.testing.assert_allclose(V.block_influence(st), [0.0, 2.0, 1 - math.cos(th), 0.0], atol=1e-12)
    # ‖f‖/‖z‖: identity 0, negation 2, rotation |e^{iθ} − 1| = 2 sin(θ/2), scaling 0.5
    np.testing.assert_allclose(V.update_ratios(st), [0.0, 2.0, 2 * math.sin(th / 2), 0.5], atol=1e-12)


def test_block_influence_per_token_for_sequences():
    # a (B, T, d) stream: rows are tokens; negate only token 0 of each sequence -> BI = 2·(1/T)
    def neg_first(z):
        out = z.clone()
        out[:, 0] = -out[:, 0]
        return out

    _, st = V.capture_stream(_Stack(neg_first), torch.randn(3, 4, 5, dtype=torch.float64))
    np.testing.assert_allclose(V.block_influence(st), [2 * 3 / 12], atol=1e-12)


# ----------------------------------------------------------------------------- L_depth
def test_depth_regularizer_against_a_hand_computation():
    z0 = torch.tensor([[3.0, 4.0], [1.0, 0.0]], dtype=torch.float64)
    e = torch.tensor([0.0, 2.0], dtype=torch.float64)
    model = _Stack(lambda z: 2 * z, lambda z: z + e)
    _, st = V.capture_stream(model, z0)
    # block 1: f = z -> ‖f‖²/‖z‖² = 1 for both rows -> mean 1
    # block 2: z_1 = (6, 8), (2, 0); f = (0, 2): 4/100 and 4/4 -> mean 0.52
    # weights 2l/(L(L+1)) = 1/3, 2/3
    assert float(V.depth_regularizer(st)) == pytest.approx(1 / 3 * 1 + 2 / 3 * 0.52, rel=1e-12)
    np.testing.assert_allclose(V.depth_weights(4).numpy(), [0.1, 0.2, 0.3, 0.4])


def test_recipe_depth_reg_is_off_by_default_and_works_when_on():
    assert "depth_reg" not in R.RECIPE.to_dict()  # the sweep's resume keys are unchanged
    with pytest.raises(ValueError, match="depth_reg"):
        R.Recipe(depth_reg=-1.0)
    sizes = R.Sizes(train=160, val=60, probe=64, test=60)
    splits = R.load_splits("digits", 0, sizes)
    recipe = R.Recipe(max_epochs=3, patience=3)
    out = {}
    for lam in (0.0, 10.0):
        model = R.build_model("mlp", 3, splits, seed=0, width=16)
        res = R.train(model, splits, seed=0, recipe=R.Recipe(**{**recipe.__dict__, "depth_reg": lam}))
        _, st = V.capture_stream(res.model, splits.probe.x)
        out[lam] = float(V.depth_regularizer(st))
    assert out[10.0] < 0.5 * out[0.0]


def test_diminishing_returns_on_hand_tables():
    d = V.diminishing_returns([1.0, 0.5, 0.25], [1.0, 0.5, 0.3, 0.2])
    assert d["loss_decrease"] == pytest.approx([0.5, 0.2, 0.1])
    assert d["updates_diminish"] and d["loss_decrease_diminishes"] and d["holds"]
    d = V.diminishing_returns([1.0, 0.5, 0.8], [1.0, 0.9, 0.5, 0.45])
    assert not d["updates_diminish"] and not d["loss_decrease_diminishes"]
    with pytest.raises(ValueError, match="L\\+1"):
        V.diminishing_returns([1.0, 0.5], [1.0, 0.5])


# ----------------------------------------------------------------------------- rules
def test_snap_influence_count_and_agreement():
    grid = (1, 2, 4, 8)
    assert [EV.snap_depth(v, grid) for v in (0.0, 0.4, 1.0, 1.01, 3.9, 8, 20)] == [1, 1, 1, 2, 4, 8, 8]
    assert EV.influence_count([0.5, 0.3, 0.1, 0.1], 0.9) == 3  # 0.5+0.3+0.1 = 0.9
    assert EV.influence_count([0.1, 0.0, 0.85, 0.05], 0.9) == 2
    assert EV.influence_count([0.0, 0.0], 0.9) == 2
    curve = S.Curve("digits", "mlp", grid)
    v = EV.curve_verdicts(curve, [1.0, 0.5, 0.45, 0.44], 1.3, [0.6, 0.3, 0.05, 0.05], 4, mass=0.9, certified=False)
    # s plateaus at 4 (0.45 − 0.44 ≤ 0.1·0.56; 0.5 − 0.44 > 0.056); E[τ] 1.3 -> 2; BI needs 2 blocks -> 2
    assert (v["first_order"], v["stopping"], v["block_influence"]) == (4, 2, 2)
    assert v["agree_first_order"] and v["agree_stopping"] and v["agree_block_influence"] and v["all_agree"]
    assert v["retrained_plateau"] is None and v["all_agree_retrained"] is None
    v = EV.curve_verdicts(
        curve, [1.0, 0.5, 0.45, 0.44], 0.2, [0.6, 0.3, 0.05, 0.05], 8, mass=0.9, certified=False, retrained_plateau=2
    )
    assert v["stopping"] == 1 and v["agree_stopping"] is False and v["all_agree"] is False
    # against a plateau at 2: first-order 4 (one step) and stopping 1 (one step) agree, BI 2 agrees
    assert v["agree_retrained_first_order"] and v["agree_retrained_stopping"] and v["all_agree_retrained"]
    assert (
        EV.curve_verdicts(curve, [1, 1, 1, 1], 1.0, [1, 1, 1, 1], None, mass=0.9, certified=False)["all_agree"] is None
    )
    # s still halving at the deepest depth: the first-order view reaches no plateau and agrees with none
    v = EV.curve_verdicts(curve, [1.0, 0.5, 0.25, 0.125], 1.3, [0.6, 0.3, 0.05, 0.05], 4, mass=0.9, certified=False)
    assert v["first_order"] is None and v["agree_first_order"] is False and v["all_agree"] is False


# ----------------------------------------------------------------------------- bad input
def test_bad_input_errors():
    with pytest.raises(ValueError, match="cost"):
        V.oracle_stopping_depth(np.zeros((2, 3)), -0.1)
    with pytest.raises(ValueError, match="non-finite"):
        V.oracle_stopping_depth(np.array([[0.0, np.nan]]), 0.1)
    with pytest.raises(ValueError, match=r"\(L\+1, n\)"):
        V.oracle_stopping_depth(np.zeros(3), 0.1)
    with pytest.raises(ValueError, match="blocks"):
        V.residual_blocks(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not a submodule"):
        V.residual_blocks(_Stack(lambda z: z), ["blocks.7"])

    class Parallel(nn.Module):  # two blocks reading the same input: not one stream
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([_Lambda(lambda z: z + 1), _Lambda(lambda z: z + 2)])

        def forward(self, z):
            return self.blocks[0](z) + self.blocks[1](z)

    with pytest.raises(ValueError, match="one residual stream"):
        V.capture_stream(Parallel(), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="l2"):
        V.fit_linear_readouts(_Stack(lambda z: z), torch.zeros(4, 2), torch.zeros(4), 2, l2=-1)
    with pytest.raises(ExperimentError, match="config"):
        EV.run_views("huge")


# ----------------------------------------------------------------------------- the tiny run
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny views run through the CLI, against a hand-made sweep summary."""
    root = tmp_path_factory.mktemp("views")
    sweep = root / "sweep"
    sweep.mkdir()
    plateaus = [
        {"dataset": "digits", "arch": "mlp", "metric": "test_loss", "plateau_depth": 2},
        {"dataset": "digits", "arch": "mlp", "metric": "test_accuracy", "plateau_depth": 1},
        {"dataset": "digits", "arch": "cnn", "metric": "test_loss", "plateau_depth": 1},
        {"dataset": "kjv", "arch": "gpt", "metric": "test_loss", "plateau_depth": 1},
        {"dataset": "kjv", "arch": "gpt", "metric": "test_bpc", "plateau_depth": 2},
    ]
    recipe = EV.CONFIGS["tiny"].recipe.to_dict()
    (sweep / "summary.json").write_text(
        json.dumps({"meta": {"commit": "abc", "config": {"recipe": recipe}}, "summary": {"plateaus": plateaus}})
    )
    out = root / "views"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = runner.invoke(app, ["experiment", "views", "--config", "tiny", "--out", str(out), "--sweep", str(sweep)])
    finally:
        torch.set_num_threads(threads)
    assert res.exit_code == 0, res.output
    return out, res.output


def test_tiny_views_outputs(tiny):
    out, text = tiny
    for name in ("runs", "sites", "stopping", "stopping_hist", "curves", "depth_reg"):
        assert (out / f"{name}.csv").is_file(), name
    assert (out / "views.png").is_file() and (out / "views.svg").is_file()
    assert "Where depth stops paying" in text
    data = json.loads((out / "summary.json").read_text())
    summ = data["summary"]
    # the plateaus read from the sweep folder: test loss for images, bpc for text (not accuracy)
    assert {k: v["sweep_plateau"] for k, v in summ["verdicts"].items()} == {
        "digits/mlp": 2,
        "digits/cnn": 1,
        "kjv/gpt": 2,
    }
    assert summ["sweep"]["recipe_matches"] is True and summ["sweep"]["commit"] == "abc"
    assert data["meta"]["seeds"] == [0, 1]
    sites = _rows(out / "sites.csv")
    assert len(sites) == 2 * sum((d + 1) for d in (1, 2)) * 3  # seeds × Σ (depth + 1) × curves
    mlp1 = [r for r in sites if r["arch"] == "mlp" and r["depth"] == "1" and r["seed"] == "0"]
    assert [r["site"] for r in mlp1] == ["embed", "blocks.0"]
    gpt1 = [r for r in sites if r["arch"] == "gpt" and r["depth"] == "1" and r["seed"] == "0"]
    assert [r["site"] for r in gpt1] == ["(input of blocks.0)", "blocks.0"]
    for r in sites:
        if r["block_influence"]:
            assert 0 <= float(r["block_influence"]) <= 2


def test_tiny_views_stopping_is_consistent(tiny):
    out, _ = tiny
    hist = _rows(out / "stopping_hist.csv")
    for r in _rows(out / "stopping.csv"):
        key = ("dataset", "arch", "depth", "seed", "policy", "cost")
        mine = [h for h in hist if all(h[k] == r[k] for k in key)]
        counts = np.array([int(h["count"]) for h in sorted(mine, key=lambda h: int(h["l"]))])
        assert len(counts) == int(r["depth"]) + 1
        assert float(r["expected_depth"]) == pytest.approx((counts * np.arange(len(counts))).sum() / counts.sum())
        assert float(r["risk"]) == pytest.approx(
            float(r["loss_at_stop"]) + float(r["cost"]) * float(r["expected_depth"])
        )
        if r["policy"] == "oracle":  # the oracle never pays more than running every block
            assert float(r["risk"]) <= float(r["full_depth_loss"]) + float(r["cost"]) * int(r["depth"]) + 1e-9
    reg = _rows(out / "depth_reg.csv")
    assert sorted({(r["seed"], r["lambda"]) for r in reg}) == [("0", "0.0"), ("0", "1.0"), ("1", "0.0"), ("1", "1.0")]


def test_views_bad_input_one_line_exit_2(tmp_path):
    res = runner.invoke(app, ["experiment", "views", "--config", "huge", "--out", str(tmp_path / "v")])
    assert res.exit_code == 2 and "huge" in res.output
    res = runner.invoke(
        app,
        ["experiment", "views", "--config", "tiny", "--out", str(tmp_path / "v"), "--sweep", str(tmp_path / "nope")],
    )
    assert res.exit_code == 2 and "sweep" in res.output
    assert not (tmp_path / "v").exists()


def test_views_write_is_atomic(tmp_path, monkeypatch):
    out = tmp_path / "views"
    out.mkdir()
    (out / "old.csv").write_text("previous results\n")

    class BadFigure:  # fails inside write_results, after the CSV files are in the temporary folder
        def savefig(self, *_a, **_k):
            raise RuntimeError("figure failed")

    def boom(*_a, **_k):
        return BadFigure()

    monkeypatch.setattr(EV, "_figure", boom)
    small = EV.ViewsConfig(
        name="tiny",
        curves=(S.Curve("digits", "mlp", (1,), 8),),
        seeds=(0,),
        sizes={"digits": R.Sizes(train=60, val=30, probe=30, test=30)},
        recipe=R.Recipe(max_epochs=1, patience=1),
        reg_datasets=(),
    )
    with pytest.raises(RuntimeError, match="figure failed"):
        EV.run_views(small, out=out, sweep=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["views"]  # no temporary folder left
    assert sorted(p.name for p in out.iterdir()) == ["old.csv"]  # the previous results untouched
