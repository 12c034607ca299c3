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
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = ["experiment", "budget-sweep", "--config", "tiny", "--resume", str(root / "done.jsonl")]
        res = runner.invoke(app, [*args, "--out", str(root / "a")])
        assert res.exit_code == 0, res.output
        lines = (root / "done.jsonl").read_text().splitlines()
        again = runner.invoke(app, [*args, "--out", str(root / "b")])
        assert again.exit_code == 0, again.output
    finally:
        torch.set_num_threads(threads)
    assert (root / "done.jsonl").read_text().splitlines() == lines  # resume: nothing retrained
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
    assert set(got) == {"precondition", "c1", "c3", "c2"}
    assert all(v["verdict"] in ("holds", "fails", "untestable here") for v in got["c1"].values() if isinstance(v, dict))


def test_budget_sweep_bad_config_is_one_line_error(tmp_path):
    res = runner.invoke(app, ["experiment", "budget-sweep", "--config", "huge", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "choose one of" in res.output
