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
- ``num-noise-test`` (coverage): pure-noise probes (``g`` independent of ``z``) at
  ``n/k̃`` from ``0.1`` to ``100`` for every law of the test's stated domain (symmetric or mildly
  skewed ``g``): no cell's count of "improvable" is improbable at rate ``α`` (one-sided binomial,
  family-wise 1%) and the pooled rate is below ``α + 3 sd``; strong signals at
  ``n = 10 k̃`` are all "improvable". Strongly skewed laws, outside the domain
  (``prop-noise-no-uniform-level``: no test can hold ``α`` for them at every ``n``), are reported.
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
from depthsat_theory.statistics.linalg import FEATURE_ROUNDING_FACTOR, dropped_score, unit_roundoff
from depthsat_theory.vocabulary import Verdict

from ._registry import Context, Outcome, check
from .t1_gradient import fmt


def _solve_rational(gram: list[list[Fraction]], rhs: list[list[Fraction]]) -> list[list[Fraction]]:
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
    x = _solve_rational(gram, rhs)
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
    x = _solve_rational(sigma, q)  # Σ x = Q (the 1/n cancels)
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

    Issue 10's reproducer of the rank cutoff (``ε = 1e-4`` in float32): ``g`` lies in the tangent space
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


#: Laws of the activation gradient inside the noise test's stated domain (theory/numerics.md,
#: ``thm-noise-test``): symmetric (Gaussian, Rademacher, Student t₃) and mildly skewed (centred
#: exponential, skewness 2); each standardised draws ``(n,)`` from a numpy generator
NOISE_LAWS: dict[str, Callable[[np.random.Generator, int], np.ndarray]] = {
    "gaussian": lambda r, n: r.standard_normal(n),
    "rademacher": lambda r, n: r.choice([-1.0, 1.0], n),
    "student-t3": lambda r, n: r.standard_t(3, n),
    "exponential": lambda r, n: r.exponential(1.0, n) - 1.0,
}

#: Strongly skewed laws outside the domain (``prop-noise-no-uniform-level``): reported, not bounded
SKEWED_LAWS: dict[str, Callable[[np.random.Generator, int], np.ndarray]] = {
    "bernoulli(0.01)": lambda r, n: (r.random(n) < 0.01) - 0.01,
    "lognormal(1.5)": lambda r, n: r.lognormal(0.0, 1.5, n) - math.exp(1.5**2 / 2),
}

#: ``n/k̃`` of the Monte Carlo (the issue's range, 0.1 to 100)
NOISE_RATIOS = (0.1, 0.3, 1, 3, 10, 30, 100)


def noise_rate(spec: str, d: int, law, ratio: float, reps: int, rng: np.random.Generator) -> tuple[int, float]:
    """``(n, rate)``: the share of "improvable" verdicts on ``reps`` pure-noise probes.

    ``z`` is standard normal ``(n, d)`` and ``g`` has i.i.d. coordinates from ``law`` (mean 0),
    independent of ``z``: the population cross-gradient is ``E[g] E[φ̃]ᵀ = 0``, so ``s = 0``.
    """
    k = d + (spec == "linear")
    n = max(2, round(ratio * k))
    hits = 0
    for _ in range(reps):
        z = rng.standard_normal((n, d))
        g = np.stack([law(rng, n) for _ in range(d)], 1)
        stats = statistics_for(parse_family(spec), (d,), "vector")
        stats.update(torch.from_numpy(z), torch.from_numpy(g))
        hits += stats.result().verdict is Verdict.IMPROVABLE
    return n, hits / reps


@check("NUM", "thm-noise-test", "num-noise-test", "coverage")
def noise_test(ctx: Context) -> Outcome:
    """Pure noise: "improvable" at most at rate ``α`` for ``n/k̃`` in [0.1, 100], laws of the domain.

    Configurations: linear with a bias at ``d = 1`` (``k̃ = 2``: the mean of a skewed gradient lies in
    the bias direction), linear without a bias at ``d = 1`` (one χ² weight, the extremal law of the
    test) for every law of :data:`NOISE_LAWS`, and linear at ``d = 8`` for the Gaussian; strong
    signals at ``n = 10 k̃`` must all be improvable. The strongly skewed laws of
    :data:`SKEWED_LAWS` are run too and reported in the table ("outside the domain"), not bounded.
    """
    rng = ctx.rng("num-noise-test")
    gen = ctx.torch_generator("num-noise-test")
    reps = ctx.count(200, 60)
    from scipy.stats import binom

    rows, bad, n_inst = [], 0, 0
    configs = [(spec, 1, law) for spec in ("linear", "linear-nobias") for law in NOISE_LAWS] + [
        ("linear", 8, "gaussian")
    ]
    cells = len(configs) * len(NOISE_RATIOS)
    # a cell fails when its count of "improvable" is improbable under rate α (one-sided binomial
    # p-value below 0.01/cells: family-wise 1%); the pooled rate over every cell must be ≤ α + 3 sd
    hits_all = 0
    for spec, dd, law in configs:
        rates = [noise_rate(spec, dd, NOISE_LAWS[law], ratio, reps, rng) for ratio in NOISE_RATIOS]
        n_inst += reps * len(rates)
        for _, rate in rates:
            hits = round(rate * reps)
            hits_all += hits
            bad += bool(binom.sf(hits - 1, reps, NOISE_ALPHA) < 0.01 / cells)
        rows.append([f"{spec} d={dd}", law, "yes", *(f"{rate:.3f}" for _, rate in rates)])
    pooled = hits_all / (cells * reps)
    slack = 3 * math.sqrt(NOISE_ALPHA * (1 - NOISE_ALPHA) / (cells * reps))
    bad += pooled > NOISE_ALPHA + slack
    for law, draw in SKEWED_LAWS.items():
        rates = [noise_rate("linear", 1, draw, ratio, reps, rng) for ratio in NOISE_RATIOS]
        rows.append(["linear d=1", law, "no", *(f"{rate:.3f}" for _, rate in rates)])
    d = 8
    k = d + 1
    strong = 0
    for _ in range(ctx.count(20, 5)):
        n = 10 * k
        z = torch.randn(n, d, generator=gen, dtype=torch.float64)
        g = z @ torch.randn(d, d, generator=gen, dtype=torch.float64) + torch.randn(n, d, generator=gen)
        stats = statistics_for(parse_family("linear"), (d,), "vector")
        stats.update(z, g.double())
        strong += stats.result().verdict is Verdict.IMPROVABLE
        n_inst += 1
    n_strong = ctx.count(20, 5)
    bad += n_strong - strong
    return Outcome(
        n_inst,
        bad,
        detail=(
            f"pure-noise 'improvable' rate: pooled {pooled:.4f} ≤ {NOISE_ALPHA} + {slack:.4f}, no cell above α "
            f"(binomial, family-wise 1%) on {len(configs)} (family, law) pairs × {len(NOISE_RATIOS)} n/k̃ from "
            f"0.1 to 100; strong signals {strong}/{n_strong}"
        ),
        table=(
            f"noise test: rate of 'improvable' on pure noise ({reps} probes per cell, α = {NOISE_ALPHA})",
            ["family", "law of g", "in domain", *(f"n/k̃={r:g}" for r in NOISE_RATIOS)],
            rows,
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
