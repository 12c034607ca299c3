r"""Criterion-driven growth (beyond the paper).

Start shallow; train with the fixed recipe; then repeat:

1. diagnose every site on the ``probe`` split (:func:`~depthsat_theory.diagnose.diagnose`, linear
   family, ``(1 − δ)`` intervals union-bounded over the sites, the saturation certificate at
   ``ε = sqrt(2 β ε_J)``: ``ε_J`` the library's default
   :data:`~depthsat_theory.statistics.decrease.DEFAULT_EPSILON_NATS` and ``β = ½‖W_head‖²`` the
   cross-entropy smoothness at the head input
   (:func:`~depthsat_theory.statistics.decrease.cross_entropy_smoothness`), the only ``β`` the
   library can compute here; it is *not* proven for the hidden sites, so this ``ε`` is a
   yardstick there, not a guarantee);
2. **certified rule** — stop when every site is certified ε-saturated; insert a zero-output
   :class:`~depthsat_theory.tasks.models.MLPBlock` after the certified-improvable site with the largest
   certified lower end of ``s/AG_rms`` (:func:`~depthsat_theory.grow.rank_sites`); when no site is
   certified either way the certificate is out of reach at this probe size (each site's
   ``n_to_certify`` says how far), and the certified rule stops there;
3. **fallback** (documented in :func:`~depthsat_theory.grow.rank_sites`, used only after the certified
   rule has stopped undetermined): rank by the point estimate ``ŝ/AG_rms`` and insert at the top site;
   stop when the bias-corrected ``ŝ²`` (``score_squared_unbiased``) is at most ``ε²`` at every site
   (a point estimate, not a certificate) or at ``max_depth``;
4. retrain the grown model with the fixed recipe (early stopping), and go to 1.

Reported per seed and round: depth, the sites' scores, intervals, certificates and ``n_to_certify``,
the chosen site and rule, train/val/test loss and accuracy, and the cumulative compute (examples seen,
FLOPs), next to the depth sweep's plateau depth and compute when its results are present.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from depthsat_theory.diagnose import Diagnosis, diagnose
from depthsat_theory.experiments import recipe as rc
from depthsat_theory.experiments.deepen import deepen
from depthsat_theory.experiments.flops import training_cost
from depthsat_theory.experiments.growth import sweep_sizes
from depthsat_theory.experiments.record import (
    DEFAULT_RESULTS_ROOT,
    ExperimentError,
    default_folder,
    provenance,
    summarize,
    write_results,
)
from depthsat_theory.grow import BY_CERTIFIED, rank_sites
from depthsat_theory.statistics.decrease import DEFAULT_EPSILON_NATS, cross_entropy_smoothness, epsilon_from_nats
from depthsat_theory.vocabulary import Certificate

__all__ = ["CONFIGS", "decide", "run_criterion_growth"]

#: The configurations by name, ``tiny`` (what CI runs, in seconds) and ``full`` (the committed results;
#: experiments/README.md gives its wall time).
CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": {
        "datasets": ["digits"],
        "arch": "mlp",
        "width": 8,
        "start_depth": 1,
        "max_depth": 3,
        "delta": 0.05,
        "seeds": [0, 1, 2],
        "recipe": {"max_epochs": 3, "patience": 1},
        "sizes": {"digits": {"train": 300, "val": 100, "probe": 100, "test": 200}},
    },
    "full": {
        "datasets": ["digits", "mnist5k"],
        "arch": "mlp",
        "width": 32,
        "start_depth": 1,
        "max_depth": 8,
        "delta": 0.05,
        "seeds": [0, 1, 2, 3, 4],
        # the shared recipe as the depth sweep runs it, and its split sizes (experiments/sweep.py)
        "recipe": {},
        "sizes": sweep_sizes(["digits", "mnist5k"]),
    },
}

#: ``decide``'s rules
CERTIFIED, FALLBACK = "certified", "point-estimate fallback"


def decide(diag: Diagnosis, epsilon: float, certified_stopped: bool) -> dict[str, Any]:
    """One round's decision: stop (and why) or the site to grow after, by which rule.

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
                "probe_n": diag.n,
            }
        )
    return rows


def _diagnose(model: nn.Module, splits: rc.Splits, delta: float) -> tuple[Diagnosis, float]:
    probe_model = copy.deepcopy(model).double().eval()
    head = probe_model.get_submodule("head")
    assert isinstance(head, nn.Linear)
    eps = epsilon_from_nats(DEFAULT_EPSILON_NATS, cross_entropy_smoothness(head.weight))
    diag = diagnose(
        probe_model, rc.loss_function(splits), rc.probe_batches(splits), delta=delta, bound_kwargs={"epsilon": eps}
    )
    return diag, eps


def _depth(model: nn.Module) -> int:
    blocks = model.get_submodule("blocks")
    assert isinstance(blocks, nn.ModuleList)
    return len(blocks)


def _site_index(site: str) -> int:
    """``deepen``'s ``after`` index of a site: ``embed`` → −1, ``blocks.i`` → ``i``."""
    return -1 if site == "embed" else int(site.split(".")[1])


def _one_seed(cfg: dict[str, Any], dataset: str, seed: int) -> tuple[list[dict], list[dict], dict]:
    recipe = dataclasses.replace(rc.RECIPE, **cfg["recipe"])
    splits = rc.load_splits(dataset, seed, rc.Sizes(**cfg["sizes"].get(dataset, {})))
    model = rc.build_model(cfg["arch"], cfg["start_depth"], splits, seed=seed, width=cfg["width"])
    example = splits.train.x[:1]
    res = rc.train(model, splits, seed=seed, recipe=recipe)
    examples, flops = res.examples_seen, 2 * training_cost(model, example).macs * res.examples_seen
    rounds: list[dict] = []
    sites: list[dict] = []
    stopped_certified: dict[str, Any] | None = None
    for rnd in range(cfg["max_depth"] + 1):
        depth = _depth(res.model)
        diag, eps = _diagnose(res.model, splits, cfg["delta"])
        dec = decide(diag, eps, stopped_certified is not None)
        if dec["certified_undetermined"] and stopped_certified is None:
            stopped_certified = {"depth": depth, "round": rnd, "reason": dec["reason"].split(";")[0]}
        at_max = depth >= cfg["max_depth"] and not dec["stop"]
        base = {"dataset": dataset, "seed": seed, "round": rnd, "depth": depth}
        m = res.metrics
        rounds.append(
            {
                **base,
                "train_loss": m["train"]["loss"],
                "val_loss": m["val"]["loss"],
                "test_loss": m["test"]["loss"],
                "test_accuracy": m["test"]["accuracy"],
                "examples_seen_cumulative": examples,
                "flops_cumulative": flops,
                "epsilon": eps,
                "probe_loss": diag.loss,
                "decision": "stop" if dec["stop"] or at_max else f"grow after {dec['site']}",
                "rule": dec["rule"],
                "reason": "max_depth reached" if at_max else dec["reason"],
                "ranked_by": dec["ranked_by"],
            }
        )
        sites += _site_rows(diag, base)
        if dec["stop"] or at_max:
            break
        grown = deepen(res.model, [_site_index(dec["site"])], splits.probe.x, seed=seed + 10_000 + rnd)
        res = rc.train(grown.model, splits, seed=seed + rnd + 1, recipe=recipe)
        examples += res.examples_seen
        flops += 2 * training_cost(grown.model, example).macs * res.examples_seen
    final = rounds[-1]
    stop = {
        "dataset": dataset,
        "seed": seed,
        "certified_stop_depth": None,
        "certified_stop_reason": None,
        "final_depth": final["depth"],
        "final_rule": final["rule"],
        "final_reason": final["reason"],
        "examples_seen": examples,
        "flops": flops,
        "test_loss": final["test_loss"],
    }
    if stopped_certified is not None:
        stop["certified_stop_depth"], stop["certified_stop_reason"] = (
            stopped_certified["depth"],
            stopped_certified["reason"],
        )
    elif final["rule"] == CERTIFIED:
        stop["certified_stop_depth"], stop["certified_stop_reason"] = final["depth"], final["reason"]
    return rounds, sites, stop


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _sweep_plateau(folder: Path, ds: str, cfg: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The sweep's plateau depth of the test loss for ``ds`` and the width its curve used."""
    out: dict[str, Any] = {}
    width = cfg["width"]
    summary = folder / "summary.json"
    if not summary.is_file():
        return out, width
    data = json.loads(summary.read_text())
    curves = data.get("meta", {}).get("config", {}).get("curves", [])
    width = next((c["width"] for c in curves if (c.get("dataset"), c.get("arch")) == (ds, cfg["arch"])), width)
    for p in data.get("summary", {}).get("plateaus", []):
        if (p.get("dataset"), p.get("arch"), p.get("metric")) == (ds, cfg["arch"], "test_loss"):
            out["sweep_plateau_depth_test_loss"] = p.get("plateau_depth")
            out["sweep_plateau_depth_per_seed"] = p.get("per_seed")
    return out, width


def _sweep_side(folder: Path, ds: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The depth sweep's plateau depth of the test loss and its compute per seed, from its result folder."""
    out, width = _sweep_plateau(folder, ds, cfg)
    runs = folder / "runs.csv"
    rows = (
        [r for r in _read_csv(runs) if r.get("dataset") == ds and r.get("arch") == cfg["arch"]]
        if runs.is_file()
        else []
    )
    if not rows:
        return out
    splits = rc.load_splits(ds, 0, rc.Sizes(**cfg["sizes"].get(ds, {})))
    cost = {
        d: training_cost(rc.build_model(cfg["arch"], d, splits, seed=0, width=width), splits.train.x[:1]).macs
        for d in {int(r["depth"]) for r in rows}
    }
    per = [[r for r in rows if r["seed"] == sd] for sd in sorted({r["seed"] for r in rows})]
    out["sweep_depths"], out["sweep_width"] = sorted(cost), width
    out["sweep_examples_seen_per_seed"] = summarize([sum(int(r["examples_seen"]) for r in p) for p in per])
    out["sweep_flops_per_seed"] = summarize(
        [sum(2 * cost[int(r["depth"])] * int(r["examples_seen"]) for r in p) for p in per]
    )
    return out


def _own_plateau(rounds: list[dict], ds: str) -> dict[str, Any]:
    """The sweep's plateau rule applied to this experiment's own test-loss trajectories (per seed)."""
    try:
        from depthsat_theory.experiments.sweep import plateau_depth
    except ImportError:  # the sweep module is not on this branch
        return {"own_plateau_depth_test_loss": "the sweep's plateau rule (experiments/sweep.py) is not available"}
    per_seed = []
    for seed in sorted({r["seed"] for r in rounds if r["dataset"] == ds}):
        pts = [r for r in rounds if r["dataset"] == ds and r["seed"] == seed]
        per_seed.append(plateau_depth([r["depth"] for r in pts], [r["test_loss"] for r in pts]))
    return {"own_plateau_depth_test_loss_per_seed": per_seed, "own_plateau_depth_test_loss": summarize(per_seed)}


def _summary(stops: list[dict], rounds: list[dict], cfg: dict[str, Any], sweep_dir: Path) -> dict[str, Any]:
    found = (sweep_dir / "summary.json").is_file()
    out: dict[str, Any] = {
        "epsilon_rule": f"ε = sqrt(2 β ε_J), ε_J = {DEFAULT_EPSILON_NATS} nats (library default), β = ½‖W_head‖² "
        "(head input; not proven at hidden sites)",
        "sweep_reference": str(sweep_dir) if found else f"{sweep_dir / 'summary.json'} not found",
    }
    for ds in cfg["datasets"]:
        st = [s for s in stops if s["dataset"] == ds]
        if not st:
            continue
        cert = [s["certified_stop_depth"] for s in st if s["certified_stop_depth"] is not None]
        out[ds] = {
            "certified_stop_depth": summarize(cert) if cert else None,
            "certified_stop_reasons": sorted({s["certified_stop_reason"] for s in st if s["certified_stop_reason"]}),
            "final_depth": summarize([s["final_depth"] for s in st]),
            "final_depth_per_seed": [s["final_depth"] for s in st],
            "final_reasons": sorted({s["final_reason"] for s in st}),
            "examples_seen": summarize([s["examples_seen"] for s in st]),
            "flops": summarize([s["flops"] for s in st]),
            "test_loss": summarize([s["test_loss"] for s in st]),
            **_own_plateau(rounds, ds),
            **_sweep_side(sweep_dir, ds, cfg),
        }
    return out


def _figure(rounds: list[dict], sites: list[dict], cfg: dict[str, Any]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dsets = [d for d in cfg["datasets"] if any(r["dataset"] == d for r in rounds)]
    fig, axes = plt.subplots(2, len(dsets), figsize=(5 * len(dsets), 7), squeeze=False)
    for j, ds in enumerate(dsets):
        ax = axes[0][j]
        for seed in cfg["seeds"]:
            pts = [r for r in rounds if r["dataset"] == ds and r["seed"] == seed]
            ax.plot(
                [r["depth"] for r in pts], [r["test_loss"] for r in pts], marker="o", alpha=0.7, label=f"seed {seed}"
            )
        ax.set(title=f"{ds}: criterion-driven growth", xlabel="depth (blocks)", ylabel="test loss (nats per example)")
        ax.legend(fontsize=7)
        ax = axes[1][j]
        pts = [s for s in sites if s["dataset"] == ds]
        ax.scatter(
            [s["depth"] for s in pts], [s["relative_score"] for s in pts], s=10, alpha=0.6, label="ŝ/AG_rms (point)"
        )
        ax.set(
            xlabel="depth of the model diagnosed",
            ylabel="s/AG_rms at each site",
            title="point scores (intervals and certificates: sites.csv)",
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def run_criterion_growth(
    config: str = "full",
    *,
    out: str | Path | None = None,
    seeds: Sequence[int] | None = None,
    datasets: Sequence[str] | None = None,
    sweep: str | Path | None = None,
    log=print,
) -> Path:
    """Run criterion-driven growth and write ``experiments/results/criterion-growth/`` (or ``out``).

    Args:
        config: ``"tiny"`` or ``"full"`` (:data:`CONFIGS`).
        out: the result folder (default :func:`~.record.default_folder`: ``experiments/results/criterion-growth``
            for ``full``, a new temporary folder otherwise).
        seeds: override the seeds.
        datasets: override the image data sets.
        sweep: the depth sweep's result folder (default ``experiments/results/sweep``): its
            ``summary.json`` (plateau depths) and ``runs.csv`` (examples seen per depth and seed).
        log: called with one line per seed.

    Returns:
        The result folder: ``rounds.csv`` (one row per seed and round), ``sites.csv`` (every site of
        every diagnosis), ``stops.csv`` (one row per seed), ``summary.json``, ``criterion-growth.png``/``.svg``.

    Raises:
        ExperimentError: a bad configuration.
    """
    started = time.time()
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
    rounds: list[dict] = []
    sites: list[dict] = []
    stops: list[dict] = []
    skipped: dict[str, str] = {}
    for ds in cfg["datasets"]:
        reason = rc.dataset_unavailable(ds)
        if reason:
            skipped[ds] = reason
            continue
        for seed in cfg["seeds"]:
            r, s, st = _one_seed(cfg, ds, seed)
            rounds += r
            sites += s
            stops.append(st)
            log(
                f"criterion-growth {ds} seed {seed}: certified rule stopped at depth {st['certified_stop_depth']}, "
                f"fallback at {st['final_depth']} ({st['final_reason']})"
            )
    sweep_dir = Path(sweep) if sweep is not None else DEFAULT_RESULTS_ROOT / "sweep"
    summary = {**_summary(stops, rounds, cfg, sweep_dir), "skipped": skipped}
    target = Path(out) if out is not None else default_folder("criterion-growth", config)
    fig = _figure(rounds, sites, cfg) if rounds else None
    return write_results(
        target,
        tables={"rounds": rounds, "sites": sites, "stops": stops},
        summary=summary,
        figures={"criterion-growth": fig} if fig is not None else None,
        meta=provenance(seeds=cfg["seeds"], config=cfg, started=started),
    )
