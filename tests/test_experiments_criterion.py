"""Criterion-driven growth: the carried optimizer, the best round and the noise stop rule.

Independent checks: the optimizer state carried across rounds equals a hand-run ``torch.optim.Adam``
over the concatenated rounds (old parameters matched by name, the new block's added with
``add_param_group``), bit for bit; the best round is the argmin of the validation losses measured on
the kept models; the noise rule and ``rules_that_stop`` on hand-built diagnoses.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from depthsat_theory.experiments import criterion as C
from depthsat_theory.experiments import recipe as R
from depthsat_theory.experiments.deepen import deepen
from depthsat_theory.grow import GrowError
from depthsat_theory.tasks.models import classification_loss
from depthsat_theory.vocabulary import Certificate, Verdict

SIZES = R.Sizes(train=96, val=64, probe=64, test=64)
RECIPE = R.Recipe(batch_size=32, max_epochs=3, patience=10)


@pytest.fixture(autouse=True)
def _one_thread():
    """Bitwise comparisons of two training runs need one reduction order."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _splits():
    return R.load_splits("digits", 0, SIZES)


def _names(model):
    return {id(p): n for n, p in model.named_parameters()}


def _shifted(name: str, after: int) -> str:
    """The name of an old parameter once one block is inserted after block ``after`` (-1: after the embedding)."""
    parts = name.split(".")
    if parts[0] == "blocks" and int(parts[1]) > after:
        parts[1] = str(int(parts[1]) + 1)
    return ".".join(parts)


def _assert_same_state(opt_a, model_a, opt_b, model_b):
    """Every parameter's Adam state (exp_avg, exp_avg_sq, step) equal bitwise, matched by parameter name."""
    by_name_b = dict(model_b.named_parameters())
    for name, p in model_a.named_parameters():
        sa, sb = opt_a.state[p], opt_b.state[by_name_b[name]]
        assert set(sa) == set(sb) == {"exp_avg", "exp_avg_sq", "step"}, name
        for k in sa:
            assert torch.equal(sa[k], sb[k]), (name, k)


# ----------------------------------------------------------------------------- carrying the optimizer


def test_carry_optimizer_keeps_old_state_and_starts_the_new_block_at_zero():
    splits = _splits()
    model = R.build_model("mlp", 2, splits, seed=0, width=4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for i in range(3):  # a few hand steps: nonzero moments, step 3
        opt.zero_grad()
        classification_loss(
            model(splits.train.x[i * 8 : i * 8 + 8]), splits.train.y[i * 8 : i * 8 + 8]
        ).mean().backward()
        opt.step()
    grown = deepen(model, [-1], splits.probe.x, seed=5)  # after the embedding: old blocks.i becomes blocks.i+1
    carried = C.carry_optimizer(opt, model, grown)
    new_ids = {id(p) for p in grown.new_params}
    names = _names(grown.model)
    old_by_new_name = {_shifted(n, -1): p for n, p in model.named_parameters()}
    for p in grown.model.parameters():
        if id(p) in new_ids:
            assert names[id(p)].startswith("blocks.0.") and len(carried.state[p]) == 0  # zero state: none yet
            continue
        src = opt.state[old_by_new_name[names[id(p)]]]
        assert float(carried.state[p]["step"]) == 3
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(carried.state[p][k], src[k])
    # the first step from zero state: Adam's moments of the new block are (1 - β) g and (1 - β₂) g², step 1
    carried.zero_grad()
    classification_loss(grown.model(splits.train.x[:8]), splits.train.y[:8]).mean().backward()
    grads = {id(p): p.grad.clone() for p in grown.new_params}
    carried.step()
    for p in grown.new_params:
        st = carried.state[p]
        assert float(st["step"]) == 1
        assert torch.allclose(st["exp_avg"], 0.1 * grads[id(p)], rtol=1e-6, atol=0)
        assert torch.allclose(st["exp_avg_sq"], 0.001 * grads[id(p)] ** 2, rtol=1e-6, atol=0)


def test_carry_optimizer_refuses_an_optimizer_of_another_model():
    splits = _splits()
    model = R.build_model("mlp", 1, splits, seed=0, width=4)
    other = R.build_model("mlp", 1, splits, seed=1, width=4)
    grown = deepen(model, [0], splits.probe.x, seed=0)
    with pytest.raises(GrowError, match="exactly the parameters"):
        C.carry_optimizer(torch.optim.Adam(other.parameters()), model, grown)


def _hand_round(model, opt, splits, seed):
    """One early-stopping round by hand: epochs of seeded batches, the best-val weights and Adam state kept."""
    gen = torch.Generator().manual_seed(seed)
    x, y, n = splits.train.x, splits.train.y, len(splits.train)
    best = (math.inf, None, None)
    for _ in range(RECIPE.max_epochs):  # patience 10 > max_epochs: every epoch runs
        model.train()
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n, RECIPE.batch_size):
            idx = perm[i : i + RECIPE.batch_size]
            loss = classification_loss(model(x[idx]), y[idx]).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        val = R.evaluate(model, splits.val, splits)["loss"]
        if val < best[0]:
            best = (val, copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    model.load_state_dict(best[1])
    opt.load_state_dict(best[2])


def _grow_after_first_block(monkeypatch):
    """Make every round's decision "grow after blocks.0" (the decision rules are tested on their own)."""
    grow = {"stop": False, "site": "blocks.0", "rule": C.NOISE, "reason": "test", "certified_undetermined": False}
    monkeypatch.setattr(C, "_decision", lambda *a: {**grow, "ranked_by": "test", "ranking_reason": "test"})


def _run(monkeypatch, max_depth):
    _grow_after_first_block(monkeypatch)
    splits = _splits()
    cfg = {"recipe": {"batch_size": RECIPE.batch_size, "max_epochs": RECIPE.max_epochs, "patience": RECIPE.patience}}
    fit, lr = C._fit(cfg, splits)
    model = R.build_model("mlp", 1, splits, seed=0, width=4)
    run = C.grow_by_criterion(model, splits, fit, rule="noise", seed=0, max_depth=max_depth, delta=0.05, lr=lr)
    return splits, run


def test_carried_adam_state_equals_a_hand_run_adam_over_the_concatenated_rounds(monkeypatch):
    splits, run = _run(monkeypatch, max_depth=3)
    assert [r["depth"] for r in run.rounds] == [1, 2, 3]
    # by hand: one Adam through three rounds; at each growth the old parameters' state moves by name
    model = R.build_model("mlp", 1, splits, seed=0, width=4)
    opt = torch.optim.Adam(model.parameters(), lr=RECIPE.lr)
    _hand_round(model, opt, splits, seed=0)
    for rnd in (0, 1):
        grown = deepen(model, [0], splits.probe.x, seed=10_000 + rnd)
        old = {_shifted(n, 0): p for n, p in model.named_parameters()}
        new_ids = {id(p) for p in grown.new_params}
        kept = [p for p in grown.model.parameters() if id(p) not in new_ids]
        hand = torch.optim.Adam(kept, lr=RECIPE.lr)
        for name, p in grown.model.named_parameters():
            if id(p) not in new_ids:
                hand.state[p] = {k: v.clone() for k, v in opt.state[old[name]].items()}
        hand.add_param_group({"params": list(grown.new_params)})  # no state: Adam starts them from zero
        model, opt = grown.model, hand
        _hand_round(model, opt, splits, seed=rnd + 1)
    _assert_same_state(run.optimizer, run.models[-1], opt, model)
    for (name, a), b in zip(run.models[-1].state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # the old parameters took every round's steps up to its best epoch; each new block only the rounds since it
    # was added (growing after blocks.0 twice: the newest block is blocks.1, the first one moved to blocks.2)
    steps = {n: float(run.optimizer.state[p]["step"]) for n, p in run.models[-1].named_parameters()}
    per_round = [3 * r["best_epoch"] for r in run.rounds]  # 96 examples in batches of 32: 3 steps per epoch
    assert (steps["head.weight"], steps["blocks.2.W2.weight"], steps["blocks.1.W2.weight"]) == (
        sum(per_round),
        sum(per_round[1:]),
        per_round[2],
    )


def test_the_best_round_is_the_argmin_of_validation_losses_and_its_model_is_returned(monkeypatch):
    splits, run = _run(monkeypatch, max_depth=3)
    measured = [R.evaluate(m, splits.val, splits)["loss"] for m in run.models]  # on the kept models, not the rows
    assert [r["val_loss"] for r in run.rounds] == measured
    best = min(range(len(measured)), key=lambda i: (measured[i], i))
    assert run.best_round == best and [r["is_best"] for r in run.rounds] == [i == best for i in range(3)]
    assert len(run.model.blocks) == run.rounds[best]["depth"]
    for (name, a), b in zip(run.model.state_dict().items(), run.models[best].state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert R.evaluate(run.model, splits.test, splits)["loss"] == run.rounds[best]["test_loss"]


def test_train_restores_the_optimizer_state_of_the_best_epoch():
    splits = _splits()
    model = R.build_model("mlp", 1, splits, seed=0, width=4)
    opt = torch.optim.Adam(model.parameters(), lr=RECIPE.lr)
    res = R.train(model, splits, seed=0, recipe=RECIPE, optimizer=opt)
    steps_per_epoch = -(-len(splits.train) // RECIPE.batch_size)
    assert {float(s["step"]) for s in opt.state.values()} == {res.best_epoch * steps_per_epoch}


def test_train_budget_with_a_carried_optimizer_restarts_the_cosine_and_keeps_the_moments():
    splits = _splits()
    budget = R.BudgetRecipe(lr=1e-2, batch_size=16, steps=9)
    loss_fn = R.loss_function(splits)
    x, y = splits.train.x, splits.train.y
    model = R.build_model("mlp", 1, splits, seed=0, width=4)
    opt = torch.optim.Adam(model.parameters(), lr=budget.lr)
    for seed in (1, 2):
        R.train_budget(model, x, y, loss_fn, seed=seed, recipe=budget, optimizer=opt)
    # by hand: one Adam, two cosine schedules from lr to 0, batches as train_budget draws them
    hand = R.build_model("mlp", 1, splits, seed=0, width=4)
    hopt = torch.optim.Adam(hand.parameters(), lr=budget.lr)
    for seed in (1, 2):
        hopt.param_groups[0]["lr"] = budget.lr
        gen = torch.Generator().manual_seed(seed)
        perm, pos = torch.randperm(len(x), generator=gen), 0
        for step in range(budget.steps):
            if pos + budget.batch_size > len(x):
                perm, pos = torch.randperm(len(x), generator=gen), 0
            idx = perm[pos : pos + budget.batch_size]
            pos += budget.batch_size
            hand.train()
            loss = loss_fn(hand(x[idx]), y[idx]).mean()
            hopt.zero_grad(set_to_none=True)
            loss.backward()
            hopt.step()
            hopt.param_groups[0]["lr"] = budget.lr * (1 + math.cos(math.pi * (step + 1) / budget.steps)) / 2
    assert {float(s["step"]) for s in opt.state.values()} == {2 * budget.steps}
    for (name, a), b in zip(model.state_dict().items(), hand.state_dict().values(), strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (
            name
        )  # the closed-form cosine rounds unlike torch's recursion


# ----------------------------------------------------------------------------- the noise stop rule


def _diagnosis(verdicts, scores, *, n=256, needed=None, certs=None, unbiased=None):
    """Hand-built diagnosis: per site a noise verdict, a plug-in score, ``ŝ²_U`` (the ranking key, default ŝ²/2)."""
    sites = []
    unbiased = unbiased or [s * s / 2 for s in scores]
    for i, (v, s) in enumerate(zip(verdicts, scores, strict=True)):
        iv = SimpleNamespace(
            certificate=(certs or [Certificate.NOT_CERTIFIED] * len(scores))[i],
            score_lower=0.0,
            vacuous=True,
            n_to_certify=10**6,
            score_squared_unbiased=unbiased[i],
        )
        res = SimpleNamespace(
            ag_rms=1.0,
            relative_score=s,
            score=s,
            n=n,
            noise_variance=n * s * s - (n - 1) * unbiased[i],  # so that the headline's ŝ²_U is unbiased[i]
            alpha=0.05,
            noise_ratio=float("nan"),
            verdict=v,
            examples_needed=(needed or [None] * len(scores))[i],
        )
        sites.append(SimpleNamespace(site=f"blocks.{i}", depth=i, interval=iv, result=res, verdict=v))
    return SimpleNamespace(sites=sites, delta=0.05, n=n)


def test_noise_rule_grows_at_the_one_improvable_site_even_when_another_ranks_higher():
    u, imp = Verdict.UNDETERMINED, Verdict.IMPROVABLE
    d = C.decide_noise(_diagnosis([u, imp, u], [0.9, 0.2, 0.5]))
    assert (d["stop"], d["site"], d["rule"]) == (False, "blocks.1", C.NOISE)
    assert "1 site(s) improvable at α = 0.05 on the probe of n = 256 examples" in d["reason"]


def test_noise_rule_grows_at_the_top_ranked_of_several_improvable_sites():
    u, imp = Verdict.UNDETERMINED, Verdict.IMPROVABLE
    d = C.decide_noise(_diagnosis([imp, u, imp], [0.3, 0.9, 0.6]))
    assert (d["stop"], d["site"]) == (False, "blocks.2")


def test_noise_rule_stops_when_no_site_is_improvable_and_says_at_which_probe_size():
    u, s = Verdict.UNDETERMINED, Verdict.SATURATED
    d = C.decide_noise(_diagnosis([u, s, u], [0.4, 0.0, 0.2], n=8192, needed=[70000, None, 130000]))
    assert d["stop"] and d["site"] is None and d["rule"] == C.NOISE
    assert d["reason"] == (
        "noise test: no site improvable at α = 0.05 on the probe of n = 8192 examples (examples needed 70000–130000)"
    )


def test_rules_that_stop_reads_each_rule_on_its_own():
    u, imp = Verdict.UNDETERMINED, Verdict.IMPROVABLE
    sat, ci, nc = Certificate.SATURATED, Certificate.IMPROVABLE, Certificate.NOT_CERTIFIED
    eps = 0.1
    # certified improvable somewhere, ŝ_U² above ε² at one site (0.0144 > 0.01), noise-improvable at one
    got = C.rules_that_stop(_diagnosis([u, imp], [0.2, 0.3], certs=[ci, nc], unbiased=[0.0144, 0.0]), eps)
    assert got == {"certified": False, "fallback": False, "noise": False}
    # nothing certified (undetermined: the certified rule stops), ŝ_U² = 0.0081 <= 0.01 everywhere, nothing improvable
    got = C.rules_that_stop(_diagnosis([u, u], [0.2, 0.3], certs=[nc, nc], unbiased=[0.0081, -0.5]), eps)
    assert got == {"certified": True, "fallback": True, "noise": True}
    got = C.rules_that_stop(_diagnosis([imp, u], [0.2, 0.3], certs=[sat, sat], unbiased=[0.0, 0.0]), eps)
    assert got == {"certified": True, "fallback": True, "noise": False}


def test_grow_by_criterion_refuses_an_unknown_rule():
    splits = _splits()
    with pytest.raises(C.ExperimentError, match="stop rule 'plateau'"):
        C.grow_by_criterion(
            R.build_model("mlp", 1, splits, seed=0, width=4),
            splits,
            None,
            rule="plateau",
            seed=0,
            max_depth=2,
            delta=0.05,
            lr=1e-3,
        )


# ----------------------------------------------------------------------------- claims rows in summary.json


def test_write_results_writes_claims_rows_and_refuses_a_malformed_one(tmp_path):
    import json

    from depthsat_theory.experiments.record import ExperimentError, write_results

    row = {"claim": "c", "setting": "s", "verdict": "holds", "qualifier": "", "interval": "i", "reason": "r"}
    folder = write_results(tmp_path / "ok", tables={}, summary={"x": 1}, meta={}, claims=[row])
    assert json.loads((folder / "summary.json").read_text()) == {"meta": {}, "summary": {"x": 1}, "claims": [row]}
    for bad in ({**row, "verdict": "undetermined"}, {k: v for k, v in row.items() if k != "reason"}, {**row, "n": 3}):
        with pytest.raises(ExperimentError, match="claims row"):
            write_results(tmp_path / "bad", tables={}, summary={}, meta={}, claims=[bad])
    assert not (tmp_path / "bad").exists()
    assert "claims" not in json.loads(
        (write_results(tmp_path / "none", tables={}, summary={}, meta={}) / "summary.json").read_text()
    )
