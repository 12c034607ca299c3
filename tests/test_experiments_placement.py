"""``depthsat experiment placement``: where to grow an LLM, its pieces and the tiny configuration.

Independent truths: block influence recomputed with numpy from a tiny Llama's ``output_hidden_states``
(the final norm replaced by the identity, so the last layer's raw output is visible); the window sets
checked line by line; Spearman's ρ and its bootstrap against ``scipy.stats.spearmanr`` on the resampled
windows; the verdict rule on gains and scores built so that each verdict must come out; the tiny run's
gains recomputed from the original model's held-out loss by a plain token cross-entropy; resume and
``--recorded-only`` reproduce the tables.
"""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import stats
from typer.testing import CliRunner

from depthsat_theory.cli import app
from depthsat_theory.experiments import ExperimentError, placement_report
from depthsat_theory.experiments import placement as pl

runner = CliRunner()


def _rows(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _numbers(path):
    """A table's rows without its timing columns (CPU and wall seconds differ between runs)."""
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in _rows(path)]


# ----------------------------------------------------------------------------- block influence
def _tiny_llama(layers=3):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.config.use_cache = False
    return model


def test_block_influence_matches_numpy_on_hidden_states():
    model = _tiny_llama()
    model.model.norm = torch.nn.Identity()  # hidden_states[L] is then the last layer's raw output
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 40, (3, 7), generator=g)
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2, [1] * 3 + [0] * 4])
    labels = torch.full_like(ids, -100)
    batches = [({"input_ids": ids[:2], "attention_mask": mask[:2]}, labels[:2])]
    batches.append(({"input_ids": ids[2:], "attention_mask": mask[2:]}, labels[2:]))
    got = pl.block_influence(model, batches)
    assert got.shape == (3, 3, 2)
    with torch.no_grad():
        hs = [
            model(input_ids=b[0]["input_ids"], attention_mask=b[0]["attention_mask"], output_hidden_states=True)
            for b in batches
        ]
    m = mask.numpy().astype(float)
    for p in range(3):
        h_in = np.concatenate([h.hidden_states[p].double().numpy() for h in hs])
        h_out = np.concatenate([h.hidden_states[p + 1].double().numpy() for h in hs])
        cos = (h_in * h_out).sum(-1) / (np.linalg.norm(h_in, axis=-1) * np.linalg.norm(h_out, axis=-1))
        want = ((1 - cos) * m).sum() / m.sum()
        assert got[p, :, 0].sum() / got[p, :, 1].sum() == pytest.approx(want, rel=1e-9)
        np.testing.assert_allclose(got[p, :, 1], m.sum(1))  # real tokens per window


# ----------------------------------------------------------------------------- windows
def test_window_sets_are_disjoint_spread_and_new_per_seed():
    n, v = 30_000, 3
    sizes = {"train": 32, "probe": 256, "heldout": 96}
    sets = {s: pl.window_sets(n, v, sizes, s) for s in (0, 1, 2)}
    for got in sets.values():
        assert {k: len(x) for k, x in got.items()} == sizes
        lines = [set(range(s, s + v)) for x in got.values() for s in x]
        assert sum(len(x) for x in lines) == len(set().union(*lines))  # no line in two windows
        assert all(s % v == 0 and s + v <= n for x in got.values() for s in x)
        for x in got.values():  # across the whole text, not one contiguous range
            assert min(x) < 0.1 * n and max(x) > 0.9 * n
    assert len(set(sets[0]["probe"]) & set(sets[1]["probe"])) < 20  # ~256*256/10000 expected by chance
    assert pl.window_sets(n, v, sizes, 0) == sets[0]
    with pytest.raises(ExperimentError, match="fewer than"):
        pl.window_sets(100, 3, {"a": 30, "b": 10}, 0)


# ----------------------------------------------------------------------------- statistics
@pytest.mark.parametrize("ties", [False, True])
def test_spearman_matches_scipy(ties):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 4, 30) if ties else rng.normal(size=30)
    y = x + rng.normal(size=30)
    assert pl.spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)
    assert math.isnan(pl.spearman(np.ones(5), np.arange(5)))


@pytest.mark.parametrize("with_probe", [False, True])
def test_bootstrap_spearman_matches_scipy_on_each_resample(with_probe):
    rng = np.random.default_rng(2)
    gains = rng.normal(size=(6, 9)) + np.arange(6)[:, None] * 0.3
    bi = np.stack([rng.random((6, 5)), np.full((6, 5), 4.0)], axis=-1)
    score = rng.normal(size=6)
    reps = pl.bootstrap_spearman(bi if with_probe else None, score, gains, 25, np.random.default_rng(7))
    again = np.random.default_rng(7)  # the same draws, in the documented order: held-out, then probe
    idx = again.integers(0, 9, size=(25, 9))
    jdx = again.integers(0, 5, size=(25, 5)) if with_probe else None
    for r in range(25):
        g = gains[:, idx[r]].mean(1)
        s = bi[:, jdx[r], 0].sum(1) / bi[:, jdx[r], 1].sum(1) if with_probe else score
        assert reps[r] == pytest.approx(stats.spearmanr(s, g).statistic, abs=1e-12)


def test_verdict_rule():
    assert pl.placement_verdict(-0.1, 0.9) == "untestable here"
    assert pl.placement_verdict(math.nan, 0.9) == "untestable here"
    assert pl.placement_verdict(0.2, 0.05) == "holds"
    assert pl.placement_verdict(0.2, -0.05) == "fails"
    assert pl.placement_verdict(0.2, 0.0) == "fails"
    assert pl.placement_verdict(0.2, 0.5, seeds=1) == "untestable here"  # one probe: no probe noise in the interval


def _constructed(strength, criterion, seeds=3, positions=12, windows=40, seed=0):
    """Per-window gains = strength_p + noise; scores given; block influence flat noise."""
    rng = np.random.default_rng(seed)
    probes, gains = [], []
    for _ in range(seeds):
        g = strength[:, None] + rng.normal(scale=0.05, size=(positions, windows))
        gains.append(g)
        crit = [{"criterion": c} for c in criterion]
        bi = np.stack([rng.random((positions, 8)), np.ones((positions, 8))], axis=-1)
        probes.append({"positions": list(range(positions)), "criterion": crit, "bi_windows": bi})
    return probes, gains


@pytest.mark.parametrize(
    ("case", "want"),
    [("aligned", "holds"), ("reversed", "fails"), ("noise", "untestable here")],
)
def test_readings_give_each_verdict_on_constructed_inputs(case, want):
    p = 12
    strength = np.zeros(p) if case == "noise" else np.linspace(0, 1, p)
    criterion = np.linspace(0, 1, p) if case != "reversed" else np.linspace(1, 0, p)
    probes, gains = _constructed(strength, criterion)
    got = pl.readings(probes, gains, 300)
    assert got["verdict"] == want
    if case == "aligned":
        assert got["rho"]["criterion"]["pooled"] > 0.9
        assert got["rho"]["depth"]["pooled"] > 0.9  # depth equals the strength's order here
    if case == "reversed":
        assert got["rho"]["criterion"]["high"] < 0


def test_arm_positions_rules():
    crit = [0.1, 0.5, 0.5, 0.2, 0.9, 0.0]
    assert pl.arm_positions("criterion", 6, 2, seed=0, criterion=crit) == [1, 4]  # tie 1/2: the shallower
    assert pl.arm_positions("block_influence", 6, 3, seed=0, bi=crit) == [1, 2, 4]
    assert pl.arm_positions("even", 30, 2, seed=0) == [14, 29]
    assert pl.arm_positions("even", 30, 4, seed=0) == [7, 14, 22, 29]
    r = [pl.arm_positions("random", 30, 4, seed=s) for s in (0, 1, 2)]
    assert len({tuple(x) for x in r}) == 3 and all(len(set(x)) == 4 for x in r)
    with pytest.raises(ExperimentError, match="unknown arm"):
        pl.arm_positions("deepest", 6, 2, seed=0)
    with pytest.raises(ExperimentError, match="one score per layer"):
        pl.arm_positions("criterion", 6, 2, seed=0, criterion=[1.0])


# ----------------------------------------------------------------------------- the tiny configuration
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement")
    out, log = root / "placement", root / "units.jsonl"
    res = runner.invoke(app, ["experiment", "placement", "--config", "tiny", "--out", str(out), "--resume", str(log)])
    assert res.exit_code == 0, res.output
    return out, log


def _heldout_loss_by_hand(seed):
    """The original tiny model's mean held-out loss, windows rebuilt and the loss written out here."""
    from depthsat_theory.experiments.expand import _CharTokenizer, _tiny_llama
    from depthsat_theory.tasks.data import load_kjv_text
    from depthsat_theory.tasks.zoo import kjv_verses

    cfg = pl.CONFIGS["tiny"]
    lines = kjv_verses()
    tok = _CharTokenizer(load_kjv_text())
    model = _tiny_llama(tok.pad_token_id + 1)
    sizes = {"train": cfg.steps * cfg.batch_size, "probe": cfg.probe_windows, "heldout": cfg.heldout_windows}
    starts = pl.window_sets(len(lines), cfg.verses_per_window, sizes, seed)["heldout"]
    losses = []
    with torch.no_grad():
        for s in starts:
            ids = tok("\n".join(lines[s : s + cfg.verses_per_window]))["input_ids"][: cfg.heldout_tokens]
            x = torch.tensor([ids])
            logits = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0, :-1]
            losses.append(float(F.cross_entropy(logits, x[0, 1:])))
    return sum(losses) / len(losses)


def test_tiny_run_tables_claims_and_gains(tiny_run):
    out, _ = tiny_run
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(
        ["positions.csv", "readings.csv", "arms.csv", "paired.csv", "summary.json", "placement.png", "placement.svg"]
    )
    doc = json.loads((out / "summary.json").read_text())
    (claim,) = doc["claims"]
    assert set(claim) == {"claim", "setting", "verdict", "qualifier", "interval", "reason"}
    assert claim["claim"] == "LLM placement" and claim["verdict"] in ("holds", "fails", "untestable here")
    assert claim["verdict"] == doc["summary"]["verdict"]
    rows = _rows(out / "positions.csv")
    assert sorted((int(r["seed"]), int(r["position"])) for r in rows) == [(s, p) for s in (0, 1, 2) for p in range(4)]
    for seed in (0, 1):
        before = _heldout_loss_by_hand(seed)
        for r in (r for r in rows if int(r["seed"]) == seed):
            assert float(r["gain"]) == pytest.approx(before - float(r["loss_after"]), abs=2e-6)
    arms = _rows(out / "arms.csv")
    assert sorted({(r["arm"], int(r["k"])) for r in arms}) == sorted((a, 2) for a in pl.ARMS)
    assert len({r["new_parameters"] for r in arms}) == 1  # matched trainable parameters


@pytest.mark.slow
def test_tiny_resume_and_recorded_only_reproduce_the_tables(tiny_run, tmp_path):
    out, log = tiny_run
    lines = log.read_text().splitlines()
    assert len(lines) == 3 * (1 + 4) + 3 * 4  # probes, positions, arms
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines[:7]) + "\n" + lines[7][:30])  # a line cut by a crash
    again = tmp_path / "again"
    res = runner.invoke(app, ["experiment", "placement", "--config", "tiny", "--out", str(again), "--resume", str(cut)])
    assert res.exit_code == 0, res.output
    assert _numbers(again / "positions.csv") == _numbers(out / "positions.csv")
    assert _numbers(again / "arms.csv") == _numbers(out / "arms.csv")
    agg = tmp_path / "agg"
    res = runner.invoke(
        app,
        ["experiment", "placement", "--config", "tiny", "--out", str(agg), "--resume", str(log), "--recorded-only"],
    )
    assert res.exit_code == 0, res.output
    assert _rows(agg / "readings.csv") == _rows(out / "readings.csv")


def test_recorded_only_needs_resume_and_lists_what_is_missing(tiny_run, tmp_path):
    _, log = tiny_run
    res = runner.invoke(app, ["experiment", "placement", "--config", "tiny", "--recorded-only", "--out", str(tmp_path)])
    assert res.exit_code != 0 and "--resume" in res.output
    part = tmp_path / "part.jsonl"
    part.write_text("\n".join(log.read_text().splitlines()[:5]) + "\n")  # seed 0's probe and 4 positions
    res = runner.invoke(
        app,
        [
            "experiment",
            "placement",
            "--config",
            "tiny",
            "--recorded-only",
            "--resume",
            str(part),
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert any("seed 1" in m for m in doc["summary"]["left_out"])
    assert doc["meta"]["seeds"] == [0]


def test_paired_window_interval_pairs_the_windows():
    a = [0.5, 0.25, 0.75, 1.0]
    got = pl.paired_window_interval([(a, [x - 0.125 for x in a]), (a, [x - 0.375 for x in a])], 50)
    assert got == {"mean": 0.25, "low": 0.25, "high": 0.25, "seeds": 2}  # paired: window noise cancels exactly
    rng = np.random.default_rng(4)
    d1, d2 = rng.normal(size=7), rng.normal(size=5)
    got = pl.paired_window_interval([(d1, np.zeros(7)), (d2, np.zeros(5))], 40, seed=9)
    again = np.random.default_rng(9)
    reps = []
    i1 = again.integers(0, 7, size=(40, 7))
    i2 = again.integers(0, 5, size=(40, 5))
    reps = (d1[i1].mean(1) + d2[i2].mean(1)) / 2
    assert got["mean"] == pytest.approx((d1.mean() + d2.mean()) / 2)
    assert (got["low"], got["high"]) == pytest.approx(tuple(np.quantile(reps, [0.025, 0.975])))


def test_windows_to_decide_is_the_noise_tests_size():
    # chi2_{1,0.95} = 3.841458820694124; v = n chance^2 = 100/16; s_U^2 = 1/4: 3.8414588 * 6.25 * 4 = 96.04
    assert pl._windows_to_decide({"criterion": 0.5, "chance": 0.25, "probe_windows": 100}) == 97
    assert math.isnan(pl._windows_to_decide({"criterion": 0.0, "chance": 0.25, "probe_windows": 100}))


def test_partial_given_depth_is_the_rank_residual_correlation():
    rng = np.random.default_rng(5)
    p = 10
    strength = np.linspace(1, 0, p) + rng.normal(scale=0.3, size=p)
    criterion = strength + rng.normal(scale=0.3, size=p)
    probes, gains = _constructed(strength, criterion, seeds=2, positions=p)
    got = pl.readings(probes, gains, 50)["partial_given_depth"]["per_seed"]
    for i, g in enumerate(gains):  # residuals of the ranks on the depth ranks, then their correlation
        rc, rg, rd = (stats.rankdata(v) for v in (criterion, g.mean(1), np.arange(p)))
        res = [v - np.polyval(np.polyfit(rd, v, 1), rd) for v in (rc, rg)]
        assert got[i] == pytest.approx(np.corrcoef(*res)[0, 1], abs=1e-9)


@pytest.mark.parametrize(
    ("per_seed", "low", "high", "want"),
    [
        # over seeds: mean 1.25, sd 0.25, t_{0.975,2} = 4.302653 -> [0.629, 1.871], above 0 like the bootstrap
        ([1.0, 1.25, 1.5], 0.5, 2.0, "beats depth"),
        ([-1.0, -1.25, -1.5], -2.0, -0.5, "loses to depth"),
        # over seeds: mean 2, sd 1 -> [2 - 2.484, 2 + 2.484] reaches 0 although the bootstrap is above 0
        ([1.0, 2.0, 3.0], 0.5, 3.5, "not resolved against depth over seeds (+2.00 [-0.48, +4.48])"),
        ([1.0, 1.25, 1.5], -0.5, 2.0, "not resolved against depth"),
    ],
)
def test_beats_needs_the_bootstrap_and_the_over_seeds_interval_to_agree(per_seed, low, high, want):
    diff = {"pooled": sum(per_seed) / 3, "low": low, "high": high, "per_seed": per_seed}
    assert placement_report.beats_text(diff, "depth") == want
