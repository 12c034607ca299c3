"""T5: zero-output families (``thm-zero-output``) and the cross-gradient identity (``thm-cross-gradient``).

Claim (theory/definitions.md and the claims of theory/, T5): for ``h(u) = W φ_ψ(u) + c`` with the final linear map zero
at the origin, ``A(u)(δW, δc, δψ) = δW φ(u) + δc`` (zero ``ψ`` columns),
``b = vec(G)``, ``K = I_d ⊗ Σ``, ``s² = tr(G Σ⁺ Gᵀ)``; saturated ⇔ ``G = 0``.

Checks:

- ``t5-cross-gradient-symbolic`` (symbolic): the algebraic identity
  ``vec(G)ᵀ (I ⊗ Σ)⁻¹ vec(G) = tr(G Σ⁻¹ Gᵀ)`` for symbolic ``G``, ``Σ``; and for a small
  symbolic feature family ``φ_ψ(u) = (ψ₁u₁ + u₂, (u₁ − ψ₂)², u₁u₂)`` with bias on random
  rational finite measures: ``A = I ⊗ φ̃ᵀ`` (ordering ``θ = vec_row([W | c])``), zero
  ``ψ`` columns for symbolic ``ψ``, ``b = vec(G)``, ``K = I ⊗ Σ``, ``bᵀK⁺b = tr(GΣ⁺Gᵀ)``.
- ``t5-zero-output-symbolic`` (symbolic): rows of ``G`` lie in ``range Σ``
  (``G Σ⁺ Σ = G``), hence ``s = 0 ⇔ G = 0``; a symmetric measure (units ``±u``, odd
  ``g``, even features) has ``G = 0`` and ``s = 0`` with ``g ≠ 0``, a generic one
  ``G ≠ 0`` and ``s > 0``.
- ``t5-dense-reference`` (numeric): ``s`` and ``b`` from the streaming
  :class:`~depthsat_theory.statistics.FeatureStatistics` equal the dense Jacobian reference
  (:func:`depthsat_theory.engines.dense.dense_saturation`) on random MLP/CNN/GPT models for
  row and tensor (conv3×3, attention) families.
- ``t5-saturated-iff-G-zero`` (numeric): the exact constructions have ``G = 0`` and are
  saturated, random instances have ``G ≠ 0`` and ``s > tol``; in all of them
  ``s·√λ⁺_min(Σ) ≤ ‖G‖_F ≤ s·√λ_max(Σ)`` and the autograd gradient of the feature
  parameters (LayerNorm/Linear of ``preln``, q/k/v of attention, conv3×3) is exactly 0.
"""

from __future__ import annotations

import math

import numpy as np
import sympy as sp

from depthsat_theory.capture import SiteRecorder
from depthsat_theory.check import pool_family
from depthsat_theory.engines import dense_saturation
from depthsat_theory.families import FeatureFamily
from depthsat_theory.statistics import FeatureStatistics
from depthsat_theory.vocabulary import Layout

from ._registry import Context, Outcome, check
from .t1_gradient import draw_instances, fmt, insertion, lsq_task, odd_task, random_task, rat, rat_probs, sites_of

# ============================================================================ symbolic
u1, u2, psi1, psi2 = sp.symbols("u1 u2 psi1 psi2", real=True)
D, KF = 2, 3  # site width, number of features (k̃ = 4 with the bias)


def _features(psi=(psi1, psi2)):
    return sp.Matrix([psi[0] * u1 + u2, (u1 - psi[1]) ** 2, u1 * u2])


def _family_tangent():
    """``A(u)`` of ``h = Wφ_ψ(u) + c`` at ``W = 0, c = 0`` w.r.t. ``(vec_row([W|c]), ψ)``, symbolic ψ."""
    Wc = sp.Matrix(D, KF + 1, lambda i, j: sp.Symbol(f"w{i}{j}"))
    phit = _features().col_join(sp.Matrix([1]))
    h = Wc * phit
    theta = list(Wc)  # row-major: vec_row([W | c])
    jac = h.jacobian([*theta, psi1, psi2]).subs(dict.fromkeys(theta, 0))
    return jac, phit


def _identity_generic() -> bool:
    g = sp.Matrix(2, 2, sp.symbols("g11 g12 g21 g22"))
    a, b_, c = sp.symbols("a b c")
    sig = sp.Matrix([[a, b_], [b_, c]])
    vec = g.reshape(4, 1)  # row-major
    lhs = (vec.T * sp.kronecker_product(sp.eye(2), sig).inv() * vec)[0, 0]
    rhs = (g * sig.inv() * g.T).trace()
    return sp.simplify(lhs - rhs) == 0


def _measure(rng, n_units: int, symmetric: bool = False):
    """Units (rational), masses and (prob, g) draws; symmetric: units ±u with g(−u) = −g(u)."""
    units, masses, draws = [], [], []
    base = n_units // 2 if symmetric else n_units
    for _ in range(base):
        u = (rat(rng), rat(rng))
        w = sp.Rational(int(rng.integers(1, 4)), int(rng.integers(1, 3)))
        qs = rat_probs(rng, 2)
        gs = [(q, sp.Matrix([rat(rng), rat(rng)])) for q in qs]
        units.append(u)
        masses.append(w)
        draws.append(gs)
        if symmetric:
            units.append((-u[0], -u[1]))
            masses.append(w)
            draws.append([(q, -v) for q, v in gs])
    return units, masses, draws


def _cross_instance(rng, jac, phit, symmetric=False):
    """``(ok, G, s², Σ)`` for the polynomial family (or the even one when ``symmetric``)."""
    units, masses, draws = _measure(
        rng, int(rng.integers(2, 7)) if not symmetric else 2 * int(rng.integers(1, 4)), symmetric
    )
    psi0 = {psi1: rat(rng), psi2: rat(rng)}
    if symmetric:  # even features of u: (u1², u2², u1u2), bias
        feats = sp.Matrix([u1**2, u2**2, u1 * u2, 1])
        amap = sp.kronecker_product(sp.eye(D), feats.T)
    else:
        feats = phit.subs(psi0)
        amap = jac[:, : D * (KF + 1)].subs(psi0)
    k = feats.shape[0]
    p = D * k
    G, Sig, bvec, K = sp.zeros(D, k), sp.zeros(k, k), sp.zeros(p, 1), sp.zeros(p, p)
    for u, w, gs in zip(units, masses, draws, strict=False):
        at = {u1: u[0], u2: u[1]}
        ph = feats.subs(at)
        A = amap.subs(at)
        m = sum((q * v for q, v in gs), sp.zeros(D, 1))
        G += w * m * ph.T
        Sig += w * ph * ph.T
        bvec += w * A.T * m
        K += w * A.T * A
    ok = bvec == G.reshape(p, 1) and sp.kronecker_product(sp.eye(D), Sig) == K
    s2 = sp.nsimplify((bvec.T * K.pinv() * bvec)[0, 0])
    ok &= sp.simplify(s2 - (G * Sig.pinv() * G.T).trace()) == 0
    ok &= G * Sig.pinv() * Sig == G  # rows of G in range Σ ⇒ (s = 0 ⇔ G = 0)
    return bool(ok), G, s2


@check("T5", "thm-cross-gradient", "t5-cross-gradient-symbolic", "symbolic")
def cross_gradient_symbolic(ctx: Context) -> Outcome:
    """``b = vec G``, ``K = I⊗Σ``, ``s² = tr(GΣ⁺Gᵀ)``, zero ψ columns (exact)."""
    rng = ctx.rng("t5-cross-gradient-symbolic")
    jac, phit = _family_tangent()
    ok_struct = jac[:, D * (KF + 1) :] == sp.zeros(D, 2)
    ok_struct &= jac[:, : D * (KF + 1)] == sp.kronecker_product(sp.eye(D), phit.T)
    ok_gen = _identity_generic()
    n = ctx.count(10, 3)
    bad = 0
    for _ in range(n):
        ok, _G, _s2 = _cross_instance(rng, jac, phit)
        bad += not ok
    return Outcome(
        n + 2,
        bad + (not ok_struct) + (not ok_gen),
        detail=(
            f"φ_ψ = (ψ₁u₁+u₂, (u₁−ψ₂)², u₁u₂) + bias, d = 2: A = I⊗φ̃ᵀ and ∂h/∂ψ ≡ 0 for symbolic ψ; generic "
            f"vec(G)ᵀ(I⊗Σ)⁻¹vec(G) = tr(GΣ⁻¹Gᵀ); {n} rational measures (2–6 units, Σ often singular): "
            f"b = vec G, K = I⊗Σ, bᵀK⁺b = tr(GΣ⁺Gᵀ) exactly"
        ),
    )


@check("T5", "thm-zero-output", "t5-zero-output-symbolic", "symbolic")
def zero_output_symbolic(ctx: Context) -> Outcome:
    """``GΣ⁺Σ = G`` (so ``s = 0 ⇔ G = 0``); symmetric measure with even features: ``G = 0``, ``s = 0``, ``g ≠ 0``."""
    rng = ctx.rng("t5-zero-output-symbolic")
    jac, phit = _family_tangent()
    n = ctx.count(8, 2)
    bad = 0
    for i in range(n):
        symmetric = i % 2 == 1
        ok, G, s2 = _cross_instance(rng, jac, phit, symmetric=symmetric)
        if symmetric:
            ok &= sp.zeros(*G.shape) == G and s2 == 0
        else:
            ok &= (sp.zeros(*G.shape) == G) == (s2 == 0)
        bad += not ok
    return Outcome(
        n,
        bad,
        detail=(
            "rows of G in range Σ (GΣ⁺Σ = G) on every measure, so s² = tr(GΣ⁺Gᵀ) = 0 ⇔ G = 0; "
            f"{(n + 1) // 2} generic (G ≠ 0, s > 0), {n // 2} symmetric ±u, odd g, even "
            f"features: G = 0, s = 0 with g ≠ 0"
        ),
    )


# ============================================================================ numeric
def _probe(task, site):
    with SiteRecorder(task.model, [site]) as rec:
        losses = task.loss(task.model(task.inputs), task.targets)
        rec.backward(losses.sum())
    return rec.z[site], rec.g[site]


#: families compared with the dense reference (p = d·k̃ stays small at d ≤ 12)
DENSE_FAMILIES: dict[str, tuple[str, ...]] = {
    Layout.VECTOR: (
        "linear",
        "linear-nobias",
        "powers:2",
        "relu:16",
        "gelu:8",
        "tanh:8",
        "even:abs",
        "even:square",
        "preln:8",
    ),
    Layout.SEQUENCE: ("linear", "relu:16", "attention:8", "preln:8", "even:square"),
    Layout.IMAGE: ("conv1x1", "conv3x3:6", "relu:8", "even:abs"),
}
DENSE_RTOL = 1e-9


@check("T5", "thm-cross-gradient", "t5-dense-reference", "numeric")
def dense_reference(ctx: Context) -> Outcome:
    """Streaming cross-gradient ``s``, ``b`` = dense Jacobian least-squares reference."""
    rng = ctx.rng("t5-dense-reference")
    n = ctx.count(24, 4)
    bad = 0
    worst_s = worst_b = 0.0
    fams = set()
    for i in range(n):
        task = random_task(("mlp", "gpt", "cnn")[i % 3], int(rng.integers(1 << 30)))
        sites = sites_of(task)
        site = sites[int(rng.integers(len(sites)))]
        pool = DENSE_FAMILIES[task.layout]
        spec = pool[int(rng.integers(len(pool)))]
        fams.add(spec)
        fam = pool_family(spec)
        z, g = _probe(task, site)
        acc = _feature_stats(fam, z, g, task.layout)
        res = acc.result()
        ref = dense_saturation(fam, z, g, task.layout)
        ds = abs(res.score - ref.score) / max(ref.score, res.tol)
        db = float(np.abs(res.gradient - ref.gradient).max() / max(np.abs(ref.gradient).max(), 1e-300))
        worst_s, worst_b = max(worst_s, ds), max(worst_b, db)
        bad += not (ds <= DENSE_RTOL and db <= DENSE_RTOL and res.tangent_rank == ref.tangent_rank)
    return Outcome(
        n,
        bad,
        detail=(
            f"{len(fams)} families (row + conv3x3/attention tensor units): max |s−s_dense|/s = "
            f"{fmt(worst_s)}, max |b−b_dense|/|b| = {fmt(worst_b)} (tol {DENSE_RTOL:g}); "
            f"rank d·rank Σ = dense lstsq rank"
        ),
    )


def _feature_stats(fam, z, g, layout):
    acc = FeatureStatistics(fam, tuple(z.shape[1:]), layout)
    acc.update(z, g)
    return acc


def _g_bounds(ins) -> tuple[float, float, float, float]:
    """``(‖G̃‖_F, s·√λ̃⁺_min, s·√λ̃_max, rounding allowance)`` in the engine's diagonally scaled coordinates.

    The coordinates are ``G̃ = G D^{-1/2}``, ``Σ̃ = D^{-1/2} Σ D^{-1/2}``, ``D = diag Σ`` (``s`` is
    invariant); ``λ̃⁺_min`` is the smallest eigenvalue the engine keeps (``> rtol·λ̃_max``).
    """
    G, sig = ins.stats.cross_gradient(), ins.stats.feature_gram()
    diag = np.clip(np.diag(sig), 0.0, None)
    scale = np.where(diag > 0, 1.0 / np.sqrt(np.where(diag > 0, diag, 1.0)), 0.0)
    gs, ss = G * scale, sig * np.outer(scale, scale)
    lam = np.linalg.eigvalsh(0.5 * (ss + ss.T))
    lmax = max(float(lam.max()), 0.0)
    kept = lam[lam > ins.result.rtol * lmax]
    lmin = float(kept.min()) if kept.size else 0.0
    s = ins.result.score
    gn = float(np.linalg.norm(gs))
    return gn, s * math.sqrt(lmin), s * math.sqrt(lmax), ins.result.tol * math.sqrt(lmax) + 1e-9 * gn


@check("T5", "thm-zero-output", "t5-saturated-iff-G-zero", "numeric")
def saturated_iff_g_zero(ctx: Context) -> Outcome:
    """Saturated ⇔ ``G = 0``: exact constructions vs random instances; feature gradients vanish."""
    rng = ctx.rng("t5-saturated-iff-G-zero")
    cases = []
    task, sites = lsq_task(int(rng.integers(1 << 30)))
    cases += [(task, sites[0], "linear"), (task, sites[0], "linear-nobias")]
    otask, osites = odd_task(ctx.seed)
    cases += [(otask, s, f) for s in osites for f in ("even:abs", "even:square")][: ctx.count(6, 1)]
    draws = draw_instances(
        rng,
        ctx.count(14, 4),
        trained_kinds=("mlp", "gpt") if not ctx.quick else ("mlp",),
        exclude=("product:4", "product:2", "diag-general"),
    )
    cases += draws
    n_sat = n_imp = bad = 0
    worst_zero = 0.0
    feat = 0.0
    for task, site, spec in cases:
        ins = insertion(task, site, spec)
        assert isinstance(ins.family, FeatureFamily)
        gn, lo, hi, slack = _g_bounds(ins)
        feat = max(feat, ins.feature_grad_max)
        ok = lo - slack <= gn <= hi + slack and ins.feature_grad_max == 0.0
        if ins.result.saturated:
            n_sat += 1
            stats = ins.stats
            assert isinstance(stats, FeatureStatistics)  # a feature family's statistics
            g_norm = float(np.linalg.norm(stats.cross_gradient()))
            worst_zero = max(worst_zero, g_norm / max(ins.result.ag_rms, 1e-300))
        else:
            n_imp += 1
            ok &= gn > 0.0
        bad += not ok
    return Outcome(
        len(cases),
        bad,
        detail=(
            f"{n_sat} saturated (lsq readout, odd network): max ‖G‖_F/AG_rms = {fmt(worst_zero)}; {n_imp} improvable "
            f"(random/trained models): G ≠ 0; s√λ⁺min ≤ ‖G‖_F ≤ s√λmax (scaled Σ) in all; max |∂J/∂ψ| = {fmt(feat)}"
        ),
    )
