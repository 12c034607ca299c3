"""Names audit: names say what a thing is, and modules keep their private names to themselves.

Two rules (GUIDE "Standards"):

- no file, folder, function, class or heading is named after a tracker issue number (``issue10_…``,
  "Where issue 12 stands"), and no docstring of the package cites one (docstrings are the API
  reference);
- no private name (``_x``) is imported from another module outside ``tests/`` (tests may pin
  internals): what two modules share is public, or lives where both can use it.

Each checker is first run on a planted violation, so the audit itself can fail.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ISSUE = re.compile(r"issues?[\s_-]*\d", re.IGNORECASE)
#: Folders whose Python may not import another module's private names.
WALLED = ("depthsat_theory", "proofs_checks", "benchmarks", "experiments", "book")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode == 0 and out.stdout.strip():
        return [p for p in out.stdout.splitlines() if (ROOT / p).exists()]
    skip = {".venv", ".git", "_build", "__pycache__", "node_modules"}
    return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.parts)]


def issue_numbered_paths(paths: list[str]) -> list[str]:
    """Paths with a component named after an issue number."""
    return [p for p in paths if any(ISSUE.search(part) for part in Path(p).parts)]


def issue_numbered_defs(source: str, docstrings: bool) -> list[str]:
    """Functions/classes named after an issue number, and (if ``docstrings``) docstrings citing one."""
    bad = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and ISSUE.search(node.name):
            bad.append(f"line {node.lineno}: name {node.name}")
        if docstrings and isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False) or ""
            if ISSUE.search(doc):
                bad.append(f"docstring of {getattr(node, 'name', 'module')}: {ISSUE.search(doc).group(0)!r}")
    return bad


def issue_numbered_headings(text: str) -> list[str]:
    """Markdown headings (outside code fences) that cite an issue number."""
    bad, fence = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
        elif not fence and re.match(r"#{1,6}\s", line) and ISSUE.search(line):
            bad.append(f"line {i}: {line.strip()}")
    return bad


def private_imports(source: str, module: str) -> list[str]:
    """``from other import _name`` and ``other_alias._name`` where ``other`` is another module."""
    bad = []
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = node.module or ""
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__") and src != module:
                    bad.append(f"line {node.lineno}: from {'.' * node.level}{src} import {a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and aliases[node.value.id].startswith(("depthsat_theory", "proofs_checks"))
        ):
            bad.append(f"line {node.lineno}: {aliases[node.value.id]}.{node.attr}")
    return bad


def _module_name(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


# ----------------------------------------------------------------------------- the checkers can fail


def test_checkers_catch_planted_violations():
    assert issue_numbered_paths(
        ["proofs_checks/issue10_reproducers.py", "benchmarks/results/issue12-round4/x.json"]
    ) == [
        "proofs_checks/issue10_reproducers.py",
        "benchmarks/results/issue12-round4/x.json",
    ]
    assert issue_numbered_paths(["proofs_checks/verdict_reproducers.py", "tissue.md"]) == []
    assert len(issue_numbered_defs("def issue_14_table():\n    pass\n", docstrings=False)) == 1
    assert len(issue_numbered_defs('"""Depth sweep (issue 14, item 1)."""\n', docstrings=True)) == 1
    assert issue_numbered_defs('"""Depth sweep (the issue asks)."""\n', docstrings=True) == []
    assert issue_numbered_headings("# Intro\n## Where issue 12 stands\n```\n# issue 3 in code\n```\n") == [
        "line 2: ## Where issue 12 stands"
    ]
    src = "from depthsat_theory.grow.run import _train\nimport depthsat_theory.tasks.zoo as z\nz._kjv()\n"
    assert private_imports(src, "depthsat_theory.experiments.expand") == [
        "line 1: from depthsat_theory.grow.run import _train",
        "line 3: depthsat_theory.tasks.zoo._kjv",
    ]
    assert private_imports("from depthsat_theory.grow.run import train_new_blocks\n", "x") == []


# ----------------------------------------------------------------------------- the tree


def test_no_path_named_after_an_issue():
    assert issue_numbered_paths(_tracked()) == []


def test_no_function_class_or_package_docstring_cites_an_issue():
    bad = {}
    for p in _tracked():
        if p.endswith(".py"):
            found = issue_numbered_defs(
                (ROOT / p).read_text(encoding="utf-8"), docstrings=p.startswith("depthsat_theory/")
            )
            if found:
                bad[p] = found
    assert bad == {}


def test_no_heading_cites_an_issue():
    bad = {}
    for p in _tracked():
        if p.endswith(".md"):
            found = issue_numbered_headings((ROOT / p).read_text(encoding="utf-8"))
            if found:
                bad[p] = found
    assert bad == {}


@pytest.mark.parametrize("top", WALLED)
def test_no_private_name_imported_across_modules(top):
    bad = {}
    for p in _tracked():
        if p.startswith(top + "/") and p.endswith(".py"):
            found = private_imports((ROOT / p).read_text(encoding="utf-8"), _module_name(p))
            if found:
                bad[p] = found
    assert bad == {}
