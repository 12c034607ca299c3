"""Streaming tangent statistics, the projector onto the tangent space and saturation scores."""

from depthsat_theory.statistics.tangent import (
    GRAM_FACTOR,
    TANGENT_GRAM_MAX_ELEMENTS,
    TOL_FACTOR,
    FeatureStatistics,
    GeneralStatistics,
    SaturationResult,
    StatisticsError,
    TangentProjector,
    default_rtol,
    default_tol,
    pinv_quadratic,
    statistics_for,
)

__all__ = [
    "GRAM_FACTOR",
    "TANGENT_GRAM_MAX_ELEMENTS",
    "TOL_FACTOR",
    "FeatureStatistics",
    "GeneralStatistics",
    "SaturationResult",
    "StatisticsError",
    "TangentProjector",
    "default_rtol",
    "default_tol",
    "pinv_quadratic",
    "statistics_for",
]
