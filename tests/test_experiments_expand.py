"""``depthsat experiment expand``: where to expand an LLM, tiny configuration.

Independent truths: the original model's held-out loss recomputed here with a plain token
cross-entropy (per window, then averaged) equals every arm's loss before training (function
preservation); old weights compared parameter by parameter with a by-hand layer map after training;
LLaMA-Pro's even rule written out (a copy after layer ``i`` when ``(i + 1) % (L / k) == 0``) and
literal positions; the paired differences and Student-t intervals recomputed from ``runs.csv`` with
numpy/scipy; the first training loss equal across arms (the same first batch, before any update).
"""

from __future__ import annotations

import csv
import json
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from depthsat_theory.cli import app
from depthsat_theory.experiments import ExperimentError
from depthsat_theory.experiments import expand as ex

runner = CliRunner()


def _rows(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("expand") / "expand"
    res = runner.invoke(app, ["experiment", "expand", "--config", "tiny", "--out", str(out)])
    assert res.exit_code == 0, res.output
    return out, res.output


def test_tiny_writes_every_table_and_the_verdicts(tiny_run):
    out, output = tiny_run
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(
        ["runs.csv", "ranking.csv", "paired.csv", "train_curves.csv", "summary.json", "expand.png", "expand.svg"]
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["seeds"] == [0, 1, 2]
    assert summary["meta"]["config"]["name"] == "tiny"
    runs = _rows(out / "runs.csv")
    assert sorted((r["arm"], int(r["seed"])) for r in runs) == sorted((a, s) for a in ex.ARMS for s in (0, 1, 2))
    for key in ("verdict_even", "verdict_random"):
        assert summary["summary"][key] in output.replace("\n", " ") or summary["summary"][key][:40] in output


def test_loss_before_training_is_the_original_models_for_every_arm(tiny_run):
    """Every arm's held-out loss before training equals the ungrown model's, recomputed here by hand."""
    out, _ = tiny_run
    cfg = ex.CONFIGS["tiny"]
    from depthsat_theory.tasks.zoo import causal_lm_batches, kjv_verses

    model, tok, _ = ex.load_model(cfg.model)
    heldout_lines = kjv_verses()[int(0.9 * len(kjv_verses())) :]
    batches = causal_lm_batches(
        tok, heldout_lines, cfg.heldout_windows, cfg.eval_batch_size, cfg.probe_seed, 1, cfg.max_tokens
    )
    per_window = []
    with torch.no_grad():
        for inputs, _labels in batches:
            logits = model(**inputs).logits.double()
            for b in range(logits.shape[0]):
                n = int(inputs["attention_mask"][b].sum())
                ids = inputs["input_ids"][b, :n]
                per_window.append(float(F.cross_entropy(logits[b, : n - 1], ids[1:])))
    truth = sum(per_window) / len(per_window)
    runs = _rows(out / "runs.csv")
    before = {r["loss_before"] for r in runs}
    assert len(before) == 1  # bitwise equal (same CSV text) for all arms and seeds
    assert float(before.pop()) == pytest.approx(truth, rel=1e-5)
    summary = json.loads((out / "summary.json").read_text())["summary"]
    assert summary["loss_before_equal_for_every_arm_and_seed"] is True
    assert summary["loss_before"] == pytest.approx(truth, rel=1e-5)
    for r in runs:
        assert float(r["change"]) == pytest.approx(float(r["loss_after"]) - float(r["loss_before"]), abs=1e-12)
        assert r["old_layers_unchanged"] == "True"


def test_the_arms_see_the_same_first_batch_and_seeds_differ(tiny_run):
    """Same seed: the first logged training loss (batch 1, before any update) is equal across arms."""
    out, _ = tiny_run
    runs = _rows(out / "runs.csv")
    first = {}
    for r in runs:
        first.setdefault(int(r["seed"]), set()).add(r["train_loss_first"])
    assert all(len(v) == 1 for v in first.values())
    assert len({v.pop() for v in first.values()}) == 3  # the seeds draw different training windows


def test_paired_differences_and_intervals_recomputed(tiny_run):
    from scipy import stats

    out, _ = tiny_run
    runs = _rows(out / "runs.csv")
    after = {(r["arm"], int(r["seed"])): float(r["loss_after"]) for r in runs}
    summary = json.loads((out / "summary.json").read_text())["summary"]
    for other in ("even", "random"):
        d = np.array([after[("criterion", s)] - after[(other, s)] for s in (0, 1, 2)])
        half = stats.t.ppf(0.975, 2) * d.std(ddof=1) / math.sqrt(3)
        got = summary[f"criterion_minus_{other}"]
        assert got["mean"] == pytest.approx(d.mean(), abs=1e-12)
        assert got["ci_low"] == pytest.approx(d.mean() - half, abs=1e-12)
        assert got["ci_high"] == pytest.approx(d.mean() + half, abs=1e-12)
        assert got["n"] == 3


def test_positions_written_are_the_arms_rules(tiny_run):
    out, _ = tiny_run
    runs = _rows(out / "runs.csv")
    ranking = _rows(out / "ranking.csv")
    top = sorted(int(r["layer"]) for r in ranking[:2])
    keys = [float(r["key"]) for r in ranking]
    assert keys == sorted(keys, reverse=True)
    for r in runs:
        pos = [int(t) for t in r["positions"].split()]
        if r["arm"] == "criterion":
            assert pos == top
        elif r["arm"] == "even":
            assert pos == [1, 3]  # L = 4, k = 2: after layers 2 and 4 (1-based)
        else:
            assert pos == sorted(random.Random(int(r["seed"])).sample(range(4), 2))


@pytest.mark.parametrize(("n", "k"), [(30, 2), (30, 3), (30, 5), (32, 8), (24, 4), (4, 2), (7, 7), (9, 1)])
def test_even_positions_are_llama_pro_rule(n, k):
    """LLaMA-Pro (Wu et al. 2024, sec. 3.2): L layers in k groups of L/k, a copy after each group."""
    split = n // k
    by_hand = [i for i in range(n) if (i + 1) % split == 0]
    assert ex.arm_positions("even", n, k, seed=0) == by_hand


def test_even_positions_literal():
    assert ex.arm_positions("even", 30, 2, seed=5) == [14, 29]
    assert ex.arm_positions("even", 30, 3, seed=5) == [9, 19, 29]


def test_random_positions_reproducible_distinct_and_spread():
    for seed in range(20):
        a = ex.arm_positions("random", 30, 3, seed=seed)
        assert a == ex.arm_positions("random", 30, 3, seed=seed)
        assert len(set(a)) == 3 and a == sorted(a) and all(0 <= i < 30 for i in a)
    draws = [ex.arm_positions("random", 30, 2, seed=s) for s in range(600)]
    assert len({tuple(d) for d in draws}) > 200
    counts = np.bincount(np.array(draws).ravel(), minlength=30)
    assert counts.min() > 0 and counts.max() < 3 * counts.mean()  # every layer is drawn, none dominates


def test_criterion_positions_are_the_top_k_ascending():
    assert ex.arm_positions("criterion", 30, 2, seed=0, ranked=[17, 3, 9]) == [3, 17]
    with pytest.raises(ExperimentError, match="ranked 1 layers"):
        ex.arm_positions("criterion", 30, 2, seed=0, ranked=[4])
    with pytest.raises(ExperimentError, match="--blocks 31"):
        ex.arm_positions("even", 30, 31, seed=0)
    with pytest.raises(ExperimentError, match="unknown arm"):
        ex.arm_positions("middle", 30, 2, seed=0)


def test_split_verses_is_disjoint_and_ordered():
    lines = [f"v{i}" for i in range(100)]
    parts = ex.split_verses(lines)
    assert parts["train"] == lines[:80] and parts["probe"] == lines[80:90] and parts["heldout"] == lines[90:]


def test_frozen_old_layers_do_not_move_and_new_ones_do(monkeypatch):
    """After training one arm, each old parameter equals the original (map built by hand), new zeroed ones moved."""
    import depthsat_theory.grow as grow_pkg
    from depthsat_theory.tasks.zoo import kjv_verses, token_loss_masked

    grown = []
    real = grow_pkg.expand_layers

    def spy(*args, **kwargs):
        exp = real(*args, **kwargs)
        grown.append(exp.model)
        return exp

    monkeypatch.setattr(grow_pkg, "expand_layers", spy)
    cfg = ex.with_overrides("tiny", steps=3, seeds=(0,))
    base, tok, _ = ex.load_model(cfg.model)
    parts = ex.split_verses(kjv_verses())
    train = ex._windows(tok, parts["train"], 6, 2, 0, cfg)
    held = ex._windows(tok, parts["heldout"], 4, 4, 0, cfg)
    original = {n: p.detach().clone() for n, p in base.named_parameters()}
    res = ex._run_arm(base, token_loss_masked, [0, 2], train, held, cfg, 0)
    assert res["old_layers_unchanged"] is True and len(grown) == 1
    # grown layers: 0, copy(0), 1, 2, copy(2), 3
    old_of = {0: 0, 2: 1, 3: 2, 5: 3}
    moved_new = 0
    n_checked = 0
    for name, p in grown[0].named_parameters():
        bits = name.split(".")
        if bits[:2] == ["model", "layers"]:
            g = int(bits[2])
            if g not in old_of:
                if bits[-2] in ("o_proj", "down_proj"):
                    moved_new += int(bool(p.detach().abs().sum() > 0))
                continue
            name = ".".join(["model", "layers", str(old_of[g]), *bits[3:]])
        assert torch.equal(p.detach(), original[name]), name
        n_checked += 1
    assert n_checked == len(original)
    assert moved_new == 4  # o_proj and down_proj of both copies left zero
    assert all(torch.equal(p.detach(), original[n]) for n, p in base.named_parameters())  # base untouched


def test_bad_input_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "x"
    for args, word in (
        (["--config", "huge"], "--config"),
        (["--config", "tiny", "--seeds", "a,b"], "--seeds"),
        (["--config", "tiny", "--seeds", "1,1"], "--seeds"),
        (["--config", "tiny", "--blocks", "9"], "--blocks"),
        (["--config", "tiny", "--steps", "0"], "steps"),
        (["--config", "tiny", "--max-tokens", "1"], "--max-tokens"),
    ):
        res = runner.invoke(app, ["experiment", "expand", *args, "--out", str(out)])
        assert res.exit_code == 2, (args, res.output)
        errors = [line for line in res.output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and word in errors[0], res.output
        assert not out.exists()


def test_equal_positions_give_equal_results(tiny_run):
    """Training is a function of (positions, seed) only: two arms that chose the same layers end bitwise equal."""
    out, _ = tiny_run
    runs = _rows(out / "runs.csv")
    pairs = 0
    for a in runs:
        for b in runs:
            if a["arm"] < b["arm"] and a["seed"] == b["seed"] and a["positions"] == b["positions"]:
                assert a["loss_after"] == b["loss_after"] and a["train_loss_last"] == b["train_loss_last"]
                pairs += 1
    assert pairs >= 1  # tiny, seed 0: the random draw is LLaMA-Pro's [1, 3]


def test_too_many_blocks_are_refused_before_the_diagnosis(tmp_path, monkeypatch):
    from depthsat_theory.experiments import expand as expand_mod

    def never(*args, **kwargs):
        raise AssertionError("the layers were ranked before --blocks was checked")

    monkeypatch.setattr(expand_mod, "_rank", never)
    res = runner.invoke(
        app, ["experiment", "expand", "--config", "tiny", "--blocks", "9", "--out", str(tmp_path / "x")]
    )
    assert res.exit_code == 2 and "error: --blocks 9: the model has 4 layers (give 1..4)" in res.output, res.output
