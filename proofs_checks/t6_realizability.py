"""T6: signal realizability (``thm-realizability``) and the certificate chain (``cor-agmax-certificate``).

Claim (theory/realizability.md, thm-realizability): if ``m ∈ T`` then ``s = r``, so saturation ⇔ ``m = 0``. ``g = 0``
a.s. is always sufficient; it is necessary only under signal realizability; with label
noise at an optimum ``m = 0`` while ``AG_max > 0``. On one probe
``s ≤ r ≤ AG_rms ≤ AG_max``.

Checks:

- ``t6-realizable-symbolic`` (symbolic): random rational finite measures with
  ``m = A v₀ ∈ T`` (``g`` scattered around ``m`` with conditional mean zero): ``s² = r²``
  exactly; for generic ``m``: ``r² = s² + ‖m − Πm‖²`` (Pythagoras) and ``s < r``.
- ``t6-chain-symbolic`` (symbolic): ``s² ≤ r² ≤ AG_rms² ≤ AG_max²`` exactly on random
  finite laws of examples with several units each (intensity measure of units).
- ``t6-symbolic-engine`` (symbolic): the exact engine :mod:`depthsat_theory.engines.symbolic`
  reports ``s = r`` and ``ρ = 0`` for ``m ∈ T`` and ``r² = s² + (ρr)²`` otherwise.
- ``t6-finite-population`` (numeric): finite populations of units with ties where ``g``
  is a function of the unit (or ``m`` plus noise of conditional mean zero) and
  ``m ∈ T`` — direct ``(z, g)`` probes for feature and general families, and a random
  MLP whose targets are an affine function of the readout input — the engine's ``s``
  equals ``r̂`` and ``ρ̂ = 0``.
- ``t6-agmax-chain`` (numeric): ``s ≤ r̂ ≤ AG_rms ≤ AG_max`` on random probes (random and
  trained models, probes with repeated inputs and conflicting labels).
- ``t6-no-realizability`` (converse): ``g ≠ 0`` with ``s = 0`` without realizability: the
  least-squares readout, the odd network with even features, and label noise at an
  optimum (``m = 0`` while ``AG_max > 0``).
- ``t6-per-token-max`` (converse): the chain needs the whole-tensor norm: with ``N`` equal
  tokens carrying ``g_t = a e₁`` and the bias family, ``s = a√N`` while every token has
  ``‖g_t‖ = a`` (theory ``ex-per-token-max``).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np
import sympy as sp
import torch

import depthsat_theory.engines.symbolic as S
from depthsat_theory.capture import SiteRecorder
from depthsat_theory.check import FAMILY_POOLS, pool_family
from depthsat_theory.families import GeneralFamily
from depthsat_theory.statistics import statistics_for
from depthsat_theory.tasks import Task, squared_error
from depthsat_theory.vocabulary import Layout

from ._registry import Context, Outcome, check
from .t1_gradient import (
    draw_instances,
    fmt,
    insertion,
    lsq_task,
    odd_task,
    random_example_law,
    random_measure,
    random_task,
    rat,
    rat_matrix,
    sites_of,
)


# ============================================================================ symbolic
def _realizable_instance(rng: np.random.Generator, realizable: bool) -> tuple[bool, bool]:
    d, p = int(rng.integers(1, 3)), int(rng.integers(1, 4))
    rank = int(rng.integers(1, p)) if p > 1 and rng.random() < 0.4 else None
    fm = random_measure(
        rng,
        units=int(rng.integers(2, 5)),
        d=d,
        p=p,
        rank=rank,
        draws=int(rng.integers(1, 3)),
        realizable=realizable,
        conditional_noise=True,
    )
    K, b = fm.K, fm.b
    Kp = K.pinv()
    s2 = sp.simplify((b.T * Kp * b)[0, 0])
    ms = fm.ms()
    r2 = fm.inner(ms, ms)
    pim = [a * (Kp * b) for a in fm.A]
    resid = [m - q for m, q in zip(ms, pim, strict=False)]
    defect2 = fm.inner(resid, resid)
    ok = sp.simplify(r2 - s2 - defect2) == 0  # Pythagoras: ‖m‖² = ‖Πm‖² + ‖m − Πm‖²
    if realizable:
        ok &= sp.simplify(r2 - s2) == 0 and defect2 == 0
        strict = False
    else:
        strict = defect2 != 0
        ok &= (sp.simplify(r2 - s2) > 0) == strict
    return bool(ok), strict


@check("T6", "thm-realizability", "t6-realizable-symbolic", "symbolic")
def realizable_symbolic(ctx: Context) -> Outcome:
    """``m ∈ T ⇒ s = r`` exactly; otherwise ``r² = s² + ‖m − Πm‖²`` and ``s < r``."""
    rng = ctx.rng("t6-realizable-symbolic")
    n = ctx.count(16, 4)
    bad = strict = 0
    for i in range(n):
        ok, st = _realizable_instance(rng, realizable=i % 2 == 0)
        bad += not ok
        strict += st
    return Outcome(
        n,
        bad,
        detail=(
            f"{(n + 1) // 2} measures with m = Av₀ (+ noise of conditional mean 0): s² = r², "
            f"ρ = 0 exactly; {n // 2} generic: r² = s² + ‖m−Πm‖², s < r in {strict}"
        ),
    )


def _chain_instance(rng: np.random.Generator) -> bool:
    d, p = int(rng.integers(1, 3)), int(rng.integers(1, 4))
    n_units, n_ex, T = int(rng.integers(2, 4)), int(rng.integers(2, 5)), int(rng.integers(1, 4))
    A = [rat_matrix(rng, d, p) for _ in range(n_units)]
    law = random_example_law(rng, n_ex, T, n_units, d)
    K = sum((q * A[k].T * A[k] for q, k, _ in law.terms()), sp.zeros(p))
    b = sum((q * A[k].T * gv for q, k, gv in law.terms()), sp.zeros(p, 1))
    s2 = (b.T * K.pinv() * b)[0, 0]
    r2 = sum((mass * (m.T * m)[0, 0] for _, mass, m in law.pooled(n_units, d)), sp.Integer(0))
    per_ex = [sum(((gv.T * gv)[0, 0] for gv in gs), sp.Integer(0)) for gs in law.g]
    ag_rms2 = sum(q * e for q, e in zip(law.px, per_ex, strict=True))
    ag_max2 = max(per_ex)
    return bool(sp.simplify(s2) <= r2 <= ag_rms2 <= ag_max2)


@check("T6", "cor-agmax-certificate", "t6-chain-symbolic", "symbolic")
def chain_symbolic(ctx: Context) -> Outcome:
    """``s² ≤ r² ≤ AG_rms² ≤ AG_max²`` exactly on random finite laws (several units per example)."""
    rng = ctx.rng("t6-chain-symbolic")
    n = ctx.count(16, 4)
    bad = sum(not _chain_instance(rng) for _ in range(n))
    return Outcome(n, bad, detail="examples with 1–3 units (ties), rational laws; AG_max over whole examples: exact")


def _engine_instance(rng: np.random.Generator, i: int) -> bool:
    fam = (S.linear(2), S.polynomial(1, 2), S.polynomial(2, 1, bias=False))[i % 3]
    u = fam.units
    pts = [tuple(rat(rng) for _ in u) for _ in range(int(rng.integers(3, 6)))]
    mu = S.FiniteMeasure(
        pts, [int(w) for w in rng.integers(1, 4, size=len(pts))], total_mass=sp.Rational(int(rng.integers(1, 5)), 2)
    )
    v0 = rat_matrix(rng, fam.p, 1)
    m_in = list(S.tangent_map(fam) * v0)  # m ∈ T
    sat = S.saturation(fam, mu, m_in)
    ok = sp.simplify(sat.score - sat.raw_score) == 0 and sat.realizability_defect == 0 and sat.score != 0
    m_out = [u[0] ** 3 + rat(rng) * u[-1] ** 2 for _ in u]  # generically ∉ T
    sat2 = S.saturation(fam, mu, m_out)
    rho = sat2.realizability_defect
    ok &= sp.simplify(sat2.raw_score**2 - sat2.score**2 - (rho * sat2.raw_score) ** 2) == 0
    ok &= (sp.simplify(sat2.raw_score - sat2.score) > 0) == (rho != 0)
    return bool(ok)


@check("T6", "thm-realizability", "t6-symbolic-engine", "symbolic")
def symbolic_engine(ctx: Context) -> Outcome:
    """The exact engine (``depthsat_theory.engines.symbolic.saturation``) agrees with T6.

    ``m ∈ T ⇒ s = r, ρ = 0``; otherwise ``r² = s² + ρ²r²``.
    """
    rng = ctx.rng("t6-symbolic-engine")
    n = ctx.count(3, 1)
    bad = sum(not _engine_instance(rng, i) for i in range(n))
    return Outcome(
        n,
        bad,
        detail=(
            "linear / poly:2 / poly:1-nobias families on rational finite measures: engine "
            "s = r, ρ = 0 for m = A v₀; r² = s² + (ρr)², s < r ⇔ ρ > 0 for m = u₁³ + c u_d²"
        ),
    )


# ============================================================================ numeric
def _tangent_field(fam, z: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``A(u) v`` on rows ``z`` (``(N, d)``): an element of ``T``."""
    p = v.numel()
    theta0 = torch.zeros(p, dtype=torch.float64)
    return torch.func.jvp(lambda th: fam.functional(th, z, Layout.VECTOR), (theta0,), (v,))[1]


def _population(rng: np.random.Generator, gen: torch.Generator, spec: str, noise: bool):
    """A finite population of rows with ties; ``g = A(u)v₀`` (+ noise of mean 0 per unit)."""
    d = int(rng.integers(3, 7))
    n_distinct = int(rng.integers(6, 16))
    units = torch.randn(n_distinct, d, generator=gen, dtype=torch.float64)
    fam = pool_family(spec)
    if hasattr(fam, "frozen_feature_map"):
        fam.frozen_feature_map((d,), Layout.VECTOR, dtype=torch.float64, device=torch.device("cpu"))
    v0 = torch.randn(fam.param_dim((d,)), generator=gen, dtype=torch.float64)
    m = _tangent_field(fam, units, v0)
    zs, gs = [], []
    for i in range(n_distinct):
        reps = int(rng.integers(1, 4))
        if noise:  # ± pairs: conditional mean exactly m(u_i)
            e = torch.randn(d, generator=gen, dtype=torch.float64)
            zs += [units[i]] * (2 * reps)
            gs += [m[i] + e, m[i] - e] * reps
        else:
            zs += [units[i]] * reps
            gs += [m[i]] * reps
    return fam, torch.stack(zs), torch.stack(gs)


def _affine_target_task(seed: int) -> tuple[Task, str]:
    """A random MLP on a finite population with targets affine in the readout input.

    The population is 12 inputs, repeated; the loss is squared error against targets ``y = M z + c``
    affine in the readout input ``z`` (site ``ln_f``), so ``g = Wᵀ((W − M) z)`` is a function of the
    unit in the linear family's ``T``.
    """
    base = random_task("mlp", seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = base.inputs[:12]
    x = torch.cat([x, x[:8], x[:3]])
    model: Any = base.model
    feats = []
    h = model.ln_f.register_forward_hook(lambda mod, i, o: feats.append(o.detach()))
    with torch.no_grad():
        model(x)
    h.remove()
    head = model.head
    M = head.weight.detach() + 0.3 * torch.randn(head.weight.shape, generator=gen, dtype=torch.float64)
    y = feats[0] @ M.T + head.bias.detach()
    task = Task(
        kind="random-mlp-affine",
        data="random",
        model=model,
        inputs=x,
        targets=y,
        loss=squared_error,
        layout=Layout.VECTOR,
        train_loss=float("nan"),
        probe_loss=float("nan"),
    )
    return task, "ln_f"


POP_FAMILIES = ("linear", "linear-nobias", "relu:16", "powers:2", "tanh:8", "diag-general")
REAL_RTOL = 1e-9


@check("T6", "thm-realizability", "t6-finite-population", "numeric")
def finite_population(ctx: Context) -> Outcome:
    """On finite populations with ``m ∈ T``: ``s = r̂`` and ``ρ̂ = 0`` (engine, float64)."""
    rng = ctx.rng("t6-finite-population")
    gen = ctx.torch_generator("t6-finite-population")
    n = ctx.count(12, 3)
    bad = 0
    worst = worst_rho = 0.0
    noisy = 0
    for i in range(n):
        spec = POP_FAMILIES[int(rng.integers(len(POP_FAMILIES)))]
        noise = i % 2 == 1
        fam, z, g = _population(rng, gen, spec, noise)
        acc = statistics_for(fam, (z.shape[1],), Layout.VECTOR, pool_ties=True)
        acc.update(z, g)
        res = acc.result()
        dev = abs(res.score - res.raw_score) / res.raw_score
        rho = res.realizability_defect
        worst, worst_rho = max(worst, dev), max(worst_rho, rho)
        ok = dev <= REAL_RTOL and rho <= 1e-6 and not res.saturated
        if noise:
            noisy += 1
            ok &= res.ag_rms > res.raw_score * (1 + 1e-9)
        bad += not ok
    m_models = ctx.count(3, 1)
    for _j in range(m_models):
        task, site = _affine_target_task(int(rng.integers(1 << 30)))
        for spec in ("linear", "linear-nobias"):
            ins = insertion(task, site, spec, pool_ties=True)
            res = ins.result
            dev = abs(res.score - res.raw_score) / res.raw_score
            worst, worst_rho = max(worst, dev), max(worst_rho, res.realizability_defect)
            bad += not (dev <= REAL_RTOL and res.realizability_defect <= 1e-6)
    total = n + 2 * m_models
    return Outcome(
        total,
        bad,
        detail=(
            f"{n} direct populations ({noisy} with ± label noise, AG_rms > r̂) over {len(POP_FAMILIES)} families + "
            f"{2 * m_models} MLPs with affine targets at ln_f: max |s−r̂|/r̂ = {fmt(worst)} (tol {REAL_RTOL:g}), "
            f"max ρ̂ = {fmt(worst_rho)}"
        ),
    )


def _with_repeats(task: Task, gen: torch.Generator) -> Task:
    """The probe plus repeated inputs with redrawn labels (ties with different g: r̂ < AG_rms)."""
    n = task.inputs.shape[0]
    k = max(1, n // 3)
    idx = torch.randperm(n, generator=gen)[:k]
    x = torch.cat([task.inputs, task.inputs[idx]])
    y_extra = task.targets[idx][torch.randperm(k, generator=gen)]
    return dataclasses.replace(task, inputs=x, targets=torch.cat([task.targets, y_extra]))


@check("T6", "cor-agmax-certificate", "t6-agmax-chain", "numeric")
def agmax_chain(ctx: Context) -> Outcome:
    """``s ≤ r̂ ≤ AG_rms ≤ AG_max`` on random probes (ties pooled exactly)."""
    rng = ctx.rng("t6-agmax-chain")
    gen = ctx.torch_generator("t6-agmax-chain")
    draws = draw_instances(rng, ctx.count(20, 5), trained_kinds=("mlp", "gpt") if not ctx.quick else ("mlp",))
    bad = strict_r = 0
    ratios = []
    below_s = below_rms = seq = 0
    for i, (task, site, spec) in enumerate(draws):
        if i % 2 == 1:
            task = _with_repeats(task, gen)
        ins = insertion(task, site, spec, pool_ties=True)
        res = ins.result
        slack = 1e-12 * res.ag_max
        chain = [res.score, res.raw_score, res.ag_rms, res.ag_max]
        ok = all(a <= b_ + slack for a, b_ in itertools.pairwise(chain))
        bad += not ok
        strict_r += res.raw_score < res.ag_rms * (1 - 1e-12)
        if res.ag_max > 0:
            ratios.append(res.score / res.ag_max)
        if task.layout == Layout.SEQUENCE:  # a per-token max would break the chain
            seq += 1
            _, g = _site_probe(task, site)
            token_max = float(g.norm(dim=-1).max())
            below_s += token_max < res.score
            below_rms += token_max < res.ag_rms
    return Outcome(
        len(draws),
        bad,
        detail=(
            f"random/trained models, half with repeated inputs and redrawn labels: r̂ < AG_rms strictly in {strict_r}; "
            f"s/AG_max ∈ [{min(ratios):.2g}, {max(ratios):.2g}]; on {seq} sequence probes the per-token max ‖g_t‖ "
            f"is < s in {below_s} and < AG_rms in {below_rms} (a per-token max is no bound)"
        ),
    )


def _site_probe(task, site):
    with SiteRecorder(task.model, [site]) as rec:
        rec.backward(task.loss(task.model(task.inputs), task.targets).sum())
    return rec.z[site], rec.g[site]


def _label_noise_probes(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Site probes of a random MLP at an optimum of a probe with label noise, ties exact on every BLAS.

    The probe is each of 16 inputs twice, with targets ``f(x) ± δe`` (``e`` Gaussian, ``δ = 1/4``): the
    squared-error gradient at the output is ``∓δe``, so at every site the two copies share the unit ``z`` and carry
    exactly opposite activation gradients ``∓δJ(x)ᵀe``; ``m = 0`` at every unit while every per-example gradient
    is nonzero.  Forwarding the duplicated batch would leave the ties to the BLAS: a kernel may round rows ``i`` and
    ``i + 16`` of one product differently (an AVX2 kernel does), and then the copies are two units with ``r̂ > 0``.
    So the 16 inputs are forwarded and backpropagated once (output gradient ``δe``) and each site's probe is
    ``(z; z)`` with ``(g; −g)``: copying and negating are exact, so the copies tie bit for bit and each tie's
    gradients sum to exactly ``0``.

    Returns:
        ``{site: (z, g)}`` float64, ``(32, *shape)`` each.
    """
    base = random_task("mlp", seed)
    gen = torch.Generator().manual_seed(seed + 7)
    x = base.inputs[:16]
    sites = sites_of(base)
    with SiteRecorder(base.model, sites) as rec:
        out = base.model(x)
        e = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        rec.backward((out * (0.25 * e)).sum())
    return {s: (torch.cat([rec.z[s], rec.z[s]]), torch.cat([rec.g[s], -rec.g[s]])) for s in sites}


def _label_noise_result(probe: tuple[torch.Tensor, torch.Tensor], spec: str):
    """The engine's result (ties pooled) on one site probe of :func:`_label_noise_probes`."""
    z, g = probe
    acc = statistics_for(pool_family(spec), tuple(z.shape[1:]), Layout.VECTOR, pool_ties=True)
    acc.update(z, g)
    return acc.result()


def _label_noise_cases(ctx: Context, rng) -> list[tuple]:
    """``(probe, family spec)`` pairs of the label-noise group: random sites and vector families."""
    cases = []
    pool = [f for f in FAMILY_POOLS[Layout.VECTOR] if not f.startswith("product")]
    for _ in range(ctx.count(2, 1)):
        probes = _label_noise_probes(int(rng.integers(1 << 30)))
        sites = sorted(probes)
        for _ in range(ctx.count(3, 2)):
            site = sites[int(rng.integers(len(sites)))]
            cases.append((probes[site], pool[int(rng.integers(len(pool)))]))
    return cases


@check("T6", "thm-realizability", "t6-no-realizability", "converse")
def no_realizability(ctx: Context) -> Outcome:
    """``g ≠ 0`` with ``s = 0``: lsq readout, odd network (even features), label noise at an optimum."""
    rng = ctx.rng("t6-no-realizability")
    groups: dict[str, list[bool]] = {"lsq readout": [], "odd network": [], "label noise": []}
    ag_ratio = []
    ltask, lsites = lsq_task(int(rng.integers(1 << 30)))
    otask, osites = odd_task(ctx.seed)
    # lsq: noise-free targets, g a function of the unit (realizability (a) holds) but m ⟂ T ((b) fails)
    cases = [("lsq readout", ltask, lsites[0], f) for f in ("linear", "linear-nobias")]
    cases += [("odd network", otask, s, f) for s in osites for f in ("even:abs", "even:square")][: ctx.count(8, 2)]
    noise_cases = _label_noise_cases(ctx, rng)
    for group, task, site, spec in cases:
        res = insertion(task, site, spec, pool_ties=True).result
        groups[group].append(res.saturated and res.ag_max > 0 and res.ag_rms > 0)
        ag_ratio.append(res.score / res.ag_max if res.ag_max > 0 else float("inf"))
    for probe, spec in noise_cases:  # m = 0 exactly: every tie's gradients cancel, so r̂ = 0 exactly
        res = _label_noise_result(probe, spec)
        groups["label noise"].append(res.saturated and res.ag_max > 0 and res.ag_rms > 0 and res.raw_score == 0)
        ag_ratio.append(res.score / res.ag_max if res.ag_max > 0 else float("inf"))
    n = sum(len(v) for v in groups.values())
    bad = sum(not x for v in groups.values() for x in v)
    conv = "g ≠ 0 with s = 0 (saturated, AG_max > 0): " + ", ".join(f"{k} {sum(v)}/{len(v)}" for k, v in groups.items())
    return Outcome(
        n,
        bad,
        converse=conv,
        detail=(
            f"max s/AG_max = {fmt(max(ag_ratio))} (s ≤ tol = 1e3·eps·AG_rms); label noise: each input twice with "
            f"targets f(x) ± δe at random sites/families (the ties built exactly), r̂ = 0 while AG_max > 0"
        ),
    )


def _bias_family() -> GeneralFamily:
    """The row-wise bias family ``h_θ(u) = θ`` (tangent space: the constant fields)."""
    return GeneralFamily(lambda th, u: th.expand_as(u), lambda d: d, name="bias")


@check("T6", "cor-agmax-certificate", "t6-per-token-max", "converse")
def per_token_max(ctx: Context) -> Outcome:
    """A maximum over single tokens is no bound: ``max_t ‖g_t‖ < s`` (theory ``ex-per-token-max``)."""
    rng = ctx.rng("t6-per-token-max")
    gen = ctx.torch_generator("t6-per-token-max")
    n = ctx.count(6, 2)
    broke = 0
    worst = 0.0
    for _ in range(n):
        b, t, d = int(rng.integers(2, 6)), int(rng.integers(2, 9)), int(rng.integers(2, 6))
        a = float(rng.uniform(0.5, 2.0))
        z = torch.randn(1, 1, d, generator=gen, dtype=torch.float64).expand(b, t, d).contiguous()
        g = torch.zeros(b, t, d, dtype=torch.float64)
        g[..., 0] = a  # the same unit and gradient a·e₁ at every token
        acc = statistics_for(_bias_family(), (t, d), Layout.SEQUENCE)
        acc.update(z, g)
        res = acc.result()
        token_max = float(g.norm(dim=-1).max())
        ok = abs(res.score - a * t**0.5) <= 1e-12 * a * t**0.5 and abs(res.ag_max - res.score) <= 1e-12 * res.score
        broke += ok and token_max < res.score
        worst = max(worst, token_max / res.score)
    return Outcome(
        n,
        n - broke,
        converse=f"per-token max ‖g_t‖ < s in {broke}/{n} N-token constructions",
        detail=(
            f"g_t = a·e₁ on N = 2…8 equal tokens, bias family: s = a√N = AG_rms = AG_max (engine, "
            f"rel. 1e-12) while max_t ‖g_t‖ = a; max (per-token max)/s = {worst:.3g}"
        ),
    )
