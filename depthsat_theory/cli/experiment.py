"""``depthsat experiment …``: the paper's experiments (issue 14) and the views of seeds 002/003.

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

__all__ = ["EXPERIMENTS", "experiment_app"]

experiment_app = typer.Typer(
    no_args_is_help=True,
    help="Reproduce the paper's experiments (depth sweep, growth against scratch, local insertion, "
    "criterion-driven growth, LLM expansion); results go to experiments/results/<name>/.",
)


# ----------------------------------------------------------------------------- the registry for `all`
#: ``{name: runner(config, out, log)}``: what ``depthsat experiment all`` runs, in this order.
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
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        fail(f"--seeds {text!r}: give comma-separated integers, e.g. 0,1,2")


def _check_out(out: Path | None, flag: str = "--out") -> None:
    """Refuse, before any training, a result folder that could not be written at the end."""
    if out is None:
        return
    for folder in (Path(out), *Path(out).parents):
        if folder.exists():
            if not folder.is_dir():
                fail(f"{flag} {out}: {folder} exists and is not a folder; name a folder")
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
    config: str = _CONFIG,
    out: Path | None = typer.Option(
        None, "--out", help="Result folder (default experiments/results/criterion-growth)."
    ),
    seeds: str | None = _SEEDS,
    dataset: list[str] | None = _DATASET,
    sweep: Path | None = typer.Option(
        None, "--sweep", help="The depth sweep's result folder (default experiments/results/sweep)."
    ),
) -> None:
    """Criterion-driven growth: insert where the certified score is largest, retrain, repeat.

    Stops when every site is certified ε-saturated or the certificate is out of reach at the probe
    size (then a point-estimate fallback continues, labelled as such).
    """
    from depthsat_theory.experiments.criterion import run_criterion_growth

    if sweep is not None and not (sweep / "summary.json").is_file():
        fail(f"--sweep {sweep}: no summary.json there; name a folder written by `depthsat experiment sweep`")
    _run(run_criterion_growth, config=config, out=out, seeds=_seeds(seeds), datasets=dataset, sweep=sweep)


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


@experiment_app.command("all")
def all_command(
    config: str = _CONFIG,
    root: Path = typer.Option(Path("experiments/results"), "--root", help="Folder of the result folders."),
) -> None:
    """Regenerate every experiment's results (in the registry's order) into ROOT/<name>/."""
    _check_out(root, "--root")
    for name, runner in EXPERIMENTS.items():
        typer.echo(f"== {name} ({config})")
        _run(runner, config=config, out=root / name)
