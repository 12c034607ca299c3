"""Adversarial probes whose truth is known in closed form (Walsh/Hadamard columns, dyadic scales).

``z`` holds columns 1, 2 of the 64 x 64 Sylvester-Hadamard matrix ``H`` (entries ±1); the linear family's
features ``(z₁, z₂, 1)`` are columns 1, 2, 0 of ``H``, mutually orthogonal with ``Hᵀ H = 64 I``.  With
``g = (c·H[:, 1], 0)`` the gradient lies in the tangent space: the sample score is exactly ``|c|`` (RMS norm
of ``g``).  With ``g = (c·H[:, 5], 0)`` it is orthogonal to every feature: the sample score is exactly 0.
Scales ``c = 2^±100`` and float16/float32 storage keep every value exact, so the truth is not rounded.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from depthsat_theory.cli import app
from depthsat_theory.diagnose import diagnose
from depthsat_theory.statistics.linalg import noise_threshold
from depthsat_theory.tasks import CharGPT
from proofs_checks.adversarial_sweep import (
    exact_noise_ratio,
    exact_score,
    judge,
    padded_probe,
    same_result,
    stream,
    vector_probe,
)


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


# ----------------------------------------------------------------------------- exact truth on planted Walsh probes
# proofs_checks.adversarial_sweep: the truth is the rational Walsh expansion of the stored values; every verdict is
# judged against it (saturated: s ≤ tol + e; improvable: s ≥ ŝ − e > 0 and the exact noise test rejects), and a run
# interrupted halfway and resumed from its saved state must report the same result.
CHI2 = noise_threshold(0.05)


@pytest.mark.parametrize(
    ("dtype", "products", "eps"),
    [
        ("float64", "float64", 2.0**-1),
        ("float64", "float64", 2.0**-30),  # eigenvalue ratio ≈ 2^60: the triangular factor and v̂_up
        ("float64", "float32", 2.0**-1),
        ("float32", "float64", 2.0**-11),
        ("bfloat16", "float64", 2.0**-3),
    ],
)
@pytest.mark.parametrize("side", [-1e-2, -1e-4, 1e-4, 1e-2])
def test_noise_test_at_its_threshold_agrees_with_the_exact_test(dtype, products, eps, side):
    """The junk is set so that the exact noise ratio ``n s²/v`` of the stored values is ``χ²(1 ± δ)``: "improvable"
    only where the exact test rejects; every verdict holds against the exact ``s``; the resumed run is identical."""
    n, d = 256, 8
    q = CHI2 * (d + 1) / n  # a²/(a² + b²) at the threshold (every unit has leverage k̃/n)
    probe = vector_probe(n, d, [eps], [0.25], 0.25 * math.sqrt(1 / q - 1) * (1 - side), dtype)  # side > 0: above
    ratio = exact_noise_ratio(probe)
    assert abs(float(ratio) / CHI2 - 1) < 3 * abs(side) + 1e-2  # the construction sits at the threshold
    res = stream(probe, 64, products=products).result()
    jd = judge(probe, res, products)
    assert not jd.wrong and not jd.sub_resolution, jd
    if res.verdict.value == "improvable":
        assert ratio > Fraction(CHI2)
    if dtype == "float64" and eps == 0.5 and side == 1e-2 and products == "float64":
        assert res.verdict.value == "improvable"  # not vacuous: well-conditioned, 1% above the threshold
    assert same_result(res, stream(probe, 64, stop=2, products=products).result())


@pytest.mark.parametrize(
    ("dtype", "products", "eps"),
    [
        ("float32", "float32", 2.0**-11),
        ("float16", "float64", 2.0**-5),
        ("float16", "float32", 2.0**-5),
        ("bfloat16", "float64", 2.0**-3),
        ("bfloat16", "float32", 2.0**-3),
    ],
)
@pytest.mark.parametrize("signal", [0.0, 0.5, 1.1, 2.0, 4.0, "all"])
def test_low_precision_planted_direction_against_exact_truth(dtype, products, eps, signal):
    """A real planted direction (amplitude above ``ε_M``) at float32/float16/bfloat16 sites, with float64 or float32
    products, carrying ``s`` from 0 to the whole gradient, around the rounding bound ``e``: no verdict contradicts
    the exact score, and a resumed run is identical."""
    n, d = 256, 32
    pilot = stream(vector_probe(n, d, [eps], [0.0], 1.0, dtype), 64, products=products).result()
    e = pilot.score_error if math.isfinite(pilot.score_error) else 0.1
    a, b = (1.0, 0.0) if signal == "all" else (min(e * float(signal), 4.0), 1.0)
    probe = vector_probe(n, d, [eps], [a], b, dtype)
    res = stream(probe, 64, products=products).result()
    jd = judge(probe, res, products)
    assert not jd.wrong and not jd.sub_resolution, jd
    if signal == "all":
        assert res.verdict.value != "saturated"  # exact s = AG_rms
    assert same_result(res, stream(probe, 64, stop=2, products=products).result())


@pytest.mark.parametrize(
    ("dtype", "products"), [("float64", "float64"), ("float32", "float32"), ("bfloat16", "float64")]
)
@pytest.mark.parametrize(("a", "b"), [(0.0, 1.0), (1.0, 0.0), (0.25, 1.0)])
def test_padded_token_mean_sequence_site_against_exact_truth(dtype, products, a, b):
    """Per-token units of padded sequences (lengths 1–8, ``g`` divided by the length as ``token_mean`` gives), padding
    filled with values of size ``10³⁰`` (``6·10⁴`` in float16): the padding changes nothing, the verdict holds against
    the exact score of the real tokens, and a run resumed from its saved state is identical."""
    eps = {"float64": 2.0**-30, "float32": 2.0**-11, "bfloat16": 2.0**-3}[dtype]
    probe = padded_probe(256, 8, [eps], [a], b, dtype, pad=1e30)
    res = stream(probe, 16, products=products).result()
    jd = judge(probe, res, products)
    assert not jd.wrong and not jd.sub_resolution, jd
    quiet = padded_probe(256, 8, [eps], [a], b, dtype, pad=1.0)
    assert same_result(res, stream(quiet, 16, products=products).result())  # the padding's values do not matter
    assert same_result(res, stream(probe, 16, stop=2, products=products).result())
    if a == 1.0 and dtype == "float64":
        assert (
            res.verdict.value == "improvable" and abs(res.score - math.sqrt(exact_score(probe)[0])) <= res.score_error
        )


@pytest.mark.parametrize(
    ("top", "coefs", "junk"),
    [
        # well-conditioned: a small exact s within the bound
        pytest.param(2.0**-1, [2.0**-10, 0.0, 0.0], 1.0, id="well-conditioned", marks=pytest.mark.slow),
        # amplitudes 7e-7…4e-8: below what the float64 Gram resolves
        pytest.param(2.0**-20, [0.0, 0.0, 0.375], 1.0, id="ill-conditioned-s0.375"),
        # the same dropped directions carrying nothing
        pytest.param(2.0**-20, [0.0, 0.0, 0.0], 1.0, id="ill-conditioned-s0", marks=pytest.mark.slow),
        # kept amplitudes 2^-14…2^-18: the Gram's first-order bound fails (e = ∞); --gram units decides the arithmetic
        pytest.param(2.0**-14, [0.5, 0.0, 0.0], 1.0, id="e-infinite", marks=pytest.mark.slow),
    ],
)
def test_wide_float64_gram_site_against_exact_truth(top, coefs, junk):
    """k̃ = 1100 (the dense float64 Gram path, no triangular factor): three planted pairs of graded amplitudes; no
    verdict contradicts the exact score, and a run resumed from its saved state is identical."""
    graded = [top * 2.0 ** (-2 * j) for j in range(3)] if top < 0.5 else [0.5] * 3
    probe = vector_probe(2048, 1099, graded, coefs, junk, "float64")
    res = stream(probe, 512).result()
    jd = judge(probe, res)
    assert not jd.wrong and not jd.sub_resolution, jd
    if coefs[2]:
        assert res.verdict.value == "undetermined" and res.unresolved >= 1
    assert same_result(res, stream(probe, 512, stop=2).result())
    if top == 2.0**-14:
        assert not math.isfinite(res.score_error) and "--gram units" in res.verdict_reason
        units = stream(probe, 512, gram="units").result()
        assert abs(units.score - jd.exact) <= units.score_error < 1e-5  # the factored rows bound the error


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("products", ["float64", "float32"])
def test_diagnose_resumed_from_a_checkpoint_equals_the_uninterrupted_run(tmp_path, dtype, products):
    """``diagnose`` of a padded causal model (``reduction="token_mean"``, per-token units) in float64, float32 or
    bfloat16, with float64 or float32 products, interrupted after 2 of 4 batches and resumed from its checkpoint:
    every site's result (verdict, reason, every number) equals the uninterrupted run's."""
    torch.manual_seed(3)
    model = CharGPT(vocab_size=7, d_model=8, n_layers=2, n_heads=2, seq_len=8).to(dtype).eval()
    x, y = torch.randint(0, 7, (12, 8)), torch.randint(0, 7, (12, 8))
    mask = torch.arange(8)[None, :] < torch.tensor([8, 3, 5, 1, 8, 2, 7, 4, 6, 8, 2, 5])[:, None]
    batches = [(x[i : i + 3], y[i : i + 3], mask[i : i + 3]) for i in range(0, 12, 3)]

    def per_token(logits, t):
        return torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), t, reduction="none")

    kw = dict(reduction="token_mean", family="linear", products=products)
    full = diagnose(model, per_token, batches, **kw)
    ck = tmp_path / "ck.safetensors"

    def stop(done, total):
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        diagnose(model, per_token, batches, checkpoint=ck, progress=stop, **kw)
    resumed = diagnose(model, per_token, batches, checkpoint=ck, **kw)
    assert resumed.resumed_from == 2
    assert [s.result.to_dict() for s in resumed.sites] == [s.result.to_dict() for s in full.sites]
    assert all(s.result.units == int(mask.sum()) for s in full.sites)  # padded tokens left out
