r"""Zero-state first-step maps of optimizers, and the optimizers themselves.

A new residual block inserted into a trained network starts at parameters
:math:`\theta = 0`. Let :math:`b = \nabla_\theta J(0)` be the gradient of the
objective with respect to the new block's parameters (flattened to a 1-D
vector). An optimizer whose state is all zero/neutral (fresh moments, fresh
accumulators, step counter 0) takes the *zero-state update*

.. math::

    \theta_1 = -\eta \, P(b),

where :math:`P` is the optimizer's *first-step map*. :math:`P` is called
*descent-compatible* iff

.. math::

    P(0) = 0 \quad\text{and}\quad \langle b, P(b) \rangle > 0
    \quad \text{for all } b \neq 0 .

For a descent-compatible map the first-order change of :math:`J` along the
step is :math:`J(\theta_1) - J(0) = -\eta \langle b, P(b) \rangle + o(\eta)`,
i.e. strictly negative for small :math:`\eta`.

The package :mod:`depthsat_theory.optimizers` provides (this module holds the registry)

* :class:`ZeroStateUpdate`: the abstract first-step map, with a
  :meth:`~ZeroStateUpdate.make_optimizer` that builds the *real* optimizer
  (a ``torch.optim`` class where torch has one) with the same hyperparameters,
  so the map can be checked against an actual ``.step()``;
* :data:`UPDATES`: a registry of concrete maps (SGD, momentum SGD, Nesterov,
  Adam, AdamW, RMSprop, Adagrad, signSGD, Lion, and the planted
  non-descent-compatible ``"rotation"``);
* :class:`SignSGD`, :class:`Lion`, :class:`RotationOptimizer`:
  ``torch.optim.Optimizer`` subclasses for the maps torch does not ship;
* :func:`threshold`, :func:`is_descent_compatible`: helpers for predictions
  and for a numerical check of the descent-compatibility predicate.

The registered hyperparameters are fixed (see :data:`UPDATES`); variants can
be made with :func:`dataclasses.replace`, e.g.
``dataclasses.replace(get_update("adam"), eps=1e-6)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from depthsat_theory.optimizers.base import ZeroStateUpdate
from depthsat_theory.optimizers.first_steps import (
    AdagradUpdate,
    AdamUpdate,
    AdamWUpdate,
    LionUpdate,
    MomentumUpdate,
    NesterovUpdate,
    RMSpropUpdate,
    RotationUpdate,
    SGDUpdate,
    SignSGDUpdate,
)

__all__ = [
    "DESCENT_COMPATIBLE",
    "UPDATES",
    "ZeroStateUpdate",
    "get_update",
    "resolve_update",
]


#: The zero-state updates by name (``sgd``, ``adam``, …, and the planted ``rotation``).
UPDATES: dict[str, ZeroStateUpdate] = {
    u.name: u
    for u in (
        SGDUpdate(),
        MomentumUpdate(),
        NesterovUpdate(),
        AdamUpdate(),
        AdamWUpdate(),
        RMSpropUpdate(),
        AdagradUpdate(),
        SignSGDUpdate(),
        LionUpdate(),
        RotationUpdate(),
    )
}
"""Registry of first-step maps, keyed by name.

Hyperparameters: ``sgd`` (none); ``momentum`` :math:`\\mu = 0.9`;
``nesterov`` :math:`\\mu = 0.9`; ``adam`` betas (0.9, 0.999), eps 1e-8;
``adamw`` the same plus weight_decay 0.01; ``rmsprop`` alpha 0.99, eps 1e-8;
``adagrad`` initial_accumulator_value 0.1, eps 1e-10; ``signsgd`` (none);
``lion`` betas (0.9, 0.99), weight_decay 0; ``rotation`` (none, not
descent-compatible).
"""

DESCENT_COMPATIBLE: tuple[str, ...] = tuple(name for name, u in UPDATES.items() if u.descent_compatible)
"""Names in :data:`UPDATES` whose map is declared descent-compatible."""


def get_update(name: str) -> ZeroStateUpdate:
    """Look up a first-step map by name.

    Args:
        name: One of the keys of :data:`UPDATES`.

    Returns:
        The registered :class:`ZeroStateUpdate` instance.

    Raises:
        ValueError: If ``name`` is not a registered name; the message lists
            the valid names.
    """
    if isinstance(name, str) and name in UPDATES:
        return UPDATES[name]
    raise ValueError(f"unknown update {name!r}; valid names: {', '.join(sorted(UPDATES))}")


#: Fields of a :class:`ZeroStateUpdate` that are not hyperparameters.
_NOT_HYPER = ("name", "descent_compatible")


def resolve_update(update: str | ZeroStateUpdate, hyper: Mapping[str, Any] | None = None) -> ZeroStateUpdate:
    """The map named or given by ``update``, with hyperparameters overridden by ``hyper``.

    The argument convention shared by the numeric and the symbolic
    ``is_descent_compatible``.

    Args:
        update: a name in :data:`UPDATES` or a :class:`ZeroStateUpdate` instance.
        hyper: hyperparameter overrides (dataclass field names, e.g. ``{"eps": 1e-6}``),
            applied with :func:`dataclasses.replace`.

    Returns:
        The resolved :class:`ZeroStateUpdate` (``update`` itself when ``hyper`` is empty).

    Raises:
        TypeError: if ``update`` is neither a string nor a :class:`ZeroStateUpdate`.
        ValueError: on an unknown name, or a key of ``hyper`` that is not a
            hyperparameter of the map (the message lists the valid ones).
    """
    if isinstance(update, str):
        update = get_update(update)
    elif not isinstance(update, ZeroStateUpdate):
        raise TypeError(f"update must be a name or a ZeroStateUpdate, got {type(update).__name__}")
    if not hyper:
        return update
    valid = sorted(f.name for f in dataclasses.fields(update) if f.name not in _NOT_HYPER)
    bad = sorted(set(hyper) - set(valid))
    if bad:
        raise ValueError(f"{update.name} has no hyperparameter {bad[0]!r}; it has {valid}")
    return dataclasses.replace(update, **dict(hyper))
