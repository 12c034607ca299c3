"""Sharded diagnosis (depthsat_theory.diagnose.distributed): N processes give one process's numbers.

Two real processes join a gloo group on CPU the way ``torchrun`` starts them (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` in the environment), each takes the
probe batches ``r, r + 2, …``, and the all-reduced statistics must agree with a single
process on the whole probe to 1e-10 relative (they differ only in summation order).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from depthsat_theory.cli import app
from depthsat_theory.diagnose import diagnose
from depthsat_theory.tasks import classification_loss

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not available",
)

_PROBLEM = textwrap.dedent("""
    import torch
    from depthsat_theory.tasks.models import ResidualMLP, classification_loss

    def problem():
        torch.manual_seed(3)
        model = ResidualMLP(in_dim=6, width=5, depth=3, n_classes=3).to(torch.float64).eval()
        x = torch.randn(61, 6, dtype=torch.float64)
        y = torch.randint(0, 3, (61,))
        x[40:50] = x[0:10]  # some exact ties, so the tie pooling is exercised across ranks
        return model, [(x[i:i + 9], y[i:i + 9]) for i in range(0, 61, 9)]  # 7 batches, uneven
""")

_WORKER = textwrap.dedent("""
    import json, sys
    from depthsat_theory.diagnose import distributed
    from depthsat_theory.diagnose.run import diagnose
    from depthsat_theory.tasks.models import classification_loss
    from problem import problem

    assert distributed.init_from_env("gloo")
    model, batches = problem()
    d = diagnose(model, classification_loss, batches, family="poly:2", delta=0.2, realizability=True)
    if distributed.is_main():
        json.dump(d.to_dict(), open(sys.argv[1], "w"))
    print("rank", distributed.world(), "n", d.n, flush=True)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _close(a, b, path=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        # ρ̂ is dimensionless; at rounding level (≈1e-12 when s = r̂) only an absolute check makes sense;
        # the U-statistic of s² cancels n ŝ² against v̂, so near 0 it too is checked absolutely. Shards
        # change only the order of float64 sums: the pseudo-inverse of an ill-conditioned Σ amplifies that
        # to ~1e-10 relative (theory/numerics.md), far below what a lost or doubled shard would change.
        tol = 1e-9 if path.endswith(("realizability_defect", "score_squared_unbiased", "score_squared_se")) else 1e-13
        if ".headline." in path or path.endswith("joint_score_unbiased"):
            tol = 1e-4  # s_U = sqrt(max(0, ŝ²_U)): a 1e-9 change of ŝ²_U near 0 moves it by up to sqrt(1e-9) ≈ 3e-5
        assert a == pytest.approx(b, rel=1e-8, abs=tol), path
    elif path.endswith("n_to_certify") and a is not None and b is not None:
        # a probe size solved from ŝ, v̂ (a 1e-13 change of ŝ moves a 5e10-example plan by a few examples)
        assert a == pytest.approx(b, rel=1e-8), path
    elif path.endswith(("world_size", "notes")):
        pass
    else:
        assert a == b, path


def test_two_gloo_processes_match_one_process(tmp_path):
    (tmp_path / "problem.py").write_text(_PROBLEM)
    (tmp_path / "worker.py").write_text(_WORKER)
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(tmp_path / "worker.py"), str(tmp_path / "out.json")],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        finally:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    assert "rank (0, 2) n 61" in outs[0] and "rank (1, 2) n 61" in outs[1]

    sys.path.insert(0, str(tmp_path))
    try:
        from problem import problem
    finally:
        sys.path.remove(str(tmp_path))
    model, batches = problem()
    single = diagnose(model, classification_loss, batches, family="poly:2", delta=0.2, realizability=True)
    sharded = json.loads((tmp_path / "out.json").read_text())
    assert sharded["world_size"] == 2 and sharded["n"] == single.n == 61
    ref = json.loads(json.dumps(single.to_dict()))
    assert ref["sites"][0]["raw_score"] < ref["sites"][0]["ag_rms"]  # ties were pooled
    _close(sharded, ref)


def test_torchrun_cli_matches_single_process(tmp_path, model_cache, monkeypatch):
    env = dict(
        os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()), PYTHONPATH=str(ROOT), DEPTHSAT_CACHE=model_cache
    )  # same thread count: same cached weights as in-process
    common = ["diagnose", "--model", "mlp", "--batches", "3", "--batch-size", "16", "--rho", "-q"]
    monkeypatch.setenv("DEPTHSAT_CACHE", model_cache)  # the in-process single run below
    one = CliRunner().invoke(app, [*common, "--json", str(tmp_path / "one.json")])
    assert one.exit_code == 0, one.output
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_free_port()),
            "-m",
            "depthsat_theory.cli",
            *common,
            "--json",
            str(tmp_path / "two.json"),
            "--checkpoint",
            str(tmp_path / "ck"),
        ],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("depthsat diagnose:") == 1  # only rank 0 prints the table (its title)
    assert (tmp_path / "ck.rank0-of-2").is_file() and (tmp_path / "ck.rank1-of-2").is_file()
    a = json.loads((tmp_path / "two.json").read_text())
    b = json.loads((tmp_path / "one.json").read_text())
    assert a["world_size"] == 2 and a["n"] == b["n"] == 48
    _close(a, b)
