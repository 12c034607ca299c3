"""Growth against scratch and criterion-driven growth.

Independent checks: exact function preservation of the zero-output deepening; the architecture
equals the one built from scratch; the multiply-add counter against a hand count and against
``torch.utils.flop_counter``; the budget accounting of the CLI's tiny run against the configuration;
the paired interval against scipy's one-sample t interval; the criterion's decision rule on
hand-built diagnoses.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from scipy import stats
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from typer.testing import CliRunner

from depthsat_theory.cli.app import app
from depthsat_theory.experiments import ExperimentError
from depthsat_theory.experiments.criterion import CERTIFIED, FALLBACK, decide
from depthsat_theory.experiments.criterion import CONFIGS as CRITERION_CONFIGS
from depthsat_theory.experiments.deepen import deepen, interleaved_positions
from depthsat_theory.experiments.flops import training_cost
from depthsat_theory.experiments.growth import CONFIGS as GROWTH_CONFIGS
from depthsat_theory.experiments.growth import paired_relative_difference
from depthsat_theory.grow import GrowError
from depthsat_theory.tasks.models import MLPBlock, ResidualMLP
from depthsat_theory.vocabulary import Certificate, Verdict

runner = CliRunner()


def _read(path):
    with open(path) as fh:
        return list(csv.DictReader(fh))


# ----------------------------------------------------------------------------- deepening


def _trained_mlp(depth: int, seed: int = 0) -> ResidualMLP:
    """A ResidualMLP moved off its initialisation (every W2 nonzero), so preservation is not trivial."""
    torch.manual_seed(seed)
    model = ResidualMLP(in_dim=6, width=5, depth=depth, n_classes=3, activation="tanh")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(40, 6), torch.randint(0, 3, (40,))
    for _ in range(5):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.eval()


@pytest.mark.parametrize("after", [[0], [1], [-1], [-1, 0, 1, 1]])
def test_deepened_model_computes_exactly_the_same_outputs(after):
    model = _trained_mlp(2)
    grown = deepen(model, after, torch.randn(8, 6), seed=3)
    fresh = torch.randn(64, 6)  # not the probe the check used
    assert torch.equal(grown.model(fresh), model(fresh))
    assert grown.deviation == 0.0
    assert len(grown.model.blocks) == 2 + len(after)
    for pos in grown.positions:  # the new blocks are zero-output MLP blocks of the same kind
        block = grown.model.blocks[pos]
        assert isinstance(block, MLPBlock) and isinstance(block.act, nn.Tanh)
        assert not block.W2.weight.any() and not block.W2.bias.any()
        assert block.W1.weight.abs().sum() > 0
    assert len(model.blocks) == 2  # the original is untouched


def test_deepened_model_is_the_architecture_built_from_scratch():
    model = _trained_mlp(2)
    grown = deepen(model, interleaved_positions(2, 3), torch.randn(4, 6)).model
    scratch = ResidualMLP(in_dim=6, width=5, depth=5, n_classes=3, activation="tanh")
    assert {k: v.shape for k, v in grown.state_dict().items()} == {k: v.shape for k, v in scratch.state_dict().items()}
    scratch.load_state_dict(grown.state_dict(), strict=True)
    x = torch.randn(10, 6)
    assert torch.equal(scratch.eval()(x), model(x))


def test_new_blocks_get_a_gradient_through_their_output_layer():
    model = _trained_mlp(1)
    grown = deepen(model, [0], torch.randn(4, 6))
    x, y = torch.randn(30, 6), torch.randint(0, 3, (30,))
    nn.functional.cross_entropy(grown.model(x), y).backward()
    new = grown.model.blocks[grown.positions[0]]
    assert new.W2.weight.grad.abs().sum() > 0  # trainable from zero: not a dead block
    assert not new.W1.weight.grad.any()  # W2 = 0 blocks the path to W1 at the first step


def test_interleaved_positions_hand_values():
    assert interleaved_positions(2, 2) == [0, 1]
    assert interleaved_positions(2, 6) == [0, 0, 0, 1, 1, 1]
    assert interleaved_positions(4, 2) == [1, 3]
    with pytest.raises(GrowError):
        interleaved_positions(0, 1)


@pytest.mark.parametrize("after", [[], [2], [-2]])
def test_deepen_refuses_bad_positions(after):
    with pytest.raises(GrowError, match="after"):
        deepen(_trained_mlp(2), after, torch.randn(4, 6))


# ----------------------------------------------------------------------------- FLOP counter


def test_training_cost_against_a_hand_count():
    # embed 8x4, one block 4->8->4, head 4x3:  forward 32 + 32 + 32 + 12 = 108 multiply-adds;
    # weight gradients as many; input gradients for every layer but the embedding (raw input): 76
    cost = training_cost(ResidualMLP(in_dim=8, width=4, depth=1, n_classes=3), torch.randn(1, 8))
    assert (cost.forward, cost.weight_grad, cost.input_grad) == (108, 108, 76)
    assert cost.macs == 292 and cost.flops == 584


def test_training_cost_against_torch_flop_counter():
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 2, 3, stride=2), nn.Flatten(), nn.Linear(2 * 3 * 3, 4)
    )
    x = torch.randn(1, 1, 7, 7)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    assert training_cost(model, x).flops == counter.get_total_flops()
    assert training_cost(model, x).forward == 7 * 7 * 3 * 9 + 3 * 3 * 2 * 27 + 18 * 4


def test_training_cost_refuses_a_batch():
    with pytest.raises(ValueError, match="one example"):
        training_cost(ResidualMLP(8, 4, 1, 3), torch.randn(2, 8))


# ----------------------------------------------------------------------------- paired interval


def test_paired_relative_difference_against_scipy():
    grown = [0.81, 0.92, 0.77, 1.05, 0.88]
    scratch = [0.95, 0.97, 0.90, 1.02, 1.01]
    rel = [(g - s) / s for g, s in zip(grown, scratch, strict=True)]
    ref = stats.ttest_1samp(rel, 0.0).confidence_interval(0.95)
    got = paired_relative_difference(grown, scratch)
    assert got["per_seed"] == pytest.approx(rel, rel=1e-15)
    assert got["mean"] == pytest.approx(sum(rel) / 5, rel=1e-13)
    assert got["std"] == pytest.approx(stats.tstd(rel), rel=1e-12)
    assert (got["ci_low"], got["ci_high"]) == pytest.approx((ref.low, ref.high), rel=1e-10)


@pytest.mark.parametrize(
    ("treated", "control", "match"),
    [
        ([1.0], [1.0, 2.0], "treated values"),
        ([1.0, 2.0], [0.0, 1.0], "positive"),
        ([math.nan, 1.0], [1.0, 1.0], "non-finite"),
    ],
)
def test_paired_relative_difference_refuses_bad_input(treated, control, match):
    with pytest.raises(ExperimentError, match=match):
        paired_relative_difference(treated, control)


# ----------------------------------------------------------------------------- the tiny growth run


def _macs(in_dim: int, width: int, depth: int, classes: int) -> int:
    """Hand count for a ResidualMLP: forward, weight gradients, input gradients (not the embedding's)."""
    forward = in_dim * width + depth * 4 * width * width + width * classes
    return 3 * forward - in_dim * width


def test_growth_tiny_through_the_cli(tmp_path, monkeypatch):
    # no --out: a tiny run goes to a new temporary folder, never over the committed experiments/results/
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["experiment", "growth", "--config", "tiny"])
    assert res.exit_code == 0, res.output
    out = Path(res.output.strip().splitlines()[-1].removeprefix("results written to "))
    assert not (tmp_path / "experiments").exists()
    assert out.name == "growth" and out.parent.parent == Path(tempfile.gettempdir())
    cfg = GROWTH_CONFIGS["tiny"]
    rows = _read(out / "runs.csv")
    assert len(rows) == 3 * len(cfg["seeds"])
    n_train = cfg["sizes"]["digits"]["train"]
    c0 = _macs(64, cfg["width"], cfg["shallow_depth"], 10)
    c1 = _macs(64, cfg["width"], cfg["deep_depth"], 10)
    for seed in cfg["seeds"]:
        arm = {r["arm"]: r for r in rows if int(r["seed"]) == seed}
        e0 = int(arm["shallow"]["epochs"]) * n_train
        assert int(arm["shallow"]["examples_seen"]) == e0
        budget = e0 + cfg["grow_epochs"] * n_train
        assert int(arm["grown"]["examples_seen"]) == int(arm["scratch"]["examples_seen"]) == budget
        assert int(arm["grown"]["flops"]) == 2 * (c0 * e0 + c1 * (budget - e0))
        assert int(arm["scratch"]["flops"]) == 2 * c1 * budget
        assert float(arm["grown"]["growth_deviation"]) == 0.0
    summary = json.loads((out / "summary.json").read_text())
    res_d = summary["summary"]["results"]["digits"]
    assert res_d["examples_seen_equal"] is True
    rel = [
        (float(g["test_loss"]) - float(s["test_loss"])) / float(s["test_loss"])
        for g, s in zip(
            [r for r in rows if r["arm"] == "grown"], [r for r in rows if r["arm"] == "scratch"], strict=True
        )
    ]
    assert res_d["relative_test_loss_grown_vs_scratch"]["mean"] == pytest.approx(sum(rel) / len(rel), rel=1e-9)
    assert summary["meta"]["seeds"] == cfg["seeds"]
    assert (out / "growth.png").is_file() and (out / "growth.svg").is_file()


def test_only_the_full_configuration_defaults_to_the_committed_results():
    from depthsat_theory.experiments.record import DEFAULT_RESULTS_ROOT, default_folder

    assert (
        default_folder("growth", "full")
        == Path("experiments") / "results" / "growth"
        == DEFAULT_RESULTS_ROOT / "growth"
    )
    for config in ("tiny", "large"):
        folder = default_folder("sweep", config)
        assert folder.name == "sweep" and not folder.exists() and folder.parent.is_dir()
        assert folder.parent.parent == Path(tempfile.gettempdir())


def test_growth_cli_refuses_one_seed(tmp_path):
    res = runner.invoke(app, ["experiment", "growth", "--config", "tiny", "--seeds", "0", "--out", str(tmp_path / "g")])
    assert res.exit_code == 2
    assert "--seeds" in res.output
    assert not (tmp_path / "g").exists()


# ----------------------------------------------------------------------------- criterion-driven growth


def _fake_sweep(folder):
    """A made-up sweep result folder: width 16, test loss 0.5, 0.25, 0.25 at depths 1, 2, 4 (plateau at 2)."""
    folder.mkdir()
    meta = {"config": {"curves": [{"dataset": "digits", "arch": "mlp", "depths": [1, 2, 4], "width": 16}]}}
    (folder / "summary.json").write_text(json.dumps({"meta": meta, "summary": {"plateaus": []}}))
    test = {1: 0.5, 2: 0.25, 4: 0.25}
    runs = [(1, 0, 1000), (2, 0, 2000), (4, 0, 500), (1, 1, 3000), (2, 1, 500), (4, 1, 100)]  # depth, seed, examples
    with open(folder / "runs.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["dataset", "arch", "depth", "seed", "examples_seen", "test_loss"])
        w.writerows(["digits", "mlp", d, sd, e, test[d]] for d, sd, e in runs)
        w.writerow(["digits", "cnn", 1, 0, 10**6, 9.0])  # another curve of the sweep: not the reference
    return runs


def test_criterion_growth_tiny_through_the_cli(tmp_path):
    out = tmp_path / "crit"
    fake = _fake_sweep(tmp_path / "sweep")
    res = runner.invoke(
        app,
        ["experiment", "criterion-growth", "--config", "tiny", "--out", str(out), "--sweep", str(tmp_path / "sweep")],
    )
    assert res.exit_code == 0, res.output
    rounds, sites, stops = (_read(out / f"{n}.csv") for n in ("rounds", "sites", "stops"))
    assert sorted((s["arm"], s["seed"]) for s in stops) == [
        (a, str(sd)) for a in ("certified", "noise") for sd in range(3)
    ]
    for stop in stops:
        mine = [r for r in rounds if (r["seed"], r["arm"]) == (stop["seed"], stop["arm"])]
        assert [int(r["depth"]) for r in mine] == list(range(1, len(mine) + 1))  # one block per round
        assert [r["decision"] == "stop" for r in mine] == [False] * (len(mine) - 1) + [True]
        assert int(stop["stop_depth"]) == int(mine[-1]["depth"])
        assert all(
            int(a["examples_seen_cumulative"]) < int(b["examples_seen_cumulative"]) for a, b in itertools.pairwise(mine)
        )
        # the reported round is the one with the lowest validation loss, and the stop row reports it
        vals = [float(r["val_loss"]) for r in mine]
        best = vals.index(min(vals))
        assert [r["is_best"] == "True" for r in mine] == [i == best for i in range(len(mine))]
        assert (int(stop["best_round"]), stop["test_loss"]) == (best, mine[best]["test_loss"])
        for r in mine:  # a diagnosis covers every site of the model diagnosed: embed + one per block
            at = [s for s in sites if (s["seed"], s["arm"], s["round"]) == (stop["seed"], stop["arm"], r["round"])]
            assert [s["site"] for s in at] == ["embed"] + [f"blocks.{i}" for i in range(int(r["depth"]))]
            noise_stops = not any(s["noise_verdict"] == "improvable" for s in at)
            assert r["stops_noise"] == str(noise_stops)
        if stop["arm"] == "noise":
            assert (mine[-1]["stops_noise"] == "True") == (mine[-1]["reason"] != "max_depth reached")
    data = json.loads((out / "summary.json").read_text())
    ref = data["summary"]["digits"]["reference"]
    assert ref["reference_plateau_depth_test_loss"] == 2
    assert ref["reference_depth_pays"]["per_seed"] == [0.25, 0.25] and ref["reference_depth_pays"]["pays"]
    width = 16  # the sweep's width (its meta), not this experiment's
    assert CRITERION_CONFIGS["tiny"]["width"] != width and ref["reference_width"] == width
    per_seed = [sum(2 * _macs(64, width, d, 10) * e for d, sd, e in fake if sd == seed) for seed in (0, 1)]
    assert ref["reference_flops_per_seed"]["mean"] == pytest.approx(sum(per_seed) / 2, rel=1e-12)
    assert ref["reference_examples_seen_per_seed"]["mean"] == 3550
    keys = {"claim", "setting", "verdict", "qualifier", "interval", "reason"}
    assert len(data["claims"]) == 2 and all(set(c) == keys for c in data["claims"])
    for c in data["claims"]:  # the stated rule: within a factor 2 of the plateau (2) in every seed
        arm = "noise" if "noise rule" in c["setting"] else "certified"
        depths = [int(s["stop_depth"]) for s in stops if s["arm"] == arm]
        assert c["verdict"] == ("holds" if all(1 <= d <= 4 for d in depths) else "fails")


def _fake_diagnosis(certs, lowers, scores, unbiased_sq, n_to_certify=10**6, n=256):
    sites = []
    for i, (c, lo, s, u) in enumerate(zip(certs, lowers, scores, unbiased_sq, strict=True)):
        iv = SimpleNamespace(
            certificate=c, score_lower=lo, vacuous=lo == 0.0, n_to_certify=n_to_certify, score_squared_unbiased=u
        )
        # v̂ chosen so that (n ŝ² − v̂)/(n − 1) = u: the headline s_U = sqrt(max(u, 0)) ranks as the fallback reads
        res = SimpleNamespace(
            ag_rms=1.0,
            relative_score=s,
            score=s,
            n=n,
            noise_variance=n * s * s - (n - 1) * u,
            alpha=0.05,
            noise_ratio=float("nan"),
            verdict=Verdict.UNDETERMINED,
        )
        sites.append(
            SimpleNamespace(site=f"blocks.{i}", depth=i, interval=iv, result=res, verdict=Verdict.UNDETERMINED)
        )
    return SimpleNamespace(sites=sites, delta=0.05, n=n)


def test_decide_stops_when_every_site_is_certified_saturated():
    s = Certificate.SATURATED
    d = decide(_fake_diagnosis([s, s], [0.0, 0.0], [0.01, 0.02], [0.0, 0.0]), 0.1, False)
    assert d["stop"] and d["rule"] == CERTIFIED


def test_decide_grows_at_the_largest_certified_lower_end():
    i, n = Certificate.IMPROVABLE, Certificate.NOT_CERTIFIED
    d = decide(_fake_diagnosis([i, i, n], [0.2, 0.3, 0.0], [0.9, 0.35, 0.95], [0.5, 0.5, 0.5]), 0.1, False)
    assert (d["stop"], d["site"], d["rule"]) == (False, "blocks.1", CERTIFIED)


def test_decide_falls_back_to_the_point_estimate_when_nothing_is_certified():
    n = Certificate.NOT_CERTIFIED
    d = decide(_fake_diagnosis([n, n, n], [0.0] * 3, [0.2, 0.6, 0.4], [0.04, 0.3, 0.1]), 0.1, False)
    assert (d["stop"], d["site"], d["rule"], d["certified_undetermined"]) == (False, "blocks.1", FALLBACK, True)
    assert "n_to_certify" in d["reason"]
    # the fallback stops when the bias-corrected score is at most ε everywhere (0.09² ≤ 0.1²)
    d = decide(_fake_diagnosis([n, n], [0.0] * 2, [0.2, 0.6], [0.0081, -0.01]), 0.1, False)
    assert d["stop"] and d["rule"] == FALLBACK


def test_criterion_growth_refuses_a_sweep_folder_without_results(tmp_path):
    out = tmp_path / "crit"
    (tmp_path / "empty").mkdir()
    for sweep in (tmp_path / "missing", tmp_path / "empty"):
        res = runner.invoke(
            app, ["experiment", "criterion-growth", "--config", "tiny", "--out", str(out), "--sweep", str(sweep)]
        )
        assert res.exit_code == 2, res.output
        assert res.output.startswith("error: --sweep") and len(res.output.strip().splitlines()) == 1, res.output
    assert not out.exists()
