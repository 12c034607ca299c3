"""The confidence interval of a dumped probe: arrays of activations and activation gradients."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from depthsat_theory.bounds.constants import check_delta, check_n, check_number
from depthsat_theory.bounds.interval import ScoreInterval
from depthsat_theory.bounds.statistics import BoundStatistics
from depthsat_theory.families import FamilyError, FeatureFamily, ResidualFamily
from depthsat_theory.vocabulary import Layout

__all__ = ["interval_from_probe"]


def interval_from_probe(
    z: np.ndarray,
    g: np.ndarray,
    family: ResidualFamily,
    *,
    delta: float,
    epsilon: float | None = None,
    candidates: int = 1,
    bootstrap: int = 200,
    seed: int = 0,
    **constants: Any,
) -> ScoreInterval:
    """The :math:`(1 − δ)` interval for the score of ``family`` on a vector-site probe (``thm-finite-sample``).

    Each row of ``z`` and ``g`` is one example (one unit); the probe's rows are kept, so
    the bootstrap and the exact probe leverage are available.

    Args:
        z: activations, ``(n, d)``, float32 or float64.
        g: activation gradients, ``(n, d)``, same dtype (loss units per activation unit).
        family: a zero-output feature family.
        delta: :math:`δ ∈ (0, 1)`.
        epsilon: the :math:`ε` of the saturation certificate (``None``: no such verdict).
        candidates: union-bound count :math:`m ≥ 1`.
        bootstrap: bootstrap resamples (``0``: none).
        seed: bootstrap seed.
        **constants: ``grad_max``, ``leverage_max``, ``feature_norm_max``, ``eig_floor``,
            ``ridge``, ``variance``, ``dim`` (see :func:`interval_from_moments`).

    Returns:
        The :class:`ScoreInterval`.

    Raises:
        BoundError: bad :math:`δ`, :math:`ε`, ``candidates``, ``bootstrap`` or constants (the
            message names the Python argument).
        FamilyError: if ``family`` is not a zero-output feature family.
    """
    check_delta(delta)
    check_n(candidates, "candidates")
    check_number("epsilon", epsilon, positive=True)
    check_number("bootstrap", bootstrap)
    if not isinstance(family, FeatureFamily):
        raise FamilyError(
            f"confidence bounds need a zero-output feature family, not "
            f"{getattr(family, 'spec', type(family).__name__)!r}"
        )
    stats = BoundStatistics(family, (z.shape[1],), Layout.VECTOR, keep_probe=True)
    stats.update(torch.from_numpy(np.ascontiguousarray(z)), torch.from_numpy(np.ascontiguousarray(g)))
    return stats.interval(
        delta, epsilon=epsilon, candidates=candidates, bootstrap=int(bootstrap), seed=seed, **constants
    )
