"""T4: invariance under regular reparameterization (``thm-reparameterization``).

Claim (theory/reparameterization.md, thm-reparameterization): if ``θ = χ(ξ)``, ``χ(0) = 0`` and
``range(A·Dχ(0)) = range(A)`` (equivalently ``rank(Dχᵀ K Dχ) = rank K``), then ``T``, ``Π`` and ``s`` are unchanged and
``b ↦ Dχ(0)ᵀ b`` (``‖b‖`` is not invariant). Degenerate parameterizations (``W = UV`` with
both factors zero, ``θ = ξ ⊙ ξ``) collapse ``T`` to ``{0}``: degenerate, never saturated.

Checks:

- ``t4-reparam-symbolic`` (symbolic): random rational finite measures with a family
  ``h(θ, u) = A(u)θ + (quadratic in θ)`` and ``χ(ξ) = Cξ + (quadratic in ξ)``: sympy
  differentiates ``h(χ(ξ), u)`` at ``ξ = 0`` and checks ``Ã = A C``, ``K̃ = CᵀKC``,
  ``b̃ = Cᵀb``, ``rank K̃ = rank K``, the projector matrices ``Π̃ = Π`` and ``s̃ = s``
  exactly, for square invertible ``C`` and for wide surjective ``C`` (more parameters);
  and that ``‖b̃‖ ≠ ‖b‖`` in general.
- ``t4-symbolic-engine`` (symbolic): the exact engine :mod:`depthsat_theory.engines.symbolic`
  (``saturation_score``, ``reparameterize``, ``is_regular_reparameterization``,
  ``is_degenerate``) agrees with an independent ``bᵀK⁺b`` and with the claim on
  rational finite measures.
- ``t4-reparam-numeric`` (numeric): a family reparameterized through
  ``χ(ξ) = C tanh(ξ) + 0.3 (Eξ)⊙(Eξ)`` (random well-conditioned ``C``) as a
  :class:`~depthsat_theory.families.GeneralFamily` gives the same ``s`` and rank as the
  original on random/trained models, and ``b̃ = Cᵀ b``.
- ``t4-degenerate`` (converse): ``W = UV`` (``product:R``) and ``θ = ξ ⊙ ξ`` have exactly
  zero tangent maps (sympy) and the engine reports them degenerate (rank 0, not
  saturated, no first-order change under SGD/Adam steps) where the linear family they
  reparameterize has ``s > 0``.
"""

from __future__ import annotations

import numpy as np
import sympy as sp
import torch

import depthsat_theory.engines.symbolic as S
from depthsat_theory.check import CheckConfig, evaluate, pool_family, probe_statistics, site_shapes
from depthsat_theory.families import FeatureFamily, GeneralFamily, ResidualFamily, linear
from depthsat_theory.optimizers import get_update
from depthsat_theory.vocabulary import Layout

from ._registry import Context, Outcome, check
from .t1_gradient import fmt, insertion, random_measure, random_task, rat, rat_matrix, sites_of, trained


# ============================================================================ symbolic
def _projector(fm, K: sp.Matrix) -> sp.Matrix:
    """``Π`` as a matrix on ``⊕_i R^d`` (functions on the units): ``𝒜 K⁺ 𝒜ᵀ M``."""
    big_a = sp.Matrix.vstack(*fm.A)
    d = fm.A[0].shape[0]
    weights = sp.diag(*[w for w in fm.mu for _ in range(d)])
    return big_a * K.pinv() * big_a.T * weights


def _reparam_instance(rng: np.random.Generator, wide: bool) -> tuple[bool, bool]:
    d, p = int(rng.integers(1, 3)), int(rng.integers(2, 4))
    q = p + 1 if wide else p
    rank = int(rng.integers(1, p)) if rng.random() < 0.4 else None
    fm = random_measure(rng, units=int(rng.integers(2, 4)), d=d, p=p, rank=rank, draws=2)
    th = sp.symbols(f"theta1:{p + 1}")
    xi = sp.symbols(f"xi1:{q + 1}")
    while True:  # Dχ(0) = C: square invertible, or wide of full row rank (surjective)
        C = rat_matrix(rng, p, q)
        if C.rank() == p:
            break
    chi = C * sp.Matrix(xi) + sp.Matrix(
        [rat(rng) * xi[int(rng.integers(q))] * xi[int(rng.integers(q))] for _ in range(p)]
    )
    zero = dict.fromkeys(xi, 0)
    ok = True
    new_a = []
    for a in fm.A:
        h = a * sp.Matrix(th) + sp.Matrix([rat(rng) * th[0] * th[int(rng.integers(p))] for _ in range(d)])
        h_rep = h.subs(dict(zip(th, chi, strict=False)), simultaneous=True)
        at = h_rep.jacobian(xi).subs(zero)
        ok &= at == a * C
        new_a.append(at)
    fm2 = type(fm)(fm.mu, new_a, fm.g)
    K, K2, b, b2 = fm.K, fm2.K, fm.b, fm2.b
    ok &= K2 == C.T * K * C and b2 == C.T * b
    ok &= K2.rank() == K.rank()
    ok &= _projector(fm2, K2) == _projector(fm, K)
    s2, s2b = (b.T * K.pinv() * b)[0, 0], (b2.T * K2.pinv() * b2)[0, 0]
    ok &= sp.simplify(s2 - s2b) == 0
    return bool(ok), (b.T * b)[0, 0] != (b2.T * b2)[0, 0]


@check("T4", "thm-reparameterization", "t4-reparam-symbolic", "symbolic")
def reparam_symbolic(ctx: Context) -> Outcome:
    """``Ã = A·Dχ(0)``, ``T``, ``Π``, ``s`` invariant, ``b ↦ Dχᵀ b`` exactly on rational measures."""
    rng = ctx.rng("t4-reparam-symbolic")
    n = ctx.count(12, 3)
    bad = norm_changed = 0
    for i in range(n):
        ok, changed = _reparam_instance(rng, wide=bool(i % 3 == 2))
        bad += not ok
        norm_changed += changed
    return Outcome(
        n,
        bad,
        detail=(
            f"square invertible and wide surjective Dχ(0), quadratic terms in h and χ: "
            f"Ã=AC, K̃=CᵀKC, b̃=Cᵀb, rank, Π matrix, s equal (exact); "
            f"‖b̃‖ ≠ ‖b‖ in {norm_changed}/{n}"
        ),
    )


def _engine_instance(rng: np.random.Generator, i: int) -> tuple[bool, str]:
    """One cross-check of the symbolic engine (:mod:`depthsat_theory.engines.symbolic`) against T4."""
    fam = (S.linear(2), S.polynomial(1, 2), S.linear(2, bias=False))[i % 3]
    u = fam.units
    pts = [tuple(rat(rng) for _ in u) for _ in range(int(rng.integers(3, 6)))]
    mu = S.FiniteMeasure(
        pts, [int(w) for w in rng.integers(1, 4, size=len(pts))], total_mass=sp.Rational(int(rng.integers(1, 5)), 2)
    )
    m = [rat(rng) * u[0] ** 2 + rat(rng) * u[-1] + rat(rng) for _ in u]
    _, s2 = S.saturation_score(fam, mu, m)
    # independent: K, b from the Jacobian at each point, bᵀK⁺b
    jac = fam.expr.jacobian(sp.Matrix(fam.params)).subs(dict.fromkeys(fam.params, 0))
    K = sp.zeros(fam.p)
    bvec = sp.zeros(fam.p, 1)
    for w, pt in zip(mu.masses, mu.points, strict=False):
        at = dict(zip(u, pt, strict=False))
        a = jac.subs(at)
        K += w * a.T * a
        bvec += w * a.T * sp.Matrix(m).subs(at)
    ok = sp.simplify(s2 - (bvec.T * K.pinv() * bvec)[0, 0]) == 0 and s2 != 0
    xi = S.param_symbols(fam.p, "x")
    while True:
        C = rat_matrix(rng, fam.p, fam.p)
        if C.rank() == fam.p:
            break
    chi = list(C * sp.Matrix(xi) + sp.Matrix([rat(rng) * xi[0] * x for x in xi]))
    ok &= S.is_regular_reparameterization(fam, chi, xi, mu) and S.is_regular_reparameterization(fam, chi, xi)
    ok &= sp.simplify(S.saturation_score(S.reparameterize(fam, chi, xi), mu, m)[1] - s2) == 0
    ok &= not S.is_regular_reparameterization(fam, [x**2 for x in xi], xi, mu)
    for deg in (S.elementwise_square_param(len(u)), S.product(len(u), 1)):
        sat = S.saturation(deg, mu, m)
        ok &= S.is_degenerate(deg) and sat.degenerate and not sat.saturated and sat.tangent_rank == 0
    return bool(ok), fam.name


@check("T4", "thm-reparameterization", "t4-symbolic-engine", "symbolic")
def symbolic_engine(ctx: Context) -> Outcome:
    """The exact engine (``depthsat_theory.engines.symbolic``) agrees with T4.

    ``s`` is invariant under a regular χ, ``ξ⊙ξ`` is not regular, ``UV`` and ``ξ⊙ξ`` are
    degenerate (never saturated).
    """
    rng = ctx.rng("t4-symbolic-engine")
    n = ctx.count(3, 1)
    bad, names = 0, []
    for i in range(n):
        ok, name = _engine_instance(rng, i)
        bad += not ok
        names.append(name)
    return Outcome(
        n,
        bad,
        detail=(
            f"{', '.join(names)} on rational finite measures: engine s² = independent "
            f"bᵀK⁺b ≠ 0, regular χ = Cξ + ξ₁ξ keeps s exactly, ξ⊙ξ not regular; "
            f"product:1 and ξ⊙ξ degenerate, rank 0, not saturated"
        ),
    )


# ============================================================================ numeric
def _prebuild(base: ResidualFamily, d: int) -> None:
    """Build a feature family's frozen row feature map outside ``torch.func`` transforms.

    Building it lazily inside ``vjp`` fails: ``Module.to`` mutates ``.data``.
    """
    if isinstance(base, FeatureFamily):
        base.frozen_feature_map((d,), Layout.VECTOR, dtype=torch.float64, device=torch.device("cpu"))


def reparameterized(base: ResidualFamily, C: torch.Tensor, E: torch.Tensor, d: int) -> GeneralFamily:
    """``h̃(ξ, u) = h(χ(ξ), u)`` with ``χ(ξ) = C tanh(ξ) + 0.3 (Eξ)⊙(Eξ)`` (``Dχ(0) = C``) on rows of width ``d``."""
    _prebuild(base, d)

    def fn(xi, u):
        ex = E.to(xi) @ xi
        theta = C.to(xi) @ torch.tanh(xi) + 0.3 * ex * ex
        return base.functional(theta, u, Layout.VECTOR)

    return GeneralFamily(fn, C.shape[1], name=f"reparam({base.spec})")


def xi_squared(base: ResidualFamily, p: int, d: int) -> GeneralFamily:
    """The degenerate parameterization ``θ = ξ ⊙ ξ`` of a row family on rows of width ``d``."""
    _prebuild(base, d)
    return GeneralFamily(lambda xi, u: base.functional(xi * xi, u, Layout.VECTOR), p, name=f"xi*xi({base.spec})")


def _row_dim(shape) -> int:
    return int(shape[0] if len(shape) == 3 else shape[-1])


def site_results(task, site: str, families: list[ResidualFamily]) -> tuple[list, tuple[int, ...]]:
    """Results of several families at one site in one pass over the probe, and the site's shape."""
    accs, _ = probe_statistics(task, [(site, f) for f in families])
    return [a.result() for a in accs], accs[0].shape


def _random_chi(gen: torch.Generator, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, _ = torch.linalg.qr(torch.randn(p, p, generator=gen, dtype=torch.float64))
    scale = 2.0 ** (2 * float(torch.rand((), generator=gen, dtype=torch.float64)) - 1)
    C = scale * q * torch.exp(torch.rand(p, generator=gen, dtype=torch.float64) - 0.5)  # cond(C) ≤ e
    E = torch.randn(p, p, generator=gen, dtype=torch.float64) / p**0.5
    return C, E


#: base families of the numeric reparameterization check (row units, small p at d = 12)
REPARAM_BASES = ("linear", "diag-general", "relu:8", "tanh:6", "linear-nobias", "even:square")
#: relative tolerance on ``|s̃ − s|`` (eigenvalue cutoffs at rounding level of ``K`` vs ``CᵀKC``)
REPARAM_RTOL = 1e-7


@check("T4", "thm-reparameterization", "t4-reparam-numeric", "numeric")
def reparam_numeric(ctx: Context) -> Outcome:
    """A random regular reparameterization leaves ``s`` and ``rank K`` unchanged and maps ``b ↦ Cᵀ b``."""
    rng = ctx.rng("t4-reparam-numeric")
    gen = ctx.torch_generator("t4-reparam-numeric")
    n = ctx.count(16, 4)
    bad = 0
    worst_s = worst_b = 0.0
    ratios = []
    for i in range(n):
        if i % 4 == 3:
            task, spec = trained("mlp"), "diag-general"
        else:
            task = random_task(("mlp", "gpt", "cnn")[i % 3], int(rng.integers(1 << 30)))
            spec = REPARAM_BASES[int(rng.integers(len(REPARAM_BASES)))]
        site = sites_of(task)[int(rng.integers(len(sites_of(task))))]
        base = pool_family(spec)
        shape = site_shapes(task, [site])[site]
        p = base.param_dim(shape)
        C, E = _random_chi(gen, p)
        (r0, r1), _ = site_results(task, site, [base, reparameterized(base, C, E, _row_dim(shape))])
        ds = abs(r1.score - r0.score) / max(r0.score, r0.tol)
        b_pred = C.T.numpy() @ r0.gradient
        db = float(np.abs(r1.gradient - b_pred).max() / max(np.abs(b_pred).max(), 1e-300))
        worst_s, worst_b = max(worst_s, ds), max(worst_b, db)
        ratios.append(np.linalg.norm(r1.gradient) / max(np.linalg.norm(r0.gradient), 1e-300))
        if ds > REPARAM_RTOL or db > 1e-9 or r0.tangent_rank != r1.tangent_rank or r0.saturated != r1.saturated:
            bad += 1
    return Outcome(
        n,
        bad,
        detail=(
            f"χ(ξ) = C tanh ξ + 0.3(Eξ)², cond C ≤ e: max |s̃−s|/s = {fmt(worst_s)} (tol {REPARAM_RTOL:g}), "
            f"max |b̃−Cᵀb|/|Cᵀb| = {fmt(worst_b)} (tol 1e-9), ranks equal; ‖b̃‖/‖b‖ ∈ "
            f"[{min(ratios):.3g}, {max(ratios):.3g}] (not invariant)"
        ),
    )


def _symbolic_degenerate() -> bool:
    """Tangent maps of ``UVu`` and ``(ξ⊙ξ)``-linear families vanish identically at 0."""
    u = sp.Matrix(sp.symbols("u1:3"))
    U = sp.Matrix(2, 1, sp.symbols("U1:3"))
    V = sp.Matrix(1, 2, sp.symbols("V1:3"))
    h = U * V * u
    params = list(U) + list(V)
    ok = h.jacobian(params).subs(dict.fromkeys(params, 0)) == sp.zeros(2, 4)
    xi = sp.symbols("xi1:7")
    W = sp.Matrix(2, 3, [x * x for x in xi])
    h2 = W * u.col_join(sp.Matrix([1]))
    ok &= h2.jacobian(xi).subs(dict.fromkeys(xi, 0)) == sp.zeros(2, 6)
    return bool(ok)


@check("T4", "thm-reparameterization", "t4-degenerate", "converse")
def degenerate(ctx: Context) -> Outcome:
    """``W = UV`` and ``θ = ξ⊙ξ`` collapse ``T`` to ``{0}``: reported degenerate where ``s > 0`` originally."""
    rng = ctx.rng("t4-degenerate")
    n = ctx.count(6, 2)
    sym_ok = _symbolic_degenerate()
    cfg = CheckConfig()
    bad, total = 0, 0
    s_min = float("inf")
    for i in range(n):
        task = random_task(("mlp", "gpt", "cnn")[i % 3], int(rng.integers(1 << 30)))
        site = sites_of(task)[int(rng.integers(len(sites_of(task))))]
        base = linear()
        shape = site_shapes(task, [site])[site]
        p = base.param_dim(shape)
        degs = [pool_family("product:2"), xi_squared(base, p, _row_dim(shape))]
        results, _ = site_results(task, site, [base, *degs])
        r0 = results[0]
        s_min = min(s_min, r0.score / max(r0.tol, 1e-300))
        for fam, res in zip(degs, results[1:], strict=False):
            total += 1
            ok = r0.score > r0.tol and res.degenerate and res.tangent_rank == 0 and not res.saturated
            ins = insertion(task, site, fam)
            for name in ("sgd", "adam"):
                ok &= evaluate(ins, get_update(name), cfg)["agreement"] == "degenerate"
            bad += not ok
    return Outcome(
        total + 1,
        bad + (not sym_ok),
        converse=(
            f"W=UV, θ=ξ⊙ξ: {total - bad}/{total} collapse T to {{0}} (rank 0, degenerate, not saturated, "
            f"no first-order change) where the linear family has s > 0"
        ),
        detail=f"sympy: both tangent maps ≡ 0; original linear family: min s/tol = {fmt(s_min)}",
    )
