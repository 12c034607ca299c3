"""Every labelled claim of ``theory/`` has a machine check, and every check names a real label.

Labels are MyST targets, either a ``(label)=`` line or a ``:label:`` option of a directive.
Claims are the labels starting with ``thm-``, ``lem-``, ``cor-`` or ``prop-``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from proofs_checks import load_all

THEORY = Path(__file__).resolve().parents[1] / "theory"
CLAIM_PREFIXES = ("thm-", "lem-", "cor-", "prop-")
_TARGET = re.compile(r"^\s*\(([A-Za-z0-9_.:-]+)\)=\s*$")
_OPTION = re.compile(r"^\s*:label:\s*([A-Za-z0-9_.:-]+)\s*$")


def theory_labels(folder: Path = THEORY) -> dict[str, str]:
    """``{label: file name}`` for every MyST label in ``folder/*.md``."""
    out: dict[str, str] = {}
    for path in sorted(folder.glob("*.md")):
        for line in path.read_text(encoding="utf-8").splitlines():
            m = _TARGET.match(line) or _OPTION.match(line)
            if m:
                out.setdefault(m.group(1), path.name)
    return out


def test_label_parser_reads_both_forms(tmp_path):
    (tmp_path / "a.md").write_text(
        "(thm-one)=\n## Theorem\n\n```{prf:lemma}\n:label: lem-two\ntext\n```\nsee (thm-not-a-target) inline\n",
        encoding="utf-8",
    )
    assert theory_labels(tmp_path) == {"thm-one": "a.md", "lem-two": "a.md"}


@pytest.fixture(scope="module")
def checked_labels() -> set[str]:
    return {label for chk in load_all() for label in chk.labels}


def test_every_claim_label_has_a_check(checked_labels):
    labels = theory_labels()
    assert labels, "no MyST labels found in theory/"
    claims = {lab: f for lab, f in labels.items() if lab.startswith(CLAIM_PREFIXES)}
    missing = sorted(f"{lab} ({f})" for lab, f in claims.items() if lab not in checked_labels)
    assert not missing, f"claims of theory/ without a check in proofs_checks: {missing}"


def test_every_checked_label_exists_in_theory(checked_labels):
    labels = theory_labels()
    unknown = sorted(checked_labels - set(labels))
    assert not unknown, f"labels named by checks but not defined in theory/*.md: {unknown}"
