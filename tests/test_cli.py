"""Command-line interface: ``depthsat score`` and ``depthsat check``.

Values are checked against an independent numpy least-squares projection of ``g``
onto ``span{V φ̃}`` (for ``linear``: ``φ̃ = (z, 1)``) in the empirical measure
``‖f‖² = (1/n) Σ_i |f(u_i)|²``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from depthsat_theory.cli import app

runner = CliRunner()


def _probe(tmp_path, n=50, d=4, seed=0, dtype=np.float64, **extra):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, d)).astype(dtype)
    g = rng.normal(size=(n, d)).astype(dtype)
    arrays = {"z": z, "g": g, **extra}
    path = tmp_path / "probe.npz"
    np.savez(path, **arrays)
    return path, z, g


def _numpy_score(z, g, bias=True):
    phi = np.hstack([z, np.ones((z.shape[0], 1))]) if bias else z
    coef, *_ = np.linalg.lstsq(phi, g, rcond=None)
    proj = phi @ coef
    return float(np.sqrt((proj**2).sum() / z.shape[0]))


def _json(result):
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("spec,bias", [("linear", True), ("linear-nobias", False)])
def test_score_json_matches_numpy_projection(tmp_path, spec, bias):
    path, z, g = _probe(tmp_path)
    out = _json(runner.invoke(app, ["score", "--probe", str(path), "--family", spec, "--json"]))
    for key in (
        "score",
        "raw_score",
        "ag_max",
        "ag_rms",
        "realizability_defect",
        "tangent_rank",
        "tangent_dim",
        "saturated",
        "tol",
        "n",
        "family",
    ):
        assert key in out
    expected = _numpy_score(z.astype(np.float64), g.astype(np.float64), bias)
    assert out["score"] == pytest.approx(expected, rel=1e-10)
    gn = np.linalg.norm(g, axis=1)
    assert out["ag_rms"] == pytest.approx(np.sqrt((gn**2).mean()), rel=1e-12)
    assert out["ag_max"] == pytest.approx(gn.max(), rel=1e-12)
    # continuous rows: no ties, so the pooled raw score equals AG_rms
    assert out["raw_score"] == pytest.approx(out["ag_rms"], rel=1e-12)
    assert out["realizability_defect"] == pytest.approx(np.sqrt(1 - expected**2 / out["ag_rms"] ** 2), rel=1e-8)
    d = z.shape[1]
    assert out["tangent_dim"] == d * (d + bias)
    assert out["tangent_rank"] == d * (d + bias)
    assert out["n"] == 50 and out["saturated"] is False


def test_score_saturated_probe_and_float32(tmp_path):
    rng = np.random.default_rng(1)
    z = rng.normal(size=(80, 3))
    raw = rng.normal(size=(80, 3))
    phi = np.hstack([z, np.ones((80, 1))])
    g = raw - phi @ np.linalg.lstsq(phi, raw, rcond=None)[0]  # g ⟂ T exactly (up to rounding)
    path = tmp_path / "sat.npz"
    np.savez(path, z=z, g=g)
    out = _json(runner.invoke(app, ["score", "--probe", str(path), "--family", "linear", "--json"]))
    assert out["saturated"] is True
    assert out["score"] <= out["tol"]
    assert out["ag_max"] > 0.1
    assert out["realizability_defect"] == pytest.approx(1.0, abs=1e-10)
    path32, z32, g32 = _probe(tmp_path, dtype=np.float32)
    out32 = _json(runner.invoke(app, ["score", "--probe", str(path32), "--family", "powers:2", "--json"]))
    zz = z32.astype(np.float64)
    phi2 = np.hstack([zz, zz**2])
    assert out32["score"] == pytest.approx(_numpy_score(phi2, g32.astype(np.float64)), rel=1e-6)
    assert out32["tol"] > 1e3 * out["tol"]  # float32 threshold follows the dtype


def test_score_byte_order_and_signed_zero_ties(tmp_path):
    """Big-endian float64 is float64; rows (0, 1) and (-0, 1) are the same unit."""
    path, z, g = _probe(tmp_path)
    big = tmp_path / "big.npz"
    np.savez(big, z=z.astype(">f8"), g=g.astype(">f8"))
    a = _json(runner.invoke(app, ["score", "--probe", str(path), "--family", "linear", "--json"]))
    b = _json(runner.invoke(app, ["score", "--probe", str(big), "--family", "linear", "--json"]))
    assert a["score"] == b["score"]
    zz = np.array([[0.0, 1.0], [-0.0, 1.0]])
    gg = np.array([[1.0, 0.0], [-1.0, 0.0]])  # the pooled mean over the tied unit is 0
    tie = tmp_path / "tie.npz"
    np.savez(tie, z=zz, g=gg)
    out = _json(runner.invoke(app, ["score", "--probe", str(tie), "--family", "linear", "--json"]))
    assert out["raw_score"] == 0.0 and out["ag_rms"] == 1.0


def test_score_not_fooled_by_a_weak_but_real_direction(tmp_path):
    """g linear in z along a direction of relative variance ~3e-7: s = AG_rms, not 'saturated'."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=500), rng.normal(size=500)
    z = np.stack([x, x + 1e-3 * y], axis=1)
    g = np.stack([(z[:, 1] - z[:, 0]) * 1e3, np.zeros(500)], axis=1)  # = y exactly in T
    path = tmp_path / "weak.npz"
    np.savez(path, z=z, g=g)
    out = _json(runner.invoke(app, ["score", "--probe", str(path), "--family", "linear", "--json"]))
    assert out["saturated"] is False
    assert out["score"] == pytest.approx(out["ag_rms"], rel=1e-6)
    assert out["tangent_rank"] == 6


def test_score_table_output(tmp_path):
    path, *_ = _probe(tmp_path)
    res = runner.invoke(app, ["score", "--probe", str(path), "--family", "relu:16:3"])
    assert res.exit_code == 0
    assert "score" in res.stdout and "relu:16:3" in res.stdout


@pytest.mark.parametrize(
    "case,needle",
    [
        ("missing_g", "missing array"),
        ("shape", "must match"),
        ("nan", "NaN"),
        ("empty", "empty"),
        ("family", "bad family spec"),
        ("not_npz", "not an .npz archive"),
        ("no_file", "no such file"),
        ("ints", "dtype"),
        ("npy", "not an .npz archive"),
        ("directory", "is a directory"),
        ("overflow", "overflowed float64"),
        ("underflow", "underflow"),
        ("huge_degree", "degree must be in"),
    ],
)
def test_score_bad_input_is_one_line(tmp_path, case, needle):
    rng = np.random.default_rng(0)
    path = tmp_path / "p.npz"
    fam = "linear"
    if case == "missing_g":
        np.savez(path, z=rng.normal(size=(5, 2)))
    elif case == "shape":
        np.savez(path, z=rng.normal(size=(5, 2)), g=rng.normal(size=(5, 3)))
    elif case == "nan":
        g = rng.normal(size=(5, 2))
        g[1, 1] = np.nan
        np.savez(path, z=rng.normal(size=(5, 2)), g=g)
    elif case == "empty":
        np.savez(path, z=np.zeros((0, 2)), g=np.zeros((0, 2)))
    elif case == "family":
        np.savez(path, z=rng.normal(size=(5, 2)), g=rng.normal(size=(5, 2)))
        fam = "banana:3"
    elif case == "not_npz":
        path.write_text("not a zip")
    elif case == "no_file":
        path = tmp_path / "absent.npz"
    elif case == "ints":
        np.savez(path, z=np.ones((5, 2), dtype=np.int64), g=np.ones((5, 2), dtype=np.int64))
    elif case == "npy":
        path = tmp_path / "p.npy"
        np.save(path, rng.normal(size=(5, 2)))
    elif case == "directory":
        path = tmp_path
    elif case == "overflow":
        np.savez(path, z=rng.normal(size=(5, 2)) * 1e160, g=rng.normal(size=(5, 2)))
    elif case == "underflow":
        np.savez(path, z=rng.normal(size=(5, 2)), g=rng.normal(size=(5, 2)) * 1e-170)
    elif case == "huge_degree":
        np.savez(path, z=rng.normal(size=(5, 2)), g=rng.normal(size=(5, 2)))
        fam = "poly:99999999999999999999"
    proc = subprocess.run(
        [sys.executable, "-m", "depthsat_theory.cli", "score", "--probe", str(path), "--family", fam],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:") and needle in lines[0]
    assert "Traceback" not in proc.stderr


def test_check_cli_writes_report_and_flags_rotation(tmp_path, model_cache):
    rep = tmp_path / "report.json"
    res = runner.invoke(
        app, ["check", "--instances", "8", "--seed", "2", "--report", str(rep), "--cache-dir", model_cache, "--quiet"]
    )
    assert res.exit_code == 0, res.output
    data = json.loads(rep.read_text())
    assert data["instances"] == 8 and data["counterexamples"] == 0 and data["seed"] == 2
    assert "agree" in res.stdout
    rep2 = tmp_path / "planted.json"
    res = runner.invoke(
        app,
        [
            "check",
            "--instances",
            "16",
            "--seed",
            "2",
            "--report",
            str(rep2),
            "--cache-dir",
            model_cache,
            "--quiet",
            "--optimizers",
            "rotation",
            "--construction-fraction",
            "0",
        ],
    )
    assert res.exit_code == 1
    assert json.loads(rep2.read_text())["counterexamples"] > 0


def test_check_cli_bad_options(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "depthsat_theory.cli",
            "check",
            "--instances",
            "0",
            "--report",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "Traceback" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "depthsat_theory.cli", "check", "--report", str(tmp_path / "missing" / "r.json")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "does not exist" in proc.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (["bound", "--delta", "0.1", "--n", "abc"], "Invalid value for '--n'"),
        (["score", "--no-such-flag"], "No such option: --no-such-flag"),
        (["no-such-command"], "No such command"),
    ],
)
def test_usage_errors_are_one_line(args, needle):
    """Option-parsing errors follow the same contract as value errors: one line, exit 2."""
    proc = subprocess.run(
        [sys.executable, "-m", "depthsat_theory.cli", *args], capture_output=True, text=True, check=False
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_bad_paths_are_user_errors_not_internal_errors(tmp_path):
    """A --json folder that does not exist, or a cache location that is a file, is bad
    input (exit 2, one line) and is refused before any work starts."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [
        (["proofs", "--quick", "--json", str(tmp_path / "no" / "x.json")], {}, "does not exist"),
        (["check", "-n", "1", "--cache-dir", str(afile)], {}, "is a file, not a folder"),
        (["diagnose", "--model", "mlp"], {"DEPTHSAT_CACHE": str(afile)}, "is a file, not a folder"),
    ]
    import os

    for args, env, needle in cases:
        proc = subprocess.run(
            [sys.executable, "-m", "depthsat_theory.cli", *args],
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, **env},
        )
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and ln.startswith("error")]
        assert proc.returncode == 2, (args, proc.stderr)
        assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr


def test_score_json_is_the_result_dict_plus_note(tmp_path):
    """``depthsat score --json`` prints ``SaturationResult.to_dict()`` (computed here) and a note."""
    import torch

    from depthsat_theory.families import parse_family
    from depthsat_theory.statistics import statistics_for

    path, z, g = _probe(tmp_path)
    out = _json(runner.invoke(app, ["score", "--probe", str(path), "--family", "poly:2", "--json"]))
    acc = statistics_for(parse_family("poly:2"), (z.shape[1],), "vector", pool_ties=True)
    acc.update(torch.from_numpy(z), torch.from_numpy(g))
    ref = acc.result().to_dict()
    assert set(out) == set(ref) | {"note", "headline"}
    for key, val in ref.items():
        assert out[key] == (pytest.approx(val, rel=1e-12) if isinstance(val, float) else val), key
    assert "empirical measure of the probe" in out["note"]
    # the headline s_U = sqrt(max(0, (n ŝ² − v̂)/(n − 1))) (def-bias-corrected-score), from the result's own fields
    n, s, v = ref["n"], ref["score"], ref["noise_variance"]
    assert out["headline"]["score"] == pytest.approx(
        math.sqrt(max(0.0, (n * s * s - v) / (n - 1))), rel=1e-9, abs=1e-12
    )


def test_every_bound_argument_has_a_flag():
    """Each Python argument of the bounds the CLI passes on has a flag of ``depthsat bound``/``score``."""
    import inspect

    from depthsat_theory.bounds import interval_from_probe, plan_bound
    from depthsat_theory.cli.flags import FLAGS

    args = set(inspect.signature(plan_bound).parameters) | {"epsilon", "candidates", "bootstrap"}
    args |= {"grad_max", "leverage_max", "feature_norm_max", "eig_floor", "ridge", "variance"}
    assert args <= set(FLAGS)
    assert {"delta", "epsilon", "candidates", "bootstrap"} <= set(inspect.signature(interval_from_probe).parameters)
    helps = {cmd: runner.invoke(app, [cmd, "--help"]).stdout for cmd in ("bound", "score")}
    for name, flag in FLAGS.items():
        assert flag == "--" + name.replace("_", "-")
        assert any(flag in text for text in helps.values()), flag


def test_cli_package_exports_app_and_main():
    import depthsat_theory.cli as cli

    assert cli.__all__ == ["app", "main"]
    assert callable(cli.main) and cli.app.registered_commands


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--instances", "0"], "error: --instances must be >= 1, got 0"),
        (["--construction-fraction", "2"], "error: --construction-fraction must be in [0, 1], got 2.0"),
        (["--models", "mlp,foo"], "error: unknown model kind 'foo' in --models; use mlp, cnn, gpt"),
        (["--seed", "-1"], "error: --seed must be >= 0, got -1"),
    ],
)
def test_check_config_errors_name_the_flags(args, message, tmp_path):
    """The checker's CheckConfig names Python fields; the CLI reports them as its own flags."""
    from depthsat_theory.check import CheckConfig

    with pytest.raises(ValueError, match="instances must be >= 1"):
        CheckConfig(instances=0).validate()
    res = subprocess.run(
        [sys.executable, "-m", "depthsat_theory.cli", "check", *args, "--report", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 2
    assert res.stderr.strip() == message


def test_check_writable_says_whether_the_report_folder_is_missing_or_a_file(tmp_path):
    from depthsat_theory.cli.inputs import check_writable

    a_file = tmp_path / "f"
    a_file.write_text("")
    with pytest.raises(OSError, match="is not a folder"):
        check_writable(a_file / "r.json")
    with pytest.raises(OSError, match="does not exist"):
        check_writable(tmp_path / "missing" / "r.json")


def test_a_usage_error_in_a_subcommand_names_its_full_path():
    res = subprocess.run(
        [sys.executable, "-m", "depthsat_theory.cli", "experiment", "all", "--out", "x"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 2
    assert res.stderr.strip().endswith("(see depthsat experiment all --help)"), res.stderr
