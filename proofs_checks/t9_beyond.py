"""Beyond the first-order criterion: kinks, finite steps, second order, several blocks.

Claims (theory/gradient.md, decrease.md, second-order.md, joint.md):

- ``t1-kink-tie`` (converse, ``thm-gradient``/``thm-directional``): ``relu(z) − relu(−z)`` at
  ``z = 0`` with a bias block: ``J(θ) = θ`` yet autograd's ``b`` is ``0``; the kink counter sees
  the ties, the one-sided derivative along ``−1`` is ``−1``.
- ``t9-decrease-exact`` (symbolic, ``prop-squared-error-exact``/``thm-guaranteed-decrease``/
  ``prop-decrease-upper``): on random rational finite measures with squared error at the output,
  the best decrease over ``T`` is exactly ``s²/2`` (sympy minimization), and both bounds hold with
  ``β = μ = 1``.
- ``t9-decrease-ce`` (numeric, ``lem-ce-smoothness``/``thm-guaranteed-decrease``/``prop-decrease-upper``):
  random linear cross-entropy heads: the dense Hessian (``torch.func.hessian``) is below
  ``½‖W‖₂²``; the step ``−Πg/β`` removes at least ``s²/(2β)``; random fields of norm ``r`` remove at
  most ``s r + β r²/2``; ``s`` from the numeric engine.
- ``t9-saddle-example`` (symbolic, ``thm-strict-saddle``): the exact example ``ex-saddle``.
- ``t9-saddle-dense`` (numeric, ``thm-strict-saddle``): the cross block streamed by
  :class:`~depthsat_theory.statistics.secondorder.CrossBlockStatistics` against the mixed Hessian
  ``∂²J/∂W∂ψ`` of the really inserted block (double backward), and its saddle score against a dense SVD.
- ``t9-saddle-converse`` (converse, ``thm-strict-saddle``): the engine calls ``ex-saddle``
  saturated, and the loss still decreases along the saddle direction.
- ``t9-joint`` (numeric, ``prop-joint``): two blocks inserted at once in random residual MLPs.
"""

from __future__ import annotations

import math
from typing import cast

import numpy as np
import sympy as sp
import torch
import torch.nn.functional as F
from torch import nn

from depthsat_theory.capture import accumulate
from depthsat_theory.capture.kinks import KinkCounter
from depthsat_theory.families import FeatureFamily, parse_family
from depthsat_theory.statistics import FeatureStatistics, statistics_for
from depthsat_theory.statistics.decrease import cross_entropy_smoothness, guaranteed_decrease
from depthsat_theory.statistics.secondorder import CrossBlockStatistics
from depthsat_theory.tasks import ResidualMLP, classification_loss

from ._registry import Context, Outcome, check

# ----------------------------------------------------------------------------- T1: kink ties


class _KinkNet(nn.Module):
    """``x ↦ z = 0·x`` (the site), then ``relu(z) − relu(−z)`` (identically ``z``)."""

    def __init__(self) -> None:
        super().__init__()
        self.site = nn.Identity()
        self.bias = nn.Parameter(torch.zeros(1, dtype=torch.float64))

    def forward(self, x):
        z = self.site(0 * x) + self.bias  # the bias block h_θ = θ at the site
        return torch.relu(z) - torch.relu(-z)


@check("T1", ("thm-gradient", "thm-directional"), "t1-kink-tie", "converse")
def kink_tie(ctx: Context) -> Outcome:
    """Autograd's b = 0 where J(θ) = θ (b = 1): the kink counter flags every example."""
    bad = 0
    sizes = [3, 7, 16][: ctx.count(3, 2)]
    for n in sizes:
        net = _KinkNet()
        x = torch.randn(n, 1, dtype=torch.float64, generator=ctx.torch_generator(f"kink{n}"))
        counter = KinkCounter(net, ["site"])
        with counter:
            loss = counter.wrap_loss(lambda out, _y: out.sum(1))(net(x), None).mean()
        (b,) = torch.autograd.grad(loss, net.bias)
        with torch.no_grad():
            eta = 1e-3
            net.bias.fill_(eta)
            up = float(net(x).mean()) / eta
            net.bias.fill_(-eta)
            down = float(net(x).mean()) / eta  # J'(0; −1) = lim (J(−η) − J(0))/η
            net.bias.zero_()
        bad += int(not (float(b) == 0.0 and abs(up - 1) < 1e-12 and abs(down + 1) < 1e-12))
        bad += int(counter.ties["site"] != 2 * n)  # both relus at their kink, every example
    return Outcome(
        len(sizes),
        bad,
        converse=f"{len(sizes)}/{len(sizes)} probes: J(θ) = θ, autograd b = 0 ('saturated'), ties counted",
        detail="J'(0; +1) = 1, J'(0; −1) = −1 by one-sided differences; ties = 2n",
    )


# ----------------------------------------------------------------------------- decrease


def _rational_measure(rng: np.random.Generator, n: int, d: int):
    units = [sp.Matrix([sp.Rational(int(v), 3) for v in rng.integers(-4, 5, d)]) for _ in range(n)]
    grads = [sp.Matrix([sp.Rational(int(v), 2) for v in rng.integers(-3, 4, d)]) for _ in range(n)]
    return units, grads


@check(
    "DEC",
    ("prop-squared-error-exact", "thm-guaranteed-decrease", "prop-decrease-upper"),
    "t9-decrease-exact",
    "symbolic",
)
def decrease_exact(ctx: Context) -> Outcome:
    """Exact minimization of ½ E‖g + Vφ̃‖² over V (sympy) against ½‖g‖² − s²/2 with s² = tr(GΣ⁺Gᵀ)."""
    rng = ctx.rng("decrease-exact")
    bad, count = 0, ctx.count(6, 3)
    for _ in range(count):
        n, d = int(rng.integers(3, 6)), int(rng.integers(1, 3))
        units, grads = _rational_measure(rng, n, d)
        phis = [u.col_join(sp.Matrix([1])) for u in units]
        w = sp.Rational(1, n)
        sigma = sum((p * p.T for p in phis), sp.zeros(d + 1, d + 1)) * w
        cross = sum((g * p.T for g, p in zip(grads, phis, strict=True)), sp.zeros(d, d + 1)) * w
        s2 = (cross * sigma.pinv() * cross.T).trace()
        vs = sp.Matrix(d, d + 1, lambda i, j: sp.Symbol(f"v{i}_{j}"))
        obj = sum((((g + vs * p).T * (g + vs * p))[0] for g, p in zip(grads, phis, strict=True)), sp.Integer(0)) * w / 2
        sol = sp.solve([sp.diff(obj, v) for v in vs], list(vs), dict=True)
        best = sp.nsimplify(obj.subs(sol[0]).subs(dict.fromkeys(vs, 0))) if sol else None
        j0 = obj.subs(dict.fromkeys(vs, 0))
        exact = best is not None and sp.simplify(j0 - best - s2 / 2) == 0
        # guaranteed step f = −Πg (β = 1) attains it; upper bound s r + r²/2 at r = s: s² + s²/2 ≥ s²/2
        bad += int(not exact)
    return Outcome(count, bad, detail="J(0) − min_T J = s²/2 exactly (rationals)")


def _ce_head(gen: torch.Generator, n: int, d: int, c: int):
    w = torch.randn(c, d, generator=gen, dtype=torch.float64)
    bias = torch.randn(c, generator=gen, dtype=torch.float64)
    z = torch.randn(n, d, generator=gen, dtype=torch.float64)
    y = torch.randint(0, c, (n,), generator=gen)
    return w, bias, z, y


def _ce_instance(gen: torch.Generator) -> tuple[int, float]:
    """One random linear CE head: (#violations, largest curvature / bound)."""
    n, d, c = 40, 4, 5
    w, bias, z, y = _ce_head(gen, n, d, c)
    beta = cross_entropy_smoothness(w)
    bad = 0
    h = torch.func.hessian(lambda zz: F.cross_entropy(zz @ w.T + bias, y, reduction="sum"))(z)
    blocks = torch.stack([h[i, :, i, :] for i in range(n)])
    worst = float(torch.linalg.eigvalsh(blocks).max()) / beta
    bad += int(worst > 1 + 1e-12)
    zz = z.clone().requires_grad_(True)
    loss = F.cross_entropy(zz @ w.T + bias, y, reduction="none")
    (g,) = torch.autograd.grad(loss.sum(), zz)
    stats = statistics_for(parse_family("linear"), (d,), "vector")
    stats.update(z, g)
    s = stats.result().score
    phi = torch.cat([z, torch.ones(n, 1, dtype=z.dtype)], 1)
    sig, cross = phi.T @ phi / n, g.T @ phi / n
    v_star = -cross @ torch.linalg.pinv(sig) / beta

    def objective(v):
        return float(F.cross_entropy((z + phi @ v.T) @ w.T + bias, y))

    j0 = objective(torch.zeros_like(v_star))
    bad += int(j0 - objective(v_star) < guaranteed_decrease(s, beta) - 1e-12)
    for _ in range(4):
        v = torch.randn(v_star.shape, generator=gen, dtype=torch.float64)
        r = float(torch.sqrt(((phi @ v.T) ** 2).sum(1).mean()))
        bad += int(j0 - objective(v) > s * r + beta * r * r / 2 + 1e-12)
    return bad, worst


@check(
    "DEC",
    ("lem-ce-smoothness", "thm-guaranteed-decrease", "prop-decrease-upper"),
    "t9-decrease-ce",
    "numeric",
)
def decrease_ce(ctx: Context) -> Outcome:
    """CE heads: curvature ≤ ½‖W‖², the step −Πg/β removes ≥ s²/(2β), no field removes more than sr + βr²/2."""
    gen = ctx.torch_generator("decrease-ce")
    count = ctx.count(12, 4)
    bad, worst = 0, 0.0
    for _ in range(count):
        b, w = _ce_instance(gen)
        bad, worst = bad + b, max(worst, w)
    return Outcome(count, bad, detail=f"largest per-unit curvature / (½‖W‖²) = {worst:.3f}")


# ----------------------------------------------------------------------------- second order

_U, _G = [1, 2, -1, -2], [2, -1, -1, 0]


@check("SO", "thm-strict-saddle", "t9-saddle-example", "symbolic")
def saddle_example(ctx: Context) -> Outcome:
    """ex-saddle: G = 0, C = 1/4, Hessian eigenvalues, J(t, −5t, 0) and σ = 1/√11, exactly."""
    w, beta, c, t = sp.symbols("w beta c t", real=True)
    quarter = sp.Rational(1, 4)
    # near the origin relu(u + β) = (u + β)·1{u > 0} on these units (no tie at u = 0)
    jfun = sum(quarter * (g + w * ((u + beta) if u > 0 else 0) + c) ** 2 / 2 for u, g in zip(_U, _G, strict=True))
    origin = {w: 0, beta: 0, c: 0}
    grad = [sp.diff(jfun, v).subs(origin) for v in (w, beta, c)]
    hess = sp.hessian(jfun, (w, beta, c)).subs(origin)
    eig = sorted(float(sp.re(sp.N(e))) for e in hess.eigenvals())
    series = sp.series(jfun.subs({w: t, beta: -5 * t, c: 0}), t, 0, 3).removeO()
    sigma = sp.Matrix([[sp.Rational(5, 4), sp.Rational(3, 4)], [sp.Rational(3, 4), 1]])
    saddle = hess[0, 1] * sp.sqrt(sigma.inv()[0, 0])
    checks = [
        grad == [0, 0, 0],
        hess[0, 1] == quarter and hess[1, 1] == 0,
        np.allclose(eig, [-0.0775836, 0.4229619, 1.9046218], atol=1e-6),
        sp.simplify(series - (sp.Rational(3, 4) - sp.Rational(5, 8) * t**2)) == 0,
        sp.simplify(saddle - 1 / sp.sqrt(11)) == 0,
        _symbolic_engine_saddle() == (sp.Rational(1, 4), 1 / sp.sqrt(11)),
    ]
    return Outcome(len(checks), sum(not ok for ok in checks), detail=f"Hessian eigenvalues {np.round(eig, 4).tolist()}")


def _symbolic_engine_saddle() -> tuple:
    """The symbolic engine's (C, σ) on ex-saddle (family ``t1*relu(u + t2) + t3``)."""
    from depthsat_theory.engines.symbolic import SymbolicFamily, saddle
    from depthsat_theory.engines.symbolic.measures import FiniteMeasure

    fam = SymbolicFamily.parse("t1*relu(u + t2) + t3")
    m = sp.interpolate(list(zip(_U, _G, strict=True)), fam.units[0])
    res = saddle(fam, FiniteMeasure(_U), m)
    return res.cross_block[0, 0], sp.nsimplify(res.saddle_score)


def _example_cross_stats() -> CrossBlockStatistics:
    """The numeric engine's cross block on ex-saddle (feature relu(u + β), a = 1, β = 0)."""
    stats = CrossBlockStatistics(cast(FeatureFamily, parse_family("relu:1")), (1,), "vector")
    stats.weight = torch.ones(1, 1, dtype=torch.float64)
    stats.bias = torch.zeros(1, dtype=torch.float64)
    z = torch.tensor(_U, dtype=torch.float64).reshape(4, 1)
    g = torch.tensor(_G, dtype=torch.float64).reshape(4, 1)
    stats.update(z, g)
    return stats


@check("SO", "thm-strict-saddle", "t9-saddle-converse", "converse")
def saddle_converse(ctx: Context) -> Outcome:
    """ex-saddle is saturated for the engine (s = 0), yet J(t, −5t, 0) < J(0) for small t."""
    z = torch.tensor(_U, dtype=torch.float64).reshape(4, 1)
    g = torch.tensor(_G, dtype=torch.float64).reshape(4, 1)
    first = _example_first_order(z, g)
    drops = [_example_loss(t, -5 * t) < 0.75 for t in (1e-3, 1e-2, 5e-2)]
    sigma = _example_cross_stats().result().saddle_score
    ok = first < 1e-15 and all(drops) and abs(sigma - 11**-0.5) < 1e-12
    return Outcome(
        1,
        int(not ok),
        converse="first-order saturated (G = 0) yet J(t, −5t, 0) < J(0) at t = 1e-3, 1e-2, 5e-2",
        detail=f"‖G‖ = {first:.1e}, saddle score {sigma:.6f} (1/√11 = {11**-0.5:.6f})",
    )


def _example_first_order(z: torch.Tensor, g: torch.Tensor) -> float:
    phi = torch.cat([torch.relu(z), torch.ones_like(z)], 1)
    return float((g.T @ phi / 4).norm())


def _example_loss(w: float, beta: float) -> float:
    u = torch.tensor(_U, dtype=torch.float64)
    g = torch.tensor(_G, dtype=torch.float64)
    return float(((g + w * torch.relu(u + beta)) ** 2).mean() / 2)


def _dense_cross_block(z, g, weight, bias) -> torch.Tensor:
    """``∂²J/∂W∂ψ`` at W = 0 by double backward of ``J = E ⟨g, W φ_ψ(u)⟩`` (``(d, K) × (K, d+1)``)."""
    n, d = z.shape
    k = weight.shape[0]
    wt = torch.zeros(d, k, dtype=torch.float64, requires_grad=True)
    a = weight.clone().requires_grad_(True)
    b = bias.clone().requires_grad_(True)
    jv = ((g * (torch.relu(z @ a.T + b) @ wt.T)).sum()) / n  # the linear-in-g part of J (exact at W = 0)
    (gw,) = torch.autograd.grad(jv, wt, create_graph=True)
    rows = []
    for i in range(d):
        for j in range(k):
            da, db = torch.autograd.grad(gw[i, j], (a, b), retain_graph=True)
            rows.append(torch.cat([da[j], db[j : j + 1]]))  # only feature j's parameters move column j
    return torch.stack(rows).reshape(d, k, d + 1).permute(1, 0, 2)


@check("SO", "thm-strict-saddle", "t9-saddle-dense", "numeric")
def saddle_dense(ctx: Context) -> Outcome:
    """Streamed cross block = mixed Hessian of the inserted block; saddle score = dense SVD."""
    gen = ctx.torch_generator("saddle-dense")
    count, bad, dev = ctx.count(6, 2), 0, 0.0
    for _ in range(count):
        n, d, k = 30, 3, 4
        z = torch.randn(n, d, generator=gen, dtype=torch.float64)
        g = torch.randn(n, d, generator=gen, dtype=torch.float64)
        stats = CrossBlockStatistics(cast(FeatureFamily, parse_family(f"relu:{k}")), (d,), "vector")
        stats.update(z, g)
        dense = _dense_cross_block(z, g, stats.weight, stats.bias)
        dev = max(dev, float((dense - torch.from_numpy(stats.cross_block())).abs().max()))
        # dense saddle score: the (d·k̃) × (k·(d+1)) matrix of δψ ↦ vec(δG Σ^{+1/2})
        sig = stats.feature_gram()
        w_, v_ = np.linalg.eigh(sig)
        half = (v_ / np.sqrt(w_)) @ v_.T
        blocks = stats.cross_block()
        mat = np.zeros((d, k + 1, k, d + 1))
        for j in range(k):
            mat[:, :, j, :] = np.einsum("de,m->dme", blocks[j], half[j])
        dense_sigma = np.linalg.norm(mat.reshape(d * (k + 1), k * (d + 1)), 2)
        stream_sigma = stats.result().saddle_score
        bad += int(abs(float(dense_sigma) - stream_sigma) > 1e-9 * max(1.0, float(dense_sigma)))
    bad += int(dev > 1e-12)
    return Outcome(count, bad, detail=f"max |C_stream − C_dense| = {dev:.1e}")


# ----------------------------------------------------------------------------- several blocks


def _joint_instance(gen: torch.Generator, ctx_seed: int) -> tuple[int, float]:
    torch.manual_seed(ctx_seed)
    model = ResidualMLP(in_dim=6, width=5, depth=2, n_classes=3).to(torch.float64).eval()
    x = torch.randn(24, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (24,), generator=gen)
    sites = ["blocks.0", "blocks.1"]
    fam = parse_family("linear")
    stats = {s: statistics_for(fam, (5,), "vector") for s in sites}
    accumulate(model, sites, [(x, y)], classification_loss, stats)
    res = {s: stats[s].result() for s in sites}
    params = {s: torch.zeros(5, 6, dtype=torch.float64, requires_grad=True) for s in sites}
    handles = [
        model.get_submodule(s).register_forward_hook(
            lambda _m, _a, out, s=s: (
                out + torch.cat([out, torch.ones(out.shape[0], 1, dtype=out.dtype)], 1) @ params[s].T
            )
        )
        for s in sites
    ]
    try:
        loss = classification_loss(model(x), y).mean()
        grads = torch.autograd.grad(loss, [params[s] for s in sites], create_graph=True)
        weights = torch.randn(grads[1].shape, generator=gen, dtype=torch.float64)  # (1ᵀg = 0 before a LayerNorm)
        mixed = torch.autograd.grad((grads[1] * weights).sum(), params[sites[0]])[0]
    finally:
        for h in handles:
            h.remove()
    bad = 0
    for s, gr in zip(sites, grads, strict=True):
        vec = torch.cat([gr[:, :-1].reshape(-1), gr[:, -1]]).detach().numpy()  # (vec_row(W), c)
        bad += int(not np.allclose(vec, res[s].gradient, atol=1e-12))
    # joint score over the block-diagonal Gram, from the joint gradient directly
    joint2 = 0.0
    for s, gr in zip(sites, grads, strict=True):
        sig = np.asarray(cast(FeatureStatistics, stats[s]).feature_gram(), dtype=np.float64)
        gm = gr.detach().numpy()
        joint2 += float(np.trace(gm @ np.linalg.pinv(sig) @ gm.T))
    target = float(np.sqrt(sum(r.score**2 for r in res.values())))
    bad += int(abs(np.sqrt(joint2) - target) > 1e-9 * max(1.0, target))
    return bad, float(mixed.abs().max())


@check("JOINT", "prop-joint", "t9-joint", "numeric")
def joint(ctx: Context) -> Outcome:
    """Two blocks at once: gradient = concatenation, joint score = (Σ s²)^½, cross-site Hessian ≠ 0."""
    gen = ctx.torch_generator("joint")
    count, bad, cross = ctx.count(6, 2), 0, []
    for i in range(count):
        b, m = _joint_instance(gen, int(ctx.rng(f"joint{i}").integers(2**31)))
        bad += b
        cross.append(m)
    bad += int(min(cross) == 0.0)  # (5): the cross-site second-order term does not vanish
    return Outcome(count, bad, detail=f"smallest max |∂²J/∂θ₁∂θ₂| = {min(cross):.2e} (nonzero)")


# ----------------------------------------------------------------------------- peers


@check("PEER", "prop-gromo-decrease", "t9-gromo-identity", "symbolic")
def gromo_identity(ctx: Context) -> Outcome:
    """tr(Mᵀ S⁺ M) with GroMo's S = E[x̃x̃ᵀ], M = E[x̃ gᵀ] equals tr(G Σ⁺ Gᵀ) (exact rationals, singular S too)."""
    rng = ctx.rng("gromo-identity")
    count, bad = ctx.count(6, 3), 0
    for i in range(count):
        n, d = int(rng.integers(2, 6)), int(rng.integers(1, 3))
        units, grads = _rational_measure(rng, n, d)
        if i % 2:  # a repeated unit makes S singular for small n
            units[-1] = units[0]
        xt = [u.col_join(sp.Matrix([1])) for u in units]
        w = sp.Rational(1, n)
        s_mat = sum((x * x.T for x in xt), sp.zeros(d + 1, d + 1)) * w
        m_mat = sum((x * g.T for x, g in zip(xt, grads, strict=True)), sp.zeros(d + 1, d)) * w
        gromo = (m_mat.T * s_mat.pinv() * m_mat).trace()
        cross = m_mat.T  # G = E[g φ̃ᵀ]
        ours = (cross * s_mat.pinv() * cross.T).trace()
        bad += int(sp.simplify(gromo - ours) != 0)
    return Outcome(count, bad, detail="GroMo's parameter_update_decrease = s² (linear family), exactly")


# ----------------------------------------------------------------------------- cross-fitted r, ρ


@check("T6", "thm-crossfit-raw-score", "t9-crossfit-identity", "symbolic")
def crossfit_identity(ctx: Context) -> Outcome:
    """E[2⟨g, f(u)⟩ − ‖f(u)‖²] = ‖m‖² − ‖m − f‖² for any f of the unit (finite rational measures)."""
    rng = ctx.rng("crossfit-identity")
    count, bad = ctx.count(8, 4), 0
    for _ in range(count):
        n_units, reps = int(rng.integers(2, 4)), int(rng.integers(2, 4))
        units = [sp.Rational(int(v), 2) for v in rng.integers(-3, 4, n_units)]
        grads = {u: [sp.Rational(int(v), 3) for v in rng.integers(-4, 5, reps)] for u in units}
        f = {u: sp.Rational(int(rng.integers(-5, 6)), 4) for u in units}
        w = sp.Rational(1, n_units * reps)
        m = {u: sum(grads[u]) / reps for u in units}
        lhs = sum(w * (2 * gi * f[u] - f[u] ** 2) for u in units for gi in grads[u])
        rhs = sum(w * reps * (m[u] ** 2 - (m[u] - f[u]) ** 2) for u in units)
        bad += int(sp.simplify(lhs - rhs) != 0)
    return Outcome(count, bad, detail="bias of the orthogonalised moment is −‖m̂ − m‖², exactly")


@check("T6", "thm-crossfit-raw-score", "t9-crossfit-populations", "numeric")
def crossfit_populations(ctx: Context) -> Outcome:
    """Populations with known r, ρ (linear family with bias, u ~ N(0, 1)): cross-fit vs truth within 5 SE."""
    from depthsat_theory.statistics.realizability import crossfit_realizability

    rng = ctx.rng("crossfit-populations")
    n = ctx.count(8000, 3000)
    # (m(u), r², ρ): m = u² has Πm = 1, r² = E u⁴ = 3, ρ = sqrt(2/3); m = 2u + 1 ∈ T: r² = 5, ρ = 0
    cases = [(lambda u: u**2, 3.0, math.sqrt(2 / 3)), (lambda u: 2 * u + 1, 5.0, 0.0)]
    bad, worst = 0, 0.0
    for fn, r2, rho in cases:
        u = rng.standard_normal((n, 1))
        g = fn(u) + rng.standard_normal((n, 1))
        stats = statistics_for(parse_family("linear"), (1,), "vector")
        stats.update(torch.from_numpy(u), torch.from_numpy(g))
        est = crossfit_realizability(u, g, score_squared=stats.result().score_squared_unbiased)
        dev = abs(est.raw_score_squared - r2) / est.standard_error
        worst = max(worst, dev)
        bad += int(dev > 5 or abs(est.realizability_defect - rho) > 0.15)
    return Outcome(len(cases), bad, detail=f"n = {n}: largest |r̂² − r²| / SE = {worst:.2f}")
