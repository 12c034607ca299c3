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

__all__ = ["CONFIGS", "BudgetSweepConfig", "claims", "run_budget_sweep"]


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
        d["model"] = "ResidualMLP (pre-LN GELU blocks, hidden 2*width), build_model('mlp', depth, splits, seed=seed)"
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
    ),
}


# ----------------------------------------------------------------------------
# One model
# ----------------------------------------------------------------------------


def _train(cfg: BudgetSweepConfig, splits: R.Splits, depth: int, seed: int) -> tuple[nn.Module, dict[str, Any]]:
    model = R.build_model("mlp", depth, splits, seed=seed, width=cfg.width)
    fit = R.train_budget(
        model, splits.train.x, splits.train.y, R.loss_function(splits), seed=seed + 1, recipe=cfg.budget
    )
    return model, fit


def _metrics(model: nn.Module, splits: R.Splits) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in ("train", "val", "test"):
        for k, v in R.evaluate(model, getattr(splits, name), splits).items():
            out[f"{name}_{k}"] = v
    return out


def _batches(x: torch.Tensor, y: torch.Tensor, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x = x.double()
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
        "test": _batches(splits.test.x, splits.test.y, cfg.probe_batch),
    }
    cross = crossfit_rows(model, parts, diag["probe"], loss_fn=R.loss_function(splits), step_fraction=cfg.step_fraction)
    key = {"depth": depth, "seed": seed}
    run = {
        **key,
        **_metrics(model, splits),
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


def _growth_record(cfg: BudgetSweepConfig, splits: R.Splits, seed: int, shallow: nn.Module) -> dict:
    """Grow the trained shallow model one-shot to ``growth[1]`` blocks and train it; scratch at examples and FLOPs."""
    from depthsat_theory.experiments.deepen import deepen, interleaved_positions

    assert cfg.growth is not None
    d0, d1 = cfg.growth
    steps = cfg.budget.steps
    ex = cfg.budget.batch_size
    f0 = _flops_per_example(shallow, splits)
    t0 = time.time()
    grown = deepen(shallow, interleaved_positions(d0, d1 - d0), splits.probe.x[:256], seed=seed).model
    deviation = float(
        (grown(splits.probe.x[:256]) - shallow(splits.probe.x[:256])).abs().max().detach()
    )  # the function is preserved (deepen checks it; recorded)
    f1 = _flops_per_example(grown, splits)
    R.train_budget(grown, splits.train.x, splits.train.y, R.loss_function(splits), seed=seed + 2, recipe=cfg.budget)
    grown_flops = float(f0 * steps * ex + f1 * steps * ex)
    rows = [_arm_row("grown", seed, grown, splits, 2 * steps, grown_flops, time.time() - t0)]
    rows[0]["deviation_at_insertion"] = deviation
    # scratch at the grown arm's examples (2 budgets); matched FLOPs would be steps·(f0 + f1)/f1 (in the summary)
    for arm, n_steps in {"scratch_examples": 2 * steps}.items():
        t1 = time.time()
        model = R.build_model("mlp", d1, splits, seed=seed, width=cfg.width)
        R.train_budget(
            model,
            splits.train.x,
            splits.train.y,
            R.loss_function(splits),
            seed=seed + 1,
            recipe=dataclasses.replace(cfg.budget, steps=n_steps),
        )
        rows.append(_arm_row(arm, seed, model, splits, n_steps, float(f1 * n_steps * ex), time.time() - t1))
    return {
        "growth": rows,
        "flops_per_example": {str(d0): f0, str(d1): f1},
        "scratch_steps_at_grown_flops": steps * (f0 + f1) / f1,
    }


# ----------------------------------------------------------------------------
# Resume file
# ----------------------------------------------------------------------------


class _Resume(ResumeFile):
    """Finished models and growth arms, keyed by the configuration's hash (minus name and seeds)."""

    def __init__(self, path: str | Path | None, cfg: BudgetSweepConfig):
        super().__init__(path, "finished-model")
        self.tag = config_tag(cfg.to_dict(), ("name", "seeds", "depths"))

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


def _c2(growth: list[dict[str, Any]], runs: list[dict[str, Any]], d1: int) -> dict[str, Any]:
    scratch1 = {r["seed"]: r for r in runs if r["depth"] == d1}
    arms: dict[int, dict[str, dict[str, Any]]] = {r["seed"]: {} for r in growth}
    for r in growth:
        arms[r["seed"]][r["arm"]] = r
    out: dict[str, Any] = {}
    for ref in ("scratch_budget", "scratch_examples"):
        for metric in ("test_loss", "train_loss"):
            rel = []
            for seed, a in sorted(arms.items()):
                other = scratch1.get(seed) if ref == "scratch_budget" else a.get(ref)
                if "grown" in a and other is not None:
                    rel.append((a["grown"][metric] - other[metric]) / other[metric])
            out[f"{metric}: (grown - {ref}) / {ref}"] = {"per_seed": rel, **_interval(rel)}
    out["verdict"] = _c2_verdict(out["test_loss: (grown - scratch_examples) / scratch_examples"])
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
) -> dict[str, Any]:
    """The readings of the budget sweep: precondition, C1, C3 cross-fitted and C2, with intervals.

    Args:
        runs: ``runs.csv`` rows (one per depth and seed).
        curves_rows: ``curves.csv`` rows (means over seeds per depth).
        crossfit: ``crossfit.csv`` rows.
        growth: ``growth.csv`` rows (C2), or ``None``.
        growth_depth: the grown depth (C2's scratch reference in ``runs``).

    Returns:
        ``{"precondition", "c1", "c3", "c2"}``: every interval is a Student-t 95 % interval over seeds
        (:func:`~depthsat_theory.experiments.record.summarize`); each C1 curve's ``verdict`` is
        ``holds``/``fails``/``untestable here`` with the reason.
    """
    pre = _precondition(runs, curves_rows)
    out: dict[str, Any] = {"precondition": pre, "c1": _c1(curves_rows, pre), "c3": _c3(crossfit)}
    if growth:
        assert growth_depth is not None
        out["c2"] = _c2(growth, runs, growth_depth)
    return out


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
    out: str | Path | None = None,
    seeds: Sequence[int] | None = None,
    resume: str | Path | None = None,
    growth: bool = True,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Run the budget sweep and write its results atomically.

    Args:
        config: ``"tiny"``, ``"full"`` (the keys of ``CONFIGS``) or a :class:`BudgetSweepConfig`.
        out: the result folder (default: ``experiments/results/budget-sweep`` for ``full``, else a
            new temporary folder).
        seeds: seeds (default: the configuration's).
        resume: a JSON-lines file of finished models, reused and appended to.
        growth: run C2's growth arms (when the configuration has ``growth``).
        log: called with one line after each model.

    Returns:
        The result folder.

    Raises:
        ExperimentError: an unknown configuration, no or repeated seeds, growth depths not in the sweep.
        DatasetUnavailable: the data set cannot be read here.
    """
    started = time.time()
    cfg = _resolve(config)
    seeds = tuple(cfg.seeds if seeds is None else seeds)
    if not seeds or len(set(seeds)) != len(seeds):
        raise ExperimentError(f"--seeds: give distinct seeds, got {list(seeds)}")
    if cfg.growth is not None and not set(cfg.growth) <= set(cfg.depths):
        raise ExperimentError(f"growth depths {cfg.growth} must be among the sweep's depths {cfg.depths}")
    cfg = dataclasses.replace(cfg, seeds=seeds)
    done = _Resume(resume, cfg)
    runs: list[dict] = []
    sites: list[dict] = []
    cross: list[dict] = []
    grow: list[dict] = []
    flops: dict[str, Any] = {}
    for seed in seeds:
        splits = R.load_splits(cfg.dataset, seed, cfg.sizes)
        models: dict[int, nn.Module] = {}
        for depth in cfg.depths:
            record = done.done.get(done.key("model", depth, seed))
            if record is None:
                record, models[depth] = _one_model(cfg, splits, depth, seed)
                done.add(done.key("model", depth, seed), record)
            runs.extend(record["runs"])
            sites.extend(record["sites"])
            cross.extend(record["crossfit"])
            if log:
                _log_model(log, record["runs"][0])
        if growth and cfg.growth is not None:
            record = _growth_of_seed(cfg, done, splits, seed, models)
            grow.extend(record["growth"])
            flops = {k: record[k] for k in ("flops_per_example", "scratch_steps_at_grown_flops")}
            if log:
                log(
                    f"seed {seed} growth: "
                    + ", ".join(f"{r['arm']} test {r['test_loss']:.4f}" for r in record["growth"])
                )
    curves_rows = _curves(runs, cross)
    summary = {
        "splits": {"sizes": R.load_splits(cfg.dataset, seeds[0], cfg.sizes).sizes(), "dataset": cfg.dataset},
        "claims": claims(runs, curves_rows, cross, grow or None, cfg.growth[1] if cfg.growth else None),
        "flops": flops,
    }
    folder = Path(out) if out is not None else default_folder("budget-sweep", cfg.name)
    tables = {"runs": runs, "sites": sites, "crossfit": cross, "curves": curves_rows}
    if grow:
        tables["growth"] = grow
    return write_results(
        folder,
        tables=tables,
        summary=summary,
        figures={"budget_sweep": _figure(runs, curves_rows)},
        meta=provenance(seeds=seeds, config=cfg.to_dict(), started=started),
    )


def _growth_of_seed(
    cfg: BudgetSweepConfig, done: _Resume, splits: R.Splits, seed: int, models: dict[int, nn.Module]
) -> dict:
    assert cfg.growth is not None
    key = done.key("growth", cfg.growth[0], seed)
    record = done.done.get(key)
    if record is None:
        shallow = models.get(cfg.growth[0])
        if shallow is None:  # recorded in an earlier process: retrain it (deterministic per seed)
            shallow, _ = _train(cfg, splits, cfg.growth[0], seed)
        record = _growth_record(cfg, splits, seed, shallow)
        done.add(key, record)
    return record


def _log_model(log: Callable[[str], None], r: dict[str, Any]) -> None:
    log(
        f"depth {r['depth']} seed {r['seed']}: train {r['train_loss']:.4f} test {r['test_loss']:.4f} nats, "
        f"deepest site {r['probe_verdict_last']} (s/AG_rms {r['probe_rel_last']:.3g}, "
        f"s_U/AG_rms {r['probe_rel_u_last']:.3g}), {r['model_wall_s']:.1f} s"
    )


def _resolve(config: str | BudgetSweepConfig) -> BudgetSweepConfig:
    if isinstance(config, BudgetSweepConfig):
        return config
    if config not in CONFIGS:
        raise ExperimentError(f"--config {config!r}: choose one of {', '.join(CONFIGS)}")
    return CONFIGS[config]
