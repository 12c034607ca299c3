"""The views on the budget sweep's models (``depthsat experiment views --config budget``).

* the model provider is the budget sweep's own training: the tiny budget sweep is run
  (``run_budget_sweep``, its own folder) and the views' retrained models have its test and train
  losses and its deepest-site ``s`` bit for bit; a resumed run trains nothing and writes the same;
* the exits and block influence of a budget-trained model against a dense numpy reference (the
  stream recomputed block by block, the standardised readout's log-softmax, ``1 − cos``);
* reading the budget sweep's folder, the reproduction rule and the ``Views agree`` claim rows on
  hand-made values (exact floats, hand-counted agreement).
"""

from __future__ import annotations

import csv
import itertools
import json
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from depthsat_theory import views as V
from depthsat_theory.cli import app
from depthsat_theory.experiments import ExperimentError
from depthsat_theory.experiments import budget_sweep as B
from depthsat_theory.experiments import recipe as R
from depthsat_theory.experiments import sweep as S
from depthsat_theory.experiments import views as EV

runner = CliRunner()
SCHEMA_KEYS = {"claim", "setting", "verdict", "qualifier", "interval", "reason"}


def _rows(path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_budget(tmp_path_factory, one_thread):
    """The tiny budget sweep (seed 0, no growth), then the views on its models through the CLI, with --resume."""
    root = tmp_path_factory.mktemp("views-budget")
    sweep = B.run_budget_sweep("tiny", out=root / "budget-sweep", seeds=[0], growth=False)
    out = root / "views-budget"
    args = ["experiment", "views", "--config", "tiny-budget", "--seeds", "0", "--sweep", str(sweep)]
    res = runner.invoke(app, [*args, "--out", str(out), "--resume", str(root / "r.jsonl")])
    assert res.exit_code == 0, res.output
    return root, sweep, out, res.output, args


def test_tiny_budget_views_reproduce_the_budget_sweep_models(tiny_budget):
    _root, sweep, out, text, _ = tiny_budget
    committed = {(r["seed"], r["depth"]): r for r in _rows(sweep / "runs.csv")}
    deepest_s = {}
    for r in _rows(sweep / "sites.csv"):
        if r["split"] == "probe" and r["s"]:
            deepest_s[(r["seed"], r["depth"])] = r["s"]  # file order: the last is the deepest site
    runs = _rows(out / "runs.csv")
    assert sorted((r["seed"], r["depth"]) for r in runs) == sorted(committed)
    for r in runs:
        ref = committed[(r["seed"], r["depth"])]
        # bit for bit: the same float text as the budget sweep's own run wrote
        assert (r["test_loss"], r["train_loss"]) == (ref["test_loss"], ref["train_loss"])
        assert r["s_last"] == deepest_s[(r["seed"], r["depth"])]
        assert r["reproduced"] == "True"
    data = json.loads((out / "summary.json").read_text())
    rep = data["summary"]["reproduction"]
    assert (rep["models"], rep["reproduced"], rep["bitwise_losses"]) == (2, 2, 2)
    assert data["summary"]["sweep"]["recipe_matches"] is True
    assert "reproduction: 2 of 2 models" in text
    assert not (out / "depth_reg.csv").exists()  # no L_depth on the budget sweep's models


def test_tiny_budget_views_plateaus_and_claims(tiny_budget):
    _root, sweep, out, _, _ = tiny_budget
    data = json.loads((out / "summary.json").read_text())
    v = data["summary"]["verdicts"]["digits/mlp"]
    # the sweep plateau is the budget sweep's own reading; recomputed here from its runs.csv
    runs = _rows(sweep / "runs.csv")
    means = [np.mean([float(r["test_loss"]) for r in runs if int(r["depth"]) == d]) for d in (1, 2)]
    assert v["sweep_plateau"] == (1 if means[0] <= means[1] else None)  # None: still falling at 2
    assert v["retrained_plateau"] == v["sweep_plateau"]
    claims = data["claims"]
    assert len(claims) == 1 and set(claims[0]) == SCHEMA_KEYS
    assert claims[0]["claim"] == "Views agree"
    expected = "untestable here" if v["sweep_plateau"] in (1, None) else ("holds" if v["all_agree"] else "fails")
    assert claims[0]["verdict"] == expected
    per_seed = data["summary"]["verdicts_per_seed"]["digits/mlp"]
    assert [r["seed"] for r in per_seed] == [0]


def test_tiny_budget_views_resume_trains_nothing(tiny_budget, monkeypatch):
    root, _sweep, out, _, args = tiny_budget

    def no_training(*_a, **_k):
        raise AssertionError("a finished model was retrained")

    monkeypatch.setattr(B, "_train", no_training)
    again = root / "again"
    res = runner.invoke(app, [*args, "--out", str(again), "--resume", str(root / "r.jsonl")])
    assert res.exit_code == 0, res.output
    assert _rows(again / "runs.csv") == _rows(out / "runs.csv")
    first, second = (json.loads((f / "summary.json").read_text()) for f in (out, again))
    assert first["summary"]["verdicts"] == second["summary"]["verdicts"]
    assert first["claims"] == second["claims"]


def test_budget_model_exits_and_influence_against_numpy(one_thread):
    cfg = EV.CONFIGS["tiny-budget"]
    curve = cfg.curves[0]
    splits = R.load_splits(curve.dataset, 1, cfg.sizes[curve.dataset])
    model, metrics = EV._trained(cfg, curve, 2, 1, splits)
    assert metrics["test_loss"] == R.evaluate(B._train(cfg.budget, splits, 2, 1)[0], splits.test, splits)["loss"]
    ro = V.fit_linear_readouts(model, splits.train.x, splits.train.y, splits.n_classes, l2=cfg.readout_l2)
    table = V.readout_table(model, ro, splits.test.x, splits.test.y)
    # the stream by hand, block by block, in float64 numpy from float32 torch block calls
    with torch.no_grad():
        z = [model.embed(splits.test.x.float())]
        for blk in model.blocks:
            z.append(blk(z[-1]))
    zs = [t.double().numpy() for t in z]
    y = splits.test.y.numpy()
    for k, f in enumerate(zs):
        m, s = ro.mean[k].numpy(), ro.scale[k].numpy()
        logits = ((f - m) / s) @ ro.weight[k].numpy().T + ro.bias[k].numpy()
        top = logits.max(1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(1, keepdims=True))
        np.testing.assert_allclose(table.losses[k], -logp[np.arange(len(y)), y], rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(table.confidence[k], np.exp(logp.max(1)), rtol=1e-6, atol=1e-9)
    _, st = V.capture_stream(model, splits.test.x)
    cos = [(a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)) for a, b in itertools.pairwise(zs)]
    np.testing.assert_allclose(V.block_influence(st), [1 - c.mean() for c in cos], rtol=1e-6, atol=1e-9)


def _budget_folder(tmp_path, plateau=4, s_rows=None):
    base = tmp_path / "bs"
    base.mkdir()
    config = B.CONFIGS["full"].to_dict()
    summary = {"claims": {"precondition": {"test_loss_plateau_depth": plateau, "holds": True}}}
    (base / "summary.json").write_text(json.dumps({"meta": {"commit": "c0ffee", "config": config}, "summary": summary}))
    (base / "runs.csv").write_text("depth,seed,train_loss,test_loss\n1,0,0.25,0.375\n2,0,0.125,0.5\n")
    rows = s_rows or ["0,1,probe,embed,0.5", "0,1,probe,blocks.0,0.25", "0,1,train,blocks.0,0.75"]
    (base / "sites.csv").write_text("seed,depth,split,site,s\n" + "\n".join(rows) + "\n")
    return base


def test_read_budget_sweep_and_reproduction_rule(tmp_path):
    sw = EV.read_budget_sweep(_budget_folder(tmp_path))
    assert sw["plateaus"] == {"fashion/mlp": 4} and sw["metric"] == {"fashion/mlp": "test_loss"}
    assert sw["commit"] == "c0ffee" and sw["depth_pays"] is True
    assert sw["runs"] == {
        ("fashion", "mlp", 0, 1): {"test_loss": 0.375, "train_loss": 0.25, "s_last": 0.25},
        ("fashion", "mlp", 0, 2): {"test_loss": 0.5, "train_loss": 0.125},
    }
    mine = B.CONFIGS["full"].to_dict()
    assert sw["recipe"] == {k: mine[k] for k in ("dataset", "width", "sizes", "budget", "model")}
    runs = [
        {
            "dataset": "fashion",
            "arch": "mlp",
            "seed": 0,
            "depth": 1,
            "test_loss": 0.375,
            "train_loss": 0.25,
            "s_last": 0.25,
        },
        {
            "dataset": "fashion",
            "arch": "mlp",
            "seed": 0,
            "depth": 2,
            "test_loss": 0.5 + 2.0**-38,
            "train_loss": 0.125,
            "s_last": 0.5,
        },  # 3.6e-12 off
        {
            "dataset": "fashion",
            "arch": "mlp",
            "seed": 1,
            "depth": 1,
            "test_loss": 0.375,
            "train_loss": 0.25,
            "s_last": 0.25,
        },  # not committed
    ]
    rep = EV._reproduction(runs, sw)
    assert [r["reproduced"] for r in runs] == [True, False, None]
    assert (rep["compared"], rep["reproduced"], rep["bitwise_losses"], rep["not_in_committed_runs"]) == (
        2,
        1,
        1,
        [("fashion", "mlp", 1, 1)],
    )
    assert rep["max_abs_diff_test_loss"] == 2.0**-38 and rep["max_abs_diff_train_loss"] == 0.0
    runs[1]["test_loss"] = 0.5 + 2.0**-42  # 2.3e-13: within the tolerance, not bitwise
    rep = EV._reproduction(runs, sw)
    assert (rep["reproduced"], rep["bitwise_losses"]) == (2, 1)
    with pytest.raises(ExperimentError, match="budget sweep"):
        EV.read_budget_sweep(tmp_path / "nowhere")
    (tmp_path / "bs" / "summary.json").write_text(json.dumps({"meta": {}, "summary": {"plateaus": []}}))
    with pytest.raises(ExperimentError, match="not a budget-sweep result"):
        EV.read_budget_sweep(tmp_path / "bs")


def _verdict(curve, first, stop, bi, plateau):
    # s at the deepest site per depth 1, 2, 4, 8 whose plateau (10 % of the range) is `first` by hand;
    # None: still falling at 8 (not reached)
    s_mean = {1: [1.0] * 4, 2: [1.0, 0.0, 0.0, 0.0], 4: [1.0, 0.5, 0.0, 0.0], None: [1.0, 0.75, 0.5, 0.0]}[first]
    bis = [1.0] * bi + [0.0] * (max(curve.depths) - bi)  # exactly `bi` blocks carry all the influence
    v = EV.curve_verdicts(curve, s_mean, stop, bis, plateau, mass=0.9, certified=False, retrained_plateau=plateau)
    v.update(grid_min=min(curve.depths), grid_max=max(curve.depths))
    return v


def test_views_claims_rule_on_hand_values():
    curve = S.Curve("fashion", "mlp", (1, 2, 4, 8), 32)
    v = _verdict(curve, 4, 1.5, 6, 4)  # first-order 4, stopping 2, block influence 8: all within one step of 4
    assert (v["first_order"], v["stopping"], v["block_influence"]) == (4, 2, 8)
    seeds = [
        {"seed": 0, "first_order": 4, "stopping": 2, "block_influence": 8, "all_agree": True},
        {"seed": 1, "first_order": None, "stopping": 1, "block_influence": 8, "all_agree": False},
    ]
    (row,) = EV.views_claims({"fashion/mlp": v}, {"fashion/mlp": seeds}, {"fashion/mlp": "Fashion"})
    assert set(row) == SCHEMA_KEYS and row["claim"] == "Views agree" and row["setting"] == "Fashion"
    assert row["verdict"] == "holds"
    assert row["qualifier"] == (
        "all within one step in 1 of 2 seeds; exactly at 4: 1 of 3; "
        "block-influence at the deepest depth run (one step from 4 by the grid)"
    )
    assert "4/2/8; not reached/1/8" in row["interval"]
    v = _verdict(curve, None, 1.5, 6, 4)  # s still falls at 8: the first-order view is not reached
    assert v["first_order"] is None
    (row,) = EV.views_claims({"c": v}, {"c": seeds}, {})
    assert row["verdict"] == "fails" and row["reason"].startswith("first-order not within one depth step")
    assert row["interval"].startswith("first-order not reached, stopping 2, block-influence 8 against")
    v = _verdict(curve, 4, 0.5, 6, 4)  # stopping snaps to 1: two steps from 4
    (row,) = EV.views_claims({"c": v}, {"c": seeds}, {})
    assert row["verdict"] == "fails" and row["reason"].startswith("stopping not within one depth step")
    for plateau, words in ((1, "never pays"), (None, "no test-loss plateau"), (3, "not on this curve's depth grid")):
        (row,) = EV.views_claims({"c": _verdict(curve, 2, 0.5, 1, plateau)}, {"c": []}, {})
        assert row["verdict"] == "untestable here" and words in row["reason"], plateau
        assert row["qualifier"] == ""


def test_budget_config_is_the_budget_sweeps():
    cfg, bcfg = EV.CONFIGS["budget"], B.CONFIGS["full"]
    assert cfg.budget == bcfg and cfg.recipe == bcfg.budget and cfg.seeds == bcfg.seeds
    assert cfg.curves == (S.Curve("fashion", "mlp", bcfg.depths, bcfg.width),)
    assert cfg.sizes == {"fashion": bcfg.sizes} and cfg.reg_datasets == ()
    assert (cfg.delta, cfg.probe_batch) == (bcfg.delta, bcfg.probe_batch)
    assert math.isclose(cfg.reference_cost, 0.003)


def test_views_budget_runs_after_the_budget_sweep_in_experiment_all(monkeypatch, tmp_path):
    from depthsat_theory.cli.experiment import EXPERIMENTS

    names = list(EXPERIMENTS)
    assert names.index("views-budget") > names.index("budget-sweep")  # it reads ROOT/budget-sweep
    seen = {}

    def fake(config, **kw):
        seen[config] = kw["sweep"]
        return kw["out"]

    monkeypatch.setattr(EV, "run_views", fake)
    for config in ("tiny", "full"):
        EXPERIMENTS["views-budget"](config, out=tmp_path / "views-budget", log=print)
    assert seen == {"tiny-budget": tmp_path / "budget-sweep", "budget": tmp_path / "budget-sweep"}


def test_the_early_stopping_sweeps_runs_are_checked_too(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    plateaus = [{"dataset": "digits", "arch": "mlp", "metric": "test_loss", "plateau_depth": 2}]
    (sweep / "summary.json").write_text(json.dumps({"meta": {}, "summary": {"plateaus": plateaus}}))
    sw = EV.read_sweep_plateaus(sweep)
    assert sw["runs"] is None and EV._reproduction([], sw) is None  # no runs.csv: nothing to compare
    (sweep / "runs.csv").write_text("dataset,arch,depth,seed,test_loss\ndigits,mlp,1,0,0.125\ndigits,mlp,2,0,0.25\n")
    sw = EV.read_sweep_plateaus(sweep)
    assert sw["runs"] == {("digits", "mlp", 0, 1): {"test_loss": 0.125}, ("digits", "mlp", 0, 2): {"test_loss": 0.25}}
    runs = [
        {"dataset": "digits", "arch": "mlp", "seed": 0, "depth": 1, "test_loss": 0.125, "s_last": 0.5},
        {"dataset": "digits", "arch": "mlp", "seed": 0, "depth": 2, "test_loss": 0.375, "s_last": 0.5},
    ]
    rep = EV._reproduction(runs, sw)
    assert [r["reproduced"] for r in runs] == [True, False] and "committed_train_loss" not in runs[0]
    assert (rep["reproduced"], rep["bitwise_losses"], rep["max_abs_diff_test_loss"]) == (1, 1, 0.125)
    assert rep["max_abs_diff_train_loss"] is None
    note = EV._sweep_note(True, rep)
    assert note is not None and note.startswith("1 of 2 retrained models differ") and "0.125" in note
    assert EV._sweep_note(True, {**rep, "reproduced": 2}) is None
    assert "another recipe" in EV._sweep_note(False, None)
