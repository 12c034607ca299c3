"""The theorem checker (``depthsat check``): agreement, planted failures, reports.

Expected values come from the theory, not from the checker: exact constructions
have ``s = 0`` (theory label ``ex-saturated``), the product family has ``T = {0}``, a rotation has
``⟨b, R b⟩ = 0`` so an improvable instance shows no first-order decrease under it
(T3 converse), and the observed slope of a descent-compatible step is
``−⟨b, P(b)⟩`` (T1 + chain rule), recomputed here from an independent autograd
gradient.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from depthsat_theory.check import CheckConfig, run_check, write_report_atomic
from depthsat_theory.optimizers import DESCENT_COMPATIBLE, get_update

REQUIRED = (
    "model",
    "data",
    "site",
    "family",
    "optimizer",
    "score",
    "tol",
    "predicted_improvable",
    "observed_decrease",
    "agreement",
)


@pytest.fixture(scope="module")
def report(model_cache):
    return run_check(CheckConfig(instances=60, seed=7, cache_dir=model_cache))


def test_seeded_sample_has_no_counterexample(report):
    assert report["instances"] == 60
    assert report["counterexamples"] == 0, report["summary"]["reasons"]
    for key in ("instances", "agree", "counterexamples", "undecided", "seed", "records"):
        assert key in report
    assert report["agree"] + report["undecided"] + report["degenerate"] == 60
    for rec in report["records"]:
        for key in REQUIRED:
            assert key in rec


def test_sample_covers_real_data_and_constructions(report):
    recs = report["records"]
    assert {r["data"] for r in recs} >= {"digits", "kjv", "synthetic"}
    assert {r["model"] for r in recs} >= {"mlp", "cnn", "gpt"}
    assert any(r["construction"] == "lsq-readout" for r in recs)
    assert any(r["construction"] == "odd" for r in recs)


def test_constructions_are_predicted_saturated_and_agree(report):
    for rec in report["records"]:
        if rec["construction"] is not None:
            # exact constructions: s = 0 exactly in exact arithmetic (theory label ``ex-saturated``)
            assert rec["score"] <= rec["tol"]
            assert rec["predicted_improvable"] is False
            assert rec["observed_decrease"] is False
            assert rec["agreement"] == "agree"
            # ... while the activation gradient does not vanish (T6 converse)
            assert rec["ag_max"] > 1e3 * rec["tol"]


def test_degenerate_family_is_never_saturated(report):
    deg = [r for r in report["records"] if r["family"].startswith("product:")]
    assert deg, "the draw should contain the degenerate product family"
    for rec in deg:
        assert rec["tangent_rank"] == 0
        assert rec["agreement"] == "degenerate"
        assert rec["predicted_improvable"] is False
        assert rec["delta_j"] == [0.0] * len(rec["delta_j"])  # b = 0 and T = {0}: J never moves


def test_improvable_records_decrease_at_the_predicted_rate(report):
    imp = [r for r in report["records"] if r["predicted_improvable"] and r["agreement"] == "agree"]
    assert len(imp) >= 20
    for rec in imp:
        assert rec["observed_decrease"] is True
        assert rec["predicted_slope"] < 0
        assert math.isclose(rec["observed_slope"], rec["predicted_slope"], rel_tol=2e-3, abs_tol=3 * rec["slope_error"])
        # the first differences are themselves ≈ linear at the smallest step
        assert rec["delta_j"][-1] < 0


def test_same_seed_same_report(model_cache):
    cfg = CheckConfig(instances=4, seed=11, cache_dir=model_cache)  # determinism needs no large draw
    a, b = run_check(cfg), run_check(cfg)
    assert json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def test_planted_rotation_is_flagged(model_cache):
    rep = run_check(CheckConfig(instances=8, seed=3, cache_dir=model_cache, optimizers=("rotation",)))
    assert rep["counterexamples"] > 0
    assert rep["summary"]["planted_counterexamples"] == rep["counterexamples"]
    assert rep["summary"]["reasons"] == {}
    for rec in rep["records"]:
        assert rec["descent_compatible"] is False
        if rec["agreement"] == "counterexample":
            assert rec["predicted_improvable"] is True
            assert rec["observed_decrease"] is False
            assert rec["predicted_slope"] == 0.0  # ⟨b, R b⟩ = 0 exactly


def test_observed_slope_matches_an_independent_gradient(model_cache):
    """Rebuild one improvable MLP instance by hand and recompute −⟨b, P(b)⟩ with autograd."""
    from depthsat_theory.capture import insert_block
    from depthsat_theory.families import parse_family
    from depthsat_theory.tasks import trained_task

    rep = run_check(CheckConfig(instances=30, seed=5, cache_dir=model_cache, kinds=("mlp",), construction_fraction=0.0))
    rec = next(
        r for r in rep["records"] if r["predicted_improvable"] and r["family"] in ("linear", "relu:128", "powers:2")
    )
    task = trained_task("mlp", 5, cache_dir=model_cache)
    fam = parse_family(rec["family"])
    new, blk = insert_block(task.model, rec["site"], fam.block((64,), "vector"))
    loss = task.loss(new(task.inputs), task.targets).mean()
    grads = torch.autograd.grad(loss, fam.tangent_parameters(blk))
    b = torch.cat([g.reshape(-1) for g in grads])
    upd = get_update(rec["optimizer"])
    expected = -float(b @ upd.first_step(b))
    assert math.isclose(rec["predicted_slope"], expected, rel_tol=1e-9)
    assert math.isclose(rec["observed_slope"], expected, rel_tol=2e-3)


def test_config_validation():
    with pytest.raises(ValueError, match="instances"):
        CheckConfig(instances=0).validate()
    with pytest.raises(ValueError, match=r"rotation|valid"):
        CheckConfig(optimizers=("nope",)).validate()
    assert "rotation" not in DESCENT_COMPATIBLE


def test_report_written_atomically(tmp_path):
    path = tmp_path / "r.json"
    write_report_atomic({"a": 1, "b": float("nan")}, path)
    assert json.loads(path.read_text()) == {"a": 1, "b": None}
    bad = tmp_path / "bad.json"
    with pytest.raises(TypeError):
        write_report_atomic({"x": object()}, bad)
    assert not bad.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temp file left behind


def test_check_draws_the_polynomial_family_and_its_first_step_agrees(model_cache):
    """``poly:2`` (every monomial of degree ≤ 2) is in the vector pool, and one instance
    on the trained MLP agrees: the first step's observed slope matches ``−⟨b, P(b)⟩`` from autograd."""
    from depthsat_theory.check import FAMILY_POOLS, evaluate, insert_on_probe, pool_family
    from depthsat_theory.check.checker import Agreement
    from depthsat_theory.tasks import trained_task
    from depthsat_theory.vocabulary import Layout

    assert "poly:2" in FAMILY_POOLS[Layout.VECTOR]
    task = trained_task("mlp", 5, cache_dir=model_cache)
    fam = pool_family("poly:2")
    ins = insert_on_probe(task, "blocks.1", fam)
    assert ins.result.tangent_dim == 64 * (65 * 66 // 2)  # d · (C(d + 2, 2) − 1 + bias)
    out = evaluate(ins, get_update("sgd"), CheckConfig())
    assert out["agreement"] is Agreement.AGREE, out["detail"]
    grads = torch.autograd.grad(
        task.loss(ins.model(task.inputs), task.targets).mean(), fam.tangent_parameters(ins.block)
    )
    b = torch.cat([g.reshape(-1) for g in grads])
    # the float32 model's autograd b against the checker's: equal to the model's rounding (T1's tolerance)
    assert math.isclose(out["predicted_slope"], -float(b @ b), rel_tol=1e-4)
