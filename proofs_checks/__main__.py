"""``python -m proofs_checks [--quick] [--seed S] [--only T2,T4] [--json PATH]``."""

from __future__ import annotations

from typing import Optional

import typer

from ._registry import Context
from ._report import run_and_report

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command()
def main(
    seed: int = typer.Option(0, "--seed", help="Base seed of every check."),
    quick: bool = typer.Option(False, "--quick", help="Fewer instances per check."),
    only: Optional[str] = typer.Option(None, "--only", help="Comma-separated claims, e.g. T2,T4."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Also write the rows as JSON (atomically)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No per-check progress lines."),
) -> None:
    """Run the machine checks of every claim in theory/ and print the table; exit 1 on any failure."""
    claims = [c.strip() for c in only.split(",") if c.strip()] if only else None
    raise typer.Exit(run_and_report(Context(seed=seed, quick=quick), only=claims,
                                    json_path=json_path, quiet=quiet))


if __name__ == "__main__":
    app()
