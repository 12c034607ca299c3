r"""The abstract zero-state first-step map :math:`P` (T3; see :mod:`depthsat_theory.optimizers`)."""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from depthsat_theory.optimizers.numerics import check_vector, exact_dot, threshold

__all__ = ["ZeroStateUpdate"]


@dataclass(frozen=True)
class ZeroStateUpdate(abc.ABC):
    r"""First-step map :math:`P` of an optimizer started from zero state.

    The zero-state update from :math:`\theta = 0` with gradient :math:`b` is
    :math:`\theta_1 = -\eta P(b)`. Concrete subclasses are frozen dataclasses
    holding the optimizer's hyperparameters; they implement :meth:`_map`
    (the math) and :meth:`make_optimizer` (the real optimizer with the same
    hyperparameters).

    Attributes:
        name: Registry name, e.g. ``"adam"``.
        descent_compatible: The declared (proved) property
            :math:`P(0) = 0` and :math:`\langle b, P(b)\rangle > 0` for all
            :math:`b \ne 0`. :func:`is_descent_compatible` checks it
            numerically.
    """

    name: str
    descent_compatible: bool

    @abc.abstractmethod
    def _map(self, b: torch.Tensor) -> torch.Tensor:
        """Apply :math:`P` to a validated flat vector (no validation here)."""

    @abc.abstractmethod
    def make_optimizer(self, params: Iterable[torch.Tensor] | Iterable[dict], lr: float) -> torch.optim.Optimizer:
        r"""Build the real optimizer whose first step from zero state is :math:`P`.

        Args:
            params: Parameters or parameter groups, as for any
                ``torch.optim.Optimizer``.
            lr: Learning rate :math:`\eta`, finite and ``>= 0``.

        Returns:
            A fresh optimizer (``torch.optim`` class where torch has one,
            otherwise :class:`SignSGD`, :class:`Lion` or
            :class:`RotationOptimizer`) with this map's hyperparameters.

        Raises:
            ValueError: If ``lr`` is not finite and ``>= 0``.
        """

    def first_step(self, b: torch.Tensor) -> torch.Tensor:
        r"""Return :math:`P(b)`, the zero-state step direction.

        Args:
            b: Flat gradient :math:`b = \nabla_\theta J(0)`, shape ``(d,)``,
                real floating dtype, finite.

        Returns:
            :math:`P(b)`, shape ``(d,)``, same dtype and device as ``b``.
            The zero-state update is ``-lr * P(b)``.

        Raises:
            ValueError: If ``b`` is not a finite 1-D floating tensor.
        """
        check_vector(b, "b")
        out = self._map(b)
        if out.shape != b.shape or out.dtype != b.dtype or out.device != b.device:
            raise RuntimeError(  # pragma: no cover - guards subclasses
                f"{type(self).__name__}._map returned shape {tuple(out.shape)}, "
                f"dtype {out.dtype}, device {out.device} for input of shape "
                f"{tuple(b.shape)}, dtype {b.dtype}, device {b.device}"
            )
        return out

    def predicted_change_rate(self, b: torch.Tensor, tau: float = 0.0) -> float:
        r"""First-order rate of change of :math:`J` along the zero-state update.

        .. math::

            \frac{d}{d\eta} J(-\eta P(\tilde b))\Big|_{\eta = 0}
            = -\langle b, P(\tilde b)\rangle,
            \qquad \tilde b = \operatorname{threshold}(b, \tau).

        The inner product is formed in float64 with an exactly rounded sum.

        Args:
            b: Flat gradient, shape ``(d,)``, real floating dtype, finite.
            tau: Rounding bound for :func:`threshold` (``>= 0``).

        Returns:
            :math:`-\langle b, P(\operatorname{threshold}(b, \tau))\rangle`
            as a Python ``float`` (negative means first-order descent).

        Raises:
            ValueError: If ``b`` is invalid or ``tau`` is negative/NaN.
        """
        return -exact_dot(b, self.first_step(threshold(b, tau)))
