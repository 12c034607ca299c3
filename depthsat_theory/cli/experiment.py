"""``depthsat experiment …``: the paper's experiments (issue 14) and the views of seeds 002/003.

Every command takes ``--config tiny|full`` (``tiny`` is the bounded size CI runs) and ``--out``
(default ``experiments/results/<name>``) and writes there atomically
(:func:`depthsat_theory.experiments.write_results`).
"""

from __future__ import annotations

from pathlib import Path

import typer

__all__ = ["experiment_app"]

experiment_app = typer.Typer(
    no_args_is_help=True,
    help="Reproduce the paper's experiments (depth sweep, growth against scratch, local insertion, "
    "criterion-driven growth, LLM expansion); results go to experiments/results/<name>/.",
)


@experiment_app.command("expand")
def expand_cmd(
    config: str = typer.Option(
        "tiny",
        "--config",
        help="tiny (CI, seconds), full (SmolLM2, ~35 min on one CPU thread) or large (for a GPU: --device cuda).",
    ),
    out: Path | None = typer.Option(None, "--out", help="Result folder (default experiments/results/expand)."),
    device: str = typer.Option("cpu", "--device", help="Where the models run and train: cpu, cuda (cuda:N) or auto."),
    seeds: str | None = typer.Option(None, "--seeds", help="Comma-separated seeds (default: the config's)."),
    steps: int | None = typer.Option(None, "--steps", help="Training steps per run (default: the config's)."),
    blocks: int | None = typer.Option(None, "--blocks", help="Layers added, k (default: the config's)."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", help="Tokens per window (default: the config's)."),
    batch_size: int | None = typer.Option(
        None, "--batch-size", help="Training windows per step (default: the config's)."
    ),
) -> None:
    """Where to expand an LLM: criterion-ranked layers against LLaMA-Pro's even spacing and random positions."""
    from depthsat_theory.cli import render
    from depthsat_theory.experiments import ExperimentError
    from depthsat_theory.experiments.expand import run_expand, with_overrides
    from depthsat_theory.grow import GrowError
    from depthsat_theory.tasks.custom import ModelSpecError
    from depthsat_theory.tasks.zoo import ZooUnavailableError

    try:
        seed_list = None if seeds is None else tuple(int(s) for s in seeds.split(",") if s.strip())
    except ValueError:
        render.fail(f"--seeds {seeds!r}: give comma-separated integers like 0,1,2")
    try:
        cfg = with_overrides(
            config, seeds=seed_list, steps=steps, blocks=blocks, max_tokens=max_tokens, batch_size=batch_size
        )
        summary = run_expand(
            cfg, out=out, device=device, progress=lambda msg: render.err_console.print(msg, markup=False)
        )
    except (ExperimentError, GrowError, ModelSpecError, ZooUnavailableError) as exc:
        render.fail(exc)
    for key in ("verdict_even", "verdict_random"):
        render.console.print(summary[key], markup=False, highlight=False)
