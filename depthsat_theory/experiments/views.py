"""Views side by side: where does depth stop paying, by four answers.

For a documented subset of the depth sweep's curves (:data:`CONFIGS`), every model is retrained
with the sweep's recipe and seed (training is deterministic per seed at one thread, so these are
the sweep's models when the recipe is the one the sweep ran with) and looked at four ways:

1. **First-order criterion (this toolkit)**: :func:`depthsat_theory.experiments.sweep.site_rows`
   (``diagnose`` on the probe, family ``linear``): per site the verdict, ``s`` and ``s/AG_rms``.
2. **Optimal stopping depth (seed 002)**: per-depth exits (:mod:`depthsat_theory.views.exits`: the
   logit lens for the GPT, a linear readout fitted on ``train`` for the MLP/CNN), the per-example
   exit loss on ``test``, the oracle stopping depth ``argmin_l ℓ_l(x) + c·l`` and a confidence-
   threshold policy tuned on ``val``, for every cost ``c`` of the configuration; the measured
   diminishing-returns check (relative update size and exit-loss decrease per block).
3. **Block influence (ShortGPT)**: ``1 − cos(z_in, z_out)`` per block on the probe.
4. **The sweep's plateau depth** of the test loss (bpc for text), read from the sweep's
   ``summary.json`` at run time (never hard-coded).

Per curve, each view gives a depth (in blocks) where depth stops paying (:func:`curve_verdicts`,
rules stated there) and the views are compared by one rule (within one depth step of the curve's
grid).  Seed 002's ``L_depth`` penalty (:mod:`depthsat_theory.views.regularizer`, recipe option
``depth_reg``) is measured separately: MLP at one depth on two data sets, 3 seeds, penalty on and
off, effect on the expected stopping depth and on test accuracy.

The ``budget`` configuration (:func:`budget_views_config`) looks the same four ways at the budget
sweep's Fashion-MNIST models (:mod:`~depthsat_theory.experiments.budget_sweep`: 2,000-step cosine
budget, where depth pays to 4 blocks): each model is made by the budget sweep's own training function
with its seed and configuration, its test and train loss are checked against the budget sweep's
``runs.csv`` (``summary.json → reproduction``), the sweep plateau is the budget sweep's
``claims.precondition.test_loss_plateau_depth``, and there is no ``L_depth`` measurement (a penalty
would change the models).  Every configuration also gives each seed's own views
(``verdicts_per_seed``) and the ``"Views agree"`` claim rows (:func:`views_claims`,
``summary.json → claims``).

``run_views`` writes ``sites.csv``, ``stopping.csv``, ``stopping_hist.csv``, ``runs.csv``,
``curves.csv``, ``depth_reg.csv`` (when ``L_depth`` is measured), ``summary.json`` and
``views.png``/``.svg``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from depthsat_theory.experiments import budget_sweep as B
from depthsat_theory.experiments import recipe as R
from depthsat_theory.experiments import sweep as S
from depthsat_theory.experiments.record import (
    DEFAULT_RESULTS_ROOT,
    ExperimentError,
    ResumeFile,
    config_tag,
    default_folder,
    json_ready,
    provenance,
    summarize,
    write_results,
)

__all__ = [
    "CONFIGS",
    "ViewsConfig",
    "budget_views_config",
    "curve_verdicts",
    "read_budget_sweep",
    "read_sweep_plateaus",
    "run_views",
    "snap_depth",
    "views_claims",
]


@dataclass(frozen=True)
class ViewsConfig:
    """A size of the views experiment.

    Attributes:
        name: ``"tiny"`` or ``"full"``.
        curves: the sweep curves (data set, architecture, depths, width) looked at.
        seeds: seeds (the sweep's seeds: same splits, same initialisation, same batch order).
        sizes: split sizes per data set (the sweep's).
        recipe: the training recipe (the sweep's; the budget sweep's ``BudgetRecipe`` when ``budget`` is set).
        costs: costs per block ``c`` (nats per example/token) of the stopping views.
        reference_cost: the cost whose expected oracle stopping depth is the stopping view's answer.
        readout_l2: ridge weight of the fitted linear readouts.
        influence_mass: the block-influence view counts the blocks that carry this fraction of
            the total influence.
        delta: ``δ`` of the first-order intervals (as the sweep).
        probe_batch: probe batch size.
        reg_datasets, reg_arch, reg_depth, reg_width, reg_lambdas: the ``L_depth`` measurement
            (``λ = 0`` first: the unregularised reference; no data set: not measured).
        budget: ``None`` (models retrained with ``recipe`` by :func:`~.recipe.train`) or the budget
            sweep's configuration: every model is then the budget sweep's, trained by its own
            training function (``budget_sweep._train``, same splits, seed and budget) and compared
            with the budget sweep's committed results (:func:`budget_views_config`).
    """

    name: str
    curves: tuple[S.Curve, ...]
    seeds: tuple[int, ...]
    sizes: dict[str, R.Sizes]
    recipe: R.Recipe | R.BudgetRecipe
    costs: tuple[float, ...] = (0.001, 0.003, 0.01, 0.03)
    reference_cost: float = 0.003
    readout_l2: float = 1e-3
    influence_mass: float = 0.9
    delta: float = 0.05
    probe_batch: int = 256
    reg_datasets: tuple[str, ...] = ("digits", "mnist5k")
    reg_arch: str = "mlp"
    reg_depth: int = 8
    reg_width: int = 32
    reg_lambdas: tuple[float, ...] = (0.0, 0.1, 1.0)
    budget: B.BudgetSweepConfig | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary.

        Returns:
            The configuration's fields, with ``sizes`` and ``recipe`` as dictionaries and the ``rules`` added.
        """
        d = dataclasses.asdict(self)
        d["sizes"] = {k: dataclasses.asdict(v) for k, v in self.sizes.items()}
        d["recipe"] = self.recipe.to_dict()
        d["budget"] = None if self.budget is None else self.budget.to_dict()
        d["rules"] = RULES
        return d


#: The rules of the per-curve verdicts, in words (also written into ``summary.json``).
RULES = {
    "first_order": "plateau depth (sweep.plateau_depth, 10 % of the range) of the mean over seeds of s at the "
    "deepest site (the first-order gain of one more block at the end, nats per unit step); the "
    "certificate state is reported next to it (all intervals vacuous -> 'point estimate')",
    "stopping": "expected oracle stopping depth E[argmin_l l_l(x) + c l] at the reference cost on the curve's "
    "deepest model, snapped up to the curve's depth grid (0 -> the shallowest depth)",
    "block_influence": "on the curve's deepest model, the fewest blocks whose block influence carries "
    "influence_mass of the total, snapped up to the depth grid",
    "sweep_plateau": "the sweep's plateau depth of the mean test loss (bpc for text), from its summary.json",
    "retrained_plateau": "the same plateau rule on the mean test loss of the models retrained here (the "
    "sweep's plateau when the recipes match)",
    "agree": "two views agree when their depths are at most one step apart on the curve's depth grid; "
    "all_agree when every view agrees with the sweep plateau, all_agree_retrained with the retrained plateau",
    "claim": "'Views agree' per curve: untestable here without a sweep plateau on the grid (none, or the test loss "
    "still falls at the deepest depth) or with the plateau at the shallowest depth (depth never pays: nothing to "
    "locate); else holds when all_agree (a view not reached does not agree), fails otherwise; "
    "the qualifier counts the seeds whose own views all agree and the views exactly at the plateau, and names "
    "the views at the deepest depth run (they agree with a plateau one step below only by the one-step rule)",
}

_TINY_SIZES = R.Sizes(train=200, val=80, probe=96, test=96, seq_len=16)

#: ``tiny``: what CI runs (seconds); ``full``: the committed results (one thread; see
#: experiments/README.md for the wall time).  The full curves are a subset of the sweep's: the MLP
#: curves stop at 16 blocks and the GPT at 4 so that a run fits ≈ 15 min of one thread.
CONFIGS: dict[str, ViewsConfig] = {
    "tiny": ViewsConfig(
        name="tiny",
        curves=(
            S.Curve("digits", "mlp", (1, 2), 16),
            S.Curve("digits", "cnn", (1, 2), 4),
            S.Curve("kjv", "gpt", (1, 2), 16),
        ),
        seeds=(0, 1),
        sizes={"digits": _TINY_SIZES, "kjv": _TINY_SIZES},
        recipe=dataclasses.replace(R.RECIPE, max_epochs=2, patience=1),
        reg_datasets=("digits",),
        reg_depth=2,
        reg_width=16,
        reg_lambdas=(0.0, 1.0),
    ),
    "full": ViewsConfig(
        name="full",
        curves=(
            S.Curve("digits", "mlp", (1, 2, 4, 8, 16), 32),
            S.Curve("mnist5k", "mlp", (1, 2, 4, 8, 16), 32),
            S.Curve("digits", "cnn", (1, 2, 4, 8), 8),
            S.Curve("kjv", "gpt", (1, 2, 4), 32),
        ),
        seeds=(0, 1, 2),
        sizes=S.CONFIGS["full"].sizes,
        recipe=S.CONFIGS["full"].recipe,
    ),
}


def budget_views_config(name: str, budget: B.BudgetSweepConfig, **changes: Any) -> ViewsConfig:
    """The views on the budget sweep's models: its curve, seeds, splits, budget, ``δ`` and probe batch.

    Args:
        name: the configuration's name (``"budget"``, ``"tiny-budget"``).
        budget: the budget sweep's configuration (``budget_sweep.CONFIGS``).
        **changes: other :class:`ViewsConfig` fields (e.g. ``costs``).

    Returns:
        A :class:`ViewsConfig` with ``budget`` set and no ``L_depth`` measurement (a penalty changes
        training, so its models would not be the budget sweep's).
    """
    fields: dict[str, Any] = {
        "name": name,
        "curves": (S.Curve(budget.dataset, "mlp", budget.depths, budget.width),),
        "seeds": budget.seeds,
        "sizes": {budget.dataset: budget.sizes},
        "recipe": budget.budget,
        "delta": budget.delta,
        "probe_batch": budget.probe_batch,
        "reg_datasets": (),
        "budget": budget,
    }
    return ViewsConfig(**(fields | changes))


CONFIGS["budget"] = budget_views_config("budget", B.CONFIGS["full"])
CONFIGS["tiny-budget"] = budget_views_config("tiny-budget", B.CONFIGS["tiny"])

#: Where each configuration writes by default (others: a new temporary folder, see ``default_folder``).
_DEFAULT_OUT = {"full": "views", "budget": "views-budget"}

#: The fields of the budget sweep's configuration that make its models (the rest chooses which run).
_MODEL_FIELDS = ("dataset", "width", "sizes", "budget", "model")


# ----------------------------------------------------------------------------- reading the sweep
def read_sweep_plateaus(folder: str | Path) -> dict[str, Any]:
    """The sweep's plateau depths of performance per curve, and the recipe it ran with.

    Args:
        folder: the sweep's result folder (holding ``summary.json``).

    Returns:
        ``{"plateaus": {"digits/mlp": depth, …}, "metric": {"digits/mlp": "test_loss", …},
        "recipe": {...} or None, "commit": str or None}``; a curve the sweep skipped is absent.

    Raises:
        ExperimentError: no readable ``summary.json`` there, or one without plateaus.
    """
    path = Path(folder) / "summary.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ExperimentError(
            f"--sweep {folder}: cannot read {path.name} ({exc}); run `depthsat experiment sweep` first"
        ) from None
    rows = data.get("summary", {}).get("plateaus")
    if not isinstance(rows, list):
        raise ExperimentError(f"--sweep {folder}: {path.name} has no summary.plateaus (not a sweep result)")
    plateaus, metric = {}, {}
    for r in rows:
        name = f"{r['dataset']}/{r['arch']}"
        want = "test_bpc" if r["dataset"] == "kjv" else "test_loss"
        if r["metric"] == want:  # None (null): the sweep's curve still falls at its deepest depth
            plateaus[name] = None if r["plateau_depth"] is None else int(r["plateau_depth"])
            metric[name] = want
    meta = data.get("meta", {})
    return {
        "plateaus": plateaus,
        "metric": metric,
        "recipe": meta.get("config", {}).get("recipe"),
        "commit": meta.get("commit"),
        "runs": _sweep_runs(Path(folder) / "runs.csv"),
    }


def _sweep_runs(path: Path) -> dict[tuple[str, str, int, int], dict[str, float]] | None:
    """The sweep's test loss per ``(dataset, arch, seed, depth)`` from its ``runs.csv`` (``None`` without one)."""
    import csv

    if not path.is_file():
        return None
    with open(path, newline="") as fh:
        return {
            (r["dataset"], r["arch"], int(r["seed"]), int(r["depth"])): {"test_loss": float(r["test_loss"])}
            for r in csv.DictReader(fh)
        }


def read_budget_sweep(folder: str | Path) -> dict[str, Any]:
    """The budget sweep's plateau depth, the configuration it ran with, and its per-model numbers.

    Args:
        folder: the budget sweep's result folder (``summary.json``, ``runs.csv``, ``sites.csv``).

    Returns:
        ``{"plateaus": {"fashion/mlp": depth}, "metric": {…: "test_loss"}, "depth_pays": bool,
        "recipe": {the configuration's model-making fields} or None, "commit": str or None,
        "runs": {(dataset, "mlp", seed, depth): {"test_loss", "train_loss", "s_last"}}}`` — the plateau is
        ``claims.precondition.test_loss_plateau_depth`` (``sweep.plateau_depth`` of the mean test
        loss), ``s_last`` the probe's ``s`` at the deepest site.

    Raises:
        ExperimentError: no readable ``summary.json`` or ``runs.csv`` there, or not a budget-sweep result.
    """
    import csv

    base = Path(folder)
    try:
        data = json.loads((base / "summary.json").read_text())
        with open(base / "runs.csv", newline="") as fh:
            runs = list(csv.DictReader(fh))
        with open(base / "sites.csv", newline="") as fh:
            sites = [r for r in csv.DictReader(fh) if r.get("split") == "probe" and r.get("s")]
    except (OSError, json.JSONDecodeError) as exc:
        raise ExperimentError(
            f"--sweep {folder}: cannot read the budget sweep's results ({exc}); run `depthsat experiment "
            "budget-sweep` first"
        ) from None
    pre = data.get("summary", {}).get("claims", {}).get("precondition", {})
    config = data.get("meta", {}).get("config", {})
    if "test_loss_plateau_depth" not in pre or "dataset" not in config:
        raise ExperimentError(f"--sweep {folder}: summary.json has no claims.precondition (not a budget-sweep result)")
    name = f"{config['dataset']}/mlp"
    table: dict[tuple[str, str, int, int], dict[str, float]] = {}
    ds = config["dataset"]
    for r in runs:
        losses = {"test_loss": float(r["test_loss"]), "train_loss": float(r["train_loss"])}
        table[(ds, "mlp", int(r["seed"]), int(r["depth"]))] = losses
    for r in sites:  # file order is site order: the last row of a model with an s is its deepest site
        table.setdefault((ds, "mlp", int(r["seed"]), int(r["depth"])), {})["s_last"] = float(r["s"])
    return {
        "plateaus": {name: None if pre["test_loss_plateau_depth"] is None else int(pre["test_loss_plateau_depth"])},
        "metric": {name: "test_loss"},
        "depth_pays": pre.get("holds"),
        "recipe": {k: config.get(k) for k in _MODEL_FIELDS},
        "commit": data.get("meta", {}).get("commit"),
        "runs": table,
    }


# ----------------------------------------------------------------------------- the rules
def snap_depth(value: float, grid: Sequence[int]) -> int:
    """The smallest depth of ``grid`` that is ``>= value`` (the largest if none; the smallest for ``value <= 0``).

    Args:
        value: the depth to round up (e.g. an interpolated plateau).
        grid: the trained depths.

    Returns:
        A depth of ``grid`` (``value`` is compared with a ``1e-9`` slack).

    Raises:
        ValueError: an empty grid or a NaN value.
    """
    if not grid:
        raise ValueError("snap_depth: empty depth grid")
    if math.isnan(value):
        raise ValueError("snap_depth: NaN")
    g = sorted(grid)
    return next((d for d in g if d >= value - 1e-9), g[-1])


def _steps_apart(a: int, b: int, grid: Sequence[int]) -> int:
    g = sorted(grid)
    return abs(g.index(a) - g.index(b))


def influence_count(bi: Sequence[float], mass: float) -> int:
    """The fewest blocks whose block influence sums to at least ``mass`` of the total.

    Args:
        bi: per-block influence (``>= 0``; tiny negatives from rounding count as 0).
        mass: the fraction, ``0 < mass <= 1``.

    Returns:
        A count in ``1 … L`` (``L`` when every influence is 0: nothing can be dropped by this rule
        without evidence... rather: no block is shown to matter, and none is shown redundant).

    Raises:
        ValueError: empty input, NaN, or ``mass`` outside ``(0, 1]``.
    """
    b = np.clip(np.asarray(bi, dtype=np.float64), 0.0, None)
    if b.size == 0 or not np.all(np.isfinite(b)):
        raise ValueError(f"influence_count: need finite per-block influences, got {list(bi)}")
    if not 0 < mass <= 1:
        raise ValueError(f"mass must be in (0, 1], got {mass}")
    total = b.sum()
    if total == 0:
        return int(b.size)
    c = np.cumsum(np.sort(b)[::-1])
    return int(np.argmax(c >= mass * total - 1e-12) + 1)


def curve_verdicts(
    curve: S.Curve,
    s_last_mean: Sequence[float],
    oracle_depth_deepest: float,
    bi_deepest: Sequence[float],
    sweep_plateau: int | None,
    *,
    mass: float,
    certified: bool,
    retrained_plateau: int | None = None,
) -> dict[str, Any]:
    """Where each view says depth stops paying on one curve, and whether they agree (:data:`RULES`).

    Args:
        curve: the curve (its depth grid).
        s_last_mean: mean over seeds of ``s`` at the deepest site, per depth of the grid.
        oracle_depth_deepest: mean over seeds of the expected oracle stopping depth (reference
            cost) of the curve's deepest model.
        bi_deepest: mean over seeds of the deepest model's block influence per block.
        sweep_plateau: the sweep's plateau depth (``None`` if the sweep has no such curve).
        mass: the block-influence mass.
        certified: whether any first-order interval was non-vacuous on the curve.
        retrained_plateau: the plateau depth of the mean test loss of the models retrained here
            (the same rule as the sweep's); compared like the sweep plateau (``agree_retrained_*``,
            ``all_agree_retrained``).

    Returns:
        ``{"first_order", "stopping", "block_influence", "sweep_plateau", "retrained_plateau"}``
        depths, the raw values, ``agree_*`` flags with the sweep plateau, ``all_agree`` (``None``
        without a sweep plateau or with a sweep plateau off the grid), and the same against the
        retrained plateau.
    """
    grid = list(curve.depths)
    fo = S.plateau_depth(grid, list(s_last_mean))
    stop = snap_depth(oracle_depth_deepest, grid)
    bi_n = influence_count(bi_deepest, mass)
    bi = snap_depth(bi_n, grid)
    out: dict[str, Any] = {
        "first_order": fo,
        "first_order_basis": "certified" if certified else "point estimate",
        "stopping": stop,
        "stopping_expected_depth": oracle_depth_deepest,
        "block_influence": bi,
        "block_influence_count": bi_n,
        "sweep_plateau": sweep_plateau,
        "retrained_plateau": retrained_plateau,
    }
    views = {"first_order": fo, "stopping": stop, "block_influence": bi}
    for tag, ref in (("", sweep_plateau), ("retrained_", retrained_plateau)):
        if ref is None or ref not in grid:
            out.update({f"agree_{tag}{k}": None for k in views} | {f"all_agree{'_' + tag[:-1] if tag else ''}": None})
            continue
        for k, v in views.items():  # a view whose curve still falls (None) does not agree with a plateau
            out[f"agree_{tag}{k}"] = v is not None and _steps_apart(v, ref, grid) <= 1
        out[f"all_agree{'_' + tag[:-1] if tag else ''}"] = all(out[f"agree_{tag}{k}"] for k in views)
    return out


# ----------------------------------------------------------------------------- one model
def _exit_tables(model, splits: R.Splits, l2: float):
    from depthsat_theory import views as V

    if splits.kind == "text":
        return (
            V.logit_lens_table(model, splits.val.x, splits.val.y),
            V.logit_lens_table(model, splits.test.x, splits.test.y),
        )
    ro = V.fit_linear_readouts(model, splits.train.x, splits.train.y, splits.n_classes, l2=l2)
    units = splits.loss_units
    return (
        V.readout_table(model, ro, splits.val.x, splits.val.y, units=units),
        V.readout_table(model, ro, splits.test.x, splits.test.y, units=units),
    )


def _site_depth(site: str) -> int:
    """Sites of the toolkit's models → depth index: ``embed`` → 0, ``blocks.i`` → ``i + 1``."""
    if site == "embed":
        return 0
    return int(site.split(".")[-1]) + 1


def _trained(cfg: ViewsConfig, curve: S.Curve, depth: int, seed: int, splits: R.Splits):
    """The model of ``(curve, depth, seed)`` and its metrics (the sweep's recipe or the budget sweep's training)."""
    if cfg.budget is None:
        model = R.build_model(curve.arch, depth, splits, seed=seed, width=curve.width)
        assert isinstance(cfg.recipe, R.Recipe)
        result = R.train(model, splits, seed=seed, recipe=cfg.recipe)
        metrics = {
            "test_loss": result.metrics["test"]["loss"],
            "test_accuracy": result.metrics["test"]["accuracy"],
            "epochs": result.epochs,
        }
        return result.model, metrics
    model, fit = B._train(cfg.budget, splits, depth, seed)
    test = R.evaluate(model, splits.test, splits)
    metrics = {
        "test_loss": test["loss"],
        "test_accuracy": test["accuracy"],
        "train_loss": R.evaluate(model, splits.train, splits)["loss"],
        "steps": fit["steps"],
    }
    return model, metrics


def _one_model(cfg: ViewsConfig, curve: S.Curve, depth: int, seed: int, splits: R.Splits) -> dict[str, Any]:
    from depthsat_theory import views as V

    t0 = time.time()
    key = {"dataset": curve.dataset, "arch": curve.arch, "depth": depth, "seed": seed}
    model, metrics = _trained(cfg, curve, depth, seed, splits)
    sites = {
        _site_depth(r["site"]): r for r in S.site_rows(model, splits, delta=cfg.delta, probe_batch=cfg.probe_batch)
    }
    val, test = _exit_tables(model, splits, cfg.readout_l2)
    _, st = V.capture_stream(model, splits.probe.x)
    bi, rho = V.block_influence(st), V.update_ratios(st)
    dr = V.diminishing_returns(rho.tolist(), test.mean_loss().tolist())
    exit_loss, exit_acc = test.mean_loss(), test.accuracy()
    oracle_c = V.oracle_stopping_depth(test.losses, cfg.reference_cost)
    site_rows = []
    for k in range(depth + 1):
        sr = sites.get(k, {})
        site_rows.append(
            {
                **key,
                "l": k,
                "site": sr.get("site", "(input of blocks.0)"),
                "verdict": sr.get("verdict"),
                "noise_verdict": sr.get("noise_verdict"),
                "s": sr.get("s"),
                "s_u_over_ag_rms": sr.get("rel_u"),
                "s_over_ag_rms": sr.get("s_over_ag_rms"),
                "vacuous": sr.get("vacuous"),
                "block_influence": None if k == 0 else bi[k - 1],
                "update_ratio": None if k == 0 else rho[k - 1],
                "exit_loss": exit_loss[k],
                "exit_accuracy": exit_acc[k],
                "loss_decrease": None if k == 0 else exit_loss[k - 1] - exit_loss[k],
                "oracle_share": float(np.mean(oracle_c == k)),
            }
        )
    stops = V.stopping_summary(test, cfg.costs, val)
    stop_rows: list[dict[str, Any]] = []
    hist_rows: list[dict[str, Any]] = []
    for s in stops:
        stop_rows.append(
            {
                **key,
                "policy": s.policy,
                "cost": s.cost,
                "expected_depth": s.expected_depth,
                "std_depth": s.std_depth,
                "loss_at_stop": s.loss_at_stop,
                "accuracy_at_stop": s.accuracy_at_stop,
                "risk": s.risk,
                "full_depth_loss": float(exit_loss[-1]),
                "tau": s.tau,
            }
        )
        hist_rows.extend(
            {**key, "policy": s.policy, "cost": s.cost, "l": k, "count": n} for k, n in enumerate(s.histogram)
        )
    last = [r for r in site_rows if r["s"] is not None][-1]
    run = {
        **key,
        **metrics,
        "readout": test.readout,
        "units": test.units,
        "s_last": last["s"],
        "rel_last": last["s_over_ag_rms"],
        "n_improvable": sum(r["verdict"] == "improvable" for r in sites.values()),
        "n_saturated": sum(r["verdict"] == "saturated" for r in sites.values()),
        "n_undetermined": sum(r["verdict"] == "undetermined" for r in sites.values()),
        "n_vacuous": sum(bool(r["vacuous"]) for r in sites.values()),
        "updates_diminish": dr["updates_diminish"],
        "loss_decrease_diminishes": dr["loss_decrease_diminishes"],
        "diminishing_returns": dr["holds"],
        "model_wall_s": round(time.time() - t0, 2),
    }
    return {"run": run, "sites": site_rows, "stopping": stop_rows, "hist": hist_rows, "bi": bi.tolist()}


def _reg_model(cfg: ViewsConfig, dataset: str, seed: int, lam: float, splits: R.Splits) -> dict[str, Any]:
    from depthsat_theory import views as V

    t0 = time.time()
    if not isinstance(cfg.recipe, R.Recipe):
        raise ExperimentError(f"L_depth needs the early-stopping recipe (it changes training), not {cfg.recipe}")
    recipe = dataclasses.replace(cfg.recipe, depth_reg=float(lam))
    model = R.build_model(cfg.reg_arch, cfg.reg_depth, splits, seed=seed, width=cfg.reg_width)
    result = R.train(model, splits, seed=seed, recipe=recipe)
    val, test = _exit_tables(result.model, splits, cfg.readout_l2)
    _, st = V.capture_stream(result.model, splits.probe.x)
    row: dict[str, Any] = {
        "dataset": dataset,
        "arch": cfg.reg_arch,
        "depth": cfg.reg_depth,
        "seed": seed,
        "lambda": lam,
        "test_loss": result.metrics["test"]["loss"],
        "test_accuracy": result.metrics["test"]["accuracy"],
        "l_depth_probe": float(V.depth_regularizer(st)),
        "epochs": result.epochs,
    }
    for s in V.stopping_summary(test, cfg.costs, val):
        row[f"{s.policy}_depth_c{s.cost:g}"] = s.expected_depth
        row[f"{s.policy}_acc_c{s.cost:g}"] = s.accuracy_at_stop
    row["wall_s"] = round(time.time() - t0, 2)
    return row


# ----------------------------------------------------------------------------- figure
def _figure(cfg: ViewsConfig, curves: list[S.Curve], sites: list[dict], stopping: list[dict], verdicts: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(curves), figsize=(4.2 * len(curves), 7), squeeze=False)
    for j, curve in enumerate(curves):
        deep = max(curve.depths)
        ax = axes[0][j]
        mine = [r for r in sites if (r["dataset"], r["arch"], r["depth"]) == (curve.dataset, curve.arch, deep)]
        ls = sorted({r["l"] for r in mine if r["l"] > 0})

        def mean_of(key: str, ls=ls, mine=mine) -> list[float]:
            return [float(np.mean([r[key] for r in mine if r["l"] == k and r[key] is not None])) for k in ls]

        ax.plot(ls, mean_of("block_influence"), "o-", label="block influence 1−cos")
        ax.plot(ls, mean_of("update_ratio"), "s-", label="‖f_l‖/‖z‖")
        ax.plot(ls, mean_of("s_over_ag_rms"), "^-", label="s/AG_rms (site after block)")
        dec = mean_of("loss_decrease")
        ax.plot(ls, dec, "d--", label="exit-loss decrease")
        ax.axhline(0, color="0.8", lw=0.8)
        ax.set_title(f"{curve.name}, {deep} blocks (mean of seeds)", fontsize=9)
        ax.set_xticks(ls)
        ax.set_xlabel("block l")
        if j == 0:
            ax.legend(fontsize=7)
        ax = axes[1][j]
        for c in cfg.costs:
            pts = [
                (
                    d,
                    np.mean(
                        [
                            r["expected_depth"]
                            for r in stopping
                            if (r["dataset"], r["arch"], r["depth"], r["policy"], r["cost"])
                            == (curve.dataset, curve.arch, d, "oracle", c)
                        ]
                    ),
                )
                for d in curve.depths
            ]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"oracle E[τ], c={c:g}")
        ax.plot(curve.depths, curve.depths, color="0.7", lw=0.8, label="all blocks")
        v = verdicts.get(curve.name, {})
        if v.get("sweep_plateau") is not None:
            ax.axvline(v["sweep_plateau"], color="k", ls=":", label="sweep plateau")
        if v.get("retrained_plateau") is not None:
            ax.axvline(v["retrained_plateau"], color="0.5", ls="-.", lw=0.8, label="retrained plateau")
        if v.get("first_order") is not None:
            ax.axvline(v["first_order"], color="C3", ls="--", lw=0.8, label="first-order plateau of s")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(curve.depths), [str(d) for d in curve.depths])
        ax.set_xlabel("model depth (blocks)")
        ax.set_ylabel("expected stopping depth")
        if j == 0:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- the run
def _resolve(config: str | ViewsConfig) -> ViewsConfig:
    if isinstance(config, ViewsConfig):
        return config
    if config not in CONFIGS:
        raise ExperimentError(f"--config {config!r}: choose one of {', '.join(CONFIGS)}")
    return CONFIGS[config]


def _read_sweep(cfg: ViewsConfig, sweep: str | Path | None) -> tuple[Path, dict[str, Any], bool | None]:
    """The sweep folder, what it says, and whether it ran with this configuration's recipe (None: unknown)."""
    default = "budget-sweep" if cfg.budget is not None else "sweep"
    sweep_dir = Path(sweep) if sweep is not None else DEFAULT_RESULTS_ROOT / default
    if cfg.name == "tiny" and sweep is None and not (sweep_dir / "summary.json").is_file():
        return sweep_dir, {"plateaus": {}, "metric": {}, "recipe": None, "commit": None}, None
    if cfg.budget is None:
        sw = read_sweep_plateaus(sweep_dir)
        return sweep_dir, sw, None if sw["recipe"] is None else sw["recipe"] == cfg.recipe.to_dict()
    sw = read_budget_sweep(sweep_dir)
    mine = cfg.budget.to_dict()
    return sweep_dir, sw, sw["recipe"] == {k: mine.get(k) for k in _MODEL_FIELDS}


@dataclass
class _Collected:
    runs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    sites: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    stopping: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    hist: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    bis: dict[tuple, list[float]] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)


class _Resume(ResumeFile):
    """Finished models, keyed by the configuration's hash (minus what chooses which models run)."""

    def __init__(self, path: str | Path | None, cfg: ViewsConfig):
        super().__init__(path, "finished-model")
        drop = ("name", "seeds", "curves", "rules", "reg_datasets", "reg_arch", "reg_depth", "reg_width", "reg_lambdas")
        self.tag = config_tag(json_ready(cfg.to_dict()), drop)

    def key(self, curve: S.Curve, depth: int, seed: int) -> str:
        return f"{self.tag}/{curve.name}/w{curve.width}/{depth}/{seed}"


def _train_curves(
    cfg: ViewsConfig, seeds: tuple[int, ...], col: _Collected, say: Callable[[str], None], done: _Resume
) -> list:
    ran: list[S.Curve] = []
    for curve in cfg.curves:
        reason = R.dataset_unavailable(curve.dataset)
        if reason:
            col.skipped[curve.name] = reason
            continue
        ran.append(curve)
        for seed in seeds:
            splits = None
            for depth in curve.depths:
                rec = done.done.get(done.key(curve, depth, seed))
                if rec is None:
                    splits = splits or R.load_splits(curve.dataset, seed, cfg.sizes.get(curve.dataset))
                    rec = json_ready(_one_model(cfg, curve, depth, seed, splits))
                    done.add(done.key(curve, depth, seed), rec)
                col.runs.append(rec["run"])
                col.sites.extend(rec["sites"])
                col.stopping.extend(rec["stopping"])
                col.hist.extend(rec["hist"])
                col.bis[(curve.name, depth, seed)] = rec["bi"]
                r = rec["run"]
                say(
                    f"{curve.name} depth {depth} seed {seed}: test loss {r['test_loss']:.4f}, "
                    f"s_last {r['s_last']:.3g}, {r['model_wall_s']:.1f} s"
                )
    return ran


def _stop_mean(stopping: list[dict], curve: S.Curve, depth: int, policy: str, c: float) -> dict[str, float]:
    key = (curve.dataset, curve.arch, depth, policy, c)
    return summarize(
        [r["expected_depth"] for r in stopping if (r["dataset"], r["arch"], r["depth"], r["policy"], r["cost"]) == key]
    )


def _curve_rows(cfg: ViewsConfig, curve: S.Curve, col: _Collected) -> list[dict[str, Any]]:
    out = []
    for depth in curve.depths:
        mine = [r for r in col.runs if (r["dataset"], r["arch"], r["depth"]) == (curve.dataset, curve.arch, depth)]
        row: dict[str, Any] = {"dataset": curve.dataset, "arch": curve.arch, "depth": depth}
        for k in ("test_loss", "test_accuracy", "s_last", "rel_last"):
            st = summarize([r[k] for r in mine])
            row[f"{k}_mean"], row[f"{k}_std"] = st["mean"], st["std"]
        for c in cfg.costs:
            for pol in ("oracle", "threshold"):
                st = _stop_mean(col.stopping, curve, depth, pol, c)
                row[f"{pol}_depth_c{c:g}_mean"], row[f"{pol}_depth_c{c:g}_std"] = st["mean"], st["std"]
        row["diminishing_returns_seeds"] = sum(bool(r["diminishing_returns"]) for r in mine)
        row["updates_diminish_seeds"] = sum(bool(r["updates_diminish"]) for r in mine)
        row["n_seeds"] = len(mine)
        out.append(row)
    return out


def _depth_reg(
    cfg: ViewsConfig, seeds: tuple[int, ...], col: _Collected, say: Callable[[str], None]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows = []
    for dataset in cfg.reg_datasets:
        reason = R.dataset_unavailable(dataset)
        if reason:
            col.skipped[f"depth_reg/{dataset}"] = reason
            continue
        for seed in seeds:
            splits = R.load_splits(dataset, seed, cfg.sizes.get(dataset))
            for lam in cfg.reg_lambdas:
                row = _reg_model(cfg, dataset, seed, lam, splits)
                rows.append(row)
                say(f"L_depth {dataset} lambda {lam:g} seed {seed}: test acc {row['test_accuracy']:.4f}")
    summary: dict[str, Any] = {}
    c_ref = f"c{cfg.reference_cost:g}"
    keys = ("test_accuracy", "test_loss", f"oracle_depth_{c_ref}", f"threshold_depth_{c_ref}", "l_depth_probe")
    for dataset in sorted({r["dataset"] for r in rows}):
        for lam in cfg.reg_lambdas:
            mine = [r for r in rows if r["dataset"] == dataset and r["lambda"] == lam]
            summary[f"{dataset}/lambda={lam:g}"] = {k: summarize([r[k] for r in mine]) for k in keys}
    return rows, summary


def _verdicts(
    cfg: ViewsConfig, ran: list[S.Curve], col: _Collected, seeds: tuple[int, ...], sw: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``curves.csv``'s rows and the per-curve verdicts (:func:`curve_verdicts`)."""
    curves_rows: list[dict[str, Any]] = []
    verdicts: dict[str, Any] = {}
    for curve in ran:
        crow = _curve_rows(cfg, curve, col)
        curves_rows.extend(crow)
        deep = max(curve.depths)
        mine = [r for r in col.sites if (r["dataset"], r["arch"]) == (curve.dataset, curve.arch) and r["s"] is not None]
        verdicts[curve.name] = curve_verdicts(
            curve,
            [r["s_last_mean"] for r in crow],
            crow[-1][f"oracle_depth_c{cfg.reference_cost:g}_mean"],
            np.mean([col.bis[(curve.name, deep, s)] for s in seeds], axis=0).tolist(),
            sw["plateaus"].get(curve.name),
            mass=cfg.influence_mass,
            certified=any(not r["vacuous"] for r in mine),
            retrained_plateau=S.plateau_depth(list(curve.depths), [r["test_loss_mean"] for r in crow]),
        )
    return curves_rows, verdicts


#: The largest difference allowed between a retrained model's loss and the budget sweep's committed ``runs.csv``.
REPRODUCTION_TOL = 1e-12


def _reproduction(runs: list[dict[str, Any]], sw: dict[str, Any]) -> dict[str, Any] | None:
    """Add the committed numbers to each run row and say whether every retrained model is the committed one.

    When the sweep folder has a ``runs.csv`` (``sw["runs"]``): per model the committed values it has
    (``committed_test_loss``; for the budget sweep also ``committed_train_loss`` and
    ``committed_s_last``, the probe's ``s`` at the deepest site) and ``reproduced`` (test and, where
    committed, train loss within :data:`REPRODUCTION_TOL`).
    """
    table = sw.get("runs")
    if table is None:
        return None
    diffs: dict[str, list[float]] = {"test_loss": [], "train_loss": [], "s_last": []}
    missing = []
    for r in runs:
        key = (r["dataset"], r["arch"], r["seed"], r["depth"])
        ref = table.get(key)
        if ref is None:
            missing.append(key)
            r["reproduced"] = None
            continue
        for k in diffs:
            if k in ref:
                r[f"committed_{k}"] = ref[k]
                diffs[k].append(abs(r[k] - ref[k]))
        losses = [k for k in ("test_loss", "train_loss") if k in ref]
        r["reproduced"] = all(abs(r[k] - ref[k]) <= REPRODUCTION_TOL for k in losses)
        r["bitwise"] = all(r[k] == ref[k] for k in losses)
    return {
        "models": len(runs),
        "compared": len(runs) - len(missing),
        "not_in_committed_runs": missing,
        "reproduced": sum(bool(r["reproduced"]) for r in runs),
        "bitwise_losses": sum(bool(r.get("bitwise")) for r in runs),
        **{f"max_abs_diff_{k}": (max(v) if v else None) for k, v in diffs.items()},
        "tolerance": REPRODUCTION_TOL,
        "rule": "reproduced: |test loss - committed| and, where committed, |train loss - committed| <= tolerance "
        "(nats per example)",
    }


def _sweep_note(recipe_matches: bool | None, reproduction: dict[str, Any] | None) -> str | None:
    if recipe_matches is False:
        return "the sweep's plateaus come from a run with another recipe than the models retrained here"
    if reproduction and reproduction["reproduced"] < reproduction["compared"]:
        return (
            f"{reproduction['compared'] - reproduction['reproduced']} of {reproduction['compared']} retrained models "
            f"differ from the sweep's runs.csv (max |test loss diff| {reproduction['max_abs_diff_test_loss']:.3g}): "
            "read the views against the retrained plateau"
        )
    return None


def _per_seed_verdicts(
    cfg: ViewsConfig, ran: list[S.Curve], col: _Collected, seeds: tuple[int, ...], sw: dict[str, Any]
) -> dict[str, list[dict[str, Any]]]:
    """Each seed's own views (:func:`curve_verdicts` on that seed's models alone)."""
    out: dict[str, list[dict[str, Any]]] = {}
    c = cfg.reference_cost
    for curve in ran:
        deep = max(curve.depths)
        rows = []
        for seed in seeds:
            runs = {r["depth"]: r for r in col.runs if (r["dataset"], r["arch"], r["seed"]) == (*_ds(curve), seed)}
            oracle = [
                r["expected_depth"]
                for r in col.stopping
                if (r["dataset"], r["arch"], r["depth"], r["seed"], r["policy"], r["cost"])
                == (*_ds(curve), deep, seed, "oracle", c)
            ]
            v = curve_verdicts(
                curve,
                [runs[d]["s_last"] for d in curve.depths],
                oracle[0],
                col.bis[(curve.name, deep, seed)],
                sw["plateaus"].get(curve.name),
                mass=cfg.influence_mass,
                certified=False,
                retrained_plateau=S.plateau_depth(list(curve.depths), [runs[d]["test_loss"] for d in curve.depths]),
            )
            rows.append({"seed": seed, **{k: v[k] for k in (*_VIEWS, *_REFS, "all_agree", "all_agree_retrained")}})
        out[curve.name] = rows
    return out


def _ds(curve: S.Curve) -> tuple[str, str]:
    return curve.dataset, curve.arch


_VIEWS = ("first_order", "stopping", "block_influence")
_REFS = ("sweep_plateau", "retrained_plateau")


def _depth_text(d: int | None) -> str:
    return "not reached" if d is None else str(d)


def views_claims(
    verdicts: dict[str, dict[str, Any]], per_seed: dict[str, list[dict[str, Any]]], setting: dict[str, str]
) -> list[dict[str, str]]:
    """The ``"Views agree"`` claim rows (``record.CLAIM_KEYS``), one per curve, by :data:`RULES` ``["claim"]``.

    Args:
        verdicts: :func:`curve_verdicts` per curve (means over seeds), with ``grid_min``/``grid_max``.
        per_seed: the same per seed (:func:`_per_seed_verdicts`).
        setting: per curve, the setting's one-line description.

    Returns:
        Rows with exactly the keys ``claim, setting, verdict, qualifier, interval, reason``; a view or
        plateau of ``None`` (its curve still falls at the deepest depth run) reads "not reached".
    """
    rows = []
    for name, v in verdicts.items():
        depths = {k: v[k] for k in _VIEWS}
        seeds = per_seed.get(name, [])
        said = ", ".join(f"{k.replace('_', '-')} {_depth_text(d)}" for k, d in depths.items())
        interval = (
            f"{said} against the test-loss plateau {_depth_text(v['sweep_plateau'])} (blocks, means over "
            f"{len(seeds)} seeds; per seed: "
            + "; ".join("/".join(_depth_text(r[k]) for k in _VIEWS) for r in seeds)
            + " first-order/stopping/block-influence)"
        )
        verdict, qualifier, reason = _views_verdict(v, depths, seeds, said)
        rows.append(
            {
                "claim": "Views agree",
                "setting": setting.get(name, name),
                "verdict": verdict,
                "qualifier": qualifier,
                "interval": interval,
                "reason": reason,
            }
        )
    return rows


def _views_verdict(
    v: dict[str, Any], depths: dict[str, int | None], seeds: list[dict[str, Any]], said: str
) -> tuple[str, str, str]:
    """``(verdict, qualifier, reason)`` of one curve's ``Views agree`` row (:data:`RULES` ``["claim"]``)."""
    plateau = v["sweep_plateau"]
    if plateau is None:
        return (
            "untestable here",
            "",
            "no test-loss plateau (none given, or the test loss still falls at the deepest depth)",
        )
    if v["all_agree"] is None:
        return "untestable here", "", f"the test-loss plateau {plateau} is not on this curve's depth grid"
    if plateau == v.get("grid_min"):
        return "untestable here", "", f"the test loss plateaus at the shallowest depth ({plateau}): depth never pays"
    n_all = sum(bool(r["all_agree"]) for r in seeds)
    exact = sum(d == plateau for d in depths.values())
    qualifier = f"all within one step in {n_all} of {len(seeds)} seeds; exactly at {plateau}: {exact} of 3"
    deepest = [k.replace("_", "-") for k, d in depths.items() if d == v.get("grid_max") != plateau]
    if deepest:
        qualifier += f"; {', '.join(deepest)} at the deepest depth run (one step from {plateau} by the grid)"
    off = [k.replace("_", "-") for k in _VIEWS if not v[f"agree_{k}"]]
    if not off:
        return "holds", qualifier, f"every view is within one depth step of the plateau ({said}; plateau {plateau})"
    return "fails", qualifier, f"{', '.join(off)} not within one depth step of the plateau ({said}; plateau {plateau})"


def _setting(cfg: ViewsConfig, curve: S.Curve, seeds: tuple[int, ...]) -> str:
    depths = ", ".join(map(str, curve.depths))
    if cfg.budget is not None:
        b = cfg.budget.budget
        return (
            f"{curve.dataset} (budget-sweep models), residual MLP width {curve.width}, depths {depths}, "
            f"fixed cosine budget ({b.steps:,} steps of {b.batch_size}), {len(seeds)} seeds"
        )
    return f"{curve.name} width {curve.width}, depths {depths}, early-stopping recipe (sweep), {len(seeds)} seeds"


def run_views(
    config: str | ViewsConfig = "tiny",
    *,
    out: str | Path | None = None,
    sweep: str | Path | None = None,
    seeds: Sequence[int] | None = None,
    resume: str | Path | None = None,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Run the views experiment and write its results atomically.

    Args:
        config: ``"tiny"``, ``"full"``, ``"budget"``, ``"tiny-budget"`` (:data:`CONFIGS`) or a
            :class:`ViewsConfig`.
        out: the result folder (default ``experiments/results/views`` for ``full``,
            ``experiments/results/views-budget`` for ``budget``, a new temporary folder otherwise).
        sweep: the sweep's result folder whose plateau depths are compared (default
            ``experiments/results/sweep``, or ``experiments/results/budget-sweep`` for a configuration
            on the budget sweep's models; for ``tiny`` a missing default folder is allowed: no plateau).
        seeds: seeds (default: the configuration's).
        resume: a JSON-lines file of finished models, reused and appended to.
        log: called with one line per model.

    Returns:
        The result folder.

    Raises:
        ExperimentError: an unknown configuration, bad seeds, an unreadable sweep folder, or no
            curve whose data is available (nothing is written then).
    """
    started = time.time()
    cfg = _resolve(config)
    seeds = tuple(cfg.seeds if seeds is None else seeds)
    if not seeds or len(set(seeds)) != len(seeds):
        raise ExperimentError(f"--seeds: give distinct seeds, got {list(seeds)}")
    sweep_dir, sw, recipe_matches = _read_sweep(cfg, sweep)
    say = log or (lambda _m: None)
    col = _Collected()
    ran = _train_curves(cfg, seeds, col, say, _Resume(resume, cfg))
    if not ran:
        raise ExperimentError(f"no data set available: {col.skipped}")
    reproduction = _reproduction(col.runs, sw)
    curves_rows, verdicts = _verdicts(cfg, ran, col, seeds, sw)
    for curve in ran:
        verdicts[curve.name].update(grid_min=min(curve.depths), grid_max=max(curve.depths))
    per_seed = _per_seed_verdicts(cfg, ran, col, seeds, sw)
    reg_rows, reg_summary = _depth_reg(cfg, seeds, col, say)
    summary = {
        "skipped": col.skipped,
        "sweep": {
            "folder": str(sweep_dir),
            "commit": sw["commit"],
            "recipe": sw["recipe"],
            "recipe_matches": recipe_matches,
            "depth_pays": sw.get("depth_pays"),
            "note": _sweep_note(recipe_matches, reproduction),
        },
        "reproduction": reproduction,
        "reference_cost": cfg.reference_cost,
        "verdicts": verdicts,
        "verdicts_per_seed": per_seed,
        "curves_all_agree": sum(bool(v.get("all_agree")) for v in verdicts.values()),
        "curves_all_agree_retrained": sum(bool(v.get("all_agree_retrained")) for v in verdicts.values()),
        "curves": len(verdicts),
        "diminishing_returns_models": sum(bool(r["diminishing_returns"]) for r in col.runs),
        "updates_diminish_models": sum(bool(r["updates_diminish"]) for r in col.runs),
        "models": len(col.runs),
        "depth_reg": reg_summary,
        "rules": RULES,
    }
    claims = views_claims(verdicts, per_seed, {c.name: _setting(cfg, c, seeds) for c in ran})
    default = _DEFAULT_OUT.get(cfg.name)
    folder = (
        Path(out)
        if out is not None
        else (DEFAULT_RESULTS_ROOT / default if default else default_folder("views", cfg.name))
    )
    tables = {
        "runs": col.runs,
        "sites": col.sites,
        "stopping": col.stopping,
        "stopping_hist": col.hist,
        "curves": curves_rows,
    }
    if cfg.reg_datasets:
        tables["depth_reg"] = reg_rows
    return write_results(
        folder,
        tables=tables,
        summary=summary,
        claims=claims,
        figures={"views": _figure(cfg, ran, col.sites, col.stopping, verdicts)},
        meta=provenance(seeds=seeds, config=cfg.to_dict(), started=started),
    )
