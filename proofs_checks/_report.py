"""The table printed by ``python -m proofs_checks`` and ``depthsat proofs``."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from depthsat_theory.io import check_output, is_stdout

from ._registry import Check, Context, Row, run_checks, write_json_atomic

__all__ = ["run_and_report"]


def run_and_report(
    ctx: Context,
    *,
    only: list[str] | None = None,
    json_path: str | None = None,
    console: Console | None = None,
    quiet: bool = False,
) -> int:
    """Run the checks, print the table and return the exit status.

    The table has one row per check (claim, labels, check, method, instances,
    counterexamples, converse evidence, detail, seconds); checks with an extra table
    (``Outcome.table``) print it after, then every failure and a one-line total.

    Args:
        ctx: seed and ``quick`` flag.
        only: claims to run (``["T2", "T4"]``); default all.
        json_path: also write the rows as JSON there (checked before the run).
        console: where the table goes (default stdout, 200 columns when not a terminal).
        quiet: no per-check progress lines on stderr.

    Returns:
        0 if every check passed, 1 if one failed, 2 on a bad ``json_path`` or an ``only``
        that matches no check.
    """
    console = console or (Console() if sys.stdout.isatty() else Console(width=200))
    err = Console(stderr=True)
    if json_path:  # refuse a bad --json before minutes of checks
        try:
            check_output("--json", json_path)
        except ValueError as exc:
            err.print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
            return 2
        if is_stdout(json_path):  # stdout carries the JSON: the table goes to stderr
            console = err

    def progress(chk: Check) -> None:
        if not quiet:
            err.print(f"[{chk.claim}] {chk.name} …", markup=False, highlight=False)

    rows = run_checks(ctx, only=only, progress=progress)
    if not rows:
        err.print(f"error: no checks match --only {','.join(only or [])}", markup=False)
        return 2
    _print_rows(console, rows, ctx)
    if json_path:
        try:
            write_json_atomic(rows, ctx, json_path)
        except OSError as exc:  # the table is printed above: say the JSON was not saved
            err.print(f"error: --json {json_path}: could not write ({exc})", markup=False, soft_wrap=True)
            return 2
    return 0 if all(r.passed for r in rows) else 1


def _extra_table(r: Row) -> Table | None:
    if not r.table:
        return None
    title, cols, body = r.table
    extra = Table(title=f"{r.claim} {r.check}: {title}")
    for col in cols:
        extra.add_column(str(col), justify="right")
    for line in body:
        extra.add_row(*[f"{v:.4g}" if isinstance(v, float) else str(v) for v in line])
    return extra


def _print_rows(console: Console, rows: list[Row], ctx: Context) -> None:
    """The main table, the extra tables, the failures and the total line."""
    console.print(_table(rows, ctx))
    for r in rows:
        extra = _extra_table(r)
        if extra is not None:
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
