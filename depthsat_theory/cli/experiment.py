"""``depthsat experiment …``: the paper's experiments (issue 14) and the views of seeds 002/003.

Every command takes ``--config tiny|full`` (``tiny`` is the bounded size CI runs) and ``--out``
(default ``experiments/results/<name>``) and writes there atomically
(:func:`depthsat_theory.experiments.write_results`).
"""

from __future__ import annotations

import typer

__all__ = ["experiment_app"]

experiment_app = typer.Typer(
    no_args_is_help=True,
    help="Reproduce the paper's experiments (depth sweep, growth against scratch, local insertion, "
    "criterion-driven growth, LLM expansion); results go to experiments/results/<name>/.",
)
