"""The verdict reproducers give the exact truth's verdict (``proofs_checks/verdict_reproducers.py``).

The before/after table is rebuilt by ``python -m proofs_checks.verdict_reproducers``;
here its measured rows (items 1–4, truth in rational arithmetic or a population construction) must
all agree, and every test it names for the other reproducers must exist (those tests run in the
suite on their own).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from proofs_checks.verdict_reproducers import TESTED_REPRODUCERS, Row, measured_rows, render, rows_from_tests

ROOT = Path(__file__).resolve().parents[1]


def test_every_measured_reproducer_gives_the_exact_truths_verdict():
    rows = measured_rows()
    assert len(rows) == 11
    bad = [(r.reproducer, r.truth, r.after) for r in rows if not r.ok]
    assert not bad, bad


@pytest.mark.parametrize("node", [t[4] for t in TESTED_REPRODUCERS])
def test_each_named_reproducer_test_exists(node):
    path, name = node.split("::")
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    assert name in {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}, node


def test_table_marks_a_failing_reproducer():
    """A failing test or a wrong verdict is a visible ``NO`` and not counted as agreeing."""
    rows = rows_from_tests(runner=lambda nodes: {n: n.endswith("sequence_first") is False for n in nodes})
    table = render([*rows, Row("4", "x", "b", "t", "a", False)])
    assert "| NO |" in table
    assert f"{len(rows) - 1} of {len(rows) + 1} reproducers" in table
