"""Adversarial probes whose truth is known in closed form (Walsh/Hadamard columns, dyadic scales).

``z`` holds columns 1, 2 of the 64 x 64 Sylvester-Hadamard matrix ``H`` (entries ±1); the linear family's
features ``(z₁, z₂, 1)`` are columns 1, 2, 0 of ``H``, mutually orthogonal with ``Hᵀ H = 64 I``.  With
``g = (c·H[:, 1], 0)`` the gradient lies in the tangent space: the sample score is exactly ``|c|`` (RMS norm
of ``g``).  With ``g = (c·H[:, 5], 0)`` it is orthogonal to every feature: the sample score is exactly 0.
Scales ``c = 2^±100`` and float16/float32 storage keep every value exact, so the truth is not rounded.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from depthsat_theory.cli import app


def _walsh(order: int) -> np.ndarray:
    h = np.ones((1, 1))
    for _ in range(order):
        h = np.block([[h, h], [h, -h]])
    return h


H = _walsh(6)
Z = H[:, 1:3].copy()
ZERO = np.zeros((64, 1))


def _score(tmp_path, z: np.ndarray, g: np.ndarray):
    path = tmp_path / "p.npz"
    np.savez(path, z=z, g=g)
    out = CliRunner().invoke(app, ["score", "--probe", str(path), "--family", "linear", "--json"])
    return out


@pytest.mark.parametrize("scale", [2.0**-100, 1.0, 2.0**100])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_walsh_verdicts_at_extreme_scales_and_dtypes(tmp_path, scale, dtype):
    """In-span gradient: improvable with ``ŝ = |c|``; orthogonal gradient: saturated with ``ŝ = 0``."""
    if dtype is not np.float64 and scale != 1.0:
        scale = 2.0**-10 if scale < 1 else 2.0**10  # stays exact and finite in float16
    z = (Z * scale).astype(dtype)
    inside = (np.hstack([H[:, 1:2], ZERO]) * scale).astype(dtype)
    outside = (np.hstack([H[:, 5:6], ZERO]) * scale).astype(dtype)
    out = _score(tmp_path, z, inside)
    assert out.exit_code == 0, out.output
    rep = json.loads(out.output)
    assert rep["verdict"] == "improvable"
    assert rep["score"] == pytest.approx(scale, rel=1e-6)
    out = _score(tmp_path, z, outside)
    assert out.exit_code == 0, out.output
    rep = json.loads(out.output)
    assert rep["verdict"] in ("saturated", "undetermined")
    assert rep["score"] <= 1e-6 * scale


@pytest.mark.parametrize(("which", "value"), [("z", np.nan), ("z", np.inf), ("g", np.nan), ("g", -np.inf)])
def test_non_finite_probe_is_a_clear_error(tmp_path, which, value):
    """A NaN/Inf anywhere in the probe is refused with the array named, never scored."""
    z, g = Z.copy(), np.hstack([H[:, 5:6], ZERO])
    (z if which == "z" else g)[3, 0] = value
    out = _score(tmp_path, z, g)
    assert out.exit_code != 0
    assert f"array {which} contains NaN or Inf" in out.output
