"""T7: finite-sample bounds for the saturation score (``theory/finite-sample.md``).

Claim (theory label thm-finite-sample): on an i.i.d. probe of ``n`` examples, ``ŝ_n → s`` and the interval of
:func:`depthsat_theory.bounds.interval_from_moments` contains ``s`` with probability at
least ``1 − δ`` (``thm-finite-sample``), which gives the certificates
``cor-certified-improvable`` and ``cor-certified-saturated``; the ``AG_rms`` upper bound
``cor-agmax-certificate-finite`` covers the population ``AG_rms ≥ s``; the checkpoint
intervals of :class:`~depthsat_theory.bounds.SequentialCertifier` hold simultaneously
(``thm-sequential``).

Populations are *finite*, so the exact ``s`` (and the exact essential suprema ``γ``,
``L``: population maxima) are computed by enumeration, and probes are drawn i.i.d. with
replacement from them (a probe is a vector of multinomial counts, so its moments are
weighted sums over the population and the cost does not grow with ``n``):

- ``digits/<site>/<family>``: all 1,797 scikit-learn digits through the trained residual
  MLP (``trained_task('mlp', seed=0)``), per-example ``(z, g)`` at sites ``blocks.0`` and
  ``blocks.2`` with the ``linear`` and ``relu:64`` families, plus a ridge score ``s_λ``;
- ``synthetic s=0``: ``g`` is the least-squares residual of a nonlinear field on ``φ̃``
  over the population, so ``G = 0`` and ``s = 0`` exactly (``≈ 1e-16`` in float64);
- ``synthetic s>0``: ``g`` = a nonlinear signal plus noise.

Counting rule (all coverage checks): with ``R`` probes per cell, a cell counts as a
counterexample only when its empirical coverage is below ``1 − δ − 3·SE`` with the
binomial standard error ``SE = √(δ(1 − δ)/R)``.  ``δ = 0.1`` throughout.

Checks:

- ``t7-coverage`` (coverage): coverage of the interval with the exact population constants
  for every population and size; also reported: the share of non-vacuous intervals and of
  each certificate, the coverage with constants estimated from the probe (plug-in, not a
  guarantee), the bootstrap interval's coverage (approximate, not a guarantee), the
  ``(1 − δ)`` quantile of ``|ŝ − s|``, its log–log slope against ``n`` (about ``−1/2``),
  and the looseness (median half-width of the bound over that quantile).
- ``t7-sequential`` (coverage): growing probes (``n`` doubling per checkpoint, levels
  ``δ_j = δ/(j(j+1))``): every checkpoint interval must contain ``s``; the decisions and
  stopping sizes are reported.
- ``t7-ag-certificate`` (coverage): the upper bound on ``AG_rms`` covers the population
  ``AG_rms`` (which bounds ``s``); the probe's ``AG_max`` is often below the population
  ``γ`` (it is a lower bound of the ess-sup, so it is not a certificate by itself).
- ``t7-ustatistic`` (numeric): on a tiny finite population, enumerating all ``N^n``
  ordered samples: the U-statistic with the population whitening is exactly unbiased for
  ``s²`` and ``E ŝ² = s² + (v − s²)/n``; Monte Carlo bias of ``ŝ²`` and of ``Û`` with the
  probe's own ``Σ̂`` on the populations above.
- ``t7-calculator`` (numeric): the sympy closed forms and the quartic root of the
  sample-size calculator against a numeric root-find of the bound.
- ``t7-assumptions-converse`` (converse): a rare huge gradient (``asm-bounded-gradient``
  fails for the probe's ``γ̂``), a rare large feature (``asm-leverage`` fails for the
  probe's ``L̂``) and an optimistic variance ``V = 0`` at ``s = 0`` (``asm-variance``
  fails) make the interval miss ``s`` far more often than ``δ``, while the interval with
  valid constants covers.
- ``t7-eb-ceiling`` (numeric): ``prop-eb-ceiling`` on every population: ``σ² ≥ Eℓ²/r₀``, and the
  worst-case ``Δ_n`` over the empirical-Bernstein ``max(Δ^∓(σ̃²))`` is at most ``√(L/σ²)`` for every
  size and ``σ̃² ∈ [σ², L]``; the non-vacuous sizes' ratio at ``σ̃² = L`` is at most 1.60.
- ``t7-ill-conditioned`` (coverage, ``prop-interval-resolution``): the population of
  :func:`ill_conditioned_draw` (exact ``s = 1`` or ``0``, ``γ = 1``, ``L = 3``, all the score along a direction at
  eigenvalue ratio ``≈ 10¹⁵``) through :func:`~depthsat_theory.bounds.interval_from_probe` with the true constants:
  coverage of ``s``, no "certified ε-saturated" at ``s = 1 > ε``; and a float32 probe whose small direction the
  verdict leaves unresolved gets the upper end ``γ``, never a saturation certificate.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.optimize import brentq

from depthsat_theory.bounds import (
    BoundError,
    ProbeMoments,
    SequentialCertifier,
    ag_rms_upper,
    bootstrap_interval,
    estimate,
    interval_from_moments,
    plan_bound,
    unbiased_score_squared,
)
from depthsat_theory.statistics import default_rtol
from depthsat_theory.vocabulary import Certificate

from ._registry import Context, Outcome, check

DELTA = 0.1
#: log–log slope of the (1 − δ) error quantile against n over the three largest sizes
SLOPE_RANGE = (-0.7, -0.3)


def _allowed(reps: int, delta: float = DELTA) -> float:
    """Smallest coverage that is not a counterexample: ``1 − δ − 3 √(δ(1−δ)/R)``."""
    return 1 - delta - 3 * math.sqrt(delta * (1 - delta) / reps)


# ============================================================================ populations
@dataclass
class Population:
    """A finite population of examples with its exact score and constants."""

    name: str
    phi: np.ndarray  # (N, k) augmented features
    g: np.ndarray  # (N, d) activation gradients
    ridge: float
    sizes: tuple[int, ...]
    s: float = 0.0
    gamma: float = 0.0
    lev: float = 0.0
    v: float = 0.0
    ag_rms: float = 0.0
    eps_sat: float = 0.0
    whitening: np.ndarray | None = field(default=None, repr=False)

    library_gap: float = 0.0

    def __post_init__(self):
        # the exact constants come from an independent dense computation (no library code)
        self.s, self.gamma, self.lev, self.v = exact_population(self.phi, self.g, self.ridge)
        full = ProbeMoments.from_arrays(self.phi, self.g)
        est = estimate(full, self.ridge)  # the library's view, kept only as a cross-check
        self.library_gap = max(
            abs(math.sqrt(est.s2) - self.s) / max(math.sqrt(full.g_sq), 1e-300),  # s ≤ AG_rms
            abs(est.lev_max - self.lev) / self.lev,
            abs(est.v_hat - self.v) / max(self.v, 1e-300),
        )
        self.ag_rms = math.sqrt(full.g_sq)
        self.whitening = est.inv
        # saturation target: a "certified ε-saturated" verdict is wrong exactly when s > ε
        self.eps_sat = 0.25 * self.ag_rms if self.s <= 1e-9 * self.ag_rms else 0.5 * self.s

    @property
    def N(self) -> int:
        """Population size, the number of examples (rows of ``phi`` and ``g``)."""
        return self.phi.shape[0]

    def design(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-example ``vec(φ̃φ̃ᵀ)``, ``vec(g φ̃ᵀ)`` and ``‖g‖² vec(φ̃φ̃ᵀ)``."""
        outer = np.einsum("ik,il->ikl", self.phi, self.phi).reshape(self.N, -1)
        gphi = np.einsum("id,ik->idk", self.g, self.phi).reshape(self.N, -1)
        gsq = (self.g**2).sum(1)
        return outer, gphi, outer * gsq[:, None]

    def moments(self, design, counts: np.ndarray) -> list[ProbeMoments]:
        """The :class:`ProbeMoments` of probes given as multinomial counts ``(R, N)``."""
        outer, gphi, qouter = design
        k, d = self.phi.shape[1], self.g.shape[1]
        n = counts.sum(1)
        wn = counts / n[:, None]
        sig = (wn @ outer).reshape(-1, k, k)
        cross = (wn @ gphi).reshape(-1, d, k)
        q = (wn @ qouter).reshape(-1, k, k)
        gsq = (self.g**2).sum(1)
        fsq = (self.phi**2).sum(1)
        live = counts > 0
        g_sq = wn @ gsq
        g_max = np.sqrt(np.where(live, gsq, 0.0).max(1))
        f_max = np.where(live, fsq, 0.0).max(1)
        rtol = default_rtol(torch.float64, k)
        return [
            ProbeMoments(
                n=int(n[r]),
                sigma=sig[r],
                cross=cross[r],
                q=q[r],
                g_sq=float(g_sq[r]),
                g_max=float(g_max[r]),
                feat_sq_max=float(f_max[r]),
                rtol=rtol,
            )
            for r in range(counts.shape[0])
        ]

    def draw(self, rng: np.random.Generator, n: int, reps: int) -> np.ndarray:
        """``reps`` i.i.d. probes of ``n`` examples drawn uniformly with replacement from the population.

        Returns:
            Multinomial counts, an int array of shape ``(reps, N)`` whose rows sum to ``n``.
        """
        return rng.multinomial(n, np.full(self.N, 1.0 / self.N), size=reps)


def exact_population(phi: np.ndarray, g: np.ndarray, ridge: float) -> tuple[float, float, float, float]:
    """``(s_λ, γ, L, v)`` of the uniform law on the rows, by dense numpy (shares no library code).

    ``λ = 0``: ``s² = ‖P g‖²/N`` with the least-squares projection ``P`` onto the columns of
    ``φ̃`` (``numpy.linalg.lstsq``) and the leverages ``ℓ_i = N ‖U_i‖²`` from the SVD of
    ``φ̃``; ``λ > 0``: ``s_λ² = tr(G (Σ + λI)⁻¹ Gᵀ)`` and ``ℓ_i = φ̃_iᵀ (Σ + λI)⁻¹ φ̃_i`` with
    ``numpy.linalg.solve``.  ``v = mean ‖g_i‖² ℓ_i`` (one unit per example).
    """
    n_pop = phi.shape[0]
    if ridge == 0:
        coef = np.linalg.lstsq(phi, g, rcond=None)[0]
        s2 = float(np.sum((phi @ coef) ** 2)) / n_pop
        u, sv, _ = np.linalg.svd(phi, full_matrices=False)
        keep = sv > sv.max() * max(phi.shape) * np.finfo(np.float64).eps
        lev = n_pop * np.sum(u[:, keep] ** 2, axis=1)
    else:
        a = phi.T @ phi / n_pop + ridge * np.eye(phi.shape[1])
        big_g = g.T @ phi / n_pop
        s2 = float(np.trace(big_g @ np.linalg.solve(a, big_g.T)))
        lev = np.sum(phi * np.linalg.solve(a, phi.T).T, axis=1)
    gsq = np.sum(g * g, axis=1)
    return math.sqrt(max(s2, 0.0)), float(np.sqrt(gsq.max())), float(lev.max()), float(np.mean(gsq * lev))


_CACHE: dict = {}


def _cache_dir() -> str:
    return os.environ.get("DEPTHSAT_CACHE") or str(Path.home() / ".cache" / "depthsat")


def _digits_populations() -> list[Population]:
    """Per-example (z, g) of all 1,797 digits through the trained residual MLP."""
    from depthsat_theory.capture import SiteRecorder
    from depthsat_theory.families import FeatureFamily, parse_family
    from depthsat_theory.tasks import load_digits, trained_task

    task = trained_task("mlp", seed=0, cache_dir=_cache_dir())
    x, y = load_digits(torch.float64)
    sites = ["blocks.0", "blocks.2"]
    with SiteRecorder(task.model, sites) as rec:
        losses = task.loss(task.model(x), y)
        rec.backward(losses.sum())
    sizes = (2000, 8000, 32000, 128000, 512000)
    pops = []
    for site in sites:
        z, g = rec.z[site], rec.g[site].numpy()
        for spec in ("linear", "relu:64"):
            fam = parse_family(spec)
            assert isinstance(fam, FeatureFamily)  # linear and relu:64 are feature families
            fmap = fam.frozen_feature_map(tuple(z.shape[1:]), "vector", dtype=torch.float64)
            with torch.no_grad():
                phi = fam.augmented_features(fmap, z).reshape(z.shape[0], -1).numpy()
            pops.append(Population(f"digits {site} {spec}", phi, g, 0.0, sizes))
            if site == "blocks.0" and spec == "relu:64":
                pops.append(Population(f"digits {site} {spec} ridge λ=0.03", phi, g, 0.03, sizes))
    return pops


def _synthetic_populations(rng: np.random.Generator) -> list[Population]:
    n_pop, d = 1000, 3
    z = rng.normal(size=(n_pop, d))
    phi = np.hstack([z, np.ones((n_pop, 1))])
    sizes = (250, 1000, 4000, 16000, 64000)
    raw = np.tanh(2 * z) + rng.normal(size=(n_pop, d))
    g0 = raw - phi @ np.linalg.lstsq(phi, raw, rcond=None)[0]  # G = 0: s = 0 exactly
    mix = rng.normal(size=(d, d))
    g1 = 0.3 * np.tanh(z @ mix.T) + rng.normal(size=(n_pop, d))
    return [Population("synthetic s=0", phi, g0, 0.0, sizes), Population("synthetic s>0", phi, g1, 0.0, sizes)]


def populations(ctx: Context) -> list[Population]:
    """All populations (cached per seed); the quick run keeps four of them."""
    key = ctx.seed
    if key not in _CACHE:
        _CACHE[key] = _synthetic_populations(ctx.rng("t7-synthetic")) + _digits_populations()
    pops = _CACHE[key]
    if ctx.quick:
        keep = ("synthetic s=0", "synthetic s>0", "digits blocks.0 linear", "digits blocks.0 relu:64 ridge λ=0.03")
        pops = [p for p in pops if p.name in keep]
    return pops


def _sizes(ctx: Context, pop: Population) -> tuple[int, ...]:
    return pop.sizes[::2] if ctx.quick else pop.sizes


def _fmt(x: float) -> str:
    return f"{x:.3g}"


# ============================================================================ coverage
@check("T7", ["thm-finite-sample", "cor-certified-improvable", "cor-certified-saturated"], "t7-coverage", "coverage")
def coverage(ctx: Context) -> Outcome:
    """Coverage, error decay and looseness of the (1 − δ) interval on finite populations."""
    reps = ctx.count(400, 100)
    boot_probes, boot_b = ctx.count(60, 20), ctx.count(100, 50)
    rng = ctx.rng("t7-coverage")
    rows, bad, cells = [], 0, 0
    floor = _allowed(reps)
    slopes = []
    for pop in populations(ctx):
        bad += pop.library_gap > 1e-6  # the library's population estimate against the dense one
        design = pop.design()
        qerr, sizes, first = [], _sizes(ctx, pop), True
        pop_rows = []
        for n in sizes:
            counts = pop.draw(rng, n, reps)
            cover = plug = nonvac = impr = sat = 0
            errs, halves = [], []
            for m in pop.moments(design, counts):
                it = interval_from_moments(
                    m, DELTA, ridge=pop.ridge, grad_max=pop.gamma, leverage_max=pop.lev, epsilon=pop.eps_sat
                )
                cover += it.score_lower <= pop.s <= it.score_upper
                nonvac += not it.vacuous
                impr += it.certificate == Certificate.IMPROVABLE
                sat += it.certificate == Certificate.SATURATED
                errs.append(abs(it.score - pop.s))
                halves.append(0.5 * (it.score_upper - it.score_lower))
                pi = interval_from_moments(m, DELTA, ridge=pop.ridge)  # constants from the probe
                plug += pi.score_lower <= pop.s <= pi.score_upper
            boot = ""
            if pop.name.startswith("synthetic") or (
                not ctx.quick and pop.name == "digits blocks.0 linear" and n == sizes[2]
            ):
                hits = 0
                for r in range(boot_probes):
                    mb = ProbeMoments.from_arrays(pop.phi, pop.g, counts[r], keep=True)
                    b = bootstrap_interval(mb, DELTA, resamples=boot_b, ridge=pop.ridge, seed=r)
                    hits += b["lower"] <= pop.s <= b["upper"]
                boot = _fmt(hits / boot_probes)
            q = float(np.quantile(errs, 1 - DELTA))
            qerr.append(q)
            cov = cover / reps
            cells += 1
            bad += cov < floor
            pop_rows.append(
                [
                    pop.name if first else "",
                    _fmt(pop.s) if first else "",
                    n,
                    reps,
                    _fmt(cov),
                    _fmt(nonvac / reps),
                    _fmt(impr / reps),
                    _fmt(sat / reps),
                    _fmt(plug / reps),
                    boot or "-",
                    _fmt(q),
                    _fmt(float(np.median(halves))),
                    _fmt(float(np.median(halves)) / q) if q > 0 else "-",
                    "",
                ]
            )
            first = False
        slope = float(np.polyfit(np.log(sizes), np.log(qerr), 1)[0])
        slope_tail = float(np.polyfit(np.log(sizes[-3:]), np.log(qerr[-3:]), 1)[0])
        slopes.append(slope_tail)
        bad += not SLOPE_RANGE[0] <= slope_tail <= SLOPE_RANGE[1]
        pop_rows[0][-1] = f"{slope:.2f} (last 3: {slope_tail:.2f})"
        rows.extend(pop_rows)
    cols = [
        "population",
        "s (exact)",
        "n",
        "probes",
        "coverage",
        "non-vacuous",
        "cert. improvable",
        "cert. ε-saturated",
        "plug-in cov.",
        "bootstrap cov.",
        f"q{int(100 * (1 - DELTA))} |ŝ−s|",
        "median half-width",
        "looseness",
        "log-log slope",
    ]
    title = (
        f"coverage of the (1−δ) interval, δ = {DELTA} (exact population constants); a cell fails "
        f"only if coverage < 1−δ−3·SE = {floor:.3f}; plug-in and bootstrap columns are not "
        f"guarantees; ε of the saturation verdict = AG_rms/4 (s = 0) or s/2 (s > 0)"
    )
    detail = (
        f"{cells} cells (population × n) × {reps} probes; min coverage allowed {floor:.3f}; "
        f"error-decay slopes over the 3 largest n: {', '.join(f'{s:.2f}' for s in slopes)} "
        f"(a slope outside [{SLOPE_RANGE[0]}, {SLOPE_RANGE[1]}] counts as a counterexample)"
    )
    return Outcome(instances=cells + len(slopes), counterexamples=int(bad), detail=detail, table=(title, cols, rows))


# ============================================================================ sequential
@check("T7", ["thm-sequential"], "t7-sequential", "coverage")
def sequential(ctx: Context) -> Outcome:
    """All checkpoint intervals of a growing probe contain s simultaneously (δ_j = δ/(j(j+1)))."""
    reps = ctx.count(300, 60)
    rng = ctx.rng("t7-sequential")
    floor = _allowed(reps)
    rows, bad = [], 0
    for pop in populations(ctx):
        design = pop.design()
        n0, n_last = pop.sizes[0] // 2, pop.sizes[-1]
        checkpoints = [n0]
        while checkpoints[-1] < n_last:
            checkpoints.append(2 * checkpoints[-1])
        counts = np.zeros((reps, pop.N), dtype=np.int64)
        certs = [
            SequentialCertifier(DELTA, epsilon=pop.eps_sat, ridge=pop.ridge, grad_max=pop.gamma, leverage_max=pop.lev)
            for _ in range(reps)
        ]
        prev = 0
        for n in checkpoints:
            counts += pop.draw(rng, n - prev, reps)
            prev = n
            for cert, m in zip(certs, pop.moments(design, counts), strict=True):
                cert.add_moments(m)
        cover = sum(all(h.score_lower <= pop.s <= h.score_upper for h in c.history) for c in certs)
        wrong = sum(
            (c.decision == Certificate.IMPROVABLE and pop.s == 0.0)
            or (c.decision == Certificate.SATURATED and pop.s > pop.eps_sat)
            for c in certs
        )
        impr = sum(c.decision == Certificate.IMPROVABLE for c in certs)
        sat = sum(c.decision == Certificate.SATURATED for c in certs)
        stops = [c.stopped_at for c in certs if c.stopped_at is not None]
        cov = cover / reps
        bad += cov < floor
        rows.append(
            [
                pop.name,
                _fmt(pop.s),
                f"{checkpoints[0]}…{checkpoints[-1]} ({len(checkpoints)})",
                reps,
                _fmt(cov),
                _fmt(impr / reps),
                _fmt(sat / reps),
                _fmt(wrong / reps),
                str(int(np.median(stops))) if stops else "-",
            ]
        )
    cols = [
        "population",
        "s (exact)",
        "checkpoints n (count)",
        "probes",
        "coverage (all checkpoints)",
        "stopped: improvable",
        "stopped: ε-saturated",
        "wrong decision",
        "median stopping n",
    ]
    title = (
        f"sequential (union-bound) intervals, δ = {DELTA}, δ_j = δ/(j(j+1)); a row fails only if coverage < {floor:.3f}"
    )
    return Outcome(
        instances=len(rows),
        counterexamples=int(bad),
        detail=f"{len(rows)} populations × {reps} growing probes; min coverage allowed {floor:.3f}",
        table=(title, cols, rows),
    )


# ============================================================================ AG certificate
@check("T7", ["cor-agmax-certificate-finite"], "t7-ag-certificate", "coverage")
def ag_certificate(ctx: Context) -> Outcome:
    """The (1 − δ) upper bound on AG_rms covers the population AG_rms ≥ s."""
    reps = ctx.count(400, 100)
    rng = ctx.rng("t7-ag")
    floor = _allowed(reps)
    bad = cells = 0
    below, total = 0, 0
    worst = 1.0
    for pop in populations(ctx):
        if pop.s > pop.ag_rms * (1 + 1e-12):
            bad += 1  # s ≤ AG_rms must hold exactly on the population
        gsq = (pop.g**2).sum(1)
        for n in _sizes(ctx, pop)[:3]:
            counts = pop.draw(rng, n, reps)
            rms = np.sqrt(counts @ gsq / n)
            gmax = np.sqrt(np.where(counts > 0, gsq, 0.0).max(1))
            hits = sum(ag_rms_upper(n, float(a), pop.gamma, DELTA) >= pop.ag_rms for a in rms)
            below += int((gmax < pop.gamma).sum())
            total += reps
            cov = hits / reps
            worst = min(worst, cov)
            cells += 1
            bad += cov < floor
    return Outcome(
        instances=cells,
        counterexamples=int(bad),
        converse=(
            f"probe AG_max < population γ in {below}/{total} probes: the probe's maximum "
            f"is a lower bound of the ess-sup, not a certificate by itself"
        ),
        detail=f"min coverage of the AG_rms upper bound {worst:.3f} (allowed ≥ {floor:.3f})",
    )


# ============================================================================ U-statistic and bias
@check("T7", ["thm-finite-sample", "rem-ustatistic"], "t7-ustatistic", "numeric")
def ustatistic(ctx: Context) -> Outcome:
    """Exact unbiasedness of the U-statistic by enumeration; Monte Carlo bias of ŝ² and Û."""
    import itertools

    rng = ctx.rng("t7-ustat")
    bad = inst = 0
    worst = 0.0
    for trial in range(ctx.count(6, 3)):
        n_pop, n = 5, 3
        phi = np.hstack([rng.normal(size=(n_pop, 2)), np.ones((n_pop, 1))])
        g = rng.normal(size=(n_pop, 2)) + (0.5 * phi[:, :2] if trial % 2 else 0.0)
        whole = ProbeMoments.from_arrays(phi, g)
        est = estimate(whole, 0.0)
        s2, v = est.s2, est.v_hat
        us: list[float] = []
        sq: list[float] = []
        for idx in itertools.product(range(n_pop), repeat=n):  # all N^n ordered i.i.d. samples
            w = np.bincount(idx, minlength=n_pop)
            m = ProbeMoments.from_arrays(phi, g, w, keep=False)
            us.append(unbiased_score_squared(m, whitening=est.inv))
            sq.append(float(np.sum((m.cross @ est.inv) * m.cross)))
        dev_u = abs(np.mean(us) - s2)
        dev_p = abs(np.mean(sq) - (s2 + (v - s2) / n))
        worst = max(worst, dev_u, dev_p)
        inst += 1
        bad += max(dev_u, dev_p) > 1e-10 * max(1.0, v)
    # Monte Carlo: bias of the plug-in ŝ² (≈ (v − s²)/n) and of Û with the probe's own Σ̂
    reps = ctx.count(400, 100)
    notes = []
    for pop in populations(ctx)[:2]:
        design = pop.design()
        n = pop.sizes[1]
        ms = pop.moments(design, pop.draw(rng, n, reps))
        s2p = np.array([estimate(m, 0.0, leverage=False).s2 for m in ms])
        ustats = np.array([unbiased_score_squared(m) for m in ms])
        se = float(ustats.std(ddof=1) / math.sqrt(reps))
        pred = (pop.v - pop.s**2) / n
        notes.append(
            f"{pop.name} n={n}: E ŝ²−s² = {s2p.mean() - pop.s**2:.3g} (predicted {pred:.3g}), "
            f"E Û−s² = {ustats.mean() - pop.s**2:.3g} ± {se:.2g}"
        )
        inst += 1
        if pop.s == 0.0 or pop.s < 1e-12:
            bad += abs(ustats.mean()) > 4 * se  # at s = 0 the U-statistic's bias is o(1/n)
    return Outcome(
        instances=inst,
        counterexamples=int(bad),
        detail=f"enumeration: max |E Û − s²|, |E ŝ² − s² − (v−s²)/n| = {worst:.2g}; " + "; ".join(notes),
    )


# ============================================================================ calculator
@check("T7", ["thm-finite-sample"], "t7-calculator", "numeric")
def calculator(ctx: Context) -> Outcome:
    """Sample-size calculator (sympy) vs a numeric root-find of the bound; round trips."""
    rng = ctx.rng("t7-calc")
    bad = inst = 0
    worst = 0.0
    for _ in range(ctx.count(40, 12)):
        kw = dict(
            grad_max=float(rng.uniform(0.1, 20)),
            leverage_max=float(rng.uniform(1, 500)),
            variance=float(rng.uniform(0.01, 50)),
            delta=float(rng.uniform(0.01, 0.3)),
            score_max=float(rng.uniform(0, 1)),
        )
        ok, rel = _calculator_instance(kw, float(rng.uniform(0.01, 1.0)))
        worst = max(worst, rel)
        inst += 1
        bad += not ok
    return Outcome(
        instances=inst,
        counterexamples=int(bad),
        detail=f"sympy quartic root vs brentq: max relative difference {worst:.2g}",
    )


def _calculator_instance(kw: dict, target: float) -> tuple[bool, float]:
    """Compare the calculator's n for ``target`` with brentq on an independently coded ``h``."""
    plan = plan_bound(epsilon=target, **kw)
    n_req = plan.n_required
    assert n_req is not None  # epsilon was given

    def h(n):
        return plan_bound(n=n, **kw).halfwidth

    lo = plan.n_nonvacuous
    hi = max(lo * 2, 10)
    while h(hi) > target:
        hi *= 2
    root = brentq(lambda x: _h_real(x, plan) - target, lo + 1e-9, hi, xtol=1e-9, rtol=1e-14)
    ok = h(n_req) <= target and (n_req == 1 or h(n_req - 1) > target) and math.ceil(root - 1e-6) == n_req
    root_e = brentq(lambda x: _eps_real(x, plan) - target, 1e-9, 1e15, xtol=1e-12, rtol=1e-14)
    ok = ok and math.ceil(root_e - 1e-6) == plan.n_epsilon_only
    return ok, abs(root - _n_real(plan)) / root


def _consts(plan):
    c = plan.constants
    d1 = plan.delta / plan.candidates / 2
    u1 = math.log(2 / d1)
    u2 = math.log(2 * c["dim"].value / d1)
    return c["variance"].value, c["whitened_max"].value, u1, max(c["leverage_max"].value, 1.0), u2


def _h_real(x, plan):
    var, r, u1, l1, u2 = _consts(plan)
    dev = math.sqrt(2 * l1 * u2 / x) + 2 * l1 * u2 / (3 * x)
    if dev >= 1:
        return math.inf
    return (math.sqrt(2 * var * u1 / x) + 2 * r * u1 / x + plan.score_max * dev) / math.sqrt(1 - dev)


def _eps_real(x, plan):
    var, r, u1, _, _ = _consts(plan)
    return math.sqrt(2 * var * u1 / x) + 2 * r * u1 / x


def _n_real(plan):
    from depthsat_theory.bounds import combined_required_n

    var, r, u1, l1, u2 = _consts(plan)
    return combined_required_n(plan.target, var, r, u1, l1, u2, plan.score_max)


# ============================================================================ converse
@check("T7", ["thm-finite-sample"], "t7-assumptions-converse", "converse")
def assumptions_converse(ctx: Context) -> Outcome:
    """Without a valid γ, L or V (probe maxima miss a rare example; V too small) the interval misses s."""
    reps = ctx.count(400, 100)
    rng = ctx.rng("t7-converse")
    floor = _allowed(reps)
    results: list[tuple[str, float, float]] = []
    n_pop, rare, n = 10000, 10, 100
    # (a) asm-bounded-gradient: g = M on 10 of 10,000 examples, 0 elsewhere; intercept-only family
    phi_a = np.ones((n_pop, 1))
    g_a = np.zeros((n_pop, 1))
    g_a[:rare] = 1000.0
    # (b) asm-leverage: scalar feature 1 (common) or 100 (rare), g = 1 on common, 0 on rare
    phi_b = np.ones((n_pop, 1))
    phi_b[:rare] = 100.0
    g_b = np.ones((n_pop, 1))
    g_b[:rare] = 0.0
    for name, phi, g in (
        ("rare huge gradient (γ̂ = probe AG_max)", phi_a, g_a),
        ("rare large feature (L̂ = probe leverage)", phi_b, g_b),
    ):
        pop = Population(name, phi, g, 0.0, (n,))
        ms = pop.moments(pop.design(), pop.draw(rng, n, reps))
        plug = true = 0
        for m in ms:
            a = interval_from_moments(m, DELTA)
            b = interval_from_moments(m, DELTA, grad_max=pop.gamma, leverage_max=pop.lev)
            plug += a.score_lower <= pop.s <= a.score_upper
            true += b.score_lower <= pop.s <= b.score_upper
        results.append((name, plug / reps, true / reps))
    # (c) asm-variance: an optimistic V = 0 at a saturated site gives false "improvable" verdicts
    pop0 = next(p for p in populations(ctx) if p.name == "synthetic s=0")
    ms = pop0.moments(pop0.design(), pop0.draw(rng, 16000, reps))
    plug = true = 0
    for m in ms:
        a = interval_from_moments(m, DELTA, grad_max=pop0.gamma, leverage_max=pop0.lev, variance=0.0)
        b = interval_from_moments(m, DELTA, grad_max=pop0.gamma, leverage_max=pop0.lev)
        plug += a.score_lower <= pop0.s <= a.score_upper
        true += b.score_lower <= pop0.s <= b.score_upper
    results.append(("V = 0 given at s = 0 (n = 16000)", plug / reps, true / reps))
    failed_as_expected = sum(p < floor for _, p, _ in results)
    covered_with_truth = all(t >= floor for _, _, t in results)
    conv = "; ".join(f"{nm}: coverage {p:.2f} without the assumption, {t:.2f} with it" for nm, p, t in results)
    return Outcome(
        instances=len(results),
        counterexamples=len(results) - failed_as_expected + (0 if covered_with_truth else 1),
        converse=conv,
        detail=f"n = {n} probes from populations of {n_pop} with {rare} rare examples",
    )


# ============================================================================ event level
def _two_point(p: Fraction, amp: Fraction, c: Fraction, b: Fraction) -> dict:
    """Exact (Fraction) constants of the law φ = 1, g = c w.p. 1 − p; φ = A, g = b w.p. p (k = d = 1)."""
    sig = (1 - p) + p * amp * amp
    big_g = (1 - p) * c + p * amp * b
    return {
        "sigma": sig,
        "s2": big_g * big_g / sig,
        "lev": max(Fraction(1), amp * amp) / sig,
        "v": ((1 - p) * c * c + p * amp * amp * b * b) / sig,
        "psi2": ((1 - p) + p * amp**4) / (sig * sig),  # σ² = E Ψ² (Ψ_x = φ²/Σ is a scalar)
        "gamma": max(abs(c), abs(b)),
    }


def _event_law(law: tuple, n: int, method: str) -> tuple[dict, int]:
    """Exact failure probabilities of each event and violations of each deterministic step.

    A probe from the two-point law is summarized by ``K ~ Bin(n, p)`` rare draws, so every
    probability is a finite sum; ``K`` with ``P(K) < 1e-16`` are charged to every event
    (their total mass is added to each failure probability).
    """
    from scipy.stats import binom

    p, amp, c, b = law
    ex = _two_point(p, amp, c, b)
    big_l, v, sig2 = float(ex["lev"]), float(ex["v"]), float(ex["psi2"])
    s = math.sqrt(float(ex["s2"]))
    root = math.sqrt(float(ex["sigma"]))
    r_w = float(ex["gamma"]) * math.sqrt(big_l)
    parts = 3 if method == "worst-case" else 4
    u1, u2, u4 = math.log(2 * parts / DELTA), math.log(2 * parts / DELTA), math.log(parts / DELTA)
    if method == "worst-case":
        dlo = dhi = math.sqrt(2 * max(big_l, 1) * u2 / n) + 2 * max(big_l, 1) * u2 / (3 * n)
    else:  # the one-sided deviations at the true σ² (the events are stated with it)
        dlo = math.sqrt(2 * sig2 * u2 / n) + 2 * u2 / (3 * n)
        dhi = math.sqrt(2 * sig2 * u2 / n) + 2 * big_l * u2 / (3 * n)
    e1_half = math.sqrt(2 * v * u1 / n) + 2 * r_w * u1 / n
    ks = np.arange(n + 1)
    pmf = binom.pmf(ks, n, float(p))
    live = pmf >= 1e-16
    tail = float(pmf[~live].sum())
    fail = {"E1": tail, "E2": tail, "E4": tail, "miss": tail}
    viol = 0
    a, gb = float(amp), float(b)
    mu = ((1 - float(p)) * float(c) + float(p) * a * gb) / root
    for k in ks[live]:
        pk = float(pmf[k])
        xi = ((n - k) * float(c) + k * a * gb) / (n * root)
        psi = ((n - k) + k * a * a) / (n * float(ex["sigma"]))
        zbar = ((n - k) + k * a**4) / (n * float(ex["sigma"]) ** 2)
        e1 = abs(xi - mu) <= e1_half
        e2 = -dlo <= psi - 1 <= dhi
        e4 = sig2 - zbar <= big_l * math.sqrt(2 * sig2 * u4 / n) + 2 * big_l**2 * u4 / (3 * n)
        fail["E1"] += pk * (not e1)
        fail["E2"] += pk * (not e2)
        fail["E4"] += pk * (not e4) * (method != "worst-case")
        m = ProbeMoments.from_arrays(np.array([[1.0], [a]]), np.array([[float(c)], [gb]]), np.array([n - k, k], float))
        try:
            it = interval_from_moments(
                m, DELTA, grad_max=float(ex["gamma"]), leverage_max=big_l, dim=1, matrix_bound=method
            )
        except BoundError:  # the probe's leverage contradicts L: allowed only off the matrix event
            viol += e2
            fail["miss"] += pk
            continue
        fail["miss"] += pk * (not it.score_lower <= s <= it.score_upper)
        if not (e1 and e2 and (e4 or method == "worst-case")):
            continue
        # the deterministic steps, given the events (with the interval's own ε_n, Δ)
        s_hat = abs(xi) / math.sqrt(psi)
        dev, eps = it.relative_deviation, it.epsilon_n
        slack = 1e-9 * max(1.0, s)
        viol += not (abs(abs(xi) - s) <= eps + slack)  # step 2 with V̄ ≥ v (step 5)
        viol += not (abs(s_hat - it.score) <= 1e-9 * max(1.0, s_hat))  # (1): ŝ = |ξ̄|/√Ψ̄
        viol += not (it.score_lower - slack <= s <= it.score_upper + slack)
        if dev < 1:
            viol += not (abs(s_hat - s) <= (eps + dev * s) / math.sqrt(1 - dev) + slack)
        if method != "worst-case":
            viol += not (sig2 <= it.constants["matrix_variance"].value * (1 + 1e-9))  # step D
            viol += not (zbar <= (1 + dhi) ** 2 * m_psi(m) * (1 + 1e-9))  # step C
    return fail, viol


def m_psi(m: ProbeMoments) -> float:
    """The probe's σ̂² (library) for step C."""
    return estimate(m, 0.0).psi_sq


@check("T7", ["thm-finite-sample", "thm-empirical-bernstein"], "t7-events", "numeric")
def events(ctx: Context) -> Outcome:
    """Each event of the proofs, and each deterministic step given them, on two-point laws (exact sums)."""
    laws = [
        (Fraction(1, 2), Fraction(3), Fraction(1), Fraction(-1)),
        (Fraction(1, 20), Fraction(4), Fraction(1), Fraction(0)),
        (Fraction(1, 200), Fraction(12), Fraction(1, 2), Fraction(-3)),
        (Fraction(1, 1000), Fraction(30), Fraction(1), Fraction(0)),  # the rare large feature
    ]
    sizes = (60, 400, 3000) if ctx.quick else (60, 400, 3000, 20000)
    rows, bad, inst = [], 0, 0
    share = {"worst-case": DELTA / 3, "empirical-bernstein": DELTA / 4}
    for law in laws:
        for n in sizes:
            for method in ("worst-case", "empirical-bernstein"):
                fail, viol = _event_law(law, n, method)
                inst += 1
                over = [e for e in ("E1", "E2", "E4") if fail[e] > share[method] * (1 + 1e-9)]
                bad += viol + len(over) + (fail["miss"] > DELTA)
                rows.append(
                    [
                        f"p={law[0]}, A={law[1]}, c={law[2]}, b={law[3]}",
                        n,
                        method,
                        f"{fail['E1'] / share[method]:.3f}",
                        f"{fail['E2'] / share[method]:.3f}",
                        f"{fail['E4'] / share[method]:.3f}" if method != "worst-case" else "-",
                        f"{fail['miss']:.2g}",
                        viol,
                    ]
                )
    cols = ["law", "n", "matrix step", "P(not E1)/δ_i", "P(not E2)/δ_i", "P(not E4)/δ_i", "P(miss)", "step violations"]
    title = (
        "event-level check on two-point laws (probes summarized by K ~ Bin(n, p); exact sums): each "
        f"event fails with probability ≤ its share δ_i of δ = {DELTA}, and given the events every "
        "deterministic step holds"
    )
    return Outcome(
        instances=inst,
        counterexamples=int(bad),
        detail=f"{inst} (law, n, step) cells; exact population constants in Fraction arithmetic",
        table=(title, cols, rows),
    )


# ============================================================================ empirical Bernstein vs worst case
def _nonvacuous_n(dev_of_n) -> int:
    """Smallest n with ``dev_of_n(n) < 1`` (the deviation decreases in n)."""
    hi = 1
    while dev_of_n(hi) >= 1:
        hi *= 2
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if dev_of_n(mid) < 1 else (mid, hi)
    return hi


@check("T7", ["thm-empirical-bernstein"], "t7-empirical-bernstein", "coverage")
def empirical_bernstein(ctx: Context) -> Outcome:
    """Δ and the smallest non-vacuous n, worst-case vs empirical-Bernstein step; coverage of the latter."""
    from depthsat_theory.bounds.terms import matrix_deviations, relative_deviation

    reps = ctx.count(60, 12)
    rng = ctx.rng("t7-eb")
    floor = _allowed(reps)
    rows, bad, cells = [], 0, 0
    for pop in populations(ctx):
        dim = float(pop.phi.shape[1]) if pop.ridge > 0 else float(min(pop.phi.shape[1], max(1, math.floor(pop.lev))))
        u_wc, u_eb = math.log(2 * dim / (DELTA / 3)), math.log(2 * dim / (DELTA / 4))
        n_wc = _nonvacuous_n(lambda n, lev=pop.lev, u=u_wc: relative_deviation(n, lev, u))
        n_eb = _nonvacuous_n(lambda n, lev=pop.lev, u=u_eb: matrix_deviations(n, lev, lev, u)[0])  # σ̄² ≤ L
        first = True
        for n in _sizes(ctx, pop):
            counts = pop.draw(rng, n, reps)
            cover, d_wc, d_eb, sig = 0, [], [], []
            for r in range(reps):
                m = ProbeMoments.from_arrays(pop.phi, pop.g, counts[r])
                kw: dict[str, Any] = dict(ridge=pop.ridge, grad_max=pop.gamma, leverage_max=pop.lev)
                eb = interval_from_moments(m, DELTA, matrix_bound="empirical-bernstein", **kw)
                d_wc.append(interval_from_moments(m, DELTA, **kw).relative_deviation)
                d_eb.append(eb.relative_deviation)
                sig.append(eb.constants["matrix_variance"].value)
                cover += eb.score_lower <= pop.s <= eb.score_upper
            cov = cover / reps
            cells += 1
            bad += cov < floor
            rows.append(
                [
                    pop.name if first else "",
                    _fmt(pop.lev) if first else "",
                    f"{n_wc} / {n_eb}" if first else "",
                    n,
                    _fmt(float(np.median(sig))),
                    _fmt(float(np.median(d_wc))),
                    _fmt(float(np.median(d_eb))),
                    _fmt(float(np.median(d_wc)) / float(np.median(d_eb))),
                    _fmt(cov),
                ]
            )
            first = False
    cols = [
        "population",
        "L",
        "non-vacuous n: worst-case / EB",
        "n",
        "median σ̄²",
        "median Δ worst-case",
        "median Δ EB (max of ∓)",
        "ratio",
        "EB coverage",
    ]
    title = (
        f"empirical-Bernstein matrix step (thm-empirical-bernstein) vs worst case, δ = {DELTA}; a cell "
        f"fails only if the EB coverage < {floor:.3f}; the EB non-vacuous n is for σ̄² = L (its largest value)"
    )
    return Outcome(
        instances=cells,
        counterexamples=int(bad),
        detail=f"{cells} cells × {reps} probes (rows kept: σ̂² needs them)",
        table=(title, cols, rows),
    )


# ============================================================================ ceiling of the empirical-Bernstein step
def _dev_wc(n: int, l1: float, u: float) -> float:
    """The worst-case ``Δ_n = √(2L₁u/n) + 2L₁u/(3n)`` (thm-finite-sample)."""
    return math.sqrt(2 * l1 * u / n) + 2 * l1 * u / (3 * n)


def _dev_eb(n: int, x: float, big_l: float, u: float) -> float:
    """``max(Δ^−(x), Δ^+(x))`` of thm-empirical-bernstein."""
    root = math.sqrt(2 * x * u / n)
    return max(root + 2 * u / (3 * n), root + 2 * big_l * u / (3 * n))


@check("T7", ["prop-eb-ceiling"], "t7-eb-ceiling", "numeric")
def eb_ceiling(ctx: Context) -> Outcome:
    """``σ² ≥ Eℓ²/r₀`` and ``Δ_n / max(Δ^∓(σ̃²)) ≤ √(L/σ²)`` on the T7 populations, exactly (dense numpy).

    For each population (one unit per example): the population ``σ² = λ_max(E Ψ²)`` with the
    population whitening, ``Eℓ``, ``Eℓ²``, ``r₀ = rank Σ``; for every size and ``σ̃² ∈ {σ², (σ² + L)/2, L}``
    the worst-case ``Δ_n`` over the empirical-Bernstein ``max(Δ^−, Δ^+)`` written out from the
    theorems (δ split in three and in four) must not exceed ``√(L/σ²) ≤ √(L r₀/Eℓ²)``; with
    ``σ̃² = L`` the non-vacuous sizes' ratio must not exceed 1.60. Reported: the library's ratio on
    one probe per size (its ``σ̄²`` comes from the probe).
    """
    rng = ctx.rng("t7-eb-ceiling")
    rows, bad, inst, tight = [], 0, 0, 0.0
    for pop in populations(ctx):
        phi, lam = pop.phi, pop.ridge
        n_pop, k = phi.shape
        sig = phi.T @ phi / n_pop
        ev = np.linalg.eigvalsh(sig)
        r0 = int((ev > 1e-12 * ev.max()).sum())
        inv = np.linalg.inv(sig + lam * np.eye(k)) if lam > 0 else np.linalg.pinv(sig, rcond=1e-12, hermitian=True)
        w, v = np.linalg.eigh(inv)
        rows_w = phi @ ((v * np.sqrt(np.clip(w, 0, None))) @ v.T)
        lev = (rows_w**2).sum(1)
        sig2 = float(np.linalg.eigvalsh((rows_w * lev[:, None]).T @ rows_w / n_pop).max())
        big_l, e_l, e_l2 = pop.lev, float(lev.mean()), float(np.mean(lev**2))
        inst += 1
        bad += sig2 < e_l2 / r0 * (1 - 1e-9)
        bad += lam == 0 and abs(e_l - r0) > 1e-8 * r0
        ceiling = math.sqrt(big_l / sig2)
        bad += ceiling > math.sqrt(big_l * r0 / e_l2) * (1 + 1e-9)
        dim = float(k) if lam > 0 else float(min(k, max(1, math.floor(big_l))))
        u, u_eb = math.log(2 * dim / (DELTA / 3)), math.log(2 * dim / (DELTA / 4))
        l1 = max(big_l, 1.0)

        for n in pop.sizes:
            for x in (sig2, 0.5 * (sig2 + big_l), big_l):
                inst += 1
                ratio = _dev_wc(n, l1, u) / _dev_eb(n, x, big_l, u_eb)
                tight = max(tight, ratio / ceiling)
                bad += ratio > ceiling * (1 + 1e-12)
        n_wc = _nonvacuous_n(lambda n, a=l1, b=u: _dev_wc(n, a, b))
        n_eb = _nonvacuous_n(lambda n, a=big_l, b=u_eb: math.sqrt(2 * a * b / n) + 2 * b / (3 * n))
        inst += 1
        bad += n_wc / n_eb > 1.60
        n = pop.sizes[-1]
        m = ProbeMoments.from_arrays(phi, pop.g, pop.draw(rng, n, 1)[0])
        kw: dict[str, Any] = dict(ridge=lam, grad_max=pop.gamma, leverage_max=big_l)
        lib = (
            interval_from_moments(m, DELTA, **kw).relative_deviation
            / interval_from_moments(m, DELTA, matrix_bound="empirical-bernstein", **kw).relative_deviation
        )
        rows.append(
            [
                pop.name,
                _fmt(e_l),
                _fmt(big_l),
                _fmt(e_l2),
                _fmt(sig2),
                _fmt(math.sqrt(big_l * u / (sig2 * u_eb))),
                _fmt(_dev_wc(n, l1, u) / _dev_eb(n, sig2, big_l, u_eb)),
                _fmt(lib),
                _fmt(n_wc / n_eb),
            ]
        )
    cols = [
        "population",
        "Eℓ",
        "L",
        "Eℓ²",
        "σ²",
        "ceiling √(Lu/(σ²u'))",
        "ratio, σ² exact, largest n",
        "ratio, library, largest n",
        "non-vacuous n ratio (σ̄² = L)",
    ]
    return Outcome(
        instances=inst,
        counterexamples=int(bad),
        detail=(
            f"{len(rows)} populations; Δ_n / max(Δ^∓) never above √(L/σ²) ≤ √(L r₀/Eℓ²) (prop-eb-ceiling); "
            f"largest ratio / √(L/σ²) = {tight:.3f}"
        ),
        table=(f"ceiling of the empirical-Bernstein matrix step (δ = {DELTA})", cols, rows),
    )


# ============================================================================ ill-conditioned populations
#: Relative amplitude of the small feature direction of :func:`ill_conditioned_draw` (eigenvalue ratio ≈ 10¹⁵).
ILL_EPS = 2.0**-24


def ill_conditioned_draw(
    n: int, seed: int, *, signal: bool = True, eps: float = ILL_EPS, dtype=np.float64
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` i.i.d. examples ``z = (t, t + ε w)``, ``g = (w, 0)`` (``signal``) or ``(u, 0)``; ``t, w, u`` Rademacher.

    For the linear family with a bias the features ``(z₁, z₂, 1)`` are an invertible linear map of ``(t, w, 1)``,
    whose population Gram is ``I``: ``g = (w, 0)`` lies in the tangent space, so ``s = ‖g‖ = 1``; ``(u, 0)`` is
    orthogonal to every feature, ``s = 0``; ``γ = 1`` and every leverage is ``t² + w² + 1 = 3`` (``L = 3``), exactly.
    ``ε`` is a power of two, so the stored values are exact.
    """
    rng = np.random.default_rng(seed)
    t, w, u = (rng.choice([-1.0, 1.0], n) for _ in range(3))
    z = np.stack([t, t + eps * w], 1).astype(dtype)
    g = np.stack([w if signal else u, np.zeros(n)], 1).astype(dtype)
    assert np.array_equal(z[:, 1].astype(np.float64) - z[:, 0], eps * w)
    return z, g


def ill_conditioned_interval(z: np.ndarray, g: np.ndarray, delta: float, epsilon: float):
    """The interval of ``interval_from_probe`` for the linear family with the exact ``γ = 1``, ``L = 3``."""
    from depthsat_theory.bounds.probe import interval_from_probe
    from depthsat_theory.families import parse_family

    return interval_from_probe(
        z, g, parse_family("linear"), delta=delta, epsilon=epsilon, grad_max=1.0, leverage_max=3.0, bootstrap=0
    )


@check("T7", ["prop-interval-resolution", "cor-certified-saturated"], "t7-ill-conditioned", "coverage")
def ill_conditioned(ctx: Context) -> Outcome:
    """Coverage and certificates on a population whose whole score lies along a direction at ratio ``≈ 10¹⁵``."""
    reps, n = ctx.count(100, 30), 1000
    floor = _allowed(reps)
    bad = 0
    rows = []
    for signal in (True, False):
        truth = 1.0 if signal else 0.0
        hits = saturated = 0
        for seed in range(reps):
            iv = ill_conditioned_interval(*ill_conditioned_draw(n, 5000 + seed, signal=signal), DELTA, 0.5)
            hits += iv.score_lower <= truth <= iv.score_upper
            saturated += iv.certificate is Certificate.SATURATED
        cov = hits / reps
        bad += cov < floor or (signal and saturated > (1 - floor) * reps)
        rows.append(f"s = {truth:g}: coverage {cov:.3f}, certified saturated {saturated}/{reps}")
    z, g = ill_conditioned_draw(2000, 7, eps=2.0**-22, dtype=np.float32)  # dropped by float32's data resolution
    iv = ill_conditioned_interval(z, g, DELTA, 0.5)
    bad += not (iv.score_upper >= 1.0 and iv.certificate is not Certificate.SATURATED)
    return Outcome(
        instances=2 * reps + 1,
        counterexamples=int(bad),
        detail="; ".join(rows) + f" (allowed ≥ {floor:.3f}); float32 unresolved: upper {iv.score_upper:.3g}",
    )
