"""T3: update invariance of the improvable set and the first steps of the usual optimizers.

Every descent-compatible zero-state update has the same improvable set (``thm-update-invariance``);
the first steps of the usual optimizers are those of ``prop-adam-first-step``.

Claim (theory/updates.md, thm-update-invariance): the improvable set is the same for every descent-compatible
zero-state update; a map that is not descent-compatible (a rotation) can fail where ``s > 0``.

Checks:

- ``t3-first-steps-symbolic`` (symbolic): from the update equations of each optimizer's
  algorithm box at ``t = 1`` (zero moments/buffers/accumulators, ``θ₀ = 0``, symbolic
  hyperparameters), sympy derives ``θ₁`` and checks it equals ``−η P(b)`` with the
  documented ``P`` (Adam, AdamW with decay, AMSGrad, Adamax, NAdam with its momentum
  schedule, RAdam, RMSprop, Adagrad, SGD, momentum, Nesterov, signSGD, Lion).
- ``t3-first-steps-torch`` (numeric): the derived formulas, evaluated at the default
  hyperparameters, against one real ``torch.optim`` step (and the engine's
  :class:`~depthsat_theory.optimizers.updates.ZeroStateUpdate`) on random gradients.
- ``t3-descent-compatible-symbolic`` (symbolic): ``P(0) = 0`` and ``b P(b) > 0`` for
  ``b ≠ 0`` (elementwise maps) decided by sympy's assumptions;
  ``d/dη J(−η P(b))|₀ = −⟨∇J(0), P(b)⟩`` for a generic ``J``; the rotation has
  ``⟨b, P(b)⟩ ≡ 0``.
- ``t3-same-improvable-set`` (numeric): on random instances (random and trained models,
  exact constructions), every descent-compatible update — including real
  ``torch.optim`` NAdam, RAdam, Adamax and AMSGrad — decreases ``J`` at first order exactly when ``s > tol``.
- ``t3-rotation`` (converse): the planted rotation map (``⟨b, P(b)⟩ = 0``) shows no
  first-order decrease at improvable instances.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import sympy as sp
import torch

from depthsat_theory.check import CheckConfig, evaluate
from depthsat_theory.optimizers import DESCENT_COMPATIBLE, UPDATES, ZeroStateUpdate, get_update

from ._registry import Context, Outcome, check
from .t1_gradient import draw_instances, fmt, insertion, lsq_task, odd_task

# ============================================================================ symbolic first steps
b = sp.Symbol("b", real=True, nonzero=True)  # one coordinate of the gradient (maps are elementwise)
lr = sp.Symbol("eta", positive=True)
beta1, beta2, eps, lam, mu, psi, a0 = sp.symbols("beta1 beta2 epsilon lambda mu psi a0", positive=True)
one_m_beta1, one_m_beta2, one_m_alpha = sp.symbols("omb1 omb2 oma", positive=True)  # 1 − β₁, 1 − β₂, 1 − α > 0


def _nadam_kappa():
    """NAdam's momentum schedule ``μ₁, μ₂`` (``μ_t = β₁(1 − ½·0.96^{tψ})``, torch box)."""
    mu1 = beta1 * (1 - sp.Rational(1, 2) * sp.Rational(96, 100) ** (1 * psi))
    mu2 = beta1 * (1 - sp.Rational(1, 2) * sp.Rational(96, 100) ** (2 * psi))
    return mu1, mu2


def nadam_kappa_default() -> float:
    """NAdam's first-step factor ``κ = 1 + μ₂(1 − β₁)/(1 − μ₁μ₂)`` at β₁ = 0.9, ψ = 0.004."""
    mu1, mu2 = _nadam_kappa()
    return float((1 + mu2 * (1 - beta1) / (1 - mu1 * mu2)).subs({beta1: sp.Rational(9, 10), psi: sp.Rational(4, 1000)}))


def derivations() -> dict[str, tuple[sp.Expr, sp.Expr, dict]]:
    """``name -> (θ₁ derived from the update equations, −η P(b) claimed, default hyperparameters)``.

    Each derivation transcribes the ``torch.optim`` algorithm box (or the paper's
    algorithm for signSGD/Lion) at ``t = 1`` with zero state and ``θ₀ = 0``.
    """
    th0 = sp.Integer(0)
    out = {}
    # SGD (weight decay λ: g ← g + λθ₀)
    g = b + lam * th0
    out["sgd"] = (th0 - lr * g, -lr * b, {lam: 0})
    # heavy ball: at t = 1 the buffer is the gradient itself (no dampening)
    buf = g
    out["momentum"] = (th0 - lr * buf, -lr * b, {mu: sp.Rational(9, 10)})
    # Nesterov: g ← g + μ buf
    out["nesterov"] = (th0 - lr * (g + mu * buf), -lr * (1 + mu) * b, {mu: sp.Rational(9, 10)})
    # Adam (coupled decay λ)
    m1 = beta1 * 0 + (1 - beta1) * g
    v1 = beta2 * 0 + (1 - beta2) * g**2
    mhat, vhat = m1 / (1 - beta1), v1 / (1 - beta2)
    adam_claim = -lr * b / (sp.Abs(b) + eps)
    dflt = {beta1: sp.Rational(9, 10), beta2: sp.Rational(999, 1000), eps: sp.Rational(1, 10**8)}
    out["adam"] = (th0 - lr * mhat / (sp.sqrt(vhat) + eps), adam_claim, {**dflt, lam: 0})
    # AdamW: θ ← θ − ηλθ first (inert at θ₀ = 0), then the Adam step on the raw gradient
    th_w = th0 - lr * lam * th0
    m1w, v1w = (1 - beta1) * b, (1 - beta2) * b**2
    out["adamw"] = (
        th_w - lr * (m1w / (1 - beta1)) / (sp.sqrt(v1w / (1 - beta2)) + eps),
        adam_claim,
        {**dflt, lam: sp.Rational(1, 100)},
    )
    # AMSGrad (Adam, amsgrad=True): ν̂ uses max(ν^max_0 = 0, ν₁) = ν₁
    # (written with 1 − β₂ = omb2 > 0 so that sympy can decide the max)
    v1a = beta2 * 0 + one_m_beta2 * g**2
    out["amsgrad"] = (
        th0 - lr * mhat / (sp.sqrt(sp.Max(0, v1a) / one_m_beta2) + eps),
        adam_claim,
        {**dflt, lam: 0, one_m_beta2: sp.Rational(1, 1000)},
    )
    # Adamax: u₁ = max(β₂·0, |g| + ε), θ₁ = −(η/(1 − β₁)) m₁/u₁
    u1_max = sp.Max(beta2 * 0, sp.Abs(g) + eps)
    out["adamax"] = (th0 - lr / (1 - beta1) * m1 / u1_max, adam_claim, {**dflt, lam: 0})
    # NAdam: μ_t = β₁(1 − ½·0.96^{tψ}); m̂ = μ₂ m₁/(1 − μ₁μ₂) + (1 − μ₁) g/(1 − μ₁); v̂ = v₁/(1 − β₂)
    mu1, mu2 = _nadam_kappa()
    mhat_n = mu2 * m1 / (1 - mu1 * mu2) + (1 - mu1) * g / (1 - mu1)
    kappa = 1 + mu2 * (1 - beta1) / (1 - mu1 * mu2)
    out["nadam"] = (
        th0 - lr * mhat_n / (sp.sqrt(vhat) + eps),
        -lr * kappa * b / (sp.Abs(b) + eps),
        {**dflt, lam: 0, psi: sp.Rational(4, 1000)},
    )
    # RAdam: ρ_∞ = 2/(1 − β₂) − 1, ρ₁ = ρ_∞ − 2β₂/(1 − β₂) = 1 ≤ 5: un-rectified step θ − η m̂
    rho_inf = 2 / (1 - beta2) - 1
    rho1 = sp.simplify(rho_inf - 2 * 1 * beta2**1 / (1 - beta2**1))
    assert rho1 == 1, rho1
    out["radam"] = (th0 - lr * mhat, -lr * b, {**dflt, lam: 0})
    # RMSprop (α = 1 − oma): v₁ = α·0 + (1 − α) g², θ₁ = −η g/(√v₁ + ε)
    v1r = (1 - one_m_alpha) * 0 + one_m_alpha * g**2
    out["rmsprop"] = (
        th0 - lr * g / (sp.sqrt(v1r) + eps),
        -lr * b / (sp.sqrt(one_m_alpha) * sp.Abs(b) + eps),
        {one_m_alpha: sp.Rational(1, 100), eps: sp.Rational(1, 10**8), lam: 0},
    )
    # Adagrad: state sum = a₀; sum₁ = a₀ + g²; step η g/(√sum₁ + ε) (lr decay inert at t = 1)
    s1 = a0 + g**2
    out["adagrad"] = (
        th0 - lr * g / (sp.sqrt(s1) + eps),
        -lr * b / (sp.sqrt(a0 + b**2) + eps),
        {a0: sp.Rational(1, 10), eps: sp.Rational(1, 10**10), lam: 0},
    )
    # signSGD
    out["signsgd"] = (th0 - lr * sp.sign(g), -lr * sp.sign(b), {lam: 0})
    # Lion: c = β₁ m₀ + (1 − β₁) g with 1 − β₁ = omb1 > 0; θ ← θ − η(sign(c) + λθ)
    c = (1 - one_m_beta1) * 0 + one_m_beta1 * g
    out["lion"] = (th0 - lr * (sp.sign(c) + lam * th0), -lr * sp.sign(b), {one_m_beta1: sp.Rational(1, 10), lam: 0})
    return out


@check("T3", "prop-adam-first-step", "t3-first-steps-symbolic", "symbolic")
def first_steps_symbolic(ctx: Context) -> Outcome:
    """Zero-state first steps derived from the update equations equal the documented maps."""
    der = derivations()
    bad = [n for n, (d, c, _) in der.items() if sp.simplify(d - c) != 0]
    kappa = nadam_kappa_default()
    kbad = abs(kappa - 1.0565) > 5e-5
    return Outcome(
        len(der) + 1,
        len(bad) + int(kbad),
        detail=(
            f"{len(der)} optimizers ({', '.join(der)}); RAdam ρ₁ = 1 ≤ 5 for every β₂ (unrectified); "
            f"NAdam κ = {kappa:.6f} (torch.optim.NAdam: 1.0565×Adam)" + (f"; mismatch: {bad}" if bad else "")
        ),
    )


@dataclass(frozen=True)
class _NAdam(ZeroStateUpdate):
    """NAdam's first-step map ``κ b/(|b| + ε)`` with the real ``torch.optim.NAdam`` (defaults)."""

    name: str = field(default="nadam", init=False)
    descent_compatible: bool = field(default=True, init=False)
    kappa: float = 1.0

    def _map(self, g):
        return self.kappa * g / (g.abs() + 1e-8)

    def make_optimizer(self, params, lr):
        return _TORCH_EXTRA["nadam"](params, lr)


#: real torch optimizers (default hyperparameters) of the maps the engine's registry does not list
_TORCH_EXTRA = {
    "nadam": lambda ps, lr: torch.optim.NAdam(ps, lr=lr),
    "radam": lambda ps, lr: torch.optim.RAdam(ps, lr=lr),
    "adamax": lambda ps, lr: torch.optim.Adamax(ps, lr=lr),
    "amsgrad": lambda ps, lr: torch.optim.Adam(ps, lr=lr, amsgrad=True),
}


@dataclass(frozen=True)
class _AdamLike(ZeroStateUpdate):
    """``b/(|b| + 1e-8)`` with the real ``torch.optim.Adamax`` or ``Adam(amsgrad=True)``."""

    name: str = "adamax"
    descent_compatible: bool = field(default=True, init=False)

    def _map(self, g):
        return g / (g.abs() + 1e-8)

    def make_optimizer(self, params, lr):
        return _TORCH_EXTRA[self.name](params, lr)


@dataclass(frozen=True)
class _RAdam(ZeroStateUpdate):
    """RAdam's first step (unrectified at ``t = 1``: SGD's) with the real ``torch.optim.RAdam``."""

    name: str = field(default="radam", init=False)
    descent_compatible: bool = field(default=True, init=False)

    def _map(self, g):
        return g.clone()

    def make_optimizer(self, params, lr):
        return _TORCH_EXTRA["radam"](params, lr)


def _nadam_update() -> _NAdam:
    return _NAdam(kappa=nadam_kappa_default())


#: descent-compatible updates used by the numeric checks: the engine's plus torch NAdam, RAdam
def _all_updates() -> list[ZeroStateUpdate]:
    return [get_update(n) for n in DESCENT_COMPATIBLE] + [
        _nadam_update(),
        _RAdam(),
        _AdamLike("adamax"),
        _AdamLike("amsgrad"),
    ]


#: relative tolerance of a float64 torch first step against the formula (a few ulps of the
#: division and square root), and NAdam's (its μ schedule is a float32 tensor in torch)
STEP_TOL = 1e-13
NADAM_TOL = 1e-6


def _torch_first_step(name: str, g: torch.Tensor) -> torch.Tensor:
    """``P(g) = −θ₁/η`` from one real optimizer step at ``η = 1`` from zero state."""
    p = torch.zeros_like(g, requires_grad=True)
    p.grad = g.clone()
    opt = _TORCH_EXTRA[name]([p], 1.0) if name in _TORCH_EXTRA else get_update(name).make_optimizer([p], 1.0)
    opt.step()
    return -p.detach()


def _random_gradient(rng: np.random.Generator) -> torch.Tensor:
    n = int(rng.integers(1, 24))
    mags = 10.0 ** rng.uniform(-12, 3, size=n)
    g = rng.standard_normal(n) * mags
    g[rng.random(n) < 0.15] = 0.0
    return torch.from_numpy(g)


@check("T3", "prop-adam-first-step", "t3-first-steps-torch", "numeric")
def first_steps_torch(ctx: Context) -> Outcome:
    """The derived first steps equal one real ``torch.optim`` step (float64) and the engine's maps."""
    rng = ctx.rng("t3-first-steps-torch")
    der = derivations()
    funcs = {}
    for name, (_, claim, dflt) in der.items():
        expr = (-claim / lr).subs(dflt)
        funcs[name] = sp.lambdify(b, expr, modules="numpy")
    per = ctx.count(12, 3)
    bad = 0
    worst = [0.0, 0.0]  # others, NAdam
    for _ in range(per):
        g = _random_gradient(rng)
        gn = g.numpy()
        for name, f in funcs.items():
            with np.errstate(all="ignore"):
                want = np.array([0.0 if x == 0 else float(f(x)) for x in gn])
            got = _torch_first_step(name, g).numpy()
            dev = np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-300), initial=0.0)
            if name in UPDATES:
                eng = get_update(name).first_step(g).numpy()
                dev = max(dev, np.max(np.abs(eng - want) / np.maximum(np.abs(want), 1e-300), initial=0.0))
            tol = NADAM_TOL if name == "nadam" else STEP_TOL
            worst[name == "nadam"] = max(worst[name == "nadam"], float(dev))
            bad += not dev <= tol
    return Outcome(
        per * len(funcs),
        bad,
        detail=(
            f"{len(funcs)} optimizers × {per} random gradients (|b_i| 1e-12…1e3, exact zeros): "
            f"max relative |torch step − formula| = {fmt(worst[0])} (tol {STEP_TOL:g}); NAdam {fmt(worst[1])} "
            f"(tol {NADAM_TOL:g}: torch keeps NAdam's μ-product in float32)"
        ),
    )


@check("T3", "thm-update-invariance", "t3-descent-compatible-symbolic", "symbolic")
def descent_compatible_symbolic(ctx: Context) -> Outcome:
    """``P(0) = 0``, ``b P(b) > 0`` (b ≠ 0) for every derived map; first-order change ``−⟨∇J, P(b)⟩``."""
    der = derivations()
    bad = []
    b0 = sp.Symbol("b0", real=True)
    for name, (_, claim, _) in der.items():
        p_of_b = sp.simplify(-claim / lr)
        if p_of_b.subs(b, b0).subs(b0, 0) != 0:
            bad.append(f"{name}: P(0) ≠ 0")
        prod = sp.simplify(b * p_of_b)
        if prod.is_positive is not True and name == "nadam":
            # κ > 0 needs β₁ < 1 and μ₁μ₂ < 1: decided at torch's defaults (β₁ = 0.9, ψ = 0.004)
            prod = sp.simplify(prod.subs({beta1: sp.Rational(9, 10), psi: sp.Rational(4, 1000)}))
        if prod.is_positive is not True:
            bad.append(f"{name}: b·P(b) > 0 not proved")
    # first-order change along −ηP for a generic J (2 coordinates) and a generic direction
    x1, x2, p1, p2, eta = sp.symbols("x1 x2 p1 p2 eta", real=True)
    J = sp.Function("J")
    rate = sp.diff(J(-eta * p1, -eta * p2), eta).subs(eta, 0).doit()
    grad = [sp.diff(J(x1, x2), x).subs({x1: 0, x2: 0}) for x in (x1, x2)]
    ok_rate = sp.simplify(rate + grad[0] * p1 + grad[1] * p2) == 0
    # rotation: ⟨b, R b⟩ = 0 identically (4 coordinates)
    bs = sp.symbols("c1:5", real=True)
    rot = [-bs[1], bs[0], -bs[3], bs[2]]
    ok_rot = sp.expand(sum(x * y for x, y in zip(bs, rot, strict=False))) == 0
    n = len(der) + 2
    return Outcome(
        n,
        len(bad) + (not ok_rate) + (not ok_rot),
        detail=(
            f"{len(der)} maps: P(0) = 0 and b·P(b) > 0 proved by sympy assumptions (b real ≠ 0, ε, 1−α, 1−β₁ > 0; "
            f"NAdam's κ > 0 at β₁ = 0.9, ψ = 0.004); "
            f"d/dη J(−ηP)|₀ = −⟨∇J(0), P⟩ (generic J); rotation ⟨b, Rb⟩ ≡ 0" + (f"; {bad}" if bad else "")
        ),
    )


# ============================================================================ numeric
def _instances(ctx: Context, name: str, n: int, *, constructions: int = 0):
    rng = ctx.rng(name)
    cases = draw_instances(rng, n, trained_kinds=("mlp",), exclude=("product:4", "product:2"))
    if constructions:
        task, sites = lsq_task(int(rng.integers(1 << 30)))
        otask, osites = odd_task(ctx.seed)
        extra = [
            (task, sites[0], "linear"),
            (otask, osites[-1], "even:abs"),
            (task, sites[0], "linear-nobias"),
            (otask, osites[0], "even:square"),
        ]
        cases += extra[:constructions]
    return rng, cases


@check("T3", "thm-update-invariance", "t3-same-improvable-set", "numeric")
def same_improvable_set(ctx: Context) -> Outcome:
    """Every descent-compatible update (13 maps, real optimizers) agrees on which instances improve."""
    _, cases = _instances(ctx, "t3-same-improvable-set", ctx.count(14, 2), constructions=ctx.count(4, 1))
    updates = _all_updates()
    cfg = CheckConfig()
    bad = undecided = imp = sat = 0
    for task, site, spec in cases:
        ins = insertion(task, site, spec)
        improvable = ins.result.score > ins.result.tol and not ins.result.degenerate
        decreased, verdicts = set(), []
        for upd in updates:
            ev = evaluate(ins, upd, cfg)
            verdicts.append(ev["agreement"])
            if ev["observed_decrease"]:
                decreased.add(upd.name)
        undecided += verdicts.count("undecided")
        expected = {u.name for u in updates} if improvable else set()
        if "counterexample" in verdicts or (decreased != expected and "undecided" not in verdicts):
            bad += 1
        imp += improvable
        sat += not improvable
    return Outcome(
        len(cases),
        bad,
        detail=(
            f"{len(updates)} updates (engine's {len(DESCENT_COMPATIBLE)} + torch NAdam, RAdam, Adamax, AMSGrad) "
            f"per instance: "
            f"{imp} improvable (all decrease at first order), {sat} saturated (none moves J at first order); "
            f"{undecided} undecided evaluations"
        ),
    )


@check("T3", "thm-update-invariance", "t3-rotation", "converse")
def rotation(ctx: Context) -> Outcome:
    """The rotation map (not descent-compatible) fails to decrease ``J`` at first order where ``s > 0``."""
    _, cases = _instances(ctx, "t3-rotation", ctx.count(20, 4))
    cfg = CheckConfig()
    rot, sgd = get_update("rotation"), get_update("sgd")
    n = bad = 0
    worst = 0.0
    for task, site, spec in cases:
        ins = insertion(task, site, spec)
        if not (ins.result.score > ins.result.tol and not ins.result.degenerate):
            continue
        n += 1
        ev = evaluate(ins, rot, cfg)
        ref = evaluate(ins, sgd, cfg)
        worst = max(worst, abs(ev["observed_slope"]) / abs(ref["predicted_slope"]))
        if ev["observed_decrease"] or not ref["observed_decrease"]:
            bad += 1
    return Outcome(
        n,
        bad,
        converse=f"rotation: {n - bad}/{n} improvable instances show no first-order decrease",
        detail=(
            f"improvable (s > tol) instances on random/trained models; max |rotation slope| / "
            f"SGD's ‖b‖² = {fmt(worst)}; SGD decreased at first order on all {n}"
        ),
    )
