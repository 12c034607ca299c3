r"""Growth against scratch (the paper's claim C2).

For each data set and seed:

1. **shallow**: a residual MLP of ``shallow_depth`` blocks trained with the fixed recipe
   (:data:`~depthsat_theory.experiments.recipe.RECIPE`, early stopping on ``val``) until it stops:
   a converged shallow network, ``E₀`` examples seen;
2. **grown**: ``deep_depth − shallow_depth`` zero-output :class:`~depthsat_theory.tasks.models.MLPBlock` s
   inserted evenly (:func:`~depthsat_theory.experiments.deepen.deepen`; function preservation
   checked), then trained ``grow_epochs`` more epochs (``E₁`` examples) with the same recipe
   (fresh Adam), the best-``val`` epoch kept;
3. **scratch**: the same final architecture built from scratch and trained for exactly
   ``E₀ + E₁`` examples with the same recipe, the best-``val`` epoch kept.

Both arms see the same number of training examples (per seed); their compute differs, and is
stated in FLOPs (:mod:`.flops`: dense multiply-adds per example per forward + backward, times the
examples, times 2).  Reported per arm: training loss, test loss, test accuracy (mean ± std over
seeds), and the relative test-loss difference ``(grown − scratch)/scratch`` per seed with a Student-t
confidence interval (paired by seed), next to the paper's −11.8 %.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from depthsat_theory.experiments import recipe as rc
from depthsat_theory.experiments.deepen import deepen, interleaved_positions
from depthsat_theory.experiments.flops import training_cost
from depthsat_theory.experiments.record import (
    ExperimentError,
    default_folder,
    provenance,
    summarize,
    write_results,
)

__all__ = ["CONFIGS", "PAPER_RELATIVE_TEST_LOSS", "paired_relative_difference", "run_growth"]

#: The paper's average relative test-loss difference of grown against scratch, about 11.8 % lower (C2).
PAPER_RELATIVE_TEST_LOSS = -0.118


def sweep_sizes(datasets: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The depth sweep's full split sizes of ``datasets`` (``experiments/sweep.py``), so the numbers compare."""
    from depthsat_theory.experiments.sweep import CONFIGS as SWEEP

    return {d: dataclasses.asdict(SWEEP["full"].sizes[d]) for d in datasets if d in SWEEP["full"].sizes}


#: ``tiny`` runs in CI in seconds; ``full`` is the committed configuration (see experiments/README.md).
CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": {
        "datasets": ["digits"],
        "arch": "mlp",
        "width": 8,
        "shallow_depth": 1,
        "deep_depth": 2,
        "grow_epochs": 2,
        "seeds": [0, 1, 2],
        "recipe": {"max_epochs": 3, "patience": 1},
        "sizes": {"digits": {"train": 300, "val": 100, "probe": 50, "test": 200}},
    },
    "full": {
        "datasets": ["digits", "mnist5k"],
        "arch": "mlp",
        "width": 32,
        "shallow_depth": 2,
        "deep_depth": 8,
        "grow_epochs": 15,  # a fixed budget for the grown model (the scratch arm gets the same examples)
        "seeds": list(range(12)),
        # the shared recipe as the depth sweep runs it, and its split sizes (experiments/sweep.py)
        "recipe": {},
        "sizes": sweep_sizes(["digits", "mnist5k"]),
    },
}


def paired_relative_difference(
    treated: Sequence[float], control: Sequence[float], *, confidence: float = 0.95
) -> dict[str, Any]:
    """Per-seed relative differences ``(treated − control)/control`` and their t interval.

    Args:
        treated: one value per seed (e.g. the grown arm's test loss, nats per example).
        control: the same seeds' values of the other arm, in the same order (positive).
        confidence: coverage of the Student-t interval of the mean relative difference.

    Returns:
        ``{"per_seed": [...], "mean", "std", "n", "ci_low", "ci_high"}`` (fractions: −0.118 is 11.8 % lower).

    Raises:
        ExperimentError: lengths differ, a control value is not positive, or a value is not finite.
    """
    if len(treated) != len(control):
        raise ExperimentError(f"paired difference: {len(treated)} treated values against {len(control)} controls")
    if any(not c > 0 for c in control):
        raise ExperimentError(f"paired difference: control values must be positive, got {list(control)}")
    rel = [(float(t) - float(c)) / float(c) for t, c in zip(treated, control, strict=True)]
    return {"per_seed": rel, **summarize(rel, confidence=confidence)}


def _config(name: str, seeds: Sequence[int] | None, datasets: Sequence[str] | None) -> dict[str, Any]:
    if name not in CONFIGS:
        raise ExperimentError(f"--config {name!r}: unknown; valid: {', '.join(CONFIGS)}")
    cfg = {**CONFIGS[name], "config": name}
    if seeds:
        cfg["seeds"] = [int(s) for s in seeds]
    if datasets:
        bad = [d for d in datasets if d not in rc.DATASETS or d == "kjv"]
        if bad:
            raise ExperimentError(f"--dataset {bad[0]!r}: growth runs on image data sets {rc.DATASETS[:-1]}")
        cfg["datasets"] = list(datasets)
    if len(cfg["seeds"]) < 2:
        raise ExperimentError("--seeds: give at least 2 seeds (a paired interval needs them)")
    if not 1 <= cfg["shallow_depth"] < cfg["deep_depth"]:
        raise ExperimentError("shallow_depth must be >= 1 and below deep_depth")
    return cfg


def _metrics_row(arm: str, res: Any) -> dict[str, float]:
    m = res.metrics
    return {
        "arm": arm,
        "train_loss": m["train"]["loss"],
        "val_loss": m["val"]["loss"],
        "test_loss": m["test"]["loss"],
        "test_accuracy": m["test"]["accuracy"],
    }


def _one_seed(cfg: dict[str, Any], dataset: str, seed: int) -> tuple[list[dict], list[dict]]:
    """The three runs (shallow, grown, scratch) of one data set and seed: result rows, curve rows."""
    recipe = dataclasses.replace(rc.RECIPE, **cfg["recipe"])
    splits = rc.load_splits(dataset, seed, rc.Sizes(**cfg["sizes"].get(dataset, {})))
    d0, d1, width = cfg["shallow_depth"], cfg["deep_depth"], cfg["width"]
    n_train = len(splits.train)
    example = splits.train.x[:1]

    shallow = rc.build_model(cfg["arch"], d0, splits, seed=seed, width=width)
    cost0 = training_cost(shallow, example).macs
    r0 = rc.train(shallow, splits, seed=seed, recipe=recipe)
    grown = deepen(r0.model, interleaved_positions(d0, d1 - d0), splits.probe.x, seed=seed + 10_000)
    cost1 = training_cost(grown.model, example).macs
    fixed = dataclasses.replace(recipe, max_epochs=cfg["grow_epochs"], patience=cfg["grow_epochs"])
    r1 = rc.train(grown.model, splits, seed=seed + 1, recipe=fixed)
    budget = r0.examples_seen + r1.examples_seen
    epochs = budget // n_train
    scratch = rc.build_model(cfg["arch"], d1, splits, seed=seed, width=width)
    r2 = rc.train(scratch, splits, seed=seed, recipe=dataclasses.replace(recipe, max_epochs=epochs, patience=epochs))
    if r2.examples_seen != budget or training_cost(scratch, example).macs != cost1:
        raise ExperimentError(
            f"{dataset} seed {seed}: the scratch arm's budget or architecture differs from the grown arm's"
        )

    base = {"dataset": dataset, "seed": seed, "shallow_depth": d0, "deep_depth": d1, "n_train": n_train}
    rows = [
        {
            **base,
            **_metrics_row("shallow", r0),
            "examples_seen": r0.examples_seen,
            "flops": 2 * cost0 * r0.examples_seen,
            "epochs": r0.epochs,
            "best_epoch": r0.best_epoch,
        },
        {
            **base,
            **_metrics_row("grown", r1),
            "examples_seen": budget,
            "flops": 2 * (cost0 * r0.examples_seen + cost1 * r1.examples_seen),
            "epochs": r0.epochs + r1.epochs,
            "best_epoch": r0.epochs + r1.best_epoch,
            "growth_deviation": grown.deviation,
            "growth_tolerance": grown.tolerance,
            "inserted_at": " ".join(map(str, grown.positions)),
        },
        {
            **base,
            **_metrics_row("scratch", r2),
            "examples_seen": r2.examples_seen,
            "flops": 2 * cost1 * r2.examples_seen,
            "epochs": r2.epochs,
            "best_epoch": r2.best_epoch,
        },
    ]
    curves = [
        {
            **base,
            "arm": arm,
            "examples_seen": (h["epoch"] + offset) * n_train,
            "val_loss": h["val_loss"],
            "train_loss_running": h["train_loss"],
        }
        for arm, hist, offset in (
            ("grown", r0.history, 0),
            ("grown", r1.history, r0.epochs),
            ("scratch", r2.history, 0),
        )
        for h in hist
    ]
    return rows, curves


def _summary(rows: list[dict], cfg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for ds in cfg["datasets"]:
        by = {
            arm: sorted((r for r in rows if r["dataset"] == ds and r["arm"] == arm), key=lambda r: r["seed"])
            for arm in ("shallow", "grown", "scratch")
        }
        if not by["grown"]:
            continue
        arms = {
            arm: {k: summarize([r[k] for r in rs]) for k in ("train_loss", "test_loss", "test_accuracy", "flops")}
            for arm, rs in by.items()
        }
        g, s = by["grown"], by["scratch"]
        rel_test = paired_relative_difference([r["test_loss"] for r in g], [r["test_loss"] for r in s])
        rel_train = paired_relative_difference([r["train_loss"] for r in g], [r["train_loss"] for r in s])
        out[ds] = {
            "arms": arms,
            "relative_test_loss_grown_vs_scratch": rel_test,
            "relative_train_loss_grown_vs_scratch": rel_train,
            "paper_relative_test_loss": PAPER_RELATIVE_TEST_LOSS,
            "examples_seen_equal": all(a["examples_seen"] == b["examples_seen"] for a, b in zip(g, s, strict=True)),
            "flops_ratio_grown_over_scratch": summarize([a["flops"] / b["flops"] for a, b in zip(g, s, strict=True)]),
            "max_growth_deviation": max(r["growth_deviation"] for r in g),
        }
    return out


_COLORS = {"grown": "tab:blue", "scratch": "tab:orange"}


def _curves_panel(ax, curves: list[dict], ds: str, seeds: list[int]) -> None:
    """Validation loss against examples seen, one line per arm and seed."""
    for arm, col in _COLORS.items():
        for seed in seeds:
            pts = [c for c in curves if c["dataset"] == ds and c["arm"] == arm and c["seed"] == seed]
            xs, ys = [c["examples_seen"] for c in pts], [c["val_loss"] for c in pts]
            ax.plot(xs, ys, color=col, alpha=0.5, lw=1, label=arm if seed == seeds[0] else None)
    ax.set(title=f"{ds}: validation loss", xlabel="training examples seen", ylabel="nats per example", yscale="log")
    ax.legend()


def _pairs_panel(ax, rows: list[dict], ds: str, cfg: dict[str, Any]) -> None:
    """Test loss of each arm, the two arms of one seed joined by a line."""
    by = {(r["arm"], r["seed"]): r["test_loss"] for r in rows if r["dataset"] == ds}
    for k, arm in enumerate(("grown", "scratch")):
        ys = [by[(arm, seed)] for seed in cfg["seeds"] if (arm, seed) in by]
        ax.scatter([k] * len(ys), ys, color=_COLORS[arm], alpha=0.7)
    for seed in cfg["seeds"]:
        if ("grown", seed) in by and ("scratch", seed) in by:
            ax.plot([0, 1], [by[("grown", seed)], by[("scratch", seed)]], color="grey", lw=0.8)
    ax.set(
        xticks=[0, 1],
        xticklabels=["grown", "scratch"],
        ylabel="test loss (nats per example)",
        title=f"{ds}: depth {cfg['shallow_depth']}→{cfg['deep_depth']}, same examples seen",
    )


def _figure(rows: list[dict], curves: list[dict], cfg: dict[str, Any]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dsets = [d for d in cfg["datasets"] if any(r["dataset"] == d for r in rows)]
    fig, axes = plt.subplots(2, len(dsets), figsize=(5 * len(dsets), 7), squeeze=False)
    for j, ds in enumerate(dsets):
        _curves_panel(axes[0][j], curves, ds, cfg["seeds"])
        _pairs_panel(axes[1][j], rows, ds, cfg)
    fig.tight_layout()
    return fig


def run_growth(
    config: str = "full",
    *,
    out: str | Path | None = None,
    seeds: Sequence[int] | None = None,
    datasets: Sequence[str] | None = None,
    log=print,
) -> Path:
    """Run growth against scratch and write ``experiments/results/growth/`` (or ``out``).

    Args:
        config: ``"tiny"`` or ``"full"`` (:data:`CONFIGS`).
        out: the result folder (default :func:`~.record.default_folder`: ``experiments/results/growth``
            for ``full``, a new temporary folder otherwise).
        seeds: override the configuration's seeds (at least 2).
        datasets: override its data sets (image data sets of :data:`~.recipe.DATASETS`).
        log: called with one line per finished run.

    Returns:
        The result folder: ``runs.csv`` (one row per data set, seed and arm: shallow, grown,
        scratch), ``curves.csv`` (validation loss against examples seen), ``summary.json``,
        ``growth.png``/``.svg``.

    Raises:
        ExperimentError: a bad configuration, or arms whose budgets differ.
        NotFunctionPreservingError: a growth that moved the network's outputs.
    """
    started = time.time()
    cfg = _config(config, seeds, datasets)
    rows: list[dict] = []
    curves: list[dict] = []
    skipped: dict[str, str] = {}
    for ds in cfg["datasets"]:
        reason = rc.dataset_unavailable(ds)
        if reason:
            skipped[ds] = reason
            log(f"growth: skipping {ds}: {reason}")
            continue
        for seed in cfg["seeds"]:
            r, c = _one_seed(cfg, ds, seed)
            rows += r
            curves += c
            g, s = r[1], r[2]
            log(
                f"growth {ds} seed {seed}: test loss grown {g['test_loss']:.4f} scratch {s['test_loss']:.4f} "
                f"({g['examples_seen']} examples each)"
            )
    summary = {
        "results": _summary(rows, cfg),
        "skipped": skipped,
        "recipe": dataclasses.replace(rc.RECIPE, **cfg["recipe"]).to_dict(),
    }
    target = Path(out) if out is not None else default_folder("growth", cfg["config"])
    fig = _figure(rows, curves, cfg) if rows else None
    return write_results(
        target,
        tables={"runs": rows, "curves": curves},
        summary=summary,
        figures={"growth": fig} if fig is not None else None,
        meta=provenance(seeds=cfg["seeds"], config=cfg, started=started),
    )
