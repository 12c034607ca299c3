"""From a score to a decision (theory/decision.md).

Claims and their checks:

- ``t11-chance-level`` (numeric, ``prop-plugin-chance-level``): fixed dyadic features and Rademacher ``g``,
  every sign pattern enumerated: the mean of the engine's ``ŝ²`` is ``rank/n`` and of ``ŝ²_U`` is ``0``.
- ``t11-headline-interval`` (coverage, ``prop-headline-interval``): fixed designs (the Gram as measured),
  pure noise and a planted score: the interval covers ``s`` at ``1 − α`` within Monte Carlo error.
- ``t11-mixture-identity`` (symbolic, ``thm-anytime-noise-test``): sympy evaluates the normal mixture of
  ``exp(λS − λ²V/2)`` to ``sqrt(ρ/(ρ+V)) exp(S²/(2(ρ+V)))``, and ``cosh x ≤ exp(x²/2)`` term by term.
- ``t11-anytime-level`` (coverage, ``thm-anytime-noise-test``): symmetric pure noise streamed until decided or
  the budget: the rate of "improvable" under optional stopping is at most ``α`` within Monte Carlo error.
- ``t11-beyond-exact`` (numeric, ``prop-beyond-training``): random dyadic residual linear models: the engine's
  ``s²_old``, ``s²_joint``, ``s²_beyond`` against the Schur form in rationals; Pythagoras exactly; the example
  of (4) where ``s_beyond > s_new``.
- ``t11-beyond-noise`` (coverage, ``prop-beyond-noise-test``): ``s_beyond = 0`` with a non-stationary existing
  map: the influence noise test's rate of "improvable" is at most ``α`` within Monte Carlo error.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import sympy as sp
import torch
from scipy.stats import binom

from depthsat_theory.decision import AnytimeNoiseTest, beyond_training, headline
from depthsat_theory.families import parse_family
from depthsat_theory.statistics import statistics_for
from depthsat_theory.vocabulary import Verdict

from ._registry import Context, Outcome, check
from .t8_numerics import solve_rational


def _site(z: np.ndarray, g: np.ndarray):
    stats = statistics_for(parse_family("linear"), (z.shape[1],), "vector")
    stats.update(torch.from_numpy(z), torch.from_numpy(g))
    return stats.result()


def _too_many(hits: int, reps: int, alpha: float = 0.05) -> bool:
    """One-sided binomial test at 1%: ``hits`` significantly above ``α · reps``."""
    return bool(binom.sf(hits - 1, reps, alpha) <= 0.01)


@check("DECIDE", "prop-plugin-chance-level", "t11-chance-level", "numeric")
def chance_level(ctx: Context) -> Outcome:
    """Exact enumeration of Rademacher gradients on fixed dyadic features."""
    rng = ctx.rng("t11-chance-level")
    bad, worst = 0, 0.0
    cases = ctx.count(4, 1)
    for _ in range(cases):
        n = 6
        z = rng.integers(-8, 9, size=(n, 1)) / 4.0
        while len(set(z[:, 0])) < 2:
            z = rng.integers(-8, 9, size=(n, 1)) / 4.0
        s2 = s2u = 0.0
        patterns = list(itertools.product([-1.0, 1.0], repeat=n))
        for signs in patterns:
            res = _site(z, np.array(signs)[:, None])
            s2 += res.score**2 / len(patterns)
            s2u += res.score_squared_unbiased / len(patterns)
        dev = max(abs(s2 - 2 / n), abs(s2u))
        worst = max(worst, dev)
        bad += dev > 1e-10
    return Outcome(cases, bad, detail=f"largest |E ŝ² − rank/n|, |E ŝ²_U| = {worst:.1e}")


@check("DECIDE", "prop-headline-interval", "t11-headline-interval", "coverage")
def headline_interval(ctx: Context) -> Outcome:
    """Fixed designs, pure noise and a planted score ``a z₁``: coverage of the headline's interval."""
    rng = ctx.rng("t11-headline-interval")
    reps = ctx.count(200, 40)
    n, d, bad, rows = 300, 2, 0, []
    for a in (0.0, 0.3):
        z = rng.standard_normal((n, d))
        s_true = a * math.sqrt(float(np.mean(z[:, 0] ** 2)))
        miss = 0
        for _ in range(reps):
            g = rng.standard_normal((n, d))
            g[:, 0] += a * z[:, 0]
            head = headline(_site(z, g))
            miss += not head.low <= s_true <= head.high
        bad += _too_many(miss, reps)
        rows.append([a, reps, miss])
    return Outcome(2, bad, detail=f"misses {rows[0][2]}/{reps} (s = 0), {rows[1][2]}/{reps} (s > 0)")


@check("DECIDE", "thm-anytime-noise-test", "t11-mixture-identity", "symbolic")
def mixture_identity(ctx: Context) -> Outcome:
    """The closed form of the normal mixture and ``cosh x ≤ exp(x²/2)`` (coefficientwise)."""
    lam, s, m = sp.symbols("lambda S m", real=True)
    v, rho, a = sp.symbols("V rho a", positive=True)
    # completing the square: the exponent of prior × integrand is a Gaussian in λ centred at S/(ρ+V)
    exponent = lam * s - lam**2 * v / 2 - rho * lam**2 / 2
    square = -(rho + v) / 2 * (lam - s / (rho + v)) ** 2 + s**2 / (2 * (rho + v))
    bad = int(sp.simplify(sp.expand(exponent - square)) != 0)
    # ∫ e^{−a(λ−m)²/2} dλ = sqrt(2π/a), so the mixture is sqrt(ρ/2π) · sqrt(2π/(ρ+V)) · e^{S²/(2(ρ+V))}
    gauss = sp.integrate(sp.exp(-a * (lam - m) ** 2 / 2), (lam, -sp.oo, sp.oo))
    bad += int(sp.simplify(gauss - sp.sqrt(2 * sp.pi / a)) != 0)
    # x^{2k}/(2k)! ≤ x^{2k}/(2^k k!)  ⟺  2^k k! ≤ (2k)!
    terms = ctx.count(40, 12)
    bad += sum(2**k * math.factorial(k) > math.factorial(2 * k) for k in range(terms))
    return Outcome(1 + terms, bad, detail="∫ N(dλ; 0, 1/ρ) e^{λS−λ²V/2} = sqrt(ρ/(ρ+V)) e^{S²/(2(ρ+V))}")


@check("DECIDE", "thm-anytime-noise-test", "t11-anytime-level", "coverage")
def anytime_level(ctx: Context) -> Outcome:
    """Symmetric pure noise (Gaussian and Rademacher ``g``; ``z ≥ 0`` with a bias), streamed to 256 examples."""
    rng = ctx.rng("t11-anytime-level")
    reps = ctx.count(200, 30)
    laws = {"gaussian": lambda n: rng.standard_normal(n), "rademacher": lambda n: rng.choice([-1.0, 1.0], n)}
    bad, found = 0, []
    for name, law in laws.items():
        hits = 0
        for _ in range(reps):
            test = AnytimeNoiseTest(max_examples=256)
            while not test.done:
                z = np.abs(rng.standard_normal((32, 2)))
                test.update(np.c_[z, np.ones(32)], law(32)[:, None])
            hits += test.decided
        bad += _too_many(hits, reps)
        found.append(f"{name} {hits}/{reps}")
    return Outcome(len(laws), bad, detail="improvable under optional stopping: " + ", ".join(found))


def _fr(a) -> list[list[Fraction]]:
    return [[Fraction(float(x)) for x in row] for row in np.atleast_2d(a)]


def _exact_score2(feat: list[list[Fraction]], g: list[list[Fraction]]) -> Fraction:
    """``(1/n) Σ_i g_iᵀ Φ x`` with ``ΦᵀΦ x = Φᵀ g`` (Gauss–Jordan in rationals, dependent columns skipped)."""
    n, k, d = len(g), len(feat[0]), len(g[0])
    gram = [[sum((r[a] * r[b] for r in feat), Fraction(0)) for b in range(k)] for a in range(k)]
    rhs = [[sum((feat[i][a] * g[i][j] for i in range(n)), Fraction(0)) for j in range(d)] for a in range(k)]
    x = solve_rational(gram, rhs)
    return sum((rhs[a][j] * x[a][j] for a in range(k) for j in range(d)), Fraction(0)) / n


@check("DECIDE", "prop-beyond-training", "t11-beyond-exact", "numeric")
def beyond_exact(ctx: Context) -> Outcome:
    """Engine against exact rationals on random dyadic residual linear models, and the example of (4)."""
    rng = ctx.rng("t11-beyond-exact")
    cases, bad, worst = ctx.count(20, 4), 0, 0.0
    for _ in range(cases):
        n = 10
        psi = np.c_[rng.integers(-8, 9, size=(n, 2)) / 4.0, np.ones(n)]
        z_out = rng.integers(-8, 9, size=(n, 2)) / 4.0
        g = rng.integers(-8, 9, size=(n, 2)) / 4.0
        phi = np.c_[z_out, np.ones(n)]
        res = beyond_training(psi, phi, g)
        old = _exact_score2(_fr(psi), _fr(g))
        joint = _exact_score2([a + b for a, b in zip(_fr(psi), _fr(phi), strict=True)], _fr(g))
        beyond = joint - old  # Pythagoras, (1)
        for got, want in ((res.old.score**2, old), (res.joint.score**2, joint), (res.beyond.score**2, beyond)):
            dev = abs(got - float(want)) / max(1.0, float(want))
            worst = max(worst, dev)
            bad += dev > 1e-9
    # (4): ψ, φ unit vectors at 60°, g = φ − ψ cos θ: s_old = 0 < s_new = ‖g‖ sin θ < s_beyond = ‖g‖
    psi = np.array([[1.0], [0.0]]) * math.sqrt(2)
    phi = np.array([[0.5], [math.sqrt(3) / 2]]) * math.sqrt(2)
    g = phi - psi * 0.5
    res = beyond_training(psi, phi, g)
    new = float(np.abs(phi[:, 0] @ g[:, 0]) / 2 / math.sqrt(np.mean(phi[:, 0] ** 2)))
    bad += not (res.old.score < 1e-12 and res.beyond.score > new + 0.1)
    return Outcome(cases + 1, bad, detail=f"largest relative deviation {worst:.1e}; (4): s_new {new:.3f} < s_beyond")


@check("DECIDE", "prop-beyond-noise-test", "t11-beyond-noise", "coverage")
def beyond_noise(ctx: Context) -> Outcome:
    """``s_beyond = 0`` while the existing map is not stationary (``g = 1.5 x₁ + ε``, new feature ``x₂ + 0.8 x₁``)."""
    rng = ctx.rng("t11-beyond-noise")
    reps, n, hits = ctx.count(300, 40), 200, 0
    for _ in range(reps):
        x = rng.standard_normal((n, 2))
        res = beyond_training(
            np.c_[x[:, :1], np.ones(n)], x[:, 1:] + 0.8 * x[:, :1], 1.5 * x[:, :1] + rng.standard_normal((n, 1))
        )
        hits += res.beyond.verdict is Verdict.IMPROVABLE
    return Outcome(1, int(_too_many(hits, reps)), detail=f"improvable {hits}/{reps} at α = 0.05")
