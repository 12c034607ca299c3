"""Checks that pin the verdict boundary: each kills a class of mutants of the error model.

``./dev mutate`` runs mutmut over the verdict code; every test here was added for mutants that
survived the rest of the suite, with its expected value derived independently of the code under
test: the exact score of the stored arrays in rational arithmetic
(:func:`proofs_checks.t8_numerics.exact_score`), the closed forms of theory/numerics.md evaluated
with a dense numpy eigensolve, or matrices whose spectrum is known in closed form.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from depthsat_theory import parse_family
from depthsat_theory.statistics import resolve_spectrum, statistics_for
from depthsat_theory.statistics.linalg import (
    Spectrum,
    default_rtol,
    default_tol,
    noise_threshold,
    pinv_quadratic,
    score_error,
)
from depthsat_theory.statistics.result import SaturationResult
from depthsat_theory.vocabulary import Verdict
from proofs_checks.t8_numerics import exact_score, near_threshold_probe

# theory/numerics.md: unit roundoffs and the constants C_res, C_g, C_φ, C_acc as the page states them
# NB every pytest.approx here passes abs=0: its default absolute tolerance 1e-12 would make
# comparisons of rounding-level quantities (e ≈ 1e-14, rtol ≈ 1e-15) vacuous
U = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
C_RES, C_G, C_PHI = 8.0, 64.0, 4.0


def _result(z, g, family="linear", **kw):
    stats = statistics_for(parse_family(family), tuple(z.shape[1:]), "vector")
    stats.update(z, g)
    return stats.result(**kw)


def _reference_bound(z: np.ndarray, g: np.ndarray, dtype: torch.dtype, bias: bool = True):
    """``(ŝ, e)`` of ``thm-score-error`` for vector units, by a dense numpy eigensolve (no engine code).

    ``Σ̃`` is the unit-diagonal feature Gram of ``[z, 1]``, ``λ_min`` its smallest eigenvalue (all
    kept: the instances are well above every resolution cutoff), ``ŝ² = tr(G̃ Σ̃⁻¹ G̃ᵀ)``.
    """
    n = z.shape[0]
    phi = np.concatenate([z, np.ones((n, 1))], 1) if bias else z
    sig = phi.T @ phi / n
    dinv = 1 / np.sqrt(np.diag(sig))
    sig_t = sig * np.outer(dinv, dinv)
    big_g = (g.T @ phi / n) * dinv
    # amplitudes from the SVD of the scaled data matrix (def-resolution), accurate where eigh of Σ̃ is not
    lam = np.linalg.svd(phi * dinv / math.sqrt(n), compute_uv=False) ** 2
    s_hat = math.sqrt(float(np.trace(big_g @ np.linalg.solve(sig_t, big_g.T))))
    a = math.sqrt(float(np.mean(np.sum(g * g, 1))))
    k, u_in, u64 = phi.shape[1], U[dtype], U[torch.float64]
    eps_m = C_PHI * u_in * math.sqrt(k)
    gamma = (n + 1) * u64  # worst-case recursive summation: one batch of n units, one batch
    if dtype == torch.float64:  # float64 probes stream the TSQR factor: a QR backward error, no Gram rounding
        eps_m += C_RES * math.sqrt(k) * u64
        eta = 0.0
    else:
        eta = k * (gamma + C_RES * u64)
    lam_min = float(lam.min())
    sig_min = math.sqrt(lam_min)
    assert eps_m < sig_min / 2 and eta < lam_min / 2  # first order holds on these instances
    e = C_G * u_in * a + a * eps_m / (sig_min - eps_m) + a * gamma * math.sqrt(k) / sig_min + s_hat * eta / lam_min
    return s_hat, e


# ----------------------------------------------------------------------------- the rounding bound itself
@pytest.mark.parametrize(
    ("dtype", "spread"),
    [(torch.float64, 1.0), (torch.float64, 1e-3), (torch.float32, 1e-2), (torch.float16, 0.3)],
)
def test_score_error_is_the_theorem_bound(dtype, spread):
    """``score_error`` equals ``e`` of ``thm-score-error`` (all four terms, σ_min vs λ_min, √k̃, √N)."""
    rng = np.random.default_rng(21)
    n = 300
    t = rng.standard_normal(n)
    z64 = np.stack([t, t + spread * rng.standard_normal(n), rng.standard_normal(n)], 1)
    g64 = 0.3 * z64[:, ::-1] + rng.standard_normal((n, 3))
    z, g = torch.from_numpy(z64).to(dtype), torch.from_numpy(g64).to(dtype)
    s_ref, e_ref = _reference_bound(z.double().numpy(), g.double().numpy(), dtype)
    res = _result(z, g)
    assert res.score == pytest.approx(s_ref, rel=1e-9, abs=0)
    assert res.score_error == pytest.approx(e_ref, rel=1e-8, abs=0)
    assert res.tol == res.score_error  # the threshold is the bound unless one is given
    assert res.dtype == str(dtype).replace("torch.", "")


@pytest.mark.parametrize(("dtype", "eps"), [(torch.float16, 0.03), (torch.bfloat16, 0.15)])
def test_half_precision_input_rounding_is_within_fifty_times_the_bound(dtype, eps):
    """Kills ``score_error × 1/100``: an exactly saturated model whose half-precision inputs give ``ŝ > e/50``.

    ``z = (t, t + ε w)`` in float64 and ``g`` orthogonal (in float64) to ``[z, 1]`` but along the
    part of the half-precision rounding of the small direction ``z₂ − z₁`` that ``[z, 1]`` does not
    explain: the model is saturated (exact score ≈ 1e-16), while the stored arrays have an exact
    score of a few hundredths of ``AG_rms``: the worst case the input-rounding term is there for.
    """
    rng = np.random.default_rng(0)
    n = 400
    t, w = rng.standard_normal(n), rng.standard_normal(n)
    z64 = np.stack([t, t + eps * w], 1)
    z = torch.from_numpy(z64).to(dtype)
    err = z.double().numpy() - z64
    design = np.concatenate([z64, np.ones((n, 1))], 1)
    drift = err[:, 1] - err[:, 0]
    perp = drift - design @ np.linalg.lstsq(design, drift, rcond=None)[0]
    g64 = np.stack([perp, perp], 1) / np.sqrt(np.mean(2 * perp * perp))
    g = torch.from_numpy(g64).to(dtype)
    model = exact_score(z64, g64)  # the model's own (float64) arrays
    stored = exact_score(z.double().numpy(), g.double().numpy())  # what the half-precision pass produced
    res = _result(z, g)
    assert model <= 1e-12 * res.ag_rms
    assert res.score == pytest.approx(stored, rel=1e-9, abs=0)  # the engine scores the stored arrays accurately
    assert abs(res.score - model) <= res.score_error  # the bound covers the input rounding ...
    assert stored > res.score_error / 50  # ... and is not a hundred times too loose here
    # saturated within the bound, or undetermined where 2e ≥ AG_rms (bfloat16); never improvable
    assert res.probe_verdict is not Verdict.IMPROVABLE
    assert res.verdict is Verdict.SATURATED or 2 * res.score_error >= res.ag_rms


@pytest.mark.parametrize(("dtype", "eps"), [(torch.float64, 1e-3), (torch.float32, 1e-2), (torch.float16, 0.3)])
def test_signal_at_ten_times_the_theorem_bound_is_improvable(dtype, eps):
    """Kills ``score_error × 1000``: exact ``s`` (rational truth) at ``10 e`` with ``e`` computed here.

    The plant's size comes from :func:`_reference_bound`, not from the engine, so a tolerance
    scaled by any factor above 10 calls this site saturated.
    """
    z, g0, v = near_threshold_probe(np.random.default_rng(8), eps, 150, dtype)
    zs = z.double().numpy()
    _, e0 = _reference_bound(zs, g0.double().numpy(), dtype)
    vv = np.stack([v, v], 1) / np.sqrt(np.mean(2 * v * v))
    g = (g0.double() + torch.from_numpy(10 * e0 * vv)).to(dtype)
    truth = exact_score(zs, g.double().numpy())
    _, e = _reference_bound(zs, g.double().numpy(), dtype)
    assert 5 * e < truth < 20 * e
    res = _result(z, g)
    assert abs(res.score - truth) <= res.score_error
    assert res.probe_verdict is Verdict.IMPROVABLE  # (the noise test is not asked: g₀ is pure noise)


# ----------------------------------------------------------------------------- resolution cutoffs
def _equicorrelation(k: int, c: float) -> np.ndarray:
    """``(1 − c) I + c 11ᵀ``: unit diagonal, eigenvalues ``1 + (k − 1) c`` (once) and ``1 − c``."""
    return (1 - c) * np.eye(k) + c * np.ones((k, k))


def _c_at(k: int, ratio: float) -> float:
    """The ``c`` with ``(1 − c) / (1 + (k − 1) c) = ratio``."""
    return (1 - ratio) / (1 + (k - 1) * ratio)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [2, 8])
def test_data_resolution_is_relative_to_the_largest_eigenvalue(dtype, k):
    """Kills a cutoff scaled by ``1/k̃`` or made absolute: ``λ`` is kept iff ``λ/λ_max > (C_res √k̃ u_in)²``.

    The Gram ``(1 − c) I + c 11ᵀ`` has ``λ_max = 1 + (k̃ − 1)c ≈ k̃``: an absolute cutoff, or one
    divided by ``k̃``, keeps directions at ``0.8`` of the relative cutoff.
    """
    rtol = (C_RES * math.sqrt(k) * U[dtype]) ** 2  # def-resolution: σ_data = C_res √k̃ u_in σ_max
    below = resolve_spectrum(_equicorrelation(k, _c_at(k, 0.8 * rtol)), dtype=dtype)
    above = resolve_spectrum(_equicorrelation(k, _c_at(k, 1.25 * rtol)), dtype=dtype)
    lam_max = 1 + (k - 1) * _c_at(k, 0.8 * rtol)
    assert below.rtol == pytest.approx(rtol, rel=1e-12, abs=0)
    assert below.lam_max == pytest.approx(lam_max, rel=1e-12, abs=0)
    assert below.cutoff == pytest.approx(rtol * lam_max, rel=1e-12, abs=0)
    assert below.rank == 1 and below.unresolved == 0
    assert above.rank == k and above.unresolved == 0
    assert above.lam_min == pytest.approx(1.25 * rtol * above.lam_max, rel=1e-4, abs=0)


@pytest.mark.parametrize("k", [2, 8])
def test_float64_gram_resolution_counts_unresolved_directions(k):
    """A float64 Gram resolves ``λ/λ_max`` only down to ``C_res k̃ u64``; directions below it are unresolved."""
    rtol = C_RES * k * U[torch.float64]
    below = resolve_spectrum(_equicorrelation(k, _c_at(k, 0.5 * rtol)), dtype=torch.float64)
    above = resolve_spectrum(_equicorrelation(k, _c_at(k, 2 * rtol)), dtype=torch.float64)
    assert below.rtol == pytest.approx(rtol, rel=1e-12, abs=0)
    assert below.rank == 1 and below.unresolved == k - 1
    assert above.rank == k and above.unresolved == 0
    # an explicit rtol counts nothing unresolved
    assert resolve_spectrum(_equicorrelation(k, _c_at(k, 0.5 * rtol)), rtol=rtol).unresolved == 0


def test_triangular_factor_resolves_to_the_data_resolution():
    """With a factor ``R`` (``Σ = RᵀR``), amplitudes are resolved to ``C_res √k̃ u64 σ_max``: nothing unresolved.

    ``R = [[1, 1], [0, t]]`` is bidiagonal, so its singular values are computed to high relative
    accuracy: ``σ_min/σ_max = t/2`` to first order.
    """
    rtol = (C_RES * math.sqrt(2) * U[torch.float64]) ** 2
    for amp, rank in ((1e5, 2), (2.0, 2), (0.5, 1)):
        factor = np.array([[1.0, 1.0], [0.0, 2 * amp * math.sqrt(rtol)]])  # λ_min/λ_max ≈ amp² rtol
        spec = resolve_spectrum(factor.T @ factor, dtype=torch.float64, factor=factor)
        assert spec.rtol == pytest.approx(rtol, rel=1e-12, abs=0)
        assert spec.rank == rank and spec.unresolved == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_unit_diagonal_scaling_makes_a_tiny_feature_resolvable(dtype):
    """Kills dropping the unit-diagonal scaling: a feature of scale ``2⁻ᵐ`` carrying all of ``g``.

    Unscaled, its Gram eigenvalue is ``2⁻²ᵐ`` of the largest (``m = 30``: below every Gram cutoff) and
    its amplitude ``2⁻ᵐ`` (``m = 55`` for float64 probes, whose TSQR factor resolves amplitudes down to
    ``8 sqrt(k̃) u64``); scaled it is an ordinary direction and the exact score (rational truth) is ``AG_rms``.
    """
    rng = np.random.default_rng(9)
    n = 200
    m = 55 if dtype == torch.float64 else 30
    z64 = np.stack([rng.standard_normal(n), 2.0**-m * rng.standard_normal(n)], 1)
    w = z64[:, 1] - np.mean(z64[:, 1])
    g64 = np.stack([w, -w], 1) * 2.0**m
    z, g = torch.from_numpy(z64).to(dtype), torch.from_numpy(g64).to(dtype)
    truth = exact_score(z.double().numpy(), g.double().numpy())
    res = _result(z, g)
    assert truth == pytest.approx(res.ag_rms, rel=1e-6, abs=0)
    assert res.tangent_rank == 6
    assert res.score == pytest.approx(truth, rel=1e-6, abs=0)
    assert res.probe_verdict is Verdict.IMPROVABLE


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rescaling_a_feature_by_a_power_of_two_changes_nothing(dtype):
    """``T``, ``Π`` and ``s`` do not change under ``z_j → 2^m z_j`` (T4); nor do the cutoff and the bound."""
    rng = np.random.default_rng(10)
    n = 120
    z64 = rng.standard_normal((n, 3))
    g64 = 0.2 * z64 + rng.standard_normal((n, 3))
    base = _result(torch.from_numpy(z64).to(dtype), torch.from_numpy(g64).to(dtype))
    scaled = z64 * np.array([2.0**40, 1.0, 2.0**-40])
    res = _result(torch.from_numpy(scaled).to(dtype), torch.from_numpy(g64).to(dtype))
    for key in ("score", "score_error", "rtol", "noise_variance"):
        assert getattr(res, key) == pytest.approx(getattr(base, key), rel=1e-9, abs=0), key
    assert res.tangent_rank == base.tangent_rank == 12


# ----------------------------------------------------------------------------- the verdict rules
def _bare(**kw) -> SaturationResult:
    fields = dict(
        score=1.0,
        raw_score=float("nan"),
        ag_rms=4.0,
        ag_max=3.0,
        realizability_defect=float("nan"),
        relative_score=0.5,
        activation_scaled_score=1.0,
        tangent_rank=4,
        tangent_dim=4,
        degenerate=False,
        saturated=False,
        tol=1.0,
        cutoff=0.0,
        rtol=0.0,
        n=100,
        units=100,
        family="linear",
        unit="row",
        dtype="float64",
        gradient=np.zeros(4),
    )
    fields.update(kw)
    return SaturationResult(**fields)


@pytest.mark.parametrize(
    ("kw", "probe", "verdict"),
    [
        (dict(score=1.0, tol=1.0), Verdict.SATURATED, Verdict.SATURATED),  # ŝ ≤ e: the boundary is saturated
        (dict(score=1.0 + 1e-12, tol=1.0), Verdict.IMPROVABLE, Verdict.IMPROVABLE),
        (dict(score=0.0, tol=0.0), Verdict.SATURATED, Verdict.SATURATED),
        (dict(score=0.5, tol=1.0, unresolved=1), Verdict.UNDETERMINED, Verdict.UNDETERMINED),
        (dict(score=2.0, tol=1.0, unresolved=3), Verdict.IMPROVABLE, Verdict.IMPROVABLE),  # a lower bound above e
        (dict(score=5.0, tol=math.inf), Verdict.UNDETERMINED, Verdict.UNDETERMINED),
        (dict(score=0.0, tol=0.0, degenerate=True, tangent_rank=0), Verdict.DEGENERATE, Verdict.DEGENERATE),
        (dict(score=5.0, tol=math.inf, degenerate=True), Verdict.DEGENERATE, Verdict.DEGENERATE),
        # the noise test: n ŝ²/v̂ ≤ χ² is not significant, above it is
        (dict(score=2.0, noise_ratio=3.0, noise_threshold=3.0), Verdict.IMPROVABLE, Verdict.UNDETERMINED),
        (dict(score=2.0, noise_ratio=3.0 + 1e-9, noise_threshold=3.0), Verdict.IMPROVABLE, Verdict.IMPROVABLE),
        (dict(score=0.5, noise_ratio=0.1, noise_threshold=3.0), Verdict.SATURATED, Verdict.SATURATED),
        (dict(score=0.5, noise_ratio=0.1, noise_threshold=3, unresolved=1), Verdict.UNDETERMINED, Verdict.UNDETERMINED),
        (dict(score=2.0, noise_ratio=math.inf, noise_threshold=3.0), Verdict.IMPROVABLE, Verdict.IMPROVABLE),
    ],
)
def test_verdict_rules_of_the_theory_page(kw, probe, verdict):
    """The four outcomes exactly as theory/numerics.md states them (``ŝ ≤ e`` saturated, ``n ŝ²/v̂ ≤ χ²`` noise)."""
    res = _bare(**kw)
    assert res.probe_verdict is probe
    assert res.verdict is verdict
    assert res.to_dict()["verdict"] == verdict.value and res.to_dict()["probe_verdict"] == probe.value


def test_significance_and_examples_needed():
    """``significant``: ``None`` when not streamed; ``n* = ⌈χ² v̂ / ŝ²_U⌉`` (thm-noise-test), ``None`` without signal."""
    assert _bare().significant is None
    assert _bare(noise_ratio=3.0, noise_threshold=3.0).significant is False
    assert _bare(noise_ratio=3.5, noise_threshold=3.0).significant is True
    need = dict(noise_threshold=3.0, noise_variance=2.0, n=10)
    assert _bare(**need, score_squared_unbiased=0.375).examples_needed == 16  # 6/0.375
    assert _bare(**need, score_squared_unbiased=0.3125).examples_needed == 20  # ⌈19.2⌉
    assert (
        _bare(noise_threshold=3.0, noise_variance=2.0, score_squared_unbiased=0.375).examples_needed is None
    )  # n = 100
    assert _bare(noise_threshold=3.0, noise_variance=2.0, score_squared_unbiased=0.0).examples_needed is None
    assert _bare(noise_threshold=3.0, noise_variance=2.0, score_squared_unbiased=-1.0).examples_needed is None
    assert _bare(noise_threshold=3.0, noise_variance=0.0, score_squared_unbiased=1.0).examples_needed is None


def test_examples_needed_never_names_a_size_the_probe_reaches():
    """``n*`` is a probe size to reach: at or below ``n`` it is not shown (sample size is not what is missing); a
    noise-test undetermined verdict with such an ``n*`` (float32 products test ``ŝ − e``) says a larger probe alone
    would not decide, and names no size."""
    need = dict(noise_threshold=3.0, noise_variance=2.0, score_squared_unbiased=0.375)  # n* = 16
    assert _bare(**need, n=15).examples_needed == 16
    assert _bare(**need, n=16).examples_needed is None and _bare(**need, n=256).examples_needed is None
    held = _bare(**need, n=256, score=2.0, noise_ratio=2.5, dtype="float32")
    assert held.probe_verdict is Verdict.IMPROVABLE and held.verdict is Verdict.UNDETERMINED
    assert "would not decide" in held.verdict_reason and "16" not in held.verdict_reason
    lower = _bare(score=2.0, noise_ratio=2.5, noise_threshold=3.0, unresolved=2)  # ŝ only a lower bound
    assert lower.verdict is Verdict.UNDETERMINED and "2 dropped direction(s) could carry more" in lower.verdict_reason


def test_a_significant_score_inside_the_rounding_bound_is_undetermined():
    """``ŝ ≤ tol`` with the noise test rejecting ``s = 0``: below the dtype's resolution, never saturated; the reason
    names the finer dtype that decides (bfloat16, float16 → float32; float32 → float64)."""
    for dtype, finer in (("bfloat16", "float32"), ("float16", "float32"), ("float32", "float64")):
        res = _bare(score=0.5, tol=1.0, noise_ratio=5.0, noise_threshold=3.0, dtype=dtype)
        assert res.probe_verdict is Verdict.SATURATED and res.verdict is Verdict.UNDETERMINED
        assert f"below {dtype} resolution: rerun in {finer}" in res.verdict_reason
    assert _bare(score=0.5, tol=1.0, noise_ratio=3.0, noise_threshold=3.0).verdict is Verdict.SATURATED


# ----------------------------------------------------------------------------- closed forms of the error model
U64 = U[torch.float64]


def _spectrum(values, k: int) -> Spectrum:
    """A resolved spectrum with the given kept eigenvalues of a ``k``-feature unit-diagonal Gram."""
    values = np.asarray(values, dtype=np.float64)
    return Spectrum(
        scale=np.ones(k),
        values=values,
        vectors=np.eye(k)[:, : values.size],
        lam_max=float(values.max()) if values.size else 0.0,
        cutoff=0.0,
        rtol=0.0,
        unresolved=0,
        dropped=np.zeros((k, 0)),
    )


def test_score_error_closed_form_single_unit():
    """One example, one feature, float64 (the TSQR path): ``e = (64·2 + 2·12/(1 − 12u) + 2·2) u``.

    ``λ̃ = 1``, ``ŝ = AG_rms = |g| = 2``; ``ε_M = 4u + 8u`` (features + QR backward error), ``η = 0``,
    ``γ_acc = L u`` with ``L = 1 + 1`` (one unit, one batch).
    """
    res = _result(
        torch.tensor([[3.0]], dtype=torch.float64), torch.tensor([[2.0]], dtype=torch.float64), "linear-nobias"
    )
    u = U64
    expected = 64 * u * 2 + 2 * 12 * u / (1 - 12 * u) + 2 * 2 * u
    assert res.score == 2.0 and res.ag_rms == 2.0
    assert res.score_error == pytest.approx(expected, rel=1e-12, abs=0)
    assert res.probe_verdict is Verdict.IMPROVABLE


def test_score_error_closed_form_on_a_given_spectrum():
    """``e`` of ``thm-score-error`` on a Gram spectrum given by hand (rank 1 and 2, explicit ``k̃`` and ``L``)."""
    a, s_hat, summands = 1.5, 0.25, 64
    for dtype in (torch.float32, torch.bfloat16):
        for values, k in (([0.5], 1), ([1.0, 0.25], 2), ([1.0, 0.25], 9)):
            u = U[dtype]
            eps_m, gamma = 4 * u * math.sqrt(k), 64 * U64
            eta = k * (gamma + 8 * U64)
            lam, sig = min(values), math.sqrt(min(values))
            expected = 64 * u * a + a * eps_m / (sig - eps_m) + a * gamma * math.sqrt(k) / sig + s_hat * eta / lam
            spec = _spectrum(values, len(values))
            got = score_error(spec, score=s_hat, ag_rms=a, dtype=dtype, summands=summands, k=k)
            assert got == pytest.approx(expected, rel=1e-12, abs=0), (dtype, values, k)
    assert score_error(_spectrum([], 3), score=1.0, ag_rms=1.0, dtype=torch.float16, summands=10) == 0.0


def test_score_error_is_infinite_exactly_where_first_order_fails():
    """``inf`` iff ``ε_M ≥ σ_min/2`` or ``η ≥ λ̃_min/2``, the boundaries included (exact in binary)."""
    # k̃ = 4: ε_M = 4 u √4 = 8 u exactly; σ_min = 16 u is the boundary
    u = U[torch.float16]
    at = _spectrum([1.0, (16 * u) ** 2], 2)
    past = _spectrum([1.0, (16 * u) ** 2 * (1 + 2.0**-20)], 2)
    kw = dict(score=1.0, ag_rms=1.0, dtype=torch.float16, summands=4, k=4)
    assert score_error(at, **kw) == math.inf
    assert math.isfinite(score_error(past, **kw))
    # k̃ = 4, L = 8: γ_acc = 8 u64, η = 4 (8 + 8) u64 = 64 u64 exactly; λ_min = 128 u64 is the boundary
    kw = dict(score=1.0, ag_rms=1.0, dtype=torch.float64, summands=8, k=4)
    assert score_error(_spectrum([1.0, 128 * U64], 2), **kw) == math.inf
    assert math.isfinite(score_error(_spectrum([1.0, 128 * U64 * (1 + 2.0**-20)], 2), **kw))


@pytest.mark.parametrize(("dtype", "eps"), [(torch.float16, 1e-3)])
def test_ill_conditioned_gram_is_undetermined(dtype, eps):
    """Nearly collinear features past first order: ``ε_M ≥ σ_min/2`` (float16, an explicit ``rtol``).

    (``η ≥ λ̃_min/2`` is pinned by :func:`test_score_error_is_infinite_exactly_where_first_order_fails`:
    with the default cutoffs the data resolution keeps ``λ̃_min`` above ``2η`` for float32 and half
    precision, and float64 probes use the triangular factor, where ``η = 0``.)

    Either alone makes the bound infinite and the verdict undetermined, whatever ``ŝ``.  With the
    default cutoffs ``ε_M < σ_min/2`` always holds (``C_res = 2 C_φ`` and ``λ̃_max ≥ 1``), so the
    float16 case keeps the small direction with an explicit ``rtol``.
    """
    z, g = _collinear(eps, dtype)
    res = _result(z, g, rtol=1e-12 if dtype == torch.float16 else None)
    sig_t = np.linalg.eigvalsh(_unit_diagonal_gram(z.double().numpy()))
    k, u = 3, U[dtype]
    eps_m, eta = 4 * u * math.sqrt(k), k * ((z.shape[0] + 1) * U64 + 8 * U64)
    lam_min = sig_t.min()
    if dtype == torch.float16:
        assert eps_m >= math.sqrt(lam_min) / 2 and eta < lam_min / 2
    else:
        assert eps_m < math.sqrt(lam_min) / 2 and eta >= lam_min / 2
    assert res.tangent_rank == 6  # kept: above the resolution cutoff
    assert res.score_error == math.inf and res.probe_verdict is Verdict.UNDETERMINED
    assert "ill-conditioned" in res.verdict_reason


def _collinear(eps: float, dtype, n: int = 400):
    rng = np.random.default_rng(13)
    t, w = rng.standard_normal(n), rng.standard_normal(n)
    z = torch.from_numpy(np.stack([t, t + eps * w], 1)).to(dtype)
    return z, torch.from_numpy(rng.standard_normal((n, 2))).to(dtype)


def _unit_diagonal_gram(z: np.ndarray) -> np.ndarray:
    phi = np.concatenate([z, np.ones((z.shape[0], 1))], 1)
    sig = phi.T @ phi / z.shape[0]
    d = 1 / np.sqrt(np.diag(sig))
    return sig * np.outer(d, d)


def test_default_tol_and_the_gram_rtol_closed_forms():
    """``default_tol = C_g u AG_rms``; the float64 Gram's rtol is ``C_res k̃ u64`` (also at ``k̃ = 1``)."""
    assert default_tol(torch.float32, 2.0) == 64 * 2.0**-24 * 2.0
    assert default_tol(torch.bfloat16, 0.5) == 64 * 2.0**-8 * 0.5
    assert default_rtol(torch.float64, 1) == 8 * U64
    assert default_rtol(torch.float64, 3) == 8 * 3 * U64
    assert default_rtol(torch.float16, 1) == (8 * 2.0**-11) ** 2
    assert default_rtol(torch.float32, 5) == pytest.approx((8 * math.sqrt(5) * 2.0**-24) ** 2, rel=1e-12, abs=0)
    assert resolve_spectrum(np.array([[2.0]]), dtype=torch.float64).rtol == 8 * U64
    assert resolve_spectrum(np.array([[2.0]]), dtype=torch.float16).rtol == (8 * 2.0**-11) ** 2


def test_pinv_quadratic_honours_an_explicit_rtol():
    """``pinv_quadratic`` drops ``λ ≤ rtol λ_max`` of the unit-diagonal matrix, however large ``rtol`` is."""
    mat = np.array([[4.0, 1.6], [1.6, 1.0]])  # unit-diagonal [[1, .8], [.8, 1]]: λ = 1.8, 0.2
    vecs = np.array([[2.0, -1.0]])  # scaled: (1, −1), along the small eigenvector (1, −1)/√2
    full, rank, cutoff, _ = pinv_quadratic(mat, vecs, 0.1)
    assert (
        rank == 2
        and full == pytest.approx(2 / 0.2, rel=1e-12, abs=0)
        and cutoff == pytest.approx(0.18, rel=1e-12, abs=0)
    )
    cut, rank, cutoff, inv = pinv_quadratic(mat, vecs, 0.2)
    assert rank == 1 and cut == pytest.approx(0.0, abs=1e-12) and cutoff == pytest.approx(0.36, rel=1e-12, abs=0)
    assert np.allclose(inv, np.array([[1 / 4, 1 / 2], [1 / 2, 1]]) / (2 * 1.8))  # D^{-1/2} q qᵀ/λ D^{-1/2}


def test_noise_threshold_range_and_value():
    """``χ²_{1,1−α} = Φ⁻¹(1 − α/2)²`` (stdlib normal quantile) for ``α ∈ (0, 0.215]``; ``ValueError`` outside."""
    from statistics import NormalDist

    for alpha in (0.05, 0.215, 1e-6):
        assert noise_threshold(alpha) == pytest.approx(NormalDist().inv_cdf(1 - alpha / 2) ** 2, rel=1e-9, abs=0)
    for alpha in (0.0, 0.2150001, 0.5, 1.0, -0.1):
        with pytest.raises(ValueError, match=r"0 < alpha <= 0\.215"):
            noise_threshold(alpha)


# ----------------------------------------------------------------------------- the assembled result (_finish)
def test_every_field_of_the_result_against_a_dense_reference():
    """A float64 probe with tied units: every number of the result by direct numpy (least squares, tie classes)."""
    rng = np.random.default_rng(14)
    n, d = 90, 2
    base = rng.standard_normal((30, d))
    z = base[rng.integers(0, 30, n)]  # 30 distinct units, each about 3 times
    g = 0.7 * np.tanh(z[:, ::-1]) + rng.standard_normal((n, d))
    stats = statistics_for(parse_family("linear"), (d,), "vector", pool_ties=True)
    stats.update(torch.from_numpy(z), torch.from_numpy(g))
    res = stats.result()
    phi = np.concatenate([z, np.ones((n, 1))], 1)
    fit = phi @ np.linalg.lstsq(phi, g, rcond=None)[0]  # Π g at the probe's units
    s = math.sqrt(np.sum(fit * fit) / n)
    a = math.sqrt(np.sum(g * g) / n)
    keys = [tuple(r) for r in z]
    means = {k: g[[i for i, kk in enumerate(keys) if kk == k]].mean(0) for k in set(keys)}
    m_hat = np.array([means[k] for k in keys])
    r = math.sqrt(np.sum(m_hat * m_hat) / n)
    rho = math.sqrt(np.sum((m_hat - fit) ** 2) / n) / r
    lev = np.einsum("ik,kl,il->i", phi, np.linalg.inv(phi.T @ phi / n), phi)
    v = float(np.mean(np.sum(g * g, 1) * lev))
    u_stat = (n * s * s - v) / (n - 1)
    assert res.score == pytest.approx(s, rel=1e-10, abs=0)
    assert res.ag_rms == pytest.approx(a, rel=1e-12, abs=0)
    assert res.ag_max == pytest.approx(np.linalg.norm(g, axis=1).max(), rel=1e-12, abs=0)
    assert res.raw_score == pytest.approx(r, rel=1e-10, abs=0)
    assert res.realizability_defect == pytest.approx(rho, rel=1e-8, abs=0)
    assert res.relative_score == pytest.approx(s / a, rel=1e-10, abs=0)
    assert res.activation_scaled_score == pytest.approx(s * math.sqrt(np.sum(z * z) / n), rel=1e-10, abs=0)
    assert res.noise_variance == pytest.approx(v, rel=1e-9, abs=0)
    assert res.noise_ratio == pytest.approx(n * s * s / v, rel=1e-9, abs=0)
    assert res.score_squared_unbiased == pytest.approx(u_stat, rel=1e-9, abs=0)
    se = math.sqrt(4 * v * max(u_stat, 0.0) / n + 2 * v * v / (n * (n - 1)))
    assert res.score_squared_se == pytest.approx(se, rel=1e-9, abs=0)
    assert (res.n, res.units, res.tangent_rank, res.tangent_dim) == (n, n, 6, 6)
    assert (res.family, res.unit, res.dtype, res.alpha) == ("linear", "row", "float64", 0.05)
    assert res.noise_threshold == pytest.approx(3.841458820694124, rel=1e-12, abs=0)
    assert res.tol == res.score_error and not res.degenerate
    assert res.saturated is (res.verdict is Verdict.SATURATED)
    assert np.allclose(res.gradient, np.concatenate([(g.T @ z / n).reshape(-1), g.mean(0)]), rtol=1e-12, atol=0)
    # every ratio is homogeneous of degree 0 in g: a probe with v̂ ≪ 1 gives the same noise test
    small = statistics_for(parse_family("linear"), (d,), "vector")
    small.update(torch.from_numpy(z), torch.from_numpy(g * 2.0**-12))
    tiny = small.result()
    assert tiny.noise_variance == pytest.approx(v * 2.0**-24, rel=1e-9, abs=0) and tiny.noise_variance < 1
    assert tiny.noise_ratio == pytest.approx(res.noise_ratio, rel=1e-9, abs=0)
    assert tiny.score_squared_unbiased == pytest.approx(u_stat * 2.0**-24, rel=1e-9, abs=0)
    assert tiny.ag_rms < 1 and tiny.relative_score == pytest.approx(s / a, rel=1e-9, abs=0)
    # the cutoff reported is rtol · λ̃_max, rtol = (C_res √k̃ u64)² for a float64 probe (the factor)
    lam_max = np.linalg.eigvalsh(_unit_diagonal_gram(z)).max()
    assert res.rtol == pytest.approx((8 * math.sqrt(3) * U64) ** 2, rel=1e-12, abs=0)
    assert res.cutoff == pytest.approx(res.rtol * lam_max, rel=1e-9, abs=0) and res.unresolved == 0
    explicit = stats.result(tol=0.5, alpha=0.2)
    assert explicit.tol == 0.5 and explicit.score_error == res.score_error
    assert explicit.alpha == 0.2 and explicit.noise_threshold == pytest.approx(1.6423744151498623, rel=1e-9, abs=0)


def test_small_probes_and_zero_gradients():
    """One example: no noise to test (``n ŝ²/v̂`` reported 0: undetermined); ``g = 0``: saturated, ratio 0."""
    one = _result(torch.tensor([[3.0, 1.0]], dtype=torch.float64), torch.tensor([[2.0, 0.0]], dtype=torch.float64))
    assert one.noise_ratio == 0.0 and one.significant is False
    assert one.probe_verdict is Verdict.IMPROVABLE and one.verdict is Verdict.UNDETERMINED
    assert math.isnan(one.score_squared_unbiased)
    z = torch.from_numpy(np.random.default_rng(15).standard_normal((20, 2)))
    zero = _result(z, torch.zeros(20, 2, dtype=torch.float64))
    assert zero.score == 0.0 and zero.noise_ratio == 0.0 and zero.verdict is Verdict.SATURATED
    assert math.isnan(zero.relative_score)
    two = _result(z[:2], torch.from_numpy(np.array([[1.0, 0.0], [0.0, 1.0]])))
    assert two.n == 2 and math.isfinite(two.noise_ratio) and two.noise_ratio == pytest.approx(1.0, rel=1e-9, abs=0)


# ----------------------------------------------------------------------------- the deviation terms (bounds/terms.py)
def test_deviation_terms_closed_forms():
    """``thm-finite-sample``'s terms at non-trivial arguments, and their boundaries (theory/finite-sample.md)."""
    from depthsat_theory.bounds.terms import (
        deviation_halfwidth,
        epsilon_n,
        matrix_deviations,
        relative_deviation,
        split_delta,
    )

    assert split_delta(0.3, 5, True) == pytest.approx((0.02, 0.02, 0.02), rel=1e-12, abs=0)
    assert split_delta(0.3, 5, False) == pytest.approx((0.03, 0.03, 0.0), rel=1e-12, abs=0)
    n, u1, u2 = 500, 2.5, 4.0
    assert epsilon_n(n, 3.0, 7.0, u1) == pytest.approx(math.sqrt(2 * 3 * u1 / n) + 2 * 7 * u1 / n, rel=1e-12, abs=0)
    for big_l, l1 in ((5.0, 5.0), (0.25, 1.0), (1.0, 1.0)):  # L_1 = max(L, 1)
        expected = math.sqrt(2 * l1 * u2 / n) + 2 * l1 * u2 / (3 * n)
        assert relative_deviation(n, big_l, u2) == pytest.approx(expected, rel=1e-12, abs=0)
    dev = relative_deviation(n, 5.0, u2)
    eps = epsilon_n(n, 3.0, 7.0, u1)
    assert deviation_halfwidth(n, 3.0, 7.0, u1, 5.0, u2, 2.0) == pytest.approx((eps + 2 * dev) / math.sqrt(1 - dev))
    assert deviation_halfwidth(10, 3.0, 7.0, u1, 5.0, u2, 2.0) == math.inf  # Δ_n ≥ 1
    # Δ_n = 1 exactly in floating point (√(2u) + 2u/3 = 1 at u ≈ 0.3131, L_1 = 1, n = 1): still infinite
    u_one = 0.31306822878312
    assert math.sqrt(2 * u_one) + 2 * u_one / 3 == 1.0
    assert deviation_halfwidth(1, 3.0, 7.0, u1, 0.5, u_one, 2.0) == math.inf
    lo, hi = matrix_deviations(n, 2.0, 6.0, u2)
    assert lo == pytest.approx(math.sqrt(2 * 2 * u2 / n) + 2 * u2 / (3 * n), rel=1e-12, abs=0)
    assert hi == pytest.approx(math.sqrt(2 * 2 * u2 / n) + 2 * 6 * u2 / (3 * n), rel=1e-12, abs=0)


@pytest.mark.parametrize(
    ("mean", "bound_sq", "n", "u"), [(0.3, 4.0, 200, 3.0), (-0.1, 4.0, 200, 3.0), (1e-4, 1.0, 50, 1.0)]
)
def test_bernstein_upper_bound_solves_its_defining_equation(mean, bound_sq, n, u):
    """``y`` is the root of ``y − √(2buy/n) − (max(mean, 0) + 2bu/(3n)) = 0`` (``Var Y ≤ b E Y``), capped at ``b``."""
    from depthsat_theory.bounds.terms import bernstein_mean_upper

    y = bernstein_mean_upper(mean, bound_sq, n, u)
    e = max(mean, 0.0) + 2 * bound_sq * u / (3 * n)
    assert y - math.sqrt(2 * bound_sq * u * y / n) - e == pytest.approx(0.0, abs=1e-12)
    assert y > max(mean, 0.0)
    assert bernstein_mean_upper(0.9, 1.0, 5, 3.0) == 1.0  # the cap: E Y ≤ b surely


def test_matrix_variance_upper_degenerate_branches():
    """``σ̄² = L`` when ``A = 1 − σ̂² a² ≤ 0`` (every ``t`` consistent), and never above ``L``."""
    from depthsat_theory.bounds.terms import matrix_variance_upper

    u2, u4 = 4.0, 3.0
    assert matrix_variance_upper(4.0, 7.0, 16, 2.0, u4) == 7.0  # a = √(2·2/16) = 1/2: A = 1 − 4/4 = 0 exactly
    assert matrix_variance_upper(8.0, 7.0, 16, 2.0, u4) == 7.0  # A < 0
    assert matrix_variance_upper(7.0, 7.0, 1000, u2, u4) == 7.0  # A > 0 but the root exceeds L: capped
    assert matrix_variance_upper(-1.0, 7.0, 10**6, u2, u4) == matrix_variance_upper(0.0, 7.0, 10**6, u2, u4)


@pytest.mark.parametrize("sig_hat2", [0.5, 2.0])
def test_matrix_variance_upper_is_the_fixed_point(sig_hat2):
    """Below ``L``, ``σ̄²`` satisfies ``√x = c/2 + √(c²/4 + e_0 + σ̂²(1 + Δ^+(x))²)`` with equality (also ``σ̂² < 1``)."""
    from depthsat_theory.bounds.terms import matrix_variance_upper

    n, big_l, u2, u4 = 4000, 50.0, 5.0, 3.0
    x = matrix_variance_upper(sig_hat2, big_l, n, u2, u4)
    c, e0 = big_l * math.sqrt(2 * u4 / n), 2 * big_l * big_l * u4 / (3 * n)
    dplus = math.sqrt(2 * x * u2 / n) + 2 * big_l * u2 / (3 * n)
    assert x < big_l
    assert math.sqrt(x) == pytest.approx(
        c / 2 + math.sqrt(c * c / 4 + e0 + sig_hat2 * (1 + dplus) ** 2), rel=1e-12, abs=0
    )


def test_reported_score_never_exceeds_ag_rms():
    """``s ≤ AG_rms`` holds exactly (``Π`` is a contraction): with ``n ≤ k̃`` (``ŝ = AG_rms`` exactly) the
    computed ``ŝ`` lands an ulp above ``AG_rms`` on some probes, and the report clips it back."""
    for seed in range(40):
        gen = torch.Generator().manual_seed(seed)
        z = torch.randn(6, 16, generator=gen, dtype=torch.float64)
        g = torch.randn(6, 16, generator=gen, dtype=torch.float64)
        res = _result(z, g)
        assert res.score <= res.ag_rms, seed
        assert res.score == pytest.approx(res.ag_rms, rel=1e-12, abs=0)  # every unit is its own tangent direction
        assert res.relative_score <= 1.0


def test_unresolved_directions_reach_the_result():
    """``k̃ > 1024`` float64: the Gram (no factor) resolves ``λ/λ_max`` to ``C_res k̃ u64`` only; a direction of
    amplitude ``≈ 2e-7`` is real (above the data resolution) but unresolved, and the result says so (a lower
    bound ``ŝ`` above ``e`` still grounds "improvable", lem-lower-bound)."""
    rng = np.random.default_rng(16)
    n, d = 1100, 1030
    z = rng.standard_normal((n, d))
    z[:, 1] = z[:, 0] + 3e-7 * rng.standard_normal(n)
    g = 0.5 * z + rng.standard_normal((n, d))
    res = _result(torch.from_numpy(z), torch.from_numpy(g), "linear-nobias")
    lam = np.linalg.eigvalsh(_unit_diagonal_gram_nobias(z))
    assert (8 * math.sqrt(d) * U64) ** 2 < lam[0] / lam[-1] <= 8 * d * U64  # between the two resolutions
    assert res.unresolved == 1 and res.rtol == pytest.approx(8 * d * U64, rel=1e-12, abs=0)
    assert res.tangent_rank == d * (d - 1)
    assert res.score > res.score_error and res.probe_verdict is Verdict.IMPROVABLE


def _unit_diagonal_gram_nobias(z: np.ndarray) -> np.ndarray:
    sig = z.T @ z / z.shape[0]
    dd = 1 / np.sqrt(np.diag(sig))
    return sig * np.outer(dd, dd)


def test_one_feature_factor_and_zero_gram():
    """``k̃ = 1`` with a factor: rtol ``(C_res u64)²``; a zero Gram keeps nothing, with cutoff 0 (``T = {0}``)."""
    one = resolve_spectrum(np.array([[4.0]]), dtype=torch.float64, factor=np.array([[2.0]]))
    assert one.rtol == (8 * U64) ** 2 and one.rank == 1 and one.lam_max == 1.0
    zero = resolve_spectrum(np.zeros((3, 3)), dtype=torch.float32)
    assert zero.rank == 0 and zero.cutoff == 0.0 and zero.lam_max == 0.0 and zero.unresolved == 0


def test_spectrum_order_and_dtype_check():
    """Kept eigenvalues come in descending order (``Spectrum.values``); a non-floating dtype has no roundoff."""
    from depthsat_theory.statistics.linalg import unit_roundoff

    spec = resolve_spectrum(np.array([[1.0, 0.5, 0.0], [0.5, 1.0, 0.0], [0.0, 0.0, 1.0]]))
    assert np.allclose(spec.values, [1.5, 1.0, 0.5], rtol=1e-12, atol=0)
    assert spec.values[0] == spec.lam_max and spec.lam_min == spec.values[-1]
    with pytest.raises(TypeError, match="non-floating dtype"):
        unit_roundoff(torch.int64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("k", "summands", "product_summands"),
    [(4, 1000, 0), (9, 513, 256), (64, 10**6, 0), (144, 7, 5), (1, 1, 0), (16, 1, 3)],
)
def test_gradient_rounding_level_is_the_stated_level_exactly(dtype, k, summands, product_summands):
    """The dropped-direction level ``A (ε_M + γ_acc √k̃)`` of theory/numerics.md, in rationals (both sides).

    ``ε_M = C_φ u_in √k̃`` and ``γ_acc = C_acc (L u64 + L_32 u32)`` with the page's constants
    (``C_φ = 4``, ``C_acc = 1``); ``k̃`` a perfect square so that ``√k̃`` is rational and the level is
    an exact :class:`~fractions.Fraction`.  A level lowered by ``1/k̃`` (``√k̃ → 1/√k̃``) would count
    rounding-level gradient as unresolved; a raised one would hide real directions.  ``L = 1`` (a sum of one
    term) is the formula's ``L u64`` too, not a floor of two terms.
    """
    from fractions import Fraction

    from depthsat_theory.statistics.linalg import gradient_rounding

    a = Fraction(3, 7)
    root = Fraction(math.isqrt(k))
    assert root * root == k
    u_in, u64, u32 = (Fraction(U[t]) for t in (dtype, torch.float64, torch.float32))
    eps_m = Fraction(int(C_PHI)) * u_in * root
    gamma_acc = 1 * (summands * u64 + product_summands * u32)
    exact = a * (eps_m + gamma_acc * root)
    got = gradient_rounding(ag_rms=float(a), dtype=dtype, summands=summands, k=k, product_summands=product_summands)
    assert abs(Fraction(got) - exact) <= exact * Fraction(1, 2**48)


def test_resolve_spectrum_scales_by_the_given_diagonal_and_names_its_arguments():
    """A ``diag`` given with the Gram is the one scaled by (``D^{-1/2} Σ D^{-1/2}``, dense numpy); neither the
    Gram nor a factor with its diagonal is a one-line error."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((50, 3)) * np.array([1.0, 3.0, 0.5])
    mat = x.T @ x / 50
    diag = 4.0 * np.diag(mat) * np.array([1.0, 2.0, 0.5])
    spec = resolve_spectrum(mat, diag=diag)
    np.testing.assert_allclose(spec.scale, 1 / np.sqrt(diag), rtol=1e-15)
    want = np.linalg.eigvalsh(mat / np.sqrt(np.outer(diag, diag)))
    assert spec.lam_max == pytest.approx(float(want.max()), rel=1e-12)
    np.testing.assert_allclose(np.sort(spec.values), np.sort(want), rtol=1e-12)
    for kwargs in ({}, {"factor": x}):
        with pytest.raises(ValueError) as info:
            resolve_spectrum(None, **kwargs)
        assert str(info.value) == "resolve_spectrum needs the Gram mat, or a factor together with its diag"


def test_score_raw_score_and_ag_rms_keep_their_exact_order_when_g_is_in_the_span():
    """``g = φ̃ W`` (so ``s = r = AG_rms`` exactly): rounding must not put ``ŝ`` above ``r̂`` or ``AG_rms``, nor
    ``r̂`` above ``AG_rms`` (the output clips them back), and all three agree with the truth to 1e-12."""
    at_top = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        z = rng.standard_normal((30, 3))
        phi = np.hstack([z, np.ones((30, 1))])
        g = phi @ rng.standard_normal((4, 3))
        stats = statistics_for(parse_family("linear"), (3,), "vector", pool_ties=True)
        stats.update(torch.from_numpy(z), torch.from_numpy(g))
        res = stats.result()
        truth = math.sqrt(float(np.mean(np.sum(g**2, axis=1))))
        assert res.score <= res.raw_score <= res.ag_rms
        assert res.score == pytest.approx(truth, rel=1e-12) and res.raw_score == pytest.approx(truth, rel=1e-12)
        at_top += res.score == res.ag_rms
    assert at_top > 0  # the clip is exercised


# ----------------------------------------------------------------------------- the unresolved count and the band
def _two_pair_gram(rho1: float, rho2: float) -> np.ndarray:
    """Block diagonal of ``[[1, ρ], [ρ, 1]]`` pairs: unit diagonal, eigenvalues ``1 ± ρ₁`` and ``1 ± ρ₂`` exactly."""
    mat = np.eye(4)
    mat[0, 1] = mat[1, 0] = rho1
    mat[2, 3] = mat[3, 2] = rho2
    return mat


def test_unresolved_count_is_above_the_data_resolution_times_lam_max():
    """def-resolution: a dropped eigenvalue counts as unresolved when ``λ̃ > (C_res √k̃ u_in)² · λ̃_max``.

    float16, ``k̃ = 4``: the data rtol is ``(8 · 2 · 2⁻¹¹)² = 2⁻¹⁴``; ``λ̃_max = 1 + ρ₁ ≈ 2`` (closed form of a
    ``2 × 2`` block). With a Gram error ``η = 10⁻²`` everything up to ``2η`` is dropped; of the two small
    eigenvalues ``1 − ρ₁ = 6·10⁻⁵`` lies between ``2⁻¹⁴/λ̃_max`` and ``2⁻¹⁴ λ̃_max`` (not unresolved: below
    the data resolution) and ``1 − ρ₂ = 10⁻³`` above (unresolved).
    """
    rho1, rho2 = 1 - 6e-5, 1 - 1e-3
    spec = resolve_spectrum(_two_pair_gram(rho1, rho2), dtype=torch.float16, gram_error=1e-2)
    data = (C_RES * 2 * U[torch.float16]) ** 2
    lam_max = 1 + rho1
    assert spec.lam_max == pytest.approx(lam_max, rel=1e-14, abs=0)
    assert data / lam_max < 1 - rho1 <= data * lam_max < 1 - rho2 <= 2e-2  # the instance is where it should be
    assert spec.rank == 2 and spec.unresolved == 1
    # the cutoff is the Gram's 2η, reported relative to λ̃_max
    assert spec.cutoff == 2e-2 and spec.rtol == pytest.approx(2e-2 / lam_max, rel=1e-14, abs=0)


@pytest.mark.parametrize(("rtol", "dropped"), [(0.1, 1), (0.3, 2)])
def test_an_explicit_rtol_has_no_band(rtol, dropped):
    """:attr:`Spectrum.band` marks directions dropped by the *data resolution* alone; under an explicit ``rtol``
    the cutoff is the caller's (nothing unresolved, no band), even when the dropped eigenvalues (``1 − ρ₂ = 10⁻²``
    and ``1 − ρ₁ = 0.5`` of ``λ̃_max = 1.99``, closed forms) lie far above what the float64 arithmetic resolves."""
    spec = resolve_spectrum(_two_pair_gram(0.5, 1 - 1e-2), dtype=torch.float64, rtol=rtol)
    assert spec.rank == 4 - dropped and spec.band.shape == (dropped,)
    assert spec.unresolved == 0 and not spec.band.any()


def _hand_spectrum(k: int, band: list[bool]) -> Spectrum:
    """Spectrum of ``I_k`` whose last ``m`` coordinate axes are declared dropped (``band`` for each), as a factor
    with those amplitudes computed zero (below the data's rounding level: only the rounding-level rules apply)."""
    m = len(band)
    eye = np.eye(k)
    return Spectrum(
        scale=np.ones(k),
        values=np.ones(k - m),
        vectors=eye[:, : k - m],
        lam_max=1.0,
        cutoff=0.5,
        rtol=0.5,
        unresolved=0,
        dropped=eye[:, k - m :],
        band=np.array(band, dtype=bool),
        factored=True,
        dropped_values=np.zeros(m),
    )


@pytest.mark.parametrize("with_moment", [True, False])
def test_dropped_directions_above_rounding_and_noise_significant_ones_both_count(with_moment):
    """theory/numerics.md, *Dropped directions that carry gradient*: the unresolved count is the number of dropped
    directions whose ``‖G̃v‖`` exceeds the rounding level ``A(ε_M + γ_acc √k̃)``, together with band directions
    that pass the noise test on their own (which needs the noise moment; without it only the first rule applies).

    Hand-built spectrum of ``I_3``: axis 0 kept, axes 1 (band) and 2 (not band) dropped. ``G̃`` has
    component ``A``-sized entries on both dropped axes (far above the ``≈ 10⁻¹⁴ A`` level), and the noise moment
    ``E[XᵀX] = I`` gives the band axis the ratio ``n ‖G̃ e₁‖² / 1 = 64 · 4 ≫ χ²₁(0.95)``: both count, 2.
    A band axis carrying no gradient (ratio 0, mass 0) adds nothing: 1.
    """
    rng = np.random.default_rng(0)
    n = 64
    stats = statistics_for(parse_family("linear-nobias"), (3,), "vector")
    stats.update(torch.from_numpy(rng.standard_normal((n, 3))), torch.from_numpy(rng.standard_normal((n, 3))))
    moment = np.eye(3) if with_moment else None
    spec = _hand_spectrum(3, [True, False])
    for band_mass, want in ((2.0, 2), (0.0, 1)):
        grad_rows = np.array([[1.0, band_mass, 3.0], [0.5, 0.0, -1.0], [0.0, 0.0, 0.0]])
        res = stats._finish(spec, 1.0, np.zeros(9), 9, None, grad_rows=grad_rows, noise_moment=moment)
        assert res.unresolved == want, (band_mass, with_moment)
        assert res.probe_verdict is not Verdict.SATURATED


def test_a_given_eigendecomposition_is_used_with_the_gram_resolution():
    """``eig=`` (the batched eigensolve of :func:`scaled_gram`) gives the spectrum of the closed form: the pair
    Gram's eigenvalues ``1 ± ρ`` (dense numpy cross-check), ``rtol = C_res k̃ u64`` of a float64 Gram (``k̃ = 4``)."""
    from depthsat_theory.statistics.linalg import eigh_batched, scaled_gram

    mat = _two_pair_gram(0.5, 0.25) * np.array([4.0, 4.0, 0.25, 0.25])[:, None] * np.array([4.0, 4.0, 0.25, 0.25])
    eig = eigh_batched([scaled_gram(mat)])[0]
    spec = resolve_spectrum(mat, eig=eig)
    np.testing.assert_allclose(spec.values, [1.5, 1.25, 0.75, 0.5], rtol=1e-14, atol=0)
    np.testing.assert_allclose(np.sort(spec.values), np.linalg.eigvalsh(_two_pair_gram(0.5, 0.25)), rtol=1e-14)
    assert spec.lam_max == pytest.approx(1.5, rel=1e-15, abs=0) and spec.rtol == C_RES * 4 * U[torch.float64]
    assert spec.vectors.shape == (4, 4) and spec.unresolved == 0


def test_float32_products_count_no_direction_of_a_dead_feature():
    """With float32 products every dropped direction *above zero amplitude* counts as unresolved (theory/numerics.md,
    *Float32 products*); a feature that is zero on every example has scale 0 (``def-resolution``: dropped exactly)
    and no amplitude at all, so a well-conditioned probe with one dead feature has nothing unresolved."""
    rng = np.random.default_rng(3)
    z = rng.standard_normal((200, 4))
    z[:, 2] = 0.0
    g = rng.standard_normal((200, 4))
    stats = statistics_for(parse_family("linear-nobias"), (4,), "vector", products="float32")
    stats.update(torch.from_numpy(z), torch.from_numpy(g))
    res = stats.result()
    assert res.unresolved == 0 and res.tangent_rank == 4 * 3


def test_scaled_gram_with_a_given_diagonal():
    """``scaled_gram(Σ, diag)`` is ``D^{-1/2} ½(Σ + Σᵀ) D^{-1/2}`` with the *given* ``D`` (dense numpy), and with
    ``diag = diag Σ`` it is unit-diagonal."""
    from depthsat_theory.statistics.linalg import scaled_gram

    rng = np.random.default_rng(5)
    x = rng.standard_normal((40, 3))
    mat = x.T @ x / 40
    mat[0, 1] += 1e-3  # not exactly symmetric: the symmetric part is used
    diag = np.array([4.0, 0.25, 9.0])
    want = 0.5 * (mat + mat.T) / np.sqrt(np.outer(diag, diag))
    np.testing.assert_allclose(scaled_gram(mat, diag), want, rtol=1e-14, atol=0)
    np.testing.assert_allclose(np.diag(scaled_gram(mat)), np.ones(3), rtol=1e-14, atol=0)
