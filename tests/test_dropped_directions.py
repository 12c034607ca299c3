"""Dropped directions that could carry score, and signals below the probe's resolution (theory/numerics.md).

Truth is closed form: the features are Walsh columns (±1, exactly orthogonal), one of them nearly
duplicated by ``z₂ = z₁ + ε h_w`` (``ε`` a power of two, so the stored arrays are exact), and the activation
gradient is ``a h_w + b h_junk`` on one output coordinate with ``h_junk`` orthogonal to every feature.  The
span of the features holds ``h_w`` exactly, so the exact score of the stored arrays is ``s = |a|`` and
``AG_rms = sqrt(a² + b²)``; the planted direction's amplitude on the unit-diagonal Gram is
``sqrt(1 − 1/sqrt(1 + ε²)) ≈ ε/√2``.  Sums of ``±1`` products are integers, exact in any summation order,
so the preconditions below hold on every BLAS.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy.linalg import hadamard  # also for the bfloat16 signal probe
from typer.testing import CliRunner

from depthsat_theory import parse_family
from depthsat_theory.cli import app
from depthsat_theory.statistics import statistics_for
from depthsat_theory.vocabulary import Verdict
from proofs_checks.t8_numerics import planted_amplitude, walsh_probe


def _sigma_max(eps: float) -> float:
    """``σ_max = sqrt(1 + ρ)`` of the Walsh probe's unit-diagonal Gram (closed form, :func:`planted_amplitude`)."""
    return math.sqrt(1 + 1 / math.sqrt(1 + eps * eps))


def _result(z, g, *, batch: int, **kw):
    stats = statistics_for(parse_family("linear"), tuple(z.shape[1:]), "vector", **kw)
    for i in range(0, z.shape[0], batch):
        stats.update(z[i : i + batch], g[i : i + batch])
    return stats.result()


# ----------------------------------------------------------------------------- float64 sites of k̃ > 1024 (Gram path)
N_WIDE, D_WIDE = 2048, 1100  # k̃ = 1101 > 1024: no triangular factor, the float64 Gram path


@pytest.mark.parametrize(("eps", "a"), [(2.0**-30, 2.0**-14), (2.0**-41, 0.375)], ids=["cond4e18-s6e-5", "cond5e24"])
def test_float64_wide_site_direction_below_the_gram_resolution_is_never_saturated(eps, a):
    """A direction of amplitude 6.6e-10 or 3.2e-13 (above the float64 data resolution 4e-14, below what a float64
    Gram resolves, 1.4e-6) carries exact ``s = 6e-5`` or ``0.375``: the verdict may not be "saturated"."""
    z, g = walsh_probe(N_WIDE, D_WIDE, eps, a, torch.float64, torch.float64)
    res = _result(z, g, batch=512)
    k = D_WIDE + 1
    sigma = planted_amplitude(eps)
    assert sigma > 8 * math.sqrt(k) * 2.0**-53 * 1.5  # real: above the data resolution of a float64 probe
    assert a > 2 * res.score_error  # exact s far above what "saturated" would promise
    assert res.probe_verdict is not Verdict.SATURATED and res.verdict is not Verdict.SATURATED
    assert res.verdict is Verdict.UNDETERMINED and res.unresolved >= 1
    assert "--gram units" in res.verdict_reason


@pytest.mark.parametrize("a", [2.0**-6, 0.0])
def test_float64_wide_site_is_decided_by_the_factored_unit_path(a):
    """What decides the wide float64 site: ``--gram units`` factors the rows (amplitudes to ``≈ √k̃ u64``): the
    direction is kept, exact ``s = 1/64`` is improvable within its bound, exact ``s = 0`` saturated."""
    z, g = walsh_probe(N_WIDE, D_WIDE, 2.0**-30, a, torch.float64, torch.float64)
    res = _result(z, g, batch=512, gram="units")
    assert res.tangent_rank == res.tangent_dim
    assert abs(res.score - a) <= res.score_error
    assert res.probe_verdict is (Verdict.IMPROVABLE if a else Verdict.SATURATED)


def test_float64_wide_site_cli_is_not_saturated(tmp_path):
    z, g = walsh_probe(N_WIDE, D_WIDE, 2.0**-41, 0.375, torch.float64, torch.float64)
    path = tmp_path / "wide.npz"
    np.savez(path, z=z.numpy(), g=g.numpy())
    out = CliRunner().invoke(app, ["score", "--probe", str(path), "--family", "linear", "--json"])
    assert out.exit_code == 0, out.output
    rep = json.loads(out.output)
    assert rep["verdict"] != "saturated" and rep["probe_verdict"] != "saturated"


# ----------------------------------------------------------------------------- low precision and mixed dtypes
@pytest.mark.parametrize(
    ("dtype", "n", "eps", "a"),
    [(torch.float32, 256, 2.0**-19, 2.0**-5), (torch.float16, 64, 2.0**-6, 2.0**-3)],
    ids=["float32-s0.031", "float16-s0.125"],
)
def test_direction_between_feature_rounding_and_cutoff_is_not_saturated(dtype, n, eps, a):
    """The planted amplitude lies between the tool's feature rounding ``ε_M = 4 √k̃ u`` (so rounding cannot have
    created it, Weyl) and its cutoff ``8 √k̃ u σ_max``: dropped, real, and it carries exact ``s = a``."""
    d = 8
    z, g = walsh_probe(n, d, eps, a, dtype, dtype)
    u = torch.finfo(dtype).eps / 2
    sigma = planted_amplitude(eps)
    assert 4 * math.sqrt(d + 1) * u < sigma <= 8 * math.sqrt(d + 1) * u * _sigma_max(eps)
    res = _result(z, g, batch=64)
    assert a > 2 * res.score_error and res.tangent_rank < res.tangent_dim
    assert res.probe_verdict is not Verdict.SATURATED and res.verdict is not Verdict.SATURATED


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_direction_between_feature_rounding_and_cutoff_carrying_nothing_stays_saturated(dtype):
    """The same dropped direction with ``a = 0`` (exact ``s = 0``): nothing to hide, still saturated."""
    eps = {torch.float32: 2.0**-19, torch.float16: 2.0**-6}[dtype]
    z, g = walsh_probe(256, 8, eps, 0.0, dtype, dtype)
    res = _result(z, g, batch=64)
    assert res.verdict is Verdict.SATURATED and res.unresolved == 0


@pytest.mark.parametrize("a", [2.0**-5, 0.0])
def test_float64_features_with_float32_gradients_keep_the_float64_resolution(a):
    """``z`` float64 with a direction of amplitude ``4e-8`` (real in float64, below float32's cutoff), ``g`` float32:
    the features' resolution is their own dtype's; exact ``s = a`` is found within the bound (``0``: saturated)."""
    z, g = walsh_probe(256, 8, 2.0**-24, a, torch.float64, torch.float32)
    res = _result(z, g, batch=64)
    assert res.tangent_rank == res.tangent_dim  # kept: float64 features resolve it
    assert abs(res.score - a) <= res.score_error
    assert res.probe_verdict is (Verdict.IMPROVABLE if a else Verdict.SATURATED)


# ----------------------------------------------------------------------------- below the probe's resolution
def _signal_probe(n: int, c: float, dtype):
    """``z = (h₁, h₂)``, ``g₁ = c h₁ + h₅``: exact ``s = |c|`` (Walsh columns), ``AG_rms = sqrt(1 + c²)``."""
    h = hadamard(n).astype(np.float64)
    z = h[:, 1:3].copy()
    g = np.zeros((n, 2))
    g[:, 0] = c * h[:, 1] + h[:, 5]
    zt, gt = torch.from_numpy(z).to(dtype), torch.from_numpy(g).to(dtype)
    assert np.array_equal(gt.double().numpy(), g) and np.array_equal(zt.double().numpy(), z)
    return zt, gt


def test_bfloat16_signal_within_the_rounding_bound_but_significant_is_undetermined():
    """bfloat16: ``ŝ`` (exact ``s = 1/8``) is within the rounding bound, yet the site's own noise test rejects
    ``s = 0``: below bfloat16 resolution, undetermined (never saturated); float32 decides improvable."""
    z, g = _signal_probe(1024, 0.125, torch.bfloat16)
    res = _result(z, g, batch=256)
    assert res.score <= res.score_error and res.significant is True  # the situation of the report
    assert res.verdict is Verdict.UNDETERMINED
    assert "below bfloat16 resolution" in res.verdict_reason and "float32" in res.verdict_reason
    assert res.examples_needed is None or res.examples_needed > res.n
    fine = _result(z.float(), g.float(), batch=256)
    assert fine.verdict is Verdict.IMPROVABLE and abs(fine.score - 0.125) <= fine.score_error
    zero = _result(*_signal_probe(1024, 0.0, torch.bfloat16), batch=256)
    assert zero.verdict is Verdict.SATURATED


def test_a_state_saved_before_the_features_dtype_was_kept_loads_with_the_coarser_dtype():
    """A checkpoint without ``feature_eps`` (written before it existed) loads; its features take the coarser dtype of
    ``z`` and ``g`` (``forward_eps``), the former reading, and the verdict is the one it had then."""
    z, g = walsh_probe(256, 8, 2.0**-24, 2.0**-5, torch.float64, torch.float32)
    stats = statistics_for(parse_family("linear"), (8,), "vector")
    stats.update(z, g)
    assert stats.feature_dtype == torch.float64 and stats.dtype == torch.float32
    old = {k: v for k, v in stats.state_dict().items() if k != "feature_eps"}
    fresh = statistics_for(parse_family("linear"), (8,), "vector")
    fresh.load_state_dict(old)
    assert fresh.feature_dtype == torch.float32 and fresh.n == 256
    assert fresh.result().tangent_rank < fresh.result().tangent_dim  # float32 resolution: the planted direction dropped
