"""Anytime-valid certification from a probe that grows batch by batch (``thm-sequential``).

Checkpoint ``j`` uses the level :math:`δ_j = δ/(j(j+1))` (:func:`spending`); since
:math:`Σ_j δ_j = δ`, every checkpoint's interval holds simultaneously with probability
:math:`≥ 1 − δ`, whatever the stopping rule (theory page ``theory/finite-sample.md``).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from depthsat_theory.bounds.constants import BoundError, check_delta, check_number
from depthsat_theory.bounds.interval import ScoreInterval, interval_from_moments
from depthsat_theory.bounds.moments import ProbeMoments
from depthsat_theory.bounds.statistics import BoundStatistics
from depthsat_theory.families import FamilyError, FeatureFamily
from depthsat_theory.vocabulary import Certificate, Layout

__all__ = ["SequentialCertifier", "spending"]

_DECISIONS = (Certificate.IMPROVABLE, Certificate.SATURATED)


def spending(j: int, delta: float) -> float:
    """Level :math:`δ_j = δ / (j (j + 1))` of checkpoint ``j = 1, 2, …`` (:math:`Σ_j δ_j = δ`).

    Args:
        j: checkpoint index :math:`≥ 1`.
        delta: total level :math:`δ ∈ (0, 1)`.

    Returns:
        :math:`δ_j = δ / (j (j + 1))`.
    """
    return delta / (j * (j + 1))


class SequentialCertifier:
    """Certify a site either way from a probe that grows batch by batch (``thm-sequential``).

    Checkpoint ``j`` (after the ``j``-th call of :meth:`update` / :meth:`add_moments`)
    reports the interval of :func:`interval_from_moments` at level :math:`δ_j = δ/(j(j+1))`.
    Since :math:`Σ_j δ_j = δ`, all intervals hold simultaneously with probability
    :math:`≥ 1 − δ`, so stopping at the first checkpoint that certifies the site
    (improvable, or ε-saturated) keeps the guarantee, whatever the stopping rule.  The
    batch sizes must not depend on the data seen (fixed in advance).

    Args:
        delta: overall :math:`δ ∈ (0, 1)`.
        epsilon: the :math:`ε` of the saturation certificate (``None``: stop only on
            "improvable").
        family, shape, layout: the site, for :meth:`update` (``None``: use
            :meth:`add_moments`).
        keep_probe: keep rows (exact probe leverage for plug-in constants).
        **constants: passed to :func:`interval_from_moments` (``grad_max``, …).

    Raises:
        BoundError: on a bad :math:`δ`, :math:`ε` or constant.
    """

    def __init__(
        self,
        delta: float,
        *,
        epsilon: float | None = None,
        family: FeatureFamily | None = None,
        shape: Any = None,
        layout: str = Layout.VECTOR,
        keep_probe: bool = False,
        **constants: Any,
    ) -> None:
        self.delta = check_delta(delta)
        self.epsilon = check_number("epsilon", epsilon, positive=True)
        self.constants = constants
        self.history: list[ScoreInterval] = []
        self.stats: BoundStatistics | None = None
        if family is not None:
            if not isinstance(family, FeatureFamily):
                raise FamilyError("the sequential certifier needs a zero-output feature family")
            self.stats = BoundStatistics(family, shape, layout, keep_probe=keep_probe)

    @property
    def decision(self) -> Certificate | None:
        """The first certificate reached (``None`` while not certified)."""
        for step in self.history:
            if step.certificate in _DECISIONS:
                return Certificate(step.certificate)
        return None

    @property
    def stopped_at(self) -> int | None:
        """Probe size at the first certificate (``None`` while not certified)."""
        for step in self.history:
            if step.certificate in _DECISIONS:
                return step.n
        return None

    def add_moments(self, m: ProbeMoments) -> ScoreInterval:
        """Record checkpoint ``j`` with the cumulative probe's moments ``m``.

        Args:
            m: the moments of the cumulative probe up to this checkpoint.

        Returns:
            The checkpoint's :class:`ScoreInterval` at level :math:`δ_j` (also appended to ``history``).

        Raises:
            BoundError: as :func:`interval_from_moments`.
        """
        j = len(self.history) + 1
        step = interval_from_moments(m, spending(j, self.delta), epsilon=self.epsilon, **self.constants)
        step.notes.append(f"checkpoint {j}: level δ_j = δ/(j(j+1)) = {spending(j, self.delta):.3g}")
        self.history.append(step)
        return step

    def update(self, z: Tensor, g: Tensor) -> ScoreInterval:
        """Add a batch (site tensors ``z`` and activation gradients ``g``, ``(B, *shape)``) and report.

        Args:
            z: site tensors, ``(B, *shape)``.
            g: activation gradients ``∂loss/∂z``, same shape as ``z``.

        Returns:
            The :class:`ScoreInterval` of the cumulative probe (see :meth:`add_moments`).

        Raises:
            BoundError: if the certifier was built without a family.
        """
        if self.stats is None:
            raise BoundError("no family was given: use add_moments, or pass family/shape/layout")
        self.stats.update(z, g)
        return self.add_moments(self.stats.moments())
