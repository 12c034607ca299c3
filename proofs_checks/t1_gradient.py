"""T1: the gradient of an inserted block at its origin (``thm-gradient``, ``lem-tower``).

Claim (theory/gradient.md, thm-gradient): ``∇_θ J(0) = E[Aᵀ g] = E[Aᵀ m]``, and this is autograd's
gradient of the really inserted block.

Checks:

- ``t1-chain-rule-origin`` (symbolic): for a *generic* smooth family with ``h(0, z) = 0``
  (written ``h_i = Σ_j θ_j F_ij(θ, z)`` with undefined sympy functions ``F_ij``, which is
  every such family by Hadamard's lemma) and a generic loss ``ℓ``,
  ``∂_θ ℓ(z + h(θ, z))|_0 = A(z)ᵀ ∂ℓ/∂z``; plus random polynomial families and losses.
- ``t1-tower-property`` (symbolic): on a finite joint measure of examples with several
  units each (the intensity measure, exact rationals),
  ``∇_θ J(0) = E[Aᵀ g] = E[Aᵀ m]`` with ``m(u) = E[g | unit = u]``.
- ``t1-autograd-gradient`` (numeric): random and trained torch models, random sites and
  families; the block is really inserted (:func:`depthsat_theory.capture.insert_block`)
  and autograd's gradient of the probe loss is compared with the statistics' ``b``.

This module also holds the helpers shared by the claim modules T1–T6 (small random
torch tasks, cached trained tasks, one insertion through the numeric engine, and
rational finite measures for the symbolic checks).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import math
import os
import shutil
import tempfile
from typing import Any, cast

import numpy as np
import sympy as sp
import torch

from depthsat_theory.capture import Insertion
from depthsat_theory.check import FAMILY_POOLS, insert_on_probe, pool_family
from depthsat_theory.families import ResidualFamily
from depthsat_theory.tasks import (
    CACHE_ENV_VAR,
    CharGPT,
    ResidualMLP,
    ResNetCNN,
    Task,
    classification_loss,
    lsq_readout,
    odd_network,
    token_loss,
    trained_task,
)

from ._registry import Context, Outcome, check

# ============================================================================ shared helpers
#: Kinds of small random (untrained) float64 tasks built by :func:`random_task`.
RANDOM_KINDS = ("mlp", "cnn", "gpt")
#: Probe sizes of the cached trained tasks (first examples of their probes).
TRAINED_PROBE = {"mlp": 256, "gpt": 8, "cnn": 32}


def sites_of(task: Task) -> list[str]:
    """The insertion sites of a task's model (its ``site_names()``)."""
    return list(cast(Any, task.model).site_names())


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


@functools.lru_cache(maxsize=64)
def random_task(kind: str, seed: int) -> Task:
    """A small untrained float64 model with a random probe (deterministic in ``seed``).

    ``mlp``: ResidualMLP(10 → 12, depth 2, 5 classes), 48 examples, cross-entropy;
    ``cnn``: ResNetCNN(channels (4, 6), one block per stage), 10 images 1×6×6;
    ``gpt``: CharGPT(vocab 9, d 12, 2 layers, 2 heads), 6 sequences of 8 tokens.
    Weights are redrawn at a scale where gradients are not tiny.
    """
    gen = _seeded(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        model: torch.nn.Module
        if kind == "mlp":
            model = ResidualMLP(in_dim=10, width=12, depth=2, n_classes=5)
            x = torch.randn(48, 10, generator=gen, dtype=torch.float64)
            y = torch.randint(0, 5, (48,), generator=gen)
            loss = classification_loss
        elif kind == "cnn":
            model = ResNetCNN(in_channels=1, channels=(4, 6), blocks_per_stage=1, n_classes=4)
            x = torch.randn(10, 1, 6, 6, generator=gen, dtype=torch.float64)
            y = torch.randint(0, 4, (10,), generator=gen)
            loss = classification_loss
            for mod in model.modules():
                if isinstance(mod, torch.nn.BatchNorm2d):
                    mean, var = mod.get_buffer("running_mean"), mod.get_buffer("running_var")
                    mean.copy_(0.1 * torch.randn(mean.shape, generator=gen))
                    var.copy_(0.5 + torch.rand(var.shape, generator=gen))
        elif kind == "gpt":
            model = CharGPT(vocab_size=9, d_model=12, n_layers=2, n_heads=2, seq_len=8)
            with torch.no_grad():
                for _name, prm in model.named_parameters():
                    if prm.dim() > 1:
                        prm.copy_(torch.randn(prm.shape, generator=gen) / math.sqrt(prm.shape[-1]))
            x = torch.randint(0, 9, (6, 8), generator=gen)
            y = torch.randint(0, 9, (6, 8), generator=gen)
            loss = token_loss
        else:
            raise ValueError(f"unknown random task kind {kind!r}")
    model = model.to(torch.float64).eval()
    model.requires_grad_(True)
    with torch.no_grad():
        probe_loss = float(loss(model(x), y).mean())
    return Task(
        kind=f"random-{kind}",
        data="random",
        model=model,
        inputs=x,
        targets=y,
        loss=loss,
        layout=model.layout,
        train_loss=float("nan"),
        probe_loss=probe_loss,
    )


@functools.lru_cache(maxsize=1)
def weights_cache() -> str:
    """Where trained weights are cached.

    ``$DEPTHSAT_CACHE`` when set, else a folder private to this process (removed at exit), so that
    a model is trained at most once per run even when the theorem checker loads it again by itself.
    """
    env = os.environ.get(CACHE_ENV_VAR)
    if env:
        return env
    folder = tempfile.mkdtemp(prefix="depthsat-proofs-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


@functools.lru_cache(maxsize=8)
def trained(kind: str) -> Task:
    """The trained task of ``kind``, restricted to the first :data:`TRAINED_PROBE` probe examples.

    The model is trained with seed 0; its weights are cached in :func:`weights_cache`.
    """
    task = trained_task(kind, 0, cache_dir=weights_cache())
    k = TRAINED_PROBE[kind]
    return dataclasses.replace(task, kind=f"trained-{kind}", inputs=task.inputs[:k], targets=task.targets[:k])


def insertion(task: Task, site: str, family: ResidualFamily | str, *, pool_ties: bool = False) -> Insertion:
    """One (task, site, family) through the numeric engine, as the theorem checker does it.

    Streams the probe's statistics, then really inserts the family's zero block after ``site``
    in a copy of the model (:func:`depthsat_theory.check.insert_on_probe`, a
    :class:`depthsat_theory.capture.Insertion`): function preservation, autograd gradient ``b``
    of the probe loss w.r.t. the block, its comparison with the statistics, feature-parameter
    gradients and the first-step slope.  The accumulator (G, Σ or K, b; tie pooling) is ``.stats``.
    Family specs are those of the checker's pools (:func:`depthsat_theory.check.pool_family`).
    """
    fam = pool_family(family) if isinstance(family, str) else family
    return insert_on_probe(task, site, fam, pool_ties=pool_ties)


def draw_instances(
    rng: np.random.Generator, n: int, *, trained_kinds=("mlp",), random_kinds=RANDOM_KINDS, exclude=()
) -> list[tuple[Task, str, str]]:
    """``n`` random ``(task, site, family spec)`` triples.

    Models are random (fresh seeds) or trained, sites are drawn uniformly, families from the
    checker's pool of the layout.
    """
    kinds = [("random", k) for k in random_kinds] + [("trained", k) for k in trained_kinds]
    out = []
    for _ in range(n):
        src, kind = kinds[int(rng.integers(len(kinds)))]
        task = random_task(kind, int(rng.integers(1 << 30))) if src == "random" else trained(kind)
        sites = sites_of(task)
        site = sites[int(rng.integers(len(sites)))]
        pool = [f for f in FAMILY_POOLS[task.layout] if f not in exclude]
        out.append((task, site, pool[int(rng.integers(len(pool)))]))
    return out


@functools.lru_cache(maxsize=8)
def odd_task(seed: int) -> tuple[Task, tuple[str, ...]]:
    """The odd-network construction (theory label ex-saturated; ``constructions.odd_network``), cached."""
    task, sites = odd_network(int(seed))
    return task, tuple(sites)


@functools.lru_cache(maxsize=8)
def lsq_task(seed: int) -> tuple[Task, tuple[str, ...]]:
    """The least-squares-readout construction (theory label ex-saturated) on a random MLP, cached."""
    task, sites = lsq_readout(random_task("mlp", int(seed)))
    return task, tuple(sites)


def fmt(x: float) -> str:
    """Short float for details."""
    return f"{x:.2g}"


# -- exact finite measures (symbolic checks)
def rat(rng: np.random.Generator, lo: int = -4, hi: int = 4, dens=(1, 2, 3)) -> sp.Rational:
    """A random small rational."""
    return sp.Rational(int(rng.integers(lo, hi + 1)), int(dens[int(rng.integers(len(dens)))]))


def rat_matrix(rng: np.random.Generator, rows: int, cols: int, **kw) -> sp.Matrix:
    """A random rational matrix."""
    return sp.Matrix(rows, cols, lambda i, j: rat(rng, **kw))


def rat_probs(rng: np.random.Generator, n: int) -> list[sp.Rational]:
    """``n`` positive rationals summing to 1."""
    w = [int(v) for v in rng.integers(1, 6, size=n)]
    tot = sum(w)
    return [sp.Rational(v, tot) for v in w]


@dataclasses.dataclass
class FiniteMeasure:
    """A finite intensity measure of units with exact rational masses.

    ``mu[i]`` is the mass of unit ``i``, ``A[i]`` its tangent map (``d × p``), and
    ``g[i]`` a list of ``(conditional probability, g vector)`` pairs (the law of the
    activation gradient given the unit).
    """

    mu: list
    A: list
    g: list

    def m(self, i: int) -> sp.Matrix:
        """``m(u_i) = E[g | unit = u_i]``."""
        return sum((q * v for q, v in self.g[i]), sp.zeros(*self.g[i][0][1].shape))

    @property
    def K(self) -> sp.Matrix:
        """``K = E[Aᵀ A] = Σ_i μ_i A_iᵀ A_i`` (``p × p``)."""
        return sum((w * a.T * a for w, a in zip(self.mu, self.A, strict=False)), sp.zeros(self.A[0].shape[1]))

    @property
    def b(self) -> sp.Matrix:
        """``E[Aᵀ g]`` (over the joint law of unit and g)."""
        p = self.A[0].shape[1]
        return sum(
            (w * q * a.T * v for w, a, gs in zip(self.mu, self.A, self.g, strict=False) for q, v in gs), sp.zeros(p, 1)
        )

    def inner(self, f1, f2) -> sp.Rational:
        """``⟨f1, f2⟩ = Σ_i μ_i f1(u_i)·f2(u_i)`` for lists of column vectors."""
        return sum((w * (x.T * y)[0, 0] for w, x, y in zip(self.mu, f1, f2, strict=False)), sp.Integer(0))

    def ms(self) -> list:
        """``[m(u_0), m(u_1), …]``: the conditional means of every unit (``d × 1`` each)."""
        return [self.m(i) for i in range(len(self.mu))]


def random_measure(
    rng: np.random.Generator,
    *,
    units: int,
    d: int,
    p: int,
    rank: int | None = None,
    draws: int = 2,
    realizable: bool = False,
    conditional_noise: bool = True,
) -> FiniteMeasure:
    """A random rational finite measure with tangent maps ``A_i`` (``d × p``).

    Args:
        rng: the source of randomness.
        units: number of units ``u_i``; each has a rational mass ``μ_i``.
        d: output dimension of the tangent maps (rows of ``A_i``, length of ``g``).
        p: number of parameters (columns of ``A_i``).
        rank: if given, ``A_i = B_i R`` with a shared ``R`` (``rank × p``), so ``rank K ≤ rank``.
        draws: number of ``g`` values per unit.
        realizable: make ``m = A v₀`` (``m ∈ T``) for a random ``v₀``.
        conditional_noise: with ``realizable``, the ``g`` draws scatter around ``m`` with
            conditional mean zero (otherwise ``g = m``).
    """
    mu = [sp.Rational(int(rng.integers(1, 5)), int(rng.integers(1, 4))) for _ in range(units)]
    if rank is None:
        A = [rat_matrix(rng, d, p) for _ in range(units)]
    else:
        R = rat_matrix(rng, rank, p)
        A = [rat_matrix(rng, d, rank) * R for _ in range(units)]
    g = []
    v0 = rat_matrix(rng, p, 1)
    for i in range(units):
        if realizable:
            m = A[i] * v0
            if not conditional_noise or draws == 1:
                g.append([(sp.Integer(1), m)])
                continue
            qs = rat_probs(rng, draws)
            noise = [rat_matrix(rng, d, 1) for _ in range(draws - 1)]
            # last noise value makes the conditional mean zero: Σ q_j e_j = 0
            last = -sum((q * e for q, e in zip(qs[:-1], noise, strict=False)), sp.zeros(d, 1)) / qs[-1]
            noise.append(last)
            g.append([(q, m + e) for q, e in zip(qs, noise, strict=False)])
        else:
            qs = rat_probs(rng, draws)
            g.append([(q, rat_matrix(rng, d, 1)) for q in qs])
    return FiniteMeasure(mu, A, g)


def quad_pinv(K: sp.Matrix, b: sp.Matrix) -> sp.Rational:
    """``bᵀ K⁺ b`` exactly (Moore–Penrose inverse of a rational matrix)."""
    return sp.nsimplify((b.T * K.pinv() * b)[0, 0])


@dataclasses.dataclass
class ExampleLaw:
    """A finite law of examples with ``T`` units each (exact rationals).

    ``px[x]`` is the probability of example ``x``, ``units[x][t]`` the index of its ``t``-th
    unit in a list of unit values, ``g[x][t]`` the activation gradient there (``d × 1``).
    """

    px: list
    units: list[list[int]]
    g: list[list[sp.Matrix]]

    def terms(self) -> list[tuple[sp.Rational, int, sp.Matrix]]:
        """``(probability, unit index, g)`` for every (example, position), examples first."""
        return [
            (q, k, gv)
            for q, ks, gs in zip(self.px, self.units, self.g, strict=True)
            for k, gv in zip(ks, gs, strict=True)
        ]

    def pooled(self, n_units: int, d: int) -> list[tuple[int, sp.Rational, sp.Matrix]]:
        """``(k, μ(u_k), m(u_k))`` for the units of positive intensity.

        The intensity is ``μ(u) = E_x #{t: u_t = u}`` and ``m(u) = E_x Σ_{t: u_t = u} g_t / μ(u)``.
        """
        out = []
        for k in range(n_units):
            mass = sum(q for q, j, _ in self.terms() if j == k)
            if mass == 0:
                continue
            m = sum((q * gv for q, j, gv in self.terms() if j == k), sp.zeros(d, 1)) / mass
            out.append((k, mass, m))
        return out


def random_example_law(rng: np.random.Generator, n_ex: int, T: int, n_units: int, d: int) -> ExampleLaw:
    """``n_ex`` examples of ``T`` units drawn from ``n_units``.

    Units tie across and within examples; the example probabilities and ``g`` (``d × 1``) are rational.
    """
    px = rat_probs(rng, n_ex)
    units = [[int(rng.integers(n_units)) for _ in range(T)] for _ in range(n_ex)]
    g = [[rat_matrix(rng, d, 1) for _ in range(T)] for _ in range(n_ex)]
    return ExampleLaw(px, units, g)


# ============================================================================ symbolic checks
def _chain_rule_generic(d: int, p: int) -> bool:
    th = sp.symbols(f"theta1:{p + 1}")
    z = sp.symbols(f"z1:{d + 1}")
    F = [[sp.Function(f"F{i}{j}")(*th, *z) for j in range(p)] for i in range(d)]
    h = [sum(th[j] * F[i][j] for j in range(p)) for i in range(d)]  # h(0, z) = 0 identically
    ell = sp.Function("ell")
    zero = dict.fromkeys(th, 0)
    lhs = sp.Matrix([sp.diff(ell(*[z[i] + h[i] for i in range(d)]), t).subs(zero).doit() for t in th])
    A = sp.Matrix(d, p, lambda i, j: sp.diff(h[i], th[j]).subs(zero).doit())
    grad = sp.Matrix([sp.diff(ell(*z), zi) for zi in z])
    assert all(sp.simplify(hi.subs(zero)) == 0 for hi in h)
    return sp.simplify(lhs - A.T * grad) == sp.zeros(p, 1)


def _chain_rule_polynomial(rng: np.random.Generator, d: int, p: int) -> bool:
    th = sp.symbols(f"theta1:{p + 1}")
    z = sp.symbols(f"z1:{d + 1}")
    zero = dict.fromkeys(th, 0)
    h = []
    for _ in range(d):  # every monomial carries a θ factor: h(0, z) = 0
        expr = sum(rat(rng) * th[j] * z[int(rng.integers(d))] ** int(rng.integers(0, 3)) for j in range(p))
        expr += rat(rng) * th[int(rng.integers(p))] * th[int(rng.integers(p))] * z[0]
        h.append(sp.expand(expr))
    w = sp.symbols(f"w1:{d + 1}")
    ell = sp.log(sum(sp.exp(wi) for wi in w)) - w[0] + sum(rat(rng) * wi**2 for wi in w)  # CE-like
    comp = ell.subs({w[i]: z[i] + h[i] for i in range(d)}, simultaneous=True)
    lhs = sp.Matrix([sp.diff(comp, t).subs(zero) for t in th])
    A = sp.Matrix(d, p, lambda i, j: sp.diff(h[i], th[j]).subs(zero))
    grad = sp.Matrix([sp.diff(ell, wi).subs(dict(zip(w, z, strict=False)), simultaneous=True) for wi in w])
    return sp.simplify(lhs - A.T * grad) == sp.zeros(p, 1)


@check("T1", "thm-gradient", "t1-chain-rule-origin", "symbolic")
def chain_rule_origin(ctx: Context) -> Outcome:
    """``d/dθ ℓ(z + h(θ, z))|_{θ=0} = A(z)ᵀ ∂ℓ/∂z`` for generic and polynomial ``h``, ``ℓ``."""
    rng = ctx.rng("t1-chain-rule-origin")
    shapes = [(1, 1), (2, 2)] if ctx.quick else [(1, 1), (2, 1), (1, 2), (2, 2), (3, 2)]
    bad = sum(not _chain_rule_generic(d, p) for d, p in shapes)
    poly = [(int(rng.integers(1, 4)), int(rng.integers(1, 4))) for _ in range(ctx.count(8, 2))]
    bad += sum(not _chain_rule_polynomial(rng, d, p) for d, p in poly)
    n = len(shapes) + len(poly)
    return Outcome(
        n,
        bad,
        detail=f"{len(shapes)} generic (undefined F_ij, ℓ; h=Σθ_j F_ij) + "
        f"{len(poly)} random polynomial h with a log-sum-exp ℓ; exact difference 0",
    )


def _tower_family(rng: np.random.Generator, d: int, p: int) -> tuple[tuple, tuple, sp.Matrix]:
    """``(θ, u, h)``: a general family ``h(θ, u)`` with ``h(0, u) = 0`` (nonlinear in ``θ`` and ``u``)."""
    th = sp.symbols(f"theta1:{p + 1}")
    u_sym = sp.symbols(f"u1:{d + 1}")
    h = sp.Matrix(
        [
            sum(
                th[j] * (rat(rng) * u_sym[i] + rat(rng) * u_sym[int(rng.integers(d))] ** 2 + rat(rng)) for j in range(p)
            )
            + rat(rng) * th[0] ** 2 * u_sym[i]
            for i in range(d)
        ]
    )
    return th, u_sym, h


def _tower_instance(rng: np.random.Generator) -> tuple[bool, bool]:
    d, p = int(rng.integers(1, 3)), int(rng.integers(1, 4))
    n_units = int(rng.integers(2, 4))
    units = [rat_matrix(rng, d, 1) for _ in range(n_units)]
    th, u_sym, h = _tower_family(rng, d, p)
    zero = dict.fromkeys(th, 0)
    jac = h.jacobian(th).subs(zero)

    def at(expr, u):
        return expr.subs(dict(zip(u_sym, u, strict=False)), simultaneous=True)

    # examples: each has T units (with repeats) and a per-unit gradient; rational probabilities
    n_ex, T = int(rng.integers(2, 5)), int(rng.integers(1, 4))
    law = random_example_law(rng, n_ex, T, n_units, d)
    # J(θ) = E_x Σ_t ℓ_{x,t}(u_t + h(θ, u_t)) with ℓ_{x,t}(w) = g·w + c‖w − u_t‖²: ∂ℓ/∂z = g at θ = 0
    c = rat(rng)
    J = sp.Integer(0)
    for q, k, gv in law.terms():
        u = units[k]
        w = u + at(h, u)
        J += q * ((gv.T * w)[0, 0] + c * ((w - u).T * (w - u))[0, 0])
    grad_j = sp.Matrix([sp.diff(J, t) for t in th]).subs(zero)
    e_ag = sum((q * at(jac, units[k]).T * gv for q, k, gv in law.terms()), sp.zeros(p, 1))
    e_am = sum((mass * at(jac, units[k]).T * m for k, mass, m in law.pooled(n_units, d)), sp.zeros(p, 1))
    return sp.simplify(grad_j - e_ag) == sp.zeros(p, 1), sp.simplify(e_ag - e_am) == sp.zeros(p, 1)


@check("T1", "lem-tower", "t1-tower-property", "symbolic")
def tower_property(ctx: Context) -> Outcome:
    """``∇_θ J(0) = E[Aᵀ g] = E[Aᵀ m]`` exactly on random finite intensity measures."""
    rng = ctx.rng("t1-tower-property")
    n = ctx.count(12, 3)
    bad_grad = bad_tower = 0
    for _ in range(n):
        ok_grad, ok_tower = _tower_instance(rng)
        bad_grad += not ok_grad
        bad_tower += not ok_tower
    return Outcome(
        n,
        bad_grad + bad_tower,
        detail=f"examples with 1–3 units (ties across/within examples), rational laws: "
        f"∇J(0) ≠ E[Aᵀg] in {bad_grad}, E[Aᵀg] ≠ E[Aᵀm] in {bad_tower} (exact)",
    )


# ============================================================================ numeric check
@check("T1", "thm-gradient", "t1-autograd-gradient", "numeric")
def autograd_gradient(ctx: Context) -> Outcome:
    """Autograd's gradient of a really inserted block equals the statistics' ``b`` (float64)."""
    rng = ctx.rng("t1-autograd-gradient")
    draws = draw_instances(rng, ctx.count(32, 6), trained_kinds=("mlp", "gpt") if not ctx.quick else ("mlp",))
    bad = 0
    worst_rel = 0.0
    worst_ratio = 0.0
    feat_max = 0.0
    dev_max = 0.0
    families = set()
    for task, site, spec in draws:
        ins = insertion(task, site, spec)
        families.add(spec)
        bmax = float(ins.b.abs().max()) if ins.b.numel() else 0.0
        rel = ins.gradient_error / bmax if bmax > 0 else ins.gradient_error
        worst_rel = max(worst_rel, rel)
        worst_ratio = max(worst_ratio, ins.gradient_error / ins.gradient_tol if ins.gradient_tol > 0 else 0.0)
        feat_max = max(feat_max, ins.feature_grad_max)
        dev_max = max(dev_max, ins.deviation)
        if ins.gradient_error > ins.gradient_tol or ins.feature_grad_max != 0.0 or ins.deviation != 0.0:
            bad += 1
    return Outcome(
        len(draws),
        bad,
        detail=(
            f"{len(families)} families on random mlp/cnn/gpt + trained models; max|Δb|/max|b| = {fmt(worst_rel)}, "
            f"max|Δb|/tol = {fmt(worst_ratio)} (tol = 1e3·eps64·AG_rms·max√K_ii + 1e-9·max|b|); "
            f"max|∂J/∂ψ| = {fmt(feat_max)}; max|Δf| at origin = {fmt(dev_max)}"
        ),
    )
