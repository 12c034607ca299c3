"""The depth sweep and local insertion: the tiny configuration end to end.

``depthsat experiment sweep --config tiny`` runs once (module fixture) through the CLI into a
temporary folder; the tests check the outputs' structure and, against independent truth:

* the plateau rule on hand-made curves whose plateau is read off by eye;
* ``AG_rms``/``AG_max`` of one recorded model against per-example gradients taken directly with
  ``torch.autograd`` on a retrained copy (training is deterministic per seed);
* the chain ``s ≤ AG_rms ≤ AG_max`` at every site, the interval around ``s``;
* the insertion's ``s_direct`` (``tr(G Σ⁺ Gᵀ)^{1/2}`` from the inserted block's gradient and
  feature Gram) against the diagnosis's ``s``, and the steepest step's predicted ``−t·s``;
* a failing run leaves no result folder (atomic writes), bad input exits 2 in one line.
"""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
from typer.testing import CliRunner

from depthsat_theory.cli import app
from depthsat_theory.experiments import recipe as R
from depthsat_theory.experiments import sweep as S

runner = CliRunner()


def _rows(path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny sweep, run once through the CLI."""
    out = tmp_path_factory.mktemp("sweep") / "sweep"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = runner.invoke(app, ["experiment", "sweep", "--config", "tiny", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert res.exit_code == 0, res.output
    return out


# ----------------------------------------------------------------------------- the plateau rule
@pytest.mark.parametrize(
    ("values", "lower", "expected"),
    [
        ([1.0, 0.5, 0.25, 0.2, 0.19], True, 4),  # falls, then within 10 % of the range: plateau at 4
        ([1.0, 0.5, 0.3, 0.31, 0.4], True, 4),  # U shape: the minimum's depth (deeper only worsens)
        ([0.5, 0.9, 0.95, 0.96], False, 4),  # accuracy rising: 0.96 - 0.95 <= 0.046, 0.96 - 0.9 > 0.046
        ([0.3, 0.3, 0.3, 0.3], True, 1),  # flat: the first depth
        ([1.0, 0.2, 0.9, 0.1], True, None),  # a late drop: nothing before 8 is within 0.09 of 0.1, still falling
        ([1.0, 0.5, 0.25, 0.125], True, None),  # halving to the deepest depth: no plateau reached
        ([1.0, 0.5, 0.3, 0.3, 0.3], True, 4),  # flat from depth 4 on
        ([0.5, 0.6, 0.7, 0.9], False, None),  # accuracy still rising at the deepest depth
        ([0.0, 1.0, 2.0, 3.0], True, 1),  # rising loss: depth never helped
    ],
)
def test_plateau_rule_on_hand_made_curves(values, lower, expected):
    depths = [1, 2, 4, 8, 16][: len(values)]
    assert S.plateau_depth(depths, values, lower_is_better=lower) == expected


def test_plateau_rule_on_exact_values_at_the_tolerance():
    # R = 1 exactly; the tolerance's boundary is inclusive: v_i - min_{j>=i} v_j <= tol·R
    assert S.plateau_depth([1, 2, 4, 8], [1.0, 0.125, 0.0, 0.0], tol=0.125) == 2  # 0.125 <= 0.125
    assert S.plateau_depth([1, 2, 4, 8], [1.0, 0.125 + 2**-10, 0.0, 0.0], tol=0.125) == 4  # just above
    assert S.plateau_depth([1, 2, 4, 8], [1.0, 0.1, 0.0, 0.0]) == 2  # the default 10 %: 0.1 <= 0.1·1.0
    # at the deepest-but-one depth the last step still buys more than 10 %: not reached
    assert S.plateau_depth([1, 2, 4], [1.0, 0.5, 0.375]) is None  # 0.5 - 0.375 = 0.125 > 0.1·0.625
    assert S.plateau_depth([1, 2, 4], [1.0, 0.5, 0.4375]) is None  # 0.0625 > 0.1·0.5625 = 0.05625
    assert S.plateau_depth([1, 2, 4], [1.0, 0.5, 0.4375], tol=0.125) == 2  # 0.0625 <= 0.125·0.5625
    assert S.plateau_depth([3], [0.7]) is None  # one depth: nothing to compare


def test_plateau_rule_sorts_by_depth_and_rejects_bad_input():
    assert S.plateau_depth([4, 1, 2], [0.25, 1.0, 0.5], tol=0.5) == 2  # 0.5 - 0.25 <= 0.375
    with pytest.raises(ValueError, match="non-empty"):
        S.plateau_depth([], [])
    with pytest.raises(ValueError, match="non-finite"):
        S.plateau_depth([1, 2], [1.0, math.nan])
    with pytest.raises(ValueError, match="tol"):
        S.plateau_depth([1, 2], [1.0, 0.5], tol=1.0)


# ----------------------------------------------------------------------------- the recipe
def test_recipe_splits_are_disjoint_fixed_per_seed_and_training_is_deterministic():
    a, b, c = (R.load_splits("digits", s, R.Sizes(train=200, val=50, probe=60, test=70)) for s in (3, 3, 4))
    assert a.sizes() == {"train": 200, "val": 50, "probe": 60, "test": 70}
    assert torch.equal(a.train.x, b.train.x) and not torch.equal(a.train.x, c.train.x)
    # disjoint: each digit row is found in exactly one split (digits has a few exact duplicate images:
    # compare the multiset of rows of the four splits with a fresh permutation's first 380 rows)
    rows = torch.cat([a.val.x, a.probe.x, a.test.x, a.train.x])
    from depthsat_theory.tasks.data import load_digits

    full, _ = load_digits(torch.float32)
    perm = torch.randperm(full.shape[0], generator=torch.Generator().manual_seed(3))
    assert torch.equal(rows, full[perm[:380]])
    runs = []
    for _ in range(2):
        m = R.build_model("mlp", 2, a, seed=1, width=8)
        runs.append(R.train(m, a, seed=1, recipe=R.Recipe(max_epochs=2, patience=1)))
    assert runs[0].metrics == runs[1].metrics
    assert runs[0].examples_seen == runs[0].epochs * 200
    with pytest.raises(ValueError, match="does not fit"):
        R.build_model("gpt", 1, a, seed=0)


def test_text_splits_come_from_disjoint_character_ranges():
    s = R.load_splits("kjv", 0, R.Sizes(train=10, val=5, probe=5, test=10, seq_len=48))
    enc, vocab = R._kjv_encoded()
    assert vocab < 256
    text, n = enc.to(torch.uint8).numpy().tobytes(), enc.numel()

    def found(w, lo, hi):  # the window occurs inside the character range [lo n, hi n)
        return text.find(w.to(torch.uint8).numpy().tobytes(), int(lo * n), int(hi * n)) >= 0

    assert all(found(w, 0.0, 0.8) for w in s.train.x)
    assert all(found(w, 0.85, 0.9) for w in s.probe.x)
    assert all(found(w, 0.9, 1.0) for w in s.test.x)
    assert torch.equal(s.train.y[:, :-1], s.train.x[:, 1:])  # next-token targets


# ----------------------------------------------------------------------------- the tiny run
def test_tiny_sweep_writes_every_table_figure_and_provenance(tiny):
    for name in ("runs", "sites", "curves", "plateaus", "insertion", "insertion_curves"):
        assert (tiny / f"{name}.csv").is_file(), name
    for fig in ("c1_depth_sweep", "c3_insertion"):
        assert (tiny / f"{fig}.png").stat().st_size > 1000 and (tiny / f"{fig}.svg").is_file()
    data = json.loads((tiny / "summary.json").read_text())
    meta = data["meta"]
    assert meta["seeds"] == [0, 1] and meta["config"]["name"] == "tiny"
    assert meta["versions"]["torch"] == torch.__version__ and "commit" in meta
    cfg = S.CONFIGS["tiny"]
    runs = _rows(tiny / "runs.csv")
    assert len(runs) == sum(len(c.depths) for c in cfg.curves) * len(cfg.seeds)
    assert set(data["summary"]["claims_c1"]) == {c.name for c in cfg.curves}
    sites = _rows(tiny / "sites.csv")
    # sites per model: the MLP has embed + depth sites, the CNN and GPT one per block
    expected = sum((d + (c.arch == "mlp")) * len(cfg.seeds) for c in cfg.curves for d in c.depths)
    assert len(sites) == expected == len(_rows(tiny / "insertion.csv"))
    for r in runs:
        if r["dataset"] == "kjv":
            assert float(r["test_bpc"]) == pytest.approx(float(r["test_loss"]) / math.log(2), rel=1e-12)
        assert 0.0 <= float(r["test_accuracy"]) <= 1.0


def test_site_quantities_obey_the_chain_and_the_interval(tiny):
    for r in _rows(tiny / "sites.csv"):
        s, rms, mx = float(r["s"]), float(r["ag_rms"]), float(r["ag_max"])
        assert s <= rms * (1 + 1e-9) and rms <= mx * (1 + 1e-9)
        assert float(r["s_over_ag_rms"]) == pytest.approx(s / rms, rel=1e-9)
        assert float(r["s_lower"]) <= s <= float(r["s_upper"])
        assert r["verdict"] in {"improvable", "saturated", "undetermined", "degenerate"}


def test_insertion_rederives_s_and_predicts_minus_t_s(tiny):
    for r in _rows(tiny / "insertion.csv"):
        s, sd = float(r["s"]), float(r["s_direct"])
        assert sd == pytest.approx(s, rel=1e-6, abs=1e-12)
        assert float(r["predicted"]) == pytest.approx(-float(r["step_size"]) * sd, rel=1e-12)
        assert float(r["deviation"]) == 0.0  # a zero-output block leaves the function unchanged
        # a small steepest step decreases J, and to first order as predicted (relative step 1 %)
        assert float(r["measured"]) < 0 and 0.8 < float(r["ratio"]) < 1.2


def test_recorded_activation_gradients_match_autograd_on_a_retrained_model(tiny):
    """AG_rms and AG_max of digits/mlp depth 2, seed 1, site blocks.0, from per-example autograd gradients."""
    cfg = S.CONFIGS["tiny"]
    curve = next(c for c in cfg.curves if c.name == "digits/mlp")
    splits = R.load_splits("digits", 1, cfg.sizes["digits"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = R.train(R.build_model("mlp", 2, splits, seed=1, width=curve.width), splits, seed=1, recipe=cfg.recipe)
    finally:
        torch.set_num_threads(threads)
    md = model.model.double()
    x, y = splits.probe.x.double(), splits.probe.y
    z = {}
    handle = md.blocks[0].register_forward_hook(lambda _m, _i, o: z.setdefault("z", o))
    losses = torch.nn.functional.cross_entropy(md(x), y, reduction="none")
    handle.remove()
    (g,) = torch.autograd.grad(losses.sum(), z["z"])  # row i is d loss_i / d z_i (examples independent)
    norms = g.norm(dim=1)
    row = next(
        r
        for r in _rows(tiny / "sites.csv")
        if (r["dataset"], r["arch"], r["depth"], r["seed"], r["site"]) == ("digits", "mlp", "2", "1", "blocks.0")
    )
    assert float(row["ag_rms"]) == pytest.approx(float(norms.pow(2).mean().sqrt()), rel=1e-9)
    assert float(row["ag_max"]) == pytest.approx(float(norms.max()), rel=1e-9)
    run = next(
        r
        for r in _rows(tiny / "runs.csv")
        if (r["dataset"], r["arch"], r["depth"], r["seed"]) == ("digits", "mlp", "2", "1")
    )
    assert float(run["test_loss"]) == pytest.approx(model.metrics["test"]["loss"], rel=1e-9)


def test_plateaus_csv_applies_the_rule_to_the_mean_curves(tiny):
    curves = _rows(tiny / "curves.csv")
    for p in _rows(tiny / "plateaus.csv"):
        pts = [c for c in curves if (c["dataset"], c["arch"], c["metric"]) == (p["dataset"], p["arch"], p["metric"])]
        depths, means = [int(c["depth"]) for c in pts], [float(c["mean"]) for c in pts]
        lower = S.CURVE_METRICS[p["metric"]]
        written = None if p["plateau_depth"] == "" else int(p["plateau_depth"])  # empty: not reached
        assert written == S.plateau_depth(depths, means, lower_is_better=lower)
        assert int(p["per_seed_not_reached"]) == p["per_seed"].split().count("None")


# ----------------------------------------------------------------------------- atomicity and bad input
def test_a_failing_run_leaves_no_result_folder(tmp_path, monkeypatch):
    calls = []

    def boom(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("planted failure after the first model")
        return real(*args, **kwargs)

    real = S.insertion_rows
    monkeypatch.setattr(S, "insertion_rows", boom)
    out = tmp_path / "sweep"
    with pytest.raises(RuntimeError, match="planted"):
        S.run_sweep("tiny", out=out, seeds=[0])
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path):
    out = tmp_path / "x"
    for args in (
        ["--config", "huge"],
        ["--seeds", "a,b"],
        ["--seeds", "1,1"],
        ["--seeds", "0,-1"],
        ["--curve", "cifar/vit"],
    ):
        res = runner.invoke(app, ["experiment", "sweep", *args, "--out", str(out)])
        assert res.exit_code == 2, (args, res.output)
        assert "error:" in res.output and len(res.output.strip().splitlines()) == 1
    assert not out.exists()


def test_a_stopped_sweep_resumes_from_its_finished_models(tmp_path, monkeypatch):
    log = tmp_path / "done.jsonl"
    first = S.run_sweep("tiny", out=tmp_path / "a", seeds=[0], resume=log)
    cfg = S.CONFIGS["tiny"]
    assert len(log.read_text().splitlines()) == sum(len(c.depths) for c in cfg.curves)

    def never(*args, **kwargs):
        raise AssertionError("a finished model was trained again")

    monkeypatch.setattr(S, "_one_model", never)
    second = S.run_sweep("tiny", out=tmp_path / "b", seeds=[0], resume=log)
    for name in ("runs", "sites", "insertion", "plateaus"):
        assert (first / f"{name}.csv").read_text() == (second / f"{name}.csv").read_text(), name


def test_curve_subsets_in_separate_processes_aggregate_without_retraining(tmp_path, monkeypatch):
    import csv

    names = [c.name for c in S.CONFIGS["tiny"].curves]
    part_a, part_b = names[:1], names[1:]
    logs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    outs = [
        S.run_sweep("tiny", out=tmp_path / f"o{i}", seeds=[0], resume=log, curves=part)
        for i, (part, log) in enumerate(zip((part_a, part_b), logs, strict=True))
    ]
    for out, part in zip(outs, (part_a, part_b), strict=True):
        rows = list(csv.DictReader((out / "runs.csv").open()))
        assert {f"{r['dataset']}/{r['arch']}" for r in rows} == set(part)
    merged = tmp_path / "all.jsonl"
    merged.write_text("".join(log.read_text() for log in logs))

    def never(*args, **kwargs):
        raise AssertionError("a finished model was trained again")

    monkeypatch.setattr(S, "_one_model", never)
    whole = S.run_sweep("tiny", out=tmp_path / "all", seeds=[0], resume=merged)

    def rows(folder):  # a column only some curves have (bits per character) is empty elsewhere
        return sorted(
            sorted((k, v) for k, v in r.items() if v != "") for r in csv.DictReader((folder / "runs.csv").open())
        )

    assert rows(whole) == sorted(rows(outs[0]) + rows(outs[1]))


def test_the_sweep_runs_first_in_experiment_all():
    from depthsat_theory.cli.experiment import EXPERIMENTS

    assert next(iter(EXPERIMENTS)) == "sweep"  # criterion-driven growth reads the sweep's summary.json


def test_c1_needs_a_falling_curve_whose_plateau_is_where_the_test_loss_stops_improving():
    depths = [1, 2, 4, 8]
    curve = S.Curve("digits", "mlp", tuple(depths))
    loss = [1.0, 0.5, 0.3, 0.29]  # plateau 4 by the rule

    def rows(metric, values):
        return [
            {"dataset": "digits", "arch": "mlp", "metric": metric, "depth": d, "mean": v, "std": 0.0}
            for d, v in zip(depths, values, strict=True)
        ]

    def claims(ag, ag_last):
        curves = rows("test_loss", loss) + rows("ag_max", ag) + rows("ag_max_last", ag_last)
        plateaus = [
            {"dataset": "digits", "arch": "mlp", "metric": m, "plateau_depth": S.plateau_depth(depths, v)}
            for m, v in (("test_loss", loss), ("ag_max", ag), ("ag_max_last", ag_last))
        ]
        return S._check_claims(plateaus, curves, curve)

    c = claims([10.0, 4.0, 1.0, 0.9], [1.0, 2.0, 3.0, 4.0])  # falls to a plateau at 4; rises (plateau 1)
    assert c["performance_plateau_depth"] == 4
    assert c["ag_max_plateau_depth"] == 4 and c["c1_holds_ag_max"] is True
    assert c["ag_max_last_plateau_depth"] == 1 and c["c1_holds_ag_max_last"] is False
    c = claims([10.0, 9.0, 8.0, 0.1], [10.0, 1.0, 1.0, 1.0])  # still falling at 8 (no plateau), early (plateau 2)
    assert c["ag_max_plateau_depth"] is None and c["ag_max_plateau_matches_performance"] is False
    assert c["c1_holds_ag_max"] is False  # no plateau reached, so none where the test loss stops improving (4)
    assert c["ag_max_last_plateau_depth"] == 2 and c["c1_holds_ag_max_last"] is True


def test_a_missing_fashion_mnist_is_skipped_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "FASHION_DIR", tmp_path / "no-such-folder")
    R._fashion.cache_clear()
    reason = R.dataset_unavailable("fashion")
    assert reason is not None and "apt-get install dataset-fashion-mnist" in reason
    with pytest.raises(R.DatasetUnavailable, match="dataset-fashion-mnist"):
        R.load_splits("fashion", 0)
    only = S.SweepConfig("only-fashion", (S.Curve("fashion", "mlp", (1,)),), (0,), {})
    with pytest.raises(S.ExperimentError, match="no data set available"):
        S.run_sweep(only, out=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    R._fashion.cache_clear()


def test_a_bad_out_or_resume_is_refused_before_any_training(tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a model was trained before the bad input was refused")

    monkeypatch.setattr(S, "_one_model", never)
    a_file = tmp_path / "file.txt"
    a_file.write_text("dataset,arch\ndigits,mlp\n")
    cut = tmp_path / "cut.jsonl"
    cut.write_text('{"key": "abc/digits/mlp/1/0", "rec')
    for args in (
        ["--out", str(a_file)],
        ["--out", str(a_file / "sweep")],
        ["--seeds", ""],
        ["--resume", str(tmp_path)],
        ["--resume", str(a_file)],
    ):
        res = runner.invoke(app, ["experiment", "sweep", "--config", "tiny", "--out", str(tmp_path / "o"), *args])
        assert res.exit_code == 2, (args, res.output)
        assert "error:" in res.output and len(res.output.strip().splitlines()) == 1, (args, res.output)
    assert a_file.read_text() == "dataset,arch\ndigits,mlp\n"  # nothing appended to a wrong --resume
    res = runner.invoke(app, ["experiment", "all", "--config", "tiny", "--root", str(a_file)])
    assert res.exit_code == 2 and "not a folder" in res.output, res.output
    # a line cut by a crash is still skipped (the run then trains: the planted trainer says so)
    with pytest.raises(AssertionError, match="trained before"):
        S.run_sweep("tiny", out=tmp_path / "o", seeds=[0], resume=cut)


# ----------------------------------------------------------------------------- provenance
def test_provenance_records_the_checkout_at_the_start_and_flags_a_commit_made_during_the_run(monkeypatch):
    from depthsat_theory.experiments import record

    start, end = {"commit": "a" * 40, "dirty": False}, {"commit": "b" * 40, "dirty": False}
    monkeypatch.setattr(record, "_AT_START", start)
    monkeypatch.setattr(record, "_git_commit", lambda: end)
    meta = record.provenance(seeds=[0], config={})
    assert (meta["commit"], meta["dirty"], meta["commit_at_end"]) == ("a" * 40, True, "b" * 40)
    monkeypatch.setattr(record, "_git_commit", lambda: dict(start))
    meta = record.provenance(seeds=[0], config={})
    assert (meta["commit"], meta["dirty"]) == ("a" * 40, False) and "commit_at_end" not in meta
    # an edit made during the run (same HEAD, dirty only at the end) is flagged too
    monkeypatch.setattr(record, "_git_commit", lambda: {"commit": "a" * 40, "dirty": True})
    assert record.provenance(seeds=[0], config={})["dirty"] is True
