"""Choose the streaming statistics that fit a residual family."""

from __future__ import annotations

from depthsat_theory.families import FamilyError, FeatureFamily, GeneralFamily, ResidualFamily
from depthsat_theory.statistics.feature import FeatureStatistics
from depthsat_theory.statistics.general import GeneralStatistics

__all__ = ["statistics_for"]


def statistics_for(family: ResidualFamily, shape, layout: str, *, pool_ties: bool = False):
    """The right streaming accumulator for a family at a site.

    Returns:
        :class:`FeatureStatistics` for feature families (cross-gradient path),
        :class:`GeneralStatistics` otherwise (matrix-free ``torch.func`` path).
    """
    if isinstance(family, FeatureFamily):
        return FeatureStatistics(family, shape, layout, pool_ties=pool_ties)
    if isinstance(family, GeneralFamily):
        return GeneralStatistics(family, shape, layout, pool_ties=pool_ties)
    raise FamilyError(f"no statistics for family type {type(family).__name__}")
