"""Numerics: the rounding bound (``thm-score-error``), lower bounds (``lem-lower-bound``), the noise test.

Claim (theory/numerics.md): the computed score is within ``score_error`` of the exact score
of the probe's measure; a verdict "improvable" needs ``ŝ > score_error`` and the noise test,
"saturated" needs ``ŝ ≤ score_error`` with no unresolved direction.

Checks:

- ``num-score-error-exact`` (numeric): near-threshold probes (``d = 2``, linear family with a
  bias) across conditioning (``z = (t, t + ε w)``, ``ε`` from ``1e-1`` to ``1e-6``) in float64,
  float32 and float16, on both sides of the threshold: exactly cancelling pairs (``G = 0``,
  exact ``s = 0``) and planted signals with exact ``s`` at ``3`` and ``30`` times the bound.
  The truth is the exact score of the stored arrays, in rational arithmetic
  (:class:`fractions.Fraction`, no code of the engine): ``|ŝ − s| ≤ e`` on every instance,
  ``s = 0`` never "improvable", ``s > 2e`` always "improvable".
- ``num-lower-bound`` (numeric): dropping kept directions never raises the score
  (``lem-lower-bound``), on random feature Grams.
- ``num-noise-test`` (coverage, ``rem-noise-test-level``): pure-noise probes (``g`` independent of ``z``) at
  ``n/k̃`` from ``0.1`` to ``100`` over six laws of ``z`` (centred, constant, nonnegative, heavy-tailed) and
  four of ``g`` (symmetric and centred exponential), with and without a bias: on the test's stated domain
  (:func:`in_noise_domain`) no cell's count of "improvable" is improbable at rate ``α`` (one-sided
  binomial, family-wise 1%) and the pooled rate is below ``α + 3 sd``; strong signals at ``n = 10 k̃`` are
  all "improvable". The cells outside the domain, and strongly skewed laws
  (``prop-noise-no-uniform-level``: no test can hold ``α`` for them at every ``n``), are reported.
- ``num-noise-test-constant-feature`` (numeric, ``prop-noise-test-constant-feature``): on a constant feature
  the engine's rate equals the exact enumeration for Rademacher ``g`` (``1/8`` at ``n = 4``) and the
  Student-``t`` closed form for Gaussian ``g`` is at most ``α`` (0.05, 0.01) for ``n`` up to ``10⁵``.
- ``num-unit-gram`` (numeric, ``thm-unit-gram``): random probes with fewer, about as many and more
  rows than features, full-rank and rank-deficient (repeated units, cancelling pairs, a low-rank
  site), float64 and float32: the unit path's ``ŝ`` equals the kernel form ``n⁻¹‖U_Jᵀg‖²`` of a numpy
  SVD of the features (computed here, not by the engine) within its bound, ``v̂`` equals
  ``Σ_x ‖g_x‖² ‖U_{x,J}‖²``, and rank, verdict and ``ŝ`` (within both bounds) agree with the Gram path.
- ``num-noise-factor`` (numeric, ``thm-noise-factor``): dyadic float64 probes ``z = (t, t + 2^-j w)`` at eigenvalue
  ratios ``10¹³`` to ``10¹⁷``: the engine's ``v̂`` equals the exact ``tr(Σ⁺ Q)`` of the stored arrays (rational
  Gauss–Jordan) to ``10⁻⁶`` relative and never exceeds ``v̂_up``; pure-noise probes at ``n = 400`` and ratios
  ``10¹⁵``–``10¹⁶`` are "improvable" no more often than rate ``α`` allows (one-sided binomial, 1%).
- ``num-dropped-score`` (numeric, ``lem-dropped-score``): Walsh probes (exact orthogonal ``±1`` columns, one nearly
  duplicated at a dyadic ``ε``, the gradient ``a h_w`` along the planted direction plus an orthogonal part), float64,
  float32 and float16, planted amplitudes from below the rounding level to far above the cutoff: on the float64 Gram
  of the stored features, every dropped direction whose exact amplitude (rationals) exceeds ``ρ = ε_M`` is marked
  possibly real and its exact score on its own span (rationals) is at most ``c_v``; when the planted amplitude exceeds
  ``ρ`` (rounding cannot have created it) the engine never says "saturated" with the exact score ``|a|`` above
  ``tol + e``.  (Below ``ρ`` the direction is outside the resolvable tangent space by ``def-resolution``.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction

import numpy as np
import torch
from torch import Tensor

from depthsat_theory.families import FeatureFamily, parse_family
from depthsat_theory.statistics import NOISE_ALPHA, resolve_spectrum, statistics_for
from depthsat_theory.statistics.linalg import (
    FEATURE_ROUNDING_FACTOR,
    dropped_score,
    noise_threshold,
    unit_roundoff,
)
from depthsat_theory.vocabulary import Verdict

from ._registry import Context, Outcome, check
from .t1_gradient import fmt


def solve_rational(gram: list[list[Fraction]], rhs: list[list[Fraction]]) -> list[list[Fraction]]:
    """A solution ``x`` of ``gram · x = rhs`` by Gauss–Jordan in rationals (dependent columns get ``x = 0``)."""
    k, d = len(gram), len(rhs[0])
    aug = [gram[a] + rhs[a] for a in range(k)]
    pivots: list[int] = []
    for col in range(k):
        row = len(pivots)
        piv = next((r for r in range(row, k) if aug[r][col] != 0), None)
        if piv is None:
            continue
        aug[row], aug[piv] = aug[piv], aug[row]
        p = aug[row][col]
        aug[row] = [v / p for v in aug[row]]
        for r in range(k):
            if r != row and aug[r][col] != 0:
                f = aug[r][col]
                aug[r] = [a - f * b for a, b in zip(aug[r], aug[row], strict=True)]
        pivots.append(col)
    x = [[Fraction(0)] * d for _ in range(k)]
    for i, col in enumerate(pivots):
        x[col] = aug[i][k:]
    return x


def exact_score(z: np.ndarray, g: np.ndarray, bias: bool = True) -> float:
    """Exact ``s`` of vector units ``z`` ``(n, d)``, ``g`` ``(n, d)`` for the linear family, in rationals.

    Gauss–Jordan elimination on ``[Φ̃ᵀΦ̃ | Φ̃ᵀ g]`` in :class:`~fractions.Fraction` (rank-deficient
    columns are skipped), ``s² = (1/n) Σ_i g_iᵀ Φ̃ x_i``; independent of the engine.
    """
    n, d = z.shape
    one = [Fraction(1)] if bias else []
    rows = [[Fraction(float(v)) for v in zi] + one for zi in z]
    gs = [[Fraction(float(v)) for v in gi] for gi in g]
    k = len(rows[0])
    gram = [[sum((r[a] * r[b] for r in rows), Fraction(0)) for b in range(k)] for a in range(k)]
    rhs = [[sum((rows[i][a] * gs[i][j] for i in range(n)), Fraction(0)) for j in range(d)] for a in range(k)]
    x = solve_rational(gram, rhs)
    s2 = sum((rhs[a][j] * x[a][j] for a in range(k) for j in range(d)), Fraction(0)) / n  # gᵀ Φ̃ x = (Φ̃ᵀg)ᵀ x
    return math.sqrt(float(s2))


def exact_noise_variance(z: np.ndarray, g: np.ndarray) -> Fraction:
    """``v = tr(Σ⁻¹ Q)`` of vector units for the linear family with a bias, in rationals (no engine code).

    ``Σ = (1/n) Σ_x φ̃ φ̃ᵀ``, ``Q = (1/n) Σ_x ‖g_x‖² φ̃ φ̃ᵀ`` (``X_xᵀX_x`` for one row per example); ``Σ`` must be
    invertible (asserted: the solution is checked exactly).
    """
    rows = [[Fraction(float(v)) for v in zi] + [Fraction(1)] for zi in z]
    gn = [sum((Fraction(float(v)) ** 2 for v in gi), Fraction(0)) for gi in g]
    k = len(rows[0])
    sigma = [[sum((r[a] * r[b] for r in rows), Fraction(0)) for b in range(k)] for a in range(k)]
    weighted = list(zip(rows, gn, strict=True))
    q = [[sum((w * r[a] * r[b] for r, w in weighted), Fraction(0)) for b in range(k)] for a in range(k)]
    x = solve_rational(sigma, q)  # Σ x = Q (the 1/n cancels)
    check = [[sum((sigma[a][c] * x[c][b] for c in range(k)), Fraction(0)) for b in range(k)] for a in range(k)]
    assert check == q, "Σ must be invertible"
    return sum((x[a][a] for a in range(k)), Fraction(0))


def dyadic_collinear_probe(n: int, shift: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``z = (t, t + 2^-shift w)`` with integers ``|t|, |w| ≤ 8`` and ``g`` in eighths: every value exact in float64.

    The small feature direction has relative amplitude ``≈ 2^-shift`` (eigenvalue ratio ``≈ 4^shift``).
    """
    rng = np.random.default_rng(seed)
    t = rng.integers(-8, 9, n).astype(np.float64)
    w = rng.integers(-8, 9, n).astype(np.float64)
    z = np.stack([t, t + np.ldexp(w, -shift)], 1)
    g = rng.integers(-16, 17, (n, 2)).astype(np.float64) / 8.0
    assert np.array_equal(z[:, 1] - z[:, 0], np.ldexp(w, -shift))  # stored exactly
    return z, g


def pure_noise_improvable(eps: float, seeds, n: int = 400) -> int:
    """How many pure-noise probes ``z = (t, t + ε w)``, ``g`` independent Gaussian (``s = 0``) are "improvable"."""
    count = 0
    for seed in seeds:
        rng = np.random.default_rng(seed)
        t, w = rng.standard_normal(n), rng.standard_normal(n)
        z = np.stack([t, t + eps * w], 1)
        g = rng.standard_normal((n, 2))
        stats = statistics_for(parse_family("linear"), (2,), "vector")
        stats.update(torch.from_numpy(z), torch.from_numpy(g))
        count += stats.result().verdict is Verdict.IMPROVABLE
    return count


def collinear_signal(eps: float, dtype: torch.dtype, n: int = 1000, seed: int = 0) -> tuple[Tensor, Tensor]:
    """``z = (t, t + ε w)`` and ``g`` along the small feature direction ``z₂ − z₁`` (exact ``s = AG_rms``).

    The verdict reproducer of the rank cutoff (``ε = 1e-4`` in float32): ``g`` lies in the tangent space
    of the linear family, so the exact score of the stored arrays equals ``AG_rms = 1``.
    """
    rng = np.random.default_rng(seed)
    t, w = rng.standard_normal(n), rng.standard_normal(n)
    z = torch.from_numpy(np.stack([t, t + eps * w], 1)).to(dtype)
    zs = z.double().numpy()
    v = zs[:, 1] - zs[:, 0]
    g = np.stack([v, v], 1) / np.sqrt(np.mean(2 * v * v))
    return z, torch.from_numpy(g).to(dtype)


def walsh_probe(n: int, d: int, eps: float, a: float, dtype_z, dtype_g, b: float = 1.0) -> tuple[Tensor, Tensor]:
    """Walsh columns with a planted direction: exact score ``|a|`` of the stored arrays, in closed form.

    ``z`` holds ``d`` Walsh (Sylvester–Hadamard) columns ``h₁ … h_d`` with ``z₂ = z₁ + ε h_w`` (``ε`` a power of two:
    stored exactly), ``g₁ = a h_w + b h_junk`` and ``g_j = 0`` otherwise, where ``h_w, h_junk`` are further Walsh
    columns.  The columns are exactly orthogonal and ``h_junk`` is orthogonal to every feature (the constant included),
    so the span of the features holds ``h_w`` and the exact score is ``s = |a|``, ``AG_rms = sqrt(a² + b²)``; the
    planted direction's amplitude on the unit-diagonal Gram is :func:`planted_amplitude` ``≈ ε/√2``.

    Raises:
        AssertionError: when ``dtype_z``/``dtype_g`` cannot store the construction exactly.
    """
    from scipy.linalg import hadamard

    h = hadamard(n).astype(np.float64)  # column 0 is the constant: the bias feature's direction
    z = h[:, 1 : d + 1].copy()
    z[:, 1] = z[:, 0] + eps * h[:, d + 1]
    g = np.zeros((n, d))
    g[:, 0] = a * h[:, d + 1] + b * h[:, d + 2]
    zt, gt = torch.from_numpy(z).to(dtype_z), torch.from_numpy(g).to(dtype_g)
    assert np.array_equal(zt.double().numpy(), z) and np.array_equal(gt.double().numpy(), g), "not stored exactly"
    cols = h[:, : d + 3]
    assert np.array_equal(cols.T @ cols, n * np.eye(d + 3))  # integer sums below 2^53: exact in any order
    return zt, gt


def planted_amplitude(eps: float) -> float:
    """The planted direction's amplitude on the unit-diagonal Gram of :func:`walsh_probe` (closed form).

    The pair block is ``[[1, ρ], [ρ, 1]]`` with ``ρ = 1/sqrt(1 + ε²)``; its small eigenvalue ``1 − ρ`` is written
    without cancellation as ``ε² / (sqrt(1 + ε²)(sqrt(1 + ε²) + 1))``; the other eigenvalues are ``1`` and ``1 + ρ``.
    """
    root = math.sqrt(1 + eps * eps)
    return math.sqrt(eps * eps / (root * (root + 1)))


def _span_score(phi: np.ndarray, g: np.ndarray, u: np.ndarray) -> tuple[float, float]:
    """``(score on span(Φ̃u), amplitude sqrt(E (Φ̃u)²))`` of the stored arrays, in rationals (no engine code)."""
    n = phi.shape[0]
    uq = [Fraction(float(x)) for x in u]
    proj = [sum((Fraction(float(p)) * c for p, c in zip(row, uq, strict=True)), Fraction(0)) for row in phi]
    amp2 = sum((p * p for p in proj), Fraction(0)) / n
    if amp2 == 0:
        return 0.0, 0.0
    num = sum(
        (sum((Fraction(float(g[i, j])) * proj[i] for i in range(n)), Fraction(0)) / n) ** 2 for j in range(g.shape[1])
    )
    return math.sqrt(float(num / amp2)), math.sqrt(float(amp2))


def near_threshold_probe(rng: np.random.Generator, eps: float, n_pairs: int, dtype: torch.dtype):
    """``z = (t, t + ε w)`` stored in ``dtype`` with ``g`` cancelling exactly in pairs (``G = 0``).

    Units come in pairs with the same ``z`` and opposite ``g``, so the exact cross-gradient and
    score vanish on the stored arrays while ``g ≠ 0``; the returned direction ``v`` is the small
    feature direction ``z₂ − z₁`` (as stored), along which a planted signal is added.
    """
    t, w = rng.standard_normal(n_pairs), rng.standard_normal(n_pairs)
    z = torch.from_numpy(np.repeat(np.stack([t, t + eps * w], 1), 2, axis=0)).to(dtype)
    g0 = rng.standard_normal((n_pairs, 2))
    g0 = np.stack([g0, -g0], 1).reshape(-1, 2)
    g = torch.from_numpy(g0).to(dtype)
    zs = z.double().numpy()
    v = zs[:, 1] - zs[:, 0]
    return z, g, v


def _score(z: torch.Tensor, g: torch.Tensor):
    stats = statistics_for(parse_family("linear"), (2,), "vector")
    stats.update(z, g)
    return stats.result()


@check("NUM", "thm-score-error", "num-score-error-exact", "numeric")
def score_error_exact(ctx: Context) -> Outcome:
    """``|ŝ − s| ≤ e`` and correct verdicts on near-threshold probes, truth in rational arithmetic."""
    rng = ctx.rng("num-score-error-exact")
    eps_grid = (1e-1, 1e-3, 1e-4, 1e-6) if not ctx.quick else (1e-1, 1e-4)
    configs = [(torch.float64, e) for e in eps_grid] + [(torch.float32, e) for e in eps_grid if e >= 1e-4]
    configs += [(torch.float16, 1e-1)]
    bad = n = 0
    worst = 0.0
    for dtype, eps in configs:
        z, g, v = near_threshold_probe(rng, eps, ctx.count(40, 15), dtype)
        base = _score(z, g)
        for mult in (0.0, 3.0, 30.0):
            gg = g
            if mult:
                # plant a signal along the small feature direction: exact s grows with c
                vv = torch.from_numpy(np.stack([v, v], 1) / max(np.sqrt(np.mean(v * v)), 1e-300))
                gg = (g.double() + mult * max(base.tol, 1e-300) * vv).to(dtype)
            res = _score(z, gg)
            truth = exact_score(z.double().numpy(), gg.double().numpy())
            n += 1
            within = abs(res.score - truth) <= res.tol or not math.isfinite(res.tol)
            ok = within
            if truth == 0.0:
                ok &= res.probe_verdict is not Verdict.IMPROVABLE
            if math.isfinite(res.tol) and truth > 2 * res.tol:
                ok &= res.probe_verdict is Verdict.IMPROVABLE
            if math.isfinite(res.tol) and res.tol > 0:
                worst = max(worst, abs(res.score - truth) / res.tol)
            bad += not ok
    return Outcome(n, bad, detail=f"{n} probes, float64/32/16, ε down to 1e-6: max |ŝ − s|/e = {fmt(worst)}")


@check("NUM", "lem-lower-bound", "num-lower-bound", "numeric")
def lower_bound(ctx: Context) -> Outcome:
    """Keeping fewer directions of ``Σ`` never raises ``tr(G Σ⁻ Gᵀ)`` (``lem-lower-bound``)."""
    rng = ctx.rng("num-lower-bound")
    bad = n = 0
    for _ in range(ctx.count(40, 10)):
        k, d = int(rng.integers(2, 8)), int(rng.integers(1, 4))
        phi = rng.standard_normal((50, k)) * np.logspace(0, -6, k)
        g = rng.standard_normal((50, d))
        sig, big_g = phi.T @ phi / 50, g.T @ phi / 50
        full = resolve_spectrum(sig, rtol=0.0).quadratic(big_g)
        for rtol in (1e-10, 1e-6, 1e-2):
            n += 1
            bad += resolve_spectrum(sig, rtol=rtol).quadratic(big_g) > full * (1 + 1e-9) + 1e-300
    return Outcome(n, bad, detail=f"{n} truncations of random Grams with amplitudes down to 1e-6")


#: Laws of the activation gradient ``g`` of the Monte Carlo (theory/numerics.md, ``rem-noise-test-level``):
#: symmetric (Gaussian, Rademacher, Student t₃) and skewed (centred exponential, skewness 2); each
#: draws an array of the given shape from a numpy generator, with mean 0
NOISE_LAWS: dict[str, Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]] = {
    "gaussian": lambda r, s: r.standard_normal(s),
    "rademacher": lambda r, s: r.choice([-1.0, 1.0], s),
    "student-t3": lambda r, s: r.standard_t(3, s),
    "exponential": lambda r, s: r.exponential(1.0, s) - 1.0,
}

#: Laws of the site input ``z`` (one coordinate): centred, constant (``z ≡ 1``: a bias-like feature), nonnegative
#: (uniform on ``[0, 1)``, a ReLU output ``max(N(0, 1), 0)`` with an atom at 0) and heavy-tailed (Student t₃,
#: lognormal)
FEATURE_LAWS: dict[str, Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]] = {
    "gaussian": lambda r, s: r.standard_normal(s),
    "constant": lambda r, s: np.ones(s),
    "uniform(0,1)": lambda r, s: r.random(s),
    "relu": lambda r, s: np.maximum(r.standard_normal(s), 0.0),
    "student-t3": lambda r, s: r.standard_t(3, s),
    "lognormal(1)": lambda r, s: r.lognormal(0.0, 1.0, s),
}

#: Strongly skewed laws of ``g`` outside the domain (``prop-noise-no-uniform-level``): reported, not bounded
SKEWED_LAWS: dict[str, Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]] = {
    "bernoulli(0.01)": lambda r, s: (r.random(s) < 0.01) - 0.01,
    "lognormal(1.5)": lambda r, s: r.lognormal(0.0, 1.5, s) - math.exp(1.5**2 / 2),
}

#: ``n/k̃`` of the Monte Carlo (the issue's range, 0.1 to 100)
NOISE_RATIOS = (0.1, 0.3, 1, 3, 10, 30, 100)


def in_noise_domain(bias: bool, z_law: str, g_law: str) -> bool:
    """Whether ``(family, law of z, law of g)`` lies in the finite-``n`` domain of ``rem-noise-test-level``.

    The domain: a cross-gradient ``X = g φ̃ᵀ`` whose law is symmetric (``g`` symmetric, or no bias and ``z``
    symmetric about 0, ``g`` independent of ``z``) and has no atom other than 0 (so not a Rademacher ``g`` on a
    constant feature); and centred exponential ``g`` with a bias and a non-constant ``z``.  Outside it
    (measured, reported): Rademacher ``g`` on a constant feature (a lattice) and centred exponential ``g`` on
    one feature direction of nonzero mean (no bias and ``E z ≠ 0``, or a constant ``z``).
    """
    symmetric = g_law in ("gaussian", "rademacher", "student-t3") or (not bias and z_law in ("gaussian", "student-t3"))
    lattice = g_law == "rademacher" and z_law == "constant"
    if symmetric and not lattice:
        return True
    return g_law == "exponential" and bias and z_law != "constant"


def noise_ratio_reference(z: np.ndarray, g: np.ndarray, bias: bool) -> np.ndarray:
    """``n ŝ²/v̂`` of ``R`` probes of the linear family at ``d = 1``, in closed form (no engine code).

    Args:
        z: inputs ``(R, n)`` float64.
        g: activation gradients ``(R, n)`` float64.
        bias: the family has a bias (``φ̃ = (z, 1)``) or not (``φ̃ = z``).

    Returns:
        ``(R,)``: ``n tr(Ḡ Σ̂⁺ Ḡᵀ) / tr(Σ̂⁺ Ê[XᵀX])`` with ``X = g φ̃ᵀ`` (``0`` where ``v̂ = 0``); without a bias
        this is the self-normalised sum ``(Σ g z)² / Σ (g z)²``.
    """
    n = z.shape[1]
    if not bias:
        x = g * z
        num, den = x.sum(1) ** 2, (x * x).sum(1)
    else:
        phi = np.stack([z, np.ones_like(z)], 2)
        sig = np.einsum("rni,rnj->rij", phi, phi) / n
        big_g = np.einsum("rn,rni->ri", g, phi) / n
        q = np.einsum("rn,rni,rnj->rij", g * g, phi, phi) / n
        sp = np.linalg.pinv(sig, rcond=1e-10, hermitian=True)
        num = n * n * np.einsum("ri,rij,rj->r", big_g, sp, big_g)
        den = n * np.einsum("rij,rji->r", sp, q)
    out = np.zeros_like(num)
    np.divide(num, den, out=out, where=den > 0)
    return out


def _engine_agrees(z: np.ndarray, g: np.ndarray, bias: bool, ref: np.ndarray, threshold: float) -> int:
    """How many of the probes ``z``, ``g`` ``(m, n)`` the engine's noise ratio or verdict disagrees on."""
    bad = 0
    for zi, gi, ri in zip(z, g, ref, strict=True):
        stats = statistics_for(parse_family("linear" if bias else "linear-nobias"), (1,), "vector")
        stats.update(torch.from_numpy(zi[:, None]), torch.from_numpy(gi[:, None]))
        res = stats.result()
        if abs(ri - threshold) < 1e-6 * threshold or res.score <= res.score_error:
            continue  # at the threshold, or below the rounding bound: rounding may decide either way
        bad += (res.verdict is Verdict.IMPROVABLE) != (ri > threshold)
        bad += ri > 0 and not abs(res.noise_ratio - ri) <= 1e-8 * ri
    return bad


def _noise_cells(
    ctx: Context, configs: list[tuple[bool, str, str, Callable]], reps: int, rng: np.random.Generator
) -> tuple[list[list[int]], int]:
    """Hits of the noise test (closed form) per config and ``n/k̃``, and the engine's disagreements."""
    threshold, checked = noise_threshold(NOISE_ALPHA), ctx.count(5, 2)
    hits, bad = [], 0
    for bias, z_law, _, draw in configs:
        row = []
        for ratio in NOISE_RATIOS:
            n = max(2, round(ratio * (1 + bias)))
            z, g = FEATURE_LAWS[z_law](rng, (reps, n)), draw(rng, (reps, n))
            ref = noise_ratio_reference(z, g, bias)
            row.append(int((ref > threshold).sum()))
            if n >= 4:
                bad += _engine_agrees(z[:checked], g[:checked], bias, ref[:checked], threshold)
        hits.append(row)
    return hits, bad


def noise_rate(spec: str, d: int, law, ratio: float, reps: int, rng: np.random.Generator) -> tuple[int, float]:
    """``(n, rate)``: the share of "improvable" verdicts of the engine on ``reps`` pure-noise probes.

    ``z`` is standard normal ``(n, d)`` and ``g`` has i.i.d. coordinates from ``law`` (mean 0),
    independent of ``z``: the population cross-gradient is ``E[g] E[φ̃]ᵀ = 0``, so ``s = 0``.
    """
    k = d + (spec == "linear")
    n = max(2, round(ratio * k))
    hits = 0
    for _ in range(reps):
        z = rng.standard_normal((n, d))
        g = law(rng, (n, d))
        stats = statistics_for(parse_family(spec), (d,), "vector")
        stats.update(torch.from_numpy(z), torch.from_numpy(g))
        hits += stats.result().verdict is Verdict.IMPROVABLE
    return n, hits / reps


@check("NUM", ("thm-noise-test", "rem-noise-test-level"), "num-noise-test", "coverage")
def noise_test(ctx: Context) -> Outcome:
    """Pure noise: "improvable" at most at rate ``α`` for ``n/k̃`` in [0.1, 100] on the laws of the domain.

    Grid: the linear family at ``d = 1`` with and without a bias (without: one χ² weight, the extremal law
    of the test), every law of ``z`` in :data:`FEATURE_LAWS` and of ``g`` in :data:`NOISE_LAWS`
    (independent), ``n/k̃`` in :data:`NOISE_RATIOS`.  The rate is that of the statistic ``n ŝ²/v̂`` in closed
    form (:func:`noise_ratio_reference`, many probes per cell); on the first probes of each cell with
    ``n ≥ 4`` the engine's ``noise_ratio`` must equal it and its verdict must be "improvable" exactly when
    it exceeds ``χ²₁,₁₋α``.  Cells in :func:`in_noise_domain` must not be significantly above ``α``
    (one-sided binomial, family-wise 1%) and pool to at most ``α + 3 sd``; the other cells, and the strongly
    skewed laws of :data:`SKEWED_LAWS`, are reported with 99% Clopper–Pearson intervals, not bounded.  The
    engine itself is run on linear ``d = 8`` with Gaussian ``z`` and ``g`` (200 probes per cell), and on
    strong signals at ``n = 10 k̃``, which must all be improvable.
    """
    from scipy.stats import beta, binom

    rng = ctx.rng("num-noise-test")
    gen = ctx.torch_generator("num-noise-test")
    reps = ctx.count(4000, 400)
    configs = [(b, zl, gl, NOISE_LAWS[gl]) for b in (True, False) for zl in FEATURE_LAWS for gl in NOISE_LAWS]
    configs += [(True, "gaussian", gl, draw) for gl, draw in SKEWED_LAWS.items()]
    hits, bad = _noise_cells(ctx, configs, reps, rng)
    inside = [in_noise_domain(b, zl, gl) for b, zl, gl, _ in configs]
    cells = sum(inside) * len(NOISE_RATIOS)
    rows, hits_in, worst_out = [], 0, 0.0
    for (b, zl, gl, _), row, dom in zip(configs, hits, inside, strict=True):
        cell_text = []
        for h in row:
            lo = float(beta.ppf(0.005, h, reps - h + 1)) if h else 0.0
            hi = float(beta.ppf(0.995, h + 1, reps - h)) if h < reps else 1.0
            cell_text.append(f"{h / reps:.3f} [{lo:.3f}, {hi:.3f}]")
            if dom:
                hits_in += h
                bad += bool(binom.sf(h - 1, reps, NOISE_ALPHA) < 0.01 / cells)
            else:
                worst_out = max(worst_out, h / reps)
        rows.append(["linear" if b else "linear-nobias", zl, gl, "yes" if dom else "no", *cell_text])
    pooled = hits_in / (cells * reps)
    slack = 3 * math.sqrt(NOISE_ALPHA * (1 - NOISE_ALPHA) / (cells * reps))
    bad += pooled > NOISE_ALPHA + slack
    n_inst = len(configs) * len(NOISE_RATIOS) * reps
    engine_reps = ctx.count(200, 60)
    d8 = [noise_rate("linear", 8, NOISE_LAWS["gaussian"], ratio, engine_reps, rng) for ratio in NOISE_RATIOS]
    n_inst += engine_reps * len(d8)
    for _, rate in d8:
        bad += bool(binom.sf(round(rate * engine_reps) - 1, engine_reps, NOISE_ALPHA) < 0.01 / len(d8))
    rows.append(["linear d=8", "gaussian", "gaussian", "yes (engine)", *(f"{rate:.3f}" for _, rate in d8)])
    d, n_strong = 8, ctx.count(20, 5)
    strong = 0
    for _ in range(n_strong):
        n = 10 * (d + 1)
        z = torch.randn(n, d, generator=gen, dtype=torch.float64)
        g = z @ torch.randn(d, d, generator=gen, dtype=torch.float64) + torch.randn(n, d, generator=gen)
        stats = statistics_for(parse_family("linear"), (d,), "vector")
        stats.update(z, g.double())
        strong += stats.result().verdict is Verdict.IMPROVABLE
    n_inst += n_strong
    bad += n_strong - strong
    return Outcome(
        n_inst,
        bad,
        detail=(
            f"pure-noise 'improvable' rate in the domain: pooled {pooled:.4f} ≤ {NOISE_ALPHA} + {slack:.4f}, no cell "
            f"above α (binomial, family-wise 1%) on {sum(inside)} (family, law of z, law of g) triples × "
            f"{len(NOISE_RATIOS)} n/k̃ from 0.1 to 100 ({reps} probes per cell); outside the domain up to "
            f"{worst_out:.3f}; strong signals {strong}/{n_strong}"
        ),
        table=(
            f"noise test: rate of 'improvable' on pure noise (α = {NOISE_ALPHA}; {reps} probes per cell, "
            f"99% Clopper–Pearson interval; d = 8: the engine on {engine_reps} probes)",
            ["family", "law of z", "law of g", "in domain", *(f"n/k̃={r:g}" for r in NOISE_RATIOS)],
            rows,
        ),
    )


def rademacher_constant_rate(n: int, c: float) -> Fraction:
    """``Pr((Σ g)²/Σ g² > c)`` for ``n`` Rademacher ``g`` (``prop-noise-test-constant-feature``, part 2), exactly.

    ``Σ g = 2K − n`` and ``Σ g² = n`` with ``K ~ Binomial(n, 1/2)``: ``2⁻ⁿ Σ_{k : (2k−n)² > c n} C(n, k)``.
    """
    total, binom_k = 0, 1  # binom_k = C(n, k), updated along the row
    for k in range(n + 1):
        total += binom_k if (2 * k - n) ** 2 > c * n else 0
        binom_k = binom_k * (n - k) // (k + 1)
    return Fraction(total, 2**n)


def gaussian_constant_rate(n: np.ndarray, c: float) -> np.ndarray:
    """``Pr((Σ g)²/Σ g² > c)`` for ``n`` standard normal ``g`` (``prop-noise-test-constant-feature``, part 1).

    ``0`` for ``n ≤ c``; else ``Pr(|t_{n−1}| > √((n−1)c/(n−c)))`` (Student's ``t``, scipy).
    """
    from scipy.stats import t as student

    n = np.asarray(n, dtype=np.float64)
    big = n > c
    out = np.zeros_like(n)
    m = n[big]
    out[big] = 2 * student.sf(np.sqrt((m - 1) * c / (m - c)), m - 1)
    return out


def _constant_feature_probe(g: np.ndarray):
    """The engine's result on the linear family without a bias, ``z ≡ 1``, gradients ``g`` ``(n,)``."""
    stats = statistics_for(parse_family("linear-nobias"), (1,), "vector")
    stats.update(torch.ones(g.size, 1, dtype=torch.float64), torch.from_numpy(g[:, None]))
    return stats.result()


@check("NUM", "prop-noise-test-constant-feature", "num-noise-test-constant-feature", "numeric")
def noise_test_constant_feature(ctx: Context) -> Outcome:
    """Exact rates of the noise test on a constant feature (Rademacher enumeration, Gaussian closed form).

    Rademacher: for every ``n`` enumerated and every count ``k`` of ``+1`` the engine's noise ratio equals
    ``(2k − n)²/n`` and its verdict is "improvable" exactly when that exceeds ``χ²₁,₀.₉₅`` (every probe with
    ``k`` plus signs has the same sums, exact integers), so its rate is :func:`rademacher_constant_rate`;
    the rate at ``n = 4`` is ``1/8`` (2 of 16 sign vectors) and is above ``α`` at 29 sizes from 4 to 64.
    Gaussian: the engine's ratio equals ``(Σ g)²/Σ g²`` on random probes and the closed form of
    :func:`gaussian_constant_rate` is at most ``α`` for every ``n`` from 2 to ``10⁵`` (``10⁴`` quick) at
    ``α`` = 0.05 and 0.01, above it at ``α = 0.1`` for every ``n ≥ 13``.
    """
    rng = ctx.rng("num-noise-test-constant-feature")
    c = noise_threshold(NOISE_ALPHA)
    bad = n_inst = 0
    top = ctx.count(32, 12)
    for n in range(4, top + 1):
        engine_rate = Fraction(0)
        for k in range(n + 1):
            res = _constant_feature_probe(np.array([1.0] * k + [-1.0] * (n - k)))
            truth = Fraction((2 * k - n) ** 2, n)
            bad += not math.isclose(res.noise_ratio, float(truth), rel_tol=1e-12, abs_tol=1e-300)
            hit = res.verdict is Verdict.IMPROVABLE
            bad += hit != (truth > c)
            engine_rate += hit * Fraction(math.comb(n, k), 2**n)
            n_inst += 1
        bad += engine_rate != rademacher_constant_rate(n, c)
    rates = {n: rademacher_constant_rate(n, c) for n in range(4, 1001)}
    over = [n for n in range(4, 65) if rates[n] > NOISE_ALPHA]
    bad += rates[4] != Fraction(1, 8) or rates[5] != Fraction(1, 16) or len(over) != 29
    for _ in range(ctx.count(40, 10)):
        g = rng.standard_normal(int(rng.integers(4, 200)))
        res = _constant_feature_probe(g)
        t2 = g.sum() ** 2 / (g * g).sum()
        bad += not abs(res.noise_ratio - t2) <= 1e-12 * max(t2, 1.0)
        bad += (res.verdict is Verdict.IMPROVABLE) != (t2 > c) and abs(t2 - c) > 1e-9
        n_inst += 1
    ns = np.arange(2, ctx.count(100_000, 10_000) + 1)
    worst = {a: float(gaussian_constant_rate(ns, noise_threshold(a)).max()) for a in (0.05, 0.01)}
    bad += sum(worst[a] > a for a in worst)
    r10 = gaussian_constant_rate(ns, noise_threshold(0.1))
    bad += not bool((r10[ns >= 13] > 0.1).all())
    n_inst += 3 * ns.size
    return Outcome(
        n_inst,
        bad,
        detail=(
            f"Rademacher g on z ≡ 1: engine = enumeration for n = 4..{top}; exact rate 1/8 at n = 4, "
            f"{float(rates[100]):.4f} at n = 100, {float(rates[1000]):.4f} at n = 1000, above α at "
            f"{len(over)} n in 4..64; Gaussian g: largest rate {worst[0.05]:.8f} (α = 0.05), "
            f"{worst[0.01]:.8f} (α = 0.01) over n = 2..{ns[-1]}, above α = 0.1 for every n ≥ 13"
        ),
    )


@check("NUM", "prop-noise-no-uniform-level", "num-noise-no-uniform-level", "numeric")
def noise_no_uniform_level(ctx: Context) -> Outcome:
    """The pure-noise law ``g = c (1 − B/p)`` is, without an event, a probe of the constant gradient ``c``.

    Linear family with a bias at ``d = 1``, ``n = 20`` (``n/k̃ = 10``), ``p = 0.01``, ``c = −p`` (the
    centred Bernoulli(0.01) gradient): ``E g = 0`` in rationals; on each drawn feature sample the
    constant probe's exact score (rational Gauss–Jordan) is ``|c| > 0`` and its verdict is recorded;
    every Bernoulli probe without an event must get exactly that verdict, and the observed pure-noise
    rate of "improvable" must be at least ``(1 − p)^n β − 3 sd`` (``β``: the constant probe's rate).
    """
    rng = ctx.rng("num-noise-no-uniform-level")
    p, n = Fraction(1, 100), 20
    c = -p
    bad = 0
    mean = (1 - p) * (c * (1 - 0 / p)) + p * (c * (1 - 1 / p))
    bad += mean != 0
    reps = ctx.count(400, 100)
    const_hits = noise_hits = same = no_event = 0
    pf, cf = float(p), float(c)
    for _ in range(reps):
        z = rng.standard_normal((n, 1))
        events = rng.random(n) < pf
        g_const = np.full((n, 1), cf)
        truth = exact_score(z, g_const)
        bad += not math.isclose(truth, abs(cf), rel_tol=1e-12)
        verdicts = []
        for g in (g_const, (cf * (1 - events / pf))[:, None]):
            stats = statistics_for(parse_family("linear"), (1,), "vector")
            stats.update(torch.from_numpy(z), torch.from_numpy(g))
            verdicts.append(stats.result().verdict)
        const_hits += verdicts[0] is Verdict.IMPROVABLE
        noise_hits += verdicts[1] is Verdict.IMPROVABLE
        if not events.any():
            no_event += 1
            same += verdicts[0] is verdicts[1]
    bad += same != no_event
    beta, rate = const_hits / reps, noise_hits / reps
    floor = (1 - pf) ** n * beta
    bad += rate < floor - 3 * math.sqrt(max(floor * (1 - floor), 1e-12) / reps)
    return Outcome(
        reps,
        bad,
        detail=(
            f"n = {n}, p = {p}: constant gradient improvable at rate β = {beta:.3f} (exact s = {abs(cf):g}); "
            f"pure-noise rate {rate:.3f} ≥ (1 − p)^n β = {floor:.3f}; {same}/{no_event} event-free probes "
            f"got the constant probe's verdict"
        ),
    )


def _unit_probe(rng: np.random.Generator, kind: str, n: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    z, g = rng.standard_normal((n, d)), rng.standard_normal((n, d))
    if kind == "repeated":  # five distinct units with a per-unit mean gradient: a real signal, rank ≤ 5
        idx = rng.integers(0, 5, n)
        z, g = z[idx], 0.3 * g + rng.standard_normal((5, d))[idx]
    elif kind == "cancelling":  # every unit twice with opposite gradients: exact s = 0
        half = n // 2
        z, g = np.repeat(z[:half], 2, axis=0), np.stack([g[:half], -g[:half]], 1).reshape(-1, d)
    elif kind == "low-rank":
        z = rng.standard_normal((n, 2)) @ rng.standard_normal((2, d))
    return z, g


@check("NUM", "thm-unit-gram", "num-unit-gram", "numeric")
def unit_gram(ctx: Context) -> Outcome:
    """The unit path against an independent kernel-form SVD and against the Gram path."""
    from depthsat_theory.statistics import FeatureStatistics

    rng = ctx.rng("num-unit-gram")
    bad = n_inst = 0
    worst = 0.0
    for _ in range(ctx.count(24, 8)):
        family = str(rng.choice(["linear", "relu:40", "tanh:20"]))
        kind = str(rng.choice(["random", "repeated", "cancelling", "low-rank"]))
        n, d = int(rng.integers(6, 120)), int(rng.integers(2, 6))
        dtype = torch.float64 if rng.random() < 0.5 else torch.float32
        z, g = _unit_probe(rng, kind, n, d)
        zt, gt = torch.from_numpy(z).to(dtype), torch.from_numpy(g).to(dtype)
        fam = parse_family(family)
        assert isinstance(fam, FeatureFamily)
        out = {}
        for gram in ("units", "features"):
            st = FeatureStatistics(fam, (d,), "vector", gram=gram)
            for i in range(0, zt.shape[0], 16):
                st.update(zt[i : i + 16], gt[i : i + 16])
            out[gram] = st.result()
        ru, rf = out["units"], out["features"]
        # independent: the float64 features of the stored z, scaled to unit diagonal, one numpy SVD
        m = zt.shape[0]  # rows (cancelling pairs: 2 ⌊n/2⌋)
        feats = fam.augmented_features(fam.frozen_feature_map((d,), "vector"), zt.double()).reshape(m, -1)
        phi = feats.numpy()
        gs = gt.double().numpy()
        diag = (phi**2).sum(0) / m
        scale = np.where(diag > 0, 1 / np.sqrt(np.where(diag > 0, diag, 1)), 0.0)
        u, _, _ = np.linalg.svd(phi * scale / np.sqrt(m), full_matrices=False)
        rank = ru.tangent_rank // d
        s_kernel = math.sqrt(np.sum((u[:, :rank].T @ gs) ** 2) / m)
        v_kernel = float(np.sum((gs**2).sum(1) * (u[:, :rank] ** 2).sum(1)))
        n_inst += 1
        ok = abs(ru.score - min(s_kernel, ru.ag_rms)) <= ru.score_error or not math.isfinite(ru.score_error)
        ok &= abs(ru.noise_variance - v_kernel) <= 1e-8 * max(v_kernel, ru.ag_rms**2)
        ok &= ru.tangent_rank == rf.tangent_rank and ru.verdict is rf.verdict
        ok &= abs(ru.score - rf.score) <= ru.score_error + rf.score_error
        if kind == "cancelling":
            ok &= ru.verdict is not Verdict.IMPROVABLE
        if ru.score_error > 0 and math.isfinite(ru.score_error):
            worst = max(worst, abs(ru.score - s_kernel) / ru.score_error)
        bad += not ok
    return Outcome(
        n_inst,
        bad,
        detail=f"{n_inst} probes (N/k̃ from 0.04 to 20, rank-deficient ones): max |ŝ − s_kernel|/e = {fmt(worst)}",
    )


@check("NUM", "thm-noise-factor", "num-noise-factor", "numeric")
def noise_factor(ctx: Context) -> Outcome:
    """``v̂`` from the factors against rationals on ill-conditioned dyadic probes; pure noise at ratios 10¹⁵–10¹⁶."""
    from scipy.stats import binom

    bad = n_inst = 0
    worst = 0.0
    for shift in (22, 24, 26, 27):
        for seed in range(ctx.count(4, 1)):
            z, g = dyadic_collinear_probe(64, shift, seed=100 * shift + seed)
            truth = float(exact_noise_variance(z, g))
            stats = statistics_for(parse_family("linear"), (2,), "vector")
            stats.update(torch.from_numpy(z), torch.from_numpy(g))
            res = stats.result()
            rel = abs(res.noise_variance - truth) / truth
            worst = max(worst, rel)
            upper = res.noise_variance_upper
            n_inst += 1
            bad += not (res.tangent_rank == 6 and rel <= 1e-6 and (math.isnan(upper) or upper >= truth))
    reps = ctx.count(40, 20)
    counts = []
    for eps in (3e-8, 1e-8):
        hits = pure_noise_improvable(eps, range(reps))
        counts.append(hits)
        n_inst += reps
        bad += bool(binom.sf(hits - 1, reps, NOISE_ALPHA) < 0.01)
    return Outcome(
        n_inst,
        bad,
        detail=f"max |v̂ − v|/v = {fmt(worst)} at ratios to 1e17; pure noise improvable {counts} of {reps} "
        f"(ε 3e-8, 1e-8)",
    )


@check("NUM", "lem-dropped-score", "num-dropped-score", "numeric")
def dropped_score_bound(ctx: Context) -> Outcome:
    """``c_v`` bounds what a possibly real dropped direction adds; never "saturated" above ``tol + e``."""
    rng = ctx.rng("num-dropped-score")
    exponents = {torch.float64: (24, 48), torch.float32: (17, 22), torch.float16: (5, 8)}
    bad = n_inst = checked = saturated_zero = zero = 0
    for _ in range(ctx.count(36, 12)):
        dtype = [torch.float64, torch.float32, torch.float16][int(rng.integers(3))]
        n, d = int(rng.choice([64, 256])), 8
        eps = 2.0 ** -int(rng.integers(*exponents[dtype]))
        a = 0.0 if rng.random() < 0.3 else 2.0 ** -int(rng.integers(1, 10 if dtype == torch.float16 else 12))
        z, g = walsh_probe(n, d, eps, a, dtype, dtype)
        phi = np.concatenate([z.double().numpy(), np.ones((n, 1))], 1)
        gs = g.double().numpy()
        ag = math.sqrt(float((gs**2).sum()) / n)
        spec = resolve_spectrum(phi.T @ phi / n, dtype=dtype)  # the float64 Gram path
        mass = np.linalg.norm(((gs.T @ phi / n) * spec.scale) @ spec.dropped, axis=0)
        c, real = dropped_score(spec, mass, ag_rms=ag, dtype=dtype, summands=n + 1)
        rho = FEATURE_ROUNDING_FACTOR * unit_roundoff(dtype) * math.sqrt(d + 1)
        ok = True
        for j in range(spec.dropped.shape[1]):
            contribution, amplitude = _span_score(phi, gs, spec.scale * spec.dropped[:, j])
            if amplitude > rho:
                checked += 1
                ok &= bool(real[j]) and contribution <= c[j] * (1 + 1e-9)
        res = statistics_for(parse_family("linear"), (d,), "vector")
        res.update(z, g)
        out = res.result()
        if planted_amplitude(eps) > rho and math.isfinite(out.tol) and abs(a) > out.tol + out.score_error:
            ok &= out.verdict is not Verdict.SATURATED and out.probe_verdict is not Verdict.SATURATED
        if a == 0.0:
            zero += 1
            saturated_zero += out.verdict is Verdict.SATURATED
        n_inst += 1
        bad += not ok
    return Outcome(
        n_inst,
        bad,
        detail=f"{n_inst} Walsh probes, {checked} possibly real dropped directions bounded by c_v; "
        f"exact s = 0 decided saturated on {saturated_zero}/{zero}",
    )
