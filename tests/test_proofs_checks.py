"""The machine checks of ``theory/``'s claims (``proofs_checks``) and their runner.

Every claim module's checks run in quick mode and must pass (instances > 0, zero
counterexamples); the runner must report a failing check and exit 1; ``python -m
proofs_checks`` and ``depthsat proofs`` print the table.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

import proofs_checks
from proofs_checks import CHECKS, Context, Outcome, check, run_and_report

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache_env(monkeypatch, model_cache):
    """Trained weights come from the shared cache (``$DEPTHSAT_CACHE`` or a session folder)."""
    monkeypatch.setenv("DEPTHSAT_CACHE", model_cache)
    return model_cache


def _module_checks(mod: str):
    try:
        importlib.import_module(f"proofs_checks.{mod}")
    except ModuleNotFoundError as exc:
        if exc.name == f"proofs_checks.{mod}":
            pytest.fail(f"claim module proofs_checks/{mod}.py is missing")
        raise
    return [c for c in CHECKS if c.module == f"proofs_checks.{mod}"]


@pytest.mark.parametrize("mod", proofs_checks.MODULES)
def test_claim_module_passes_in_quick_mode(mod, cache_env):
    checks = _module_checks(mod)
    assert checks, f"{mod} registers no checks"
    ctx = Context(seed=0, quick=True)
    failures = []
    for chk in checks:
        out = chk.fn(ctx)
        assert isinstance(out, Outcome)
        if out.instances <= 0 or out.counterexamples != 0:
            failures.append(
                f"{chk.name}: {out.instances} instances, {out.counterexamples} counterexamples; "
                f"{out.converse} {out.detail}"
            )
    assert not failures, "\n".join(failures)


def test_claim_module_checks_are_well_formed():
    """Each of T1–T6 registers symbolic and numeric checks; converse checks say what failed."""
    for mod in proofs_checks.MODULES[:6]:
        checks = _module_checks(mod)
        methods = {c.method for c in checks}
        assert {"symbolic", "numeric"} <= methods, (mod, methods)
        claims = {c.claim for c in checks}
        assert claims == {f"T{mod[1]}"}, (mod, claims)
    for mod in ("t3_updates", "t4_reparameterization", "t6_realizability"):
        assert any(c.method == "converse" for c in _module_checks(mod)), mod


def test_checks_are_deterministic(cache_env):
    """Same seed, same figures (a symbolic and a numeric check)."""
    mod = importlib.import_module("proofs_checks.t4_reparameterization")
    ctx = Context(seed=3, quick=True)
    assert mod.reparam_symbolic(ctx) == mod.reparam_symbolic(ctx)
    assert mod.reparam_numeric(ctx) == mod.reparam_numeric(ctx)


@pytest.fixture
def scratch_registry(monkeypatch):
    """A registry with no claim modules: ``load_all`` imports nothing, ``CHECKS`` is restored after."""
    saved = list(CHECKS)
    monkeypatch.setattr(proofs_checks, "MODULES", ())
    yield CHECKS
    CHECKS[:] = saved


def test_runner_reports_a_failing_check(scratch_registry, tmp_path):
    @check("TFAIL", "thm-deliberately-false", "deliberately-failing", "numeric")
    def _failing(ctx):
        return Outcome(instances=3, counterexamples=2, detail="2 of 3 deliberately wrong")

    @check("TFAIL", "thm-deliberately-false", "deliberately-raising", "symbolic")
    def _raising(ctx):
        raise RuntimeError("boom")

    @check("TOK", "thm-fine", "passing", "numeric")
    def _passing(ctx):
        return Outcome(instances=1, counterexamples=0)

    console = Console(record=True, width=200)
    path = tmp_path / "rows.json"
    status = run_and_report(Context(quick=True), only=["TFAIL"], console=console, quiet=True, json_path=str(path))
    text = console.export_text()
    assert status == 1
    assert "FAILED TFAIL deliberately-failing: 2 counterexample(s)" in text
    assert "FAILED TFAIL deliberately-raising: RuntimeError: boom" in text
    assert "TOK" not in text  # --only filtered it out
    doc = json.loads(path.read_text())
    assert doc["passed"] is False and len(doc["rows"]) == 2

    console = Console(record=True, width=200)
    assert run_and_report(Context(), only=["TOK"], console=console, quiet=True) == 0
    assert run_and_report(Context(), only=["TNONE"], console=console, quiet=True) == 2


def test_json_report_keeps_numpy_numbers_of_a_table(scratch_registry, tmp_path):
    # T7's coverage table holds its probe sizes as np.int64; --json once died on them
    import numpy as np

    @check("TNP", "thm-fine", "numpy-table", "numeric")
    def _table(ctx):
        rows = [["pop", np.int64(2000), np.float64(0.5)]]
        return Outcome(instances=1, counterexamples=0, table=("t", ["population", "n", "coverage"], rows))

    path = tmp_path / "rows.json"
    console = Console(record=True, width=200)
    assert run_and_report(Context(quick=True), only=["TNP"], console=console, quiet=True, json_path=str(path)) == 0
    (row,) = json.loads(path.read_text())["rows"]
    assert row["table"][2] == [["pop", 2000, 0.5]]


def test_scratch_registry_restores_checks(scratch_registry):
    n = len(scratch_registry)

    @check("TTMP", "thm-tmp", "temporary-check", "numeric")
    def _tmp(ctx):
        return Outcome(1, 0)

    assert len(scratch_registry) == n + 1
    assert proofs_checks.CHECKS is scratch_registry


def _run(args: list[str], model_cache: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), DEPTHSAT_CACHE=model_cache, OMP_NUM_THREADS="1", COLUMNS="250")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    "args",
    [["-m", "proofs_checks"], ["-m", "depthsat_theory.cli", "proofs"]],
    ids=["python-m-proofs_checks", "depthsat-proofs"],
)
def test_command_line_prints_the_table(args, model_cache):
    proc = _run([*args, "--only", "T1", "--quick"], model_cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for text in (
        "proofs_checks (seed 0, quick)",
        "t1-chain-rule-origin",
        "t1-tower-property",
        "t1-autograd-gradient",
        "thm-gradient",
        "lem-tower",
        "symbolic",
        "numeric",
    ):
        assert text in out, out
    assert "0 counterexamples, 0 failed" in out
    assert "t2-" not in out  # --only T1
