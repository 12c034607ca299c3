"""T2: the iff theorem (``thm-iff``) and the variational form of ``s`` (``lem-variational``).

Claim (theory/iff.md, thm-iff): strict first-order decrease under a descent-compatible zero-state
update ⇔ ``Π m ≠ 0`` ⇔ ``b ≠ 0`` ⇔ ``s > 0``; if ``Π m = 0`` no direction has a
first-order change.

Checks:

- ``t2-variational`` (symbolic): on random rational finite measures (``K`` often
  singular), exactly: the Penrose conditions of ``K⁺``; ``b ∈ range K``; the
  Cauchy–Schwarz maximizer ``v* = K⁺ b`` attains ``bᵀv*/‖Av*‖ = sqrt(bᵀK⁺b)``;
  ``s² K − b bᵀ ⪰ 0`` (so no ``v`` does better: the sup equals ``s``); the Lagrange
  conditions ``b = s K v̂``, ``v̂ᵀ K v̂ = 1`` at ``v̂ = v*/s``; ``Π m = A K⁺ b`` satisfies
  the normal equations and ``‖Π m‖² = ‖Π g‖² = bᵀK⁺b``.
- ``t2-iff-checker`` (numeric): the theorem checker (:mod:`depthsat_theory.check`) on
  random instances of trained models and the exact saturated constructions: ``s > tol``
  ⇔ a Richardson-measured first-order slope ``−⟨b, P(b)⟩ < 0``.  Its models are trained
  with the run's seed (cached in ``$DEPTHSAT_CACHE``; a seed not in the cache trains
  them first, about a minute on one thread).
- ``t2-iff-random-models`` (numeric): the same instance machinery on small random
  (untrained) MLP/CNN/GPT models.
- ``t2-saturated-no-first-order`` (numeric): at the exact constructions (``s = 0``) the
  gradient ``b`` vanishes within rounding and no update has a first-order term
  (``ΔJ(η)/ΔJ(η/2) ≈ 4``, Richardson slope consistent with 0).
"""

from __future__ import annotations

import numpy as np
import sympy as sp

from depthsat_theory.check import CheckConfig, evaluate, run_check
from depthsat_theory.optimizers import DESCENT_COMPATIBLE, get_update

from ._registry import Context, Outcome, check
from .t1_gradient import draw_instances, fmt, insertion, lsq_task, odd_task, random_measure, weights_cache


# ============================================================================ symbolic
def _variational_instance(rng: np.random.Generator) -> tuple[bool, bool]:
    """Returns ``(ok, rank_deficient)``."""
    d, p = int(rng.integers(1, 3)), int(rng.integers(2, 5))
    rank = int(rng.integers(1, p)) if rng.random() < 0.6 else None
    fm = random_measure(rng, units=int(rng.integers(2, 5)), d=d, p=p, rank=rank, draws=2)
    K, b = fm.K, fm.b
    Kp = K.pinv()
    ok = K * Kp * K == K and Kp * K * Kp == Kp and K * Kp == (K * Kp).T
    ok &= K * Kp * b == b  # b ∈ range K
    s2 = sp.simplify((b.T * Kp * b)[0, 0])
    vstar = Kp * b
    # ‖A v*‖² = v*ᵀ K v* and bᵀ v* both equal s²: the ratio bᵀv*/‖Av*‖ is s
    ok &= sp.simplify((vstar.T * K * vstar)[0, 0] - s2) == 0
    ok &= sp.simplify((b.T * vstar)[0, 0] - s2) == 0
    # sup: (bᵀv)² ≤ s² vᵀKv for every v ⇔ s²K − bbᵀ ⪰ 0
    ok &= bool((s2 * K - b * b.T).is_positive_semidefinite)
    if s2 != 0:
        s = sp.sqrt(s2)
        vhat = vstar / s
        ok &= sp.simplify(b - s * K * vhat) == sp.zeros(p, 1)  # ∇(bᵀv) = λ ∇(vᵀKv), λ = s/2
        ok &= sp.simplify((vhat.T * K * vhat)[0, 0] - 1) == 0
    # Π m = A K⁺ E[Aᵀ m]: normal equations ⟨m − Π m, A e_j⟩ = 0 and ‖Π m‖² = s²; same for g
    ms = fm.ms()
    bm = sum((w * a.T * m for w, a, m in zip(fm.mu, fm.A, ms, strict=False)), sp.zeros(p, 1))
    ok &= bm == b
    pim = [a * (Kp * bm) for a in fm.A]
    for j in range(p):
        col = [a[:, j] for a in fm.A]
        ok &= fm.inner([m - q for m, q in zip(ms, pim, strict=False)], col) == 0
        resid_g = sum(
            (
                w * qq * (a[:, j].T * (v - a * vstar))[0, 0]
                for w, a, gs in zip(fm.mu, fm.A, fm.g, strict=False)
                for qq, v in gs
            ),
            sp.Integer(0),
        )
        ok &= sp.simplify(resid_g) == 0
    ok &= sp.simplify(fm.inner(pim, pim) - s2) == 0
    return bool(ok), rank is not None


@check("T2", "lem-variational", "t2-variational", "symbolic")
def variational(ctx: Context) -> Outcome:
    """``s = sqrt(bᵀK⁺b) = sup bᵀv/‖Av‖ = ‖Πm‖`` exactly on random rational finite measures."""
    rng = ctx.rng("t2-variational")
    n = ctx.count(16, 4)
    bad = deficient = 0
    for _ in range(n):
        ok, dfc = _variational_instance(rng)
        bad += not ok
        deficient += dfc
    return Outcome(
        n,
        bad,
        detail=f"{deficient}/{n} with singular K; Penrose, b∈range K, attainment by "
        f"v*=K⁺b, s²K−bbᵀ⪰0, Lagrange, normal equations: exact",
    )


# ============================================================================ numeric
def _summarize(records: list[dict]) -> str:
    imp = [r for r in records if r["agreement"] == "agree" and r["predicted_improvable"]]
    sat = [r for r in records if r["agreement"] == "agree" and not r["predicted_improvable"]]
    deg = sum(r["agreement"] == "degenerate" for r in records)
    und = sum(r["agreement"] == "undecided" for r in records)
    slope = max((abs(r["observed_slope"] - r["predicted_slope"]) / abs(r["predicted_slope"]) for r in imp), default=0.0)
    ratios = [r["ratio"] for r in sat if r["ratio"] == r["ratio"]]
    rtxt = f", ΔJ(η)/ΔJ(η/2) at saturated {min(ratios):.3g}–{max(ratios):.3g}" if ratios else ""
    return (
        f"{len(imp)} improvable (max |slope−(−⟨b,P(b)⟩)|/|⟨b,P(b)⟩| = {fmt(slope)}), {len(sat)} saturated"
        f"{rtxt}, {deg} degenerate, {und} undecided"
    )


@check("T2", "thm-iff", "t2-iff-checker", "numeric")
def iff_checker(ctx: Context) -> Outcome:
    """The theorem checker's random instances (trained models + exact constructions)."""
    cfg = CheckConfig(
        instances=ctx.count(60, 6),
        seed=ctx.seed,
        kinds=("mlp", "gpt", "cnn") if not ctx.quick else ("mlp",),
        construction_fraction=0.3,
        cnn_probe_size=32,
        cache_dir=weights_cache(),
    )
    rep = run_check(cfg)
    recs = rep["records"]
    return Outcome(
        rep["instances"],
        rep["counterexamples"],
        detail=f"depthsat.check (seed {ctx.seed}, {','.join(cfg.kinds)} + lsq/odd): " + _summarize(recs),
    )


@check("T2", "thm-iff", "t2-iff-random-models", "numeric")
def iff_random_models(ctx: Context) -> Outcome:
    """``s > tol`` ⇔ first-order decrease, on random untrained MLP/CNN/GPT models."""
    rng = ctx.rng("t2-iff-random-models")
    cfg = CheckConfig()
    draws = draw_instances(rng, ctx.count(24, 5), trained_kinds=())
    recs, bad = [], 0
    for task, site, spec in draws:
        ins = insertion(task, site, spec)
        name = DESCENT_COMPATIBLE[int(rng.integers(len(DESCENT_COMPATIBLE)))]
        ev = evaluate(ins, get_update(name), cfg)
        rec = dict(ev, predicted_improvable=bool(ins.result.score > ins.result.tol and not ins.result.degenerate))
        recs.append(rec)
        bad += ev["agreement"] == "counterexample"
    return Outcome(len(draws), bad, detail=_summarize(recs))


@check("T2", "thm-iff", "t2-saturated-no-first-order", "numeric")
def saturated_no_first_order(ctx: Context) -> Outcome:
    """At exactly saturated constructions ``b ≈ 0`` and no update moves ``J`` at first order."""
    rng = ctx.rng("t2-saturated-no-first-order")
    cfg = CheckConfig()
    cases = []
    for _ in range(ctx.count(2, 1)):
        task, sites = lsq_task(int(rng.integers(1 << 30)))
        cases += [(task, sites[0], f) for f in ("linear", "linear-nobias")]
    otask, osites = odd_task(ctx.seed)
    cases += [(otask, s, f) for s in osites for f in ("even:abs", "even:square")][: ctx.count(8, 2)]
    updates = DESCENT_COMPATIBLE if not ctx.quick else ("sgd", "adam", "signsgd")
    bad = 0
    ratios, bmax_rel, slope_rel = [], 0.0, 0.0
    for task, site, spec in cases:
        ins = insertion(task, site, spec)
        res = ins.result
        ok = res.saturated and not res.degenerate
        bmax = float(ins.b.abs().max())
        bmax_rel = max(bmax_rel, bmax / max(ins.tau, 1e-300))
        for name in updates:
            ev = evaluate(ins, get_update(name), cfg)
            ok &= ev["agreement"] == "agree"
            if ev["ratio"] == ev["ratio"]:
                ratios.append(ev["ratio"])
            scale = max(res.ag_rms * ins.a_norm, 1e-300)
            slope_rel = max(slope_rel, abs(ev["observed_slope"]) / scale)
        bad += not ok
    rt = f"{min(ratios):.3g}–{max(ratios):.3g}" if ratios else "n/a"
    return Outcome(
        len(cases),
        bad,
        detail=(
            f"lsq readout (linear, linear-nobias) + odd network (even features) × {len(updates)} updates: "
            f"max|b|/τ = {fmt(bmax_rel)}; ΔJ(η)/ΔJ(η/2) ∈ {rt} (4 = no first-order term); "
            f"max |slope|/(AG_rms·‖A‖) = {fmt(slope_rel)}"
        ),
    )
