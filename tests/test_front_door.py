"""The front door: the README is short, its links resolve, its examples run, and the CLI reference is current.

- ``README.md`` has at most 250 lines, and every relative link or image in it names a file of the
  repository (so the links work on GitHub);
- the README's Python example (diagnose → read the verdict → grow) runs as printed, prints the
  verdicts its output block shows, and the grown model computes exactly the original function (a
  zero-output block adds an exact zero);
- the README's command-line example runs as printed and writes the grown model;
- ``book/reference/cli.md`` is what typer's own documentation generator writes for the CLI today
  (regenerate with ``./dev cli-docs``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
VERDICTS = ("improvable", "saturated", "undetermined", "degenerate")
CLI_DOCS = [
    "-m",
    "typer",
    "depthsat_theory.cli.app",
    "utils",
    "docs",
    "--name",
    "depthsat",
    "--title",
    "Command-line reference",
]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.M | re.S)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def relative_links(markdown: str) -> list[str]:
    """Targets of the inline links and images of ``markdown`` that are not URLs or anchors."""
    targets = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", markdown)
    return [t for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_relative_links_finds_links_and_images():
    text = "see [a](docs/a.md#x), ![pic](docs/p.png), [web](https://x.org) and [here](#top)"
    assert relative_links(text) == ["docs/a.md#x", "docs/p.png"]


def test_readme_is_a_short_front_door_whose_links_resolve():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    links = relative_links(text)
    assert len(links) > 10
    missing = [t for t in links if not (ROOT / t.split("#")[0]).exists()]
    assert missing == []


def test_readme_python_example_runs_and_grows_without_changing_the_function():
    text = README.read_text(encoding="utf-8")
    (code,) = [b for b in _blocks(text, "python") if "diagnose(" in b]
    (shown,) = [b for b in _blocks(text, "text") if "grown after" in b]
    out = subprocess.run(  # run from docs/, as the README says (python -c: the folder is on sys.path)
        [sys.executable, "-c", code], cwd=ROOT / "docs", env=_env(), capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    verdict = re.compile(r"^(blocks\.\d+): (\w+) ", re.M)
    assert verdict.findall(out.stdout) == verdict.findall(shown)
    assert all(v in VERDICTS for _, v in verdict.findall(out.stdout)) and len(verdict.findall(out.stdout)) == 3

    # the grown model is the original function, exactly: the new block's output weights start at zero
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import torch
        from my_model import factory

        from depthsat_theory.grow import insert_blocks

        model, _, batches = factory()
        growth = insert_blocks(model, {"blocks.1": "relu:64"}, probe=batches[0][0])
        with torch.no_grad():
            assert all(torch.equal(model(x), growth.model(x)) for x, _ in batches)
        assert sum(p.numel() for p in growth.model.parameters()) > sum(p.numel() for p in model.parameters())
    finally:
        sys.path.remove(str(ROOT / "docs"))


@pytest.mark.slow
def test_readme_cli_example_runs(tmp_path):
    text = README.read_text(encoding="utf-8")
    commands = [line for b in _blocks(text, "bash") for line in b.splitlines() if line.startswith("depthsat ")]
    assert [c.split()[1] for c in commands] == ["diagnose", "grow"]
    shutil.copy(ROOT / "docs" / "my_model.py", tmp_path / "my_model.py")
    for command in commands:
        argv = [sys.executable, "-m", "depthsat_theory.cli", *shlex.split(command)[1:]]
        out = subprocess.run(argv, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, (command, out.stderr[-2000:])
        assert "blocks.0" in out.stdout
    report = json.loads((tmp_path / "grown" / "grow-report.json").read_text(encoding="utf-8"))
    assert len(report["new_sites"]) == 1
    assert (tmp_path / "grown" / "model.safetensors").stat().st_size > 0


def test_cli_reference_page_is_generated_from_the_cli(tmp_path):
    out = tmp_path / "cli.md"
    run = subprocess.run(
        [sys.executable, *CLI_DOCS, "--output", str(out)], cwd=ROOT, env=_env(), capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    committed = (ROOT / "book" / "reference" / "cli.md").read_text(encoding="utf-8")
    assert committed == out.read_text(encoding="utf-8"), "book/reference/cli.md is stale: run ./dev cli-docs"
    for command in ("check", "score", "bound", "audit", "diagnose", "grow", "proofs", "experiment sweep"):
        assert f"## `depthsat {command}`" in committed
