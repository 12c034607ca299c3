"""The readings of the known-depth benchmark: each claim *holds*, *fails* or is *untestable here*, with intervals.

Rules (one for every teacher depth ``L*``; intervals are Student-t 95 % intervals over seeds of the
per-seed paired differences, :func:`~depthsat_theory.experiments.record.summarize`):

* **precondition — depth pays up to L*:** ``excess(1) − excess(L*) > 0`` with an interval above 0
  (test excess over Bayes; and the same for the training loss). When it fails, every reading that
  needs depth to pay is *untestable here*.
* **known-depth transition:** per seed, the depth from which no deeper student's deepest site is
  called improvable (:func:`~depthsat_theory.experiments.teacher.verdict_transition_depth`, noise
  test at the configuration's probe size).  *holds* when it equals ``L*`` in every seed, *fails*
  otherwise (the per-seed depths say how).
* **C1** per activation-gradient curve (mean over seeds): it falls from depth 1 to ``L*`` and its
  plateau depth (:func:`~depthsat_theory.experiments.sweep.plateau_depth`) is within one depth of the
  test excess's; plus the first depth where the batch-mean ``AG_max`` is below the paper's ``5·10⁻³``.
* **C3 cross-fitted:** the held-out decrease (probe half B) of the deepest site's steepest step,
  relative to its prediction, and whether it shrinks from depth 1 to ``2L*`` (paired interval).
"""

from __future__ import annotations

import math
from typing import Any

from depthsat_theory.experiments.record import summarize

__all__ = ["C1_CURVES", "claims"]

#: the activation-gradient curves C1 is read on (per-model columns of runs.csv)
C1_CURVES: tuple[str, ...] = (
    "probe_ag_max",
    "probe_ag_max_last",
    "probe_ag_rms_last",
    "probe_ag_max_last_z",
    "probe_s_z_last",
    "probe_rel_last",
    "probe_s2u_last",
    "train_ag_max",
    "train_ag_max_last",
    "train_ag_rms_last",
    "train_rel_last",
    "train_s2u_last",
    "probe_block_s_z_last",
    "probe_block_rel_last",
    "probe_block_s2u_last",
)


def _paired(runs: list[dict[str, Any]], metric: str, d_a: int, d_b: int) -> dict[str, Any]:
    """Interval of ``metric(d_a) − metric(d_b)`` over the seeds that have both depths."""
    by = {(r["seed"], r["depth"]): r[metric] for r in runs if r.get(metric) is not None}
    diffs = [by[(s, d_a)] - by[(s, d_b)] for s in sorted({s for s, _ in by}) if (s, d_a) in by and (s, d_b) in by]
    diffs = [d for d in diffs if math.isfinite(d)]
    if not diffs:
        return {"n": 0}
    return {f"{metric}({d_a})-{metric}({d_b})": summarize(diffs), "per_seed": diffs}


def _positive(iv: dict[str, Any]) -> bool:
    stats = next((v for k, v in iv.items() if k.startswith(tuple("pt")) and isinstance(v, dict)), None)
    return bool(stats and stats["n"] >= 2 and stats["ci_low"] > 0)


def _mean_curve(curves_rows: list[dict[str, Any]], lstar: int, metric: str) -> tuple[list[int], list[float]]:
    pts = sorted((c["depth"], c["mean"]) for c in curves_rows if c["teacher_depth"] == lstar and c["metric"] == metric)
    return [d for d, _ in pts], [v for _, v in pts]


def _c1(curves_rows: list[dict[str, Any]], lstar: int, perf_plateau: int | None, why_not: str) -> dict[str, Any]:
    from depthsat_theory.experiments.sweep import plateau_depth

    out: dict[str, Any] = {}
    for metric in C1_CURVES:
        depths, vals = _mean_curve(curves_rows, lstar, metric)
        if not depths or lstar not in depths:
            continue
        plateau = plateau_depth(depths, vals)  # None: still falling at the deepest depth
        falls = vals[depths.index(lstar)] < vals[0]
        near = perf_plateau is not None and plateau is not None and abs(plateau - perf_plateau) <= 1
        if why_not:
            verdict, why = "untestable here", why_not
        elif falls and near:
            verdict, why = "holds", f"falls to L* and plateaus at {plateau} (test excess at {perf_plateau})"
        else:
            verdict = "fails"
            at = "no depth run (still falling at the deepest)" if plateau is None else plateau
            why = (
                "does not fall to L*" if not falls else "falls"
            ) + f"; plateaus at {at} (test excess at {perf_plateau})"
        out[metric] = {"first": vals[0], "at_lstar": vals[depths.index(lstar)], "deepest": vals[-1]}
        out[metric].update({"plateau_depth": plateau, "verdict": verdict, "reason": why})
    for tag in ("probe", "train"):
        depths, vals = _mean_curve(curves_rows, lstar, f"{tag}_ag_max_last_batchmean")
        below = [d for d, v in zip(depths, vals, strict=True) if v < 5e-3]
        out[f"{tag}_first_depth_batchmean_ag_max_last_below_5e-3"] = below[0] if below else None
    return out


def _c3(cross_rows: list[dict[str, Any]], runs: list[dict[str, Any]], lstar: int) -> dict[str, Any]:
    deepest = max(r["depth"] for r in runs)
    last: dict[tuple[int, int], dict[str, Any]] = {}
    for r in cross_rows:
        k = (r["seed"], r["depth"])
        if k not in last or r["site_index"] > last[k]["site_index"]:
            last[k] = r
    ratio = {
        part: sorted(r[f"measured_{part}"] / r["predicted"] for r in last.values() if r["predicted"] < 0)
        for part in ("a", "b", "test")
    }
    rows = [{"seed": s, "depth": d, "held_out_decrease": -r["measured_b"]} for (s, d), r in last.items()]
    shrink = _paired(rows, "held_out_decrease", 1, deepest)
    return {
        "median_measured_over_predicted": {k: v[len(v) // 2] if v else None for k, v in ratio.items()},
        "held_out_decrease_shrinks_1_to_deepest": shrink,
        "verdict_shrinks": "holds" if _positive(shrink) else "fails (interval does not exclude 0 or no shrink)",
    }


def claims(
    runs: list[dict[str, Any]],
    curves_rows: list[dict[str, Any]],
    transitions: list[dict[str, Any]],
    crossfit: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Every claim per teacher depth, with intervals and per-seed values.

    Args:
        runs: ``runs.csv`` rows.
        curves_rows: ``curves.csv`` rows.
        transitions: ``transitions.csv`` rows.
        crossfit: ``crossfit.csv`` rows (C3; omitted when ``None``).

    Returns:
        ``{"L*=<d>": {"precondition", "transition", "c1", "c3"}}``.
    """
    out: dict[str, Any] = {}
    for lstar in sorted({r["teacher_depth"] for r in runs}):
        mine = [r for r in runs if r["teacher_depth"] == lstar]
        tr = [t for t in transitions if t["teacher_depth"] == lstar]
        out[f"L*={lstar}"] = _claims_for(lstar, mine, curves_rows, tr)
        if crossfit is not None:
            for fam in sorted({r["family"] for r in crossfit}):
                rows = [r for r in crossfit if r["teacher_depth"] == lstar and r["family"] == fam]
                out[f"L*={lstar}"][f"c3 ({fam})"] = _c3(rows, mine, lstar)
    return out


def _claims_for(
    lstar: int, mine: list[dict[str, Any]], curves_rows: list[dict[str, Any]], tr: list[dict[str, Any]]
) -> dict[str, Any]:
    """Precondition, transition and C1 for one teacher depth."""
    deepest = max(r["depth"] for r in mine)
    pays = _paired(mine, "test_excess", 1, lstar)
    depth_pays = _positive(pays)
    why_not = "" if depth_pays else _why_untestable(pays)
    per_seed = [t["probe_transition_last"] for t in tr]
    block = [t.get("probe_block_transition_last") for t in tr]
    has_block = bool(tr) and "probe_block_transition_last" in tr[0]
    return {
        "precondition": {
            "depth_pays_test_excess": pays,
            "depth_pays_train_loss": _paired(mine, "train_loss", 1, lstar),
            "beyond_lstar_test_excess": _paired(mine, "test_excess", lstar, deepest),
            "holds": depth_pays,
        },
        "transition": {
            "probe_last_per_seed": per_seed,
            "probe_any_per_seed": [t["probe_transition_any"] for t in tr],
            "train_last_per_seed": [t["train_transition_last"] for t in tr],
            "test_excess_plateau_per_seed": [t["test_excess_plateau"] for t in tr],
            "verdict": _transition_verdict(per_seed, lstar, deepest, why_not),
            "probe_block_last_per_seed": block,
            "probe_block_any_per_seed": [t.get("probe_block_transition_any") for t in tr],
            "verdict_block": _transition_verdict(block, lstar, deepest, why_not) if has_block else None,
        },
        "c1": _c1(curves_rows, lstar, _plateau_of_mean(curves_rows, lstar), why_not),
    }


def _why_untestable(pays: dict[str, Any]) -> str:
    """Why the precondition is not established: one seed, or an interval that reaches 0."""
    stats = next((v for k, v in pays.items() if k != "per_seed" and isinstance(v, dict)), None)
    if not stats or stats["n"] < 2:
        return "one seed: no interval for excess(1) − excess(L*)"
    per_seed = ", ".join(f"{d:.4g}" for d in pays["per_seed"])
    return (
        f"depth is not shown to pay up to L*: excess(1) − excess(L*) = {stats['mean']:.4g}, 95 % CI "
        f"[{stats['ci_low']:.4g}, {stats['ci_high']:.4g}] nats over {stats['n']} seeds (per seed {per_seed})"
    )


def _transition_verdict(per_seed: list[Any], lstar: int, deepest: int, why_not: str) -> str:
    if why_not:
        return f"untestable here ({why_not})"
    if per_seed and all(t == lstar for t in per_seed):
        return "holds"
    return f"fails (per seed: {per_seed}, L* = {lstar}; None = still improvable at depth {deepest})"


def _plateau_of_mean(curves_rows: list[dict[str, Any]], lstar: int) -> int | None:
    from depthsat_theory.experiments.sweep import plateau_depth

    depths, vals = _mean_curve(curves_rows, lstar, "test_excess")
    return plateau_depth(depths, vals) if depths else None
