r"""Criterion-driven growth (beyond the paper).

Start shallow; train; then repeat:

1. diagnose every site on the ``probe`` split (:func:`~depthsat_theory.diagnose.diagnose`, linear
   family, ``(1 − δ)`` intervals union-bounded over the sites, the saturation certificate at
   ``ε = sqrt(2 β ε_J)``: ``ε_J`` the library's default
   :data:`~depthsat_theory.statistics.decrease.DEFAULT_EPSILON_NATS` and ``β = ½‖W_head‖²`` the
   cross-entropy smoothness at the head input
   (:func:`~depthsat_theory.statistics.decrease.cross_entropy_smoothness`), the only ``β`` the
   library can compute here; it is *not* proven for the hidden sites, so this ``ε`` is a
   yardstick there, not a guarantee), with each site's noise-test verdict at ``α`` (``thm-noise-test``);
2. decide by the arm's stop rule (:data:`STOP_RULES`):

   - ``"certified"`` — **certified rule**: stop when every site is certified ε-saturated; insert a
     zero-output :class:`~depthsat_theory.tasks.models.MLPBlock` after the certified-improvable site
     with the largest certified lower end of ``s/AG_rms`` (:func:`~depthsat_theory.grow.rank_sites`);
     when no site is certified either way the certificate is out of reach at this probe size (each
     site's ``n_to_certify`` says how far), and the certified rule stops there; then the
     **fallback** (:func:`~depthsat_theory.grow.rank_sites`' point estimate ``ŝ/AG_rms``) goes on:
     stop when the bias-corrected ``ŝ²`` (``score_squared_unbiased``) is at most ``ε²`` at every site
     (a point estimate, not a certificate), else grow after the top site (:func:`decide`);
   - ``"noise"`` — **noise rule**: stop when no site is *improvable* by the noise test at ``α`` on the
     probe of ``n`` examples (the reason states ``α``, ``n`` and the examples the test would need),
     else grow after the top-ranked improvable site (:func:`decide_noise`);

   every round records which of the three rules (certified, fallback, noise) would stop there
   (:func:`rules_that_stop`);
3. grow (:func:`~depthsat_theory.experiments.deepen.deepen`) and **carry the optimizer**
   (:func:`carry_optimizer`): Adam's moments and step count of every old parameter go into the next
   round, the new block's parameters start from zero state
   (:func:`~depthsat_theory.grow.zero_state_param_groups`);
4. retrain — with the early-stopping recipe (:func:`~depthsat_theory.experiments.recipe.train`; the
   optimizer state is restored with the best epoch's weights) or one fixed cosine budget per round
   (:class:`~depthsat_theory.experiments.recipe.BudgetRecipe`, the ``fashion`` configuration) — and go to 1;
5. **keep the best round**: the reported model is the round with the lowest validation loss
   (:func:`grow_by_criterion`), and the results say which round it was.

Reported per arm, seed and round: depth, the sites' scores, intervals, certificates and ``n_to_certify``,
noise verdicts, the chosen site and rule, which rules would stop, train/val/test loss and accuracy, and
the cumulative compute (examples seen, FLOPs), next to the reference curve's plateau depth and compute
(the early-stopping depth sweep, or the budget sweep's scratch curves for ``fashion``).
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from depthsat_theory.diagnose import Diagnosis, diagnose
from depthsat_theory.experiments import recipe as rc
from depthsat_theory.experiments.deepen import Deepened, deepen
from depthsat_theory.experiments.flops import training_cost
from depthsat_theory.experiments.growth import sweep_sizes
from depthsat_theory.experiments.record import (
    DEFAULT_RESULTS_ROOT,
    ExperimentError,
    ResumeFile,
    config_tag,
    default_folder,
    provenance,
    summarize,
    write_results,
)
from depthsat_theory.grow import BY_CERTIFIED, rank_sites, zero_state_param_groups
from depthsat_theory.grow.errors import GrowError
from depthsat_theory.statistics.decrease import DEFAULT_EPSILON_NATS, cross_entropy_smoothness, epsilon_from_nats
from depthsat_theory.vocabulary import Certificate, Verdict

__all__ = [
    "CONFIGS",
    "STOP_RULES",
    "GrowthRun",
    "carry_optimizer",
    "decide",
    "decide_noise",
    "grow_by_criterion",
    "rules_that_stop",
    "run_criterion_growth",
]

#: The budget sweep's full configuration (Fashion-MNIST 60k/10k, fixed cosine budget), shared by ``fashion``.
_FASHION_SIZES = {"train": None, "val": 4096, "probe": 8192, "test": 10000}
_FASHION_BUDGET = {"lr": 3e-3, "batch_size": 256, "steps": 2000}

#: The configurations by name, ``tiny`` (what CI runs, in seconds), ``full`` (the committed results on
#: digits and MNIST-5k with the early-stopping recipe) and ``fashion`` (Fashion-MNIST 60k/10k with the
#: budget sweep's fixed cosine budget per round); experiments/README.md gives their wall times.
CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": {
        "datasets": ["digits"],
        "arch": "mlp",
        "width": 8,
        "start_depth": 1,
        "max_depth": 3,
        "delta": 0.05,
        "seeds": [0, 1, 2],
        "stop_rules": ["certified", "noise"],
        "recipe": {"max_epochs": 3, "patience": 1},
        "sizes": {"digits": {"train": 300, "val": 100, "probe": 100, "test": 200}},
        "probe_batch": 256,
        "reference": "sweep",
    },
    "full": {
        "datasets": ["digits", "mnist5k"],
        "arch": "mlp",
        "width": 32,
        "start_depth": 1,
        "max_depth": 8,
        "delta": 0.05,
        "seeds": [0, 1, 2, 3, 4],
        "stop_rules": ["certified", "noise"],
        # the shared recipe as the depth sweep runs it, and its split sizes (experiments/sweep.py)
        "recipe": {},
        "sizes": sweep_sizes(["digits", "mnist5k"]),
        "probe_batch": 256,
        "reference": "sweep",
    },
    "fashion": {
        "datasets": ["fashion"],
        "arch": "mlp",
        "width": 32,
        "start_depth": 1,
        "max_depth": 8,
        "delta": 0.05,
        "seeds": [0, 1, 2],
        "stop_rules": ["noise"],
        # the budget sweep's (experiments/budget_sweep.py, config full): one budget per round
        "budget": _FASHION_BUDGET,
        "sizes": {"fashion": _FASHION_SIZES},
        "probe_batch": 1024,
        "reference": "budget-sweep",
    },
}

#: ``decide``'s and ``decide_noise``'s rules
CERTIFIED, FALLBACK, NOISE = "certified", "point-estimate fallback", "noise test"
#: The stop rules an arm can run (the certified rule with its fallback, or the noise rule).
STOP_RULES: tuple[str, ...] = ("certified", "noise")


def decide(diag: Diagnosis, epsilon: float, certified_stopped: bool) -> dict[str, Any]:
    """One round's decision by the certified rule (then the fallback): stop (and why) or the site to grow after.

    Args:
        diag: a diagnosis with intervals (``delta``) and the saturation certificate at ``epsilon``.
        epsilon: the ``ε`` of the certificate and of the fallback's stop (loss units per unit step).
        certified_stopped: whether the certified rule already stopped undetermined in an earlier round
            (then only the fallback decides).

    Returns:
        ``{"stop": bool, "site": str | None, "rule": CERTIFIED | FALLBACK, "reason": str,
        "certified_undetermined": bool, "ranked_by": str}``.
    """
    certs = {sd.site: sd.interval.certificate if sd.interval is not None else None for sd in diag.sites}
    ranking = rank_sites(diag)
    out: dict[str, Any] = {"ranked_by": ranking.by, "ranking_reason": ranking.reason, "certified_undetermined": False}
    if all(c == Certificate.SATURATED for c in certs.values()):
        return {**out, "stop": True, "site": None, "rule": CERTIFIED, "reason": "every site certified ε-saturated"}
    improvable = [r for r in ranking.sites if certs[r.site] == Certificate.IMPROVABLE]
    if improvable and not certified_stopped:
        best = max(improvable, key=lambda r: (r.relative_lower or 0.0, -r.depth))
        why = "largest certified lower end" + (
            "" if ranking.by == BY_CERTIFIED else " among certified-improvable sites"
        )
        return {**out, "stop": False, "site": best.site, "rule": CERTIFIED, "reason": why}
    return _fallback(diag, epsilon, {**out, "certified_undetermined": True}, ranking.top(1)[0])


def _noise_level(diag: Diagnosis) -> str:
    """``α = … on the probe of n = … examples`` (the noise test's level and probe size)."""
    return f"at α = {diag.sites[0].result.alpha:g} on the probe of n = {diag.n} examples"


def decide_noise(diag: Diagnosis) -> dict[str, Any]:
    """One round's decision by the noise rule: stop when no site is improvable by the noise test, else grow.

    A site is improvable when its verdict (:attr:`~depthsat_theory.diagnose.SiteDiagnosis.verdict`:
    the noise test at the result's ``α``, ``thm-noise-test``) is ``improvable``; among those the
    site ranked first by :func:`~depthsat_theory.grow.rank_sites` is grown after.

    Args:
        diag: a diagnosis (the noise moment ``v̂`` streamed, as :func:`~depthsat_theory.diagnose.diagnose` does).

    Returns:
        ``{"stop": bool, "site": str | None, "rule": NOISE, "reason": str, "certified_undetermined": False,
        "ranked_by": str, "ranking_reason": str}``; a stop's reason states ``α``, the probe size ``n`` and
        the examples the noise test would need at the sites where it can say (``examples_needed``).

    Raises:
        GrowError: a diagnosis without sites.
    """
    ranking = rank_sites(diag)
    out: dict[str, Any] = {"ranked_by": ranking.by, "ranking_reason": ranking.reason, "certified_undetermined": False}
    improvable = {sd.site for sd in diag.sites if sd.verdict == Verdict.IMPROVABLE}
    if not improvable:
        need = [sd.result.examples_needed for sd in diag.sites if sd.result.examples_needed is not None]
        span = f"examples needed {min(need)}–{max(need)}" if need else "no site's examples needed is known"
        why = f"noise test: no site improvable {_noise_level(diag)} ({span})"
        return {**out, "stop": True, "site": None, "rule": NOISE, "reason": why}
    site = next(r.site for r in ranking.sites if r.site in improvable)
    why = f"noise test: {len(improvable)} site(s) improvable {_noise_level(diag)}; top-ranked of them by {ranking.by}"
    return {**out, "stop": False, "site": site, "rule": NOISE, "reason": why}


def rules_that_stop(diag: Diagnosis, epsilon: float) -> dict[str, bool]:
    """Which stop rules would stop on this diagnosis (whatever rule the arm runs).

    Args:
        diag: a diagnosis with intervals and noise verdicts.
        epsilon: the certificate's and the fallback's ``ε``.

    Returns:
        ``{"certified": every site certified ε-saturated or none certified improvable (the certified
        rule stops, saturated or undetermined), "fallback": the bias-corrected ``ŝ² ≤ ε²`` at every
        site, "noise": no site improvable by the noise test}``.
    """
    certs = [sd.interval.certificate if sd.interval is not None else None for sd in diag.sites]
    unbiased = [max(sd.interval.score_squared_unbiased or 0.0, 0.0) for sd in diag.sites if sd.interval is not None]
    return {
        "certified": all(c == Certificate.SATURATED for c in certs) or Certificate.IMPROVABLE not in certs,
        "fallback": all(u <= epsilon**2 for u in unbiased),
        "noise": not any(sd.verdict == Verdict.IMPROVABLE for sd in diag.sites),
    }


def _undetermined(diag: Diagnosis) -> str:
    """Why the certified rule cannot go on: the certificates at this probe size, with ``n_to_certify``."""
    ivs = [sd.interval for sd in diag.sites if sd.interval is not None]
    finite = [iv.n_to_certify for iv in ivs if iv.n_to_certify is not None]
    span = f"{min(finite)}–{max(finite)}" if finite else "none"
    n_imp = sum(iv.certificate == Certificate.IMPROVABLE for iv in ivs)
    what = "no site certified either way" if n_imp == 0 else f"{n_imp} site(s) certified improvable, the rest not"
    return f"{what} at n = {diag.n} (n_to_certify {span})"


def _fallback(diag: Diagnosis, epsilon: float, out: dict[str, Any], top: str) -> dict[str, Any]:
    """The point-estimate fallback: stop when the bias-corrected ``ŝ ≤ ε`` at every site, else grow at ``top``."""
    undetermined = _undetermined(diag)
    unbiased = [max(sd.interval.score_squared_unbiased or 0.0, 0.0) for sd in diag.sites if sd.interval is not None]
    if all(u <= epsilon**2 for u in unbiased):
        why = f"{undetermined}; point estimate: bias-corrected ŝ ≤ ε at every site (not a certificate)"
        return {**out, "stop": True, "site": None, "rule": FALLBACK, "reason": why}
    why = f"{undetermined}; {out['ranking_reason']}: top site by {out['ranked_by']}"
    return {**out, "stop": False, "site": top, "rule": FALLBACK, "reason": why}


def carry_optimizer(optimizer: torch.optim.Optimizer, old: nn.Module, grown: Deepened) -> torch.optim.Optimizer:
    """The optimizer of ``old`` moved onto the grown model: old parameters keep their state, new ones start at zero.

    :func:`~depthsat_theory.experiments.deepen.deepen` copies the model, so the grown model's old
    parameters are new tensors: they are matched to ``old``'s in order (the grown model's parameters
    without the new block's, shapes checked), the optimizer is rebuilt on them with the same groups and
    hyperparameters and its ``state_dict`` loaded (Adam: ``exp_avg``, ``exp_avg_sq`` and ``step`` of every
    old parameter carried), and the new block's parameters are added as one group with empty state
    (:func:`~depthsat_theory.grow.zero_state_param_groups`: zero moments and step 0, ``thm-update-invariance``).

    Args:
        optimizer: the optimizer that trained ``old`` (every parameter of ``old`` in its groups).
        old: the model before growth.
        grown: :func:`~depthsat_theory.experiments.deepen.deepen`'s result on ``old``.

    Returns:
        A new optimizer of the same class over every parameter of ``grown.model``.

    Raises:
        GrowError: the grown model's old parameters do not match ``old``'s (count or shapes), or a
            parameter of ``old`` is missing from the optimizer.
    """
    new_ids = {id(p) for p in grown.new_params}
    before = list(old.parameters())
    kept = [p for p in grown.model.parameters() if id(p) not in new_ids]
    if len(kept) != len(before) or any(a.shape != b.shape for a, b in zip(before, kept, strict=True)):
        raise GrowError("the grown model's old parameters do not match the model it was grown from")
    where = {id(a): b for a, b in zip(before, kept, strict=True)}
    if {id(p) for g in optimizer.param_groups for p in g["params"]} != set(where):
        raise GrowError("the optimizer does not hold exactly the parameters of the model it trained")
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [where[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    make: Any = type(optimizer)  # Adam, SGD, …: each takes the param groups as its first argument
    carried: torch.optim.Optimizer = make(groups)
    carried.load_state_dict(optimizer.state_dict())
    zero_state_param_groups(carried, grown.new_params)
    return carried


#: One round's training step, ``(model, optimizer, seed) -> {"metrics", "examples_seen", "best_epoch"}``.
Fit = Callable[[nn.Module, torch.optim.Optimizer, int], dict[str, Any]]


@dataclass
class GrowthRun:
    """What :func:`grow_by_criterion` returns.

    Attributes:
        rounds: one row per round (``round``, ``depth``, losses, decision, ``rule``, ``reason``,
            ``stops_<rule>`` for every rule, ``is_best``); losses in nats per example.
        sites: one row per site of every round's diagnosis.
        best_round: the round with the lowest validation loss (the first on a tie).
        model: that round's model (eval mode): the reported model.
        optimizer: the last round's optimizer (its state carried over every round; it holds the
            parameters of ``models[-1]``).
        models: every round's model, in round order (growth trains a copy, so each is as its round left it).
    """

    rounds: list[dict[str, Any]]
    sites: list[dict[str, Any]]
    best_round: int
    model: nn.Module
    optimizer: torch.optim.Optimizer
    models: list[nn.Module]


def _decision(rule: str, diag: Diagnosis, eps: float, certified_stopped: bool) -> dict[str, Any]:
    if rule == "noise":
        return decide_noise(diag)
    return decide(diag, eps, certified_stopped)


def grow_by_criterion(
    model: nn.Module,
    splits: rc.Splits,
    fit: Fit,
    *,
    rule: str,
    seed: int,
    max_depth: int,
    delta: float,
    lr: float,
    probe_batch: int = 256,
    base: dict[str, Any] | None = None,
) -> GrowthRun:
    """Train, then diagnose, grow one block, carry the optimizer and retrain until ``rule`` stops; keep the best round.

    Round 0 trains ``model`` with a fresh ``Adam(lr)``; round ``r`` trains with seed ``seed + r``
    (``fit``'s batch order); the new block of round ``r + 1`` is initialised from ``seed + 10000 + r``.

    Args:
        model: an untrained :class:`~depthsat_theory.tasks.models.ResidualMLP` (trained in place in round 0).
        splits: the data (``probe`` diagnoses, ``val`` picks the best round).
        fit: trains a model with a given optimizer and seed and returns its ``metrics``
            (``{"train"|"val"|"test": {"loss", "accuracy"}}``), ``examples_seen`` and ``best_epoch``.
        rule: one of :data:`STOP_RULES`.
        seed: the arm's seed.
        max_depth: stop growing at this many blocks.
        delta: ``δ`` of the intervals.
        lr: the first round's Adam learning rate.
        probe_batch: the diagnosis's batch size.
        base: columns put first in every row (data set, seed, arm).

    Returns:
        A :class:`GrowthRun`.

    Raises:
        ExperimentError: an unknown ``rule``.
    """
    if rule not in STOP_RULES:
        raise ExperimentError(f"stop rule {rule!r}: unknown; valid: {', '.join(STOP_RULES)}")
    base = dict(base or {})
    example = splits.train.x[:1]
    opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    res = fit(model, opt, seed)
    examples, flops = res["examples_seen"], 2 * training_cost(model, example).macs * res["examples_seen"]
    rounds: list[dict[str, Any]] = []
    sites: list[dict[str, Any]] = []
    models: list[nn.Module] = []
    certified_stopped = False
    for rnd in range(max_depth + 1):
        depth = _depth(model)
        diag, eps = _diagnose(model, splits, delta, probe_batch)
        dec = _decision(rule, diag, eps, certified_stopped)
        certified_stopped = certified_stopped or dec["certified_undetermined"]
        at_max = depth >= max_depth and not dec["stop"]
        row = {**base, "round": rnd, "depth": depth}
        rounds.append(
            {
                **row,
                **_loss_columns(res),
                "examples_seen_cumulative": examples,
                "flops_cumulative": flops,
                "epsilon": eps,
                "probe_loss": diag.loss,
                "probe_n": diag.n,
                "alpha": diag.sites[0].result.alpha,
                "n_noise_improvable": sum(sd.verdict == Verdict.IMPROVABLE for sd in diag.sites),
                **{f"stops_{k}": v for k, v in rules_that_stop(diag, eps).items()},
                "decision": "stop" if dec["stop"] or at_max else f"grow after {dec['site']}",
                "rule": dec["rule"],
                "reason": "max_depth reached" if at_max else dec["reason"],
                "ranked_by": dec["ranked_by"],
            }
        )
        sites += _site_rows(diag, row)
        models.append(model.eval())  # never trained again: growth trains a copy (deepen)
        if dec["stop"] or at_max:
            break
        grown = deepen(model, [_site_index(dec["site"])], splits.probe.x, seed=seed + 10_000 + rnd)
        opt = carry_optimizer(opt, model, grown)
        model = grown.model
        res = fit(model, opt, seed + rnd + 1)
        examples += res["examples_seen"]
        flops += 2 * training_cost(model, example).macs * res["examples_seen"]
    best = min(range(len(rounds)), key=lambda i: (rounds[i]["val_loss"], i))
    for i, r in enumerate(rounds):
        r["is_best"] = i == best
    return GrowthRun(rounds, sites, best, models[best], opt, models)


def _loss_columns(res: dict[str, Any]) -> dict[str, Any]:
    m = res["metrics"]
    return {
        "train_loss": m["train"]["loss"],
        "val_loss": m["val"]["loss"],
        "test_loss": m["test"]["loss"],
        "test_accuracy": m["test"]["accuracy"],
        "best_epoch": res.get("best_epoch"),
        "examples_seen_round": res["examples_seen"],
    }


def _site_rows(diag: Diagnosis, base: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for sd in diag.sites:
        iv, r = sd.interval, sd.result
        rows.append(
            {
                **base,
                "site": sd.site,
                "score": r.score,
                "relative_score": r.relative_score,
                "ag_rms": r.ag_rms,
                "ag_max": r.ag_max,
                "score_lower": iv.score_lower if iv else None,
                "score_upper": iv.score_upper if iv else None,
                "score_unbiased": math.sqrt(max(iv.score_squared_unbiased or 0.0, 0.0)) if iv else None,
                "vacuous": iv.vacuous if iv else None,
                "certificate": str(getattr(iv.certificate, "value", iv.certificate)) if iv else None,
                "n_to_certify": iv.n_to_certify if iv else None,
                "noise_verdict": sd.verdict.value,
                "noise_ratio": r.noise_ratio,
                "examples_needed": r.examples_needed,
                "probe_n": diag.n,
            }
        )
    return rows


def _diagnose(model: nn.Module, splits: rc.Splits, delta: float, probe_batch: int = 256) -> tuple[Diagnosis, float]:
    probe_model = copy.deepcopy(model).double().eval()
    head = probe_model.get_submodule("head")
    assert isinstance(head, nn.Linear)
    eps = epsilon_from_nats(DEFAULT_EPSILON_NATS, cross_entropy_smoothness(head.weight))
    diag = diagnose(
        probe_model,
        rc.loss_function(splits),
        rc.probe_batches(splits, probe_batch),
        delta=delta,
        bound_kwargs={"epsilon": eps},
    )
    return diag, eps


def _depth(model: nn.Module) -> int:
    blocks = model.get_submodule("blocks")
    assert isinstance(blocks, nn.ModuleList)
    return len(blocks)


def _site_index(site: str) -> int:
    """``deepen``'s ``after`` index of a site: ``embed`` → −1, ``blocks.i`` → ``i``."""
    return -1 if site == "embed" else int(site.split(".")[1])


def _fit(cfg: dict[str, Any], splits: rc.Splits) -> tuple[Fit, float]:
    """The round's training (early stopping, or one fixed cosine budget) and its first learning rate."""
    if "budget" in cfg:
        budget = rc.BudgetRecipe(**cfg["budget"])

        def fit_budget(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> dict[str, Any]:
            # seed + 1: round 0 is the budget sweep's scratch model of the start depth, batch for batch
            out = rc.train_budget(
                model,
                splits.train.x,
                splits.train.y,
                rc.loss_function(splits),
                seed=seed + 1,
                recipe=budget,
                optimizer=opt,
            )
            metrics = {
                k: rc.evaluate(model, getattr(splits, k), splits, budget.eval_batch_size)
                for k in ("train", "val", "test")
            }
            return {"metrics": metrics, "examples_seen": out["examples_seen"], "best_epoch": None}

        return fit_budget, budget.lr
    recipe = dataclasses.replace(rc.RECIPE, **cfg["recipe"])

    def fit_early(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> dict[str, Any]:
        res = rc.train(model, splits, seed=seed, recipe=recipe, optimizer=opt)
        return {"metrics": res.metrics, "examples_seen": res.examples_seen, "best_epoch": res.best_epoch}

    return fit_early, recipe.lr


def _first_depth(rounds: list[dict[str, Any]], key: str) -> int | None:
    return next((r["depth"] for r in rounds if r[key]), None)


def _one_arm(cfg: dict[str, Any], dataset: str, seed: int, rule: str) -> dict[str, list[dict]]:
    """One arm (stop rule) on one data set and seed: its rounds, sites and stop row."""
    splits = rc.load_splits(dataset, seed, rc.Sizes(**cfg["sizes"].get(dataset, {})))
    model = rc.build_model(cfg["arch"], cfg["start_depth"], splits, seed=seed, width=cfg["width"])
    fit, lr = _fit(cfg, splits)
    run = grow_by_criterion(
        model,
        splits,
        fit,
        rule=rule,
        seed=seed,
        max_depth=cfg["max_depth"],
        delta=cfg["delta"],
        lr=lr,
        probe_batch=cfg.get("probe_batch", 256),
        base={"arm": rule, "dataset": dataset, "seed": seed},
    )
    last, best = run.rounds[-1], run.rounds[run.best_round]
    stop = {
        "arm": rule,
        "dataset": dataset,
        "seed": seed,
        "stop_depth": last["depth"],
        "stop_rule": last["rule"],
        "stop_reason": last["reason"],
        "best_round": run.best_round,
        "best_depth": best["depth"],
        "test_loss": best["test_loss"],
        "val_loss": best["val_loss"],
        "train_loss": best["train_loss"],
        "test_accuracy": best["test_accuracy"],
        "last_test_loss": last["test_loss"],
        **{
            f"first_depth_{k}_stops": _first_depth(run.rounds, f"stops_{k}") for k in ("certified", "fallback", "noise")
        },
        "examples_seen": last["examples_seen_cumulative"],
        "flops": last["flops_cumulative"],
    }
    return {"rounds": run.rounds, "sites": run.sites, "stops": [stop]}


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _sweep_width(folder: Path, ds: str, cfg: dict[str, Any]) -> int:
    """The width of the sweep's curve for ``ds`` (its ``summary.json → meta``), else this experiment's."""
    summary = folder / "summary.json"
    if not summary.is_file():
        return cfg["width"]
    config = json.loads(summary.read_text()).get("meta", {}).get("config", {})
    curves = config.get("curves", [])
    fallback = config.get("width", cfg["width"])
    return next((c["width"] for c in curves if (c.get("dataset"), c.get("arch")) == (ds, cfg["arch"])), fallback)


def _reference_rows(folder: Path, ds: str, cfg: dict[str, Any]) -> list[dict[str, str]]:
    """The reference's ``runs.csv`` rows of ``ds`` (the budget sweep's has one data set and no such columns)."""
    runs = folder / "runs.csv"
    if not runs.is_file():
        return []
    return [r for r in _read_csv(runs) if r.get("dataset", ds) == ds and r.get("arch", cfg["arch"]) == cfg["arch"]]


def _reference(folder: Path, ds: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The scratch reference curve: test loss per depth and seed, its plateau (``sweep.plateau_depth``) and compute.

    The plateau is recomputed from ``runs.csv`` (the mean test loss over seeds per depth), so every
    reading uses the current rule; ``None`` when the curve still falls at its deepest depth.
    """
    from depthsat_theory.experiments.sweep import plateau_depth

    rows = _reference_rows(folder, ds, cfg)
    if not rows:
        return {"reference": f"{folder / 'runs.csv'} not found or without {ds}"}
    per_seed: dict[int, dict[int, float]] = {}
    for r in rows:
        per_seed.setdefault(int(r["seed"]), {})[int(r["depth"])] = float(r["test_loss"])
    depths = sorted({d for c in per_seed.values() for d in c})
    mean = [sum(c[d] for c in per_seed.values() if d in c) / sum(d in c for c in per_seed.values()) for d in depths]
    width = _sweep_width(folder, ds, cfg)
    splits = rc.load_splits(ds, 0, rc.Sizes(**cfg["sizes"].get(ds, {})))
    cost = {
        d: training_cost(rc.build_model(cfg["arch"], d, splits, seed=0, width=width), splits.train.x[:1]).macs
        for d in depths
    }
    seen = {s: [(int(r["depth"]), int(r["examples_seen"])) for r in rows if int(r["seed"]) == s] for s in per_seed}
    plateau = plateau_depth(depths, mean)
    return {
        "reference": str(folder),
        "reference_width": width,
        "reference_depths": depths,
        "reference_test_loss_mean": dict(zip(depths, mean, strict=True)),
        "reference_test_loss_per_seed": per_seed,
        "reference_plateau_depth_test_loss": plateau,
        "reference_depth_pays": _depth_pays(per_seed, depths[0], plateau),
        "reference_examples_seen_per_seed": summarize([sum(e for _, e in v) for v in seen.values()]),
        "reference_flops_per_seed": summarize([sum(2 * cost[d] * e for d, e in v) for v in seen.values()]),
    }


def _depth_pays(per_seed: dict[int, dict[int, float]], first: int, plateau: int | None) -> dict[str, Any]:
    """Whether depth pays on the reference: test loss at its first depth minus at its plateau, paired by seed.

    ``pays`` is true when the Student-t 95 % interval of the paired difference lies above 0 (two seeds or more).
    """
    if plateau is None or plateau == first:
        return {"pays": False, "difference": None}
    diffs = [c[first] - c[plateau] for c in per_seed.values() if first in c and plateau in c]
    iv = summarize(diffs) if diffs else {"n": 0}
    pays = bool(iv["n"] >= 2 and iv["ci_low"] > 0)
    return {"pays": pays, "difference": f"test_loss({first}) - test_loss({plateau})", "per_seed": diffs, **iv}


def _against_reference(st: list[dict[str, Any]], ref: dict[str, Any]) -> dict[str, Any]:
    """The best round's test loss against the reference at its plateau depth, paired by seed (relative)."""
    plateau, per_seed = ref.get("reference_plateau_depth_test_loss"), ref.get("reference_test_loss_per_seed", {})
    if plateau is None:
        return {}
    rel = [
        (s["test_loss"] - per_seed[s["seed"]][plateau]) / per_seed[s["seed"]][plateau]
        for s in st
        if plateau in per_seed.get(s["seed"], {})
    ]
    return {"test_loss_relative_to_reference_plateau": {"per_seed": rel, **summarize(rel)}} if rel else {}


def _own_plateau(rounds: list[dict], ds: str, arm: str) -> dict[str, Any]:
    """The sweep's plateau rule applied to this arm's own test-loss trajectories (per seed; ``None``: not reached)."""
    from depthsat_theory.experiments.sweep import plateau_depth

    per_seed = []
    for seed in sorted({r["seed"] for r in rounds if r["dataset"] == ds and r["arm"] == arm}):
        pts = [r for r in rounds if r["dataset"] == ds and r["arm"] == arm and r["seed"] == seed]
        per_seed.append(plateau_depth([r["depth"] for r in pts], [r["test_loss"] for r in pts]))
    return {"own_plateau_depth_test_loss_per_seed": per_seed}


def _arm_summary(st: list[dict[str, Any]], rounds: list[dict[str, Any]], ds: str, arm: str) -> dict[str, Any]:
    firsts = {k: [s[f"first_depth_{k}_stops"] for s in st] for k in ("certified", "fallback", "noise")}
    return {
        "stop_depth": summarize([s["stop_depth"] for s in st]),
        "stop_depth_per_seed": [s["stop_depth"] for s in st],
        "stop_reasons": sorted({s["stop_reason"] for s in st}),
        "best_round_per_seed": [s["best_round"] for s in st],
        "best_depth": summarize([s["best_depth"] for s in st]),
        "best_depth_per_seed": [s["best_depth"] for s in st],
        "test_loss_best_round": summarize([s["test_loss"] for s in st]),
        "test_loss_last_round": summarize([s["last_test_loss"] for s in st]),
        "first_depth_each_rule_stops_per_seed": firsts,
        "examples_seen": summarize([s["examples_seen"] for s in st]),
        "flops": summarize([s["flops"] for s in st]),
        **_own_plateau(rounds, ds, arm),
    }


def _summary(stops: list[dict], rounds: list[dict], cfg: dict[str, Any], ref_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {
        "epsilon_rule": f"ε = sqrt(2 β ε_J), ε_J = {DEFAULT_EPSILON_NATS} nats (library default), β = ½‖W_head‖² "
        "(head input; not proven at hidden sites)",
        "best_round_rule": "the round with the lowest validation loss (the first on a tie) is the reported model",
        "optimizer": "Adam carried across rounds: old parameters keep exp_avg, exp_avg_sq and step; the new "
        "block's parameters start from zero state (zero_state_param_groups)",
        "reference_folder": str(ref_dir),
    }
    for ds in cfg["datasets"]:
        if not any(s["dataset"] == ds for s in stops):
            continue
        ref = _reference(ref_dir, ds, cfg)
        out[ds] = {"reference": ref}
        for arm in cfg["stop_rules"]:
            st = [s for s in stops if s["dataset"] == ds and s["arm"] == arm]
            if st:
                out[ds][arm] = {**_arm_summary(st, rounds, ds, arm), **_against_reference(st, ref)}
    return out


#: the claim the stop depth reads (summary.json → claims)
CLAIM = "Criterion growth: the stop rule stops where depth stops paying"


def _setting(cfg: dict[str, Any], ds: str, arm: str, st: list[dict[str, Any]], rounds: list[dict[str, Any]]) -> str:
    n = next(r["probe_n"] for r in rounds if r["dataset"] == ds)
    rule = (
        f"noise rule (α = {rounds[0]['alpha']:g}, probe n = {n:,})"
        if arm == "noise"
        else f"certified rule (δ = {cfg['delta']}, probe n = {n:,}) then point-estimate fallback"
    )
    train = (
        f"{cfg['budget']['steps']} Adam steps of {cfg['budget']['batch_size']} per round, cosine"
        if "budget" in cfg
        else "early stopping per round"
    )
    return (
        f"{ds}, residual MLP width {cfg['width']}, grown one block per round from {cfg['start_depth']} to at most "
        f"{cfg['max_depth']}, {rule}, {train}, Adam state carried, {len(st)} seeds; reference: "
        f"the {cfg['reference']}'s scratch curve"
    )


def _claim_row(cfg: dict[str, Any], ds: str, arm: str, st: list[dict], rounds: list[dict], ref: dict) -> dict:
    """One claims row, by a stated rule: within a factor 2 of the reference plateau in every seed → holds."""
    depths = [s["stop_depth"] for s in st]
    iv = summarize(depths)
    plateau = ref.get("reference_plateau_depth_test_loss")
    first = (ref.get("reference_depths") or [None])[0]
    interval = (
        f"stop depth {iv['mean']:.2f} [{iv['ci_low']:.2f}, {iv['ci_high']:.2f}] blocks, Student-t 95 % over "
        f"{len(st)} seeds (per seed {', '.join(map(str, depths))}); reference test-loss plateau {plateau}"
    )
    qualifier = "stopped at the starting depth in every seed" if set(depths) == {cfg["start_depth"]} else ""
    if "reference_depths" not in ref:
        verdict, reason = "untestable here", f"no reference curve ({ref.get('reference')})"
    elif plateau is None:
        verdict = "untestable here"
        reason = "the reference test loss still falls at its deepest depth: no plateau to stop at"
    elif plateau == first:
        verdict = "untestable here"
        reason = f"depth does not pay on the reference curve (its test-loss plateau is its first depth, {first})"
    elif not ref["reference_depth_pays"]["pays"]:
        pays = ref["reference_depth_pays"]
        verdict = "untestable here"
        reason = (
            f"depth is not shown to pay on the reference curve: {pays['difference']} = {pays['mean']:.4g} "
            f"[{pays['ci_low']:.4g}, {pays['ci_high']:.4g}] nats, Student-t 95 % over {pays['n']} seeds"
        )
    else:
        inside = [plateau / 2 <= d <= 2 * plateau for d in depths]
        verdict = "holds" if all(inside) else "fails"
        reason = (
            f"{sum(inside)} of {len(st)} seeds stop within a factor 2 of the reference plateau at {plateau} blocks"
            f" (stop reasons: {'; '.join(sorted({s['stop_reason'] for s in st}))})"
        )
    setting = _setting(cfg, ds, arm, st, rounds)
    return {
        "claim": CLAIM,
        "setting": setting,
        "verdict": verdict,
        "qualifier": qualifier,
        "interval": interval,
        "reason": reason,
    }


def claims(stops: list[dict], rounds: list[dict], cfg: dict[str, Any], summary: dict[str, Any]) -> list[dict]:
    """The claims rows (``summary.json → claims``): one per data set and arm, from the stop depths by a stated rule.

    Rule: *untestable here* when there is no reference curve, when its test loss still falls at its
    deepest depth, when its plateau is its first depth, or when the paired test-loss difference between
    its first depth and its plateau does not lie above 0 (Student-t 95 %: depth is not shown to pay);
    otherwise *holds* when
    every seed's stop depth is within a factor 2 of the reference plateau (one step of a doubling depth
    grid), else *fails*.

    Args:
        stops: ``stops.csv`` rows.
        rounds: ``rounds.csv`` rows.
        cfg: the configuration.
        summary: :func:`_summary`'s output (its ``reference`` per data set).

    Returns:
        Rows with exactly the keys of :data:`~depthsat_theory.experiments.record.CLAIM_KEYS`.
    """
    rows = []
    for ds in cfg["datasets"]:
        for arm in cfg["stop_rules"]:
            st = [s for s in stops if s["dataset"] == ds and s["arm"] == arm]
            if st:
                rows.append(_claim_row(cfg, ds, arm, st, rounds, summary[ds]["reference"]))
    return rows


def _figure(rounds: list[dict], cfg: dict[str, Any], summary: dict[str, Any]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dsets = [d for d in cfg["datasets"] if any(r["dataset"] == d for r in rounds)]
    fig, axes = plt.subplots(1, len(dsets), figsize=(5 * len(dsets), 3.8), squeeze=False)
    styles = {"certified": "o-", "noise": "s--"}
    for j, ds in enumerate(dsets):
        ax = axes[0][j]
        for i, arm in enumerate(cfg["stop_rules"]):
            for seed in cfg["seeds"]:
                pts = [r for r in rounds if r["dataset"] == ds and r["seed"] == seed and r["arm"] == arm]
                if not pts:
                    continue
                line = ax.plot(
                    [r["depth"] for r in pts],
                    [r["test_loss"] for r in pts],
                    styles.get(arm, "o-"),
                    ms=3,
                    color=f"C{i}",
                    alpha=0.6,
                    label=f"{arm} rule" if seed == cfg["seeds"][0] else None,
                )
                best = next(r for r in pts if r["is_best"])
                ax.plot([best["depth"]], [best["test_loss"]], "*", ms=10, color=line[0].get_color())
        ref = summary.get(ds, {}).get("reference", {}).get("reference_test_loss_mean")
        if ref:
            ax.plot(list(ref), list(ref.values()), "k:", lw=1.5, label=f"{cfg['reference']} scratch (mean)")
        ax.set(
            title=f"{ds}: criterion-driven growth (*: best round)",
            xlabel="depth (blocks)",
            ylabel="test loss (nats per example)",
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _resolve(config: str, seeds: Sequence[int] | None, datasets: Sequence[str] | None) -> dict[str, Any]:
    if config not in CONFIGS:
        raise ExperimentError(f"--config {config!r}: unknown; valid: {', '.join(CONFIGS)}")
    cfg = {**CONFIGS[config], "config": config}
    if seeds:
        cfg["seeds"] = [int(s) for s in seeds]
    if datasets:
        bad = [d for d in datasets if d not in rc.DATASETS or d == "kjv"]
        if bad:
            raise ExperimentError(f"--dataset {bad[0]!r}: criterion growth runs on image data sets {rc.DATASETS[:-1]}")
        cfg["datasets"] = list(datasets)
    return cfg


def run_criterion_growth(
    config: str = "full",
    *,
    out: str | Path | None = None,
    seeds: Sequence[int] | None = None,
    datasets: Sequence[str] | None = None,
    sweep: str | Path | None = None,
    resume: str | Path | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Run criterion-driven growth and write ``experiments/results/criterion-growth/`` (or ``out``).

    Args:
        config: ``"tiny"``, ``"full"`` or ``"fashion"`` (:data:`CONFIGS`).
        out: the result folder (default :func:`~.record.default_folder`: ``experiments/results/criterion-growth``
            for ``full``, a new temporary folder otherwise).
        seeds: override the seeds.
        datasets: override the image data sets.
        sweep: the reference's result folder (default ``experiments/results/<reference>``: the depth sweep,
            or the budget sweep for ``fashion``): its ``runs.csv`` (test loss, examples seen per depth and seed)
            and ``summary.json`` (the width of its curves).
        resume: a JSON-lines file of finished arms (one per stop rule, data set and seed), reused and appended to.
        log: called with one line per arm and seed.

    Returns:
        The result folder: ``rounds.csv`` (one row per arm, seed and round), ``sites.csv`` (every site of
        every diagnosis), ``stops.csv`` (one row per arm and seed), ``summary.json`` (with ``claims``),
        ``criterion-growth.png``/``.svg``.

    Raises:
        ExperimentError: a bad configuration.
    """
    started = time.time()
    cfg = _resolve(config, seeds, datasets)
    done = ResumeFile(resume, "finished-arm")
    tag = config_tag(cfg, ("config", "seeds", "datasets"))
    tables: dict[str, list[dict]] = {"rounds": [], "sites": [], "stops": []}
    skipped: dict[str, str] = {}
    for ds in cfg["datasets"]:
        reason = rc.dataset_unavailable(ds)
        if reason:
            skipped[ds] = reason
            continue
        for rule in cfg["stop_rules"]:
            for seed in cfg["seeds"]:
                key = f"{tag}/{rule}/{ds}/{seed}"
                record = done.done.get(key)
                if record is None:
                    record = _one_arm(cfg, ds, seed, rule)
                    done.add(key, record)
                for name, rows in record.items():
                    tables[name] += rows
                st = record["stops"][0]
                log(
                    f"criterion-growth {ds} seed {seed}, {rule} rule: stopped at depth {st['stop_depth']} "
                    f"({st['stop_reason']}); best round {st['best_round']} (depth {st['best_depth']}, "
                    f"test loss {st['test_loss']:.4f})"
                )
    ref_dir = Path(sweep) if sweep is not None else DEFAULT_RESULTS_ROOT / cfg["reference"]
    summary = {**_summary(tables["stops"], tables["rounds"], cfg, ref_dir), "skipped": skipped}
    rows = claims(tables["stops"], tables["rounds"], cfg, summary) if tables["stops"] else []
    target = Path(out) if out is not None else default_folder("criterion-growth", config)
    fig = _figure(tables["rounds"], cfg, summary) if tables["rounds"] else None
    return write_results(
        target,
        tables=tables,
        summary=summary,
        figures={"criterion-growth": fig} if fig is not None else None,
        meta=provenance(seeds=cfg["seeds"], config=cfg, started=started),
        claims=rows,
    )
