"""The table printed by ``python -m proofs_checks`` and ``depthsat proofs``."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ._registry import Context, Row, run_checks, write_json_atomic


def run_and_report(
    ctx: Context,
    *,
    only: list[str] | None = None,
    json_path: str | None = None,
    console: Console | None = None,
    quiet: bool = False,
) -> int:
    """Run the checks, print the table (claim, check, method, instances, counterexamples,
    converse evidence) and return the exit status: 0 if every check passed, 1 otherwise."""
    import os
    import sys

    console = console or (Console() if sys.stdout.isatty() else Console(width=200))
    err = Console(stderr=True)
    if json_path:  # refuse a bad --json before minutes of checks, not after
        folder = os.path.dirname(os.path.abspath(json_path))
        if os.path.isdir(json_path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            err.print(
                f"error: --json {json_path}: not a writable file path (the folder must exist and be writable)",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            return 2

    def progress(chk):
        if not quiet:
            err.print(f"[{chk.claim}] {chk.name} …", markup=False, highlight=False)

    rows = run_checks(ctx, only=only, progress=progress)
    if not rows:
        err.print(f"error: no checks match --only {','.join(only or [])}", markup=False)
        return 2
    console.print(_table(rows, ctx))
    for r in rows:
        if r.table:
            title, cols, body = r.table
            extra = Table(title=f"{r.claim} {r.check}: {title}")
            for col in cols:
                extra.add_column(str(col), justify="right")
            for line in body:
                extra.add_row(*[f"{v:.4g}" if isinstance(v, float) else str(v) for v in line])
            console.print(extra)
    failed = [r for r in rows if not r.passed]
    for r in failed:
        why = r.error or (f"{r.counterexamples} counterexample(s)" if r.counterexamples else "no instances")
        console.print(f"FAILED {r.claim} {r.check}: {why}; {r.detail}", markup=False, highlight=False)
    total_ce = sum(r.counterexamples for r in rows)
    console.print(
        f"{len(rows)} checks, {sum(r.instances for r in rows)} instances, "
        f"{total_ce} counterexamples, {len(failed)} failed",
        markup=False,
    )
    if json_path:
        write_json_atomic(rows, ctx, json_path)
    return 1 if failed else 0


def _table(rows: list[Row], ctx: Context) -> Table:
    table = Table(title=f"proofs_checks (seed {ctx.seed}{', quick' if ctx.quick else ''})")
    for head, kw in (
        ("claim", {"no_wrap": True}),
        ("label", {}),
        ("check", {}),
        ("method", {}),
        ("instances", {"justify": "right"}),
        ("counterex.", {"justify": "right"}),
        ("converse evidence", {}),
        ("detail", {}),
        ("s", {"justify": "right"}),
    ):
        table.add_column(head, **kw)
    for r in rows:
        ce = str(r.counterexamples) if not r.error else "ERROR"
        table.add_row(
            r.claim,
            ", ".join(r.labels),
            r.check,
            r.method,
            str(r.instances),
            ce,
            r.converse or "",
            r.error or r.detail,
            f"{r.seconds:.1f}",
        )
    return table
