r"""The concrete zero-state first-step maps, one frozen dataclass per optimizer (T3).

Instances are registered in :data:`depthsat_theory.optimizers.UPDATES`; variants are
made with :func:`dataclasses.replace`.

First steps of the torch 2.13 optimizers from zero state (derived from the
algorithm boxes in the ``torch.optim`` documentation):

==========  ==============================================================
name        :math:`P(b)` (elementwise)
==========  ==============================================================
sgd         :math:`b`
momentum    :math:`b` (buffer starts as the gradient; dampening unused)
nesterov    :math:`(1 + \mu) b`
adam(w)     :math:`b / (|b| + \epsilon)` (bias correction:
            :math:`\hat m = b`, :math:`\hat v = b^2`)
rmsprop     :math:`b / (\sqrt{1 - \alpha}\,|b| + \epsilon)`
adagrad     :math:`b / (\sqrt{a_0 + b^2} + \epsilon)`
signsgd     :math:`\operatorname{sign}(b)`
lion        :math:`\operatorname{sign}(b)`
rotation    :math:`(x, y) \mapsto (-y, x)` on coordinate pairs
==========  ==============================================================

Weight decay is inert at :math:`\theta = 0`: coupled decay adds
:math:`\lambda\theta = 0` to the gradient, decoupled decay multiplies
:math:`\theta = 0`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from depthsat_theory.optimizers.base import ZeroStateUpdate
from depthsat_theory.optimizers.numerics import check_beta, check_lr, check_nonneg, rotate
from depthsat_theory.optimizers.torch_optim import Lion, RotationOptimizer, SignSGD

__all__ = [
    "AdagradUpdate",
    "AdamUpdate",
    "AdamWUpdate",
    "LionUpdate",
    "MomentumUpdate",
    "NesterovUpdate",
    "RMSpropUpdate",
    "RotationUpdate",
    "SGDUpdate",
    "SignSGDUpdate",
]


@dataclass(frozen=True)
class SGDUpdate(ZeroStateUpdate):
    r"""Plain SGD: :math:`P(b) = b`.

    Source: ``torch.optim.SGD`` algorithm box, :math:`\theta_t = \theta_{t-1}
    - \gamma g_t` with momentum 0.
    """

    name: str = field(default="sgd", init=False)
    descent_compatible: bool = field(default=True, init=False)
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        check_nonneg(self.weight_decay, "weight_decay")

    def _map(self, b: torch.Tensor) -> torch.Tensor:
        return b.clone()

    def make_optimizer(self, params, lr):
        """``torch.optim.SGD`` (no momentum) with this weight decay; see :meth:`ZeroStateUpdate.make_optimizer`."""
        return torch.optim.SGD(params, lr=check_lr(lr), weight_decay=self.weight_decay)


@dataclass(frozen=True)
class MomentumUpdate(ZeroStateUpdate):
    r"""Heavy-ball SGD, :math:`\mu = 0.9`: :math:`P(b) = b`.

    Source: ``torch.optim.SGD`` algorithm box: at :math:`t = 1` the buffer is
    :math:`\mathbf{b}_1 = g_1` (dampening is not applied on the first step).
    """

    name: str = field(default="momentum", init=False)
    descent_compatible: bool = field(default=True, init=False)
    momentum: float = 0.9
    dampening: float = 0.0

    def __post_init__(self) -> None:
        check_beta(self.momentum, "momentum")

    def _map(self, b: torch.Tensor) -> torch.Tensor:
        return b.clone()

    def make_optimizer(self, params, lr):
        """``torch.optim.SGD`` with this momentum and dampening; see :meth:`ZeroStateUpdate.make_optimizer`."""
        return torch.optim.SGD(params, lr=check_lr(lr), momentum=self.momentum, dampening=self.dampening)


@dataclass(frozen=True)
class NesterovUpdate(ZeroStateUpdate):
    r"""Nesterov SGD, :math:`\mu = 0.9`: :math:`P(b) = (1 + \mu) b`.

    Source: ``torch.optim.SGD`` algorithm box: :math:`\mathbf{b}_1 = g_1`,
    :math:`g_1 \leftarrow g_1 + \mu \mathbf{b}_1`.
    """

    name: str = field(default="nesterov", init=False)
    descent_compatible: bool = field(default=True, init=False)
    momentum: float = 0.9

    def __post_init__(self) -> None:
        check_beta(self.momentum, "momentum")
        if self.momentum == 0.0:
            raise ValueError("Nesterov momentum requires momentum > 0")

    def _map(self, b: torch.Tensor) -> torch.Tensor:
        return b + self.momentum * b

    def make_optimizer(self, params, lr):
        """``torch.optim.SGD`` with this momentum and ``nesterov=True``; see :meth:`ZeroStateUpdate.make_optimizer`."""
        return torch.optim.SGD(params, lr=check_lr(lr), momentum=self.momentum, nesterov=True)


@dataclass(frozen=True)
class AdamUpdate(ZeroStateUpdate):
    r"""Adam, betas (0.9, 0.999), eps 1e-8: :math:`P(b) = b / (|b| + \epsilon)`.

    Source: Kingma & Ba (2015) and the ``torch.optim.Adam`` algorithm box:
    :math:`m_1 = (1-\beta_1) b`, :math:`v_1 = (1-\beta_2) b^2`, bias
    correction gives :math:`\hat m_1 = b`, :math:`\hat v_1 = b^2`.
    Descent-compatible for :math:`\epsilon > 0`:
    :math:`\langle b, P(b)\rangle = \sum_i b_i^2 / (|b_i| + \epsilon)`.
    """

    name: str = field(default="adam", init=False)
    descent_compatible: bool = field(default=True, init=False)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        check_beta(self.betas[0], "betas[0]")
        check_beta(self.betas[1], "betas[1]")
        if not (math.isfinite(self.eps) and self.eps > 0.0):
            raise ValueError(f"eps must be finite and > 0, got {self.eps}")
        check_nonneg(self.weight_decay, "weight_decay")

    def _map(self, b: torch.Tensor) -> torch.Tensor:
        return b / (b.abs() + self.eps)

    def make_optimizer(self, params, lr):
        """``torch.optim.Adam`` (``torch.optim.AdamW`` for ``adamw``) with these betas, eps and weight decay.

        See :meth:`ZeroStateUpdate.make_optimizer`.
        """
        cls = torch.optim.AdamW if self.name == "adamw" else torch.optim.Adam
        return cls(
            params,
            lr=check_lr(lr),
            betas=self.betas,
            eps=self.eps,
            weight_decay=self.weight_decay,
        )


@dataclass(frozen=True)
class AdamWUpdate(AdamUpdate):
    r"""AdamW, betas (0.9, 0.999), eps 1e-8, weight decay 0.01.

    :math:`P(b) = b / (|b| + \epsilon)`; the decoupled decay
    :math:`\theta \leftarrow \theta(1 - \eta\lambda)` is inert at
    :math:`\theta = 0`. Source: Loshchilov & Hutter (2019) and the
    ``torch.optim.AdamW`` algorithm box.
    """

    name: str = field(default="adamw", init=False)
    weight_decay: float = 0.01


@dataclass(frozen=True)
class RMSpropUpdate(ZeroStateUpdate):
    r"""RMSprop (not centered), alpha 0.99, eps 1e-8.

    .. math::

        P(b) = \frac{b}{\sqrt{1 - \alpha}\,|b| + \epsilon}

    Source: ``torch.optim.RMSprop`` algorithm box (no bias correction):
    :math:`v_1 = (1 - \alpha) b^2`, step :math:`b / (\sqrt{v_1} + \epsilon)`.
    """

    name: str = field(default="rmsprop", init=False)
    descent_compatible: bool = field(default=True, init=False)
    alpha: float = 0.99
    eps: float = 1e-8

    def __post_init__(self) -> None:
        check_beta(self.alpha, "alpha")
        if not (math.isfinite(self.eps) and self.eps > 0.0):
            raise ValueError(f"eps must be finite and > 0, got {self.eps}")

    def _map(self, b: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as torch: sqrt((1 - alpha) * b * b) + eps.
        return b / (torch.sqrt((1.0 - self.alpha) * (b * b)) + self.eps)

    def make_optimizer(self, params, lr):
        """``torch.optim.RMSprop`` (not centered) with this alpha and eps.

        See :meth:`ZeroStateUpdate.make_optimizer`.
        """
        return torch.optim.RMSprop(params, lr=check_lr(lr), alpha=self.alpha, eps=self.eps)


@dataclass(frozen=True)
class AdagradUpdate(ZeroStateUpdate):
    r"""Adagrad, initial_accumulator_value 0.1, eps 1e-10.

    .. math::

        P(b) = \frac{b}{\sqrt{a_0 + b^2} + \epsilon}

    Source: Duchi et al. (2011) and the ``torch.optim.Adagrad`` algorithm box
    (``lr_decay`` is irrelevant at step 1).
    """

    name: str = field(default="adagrad", init=False)
    descent_compatible: bool = field(default=True, init=False)
    initial_accumulator_value: float = 0.1
    eps: float = 1e-10

    def __post_init__(self) -> None:
        a0 = check_nonneg(self.initial_accumulator_value, "initial_accumulator_value")
        eps = check_nonneg(self.eps, "eps")
        if a0 == 0.0 and eps == 0.0:
            raise ValueError("initial_accumulator_value and eps cannot both be 0")

    def _map(self, b: torch.Tensor) -> torch.Tensor:
        return b / (torch.sqrt(self.initial_accumulator_value + b * b) + self.eps)

    def make_optimizer(self, params, lr):
        """``torch.optim.Adagrad`` with this initial accumulator value and eps.

        See :meth:`ZeroStateUpdate.make_optimizer`.
        """
        return torch.optim.Adagrad(
            params,
            lr=check_lr(lr),
            initial_accumulator_value=self.initial_accumulator_value,
            eps=self.eps,
        )


@dataclass(frozen=True)
class SignSGDUpdate(ZeroStateUpdate):
    r"""signSGD: :math:`P(b) = \operatorname{sign}(b)`.

    :math:`\langle b, P(b)\rangle = \|b\|_1`. Source: Bernstein et al. (2018).
    """

    name: str = field(default="signsgd", init=False)
    descent_compatible: bool = field(default=True, init=False)

    def _map(self, b: torch.Tensor) -> torch.Tensor:
        return torch.sign(b)

    def make_optimizer(self, params, lr):
        """:class:`~depthsat_theory.optimizers.torch_optim.SignSGD`; see :meth:`ZeroStateUpdate.make_optimizer`."""
        return SignSGD(params, lr=check_lr(lr))


@dataclass(frozen=True)
class LionUpdate(ZeroStateUpdate):
    r"""Lion, betas (0.9, 0.99), weight decay 0: :math:`P(b) = \operatorname{sign}(b)`.

    From :math:`m = 0`, :math:`c = (1 - \beta_1) b`, so the first step is
    :math:`\operatorname{sign}(b)` (the decay term is inert at 0).
    Source: Chen et al. (2023), Alg. 2.
    """

    name: str = field(default="lion", init=False)
    descent_compatible: bool = field(default=True, init=False)
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        check_beta(self.betas[0], "betas[0]")
        check_beta(self.betas[1], "betas[1]")
        check_nonneg(self.weight_decay, "weight_decay")

    def _map(self, b: torch.Tensor) -> torch.Tensor:
        return torch.sign(b)

    def make_optimizer(self, params, lr):
        """:class:`~depthsat_theory.optimizers.torch_optim.Lion` with these betas and weight decay.

        See :meth:`ZeroStateUpdate.make_optimizer`.
        """
        return Lion(params, lr=check_lr(lr), betas=self.betas, weight_decay=self.weight_decay)


@dataclass(frozen=True)
class RotationUpdate(ZeroStateUpdate):
    r"""Planted non-descent-compatible map (converse evidence).

    Pairs coordinates :math:`(0,1), (2,3), \dots` and maps
    :math:`(x, y) \mapsto (-y, x)`; an odd trailing coordinate maps to 0.
    Hence :math:`\langle b, P(b)\rangle = 0` exactly for every :math:`b`.
    """

    name: str = field(default="rotation", init=False)
    descent_compatible: bool = field(default=False, init=False)

    def _map(self, b: torch.Tensor) -> torch.Tensor:
        return rotate(b)

    def make_optimizer(self, params, lr):
        """:class:`~depthsat_theory.optimizers.torch_optim.RotationOptimizer`.

        See :meth:`ZeroStateUpdate.make_optimizer`.
        """
        return RotationOptimizer(params, lr=check_lr(lr))
