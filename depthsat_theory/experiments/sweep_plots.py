"""Figures of the depth sweep (:mod:`depthsat_theory.experiments.sweep`): C1 curves and C3 insertion decreases."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["figures"]


def _series(rows: Sequence[dict[str, Any]], curve: Any, metric: str) -> tuple[list, list, list]:
    pts = sorted(
        (r["depth"], r["mean"], r["std"])
        for r in rows
        if r["dataset"] == curve.dataset and r["arch"] == curve.arch and r["metric"] == metric
    )
    return [p[0] for p in pts], [p[1] for p in pts], [0.0 if p[2] != p[2] else p[2] for p in pts]


def _plateau(plateaus: Sequence[dict[str, Any]], curve: Any, metric: str) -> int | None:
    for p in plateaus:
        if p["dataset"] == curve.dataset and p["arch"] == curve.arch and p["metric"] == metric:
            return None if p["plateau_depth"] is None else int(p["plateau_depth"])
    return None


def _depth_axis(ax: Any, depths: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    if depths:
        ax.set_xticks(list(depths), [str(d) for d in depths])


def _panel(ax: Any, rows: Sequence[dict], plateaus: Sequence[dict], curve: Any, metrics: Sequence[str], ylabel: str):
    for metric in metrics:
        d, m, s = _series(rows, curve, metric)
        if not d:
            continue
        line = ax.errorbar(d, m, yerr=s, marker="o", ms=3, capsize=2, label=metric)
        pd = _plateau(plateaus, curve, metric)
        if pd is not None:
            ax.axvline(pd, ls=":", color=line[0].get_color(), lw=1)
    _depth_axis(ax, _series(rows, curve, metrics[0])[0])
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=6)


def figures(curves: Sequence[Any], curves_rows: Sequence[dict], plateaus: Sequence[dict], ins_rows: Sequence[dict]):
    """The sweep's figures: ``c1_depth_sweep`` and ``c3_insertion``.

    Args:
        curves: the :class:`~depthsat_theory.experiments.sweep.Curve` s that ran.
        curves_rows: ``curves.csv`` rows (mean and std per metric and depth).
        plateaus: ``plateaus.csv`` rows (dotted vertical lines at each plateau depth).
        ins_rows: ``insertion_curves.csv`` rows.

    Returns:
        ``{name: matplotlib Figure}``.
    """
    import matplotlib

    matplotlib.use("Agg")
    # SVG text as text, not glyph paths (smaller files, and saving is several times faster)
    matplotlib.rcParams["svg.fonttype"] = "none"
    import matplotlib.pyplot as plt

    n = len(curves)
    fig, axes = plt.subplots(4, n, figsize=(2.4 * n + 1, 8), squeeze=False)
    for j, c in enumerate(curves):
        perf = ["test_bpc"] if c.dataset == "kjv" else ["test_loss"]
        _panel(axes[0][j], curves_rows, plateaus, c, perf, "test loss (nats) / bpc")
        axes[0][j].set_title(c.name, fontsize=9)
        _panel(axes[1][j], curves_rows, plateaus, c, ["test_accuracy"], "test accuracy")
        _panel(axes[2][j], curves_rows, plateaus, c, ["ag_max", "ag_max_last", "ag_rms_max"], "activation gradient")
        axes[2][j].set_yscale("log")
        _panel(axes[3][j], curves_rows, plateaus, c, ["rel_max", "rel_last"], "s / AG_rms")
        axes[3][j].set_xlabel("depth (residual blocks)", fontsize=8)
    fig.suptitle("C1: depth sweep, mean ± std over seeds (dotted: plateau depth)", fontsize=10)
    fig.tight_layout()

    fig3, axes3 = plt.subplots(1, n, figsize=(2.6 * n + 1, 3), squeeze=False)
    for j, c in enumerate(curves):
        ax = axes3[0][j]
        for metric, style in (
            ("best_predicted", "--"),
            ("best_measured", "-"),
            ("last_predicted", "--"),
            ("last_measured", "-"),
        ):
            d, m, s = _series(ins_rows, c, metric)
            if d:
                ax.errorbar(d, [-v for v in m], yerr=s, ls=style, marker="o", ms=3, capsize=2, label=metric)
        _depth_axis(ax, _series(ins_rows, c, "best_measured")[0])
        ax.set_title(c.name, fontsize=9)
        ax.set_xlabel("depth (residual blocks)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    axes3[0][0].set_ylabel("first-step decrease of J (nats)", fontsize=8)
    fig3.suptitle("C3: steepest inserted-block step, predicted (-t·s) vs measured", fontsize=10)
    fig3.tight_layout()
    return {"c1_depth_sweep": fig, "c3_insertion": fig3}
