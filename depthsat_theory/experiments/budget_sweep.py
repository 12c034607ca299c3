"""Depth sweep on real data at full size with a fixed budget: C1 in both conventions, C3 cross-fitted, C2 paired.

The committed ``sweep`` trains on 800–1,041 examples with early stopping on 200, where depth never
pays.  This experiment trains residual MLPs of several depths on a whole offline data set
(Fashion-MNIST: its 60,000 training images cut into train / validation / probe, its 10,000 test
images as the test set) with one fixed budget (:class:`~depthsat_theory.experiments.recipe.BudgetRecipe`:
Adam, cosine schedule to 0, the same number of steps at every depth), then per model

* **diagnoses** every site (:func:`~depthsat_theory.experiments.sweep.site_rows`, family
  ``linear``) on the held-out probe and on as many training examples: ``AG_max``, ``AG_rms``,
  ``z_rms``, ``s``, ``s/AG_rms``, ``ŝ²_U``, the headline ``s_U`` (``decision.headline``), the
  noise-test verdict and ``examples_needed``; ``AG_max`` also in the batch-mean convention
  (``AG_max / B``, the convention of the paper's ``5·10⁻³``);
* **cross-fits** the steepest inserted-block step at every site (C3,
  :func:`~depthsat_theory.experiments.sweep.crossfit_rows`): fitted on probe half A, measured on
  A (in-sample), on half B and on the test set;
* **grows** (C2, per seed): the trained shallow network (``growth[0]`` blocks) gets zero-output blocks
  interleaved up to ``growth[1]`` (:func:`~depthsat_theory.experiments.deepen.deepen`) and is trained
  for one more budget with a fresh Adam and cosine schedule; it is compared, paired by seed, with
  the ``growth[1]``-block network from scratch at one budget (the sweep's model) and at the grown arm's
  examples (two budgets); the FLOPs of each arm (:func:`~depthsat_theory.experiments.flops.training_cost`)
  and the scratch budget at the grown arm's FLOPs are recorded.

Readings (``summary.json → claims``, :func:`claims`): *precondition* — train loss and test loss fall
from depth 1 to the deepest (paired Student-t 95 % intervals over seeds); *C1* per
activation-gradient curve; *C3* cross-fitted ratio and shrink; *C2* paired relative differences.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from depthsat_theory.experiments import recipe as R
from depthsat_theory.experiments.record import (
    ExperimentError,
    ResumeFile,
    config_tag,
    default_folder,
    metric_curves,
    provenance,
    summarize,
    write_results,
)

__all__ = [
    "CONFIGS",
    "KJV_CONFIGS",
    "BudgetSweepConfig",
    "chain_scratch_steps",
    "chain_seeds",
    "claim_rows",
    "claims",
    "run_budget_sweep",
    "setting",
]


@dataclass(frozen=True)
class BudgetSweepConfig:
    """A size of the budget sweep.

    Attributes:
        name: ``"tiny"`` or ``"full"``.
        dataset: a data set of :data:`~depthsat_theory.experiments.recipe.DATASETS` (images).
        width: the residual MLP's stream width (hidden ``2·width``).
        depths: the depths in blocks.
        seeds: seeds (each: its own cut of the training images, initialisation and batch order).
        sizes: split sizes; ``train=None`` takes every training image the others leave.
        budget: the training recipe (fixed steps, cosine schedule).
        growth: ``(shallow, deep)`` depths of C2's one-shot growth (both in ``depths``), or ``None``.
        chain: depths of C2's staged growth (e.g. ``(2, 4, 8)``: the trained 2-block network grown to
            4, trained one budget, grown to 8, trained one budget; the first in ``depths``; the last
            there too for the one-budget scratch reference), or ``None``.  Left out of the resume key
            (it chooses runs, not how a model is made).
        arch: ``"mlp"`` (images) or ``"gpt"`` (text: :class:`~depthsat_theory.tasks.models.CharGPT`).
        text_block: text only: the character block size over which the four splits are interleaved
            (:func:`~depthsat_theory.experiments.recipe.interleaved_text_windows`); ``None``: the
            contiguous ranges of :func:`~depthsat_theory.experiments.recipe.load_splits`.
        crossfit_test: test examples the cross-fitted step is measured on (the first ones); ``None``:
            the whole test set.  The test metrics always use the whole test set.
        train_eval: training examples the reported train metrics are measured on (the first ones);
            ``None``: the whole train split.
        delta: ``δ`` of the score intervals (union-bounded over each model's sites).
        step_fraction: the steepest insertion step's size as a fraction of the site's ``z_rms``.
        probe_batch: batch size of the diagnosis.
    """

    name: str
    dataset: str
    width: int
    depths: tuple[int, ...]
    seeds: tuple[int, ...]
    sizes: R.Sizes
    budget: R.BudgetRecipe
    growth: tuple[int, int] | None = None
    chain: tuple[int, ...] | None = None
    arch: str = "mlp"
    text_block: int | None = None
    crossfit_test: int | None = None
    train_eval: int | None = None
    delta: float = 0.05
    step_fraction: float = 0.01
    probe_batch: int = 1024

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary.

        Returns:
            Every field (sizes and budget expanded) with the model and family spelled out.
        """
        d = dataclasses.asdict(self)
        d["sizes"] = dataclasses.asdict(self.sizes)
        d["budget"] = self.budget.to_dict()
        if self.arch == "mlp":  # the keys of the runs recorded before the text configuration stay valid
            d.pop("arch")
            d["model"] = (
                "ResidualMLP (pre-LN GELU blocks, hidden 2*width), build_model('mlp', depth, splits, seed=seed)"
            )
        else:
            d["model"] = f"CharGPT (d_model = width, 2 heads), build_model({self.arch!r}, depth, splits, seed=seed)"
        for k in ("text_block", "crossfit_test", "train_eval"):
            if d[k] is None:
                d.pop(k)
        d["family"] = "linear"
        d["training_split_diagnosis"] = "the first n_probe examples of the train split"
        return d


CONFIGS: dict[str, BudgetSweepConfig] = {
    "tiny": BudgetSweepConfig(
        name="tiny",
        dataset="digits",
        width=8,
        depths=(1, 2),
        seeds=(0, 1),
        sizes=R.Sizes(train=None, val=100, probe=256, test=300),
        budget=R.BudgetRecipe(steps=40, batch_size=64),
        growth=(1, 2),
        chain=(1, 2, 4),
        probe_batch=256,
    ),
    "full": BudgetSweepConfig(
        name="full",
        dataset="fashion",
        width=32,
        depths=(1, 2, 4, 8),
        seeds=(0, 1, 2),
        sizes=R.Sizes(train=None, val=4096, probe=8192, test=10000),
        budget=R.BudgetRecipe(steps=2000, batch_size=256),
        growth=(2, 4),
        chain=(2, 4, 8),
    ),
}


#: the text configurations (``--data kjv``): CharGPT on character windows interleaved over the whole KJV
KJV_CONFIGS: dict[str, BudgetSweepConfig] = {
    "tiny": BudgetSweepConfig(
        name="tiny",
        dataset="kjv",
        arch="gpt",
        width=16,
        depths=(1, 2),
        seeds=(0, 1),
        sizes=R.Sizes(train=512, val=64, probe=128, test=128, seq_len=16),
        budget=R.BudgetRecipe(steps=30, batch_size=16),
        text_block=512,
        probe_batch=128,
    ),
    "full": BudgetSweepConfig(
        name="full",
        dataset="kjv",
        arch="gpt",
        width=64,
        depths=(1, 2, 4, 8),
        seeds=(0, 1, 2),
        sizes=R.Sizes(train=32768, val=512, probe=1024, test=10000, seq_len=32),
        budget=R.BudgetRecipe(steps=600, batch_size=32),
        text_block=4096,
        crossfit_test=2048,
        train_eval=4096,
        probe_batch=256,
    ),
}


# ----------------------------------------------------------------------------
# One model
# ----------------------------------------------------------------------------


def _train(cfg: BudgetSweepConfig, splits: R.Splits, depth: int, seed: int) -> tuple[nn.Module, dict[str, Any]]:
    model = R.build_model(cfg.arch, depth, splits, seed=seed, width=cfg.width)
    fit = R.train_budget(
        model, splits.train.x, splits.train.y, R.loss_function(splits), seed=seed + 1, recipe=cfg.budget
    )
    return model, fit


def _metrics(model: nn.Module, splits: R.Splits, n_train: int | None = None) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in ("train", "val", "test"):
        split = getattr(splits, name)
        if name == "train" and n_train is not None:
            split = R.Split(split.x[:n_train], split.y[:n_train])
        for k, v in R.evaluate(model, split, splits).items():
            out[f"{name}_{k}"] = v
    return out


def _batches(x: torch.Tensor, y: torch.Tensor, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x = x.double() if x.is_floating_point() else x
    return [(x[i : i + size], y[i : i + size]) for i in range(0, x.shape[0], size)]


def _one_model(cfg: BudgetSweepConfig, splits: R.Splits, depth: int, seed: int) -> tuple[dict, nn.Module]:
    """Train, diagnose (probe and training split) and cross-fit one model."""
    from depthsat_theory.experiments.sweep import crossfit_rows, site_rows
    from depthsat_theory.experiments.teacher import site_summary

    t0 = time.time()
    model, fit = _train(cfg, splits, depth, seed)
    n = len(splits.probe)
    train_sub = R.Split(splits.train.x[:n], splits.train.y[:n])
    diag: dict[str, list[dict[str, Any]]] = {}
    for split, probe in (("probe", splits.probe), ("train", train_sub)):
        rows = site_rows(model, dataclasses.replace(splits, probe=probe), delta=cfg.delta, probe_batch=cfg.probe_batch)
        diag[split] = [{"split": split, **r} for r in rows]
    half = n // 2
    px, py = splits.probe.x, splits.probe.y
    parts = {
        "a": _batches(px[:half], py[:half], cfg.probe_batch),
        "b": _batches(px[half : 2 * half], py[half : 2 * half], cfg.probe_batch),
        "test": _batches(splits.test.x[: cfg.crossfit_test], splits.test.y[: cfg.crossfit_test], cfg.probe_batch),
    }
    cross = crossfit_rows(model, parts, diag["probe"], loss_fn=R.loss_function(splits), step_fraction=cfg.step_fraction)
    key = {"depth": depth, "seed": seed}
    run = {
        **key,
        **_metrics(model, splits, cfg.train_eval),
        "steps": fit["steps"],
        "examples_seen": fit["examples_seen"],
        "final_running_loss": fit["final_running_loss"],
        "train_wall_s": round(fit["wall_s"], 2),
        **{k: v for tag, rows in diag.items() for k, v in site_summary(rows, tag, cfg.budget.batch_size).items()},
        "model_wall_s": round(time.time() - t0, 2),
    }
    record = {
        "runs": [run],
        "sites": [{**key, **r} for rows in diag.values() for r in rows],
        "crossfit": [{**key, **r} for r in cross],
    }
    return record, model


# ----------------------------------------------------------------------------
# C2: one-shot growth against scratch
# ----------------------------------------------------------------------------


def _flops_per_example(model: nn.Module, splits: R.Splits) -> int:
    from depthsat_theory.experiments.flops import training_cost

    return training_cost(model, splits.train.x[:1]).flops


def _arm_row(arm: str, seed: int, model: nn.Module, splits: R.Splits, steps: int, flops: float, wall: float) -> dict:
    return {
        "seed": seed,
        "arm": arm,
        "depth": len(model.blocks),  # type: ignore[arg-type]
        "steps": steps,
        "flops": flops,
        **_metrics(model, splits),
        "wall_s": round(wall, 2),
    }


def _grow(
    model: nn.Module, depth: int, splits: R.Splits, *, seed: int, train_seed: int, cfg: BudgetSweepConfig
) -> tuple[nn.Module, float]:
    """Interleave zero-output blocks into a trained model up to ``depth`` blocks and train it one budget.

    Returns:
        The grown and trained model, and ``max |f_grown(x) − f(x)|`` on 256 probe inputs at insertion
        (0 for zero-output blocks: ``x + 0 = x`` in floating point).
    """
    from depthsat_theory.experiments.deepen import deepen, interleaved_positions

    d0 = len(model.blocks)  # type: ignore[arg-type]
    probe = splits.probe.x[:256]
    grown = deepen(model, interleaved_positions(d0, depth - d0), probe, seed=seed).model
    with torch.no_grad():
        deviation = float((grown(probe) - model(probe)).abs().max())
    R.train_budget(grown, splits.train.x, splits.train.y, R.loss_function(splits), seed=train_seed, recipe=cfg.budget)
    return grown, deviation


def _scratch_arm(cfg: BudgetSweepConfig, splits: R.Splits, arm: str, depth: int, seed: int, n_steps: int) -> dict:
    """The ``depth``-block network from scratch trained ``n_steps`` on one cosine schedule (seeded as the sweep's)."""
    t1 = time.time()
    model = R.build_model(cfg.arch, depth, splits, seed=seed, width=cfg.width)
    recipe = dataclasses.replace(cfg.budget, steps=n_steps)
    R.train_budget(model, splits.train.x, splits.train.y, R.loss_function(splits), seed=seed + 1, recipe=recipe)
    flops = float(_flops_per_example(model, splits) * n_steps * cfg.budget.batch_size)
    return _arm_row(arm, seed, model, splits, n_steps, flops, time.time() - t1)


def _growth_record(cfg: BudgetSweepConfig, splits: R.Splits, seed: int, shallow: nn.Module) -> dict:
    """Grow the trained shallow model one-shot to ``growth[1]`` blocks and train it; scratch at equal examples."""
    assert cfg.growth is not None
    d0, d1 = cfg.growth
    steps = cfg.budget.steps
    ex = cfg.budget.batch_size
    f0 = _flops_per_example(shallow, splits)
    t0 = time.time()
    grown, deviation = _grow(shallow, d1, splits, seed=seed, train_seed=seed + 2, cfg=cfg)
    f1 = _flops_per_example(grown, splits)
    grown_flops = float(f0 * steps * ex + f1 * steps * ex)
    rows = [_arm_row("grown", seed, grown, splits, 2 * steps, grown_flops, time.time() - t0)]
    rows[0]["deviation_at_insertion"] = deviation
    # scratch at the grown arm's examples (2 budgets); matched FLOPs would be steps·(f0 + f1)/f1 (in the summary)
    rows.append(_scratch_arm(cfg, splits, "scratch_examples", d1, seed, 2 * steps))
    return {
        "growth": rows,
        "flops_per_example": {str(d0): f0, str(d1): f1},
        "scratch_steps_at_grown_flops": steps * (f0 + f1) / f1,
    }


def chain_seeds(seed: int, stage: int) -> tuple[int, int]:
    """Seeds of growth stage ``stage`` (0-based) of the staged growth: new blocks' ``W1`` and batch order.

    Stage 0 uses the one-shot growth's seeds (``seed``, ``seed + 2``), so the staged chain's first
    stage is the one-shot grown model itself, bit for bit at one thread.

    Args:
        seed: the sweep seed.
        stage: the growth stage (0: ``chain[0] → chain[1]``).

    Returns:
        ``(deepen seed, training seed)``.
    """
    return seed + 100 * stage, seed + 2 + stage


def chain_scratch_steps(flops_per_example: Sequence[int], steps: int) -> int:
    """Scratch steps of the deepest network at the staged grown arm's training FLOPs.

    The grown arm trains one budget at each depth of the chain, ``steps·B·Σ_k f_k`` FLOPs; the
    deepest network from scratch costs ``f_last`` per example, so it gets
    ``round(steps·Σ_k f_k / f_last)`` steps of the same batch size.

    Args:
        flops_per_example: training FLOPs per example at each depth of the chain (shallow first).
        steps: the budget in steps.

    Returns:
        The matched-FLOPs step count.
    """
    return round(steps * sum(flops_per_example) / flops_per_example[-1])


def _same_metrics(recorded: dict[str, Any], metrics: dict[str, Any]) -> bool:
    """Whether a retrained model's train/val/test losses and accuracies equal the recorded ones exactly."""
    keys = [f"{p}_{m}" for p in ("train", "val", "test") for m in ("loss", "accuracy")]
    return all(recorded.get(k) == metrics[k] for k in keys)


def _chain_record(
    cfg: BudgetSweepConfig, splits: R.Splits, seed: int, shallow: nn.Module, reference: dict[str, Any]
) -> dict:
    """C2 staged: the trained shallow network grown through ``cfg.chain``, one budget per stage; scratch arms.

    Args:
        cfg: the configuration (``chain`` set).
        splits: the seed's data.
        seed: the seed.
        shallow: the trained ``chain[0]``-block network.
        reference: recorded metrics to compare bitwise: ``"shallow"`` (the sweep's ``runs`` row) and
            ``"grown"`` (the one-shot grown arm, when ``growth == chain[:2]``), each optional.

    Returns:
        ``{"chain": rows, "flops_per_example", "scratch_steps_at_grown_flops"}``: one row per grown
        stage (``grown_<depth>``) and per scratch arm of the deepest depth (``scratch_examples``:
        the grown arm's examples; ``scratch_flops``: its training FLOPs).
    """
    assert cfg.chain is not None
    steps, ex = cfg.budget.steps, cfg.budget.batch_size
    shallow_row = _metrics(shallow, splits)
    f = [_flops_per_example(shallow, splits)]
    rows: list[dict[str, Any]] = []
    model, t0 = shallow, time.time()
    for k, depth in enumerate(cfg.chain[1:]):
        grow_seed, train_seed = chain_seeds(seed, k)
        model, deviation = _grow(model, depth, splits, seed=grow_seed, train_seed=train_seed, cfg=cfg)
        f.append(_flops_per_example(model, splits))
        row = _arm_row(f"grown_{depth}", seed, model, splits, (k + 2) * steps, float(sum(f) * steps * ex), 0.0)
        row["wall_s"] = round(time.time() - t0, 2)
        row["deviation_at_insertion"] = deviation
        rows.append(row)
    first = rows[0]
    first["shallow_reproduces_record"] = (
        _same_metrics(reference["shallow"], shallow_row) if "shallow" in reference else None
    )
    first["reproduces_one_shot"] = _same_metrics(reference["grown"], first) if "grown" in reference else None
    d_last, n_steps = cfg.chain[-1], len(cfg.chain) * steps
    rows.append(_scratch_arm(cfg, splits, "scratch_examples", d_last, seed, n_steps))
    rows.append(_scratch_arm(cfg, splits, "scratch_flops", d_last, seed, chain_scratch_steps(f, steps)))
    return {
        "chain": [{"chain": "-".join(map(str, cfg.chain)), **r} for r in rows],
        "flops_per_example": {str(d): v for d, v in zip(cfg.chain, f, strict=True)},
        "scratch_steps_at_grown_flops": chain_scratch_steps(f, steps),
    }


# ----------------------------------------------------------------------------
# Resume file
# ----------------------------------------------------------------------------


class _Resume(ResumeFile):
    """Finished models and growth arms, keyed by the configuration's hash (minus name and seeds)."""

    def __init__(self, path: str | Path | None, cfg: BudgetSweepConfig):
        super().__init__(path, "finished-model")
        self.tag = config_tag(cfg.to_dict(), ("name", "seeds", "depths", "chain"))

    def key(self, kind: str, depth: int, seed: int) -> str:
        return f"{self.tag}/{kind}/{depth}/{seed}"


# ----------------------------------------------------------------------------
# Readings
# ----------------------------------------------------------------------------

#: per-model metrics summarised over seeds in curves.csv
CURVE_METRICS: tuple[str, ...] = (
    "train_loss",
    "val_loss",
    "test_loss",
    "test_accuracy",
    "probe_ag_max",
    "probe_ag_max_last",
    "probe_ag_max_batchmean",
    "probe_ag_max_last_batchmean",
    "probe_ag_rms_last",
    "probe_ag_max_last_z",
    "probe_ag_rms_last_z",
    "probe_z_rms_last",
    "probe_s_last",
    "probe_s_z_last",
    "probe_rel_last",
    "probe_s2u_last",
    "probe_s_u_last",
    "probe_rel_u_last",
    "probe_rel_chance_last",
    "probe_n_improvable",
    "train_ag_max",
    "train_ag_max_last",
    "train_ag_max_batchmean",
    "train_ag_max_last_batchmean",
    "train_ag_rms_last",
    "train_ag_max_last_z",
    "train_s_last",
    "train_rel_last",
    "train_s2u_last",
    "train_s_u_last",
    "train_rel_u_last",
    "train_n_improvable",
)

#: the activation-gradient curves C1 is read on
C1_CURVES: tuple[str, ...] = (
    "probe_ag_max",
    "probe_ag_max_last",
    "probe_ag_rms_last",
    "probe_ag_max_last_z",
    "probe_ag_rms_last_z",
    "probe_rel_last",
    "probe_s_u_last",
    "probe_rel_u_last",
    "train_ag_max",
    "train_ag_max_last",
    "train_ag_rms_last",
    "train_ag_max_last_z",
    "train_rel_last",
    "train_rel_u_last",
)


def _curves(runs: list[dict[str, Any]], crossfit: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = metric_curves(runs, CURVE_METRICS)
    for depth in sorted({r["depth"] for r in runs}):
        per: dict[str, list[float]] = {}
        for r in _deepest_crossfit(crossfit).values():
            if r["depth"] == depth:
                for k in ("predicted", "measured_a", "measured_b", "measured_test"):
                    per.setdefault(f"crossfit_last_{k}", []).append(r[k])
        for k, vals in per.items():
            rows.append({"metric": k, "depth": depth, **summarize(vals)})
    return rows


def _deepest_crossfit(crossfit: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    """Per (seed, depth): the cross-fit row of the deepest site."""
    last: dict[tuple[int, int], dict[str, Any]] = {}
    for r in crossfit:
        k = (r["seed"], r["depth"])
        if k not in last or r["site_index"] > last[k]["site_index"]:
            last[k] = r
    return last


def _paired(runs: list[dict[str, Any]], metric: str, d_a: int, d_b: int) -> dict[str, Any]:
    """``metric(d_a) − metric(d_b)`` per seed and its interval (Student-t 95 %)."""
    by = {(r["seed"], r["depth"]): r[metric] for r in runs if r.get(metric) is not None}
    seeds = sorted({s for s, _ in by})
    diffs = [by[(s, d_a)] - by[(s, d_b)] for s in seeds if (s, d_a) in by and (s, d_b) in by]
    diffs = [d for d in diffs if math.isfinite(d)]
    return {"difference": f"{metric}({d_a}) - {metric}({d_b})", "per_seed": diffs, **_interval(diffs)}


def _interval(vals: list[float]) -> dict[str, Any]:
    return summarize(vals) if vals else {"n": 0}


def _above_zero(iv: dict[str, Any]) -> bool:
    return bool(iv.get("n", 0) >= 2 and iv["ci_low"] > 0)


def _mean_curve(curves_rows: list[dict[str, Any]], metric: str) -> tuple[list[int], list[float]]:
    pts = sorted((c["depth"], c["mean"]) for c in curves_rows if c["metric"] == metric)
    return [d for d, _ in pts], [v for _, v in pts]


def _precondition(runs: list[dict[str, Any]], curves_rows: list[dict[str, Any]]) -> dict[str, Any]:
    from depthsat_theory.experiments.sweep import plateau_depth

    depths = sorted({r["depth"] for r in runs})
    d0, dn = depths[0], depths[-1]
    depths_t, test = _mean_curve(curves_rows, "test_loss")
    best = depths_t[test.index(min(test))]
    fits = _paired(runs, "train_loss", d0, dn)
    pays = _paired(runs, "test_loss", d0, best)
    return {
        "train_loss_falls_first_to_deepest": fits,
        "deeper_fits_better": _above_zero(fits),
        "train_loss_monotone_in_mean": all(
            a > b
            for a, b in zip(
                _mean_curve(curves_rows, "train_loss")[1], _mean_curve(curves_rows, "train_loss")[1][1:], strict=False
            )
        ),
        "best_test_depth_mean": best,
        "test_loss_first_minus_best": pays,
        "depth_pays": _above_zero(pays),
        "test_loss_plateau_depth": plateau_depth(depths_t, test),
        "holds": _above_zero(fits) and _above_zero(pays) and best != d0,
    }


def _c1_verdict(depths: list[int], vals: list[float], perf: int | None, why_not: str) -> dict[str, Any]:
    """One activation-gradient curve's C1 reading against the test loss's plateau ``perf`` (``None``: not reached)."""
    from depthsat_theory.experiments.sweep import plateau_depth

    plateau = plateau_depth(depths, vals)  # None: still falling at the deepest depth
    falls = vals[-1] < vals[0]
    near = plateau is not None and perf in depths and abs(depths.index(plateau) - depths.index(perf)) <= 1
    if why_not:
        verdict, why = "untestable here", why_not
    elif plateau is None and perf is None:
        verdict, why = "untestable here", "both still improve at the deepest depth run: no plateau to compare"
    elif perf is None:
        verdict, why = "untestable here", "the test loss still improves at the deepest depth run: no plateau"
    elif plateau is None and falls:
        verdict = "fails"
        why = f"still falling at the deepest depth ({depths[-1]}) while the test loss stopped improving at {perf}"
    elif falls and near:
        verdict, why = "holds", f"falls and plateaus at {plateau} (test loss at {perf})"
    else:
        verdict = "fails"
        at = "no depth run (still falling at the deepest)" if plateau is None else plateau
        why = ("does not fall" if not falls else "falls") + f"; plateaus at {at} (test loss at {perf})"
    curve = dict(zip(depths, vals, strict=True))
    return {"curve": curve, "plateau_depth": plateau, "verdict": verdict, "reason": why}


def _c1(curves_rows: list[dict[str, Any]], pre: dict[str, Any]) -> dict[str, Any]:
    perf = pre["test_loss_plateau_depth"]
    why_not = "" if pre["holds"] else "depth does not pay (precondition): no transition to coincide with"
    out: dict[str, Any] = {}
    for metric in C1_CURVES:
        depths, vals = _mean_curve(curves_rows, metric)
        if depths:
            out[metric] = _c1_verdict(depths, vals, perf, why_not)
    for tag in ("probe", "train"):
        for what in ("ag_max_last_batchmean", "ag_max_batchmean"):
            depths, vals = _mean_curve(curves_rows, f"{tag}_{what}")
            below = [d for d, v in zip(depths, vals, strict=True) if v < 5e-3]
            out[f"{tag}_{what}_first_depth_below_5e-3"] = below[0] if below else None
    return out


_PARTS = ("a", "b", "test")


def _median_ratios(rows: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """Median of measured/predicted per part over the rows with a predicted decrease."""
    return {p: _median(sorted(r[f"measured_{p}"] / r["predicted"] for r in rows if r["predicted"] < 0)) for p in _PARTS}


def _c3(crossfit: list[dict[str, Any]]) -> dict[str, Any]:
    last = _deepest_crossfit(crossfit)
    depths = sorted({d for _, d in last})
    rows = [
        {"seed": s, "depth": d, **{f"decrease_{p}": -r[f"measured_{p}"] for p in _PARTS}} for (s, d), r in last.items()
    ]
    per_depth = {
        p: {d: _interval([r[f"decrease_{p}"] for r in rows if r["depth"] == d]) for d in depths} for p in _PARTS
    }
    shrink = {p: _paired(rows, f"decrease_{p}", depths[0], depths[-1]) for p in _PARTS}
    carries = {p: _interval([r[f"decrease_{p}"] for r in rows]) for p in ("b", "test")}
    held = "holds", "fails (the held-out decrease over seeds and depths is not above 0)"
    shrinks = "holds", "fails (interval does not exclude 0 or no shrink)"
    return {
        "median_measured_over_predicted_deepest": _median_ratios(list(last.values())),
        "median_measured_over_predicted_all_sites": _median_ratios(crossfit),
        "deepest_decrease_per_depth": per_depth,
        "deepest_decrease_shrinks_first_to_deepest": shrink,
        "held_out_decrease_over_seeds_and_depths": carries,
        "verdict_first_step_held_out": {p: held[0] if _above_zero(iv) else held[1] for p, iv in carries.items()},
        "verdict_shrinks": {p: shrinks[0] if _above_zero(shrink[p]) else shrinks[1] for p in _PARTS},
    }


def _median(v: list[float]) -> float | None:
    return v[len(v) // 2] if v else None


def _c2(
    growth: list[dict[str, Any]],
    runs: list[dict[str, Any]],
    d1: int,
    grown: str = "grown",
    refs: tuple[str, ...] = ("scratch_budget", "scratch_examples"),
) -> dict[str, Any]:
    """Paired relative differences ``(grown − ref)/ref`` of test and train loss, per seed, with intervals.

    ``scratch_budget`` is the sweep's ``d1``-block model (one budget, ``runs``); the other references
    are arms of ``growth``.  Each interval carries its ``half_width`` and whether it resolves ±10 %
    (half-width below 0.10).
    """
    scratch1 = {r["seed"]: r for r in runs if r["depth"] == d1}
    arms: dict[int, dict[str, dict[str, Any]]] = {r["seed"]: {} for r in growth}
    for r in growth:
        arms[r["seed"]][r["arm"]] = r
    out: dict[str, Any] = {}
    for ref in refs:
        for metric in ("test_loss", "train_loss"):
            rel = []
            for seed, a in sorted(arms.items()):
                other = scratch1.get(seed) if ref == "scratch_budget" else a.get(ref)
                if grown in a and other is not None:
                    rel.append((a[grown][metric] - other[metric]) / other[metric])
            iv = {"per_seed": rel, **_interval(rel)}
            if iv.get("n", 0) >= 2:
                iv["half_width"] = (iv["ci_high"] - iv["ci_low"]) / 2
                iv["resolves_10_percent"] = bool(iv["half_width"] < 0.10)
            out[f"{metric}: ({grown} - {ref}) / {ref}"] = iv
    out["verdict"] = _c2_verdict(out[f"test_loss: ({grown} - scratch_examples) / scratch_examples"])
    out["paper"] = "-11.8 % (grown against scratch, relative test loss)"
    return out


def _c2_verdict(main: dict[str, Any]) -> str:
    """C2's reading of the paired relative test-loss difference at equal examples."""
    if main.get("n", 0) < 2:
        return "untestable here (fewer than 2 seeds)"
    paper = "inside" if main["ci_low"] <= -0.118 <= main["ci_high"] else "outside"
    if main["ci_high"] < 0:
        return (
            f"holds (grown's test loss below scratch's at equal examples; the paper's -11.8 % is {paper} the interval)"
        )
    if main["ci_low"] > 0:
        return "fails (grown's test loss higher than scratch at equal examples)"
    return f"undetermined (the interval contains 0; the paper's -11.8 % is {paper} it)"


def claims(
    runs: list[dict[str, Any]],
    curves_rows: list[dict[str, Any]],
    crossfit: list[dict[str, Any]],
    growth: list[dict[str, Any]] | None = None,
    growth_depth: int | None = None,
    chain: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The readings of the budget sweep: precondition, C1, C3 cross-fitted and C2, with intervals.

    Args:
        runs: ``runs.csv`` rows (one per depth and seed).
        curves_rows: ``curves.csv`` rows (means over seeds per depth).
        crossfit: ``crossfit.csv`` rows.
        growth: ``growth.csv`` rows (C2), or ``None``.
        growth_depth: the grown depth (C2's scratch reference in ``runs``).
        chain: ``growth_chain.csv`` rows (C2 staged), or ``None``; the scratch-at-one-budget reference
            is the sweep's model of the chain's last depth.

    Returns:
        ``{"precondition", "c1", "c3", "c2", "c2_chain"}`` (the last two when their rows are given):
        every interval is a Student-t 95 % interval over seeds
        (:func:`~depthsat_theory.experiments.record.summarize`); each C1 curve's ``verdict`` is
        ``holds``/``fails``/``untestable here`` with the reason.
    """
    pre = _precondition(runs, curves_rows)
    out: dict[str, Any] = {"precondition": pre, "c1": _c1(curves_rows, pre), "c3": _c3(crossfit)}
    if growth:
        assert growth_depth is not None
        out["c2"] = _c2(growth, runs, growth_depth)
    if chain:
        last = max(int(r["depth"]) for r in chain)
        refs = ("scratch_budget", "scratch_examples", "scratch_flops")
        out["c2_chain"] = _c2(chain, runs, last, grown=f"grown_{last}", refs=refs)
    return out


def _tri(iv: dict[str, Any]) -> str:
    """``holds`` (interval above 0), ``fails`` (below 0) or ``untestable here`` (contains 0, or < 2 values)."""
    if iv.get("n", 0) < 2 or not math.isfinite(iv.get("ci_low", math.nan)):
        return "untestable here"
    return "holds" if iv["ci_low"] > 0 else "fails" if iv["ci_high"] < 0 else "untestable here"


def _iv_text(iv: dict[str, Any], what: str, scale: float = 1.0, unit: str = "nats", over: str = "seeds") -> str:
    if iv.get("n", 0) < 2:
        return f"{what}: fewer than 2 {over}"
    m, lo, hi = (scale * iv[k] for k in ("mean", "ci_low", "ci_high"))
    return f"{m:+.3g} {unit} [{lo:+.3g}, {hi:+.3g}] {what}, Student-t 95 % over {iv['n']} {over}"


def _c2_row(c2: dict[str, Any], grown: str, claim: str, setting: str) -> dict[str, str]:
    main = c2[f"test_loss: ({grown} - scratch_examples) / scratch_examples"]
    rule = c2["verdict"].split(" ")[0]
    verdict = {"holds": "holds", "fails": "fails"}.get(rule, "untestable here")
    qualifier = ""
    if verdict == "holds" and "is outside" in c2["verdict"]:
        qualifier = "in direction, not in the paper's size (-11.8 % outside the interval)"
    elif verdict == "untestable here":
        qualifier = "the interval contains 0"
    if main.get("n", 0) >= 2:
        qualifier = ", ".join(
            q
            for q in (
                qualifier,
                f"half-width {100 * main['half_width']:.2g} % "
                + ("<" if main["resolves_10_percent"] else ">=")
                + " 10 %",
            )
            if q
        )
    interval = _iv_text(main, f"test loss ({grown} - scratch)/scratch at equal examples", 100, "%")
    flops = c2.get(f"test_loss: ({grown} - scratch_flops) / scratch_flops")
    if flops is not None and flops.get("n", 0) >= 2:
        # equal examples can reward scratch's overfitting; the matched-FLOPs reference stands beside it
        interval += "; " + _iv_text(flops, "at matched FLOPs", 100, "%")
        if flops["ci_low"] <= 0 <= flops["ci_high"]:
            same = "at matched FLOPs no difference (the interval contains 0)"
            qualifier = f"{qualifier}, {same}" if qualifier else same
    return {
        "claim": claim,
        "setting": setting,
        "verdict": verdict,
        "qualifier": qualifier,
        "interval": interval,
        "reason": c2["verdict"],
    }


def _pays_text(pays: dict[str, Any]) -> str:
    """The precondition's test-loss term; a comparison of the first depth with itself is said in words."""
    first, _, best = str(pays["difference"]).partition(" - ")
    if first == best:
        return f"test loss lowest at the first depth ({first}): depth does not pay on test"
    return _iv_text(pays, f"test loss {pays['difference']}")


def claim_rows(readings: dict[str, Any], setting: str, chain: Sequence[int] | None = None) -> list[dict[str, str]]:
    """The claims rows of the budget sweep (the keys of ``record.CLAIM_KEYS``).

    Rules (from :func:`claims`'s readings):

    * **C1** — the paper's curve, ``AG_max`` over all sites on the held-out probe: its verdict in
      ``c1`` (*untestable here* when depth does not pay); the qualifier counts the other curves.
    * **C2** (one-shot and staged) — :func:`_c2_verdict` on the paired relative test-loss difference
      at equal examples: *holds* (interval below 0), *fails* (above 0), *untestable here* (contains 0).
    * **C3a** — the deepest site's steepest step, fitted on probe half A, decreases the loss on half
      B: interval of the decrease over seeds and depths above 0 → *holds*, below → *fails*, else
      *untestable here*; a *holds* whose median measured/predicted on half B is below 0.5 is qualified
      "in direction, not in size".
    * **C3b** — the cross-fitted decrease (half B) shrinks from the shallowest to the deepest depth:
      the paired interval of ``decrease(first) − decrease(deepest)`` read the same way.

    Args:
        readings: :func:`claims`'s output.
        setting: the setting in words (data, model, depths, budget, seeds).
        chain: the staged growth's depths (its claim name), or ``None``.

    Returns:
        One row per claim read.
    """
    pre, c1, c3 = readings["precondition"], readings["c1"], readings["c3"]
    fits, pays = pre["train_loss_falls_first_to_deepest"], pre["test_loss_first_minus_best"]
    curves = [v for v in c1.values() if isinstance(v, dict)]
    main = c1.get("probe_ag_max", {"verdict": "untestable here", "reason": "no AG_max curve"})
    n_hold = sum(v["verdict"] == "holds" for v in curves)
    rows = [
        {
            "claim": "C1",
            "setting": setting,
            "verdict": main["verdict"],
            "qualifier": f"{n_hold} of {len(curves)} activation-gradient curves hold",
            "interval": _iv_text(fits, f"train loss {fits['difference']}") + "; " + _pays_text(pays),
            "reason": "AG_max (all sites, probe): " + main["reason"],
        }
    ]
    if "c2" in readings:
        rows.append(_c2_row(readings["c2"], "grown", "C2", setting + ", one-shot growth"))
    if "c2_chain" in readings and chain:
        label = " -> ".join(map(str, chain))
        rows.append(_c2_row(readings["c2_chain"], f"grown_{chain[-1]}", "C2", f"{setting}, staged growth {label}"))
    held = c3["held_out_decrease_over_seeds_and_depths"]["b"]
    on_test = c3["held_out_decrease_over_seeds_and_depths"]["test"]
    ratio = c3["median_measured_over_predicted_deepest"]
    shrink = c3["deepest_decrease_shrinks_first_to_deepest"]["b"]
    qualifier = (
        f"median measured/predicted {ratio['b']:.2g} on half B, {ratio['test']:.2g} on the test set"
        if ratio["b"] is not None and ratio["test"] is not None
        else ""
    )
    if _tri(held) == "holds" and ratio["b"] is not None and ratio["b"] < 0.5:
        # the step decreases the held-out loss, but by less than half of what it predicts
        qualifier = f"in direction, not in size ({qualifier})"
    rows.append(
        {
            "claim": "C3a",
            "setting": setting,
            "verdict": _tri(held),
            "qualifier": qualifier,
            "interval": _iv_text(
                held, "held-out decrease (probe half B) of the deepest site's step", over="(seed, depth) pairs"
            )
            + "; "
            + _iv_text(on_test, "on the test set", over="(seed, depth) pairs"),
            "reason": "the step fitted on probe half A "
            + {"holds": "decreases", "fails": "increases", "untestable here": "does not resolve"}[_tri(held)]
            + " the loss on half B over seeds and depths",
        }
    )
    rows.append(
        {
            "claim": "C3b",
            "setting": setting,
            "verdict": _tri(shrink),
            "qualifier": "the interval contains 0" if _tri(shrink) == "untestable here" else "",
            "interval": _iv_text(shrink, shrink["difference"]),
            "reason": "the cross-fitted decrease at the deepest site "
            + {"holds": "shrinks", "fails": "grows", "untestable here": "does not resolve a change"}[_tri(shrink)]
            + " from the shallowest to the deepest network",
        }
    )
    return rows


# ----------------------------------------------------------------------------
# Figure
# ----------------------------------------------------------------------------


def _figure(runs: list[dict[str, Any]], curves_rows: list[dict[str, Any]]):
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for seed in sorted({r["seed"] for r in runs}):
        mine = sorted((r for r in runs if r["seed"] == seed), key=lambda r: r["depth"])
        d = [r["depth"] for r in mine]
        axes[0].plot(d, [r["train_loss"] for r in mine], "o--", ms=3, label=f"train, seed {seed}")
        axes[0].plot(d, [r["test_loss"] for r in mine], "s-", ms=3, label=f"test, seed {seed}")
    axes[0].set_ylabel("loss (nats per example)")
    panels = [
        (("probe_ag_max_last", "probe_ag_max_last_z", "probe_ag_rms_last"), "deepest site, probe", True),
        (("probe_rel_last", "probe_rel_u_last", "probe_rel_chance_last", "train_rel_u_last"), "s/AG_rms", False),
    ]
    for ax, (metrics, label, log) in zip(axes[1:], panels, strict=True):
        for metric in metrics:
            depths, vals = _mean_curve(curves_rows, metric)
            if depths:
                ax.plot(depths, vals, "o-", ms=3, label=metric)
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("depth (blocks)")
        ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------
# The experiment
# ----------------------------------------------------------------------------


def run_budget_sweep(
    config: str | BudgetSweepConfig = "tiny",
    *,
    data: str = "fashion",
    out: str | Path | None = None,
    seeds: Sequence[int] | None = None,
    resume: str | Path | None = None,
    growth: bool = True,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Run the budget sweep and write its results atomically.

    Args:
        config: ``"tiny"``, ``"full"`` (the keys of ``CONFIGS`` / ``KJV_CONFIGS``) or a
            :class:`BudgetSweepConfig`.
        data: ``"fashion"`` (``CONFIGS``, residual MLPs on images) or ``"kjv"`` (``KJV_CONFIGS``,
            CharGPT on the King James text); ignored when ``config`` is a configuration.
        out: the result folder (default: ``experiments/results/budget-sweep`` (``-kjv``) for ``full``,
            else a new temporary folder).
        seeds: seeds (default: the configuration's).
        resume: a JSON-lines file of finished models, reused and appended to.
        growth: run C2's growth arms, one-shot and staged (when the configuration has them).
        log: called with one line after each model.

    Returns:
        The result folder.

    Raises:
        ExperimentError: an unknown data set or configuration, no or repeated seeds, growth depths not
            in the sweep.
        DatasetUnavailable: the data set cannot be read here.
    """
    started = time.time()
    cfg = _checked(_resolve(config, data), seeds)
    seeds = cfg.seeds
    done = _Resume(resume, cfg)
    tables: dict[str, list[dict]] = {k: [] for k in ("runs", "sites", "crossfit", "growth", "growth_chain")}
    flops: dict[str, Any] = {}
    for seed in seeds:
        for key, record in _seed_records(cfg, done, seed, growth, log).items():
            _collect(tables, flops, key, record)
    runs = tables["runs"]
    curves_rows = _curves(runs, tables["crossfit"])
    readings = claims(
        runs,
        curves_rows,
        tables["crossfit"],
        tables["growth"] or None,
        cfg.growth[1] if cfg.growth else None,
        tables["growth_chain"] or None,
    )
    splits = _load(cfg, seeds[0])
    summary = {
        "splits": {"sizes": splits.sizes(), "dataset": cfg.dataset, "source": splits.source},
        "claims": readings,
        "flops": flops.get("growth", {}),
        "flops_chain": flops.get("chain", {}),
        "wall_s_models": round(sum(r["model_wall_s"] for r in runs), 1),
    }
    rows = claim_rows(readings, setting(cfg), cfg.chain if tables["growth_chain"] else None)
    folder = Path(out) if out is not None else default_folder(_FOLDERS[cfg.dataset], cfg.name)
    tables["curves"] = curves_rows
    return write_results(
        folder,
        tables={k: v for k, v in tables.items() if v},
        summary=summary,
        claims=rows,
        figures={"budget_sweep": _figure(runs, curves_rows)},
        meta=provenance(seeds=seeds, config=cfg.to_dict(), started=started),
    )


def _checked(cfg: BudgetSweepConfig, seeds: Sequence[int] | None) -> BudgetSweepConfig:
    """The configuration with its seeds, checked (distinct seeds; growth depths among the sweep's)."""
    seeds = tuple(cfg.seeds if seeds is None else seeds)
    if not seeds or len(set(seeds)) != len(seeds):
        raise ExperimentError(f"--seeds: give distinct seeds, got {list(seeds)}")
    for what, depths in (("growth", cfg.growth), ("chain", cfg.chain and cfg.chain[:1])):
        if depths is not None and not set(depths) <= set(cfg.depths):
            raise ExperimentError(f"{what} depths {depths} must be among the sweep's depths {cfg.depths}")
    return dataclasses.replace(cfg, seeds=seeds)


def _collect(tables: dict[str, list[dict]], flops: dict[str, Any], key: str, record: dict) -> None:
    """Add one record of :func:`_seed_records` to the tables (and its FLOPs to ``flops``)."""
    if key in ("growth", "chain"):
        tables["growth" if key == "growth" else "growth_chain"].extend(record[key])
        flops[key] = {k: record[k] for k in ("flops_per_example", "scratch_steps_at_grown_flops")}
        return
    for name in ("runs", "sites", "crossfit"):
        tables[name].extend(record[name])


#: the committed result folder of each data set's ``full`` configuration
_FOLDERS = {"fashion": "budget-sweep", "kjv": "budget-sweep-kjv", "digits": "budget-sweep"}


def setting(cfg: BudgetSweepConfig) -> str:
    """The claims rows' ``setting``: data, model, depths, budget and seeds in words.

    Args:
        cfg: the configuration.

    Returns:
        One line, e.g. ``"fashion, residual MLP width 32, depths 1,2,4,8, 2000 Adam steps x 256, cosine, 3 seeds"``.
    """
    model = "CharGPT" if cfg.arch == "gpt" else "residual MLP"
    b = cfg.budget
    return (
        f"{cfg.dataset} (train {cfg.sizes.train or 'all'}, test {cfg.sizes.test}), {model} width {cfg.width}, "
        f"depths {','.join(map(str, cfg.depths))}, fixed budget {b.steps} Adam steps x {b.batch_size} (cosine), "
        f"{len(cfg.seeds)} seeds"
    )


def _load(cfg: BudgetSweepConfig, seed: int) -> R.Splits:
    if cfg.text_block is None:
        return R.load_splits(cfg.dataset, seed, cfg.sizes)
    return R.load_splits(cfg.dataset, seed, cfg.sizes, text_block=cfg.text_block)


def _seed_records(
    cfg: BudgetSweepConfig, done: _Resume, seed: int, growth: bool, log: Callable[[str], None] | None
) -> dict[str, dict]:
    """One seed's records: every depth's model, then (``growth``) the one-shot and the staged growth."""
    splits = _load(cfg, seed)
    models: dict[int, nn.Module] = {}
    out: dict[str, dict] = {}
    for depth in cfg.depths:
        record = done.done.get(done.key("model", depth, seed))
        if record is None:
            record, models[depth] = _one_model(cfg, splits, depth, seed)
            done.add(done.key("model", depth, seed), record)
        out[f"model/{depth}"] = record
        if log:
            _log_model(log, record["runs"][0])
    if not growth:
        return out
    if cfg.growth is not None:
        out["growth"] = _growth_of_seed(cfg, done, splits, seed, models)
        if log:
            log(
                f"seed {seed} growth: "
                + ", ".join(f"{r['arm']} test {r['test_loss']:.4f}" for r in out["growth"]["growth"])
            )
    if cfg.chain is not None:
        out["chain"] = _chain_of_seed(cfg, done, splits, seed, models, out)
        if log:
            log(
                f"seed {seed} chain: "
                + ", ".join(f"{r['arm']} test {r['test_loss']:.4f}" for r in out["chain"]["chain"])
            )
    return out


def _shallow(
    cfg: BudgetSweepConfig, splits: R.Splits, depth: int, seed: int, models: dict[int, nn.Module]
) -> nn.Module:
    """The trained ``depth``-block model of this seed: this process's, or retrained (deterministic per seed)."""
    if depth not in models:  # recorded in an earlier process
        models[depth], _ = _train(cfg, splits, depth, seed)
    return models[depth]


def _growth_of_seed(
    cfg: BudgetSweepConfig, done: _Resume, splits: R.Splits, seed: int, models: dict[int, nn.Module]
) -> dict:
    assert cfg.growth is not None
    key = done.key("growth", cfg.growth[0], seed)
    record = done.done.get(key)
    if record is None:
        record = _growth_record(cfg, splits, seed, _shallow(cfg, splits, cfg.growth[0], seed, models))
        done.add(key, record)
    return record


def _chain_of_seed(
    cfg: BudgetSweepConfig, done: _Resume, splits: R.Splits, seed: int, models: dict[int, nn.Module], out: dict
) -> dict:
    assert cfg.chain is not None
    key = done.key("chain-" + "-".join(map(str, cfg.chain)), cfg.chain[0], seed)
    record = done.done.get(key)
    if record is None:
        reference = {"shallow": out[f"model/{cfg.chain[0]}"]["runs"][0]}
        if cfg.growth == cfg.chain[:2] and "growth" in out:
            reference["grown"] = next(r for r in out["growth"]["growth"] if r["arm"] == "grown")
        shallow = _shallow(cfg, splits, cfg.chain[0], seed, models)
        record = _chain_record(cfg, splits, seed, shallow, reference)
        done.add(key, record)
    return record


def _log_model(log: Callable[[str], None], r: dict[str, Any]) -> None:
    log(
        f"depth {r['depth']} seed {r['seed']}: train {r['train_loss']:.4f} test {r['test_loss']:.4f} nats, "
        f"deepest site {r['probe_verdict_last']} (s/AG_rms {r['probe_rel_last']:.3g}, "
        f"s_U/AG_rms {r['probe_rel_u_last']:.3g}), {r['model_wall_s']:.1f} s"
    )


def _resolve(config: str | BudgetSweepConfig, data: str = "fashion") -> BudgetSweepConfig:
    if isinstance(config, BudgetSweepConfig):
        return config
    table = {"fashion": CONFIGS, "kjv": KJV_CONFIGS}.get(data)
    if table is None:
        raise ExperimentError(f"--data {data!r}: choose one of fashion, kjv")
    if config not in table:
        raise ExperimentError(f"--config {config!r}: choose one of {', '.join(table)}")
    return table[config]
