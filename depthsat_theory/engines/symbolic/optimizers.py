r"""Zero-state first steps derived from optimizers' update equations (theory/definitions.md, T2, T3).

For each name in :data:`depthsat_theory.optimizers.updates.UPDATES` (and ``nadam``,
``adamax``, ``radam``), the optimizer's **update equations** are written out
symbolically for one step from zero state at a symbolic parameter :math:`\theta_0`
(fresh moments, fresh accumulators, step counter :math:`t = 1`), with gradient
:math:`b` and learning rate :math:`\eta`:

.. math::

    \theta_1 = \theta_0 - \eta\, U(\theta_0, b), \qquad
    P(b) = U(0, b) = -\frac{\theta_1 - \theta_0}{\eta}\Big|_{\theta_0 = 0},

so weight-decay terms (:math:`\lambda\theta_0`, coupled or decoupled) are carried
through the algebra and vanish only at :math:`\theta_0 = 0`.  Hyperparameters default
to the registered ones (:data:`~depthsat_theory.optimizers.updates.UPDATES`, read from the
dataclasses; decimal literals become exact rationals, ``0.999 = 999/1000``) or to the
``torch.optim`` defaults for ``nadam``/``adamax``/``radam``; any of them may be
overridden, also by sympy symbols.

Conventions matched to ``torch.optim`` (torch 2.13 algorithm boxes): the SGD momentum
buffer starts *as the gradient* (dampening unused at step 1); Adam/AdamW/NAdam bias
corrections use :math:`t = 1`; RMSprop has no bias correction; Adagrad's accumulator
starts at ``initial_accumulator_value``; Lion's :math:`c = \beta_1 m_0 + (1-\beta_1) b`
with :math:`m_0 = 0`; RAdam's rectification term :math:`\rho_1 = 1 \le 5`, so its first
step is SGD's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import sympy as sp

from depthsat_theory.engines.symbolic.algebra import is_zero, simplified
from depthsat_theory.engines.symbolic.engine import gradient
from depthsat_theory.engines.symbolic.family import SymbolicFamily
from depthsat_theory.engines.symbolic.measures import as_measure
from depthsat_theory.optimizers import UPDATES, ZeroStateUpdate

__all__ = [
    "EXTRA_UPDATES",
    "SYMBOLIC_UPDATES",
    "FirstOrderChange",
    "default_hyper",
    "first_order_change",
    "is_descent_compatible",
    "zero_state_step",
    "zero_state_update",
]

#: Maps not in :data:`UPDATES` but checked against their ``torch.optim`` classes.
EXTRA_UPDATES: tuple[str, ...] = ("nadam", "adamax", "radam")
#: Every name :func:`zero_state_step` knows.
SYMBOLIC_UPDATES: tuple[str, ...] = tuple(UPDATES) + EXTRA_UPDATES

_EXTRA_DEFAULTS = {
    "nadam": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "momentum_decay": 4e-3},
    "adamax": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    "radam": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
}


def _rat(x):
    if isinstance(x, (tuple, list)):
        return tuple(_rat(v) for v in x)
    if isinstance(x, sp.Basic):
        return x
    if isinstance(x, bool):
        return x
    if isinstance(x, float):
        return sp.Rational(repr(x))  # the decimal literal, exactly
    return sp.sympify(x)


def default_hyper(name: str | ZeroStateUpdate) -> dict:
    """The hyperparameters of a map, as exact sympy numbers.

    Read from the :class:`~depthsat_theory.optimizers.ZeroStateUpdate` dataclass (all
    fields but ``name``/``descent_compatible``): the registered one for a name in
    :data:`~depthsat_theory.optimizers.UPDATES`, or the given instance; the
    ``torch.optim`` defaults for :data:`EXTRA_UPDATES`.

    Args:
        name: a name in :data:`SYMBOLIC_UPDATES` or a :class:`ZeroStateUpdate`.

    Returns:
        ``{hyperparameter: exact sympy value}`` (tuples for ``betas``).

    Raises:
        ValueError: on an unknown name (the message lists the valid ones).
    """
    upd = name if isinstance(name, ZeroStateUpdate) else UPDATES.get(name)
    if upd is not None:
        return {
            f.name: _rat(getattr(upd, f.name))
            for f in dataclasses.fields(upd)
            if f.name not in ("name", "descent_compatible")
        }
    if name in _EXTRA_DEFAULTS:
        return {k: _rat(v) for k, v in _EXTRA_DEFAULTS[name].items()}
    raise ValueError(f"unknown update {name!r}; valid names: {', '.join(SYMBOLIC_UPDATES)}")


def _b_symbols(b_symbols) -> tuple[sp.Symbol, ...]:
    if isinstance(b_symbols, int):
        if b_symbols < 1:
            raise ValueError(f"need at least one gradient coordinate, got {b_symbols}")
        return tuple(sp.Symbol(f"b{i}", real=True) for i in range(1, b_symbols + 1))
    syms = tuple(b_symbols)
    if not syms:
        raise ValueError("need at least one gradient coordinate")
    return syms


def _ew(f, *vecs) -> sp.Matrix:
    """Elementwise map over equally long column vectors."""
    n = len(vecs[0])
    return sp.Matrix([f(*(v[i] for v in vecs)) for i in range(n)])


# one function per optimizer: θ₁ from θ₀ (th), gradient g, learning rate lr, hyperparameters h;
# zero optimizer state, step t = 1
def _step_sgd(th: sp.Matrix, g: sp.Matrix, lr, h: dict) -> sp.Matrix:
    grad = g + h["weight_decay"] * th
    return th - lr * grad


def _step_momentum(th: sp.Matrix, g: sp.Matrix, lr, h: dict) -> sp.Matrix:
    buf = g  # torch: at t = 1 the buffer is clone(grad); dampening is not applied
    return th - lr * buf


def _step_nesterov(th: sp.Matrix, g: sp.Matrix, lr, h: dict) -> sp.Matrix:
    buf = g
    return th - lr * (g + h["momentum"] * buf)


def _step_adam(th: sp.Matrix, g: sp.Matrix, lr, h: dict, *, decoupled: bool = False) -> sp.Matrix:
    zero = sp.zeros(*g.shape)
    t = 1
    b1, b2 = h["betas"]
    wd, eps = h["weight_decay"], h["eps"]
    if decoupled:  # AdamW: θ ← θ (1 − η λ), then the Adam step
        th_dec, grad = th * (1 - lr * wd), g
    else:  # coupled L2: grad ← grad + λ θ
        th_dec, grad = th, g + wd * th
    m1 = b1 * zero + (1 - b1) * grad
    v1 = b2 * zero + _ew(lambda x: (1 - b2) * x**2, grad)
    mhat = m1 / (1 - b1**t)
    vhat = v1 / (1 - b2**t)
    return th_dec - lr * _ew(lambda mm, vv: mm / (sp.sqrt(vv) + eps), mhat, vhat)


def _step_rmsprop(th: sp.Matrix, g: sp.Matrix, lr, h: dict) -> sp.Matrix:
    zero = sp.zeros(*g.shape)
    alpha, eps = h["alpha"], h["eps"]
    v1 = alpha * zero + _ew(lambda x: (1 - alpha) * x**2, g)
    return th - lr * _ew(lambda x, vv: x / (sp.sqrt(vv) + eps), g, v1)


def _step_adagrad(th: sp.Matrix, g: sp.Matrix, lr, h: dict) -> sp.Matrix:
    a0, eps = h["initial_accumulator_value"], h["eps"]
    clr = lr  # lr / (1 + (t − 1) lr_decay) at t = 1
    acc = _ew(lambda x: a0 + x**2, g)
    return th - clr * _ew(lambda x, s: x / (sp.sqrt(s) + eps), g, acc)


def _step_signsgd(th: sp.Matrix, g: sp.Matrix, lr, h: dict) -> sp.Matrix:
    return th - lr * g.applyfunc(sp.sign)


def _step_lion(th: sp.Matrix, g: sp.Matrix, lr, h: dict) -> sp.Matrix:
    zero = sp.zeros(*g.shape)
    b1, _ = h["betas"]
    c = b1 * zero + (1 - b1) * g
    return th - lr * (c.applyfunc(sp.sign) + h["weight_decay"] * th)


def _step_rotation(th: sp.Matrix, g: sp.Matrix, lr, h: dict) -> sp.Matrix:
    rot = sp.zeros(*g.shape)
    for i in range(0, (len(g) // 2) * 2, 2):
        rot[i], rot[i + 1] = -g[i + 1], g[i]
    return th - lr * rot


def _step_nadam(th: sp.Matrix, g: sp.Matrix, lr, h: dict) -> sp.Matrix:
    zero = sp.zeros(*g.shape)
    t = 1
    b1, b2 = h["betas"]
    eps, psi = h["eps"], h["momentum_decay"]
    grad = g + h["weight_decay"] * th
    mu = b1 * (1 - sp.Rational(1, 2) * sp.Rational(96, 100) ** (t * psi))
    mu_next = b1 * (1 - sp.Rational(1, 2) * sp.Rational(96, 100) ** ((t + 1) * psi))
    mu_product = 1 * mu
    m1 = b1 * zero + (1 - b1) * grad
    v1 = b2 * zero + _ew(lambda x: (1 - b2) * x**2, grad)
    denom = _ew(lambda vv: sp.sqrt(vv / (1 - b2**t)) + eps, v1)
    step = _ew(lambda x, dd: x / dd, grad, denom) * ((1 - mu) / (1 - mu_product)) + _ew(
        lambda x, dd: x / dd, m1, denom
    ) * (mu_next / (1 - mu_product * mu_next))
    return th - lr * step


def _step_adamax(th: sp.Matrix, g: sp.Matrix, lr, h: dict) -> sp.Matrix:
    zero = sp.zeros(*g.shape)
    t = 1
    b1, b2 = h["betas"]
    eps = h["eps"]
    grad = g + h["weight_decay"] * th
    m1 = b1 * zero + (1 - b1) * grad
    u1 = _ew(lambda z, x: sp.Max(b2 * z, sp.Abs(x) + eps), zero, grad)
    clr = lr / (1 - b1**t)
    return th - clr * _ew(lambda mm, uu: mm / uu, m1, u1)


def _step_radam(th: sp.Matrix, g: sp.Matrix, lr, h: dict) -> sp.Matrix:
    zero = sp.zeros(*g.shape)
    t = 1
    b1, b2 = h["betas"]
    eps = h["eps"]
    grad = g + h["weight_decay"] * th
    m1 = b1 * zero + (1 - b1) * grad
    v1 = b2 * zero + _ew(lambda x: (1 - b2) * x**2, grad)
    mhat = m1 / (1 - b1**t)
    rho_inf = 2 / (1 - b2) - 1
    rho_t = sp.simplify(rho_inf - 2 * t * b2**t / (1 - b2**t))
    rect = sp.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
    adaptive = _ew(lambda mm, vv: mm * rect * sp.sqrt(1 - b2**t) / (sp.sqrt(vv) + eps), mhat, v1)
    return th - lr * sp.Matrix(
        [sp.Piecewise((a_, rho_t > 5), (s_, True)) for a_, s_ in zip(adaptive, mhat, strict=False)]
    )


_STEPS: dict[str, Callable[..., sp.Matrix]] = {
    "sgd": _step_sgd,
    "momentum": _step_momentum,
    "nesterov": _step_nesterov,
    "adam": _step_adam,
    "adamw": functools.partial(_step_adam, decoupled=True),
    "rmsprop": _step_rmsprop,
    "adagrad": _step_adagrad,
    "signsgd": _step_signsgd,
    "lion": _step_lion,
    "rotation": _step_rotation,
    "nadam": _step_nadam,
    "adamax": _step_adamax,
    "radam": _step_radam,
}


def zero_state_update(name: str, theta0, b, lr, hyper: Mapping[str, Any] | None = None) -> sp.Matrix:
    r"""One optimizer step :math:`\theta_1` from zero optimizer state, step :math:`t = 1`.

    Args:
        name: a name in :data:`SYMBOLIC_UPDATES`.
        theta0: the parameter before the step (``n`` sympy values or symbols).
        b: the gradient at ``theta0`` (``n`` values or symbols).
        lr: the learning rate :math:`\eta`.
        hyper: overrides of :func:`default_hyper`.

    Returns:
        :math:`\theta_1` as an ``n × 1`` Matrix (unsimplified update equations).

    Raises:
        ValueError: on an unknown name or hyperparameter.
    """
    h = default_hyper(name)
    for k, v in (hyper or {}).items():
        if k not in h:
            raise ValueError(f"{name} has no hyperparameter {k!r}; it has {sorted(h)}")
        h[k] = _rat(v)
    th = sp.Matrix(list(theta0))
    g = sp.Matrix(list(b))
    if th.shape != g.shape:
        raise ValueError(f"theta0 and b must have the same length, got {len(th)} and {len(g)}")
    if name not in _STEPS:
        raise ValueError(f"unknown update {name!r}; valid names: {', '.join(SYMBOLIC_UPDATES)}")
    return _STEPS[name](th, g, lr, h)


def zero_state_step(name: str, b_symbols, hyper: Mapping[str, Any] | None = None) -> sp.Matrix:
    r"""The first-step map :math:`P(b)` (so :math:`\Delta\theta = -\eta P(b)`), derived.

    Computes :func:`zero_state_update` at a symbolic :math:`\theta_0` and learning rate
    :math:`\eta`, forms :math:`-(\theta_1 - \theta_0)/\eta`, sets :math:`\theta_0 = 0`
    and simplifies (gradient symbols should be real so that
    :math:`\sqrt{b^2} = |b|`).  E.g. Adam gives :math:`b_i / (|b_i| + \epsilon)`.

    Args:
        name: a name in :data:`SYMBOLIC_UPDATES`.
        b_symbols: the gradient coordinates (sympy symbols or exact values), or an
            int ``n`` for real symbols ``b1..bn``.
        hyper: hyperparameter overrides (see :func:`default_hyper`).

    Returns:
        ``n × 1`` Matrix :math:`P(b)`.

    Raises:
        ValueError: on an unknown name/hyperparameter, or a step that depends on
            :math:`\eta` (not a first-step *map*).
    """
    bs = _b_symbols(b_symbols)
    lr = sp.Symbol("eta", positive=True)
    th0 = [sp.Symbol(f"theta0_{i}", real=True) for i in range(1, len(bs) + 1)]
    th1 = zero_state_update(name, th0, bs, lr, hyper)
    direction = (-(th1 - sp.Matrix(th0)) / lr).xreplace(dict.fromkeys(th0, 0))
    out = direction.applyfunc(lambda e: simplified(sp.piecewise_fold(e)))
    if any(e.has(lr) for e in out):
        raise ValueError(f"the first step of {name!r} is not proportional to the learning rate: {list(out)}")
    return out


@dataclass
class FirstOrderChange:
    r"""First-order change of :math:`J` along a zero-state update (theory label thm-iff, T3).

    Attributes:
        name: the update's name.
        gradient: :math:`b = E[A^T m]` (``p × 1``).
        step: :math:`P(b)` (``p × 1``).
        derivative: :math:`\frac{d}{d\eta} E[\langle m, h(-\eta P(b), u)\rangle]\big|_{\eta=0^+}`,
            computed from the family's expression (not from :math:`A`).
        predicted: :math:`-\langle b, P(b)\rangle`.
        agrees: ``derivative − predicted`` simplifies to 0 (along the actual step).
        differentiable: the right derivative along *every* direction ``s`` is
            ``−bᵀs`` (an identity in ``s``), i.e. the first-order model is linear in
            ``θ`` as T1 assumes.  ``False`` for e.g. ``|θ|`` terms, where only the
            actual step may still agree.
    """

    name: str
    gradient: sp.Matrix
    step: sp.Matrix
    derivative: sp.Expr
    predicted: sp.Expr
    agrees: bool
    differentiable: bool = True


def first_order_change(
    fam: SymbolicFamily, measure, m, name: str, hyper: Mapping[str, Any] | None = None
) -> FirstOrderChange:
    r"""Show :math:`\frac{d}{d\eta} J(\theta(\eta))|_{\eta=0^+} = -\langle b, P(b)\rangle` (T1–T3).

    The first-order model of the objective is
    :math:`J(\theta) \approx J(0) + E_\mu[\langle m(u), h(\theta, u)\rangle]`.
    Along the zero-state update :math:`\theta(\eta) = -\eta P(b)` this computes
    :math:`F(\eta) = E_\mu[\langle m, h(-\eta P(b), u)\rangle]` exactly from the
    family's expression and its right derivative at 0 (``diff`` for polynomials in
    :math:`\eta`, a one-sided limit otherwise), and compares it with
    :math:`-b^T P(b)`.

    Args:
        fam: the family.
        measure: the unit measure.
        m: conditional activation gradient (``d`` components in the units).
        name: a name in :data:`SYMBOLIC_UPDATES`.
        hyper: hyperparameter overrides.

    Returns:
        A :class:`FirstOrderChange`.

    Raises:
        FamilyError, MeasureError, ValueError: on bad inputs.
    """
    mu = as_measure(measure, fam.d)
    mm = fam.coerce(m)
    b = gradient(fam, mu, mm)
    bs = _b_symbols(fam.p)
    step = zero_state_step(name, bs, hyper).xreplace(dict(zip(bs, b, strict=False))).applyfunc(simplified)
    predicted = simplified(-(b.T * step)[0, 0])
    eta = sp.Symbol("eta", positive=True)
    # Generic direction s first: F(η) = E<m, h(−η s, u)> is exact in s, and its right
    # derivative at 0 must equal −bᵀs identically in s (a rational polynomial identity,
    # cheap to decide); then s = P(b).  Families that are not polynomial in θ are
    # differentiated along the actual step with a one-sided limit.
    sdir = sp.symbols(f"s1:{fam.p + 1}", real=True)
    moved = fam.expr.xreplace({t: -eta * s for t, s in zip(fam.params, sdir, strict=False)})
    f_eta = mu.expect(sp.expand((mm.T * moved)[0, 0]), fam.units)
    if f_eta.is_polynomial(eta):
        generic = sp.expand(sp.diff(f_eta, eta).xreplace({eta: 0}))
        linear = is_zero(generic + (b.T * sp.Matrix(sdir))[0, 0])
        deriv = simplified(generic.xreplace(dict(zip(sdir, step, strict=False))))
    else:
        linear = False
        f_eta = f_eta.xreplace(dict(zip(sdir, step, strict=False)))
        f0 = f_eta.xreplace({eta: 0})
        deriv = simplified(sp.limit((f_eta - f0) / eta, eta, 0, dir="+"))
    return FirstOrderChange(
        name=name,
        gradient=b,
        step=step,
        derivative=deriv,
        predicted=predicted,
        agrees=is_zero(deriv - predicted),
        differentiable=linear,
    )


def is_descent_compatible(
    update: str | ZeroStateUpdate, hyper: Mapping[str, Any] | None = None, *, dim: int | None = None
) -> bool | None:
    r"""Decide descent compatibility symbolically (theory label thm-iff, T2, T3).

    The predicate is :math:`P(0) = 0` and :math:`\langle b, P(b)\rangle > 0` for
    :math:`b \ne 0`.  For coordinatewise maps (:math:`P_i` depends on :math:`b_i` only)
    the inner product is :math:`\sum_i b_i P_i(b_i)`, positive for every :math:`b \ne 0`
    iff each term is positive for :math:`b_i > 0` and for :math:`b_i < 0` (given
    :math:`P(0) = 0`); this is decided with sympy's assumptions (e.g. Adam:
    :math:`b_i^2/(|b_i| + \epsilon) > 0`).  An inner product that simplifies to 0
    identically (the rotation) gives ``False``.

    Same arguments and return type as the numeric
    :func:`depthsat_theory.optimizers.is_descent_compatible` (which also accepts
    ``samples``, ``n`` and ``seed`` for its sampled check).

    Args:
        update: a name in :data:`SYMBOLIC_UPDATES` or a
            :class:`~depthsat_theory.optimizers.ZeroStateUpdate` (its hyperparameters
            are used).
        hyper: hyperparameter overrides (see :func:`default_hyper`).
        dim: number of gradient coordinates used (default 3; ``>= 2`` so pairings show).

    Returns:
        ``True``/``False`` when decided, ``None`` when sympy cannot decide.

    Raises:
        TypeError: if ``update`` is neither a name nor a ``ZeroStateUpdate``.
        ValueError: on an unknown name or hyperparameter.
    """
    if not isinstance(update, (str, ZeroStateUpdate)):
        raise TypeError(f"update must be a name or a ZeroStateUpdate, got {type(update).__name__}")
    if isinstance(update, ZeroStateUpdate):
        hyper = {**default_hyper(update), **dict(hyper or {})}
        update = update.name
    dim = 3 if dim is None else dim
    bs = _b_symbols(int(dim))
    p = zero_state_step(update, bs, hyper)
    if not all(is_zero(e) for e in p.xreplace(dict.fromkeys(bs, 0))):
        return False
    inner = simplified((sp.Matrix(bs).T * p)[0, 0])
    if inner == 0:
        return False
    if all(p[i].free_symbols <= {bs[i]} for i in range(len(bs))):
        x = sp.Symbol("x", positive=True)
        verdicts = []
        for i in range(len(bs)):
            term = bs[i] * p[i]
            for sub in (x, -x):
                val = simplified(term.xreplace({bs[i]: sub}))
                verdicts.append(val.is_positive)
        if all(v is True for v in verdicts):
            return True
        if any(v is False for v in verdicts):
            return False
    return None
