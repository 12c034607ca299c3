"""What the CLI prints: tables, summaries, JSON and one-line errors (rich)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from depthsat_theory.bounds import ScoreInterval
from depthsat_theory.cli.flags import user_message
from depthsat_theory.diagnose.report import headline_or_none
from depthsat_theory.statistics import SaturationResult

__all__ = [
    "SCORE_NOTE",
    "console",
    "err_console",
    "fail",
    "print_audit",
    "print_bound",
    "print_check_summary",
    "print_diagnosis",
    "print_grow",
    "print_json",
    "print_score",
    "progress",
    "score_fields",
]

console = Console() if sys.stdout.isatty() else Console(width=120)
err_console = Console(stderr=True)

SCORE_NOTE = (
    "empirical measure of the probe; raw_score and realizability_defect pool exactly "
    "equal rows only: exact on finite/discrete populations, biased upward for "
    "continuous rows (raw_score -> ag_rms)"
)


def fail(exc: Exception | str) -> NoReturn:
    """Print ``error: …`` (one line, arguments spelled as flags) on stderr and exit with status 2.

    Args:
        exc: the error, or the message itself.

    Raises:
        typer.Exit: always, with code 2.
    """
    msg = exc if isinstance(exc, str) else user_message(exc)
    err_console.print(f"error: {msg}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def progress(*, disable: bool) -> Progress:
    """The progress bar on stderr (description, bar, count, elapsed time).

    Args:
        disable: hide the bar (``--quiet``, or on ranks other than 0).

    Returns:
        A ``rich.progress.Progress`` (not yet started).
    """
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        disable=disable,
        transient=False,
    )


_PHASES = {"probe": "probe batches", "train": "training steps", "eval": "evaluation batches"}


def phase_progress(bar: Progress) -> Any:
    """A ``progress(phase, done, total)`` callback that keeps one bar per phase (probe, train, eval) on ``bar``.

    Args:
        bar: a started ``rich.progress.Progress`` (:func:`progress`).

    Returns:
        The callback; a phase that restarts (a second evaluation) starts a new bar.
    """
    tasks: dict[str, Any] = {}

    def update(phase: str, done: int, total: int | None) -> None:
        task = tasks.get(phase)
        if task is None or done <= bar.tasks[task].completed:
            task = tasks[phase] = bar.add_task(_PHASES.get(phase, phase), total=total)
        bar.update(task, completed=done, total=total)

    return update


def print_json(obj: Any) -> None:
    """Write ``obj`` as indented JSON (UTF-8 symbols kept) on stdout.

    Args:
        obj: a JSON-serialisable object.
    """
    sys.stdout.write(json.dumps(obj, indent=1, ensure_ascii=False) + "\n")


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, dict) and "value" in v:
        return f"{v['value']:.6g} ({v['source']})"
    if isinstance(v, dict):
        return "; ".join(f"{k}: {_cell(x) if isinstance(x, dict) else x}" for k, x in v.items())
    if isinstance(v, list):
        return "\n".join(str(x) for x in v)
    return str(v)


def _quantity_table(title: str, rows: dict) -> Table:
    table = Table(title=title)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for k, v in rows.items():
        table.add_row(k, _cell(v))
    return table


# ----------------------------------------------------------------------------- check
_CHECK_COLUMNS = [
    ("predicted_improvable", "pred. impr."),
    ("predicted_saturated", "pred. sat."),
    ("agree", "agree"),
    ("counterexample", "counterex."),
    ("undecided", "undecided"),
    ("degenerate", "degenerate"),
]


def print_check_summary(rep: dict, wall: float, path: Path | str, *, stderr: bool = False) -> None:
    """The ``depthsat check`` table (counts per group), reasons and totals.

    Args:
        rep: the report of :func:`depthsat_theory.check.run_check`.
        wall: wall time in seconds.
        path: where the JSON report was written (or why it was not).
        stderr: print on stderr (stdout carries the report of ``--report -``).
    """
    out = err_console if stderr else console
    summ = rep["summary"]
    table = Table(title=f"depthsat check: {rep['instances']} instances, seed {rep['seed']}")
    table.add_column("group", no_wrap=True)
    for _, head in _CHECK_COLUMNS:
        table.add_column(head, justify="right", no_wrap=True)
    for key in ("model", "data", "construction", "family", "optimizer"):
        for val, counts in summ[key].items():
            label = f"{key}: {'real data' if val == 'None' else val}"
            table.add_row(label, *[str(counts.get(c, 0)) for c, _ in _CHECK_COLUMNS])
        table.add_section()
    out.print(table)
    for reason, count in summ["reasons"].items():
        out.print(f"  {count} × {reason}", markup=False)
    if summ["planted_reasons"]:
        out.print(
            "planted non-descent-compatible updates (T2 assumes descent compatibility, so "
            "these counterexamples are expected and show that the checker can fail):",
            markup=False,
        )
        for reason, count in summ["planted_reasons"].items():
            out.print(f"  {count} × {reason}", markup=False)
    out.print(
        f"total: {rep['agree']} agree, {rep['counterexamples']} counterexamples "
        f"({summ['planted_counterexamples']} planted), {rep['undecided']} undecided, "
        f"{rep['degenerate']} degenerate (T = {{0}})",
        markup=False,
    )
    out.print(f"wall time {wall:.1f} s; report: {path}", markup=False)


# ----------------------------------------------------------------------------- score
def score_fields(result: SaturationResult, interval: ScoreInterval | None) -> dict:
    """The keys of ``depthsat score``: the headline, the result's, a note, then the interval's (``--delta``).

    Every key of the interval that the result also has (``label``, ``notes``, ``tangent_rank``,
    ``score_squared``, ``score_squared_unbiased``, ...) becomes ``bound_<key>``, so the
    interval never overwrites the verdict's fields (its ``score`` is the result's).

    Args:
        result: the probe's :class:`SaturationResult`.
        interval: its :class:`ScoreInterval`, or ``None`` without ``--delta``.

    Returns:
        The ``dict`` printed by :func:`print_score`.
    """
    head = headline_or_none(result)
    out = {"headline": None if head is None else head.to_dict(), **result.to_dict()}
    out["note"] = SCORE_NOTE
    if interval is not None:
        bound = interval.to_dict()
        bound.pop("score")
        # Every key the result also has (label, notes, tangent_rank, score_squared,
        # score_squared_unbiased, ...) is renamed ``bound_<key>``: the interval's
        # ŝ² must never overwrite the verdict's in ``score --json``.
        for key in [k for k in bound if k in out]:
            bound[f"bound_{key}"] = bound.pop(key)
        out.update(bound)
    return out


def print_score(out: dict, probe: Path, *, as_json: bool) -> None:
    """``depthsat score`` output: JSON, or a table of the quantities followed by the note.

    Args:
        out: the fields of :func:`score_fields`.
        probe: the probe file (its name is the table's title).
        as_json: print ``out`` as JSON instead.
    """
    if as_json:
        print_json(out)
        return
    console.print(
        _quantity_table(f"{probe.name}: family {out['family']}", {k: v for k, v in out.items() if k != "note"})
    )
    console.print(out["note"], markup=False)


def print_bound(out: dict, delta: float, *, as_json: bool) -> None:
    """``depthsat bound`` output: JSON, or a table of the plan.

    Args:
        out: the plan's dictionary (:meth:`BoundPlan.to_dict`).
        delta: ``δ`` (in the table's title).
        as_json: print ``out`` as JSON instead.
    """
    if as_json:
        print_json(out)
        return
    console.print(_quantity_table(f"finite-sample bound (thm-finite-sample), δ = {delta:g}", out))


# ----------------------------------------------------------------------------- audit, diagnose
def print_audit(rep: Any, table: Table, *, as_json: bool) -> None:
    """``depthsat audit`` output: JSON, or the probe, the report table and its notes.

    Args:
        rep: the :class:`~depthsat_theory.audit.AuditReport`.
        table: its rich table.
        as_json: print :meth:`AuditReport.to_dict` as JSON instead.
    """
    if as_json:
        print_json(rep.to_dict())
        return
    console.print(f"probe: {rep.probe}", markup=False, highlight=False)
    console.print(table)
    for note in rep.notes:
        console.print(f"  note: {note}", markup=False, highlight=False)


def print_diagnosis(res: Any, written: list[Path], *, stderr: bool = False) -> None:
    """``depthsat diagnose`` output: the table, why each undetermined site is so and what would decide it, notes.

    Args:
        res: the :class:`~depthsat_theory.diagnose.Diagnosis`.
        written: the files written (reports, plots), one line each.
        stderr: print on stderr (stdout carries the JSON of ``--json -``).
    """
    table = res.table()
    # Not a terminal (a file, a pipe, a log): wide enough for the whole table, so no column is squeezed;
    # a terminal too narrow for it: the columns that decide, and a line saying where the others are.
    width = max(160, Console(width=100_000).measure(table).maximum)
    tty = sys.stderr.isatty() if stderr else sys.stdout.isatty()
    out = (err_console if stderr else console) if tty else Console(stderr=stderr, width=width)
    if width > out.width:
        table = res.table(compact=True)
    out.print(table)
    if width > out.width:
        out.print(
            f"  (the terminal is {out.width} columns wide, the whole table {width}: the other columns are in "
            "--json, or pipe the output to a file)",
            markup=False,
            highlight=False,
        )
    for sd in res.sites:
        if sd.verdict == "undetermined":
            out.print(f"  {sd.site}: undetermined: {sd.verdict_reason}", markup=False, highlight=False)
    for note in res.notes:
        out.print(f"  note: {note}", markup=False, highlight=False)
    if res.resumed_from:
        out.print(f"resumed from checkpoint after {res.resumed_from} batches", markup=False)
    for p in written:
        out.print(f"wrote {p}", markup=False, highlight=False)


def print_grow(rep: dict, written: list[Path]) -> None:
    """The sites chosen, the first step's predicted and observed change, the loss before/after, the files.

    Args:
        rep: the grow report's dictionary (:meth:`GrowReport.to_dict`).
        written: the files written, one line each.
    """
    t = Table(title=f"depthsat grow: {rep['description']}, {rep['method']} ({rep['family']})")
    for c in ("site", "depth", "s_U/AG_rms", "verdict", "plug-in ŝ/AG_rms", "why"):
        t.add_column(c, justify="left" if c in ("site", "verdict", "why") else "right")
    for row in rep["chosen"]:
        head = row.get("headline") or {}
        rel = head.get("relative_score")
        cells = ("—" if rel is None else _cell(rel), str(row["verdict"]), _cell(row["relative_score"]))
        t.add_row(row["site"], str(row["depth"]), *cells, row["why"])
    console.print(t)
    fs = rep["first_step"]
    units = rep["loss_units"]
    console.print(
        f"new sites: {', '.join(rep['new_sites'])} ({rep['new_parameters']} parameters); "
        f"output deviation {_cell(rep['deviation'])} (tolerance {_cell(rep['tolerance'])})",
        markup=False,
        highlight=False,
    )
    console.print(
        f"first Adam step (lr {fs['lr']:g}): predicted {_cell(fs['predicted_change'])}, "
        f"observed {_cell(fs['observed_change'])} ({units})",
        markup=False,
        highlight=False,
    )
    after = "not trained" if rep["loss_after"] is None else _cell(rep["loss_after"])
    steps = len(rep["train_losses"])
    console.print(
        f"probe loss (training data): before {_cell(rep['loss_before'])}, after {steps} steps {after}",
        markup=False,
        highlight=False,
    )
    if rep.get("eval_loss_before") is not None:
        held = "not trained" if rep.get("eval_loss_after") is None else _cell(rep["eval_loss_after"])
        console.print(
            f"held-out loss: before {_cell(rep['eval_loss_before'])}, after {held}", markup=False, highlight=False
        )
    elif steps:
        console.print(
            "no held-out text (--eval-text): the fall above is on the training batches and can be memorisation",
            markup=False,
            highlight=False,
        )
    for p in written:
        console.print(f"wrote {p}", markup=False, highlight=False)


def print_prune(data: dict) -> None:
    """The removal table: block influence, first-order and measured removal change, growth score, ranks.

    Args:
        data: :meth:`PruneRanking.to_dict` with ``growth_relative_score`` per row, ``description``, ``loss_units``.
    """
    rows = data["candidates"]
    order = sorted(range(len(rows)), key=lambda i: rows[i]["first_order_change"])
    rank = {i: r + 1 for r, i in enumerate(order)}
    t = Table(title=f"depthsat prune-candidates: {data['description']}")
    for c in ("site", "block influence", "ΔJ remove (1st order)", "ΔJ remove (measured)", "grow s/AG_rms", "rank"):
        t.add_column(c, justify="left" if c == "site" else "right")
    for i, r in enumerate(rows):
        measured = "-" if r["removal_change"] is None else _cell(r["removal_change"])
        t.add_row(
            r["site"],
            _cell(r["block_influence"]),
            _cell(r["first_order_change"]),
            measured,
            _cell(r["growth_relative_score"]),
            str(rank[i]),
        )
    console.print(t)
    console.print(
        f"loss {_cell(data['loss'])} ({data['loss_units']}); rank 1 = smallest predicted loss change of removal; "
        "the first-order change is a prediction (--measure removes each layer)",
        markup=False,
        highlight=False,
    )
