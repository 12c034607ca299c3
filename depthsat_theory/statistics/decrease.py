"""How much loss a block can remove with a finite step (theory/decrease.md).

With the features fixed, a zero-output block adds a field ``f ∈ T`` to the site, and the loss is
a function ``F(f) = J`` of that field with ``∇F(0) = g`` (T1).  If ``F`` is ``β``-smooth on ``T``
in the function-space norm, the step ``f = −Πg/β`` lowers ``J`` by at least ``s²/(2β)``
(``thm-guaranteed-decrease``); no field of norm ``r`` lowers it by more than ``s r + β r²/2``
(``prop-decrease-upper``); under ``μ``-strong convexity on ``T`` the best decrease is at most
``s²/(2μ)``, and for squared error at the output site it is exactly ``s²/2``
(``prop-squared-error-exact``).  ``β`` for a cross-entropy head ``softmax(W z + c)`` is at most
``½ ‖W‖₂²`` per unit (``lem-ce-smoothness``) **at the head's input only**; one layer deeper it is not a
smoothness constant (``ex-beta-misapplied``).  For a hidden site followed by a twice-differentiable
per-unit map ``m`` with ``‖Dm‖ ≤ L`` and ``‖D²m[v, v]‖ ≤ H‖v‖²`` before the head,
``β ≤ ½‖W‖₂² L² + √2 ‖W‖₂ H`` (``prop-beta-composed``); :func:`chain_constants` gives ``(L, H)`` for
chains of linear maps, smooth elementwise activations and residual branches of them
(``cor-beta-chain``).  With a ``relu`` (any kink) or a normalization downstream no finite ``β`` is
proven: a given ``β`` is then only checked on the probe (``cor-beta-refuted``).

All decreases are in loss units per example (nats per example for cross-entropy).
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = [
    "ACTIVATION_CONSTANTS",
    "DEFAULT_EPSILON_NATS",
    "best_decrease_bound",
    "chain_constants",
    "composed_smoothness",
    "cross_entropy_smoothness",
    "decrease_upper_bound",
    "epsilon_from_nats",
    "guaranteed_decrease",
    "squared_error_decrease",
]

#: The default loss tolerance behind "certified ε-saturated" when ``β`` is known (nats per example).
DEFAULT_EPSILON_NATS = 1e-3


def _check(name: str, value: float, *, positive: bool) -> float:
    v = float(value)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        what = "positive" if positive else "non-negative"
        raise ValueError(f"{name} must be a finite {what} number, got {value!r}")
    return v


def guaranteed_decrease(score: float, beta: float) -> float:
    r"""``s² / (2β)``: the decrease the step ``−Πg/β`` is guaranteed (``thm-guaranteed-decrease``).

    .. math:: J(0) - J(-\Pi g/\beta) \ge \frac{s^2}{2\beta}

    Args:
        score: ``s = ‖Πg‖`` (loss units per example per unit function-space step).
        beta: smoothness constant of the loss in the added field on ``T`` (loss units per
            example per squared unit step), e.g. :func:`cross_entropy_smoothness`.

    Returns:
        The guaranteed decrease in loss units per example.

    Raises:
        ValueError: ``score < 0`` or ``beta ≤ 0`` or either not finite.
    """
    s = _check("score", score, positive=False)
    return s * s / (2 * _check("beta", beta, positive=True))


def decrease_upper_bound(score: float, radius: float, beta: float) -> float:
    """``s r + β r²/2``: no block of function-space size ``r`` removes more (``prop-decrease-upper``).

    Args:
        score: ``s ≥ 0`` (loss units per unit step).
        radius: ``r ≥ 0``, the block's function-space size.
        beta: ``β ≥ 0``, the smoothness constant of the loss.

    Returns:
        ``s r + β r²/2`` (loss units).

    Raises:
        ValueError: a negative or non-finite argument (``beta = 0`` is allowed).
    """
    s, r = _check("score", score, positive=False), _check("radius", radius, positive=False)
    return s * r + _check("beta", beta, positive=False) * r * r / 2


def best_decrease_bound(score: float, mu: float) -> float:
    """``s² / (2μ)``: the best decrease of a ``μ``-strongly convex loss on ``T`` (``prop-decrease-upper``).

    Args:
        score: ``s ≥ 0`` (loss units per unit step).
        mu: ``μ > 0``, the strong-convexity constant of the loss on ``T``.

    Returns:
        ``s² / (2μ)`` (loss units, e.g. nats).

    Raises:
        ValueError: ``mu ≤ 0`` or a non-finite argument.
    """
    s = _check("score", score, positive=False)
    return s * s / (2 * _check("mu", mu, positive=True))


def squared_error_decrease(score: float) -> float:
    """``s² / 2``: the exact best decrease at an output site under ``ℓ = ½‖ŷ − y‖²`` (``prop-squared-error-exact``).

    Args:
        score: ``s ≥ 0`` at the output site.

    Returns:
        ``s² / 2`` (loss units).

    Raises:
        ValueError: a negative or non-finite ``score``.
    """
    s = _check("score", score, positive=False)
    return s * s / 2


def cross_entropy_smoothness(weight, *, units_per_example: int = 1) -> float:
    """``β ≤ ½ ‖W‖₂² / T``: smoothness of cross-entropy through a linear head ``W z + c`` (``lem-ce-smoothness``).

    The Hessian of ``CE(Wz + c, y)`` in ``z`` is ``Wᵀ (diag p − p pᵀ) W`` and
    ``λ_max(diag p − p pᵀ) ≤ ½``; with the per-example loss the mean over ``T`` units
    (tokens) each unit's curvature is divided by ``T``.

    Args:
        weight: the head's weight ``(classes, d)`` (tensor or array).
        units_per_example: the smallest number of units averaged in one example's loss (``1`` for a
            per-example classifier, the shortest sequence length for a token-mean loss).

    Returns:
        ``β`` in nats per example per squared unit step.

    Raises:
        ValueError: a weight that is not 2-D or not finite, or ``units_per_example < 1``.
    """
    w = weight.detach().to(torch.float64).cpu().numpy() if isinstance(weight, torch.Tensor) else np.asarray(weight)
    if w.ndim != 2 or not np.isfinite(w).all():
        raise ValueError(f"weight must be a finite (classes, d) matrix, got shape {w.shape}")
    if int(units_per_example) < 1:
        raise ValueError(f"units_per_example must be >= 1, got {units_per_example}")
    return 0.5 * float(np.linalg.norm(w, 2)) ** 2 / int(units_per_example)


def epsilon_from_nats(nats: float, beta: float) -> float:
    """``ε = sqrt(2 β ε_J)``: the score tolerance at which the guaranteed decrease is ``ε_J`` nats.

    A site certified ``ε``-saturated with this ``ε`` has ``s²/(2β) ≤ ε_J``: even the step
    ``−Πg/β`` is promised no more than ``ε_J`` (and, when ``μ = β``, as for squared error at the
    output, no block removes more).

    Args:
        nats: ``ε_J > 0``, the decrease in loss units (nats for cross-entropy).
        beta: ``β > 0``, the smoothness constant of the loss.

    Returns:
        ``ε = sqrt(2 β ε_J)`` (loss units per unit step).

    Raises:
        ValueError: ``nats ≤ 0`` or ``beta ≤ 0``.
    """
    return math.sqrt(2 * _check("beta", beta, positive=True) * _check("nats", nats, positive=True))


#: ``(sup |σ'|, sup |σ''|)`` of the smooth elementwise activations (``cor-beta-chain``): tanh
#: ``(1, 4/(3√3))``, sigmoid ``(1/4, 1/(6√3))``, exact GELU ``x Φ(x)``: ``GELU' = Φ + xφ`` peaks at
#: ``x = √2`` and ``GELU'' = φ(x)(2 − x²)`` at ``x = 0`` (``√(2/π)``); the identity ``(1, 0)``.
ACTIVATION_CONSTANTS: dict[str, tuple[float, float]] = {
    "tanh": (1.0, 4.0 / (3.0 * math.sqrt(3.0))),
    "sigmoid": (0.25, 1.0 / (6.0 * math.sqrt(3.0))),
    "gelu": (
        0.5 * (1.0 + math.erf(1.0)) + math.sqrt(2.0) * math.exp(-1.0) / math.sqrt(2.0 * math.pi),
        math.sqrt(2.0 / math.pi),
    ),
    "identity": (1.0, 0.0),
}


def _op_norm(weight) -> float:
    w = weight.detach().to(torch.float64).cpu().numpy() if isinstance(weight, torch.Tensor) else np.asarray(weight)
    if w.ndim != 2 or not np.isfinite(w).all():
        raise ValueError(f"a linear map must be a finite 2-D matrix, got shape {w.shape}")
    return float(np.linalg.norm(w, 2))


def _activation_name(module) -> str | None:
    from torch import nn

    if isinstance(module, nn.Tanh):
        return "tanh"
    if isinstance(module, nn.Sigmoid):
        return "sigmoid"
    if isinstance(module, nn.GELU) and module.approximate == "none":
        return "gelu"
    if isinstance(module, (nn.Identity, nn.Dropout)) and not module.training:
        return "identity"
    return None


def chain_constants(steps) -> tuple[float, float]:
    """``(L, H)``: Lipschitz and curvature constants of a chain of smooth maps (``cor-beta-chain``).

    ``L ≥ ‖Dm‖₂`` and ``H ≥ ‖D²m[v, v]‖/‖v‖²`` everywhere, for ``m`` the composition of ``steps``
    applied in order: composition gives ``L = L₂L₁``, ``H = H₂L₁² + L₂H₁``; a linear map ``A``
    has ``(‖A‖₂, 0)``; an elementwise activation :data:`ACTIVATION_CONSTANTS`; a residual
    branch ``x ↦ x + b(x)`` has ``(1 + L_b, H_b)``.

    Args:
        steps: a sequence of ``torch.nn.Linear`` (or 2-D weight tensors/arrays), smooth activation
            modules (``Tanh``, ``Sigmoid``, exact ``GELU``, ``Identity``, ``Dropout`` in eval mode),
            ``nn.Sequential`` of these, and ``("residual", steps)`` pairs for residual branches.

    Returns:
        ``(L, H)`` (dimensionless, and per unit input).

    Raises:
        ValueError: a step outside this class (``ReLU`` and other kinks, ``LayerNorm``/``RMSNorm``,
            tanh-approximated GELU, attention…): no finite constant is proven for it.
    """
    from torch import nn

    lip, curv = 1.0, 0.0
    for step in steps:
        if isinstance(step, tuple) and len(step) == 2 and step[0] == "residual":
            lb, hb = chain_constants(step[1])
            sl, sh = 1.0 + lb, hb
        elif isinstance(step, nn.Sequential):
            sl, sh = chain_constants(list(step))
        elif isinstance(step, nn.Linear):
            sl, sh = _op_norm(step.weight), 0.0
        elif isinstance(step, (torch.Tensor, np.ndarray)):
            sl, sh = _op_norm(step), 0.0
        elif (name := _activation_name(step)) is not None:
            sl, sh = ACTIVATION_CONSTANTS[name]
        else:
            raise ValueError(
                f"no smoothness constant is proven through {type(step).__name__} (cor-beta-chain covers linear maps, "
                "tanh/sigmoid/exact GELU and residual branches of them; kinks and normalizations have none)"
            )
        lip, curv = sl * lip, sh * lip * lip + sl * curv
    return lip, curv


def composed_smoothness(weight, lipschitz: float, curvature: float, *, units_per_example: int = 1) -> float:
    """``β ≤ (½‖W‖₂² L² + √2 ‖W‖₂ H) / T``: a hidden site followed by ``m`` and a cross-entropy head ``W``.

    ``prop-beta-composed``: the Hessian of ``CE(W m(z) + c, y)`` in ``z`` is
    ``Dmᵀ Wᵀ (diag p − ppᵀ) W Dm + Σ_k (Wᵀ(p − e_y))_k ∇²m_k`` and ``‖p − e_y‖₂ ≤ √2``.

    Args:
        weight: the head's weight ``(classes, p)``.
        lipschitz: ``L ≥ ‖Dm‖₂`` on the region the fields reach (e.g. from :func:`chain_constants`).
        curvature: ``H ≥ ‖D²m[v, v]‖ / ‖v‖²`` there.
        units_per_example: the smallest number of units averaged in one example's loss.

    Returns:
        ``β`` in loss units per example per squared unit step (``L = 1, H = 0`` gives
        :func:`cross_entropy_smoothness`).

    Raises:
        ValueError: a non-finite or negative constant, a bad weight, or ``units_per_example < 1``.
    """
    lip = _check("lipschitz", lipschitz, positive=False)
    curv = _check("curvature", curvature, positive=False)
    if int(units_per_example) < 1:
        raise ValueError(f"units_per_example must be >= 1, got {units_per_example}")
    w = _op_norm(weight)
    return (0.5 * w * w * lip * lip + math.sqrt(2.0) * w * curv) / int(units_per_example)
