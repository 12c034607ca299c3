"""The budget sweep (real data, fixed cosine budget): its pieces against independent computations.

* the cross-fitted steepest step (``sweep.crossfit_rows``) against a direct computation: the block
  ``z ↦ W z + c`` added to the stream by a forward hook, its gradient by autograd, the feature Gram
  by hand, the step's loss change on the held-out half evaluated without the library;
* the headline columns against the closed form ``s_U = sqrt(max(0, (n ŝ² − v̂)/(n − 1)))``;
* the readings (precondition, C1, C2) on hand-made runs with dyadic values (``fractions``);
* the tiny configuration end to end through the CLI (tables, growth preserving the function, resume).
"""

from __future__ import annotations

import csv
import json
import math
from fractions import Fraction

import pytest
import torch
from typer.testing import CliRunner

from depthsat_theory.cli import app
from depthsat_theory.experiments import budget_sweep as B
from depthsat_theory.experiments.sweep import crossfit_rows
from depthsat_theory.tasks.models import ResidualMLP, classification_loss

runner = CliRunner()


def _rows(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


# ----------------------------------------------------------------------------- C3 cross-fitted, direct
def _stream_loss(model, site, x, y, w, c):
    """Mean loss with ``z ↦ z + z Wᵀ + c`` at ``site``'s output (an independent inserted linear block)."""
    module = dict(model.named_modules())[site]
    handle = module.register_forward_hook(lambda _m, _a, out: out + out @ w.T + c)
    try:
        return classification_loss(model(x), y).mean()
    finally:
        handle.remove()


def _site_output(model, site, x):
    seen = []
    module = dict(model.named_modules())[site]
    handle = module.register_forward_hook(lambda _m, _a, out: seen.append(out.detach()))
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize("site", ["embed", "blocks.1"])
def test_crossfit_step_equals_a_direct_computation_on_both_halves_and_the_test(site):
    torch.manual_seed(3)
    model = ResidualMLP(5, 4, 2, 3).double().eval()
    xa, xb, xt = (torch.randn(n, 5, dtype=torch.float64) for n in (64, 48, 40))
    ya, yb, yt = (torch.randint(0, 3, (x.shape[0],)) for x in (xa, xb, xt))
    parts = {"a": [(xa[:32], ya[:32]), (xa[32:], ya[32:])], "b": [(xb, yb)], "test": [(xt, yt)]}
    t = 0.05
    rows = crossfit_rows(
        model,
        parts,
        [{"site": site, "site_index": 0, "z_rms": 1.0}],
        loss_fn=classification_loss,
        step_fraction=t,
    )
    (row,) = rows
    # direct: G = ∂J_A/∂(W, c) at 0; Σ = E[φ̃ φ̃ᵀ] with φ̃ = (z, 1); s = sqrt(tr(G Σ⁻¹ Gᵀ)); θ = −(t/s) G Σ⁻¹
    d = 4
    w = torch.zeros(d, d, dtype=torch.float64, requires_grad=True)
    c = torch.zeros(d, dtype=torch.float64, requires_grad=True)
    gw, gc = torch.autograd.grad(_stream_loss(model, site, xa, ya, w, c), (w, c))
    g = torch.cat([gw, gc[:, None]], dim=1)
    z = _site_output(model, site, xa)
    phi = torch.cat([z, torch.ones(z.shape[0], 1, dtype=torch.float64)], dim=1)
    sigma = phi.T @ phi / z.shape[0]
    direction = torch.linalg.solve(sigma, g.T).T  # G Σ⁻¹ (Σ is symmetric and invertible here)
    s = float(torch.sqrt(torch.trace(g @ torch.linalg.solve(sigma, g.T))))
    theta = -(t / s) * direction
    assert row["s_fit"] == pytest.approx(s, rel=1e-9)
    assert row["predicted"] == pytest.approx(-t * s, rel=1e-9)
    zero_w, zero_c = torch.zeros(d, d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
    for name, (x, y) in {"a": (xa, ya), "b": (xb, yb), "test": (xt, yt)}.items():
        with torch.no_grad():
            change = _stream_loss(model, site, x, y, theta[:, :d], theta[:, d]) - _stream_loss(
                model, site, x, y, zero_w, zero_c
            )
        assert row[f"measured_{name}"] == pytest.approx(float(change), rel=1e-7, abs=1e-13), name


# ----------------------------------------------------------------------------- readings on hand-made runs
def _run(seed, depth, train, test):
    return {"seed": seed, "depth": depth, "train_loss": train, "test_loss": test}


def _curves(runs, metrics=("train_loss", "test_loss")):
    out = []
    for m in metrics:
        for d in sorted({r["depth"] for r in runs}):
            vals = [r[m] for r in runs if r["depth"] == d]
            out.append({"metric": m, "depth": d, "mean": sum(vals) / len(vals)})
    return out


def test_precondition_reads_paired_intervals_on_dyadic_runs():
    # train and test loss fall with depth in every seed by dyadic amounts
    drops = {0: Fraction(1, 8), 1: Fraction(1, 4), 2: Fraction(3, 16)}
    runs = [
        _run(s, d, float(1 - drops[s] * k), float(2 - drops[s] * k / 2)) for s in drops for k, d in enumerate((1, 2, 4))
    ]
    pre = B._precondition(runs, _curves(runs))
    fits = pre["train_loss_falls_first_to_deepest"]
    assert fits["per_seed"] == [float(2 * drops[s]) for s in sorted(drops)]
    assert fits["mean"] == float(sum(2 * v for v in drops.values()) / 3)
    assert pre["deeper_fits_better"] and pre["depth_pays"] and pre["holds"]
    assert pre["best_test_depth_mean"] == 4
    # the same seeds with the test loss rising with depth: depth does not pay, C1 untestable
    flat = [{**r, "test_loss": 2 + r["depth"] / 8} for r in runs]
    pre = B._precondition(flat, _curves(flat))
    assert not pre["depth_pays"] and not pre["holds"]
    c1 = B._c1(_curves(flat) + [{"metric": "probe_ag_max", "depth": d, "mean": 1 / d} for d in (1, 2, 4)], pre)
    assert c1["probe_ag_max"]["verdict"] == "untestable here"


def test_c2_relative_differences_are_paired_by_seed():
    runs = [{"seed": s, "depth": 4, "test_loss": 0.5, "train_loss": 0.25} for s in (0, 1)]
    growth = []
    for s, (g, e) in enumerate([(0.375, 0.5), (0.5, 0.5)]):
        growth.append({"seed": s, "arm": "grown", "test_loss": g, "train_loss": 0.25})
        growth.append({"seed": s, "arm": "scratch_examples", "test_loss": e, "train_loss": 0.125})
    got = B._c2(growth, runs, 4)
    rel = got["test_loss: (grown - scratch_examples) / scratch_examples"]
    assert rel["per_seed"] == [-0.25, 0.0] and rel["mean"] == -0.125
    assert got["train_loss: (grown - scratch_examples) / scratch_examples"]["per_seed"] == [1.0, 1.0]
    assert got["test_loss: (grown - scratch_budget) / scratch_budget"]["per_seed"] == [-0.25, 0.0]
    # two seeds at −25 % and 0 %: t(1) makes the interval contain 0 (and the paper's −11.8 %)
    assert got["verdict"].startswith("undetermined") and "is inside" in got["verdict"]
    lower = B._c2_verdict({"n": 3, "ci_low": -0.0625, "ci_high": -0.015625})
    assert lower.startswith("holds") and "is outside" in lower
    assert B._c2_verdict({"n": 3, "ci_low": 0.125, "ci_high": 0.25}).startswith("fails")


def test_c1_fails_a_curve_still_falling_past_the_test_plateau():
    pre = {"holds": True, "test_loss_plateau_depth": 4}
    halving = [{"metric": "probe_ag_max_last", "depth": d, "mean": 8 / d} for d in (1, 2, 4, 8)]
    flat = [
        {"metric": "probe_ag_rms_last", "depth": d, "mean": v}
        for d, v in zip((1, 2, 4, 8), (1, 0.5, 0.25, 0.25), strict=True)
    ]
    got = B._c1(halving + flat, pre)
    assert got["probe_ag_max_last"]["verdict"] == "fails" and "still falling" in got["probe_ag_max_last"]["reason"]
    assert got["probe_ag_rms_last"]["verdict"] == "holds" and got["probe_ag_rms_last"]["plateau_depth"] == 4
    assert got["probe_ag_max_last"]["plateau_depth"] is None  # still falling at 8: not reached
    both = B._c1(halving, {"holds": True, "test_loss_plateau_depth": None})  # the test loss still falls too
    assert both["probe_ag_max_last"]["verdict"] == "untestable here"
    assert "both still improve" in both["probe_ag_max_last"]["reason"]
    perf_only = B._c1(flat, {"holds": True, "test_loss_plateau_depth": None})
    assert perf_only["probe_ag_rms_last"]["verdict"] == "untestable here"


# ----------------------------------------------------------------------------- the tiny run, through the CLI
def _cli_at_one_thread(*runs):
    """Run ``(args, out)`` invocations of the CLI at one thread (the bitwise comparisons need it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for args, out in runs:
            res = runner.invoke(app, [*args, "--out", str(out)])
            assert res.exit_code == 0, res.output
    finally:
        torch.set_num_threads(threads)


def _run_twice(root, *extra):
    """The tiny run, then again from its resume file (which must gain no line: nothing retrained)."""
    args = ["experiment", "budget-sweep", *extra, "--config", "tiny", "--resume", str(root / "done.jsonl")]
    _cli_at_one_thread((args, root / "a"))
    lines = (root / "done.jsonl").read_text().splitlines()
    _cli_at_one_thread((args, root / "b"))
    assert (root / "done.jsonl").read_text().splitlines() == lines
    return lines


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget")
    lines = _run_twice(root)
    # the staged growth alone rerun in a new process: its shallow model is retrained (not in memory)
    (root / "no_chain.jsonl").write_text("\n".join(x for x in lines if "/chain-" not in x) + "\n")
    args = ["experiment", "budget-sweep", "--config", "tiny", "--resume", str(root / "no_chain.jsonl")]
    _cli_at_one_thread((args, root / "c"))
    return root


def test_tiny_budget_sweep_writes_tables_and_readings(tiny):
    out = tiny / "a"
    cfg = B.CONFIGS["tiny"]
    for name in ("runs", "sites", "crossfit", "curves", "growth"):
        assert (out / f"{name}.csv").is_file(), name
    assert _rows(out / "runs.csv") == _rows(tiny / "b" / "runs.csv")
    runs = _rows(out / "runs.csv")
    assert len(runs) == len(cfg.seeds) * len(cfg.depths)
    for r in runs:
        assert int(r["steps"]) == cfg.budget.steps
        assert float(r["probe_ag_max_last_batchmean"]) == pytest.approx(
            float(r["probe_ag_max_last"]) / cfg.budget.batch_size, rel=1e-12
        )
    n = cfg.sizes.probe
    for r in _rows(out / "sites.csv"):
        s, v = float(r["s"]), float(r["noise_variance"])
        s2u = (n * s * s - v) / (n - 1)
        assert float(r["s_u"]) == pytest.approx(math.sqrt(max(s2u, 0.0)), rel=1e-9, abs=1e-15)
        assert float(r["rel_chance"]) == pytest.approx(math.sqrt(v / n) / float(r["ag_rms"]), rel=1e-9)
    grow = _rows(out / "growth.csv")
    assert {r["arm"] for r in grow} == {"grown", "scratch_examples"}
    for r in grow:
        assert int(r["steps"]) == 2 * cfg.budget.steps
        if r["arm"] == "grown":
            assert float(r["deviation_at_insertion"]) == 0.0  # zero-output blocks: the function is preserved
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["config"]["name"] == "tiny" and summary["meta"]["commit"]
    got = summary["summary"]["claims"]
    assert set(got) == {"precondition", "c1", "c3", "c2", "c2_chain"}
    assert all(v["verdict"] in ("holds", "fails", "untestable here") for v in got["c1"].values() if isinstance(v, dict))


def test_tiny_staged_growth_preserves_the_function_and_keeps_the_budget(tiny):
    cfg = B.CONFIGS["tiny"]
    steps = cfg.budget.steps
    rows = _rows(tiny / "a" / "growth_chain.csv")
    assert [r["arm"] for r in rows] == ["grown_2", "grown_4", "scratch_examples", "scratch_flops"] * len(cfg.seeds)
    f = [_mlp_flops(64, cfg.width, d, 10) for d in cfg.chain]
    want_steps = {"grown_2": 2 * steps, "grown_4": 3 * steps, "scratch_examples": 3 * steps}
    want_steps["scratch_flops"] = round(Fraction(steps * sum(f), f[-1]))
    one_shot = {r["seed"]: r for r in _rows(tiny / "a" / "growth.csv") if r["arm"] == "grown"}
    for r in rows:
        assert int(r["steps"]) == want_steps[r["arm"]], r["arm"]
        assert int(r["depth"]) == {"grown_2": 2}.get(r["arm"], 4)
        if r["arm"].startswith("grown"):
            assert float(r["deviation_at_insertion"]) == 0.0  # exactly: zero-output blocks at each stage
            assert float(r["flops"]) == sum(f[: int(r["steps"]) // steps]) * steps * cfg.budget.batch_size
        if r["arm"] == "grown_2":  # stage 0 is the one-shot grown model, and its shallow model the sweep's
            assert r["shallow_reproduces_record"] == "True" and r["reproduces_one_shot"] == "True"
            assert r["test_loss"] == one_shot[r["seed"]]["test_loss"]
    # rerun in a new process, the shallow model retrained: the same numbers, bit for bit
    again = _rows(tiny / "c" / "growth_chain.csv")
    assert [{k: v for k, v in r.items() if k != "wall_s"} for r in again] == [
        {k: v for k, v in r.items() if k != "wall_s"} for r in rows
    ]
    summary = json.loads((tiny / "a" / "summary.json").read_text())
    assert summary["summary"]["flops_chain"]["scratch_steps_at_grown_flops"] == want_steps["scratch_flops"]
    claims = summary["claims"]
    assert [r["claim"] for r in claims] == ["C1", "C2", "C2", "C3a", "C3b"]
    assert "staged growth 1 -> 2 -> 4" in claims[2]["setting"]


@pytest.fixture(scope="module")
def tiny_kjv(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget_kjv")
    _run_twice(root, "--data", "kjv")
    return root


def test_tiny_kjv_budget_sweep_reads_the_same_claims_on_chargpt(tiny_kjv):
    cfg = B.KJV_CONFIGS["tiny"]
    out = tiny_kjv / "a"
    assert not (out / "growth.csv").exists() and not (out / "growth_chain.csv").exists()
    runs = _rows(out / "runs.csv")
    assert len(runs) == len(cfg.seeds) * len(cfg.depths) and runs == _rows(tiny_kjv / "b" / "runs.csv")
    assert all(int(r["steps"]) == cfg.budget.steps for r in runs)
    sites = _rows(out / "sites.csv")
    assert {r["site"] for r in sites} >= {"blocks.0", "blocks.1"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["summary"]["splits"]["sizes"] == {"train": 512, "val": 64, "probe": 128, "test": 128}
    assert "blocks of 512 characters" in summary["summary"]["splits"]["source"]
    assert summary["meta"]["config"]["arch"] == "gpt"
    claims = summary["claims"]
    assert [r["claim"] for r in claims] == ["C1", "C3a", "C3b"]
    assert all(r["verdict"] in ("holds", "fails", "untestable here") for r in claims)
    assert all(r["setting"].startswith("kjv") and "CharGPT" in r["setting"] for r in claims)


def test_budget_sweep_bad_config_is_one_line_error(tmp_path):
    res = runner.invoke(app, ["experiment", "budget-sweep", "--config", "huge", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "choose one of" in res.output
    res = runner.invoke(app, ["experiment", "budget-sweep", "--data", "mnist", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "--data 'mnist': choose one of fashion, kjv" in res.output


# ----------------------------------------------------------------------------- the KJV window sampler
def test_interleaved_text_windows_keep_the_splits_disjoint_and_spread_over_the_whole_text():
    from depthsat_theory.experiments.recipe import interleaved_text_windows

    n_chars, window, block = 100_000, 17, 500  # 200 blocks: 160 / 10 / 10 / 20
    counts = {"train": 4000, "val": 300, "probe": 300, "test": 600}
    starts = interleaved_text_windows(n_chars, window, block, counts, seed=7)
    covered = {}
    for part, s in starts.items():
        s = s.tolist()
        assert len(s) == counts[part]
        assert all(a >= 0 and a + window <= n_chars for a in s)
        assert all(a // block == (a + window - 1) // block for a in s)  # inside one block
        covered[part] = {c for a in s for c in range(a, a + window)}
    parts = list(covered)
    for i, p in enumerate(parts):
        for q in parts[i + 1 :]:
            assert not covered[p] & covered[q], (p, q)  # no character in two splits
    blocks = {p: {a // block for a in starts[p].tolist()} for p in parts}
    assert len(blocks["train"]) <= 160 and len(blocks["test"]) <= 20
    # spread: every split reaches both ends of the text (not one contiguous range) ...
    for p in parts:
        assert min(starts[p]) < n_chars // 4 and max(starts[p]) > 3 * n_chars // 4, p
    # ... and the training windows fall in every tenth of the text
    tenths = {int(a) * 10 // n_chars for a in starts["train"].tolist()}
    assert tenths == set(range(10))
    # seeded: the same seed gives the same windows, another seed others
    again = interleaved_text_windows(n_chars, window, block, counts, seed=7)
    assert all(torch.equal(again[p], starts[p]) for p in parts)
    assert not torch.equal(interleaved_text_windows(n_chars, window, block, counts, seed=8)["train"], starts["train"])


def test_interleaved_text_windows_refuse_a_block_shorter_than_a_window():
    from depthsat_theory.experiments.recipe import interleaved_text_windows

    with pytest.raises(ValueError, match="at least the window"):
        interleaved_text_windows(10_000, 33, 32, {"train": 1, "val": 1, "probe": 1, "test": 1}, seed=0)
    with pytest.raises(ValueError, match="lower it"):
        interleaved_text_windows(10_000, 33, 4096, {"train": 1, "val": 1, "probe": 1, "test": 1}, seed=0)


def test_kjv_windows_equal_the_text_slices_at_their_starts():
    from depthsat_theory.experiments import recipe as R
    from depthsat_theory.tasks.data import load_kjv_text

    text = load_kjv_text()
    sizes = R.Sizes(train=200, val=20, probe=30, test=40, seq_len=24)
    splits = R.load_splits("kjv", 3, sizes, text_block=2048)
    starts = R.interleaved_text_windows(len(text), sizes.seq_len + 1, 2048, {**splits.sizes()}, seed=3)
    chars = sorted(set(text))  # the vocabulary: sorted distinct characters
    for part in ("train", "val", "probe", "test"):
        split = getattr(splits, part)
        for i in (0, len(split) // 2, len(split) - 1):
            a = int(starts[part][i])
            assert "".join(chars[t] for t in split.x[i].tolist()) == text[a : a + sizes.seq_len], part
            assert "".join(chars[t] for t in split.y[i].tolist()) == text[a + 1 : a + sizes.seq_len + 1], part
    assert "blocks of 2048 characters" in splits.source
    with pytest.raises(ValueError, match="kjv only"):
        R.load_splits("digits", 0, R.Sizes(), text_block=2048)


# ----------------------------------------------------------------------------- C2 staged: seeds, FLOPs, resume key
def _mlp_flops(in_dim, width, depth, classes):
    """Training FLOPs per example of a ResidualMLP by hand: embed (forward + weight grad), per block
    W1 (width x 2 width) and W2 (2 width x width) three times (forward, weight and input grad), head three times."""
    macs = 2 * in_dim * width + 3 * depth * (2 * width * width + 2 * width * width) + 3 * width * classes
    return 2 * macs


def test_chain_scratch_steps_match_the_grown_arms_flops_counted_by_hand():
    f = [_mlp_flops(196, 32, d, 10) for d in (2, 4, 8)]
    assert f[:2] == [76160, 125312]  # the committed summary's flops_per_example (an independent record)
    steps = B.chain_scratch_steps(f, 2000)
    exact = Fraction(2000 * sum(f), f[-1])
    assert steps == round(exact) == 3802
    assert B.chain_seeds(5, 0) == (5, 7)  # stage 0 is the one-shot growth's seeds (deepen seed, seed + 2)
    assert len({B.chain_seeds(5, k) for k in range(3)}) == 3


def test_the_full_configuration_keeps_the_resume_key_of_the_committed_models():
    from pathlib import Path

    first = Path(__file__).parents[1] / "experiments" / "logs" / "budget-sweep-full.jsonl"
    key = json.loads(first.read_text().splitlines()[0])["key"]
    assert B._Resume(None, B.CONFIGS["full"]).tag == key.split("/")[0]
    assert B._Resume(None, B.KJV_CONFIGS["full"]).tag != key.split("/")[0]


# ----------------------------------------------------------------------------- paired intervals and claims rows
def test_c2_interval_is_the_student_t_interval_by_hand():
    import statistics

    from scipy import stats

    runs = [{"seed": s, "depth": 8, "test_loss": 0.5, "train_loss": 0.25} for s in (0, 1, 2)]
    grown = (0.4375, 0.46875, 0.453125)  # -12.5 %, -6.25 %, -9.375 % against 0.5
    growth = []
    for s, g in enumerate(grown):
        growth.append({"seed": s, "arm": "grown_8", "test_loss": g, "train_loss": 0.25})
        for arm in ("scratch_examples", "scratch_flops"):
            growth.append({"seed": s, "arm": arm, "test_loss": 0.5, "train_loss": 0.125})
    got = B._c2(growth, runs, 8, grown="grown_8", refs=("scratch_budget", "scratch_examples", "scratch_flops"))
    rel = [float(Fraction(g).limit_denominator(1 << 10) / Fraction(1, 2) - 1) for g in grown]
    mean, sd = statistics.mean(rel), statistics.stdev(rel)
    half = float(stats.t.ppf(0.975, 2)) * sd / math.sqrt(3)
    for ref in ("scratch_budget", "scratch_examples", "scratch_flops"):
        iv = got[f"test_loss: (grown_8 - {ref}) / {ref}"]
        assert iv["per_seed"] == rel
        assert iv["mean"] == pytest.approx(mean, rel=1e-12)
        assert iv["ci_low"] == pytest.approx(mean - half, rel=1e-12)
        assert iv["ci_high"] == pytest.approx(mean + half, rel=1e-12)
        assert iv["half_width"] == pytest.approx(half, rel=1e-12)
        assert iv["resolves_10_percent"] is (half < 0.10)
    assert got["train_loss: (grown_8 - scratch_flops) / scratch_flops"]["per_seed"] == [1.0, 1.0, 1.0]
    assert got["verdict"].startswith("holds")


def _readings(shrink, held, c2_interval):
    iv = {"n": 3, "mean": 0.0, "std": 0.0}
    return {
        "precondition": {
            "train_loss_falls_first_to_deepest": {**iv, "difference": "a", "ci_low": 0.25, "ci_high": 0.5},
            "test_loss_first_minus_best": {**iv, "difference": "b", "ci_low": 0.25, "ci_high": 0.5},
        },
        "c1": {
            "probe_ag_max": {"verdict": "fails", "reason": "does not fall"},
            "train_ag_max": {"verdict": "holds", "reason": "x"},
            "probe_ag_max_first_depth_below_5e-3": None,
        },
        "c3": {
            "held_out_decrease_over_seeds_and_depths": {
                p: {**iv, "ci_low": held[0], "ci_high": held[1]} for p in ("b", "test")
            },
            "median_measured_over_predicted_deepest": {"a": 1.0, "b": 0.5, "test": 0.25},
            "deepest_decrease_shrinks_first_to_deepest": {
                "b": {**iv, "difference": "d", "ci_low": shrink[0], "ci_high": shrink[1]}
            },
        },
        "c2": {
            "test_loss: (grown - scratch_examples) / scratch_examples": {
                **iv,
                "ci_low": c2_interval[0],
                "ci_high": c2_interval[1],
                "half_width": (c2_interval[1] - c2_interval[0]) / 2,
                "resolves_10_percent": True,
            },
            "verdict": B._c2_verdict({"n": 3, "ci_low": c2_interval[0], "ci_high": c2_interval[1]}),
        },
    }


@pytest.mark.parametrize(
    ("shrink", "held", "c2", "want"),
    [
        ((0.125, 0.25), (0.125, 0.25), (-0.25, -0.125), ("holds", "holds", "holds")),
        ((-0.25, -0.125), (-0.25, -0.125), (0.125, 0.25), ("fails", "fails", "fails")),
        ((-0.125, 0.125), (-0.125, 0.125), (-0.125, 0.125), ("untestable here",) * 3),
    ],
)
def test_claim_rows_follow_the_interval_rules(shrink, held, c2, want):
    rows = B.claim_rows(_readings(shrink, held, c2), "setting s")
    assert [r["claim"] for r in rows] == ["C1", "C2", "C3a", "C3b"]
    for r in rows:
        assert set(r) == {"claim", "setting", "verdict", "qualifier", "interval", "reason"}
        assert r["verdict"] in ("holds", "fails", "untestable here")
        assert r["setting"].startswith("setting s")
    by = {r["claim"]: r for r in rows}
    assert by["C1"]["verdict"] == "fails" and by["C1"]["qualifier"] == "1 of 2 activation-gradient curves hold"
    assert (by["C2"]["verdict"], by["C3a"]["verdict"], by["C3b"]["verdict"]) == want


@pytest.mark.parametrize(("flops", "note"), [((-0.0625, 0.0625), True), ((-0.25, -0.125), False)])
def test_c2_row_carries_the_matched_flops_interval_beside_equal_examples(flops, note):
    readings = _readings((0.125, 0.25), (0.125, 0.25), (-0.25, -0.125))
    readings["c2"]["test_loss: (grown - scratch_flops) / scratch_flops"] = {
        "n": 3,
        "mean": (flops[0] + flops[1]) / 2,
        "ci_low": flops[0],
        "ci_high": flops[1],
    }
    row = {r["claim"]: r for r in B.claim_rows(readings, "s")}["C2"]
    lo, hi = 100 * flops[0], 100 * flops[1]
    assert "at matched FLOPs" in row["interval"] and f"[{lo:+.3g}, {hi:+.3g}]" in row["interval"]
    assert ("at matched FLOPs no difference" in row["qualifier"]) is note
    assert row["verdict"] == "holds"  # the verdict reads equal examples; the qualifier says what matched FLOPs adds


def test_c3a_below_half_the_prediction_is_qualified_and_a_first_depth_plateau_said_in_words():
    readings = _readings((0.125, 0.25), (0.125, 0.25), (-0.25, -0.125))
    readings["c3"]["median_measured_over_predicted_deepest"]["b"] = 0.25
    readings["precondition"]["test_loss_first_minus_best"]["difference"] = "test_loss(1) - test_loss(1)"
    rows = {r["claim"]: r for r in B.claim_rows(readings, "s")}
    assert rows["C3a"]["verdict"] == "holds"
    assert rows["C3a"]["qualifier"].startswith("in direction, not in size (median measured/predicted 0.25 on half B")
    assert "test loss lowest at the first depth (test_loss(1))" in rows["C1"]["interval"]
    assert "test_loss(1) - test_loss(1)" not in rows["C1"]["interval"].replace("(test_loss(1))", "")
