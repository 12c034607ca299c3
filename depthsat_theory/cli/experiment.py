"""``depthsat experiment …``: the paper's experiments and the views of seeds 002/003.

Every command takes ``--config tiny|full`` (``tiny`` is the bounded size CI runs) and ``--out``
(default ``experiments/results/<name>``) and writes there atomically
(:func:`depthsat_theory.experiments.write_results`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import typer

from depthsat_theory.cli.render import fail
from depthsat_theory.grow.errors import GrowError
from depthsat_theory.io import unwritable_reason

__all__ = ["EXPERIMENTS", "experiment_app"]

experiment_app = typer.Typer(
    no_args_is_help=True,
    help="Reproduce the paper's experiments (depth sweep, growth against scratch, local insertion, "
    "criterion-driven growth, LLM expansion) and the views of seeds 002/003; results go to "
    "experiments/results/<name>/.",
)


# ----------------------------------------------------------------------------- the registry for `all`
#: What ``depthsat experiment all`` runs, in this order, as ``{name: runner(config, out, log)}``.
#: Each experiment module registers its runner here next to its command.
EXPERIMENTS: dict[str, Callable[..., Path]] = {}


def _sweep_runner(config: str, out: Path, log) -> Path:
    from depthsat_theory.experiments.sweep import run_sweep

    return run_sweep(config, out=out, progress=log)


# first: criterion-driven growth reads the sweep's summary.json
EXPERIMENTS["sweep"] = _sweep_runner


def _seeds(text: str | None) -> list[int] | None:
    if text is None:
        return None
    if not text.strip(" ,"):
        fail(f"--seeds {text!r}: give comma-separated integers, e.g. 0,1,2")
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        fail(f"--seeds {text!r}: give comma-separated integers, e.g. 0,1,2")
    if any(s < 0 for s in seeds):
        fail(f"--seeds {text!r}: seeds are non-negative integers, e.g. 0,1,2")
    return seeds


def _check_out(out: Path | None, flag: str = "--out") -> None:
    """Refuse, before any training, a result folder that could not be written at the end."""
    if out is None:
        return
    if str(out) == "-":
        fail(f"{flag} -: results are a folder, not stdout; name a folder")
    for folder in (Path(out), *Path(out).parents):
        if folder.exists():
            if not folder.is_dir():
                fail(f"{flag} {out}: {folder} exists and is not a folder; name a folder")
            why = unwritable_reason(folder)
            if why is not None:
                fail(f"{flag} {out}: the folder {folder} is not writable ({why})")
            return


def _run(runner: Callable[..., Path], **kwargs) -> None:
    from depthsat_theory.experiments import ExperimentError
    from depthsat_theory.experiments.recipe import DatasetUnavailable

    _check_out(kwargs.get("out"))
    try:
        folder = runner(log=typer.echo, **kwargs)
    except (ExperimentError, DatasetUnavailable, GrowError) as exc:
        fail(exc)
    typer.echo(f"results written to {folder}")


_CONFIG = typer.Option("full", "--config", help="tiny (CI, seconds) or full (the committed results).")
_SEEDS = typer.Option(None, "--seeds", help="Comma-separated seeds (default: the configuration's).")
_DATASET = typer.Option(
    None, "--dataset", help="Image data set(s): digits, mnist5k, fashion (default: the configuration's)."
)


# ----------------------------------------------------------------------------- depth sweep (C1) and insertion (C3)
@experiment_app.command("sweep")
def sweep_command(
    config: str = _CONFIG,
    out: Path | None = typer.Option(None, "--out", help="Result folder (default experiments/results/sweep)."),
    seeds: str | None = _SEEDS,
    resume: Path | None = typer.Option(
        None, "--resume", help="JSON-lines file of finished models: reused when present, appended as models finish."
    ),
    curve: list[str] | None = typer.Option(
        None, "--curve", help="Run only this curve (repeatable), e.g. digits/mlp, kjv/gpt (default: all)."
    ),
) -> None:
    """Depth sweep (C1) with local insertion at every site (C3).

    Residual MLPs and small ResNet CNNs on digits, MNIST-5k and Fashion-MNIST and a character GPT
    on the King James text, trained to early stopping at each depth and seed with one recipe;
    each is diagnosed on a held-out probe (s, s/AG_rms, AG_rms, AG_max, intervals, verdicts at
    every site), probed by inserting a zero-output block at every site (predicted against measured
    first-step decrease), and each curve's plateau depth is found by one rule.
    """
    from depthsat_theory.experiments.sweep import run_sweep

    _run(
        lambda log, **kw: run_sweep(progress=log, **kw),
        config=config,
        out=out,
        seeds=_seeds(seeds),
        resume=resume,
        curves=curve,
    )


# ----------------------------------------------------------------------------- views side by side
def _views_runner(config: str, out: Path, log) -> Path:
    from depthsat_theory.experiments.views import run_views

    sweep = out.parent / "sweep"
    return run_views(config, out=out, sweep=sweep if (sweep / "summary.json").is_file() else None, log=log)


# after the sweep: it reads the sweep's plateau depths
EXPERIMENTS["views"] = _views_runner


def _csv_rows(folder: Path, name: str) -> list[dict[str, str]]:
    import csv

    with open(folder / f"{name}.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def _mean_text(vals: list[str | None]) -> str:
    xs = [float(v) for v in vals if v not in ("", None)]
    return f"{sum(xs) / len(xs):.3g}" if xs else "–"


def _views_site_table(sites: list[dict[str, str]]):
    from rich.table import Table

    t = Table(
        title="Per site (mean over seeds): first-order verdicts (seed votes), headline s_U/AG_rms, plug-in s/AG_rms, "
        "block influence, exits"
    )
    cols = ("curve", "depth", "l", "site", "verdicts", "s_U/AG_rms", "plug-in s/AG_rms", "1−cos", "‖f‖/‖z‖")
    for col in (*cols, "exit loss", "oracle share"):
        t.add_column(col)
    groups: dict[tuple, list[dict[str, str]]] = {}
    for r in sites:
        groups.setdefault((r["dataset"], r["arch"], int(r["depth"]), int(r["l"])), []).append(r)
    for (ds, arch, depth, lvl), mine in sorted(groups.items()):
        votes: dict[str, int] = {}
        for r in mine:
            if r["verdict"]:
                votes[r["verdict"]] = votes.get(r["verdict"], 0) + 1
        t.add_row(
            f"{ds}/{arch}",
            str(depth),
            str(lvl),
            mine[0]["site"],
            " ".join(f"{k}×{v}" for k, v in sorted(votes.items())) or "–",
            *[_mean_text([r.get(k) for r in mine]) for k in ("s_u_over_ag_rms", "s_over_ag_rms")],
            *[_mean_text([r[k] for r in mine]) for k in ("block_influence", "update_ratio")],
            *[_mean_text([r[k] for r in mine]) for k in ("exit_loss", "oracle_share")],
        )
    return t


def _views_depth_table(curves: list[dict[str, str]], cref: str, verdicts: dict):
    from rich.table import Table

    pre, suf = "oracle_depth_c", "_mean"
    costs = sorted((k[len(pre) : -len(suf)] for k in curves[0] if k.startswith(pre) and k.endswith(suf)), key=float)
    t = Table(title="Per model depth (mean over seeds): expected stopping depth E[τ] by cost c (nats per block)")
    heads = ["curve", "depth", "test loss", *[f"oracle c={c}" for c in costs], f"threshold c={cref}"]
    for col in [*heads, "dim. returns (seeds)", "sweep plateau"]:
        t.add_column(col)
    for r in curves:
        name = f"{r['dataset']}/{r['arch']}"
        t.add_row(
            name,
            r["depth"],
            f"{float(r['test_loss_mean']):.3f}",
            *[f"{float(r[f'oracle_depth_c{c}_mean']):.2f}" for c in costs],
            f"{float(r['threshold_depth_c' + cref + '_mean']):.2f}",
            f"{r['diminishing_returns_seeds']}/{r['n_seeds']}",
            str(verdicts.get(name, {}).get("sweep_plateau")),
        )
    return t


def _views_verdict_table(verdicts: dict):
    from rich.table import Table

    t = Table(title="Where depth stops paying (blocks), per view; agreement with the plateau (±1 depth step)")
    for col in (
        "curve",
        "first-order",
        "stopping E[τ]",
        "block influence",
        "sweep plateau",
        "all agree",
        "retrained plateau",
        "all agree (retrained)",
    ):
        t.add_column(col)
    for name, v in verdicts.items():
        t.add_row(
            name,
            f"{'not reached' if v['first_order'] is None else v['first_order']} ({v['first_order_basis']})",
            f"{v['stopping']} ({v['stopping_expected_depth']:.2f})",
            f"{v['block_influence']} ({v['block_influence_count']} blocks)",
            str(v["sweep_plateau"]),
            str(v["all_agree"]),
            str(v.get("retrained_plateau")),
            str(v.get("all_agree_retrained")),
        )
    return t


def _print_views(folder: Path) -> None:
    """Rich tables of a views result folder: per site, per model depth, per curve."""
    import json

    from depthsat_theory.cli import render

    data = json.loads((folder / "summary.json").read_text())["summary"]
    render.console.print(_views_site_table(_csv_rows(folder, "sites")))
    render.console.print(
        _views_depth_table(_csv_rows(folder, "curves"), f"{data['reference_cost']:g}", data["verdicts"])
    )
    render.console.print(_views_verdict_table(data["verdicts"]))
    if data.get("sweep", {}).get("note"):
        render.console.print(f"note: {data['sweep']['note']}", markup=False)
    rep = data.get("reproduction")
    if rep:
        render.console.print(
            f"reproduction: {rep['reproduced']} of {rep['models']} models have the committed test and train loss "
            f"(|diff| <= {rep['tolerance']:g}; bitwise {rep['bitwise_losses']}; max |diff| test "
            f"{rep['max_abs_diff_test_loss']}, train {rep['max_abs_diff_train_loss']})",
            markup=False,
        )


@experiment_app.command("views")
def views_command(
    config: str = typer.Option(
        "full",
        "--config",
        help="tiny (CI, seconds), full (the sweep's curves), budget (the budget sweep's Fashion-MNIST models; "
        "results in experiments/results/views-budget) or tiny-budget (CI).",
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Result folder (default experiments/results/views, or views-budget for --config budget)."
    ),
    seeds: str | None = _SEEDS,
    sweep: Path | None = typer.Option(
        None,
        "--sweep",
        help="The sweep's result folder (default experiments/results/sweep; experiments/results/budget-sweep "
        "for the budget configurations).",
    ),
    resume: Path | None = typer.Option(
        None, "--resume", help="JSON-lines file of finished models: reused when present, appended as they finish."
    ),
) -> None:
    """Views side by side: first-order verdicts, optimal stopping depth (seed 002), block influence, sweep plateau.

    Retrains a subset of the sweep's models (same recipe and seeds) or, with --config budget, the
    budget sweep's models (its own training function; each model's losses checked against its
    runs.csv), reads exits at every depth (logit lens for the GPT, fitted linear readouts
    otherwise), and measures seed 002's L_depth penalty on two data sets (not for the budget models).
    """
    from depthsat_theory.experiments import ExperimentError
    from depthsat_theory.experiments.recipe import DatasetUnavailable
    from depthsat_theory.experiments.views import run_views

    try:
        folder = run_views(config, out=out, sweep=sweep, seeds=_seeds(seeds), resume=resume, log=typer.echo)
    except (ExperimentError, DatasetUnavailable) as exc:
        fail(exc)
    _print_views(folder)
    typer.echo(f"results written to {folder}")


# ----------------------------------------------------------------------------- growth against scratch (C2)
@experiment_app.command("growth")
def growth_command(
    config: str = _CONFIG,
    out: Path | None = typer.Option(None, "--out", help="Result folder (default experiments/results/growth)."),
    seeds: str | None = _SEEDS,
    dataset: list[str] | None = _DATASET,
) -> None:
    """Growth against scratch (C2): grown shallow MLP against the same architecture from scratch.

    A converged shallow MLP is grown with zero-output blocks and trained on; the same final
    architecture is trained from scratch on the same number of examples.
    """
    from depthsat_theory.experiments.growth import run_growth

    _run(run_growth, config=config, out=out, seeds=_seeds(seeds), datasets=dataset)


# ----------------------------------------------------------------------------- criterion-driven growth
@experiment_app.command("criterion-growth")
def criterion_growth_command(
    config: str = typer.Option(
        "full",
        "--config",
        help="tiny (CI, seconds), full (digits and MNIST-5k, the committed results) or fashion "
        "(Fashion-MNIST 60k/10k with the budget sweep's fixed cosine budget per round).",
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Result folder (default experiments/results/criterion-growth)."
    ),
    seeds: str | None = _SEEDS,
    dataset: list[str] | None = _DATASET,
    sweep: Path | None = typer.Option(
        None,
        "--sweep",
        help="The reference's result folder (default experiments/results/sweep; budget-sweep for fashion).",
    ),
    resume: Path | None = typer.Option(
        None, "--resume", help="JSON-lines file of finished arms (stop rule, data set, seed), reused and appended to."
    ),
) -> None:
    """Criterion-driven growth: diagnose, grow one block where the criterion says, retrain with Adam's state carried.

    Each arm runs one stop rule: the certified rule (every site certified ε-saturated, or the certificate
    out of reach at the probe size, then a point-estimate fallback, labelled as such) or the noise rule (no
    site improvable by the noise test at α on the probe). Every round records which rules would stop; the
    reported model is the round with the lowest validation loss.
    """
    from depthsat_theory.experiments.criterion import run_criterion_growth

    if sweep is not None and not (sweep / "summary.json").is_file():
        fail(f"--sweep {sweep}: no summary.json there; name a folder written by `depthsat experiment sweep`")
    _run(
        run_criterion_growth,
        config=config,
        out=out,
        seeds=_seeds(seeds),
        datasets=dataset,
        sweep=sweep,
        resume=resume,
    )


def _growth_runner(config: str, out: Path, log) -> Path:
    from depthsat_theory.experiments.growth import run_growth

    return run_growth(config, out=out, log=log)


def _criterion_runner(config: str, out: Path, log) -> Path:
    from depthsat_theory.experiments.criterion import run_criterion_growth

    return run_criterion_growth(config, out=out, sweep=out.parent / "sweep", log=log)


# ----------------------------------------------------------------------------- where to expand an LLM (item 5)
@experiment_app.command("expand")
def expand_command(
    config: str = typer.Option(
        "full",
        "--config",
        help="tiny (CI, seconds), full (SmolLM2, the committed results; ~18 min of one idle CPU thread) "
        "or large (for a GPU: --device cuda).",
    ),
    out: Path | None = typer.Option(None, "--out", help="Result folder (default experiments/results/expand)."),
    device: str = typer.Option("cpu", "--device", help="Where the models run and train: cpu, cuda (cuda:N) or auto."),
    seeds: str | None = _SEEDS,
    steps: int | None = typer.Option(None, "--steps", help="Training steps per run (default: the config's)."),
    blocks: int | None = typer.Option(None, "--blocks", help="Layers added, k (default: the config's)."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", help="Tokens per window (default: the config's)."),
    batch_size: int | None = typer.Option(
        None, "--batch-size", help="Training windows per step (default: the config's)."
    ),
) -> None:
    """Where to expand an LLM: criterion-ranked layers against LLaMA-Pro's even spacing and random positions.

    SmolLM2 grown by k zero-output layer copies at each arm's positions, the same continued pretraining on
    King James text (old layers frozen, transformers.Trainer), held-out loss before and after, paired by seed.
    """
    from depthsat_theory.cli import render
    from depthsat_theory.experiments import ExperimentError
    from depthsat_theory.experiments.expand import run_expand, with_overrides
    from depthsat_theory.tasks.custom import ModelSpecError
    from depthsat_theory.tasks.zoo import ZooUnavailableError

    seed_list = _seeds(seeds)
    _check_out(out)
    try:
        cfg = with_overrides(
            config,
            seeds=None if seed_list is None else tuple(seed_list),
            steps=steps,
            blocks=blocks,
            max_tokens=max_tokens,
            batch_size=batch_size,
        )
        summary = run_expand(
            cfg, out=out, device=device, progress=lambda msg: render.err_console.print(msg, markup=False)
        )
    except (ExperimentError, GrowError, ModelSpecError, ZooUnavailableError) as exc:
        fail(exc)
    for key in ("verdict_even", "verdict_random"):
        render.console.print(summary[key], markup=False, highlight=False)


def _expand_runner(config: str, out: Path, log) -> Path:
    from depthsat_theory.experiments.expand import run_expand

    run_expand(config, out=out, progress=log)
    return out


EXPERIMENTS["growth"] = _growth_runner
EXPERIMENTS["criterion-growth"] = _criterion_runner
EXPERIMENTS["expand"] = _expand_runner


# ----------------------------------------------------------------------------- variable- vs fixed-depth (seed 003)
@experiment_app.command("fixed-depth")
def fixed_depth_command(
    config: str = _CONFIG,
    out: Path | None = typer.Option(None, "--out", help="Result folder (default experiments/results/fixed-depth)."),
    seeds: str | None = _SEEDS,
    dataset: list[str] | None = _DATASET,
) -> None:
    """Variable-depth against fixed-depth (seed 003): one residual teacher distilled into two students.

    A residual MLP trained with the recipe is distilled (KL to its outputs on the train split, equal
    budget, one initialisation) into the same residual MLP and into its twin without identity paths;
    both are compared on held-out test data, at the end and at matched training fit, paired by seed.
    """
    from depthsat_theory.experiments.fixed_depth import run_fixed_depth

    _run(run_fixed_depth, config=config, out=out, seeds=_seeds(seeds), datasets=dataset)


def _fixed_depth_runner(config: str, out: Path, log) -> Path:
    from depthsat_theory.experiments.fixed_depth import run_fixed_depth

    return run_fixed_depth(config, out=out, log=log)


EXPERIMENTS["fixed-depth"] = _fixed_depth_runner


# ----------------------------------------------------------------------------- known-depth benchmark
@experiment_app.command("teacher")
def teacher_command(
    config: str = _CONFIG,
    out: Path | None = typer.Option(None, "--out", help="Result folder (default experiments/results/teacher)."),
    seeds: str | None = _SEEDS,
    teacher_depth: list[int] | None = typer.Option(
        None, "--teacher-depth", help="Teacher depth L* (repeatable; default: the configuration's)."
    ),
    resume: Path | None = typer.Option(
        None, "--resume", help="JSON-lines file of finished students: reused when present, appended as they finish."
    ),
    probe_size: int | None = typer.Option(
        None, "--probe-size", help="Held-out probe examples (default: the configuration's; the students are the same)."
    ),
    recorded_only: bool = typer.Option(
        False,
        "--recorded-only",
        help="Train nothing: aggregate the teacher/seed pairs complete in --resume (the rest are listed as left out).",
    ),
) -> None:
    """Known-depth benchmark: students of depth 1…2L* fitted to data from a residual teacher of depth L*.

    Labels are drawn from the teacher's tempered softmax, so the Bayes loss is known and each
    student's excess loss is measured without label noise. Each student (fixed budget, cosine
    schedule) is diagnosed on a held-out probe and on as many training examples, and probed by a
    cross-fitted steepest insertion at every site; the summary says whether the verdicts' turn from
    improvable lands at L*, per seed.
    """
    from depthsat_theory.experiments.teacher import run_teacher

    _run(
        lambda log, **kw: run_teacher(log=log, **kw),
        config=config,
        out=out,
        seeds=_seeds(seeds),
        teacher_depths=teacher_depth,
        resume=resume,
        recorded_only=recorded_only,
        probe_size=probe_size,
    )


def _teacher_runner(config: str, out: Path, log) -> Path:
    from depthsat_theory.experiments.teacher import run_teacher

    return run_teacher(config, out=out, log=log)


EXPERIMENTS["teacher"] = _teacher_runner


@experiment_app.command("budget-sweep")
def budget_sweep_command(
    config: str = _CONFIG,
    out: Path | None = typer.Option(None, "--out", help="Result folder (default experiments/results/budget-sweep)."),
    seeds: str | None = _SEEDS,
    resume: Path | None = typer.Option(
        None, "--resume", help="JSON-lines file of finished models: reused when present, appended as they finish."
    ),
    growth: bool = typer.Option(
        True, "--growth/--no-growth", help="Run C2's growth arms (one-shot and staged grown, scratch)."
    ),
    data: str = typer.Option(
        "fashion",
        "--data",
        help="fashion (residual MLPs, Fashion-MNIST 60k/10k) or kjv (CharGPT, windows across the whole KJV text; "
        "results in experiments/results/budget-sweep-kjv).",
    ),
) -> None:
    """Depth sweep on a whole data set (Fashion-MNIST 60k/10k or the KJV text), fixed cosine budget: C1, C3, C2.

    Residual MLPs of each depth are trained for the same number of Adam steps, diagnosed at every
    site on a held-out probe and on as many training examples (both activation-gradient conventions,
    the bias-corrected headline), probed by a cross-fitted steepest insertion (fitted on one probe
    half, measured on the other and on the test set), and a trained shallow network is grown
    one-shot and staged (2 -> 4 -> 8) and compared with scratch at equal examples and at matched
    FLOPs, paired by seed. With --data kjv: CharGPT on character windows interleaved over the whole
    King James text (no growth arms).
    """
    from depthsat_theory.experiments.budget_sweep import run_budget_sweep

    _run(
        lambda log, **kw: run_budget_sweep(log=log, **kw),
        config=config,
        out=out,
        seeds=_seeds(seeds),
        resume=resume,
        growth=growth,
        data=data,
    )


def _budget_sweep_runner(config: str, out: Path, log) -> Path:
    from depthsat_theory.experiments.budget_sweep import run_budget_sweep

    return run_budget_sweep(config, out=out, log=log)


def _budget_sweep_kjv_runner(config: str, out: Path, log) -> Path:
    from depthsat_theory.experiments.budget_sweep import run_budget_sweep

    return run_budget_sweep(config, data="kjv", out=out, log=log)


EXPERIMENTS["budget-sweep"] = _budget_sweep_runner
EXPERIMENTS["budget-sweep-kjv"] = _budget_sweep_kjv_runner


def _views_budget_runner(config: str, out: Path, log) -> Path:
    from depthsat_theory.experiments.views import run_views

    sweep = out.parent / "budget-sweep"
    return run_views("budget" if config == "full" else f"{config}-budget", out=out, sweep=sweep, log=log)


# after the budget sweep: its models are retrained and checked against its runs.csv
EXPERIMENTS["views-budget"] = _views_budget_runner


@experiment_app.command("placement")
def placement_command(
    config: str = typer.Option(
        "full",
        "--config",
        help="tiny (CI, seconds) or full (SmolLM2, the committed results; experiments/README.md has its CPU time).",
    ),
    out: Path | None = typer.Option(None, "--out", help="Result folder (default experiments/results/placement)."),
    seeds: str | None = _SEEDS,
    resume: Path | None = typer.Option(
        None, "--resume", help="JSON-lines file of finished units: reused when present, appended as they finish."
    ),
    recorded_only: bool = typer.Option(
        False,
        "--recorded-only",
        help="Train nothing: aggregate the units recorded in --resume (what is missing is listed as left out).",
    ),
    device: str = typer.Option("cpu", "--device", help="Where the models run and train: cpu, cuda (cuda:N) or auto."),
) -> None:
    """Where to grow an LLM: the held-out gain of one layer copy at each position against three site scores.

    At every position of SmolLM2, one zero-output layer copy is trained alone for the same few steps (old
    layers frozen) and its held-out gain is measured; the copy's own tangent score, block influence and the
    depth index are read off a probe first, and their rank correlations with the gain are reported with
    bootstrap intervals, per seed (a new probe and held-out draw each) and pooled; then k = 2 and 4 copies
    placed by the criterion, LLaMA-Pro's even spacing, random and block influence, paired by seed.
    """
    from depthsat_theory.experiments.placement import run_placement
    from depthsat_theory.tasks.custom import ModelSpecError
    from depthsat_theory.tasks.zoo import ZooUnavailableError

    try:
        _run(
            lambda log, **kw: run_placement(log=log, **kw),
            config=config,
            out=out,
            seeds=_seeds(seeds),
            resume=resume,
            recorded_only=recorded_only,
            device=device,
        )
    except (ModelSpecError, ZooUnavailableError) as exc:
        fail(exc)


def _placement_runner(config: str, out: Path, log) -> Path:
    from depthsat_theory.experiments.placement import run_placement

    return run_placement(config, out=out, log=log)


EXPERIMENTS["placement"] = _placement_runner


@experiment_app.command("all")
def all_command(
    config: str = _CONFIG,
    root: Path | None = typer.Option(
        None,
        "--root",
        help="Folder of the result folders (default: experiments/results for --config full, a new temporary "
        "folder otherwise, so a quick run never replaces the committed results).",
    ),
) -> None:
    """Regenerate every experiment's results (in the registry's order) into ROOT/<name>/."""
    from depthsat_theory.experiments.record import default_folder

    root = root if root is not None else default_folder("", config)
    _check_out(root, "--root")
    typer.echo(f"results go to {root}")
    for name, runner in EXPERIMENTS.items():
        typer.echo(f"== {name} ({config})")
        _run(runner, config=config, out=root / name)


# ----------------------------------------------------------------------------- the claims table
@experiment_app.command("claims")
def claims_command(
    root: Path = typer.Option(
        Path("experiments/results"), "--root", help="Folder of the result folders (each with a summary.json)."
    ),
    check: bool = typer.Option(
        False, "--check", help="Write nothing; exit 1 when a committed table differs from the generated one."
    ),
) -> None:
    """Regenerate the claims tables from ``ROOT/*/summary.json``.

    The full table (claim, setting, verdict, interval, reason, result folder with its wall time and
    commit) goes between the claims markers of ROOT/../README.md (experiments/README.md; the book's
    experiments chapter includes that part), the compact one (claim, setting, verdict) between the
    compact markers of ROOT/../../README.md. Rows come from each summary's "claims" list, or from the
    adapter of a committed experiment written before that list existed.
    """
    from depthsat_theory.experiments.claims import ClaimsError, update

    root = Path(root)
    targets = {"full": root.parent / "README.md", "compact": root.parent.parent / "README.md"}
    try:
        changed = update(root, targets, check=check)
    except ClaimsError as exc:
        fail(exc)
    if check:
        if changed:
            typer.echo(
                f"the claims table in {', '.join(map(str, changed))} differs from {root}/*/summary.json; "
                "run `./dev claims` (depthsat experiment claims) and commit the result",
                err=True,
            )
            raise typer.Exit(1)
        typer.echo(f"claims tables current ({', '.join(map(str, targets.values()))})")
        return
    typer.echo(f"claims tables written: {', '.join(map(str, changed)) or 'none changed'}")
