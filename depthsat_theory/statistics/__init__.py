"""Streaming statistics: the protocol, tangent statistics, the projector and saturation scores.

- :mod:`.protocol`: :class:`StreamingStatistic` (declared state with its reduction, ``merge``,
  ``state_dict``) and the exact-tie pool :class:`TiePool`;
- :mod:`.tangent`: :class:`TangentStatistics`, the state every tangent statistic shares
  (counts, ``‖g‖²``, ``max ‖g‖``, ``‖z‖²``, forward dtype, ties);
- :mod:`.feature`: zero-output feature families (``Σ``, ``G``) and the projector ``Π``;
- :mod:`.general`: general families ``h(θ, u)`` (``K``, ``b``, matrix-free);
- :mod:`.linalg`: the numerical error model (resolution cutoffs, the score's rounding bound, the noise test);
- :mod:`.result`: :class:`SaturationResult`, the result type every engine shares;
- :mod:`.factory`: :func:`statistics_for`, the statistics that fit a family.
"""

from depthsat_theory.statistics.factory import statistics_for
from depthsat_theory.statistics.feature import FeatureStatistics, TangentProjector
from depthsat_theory.statistics.general import GeneralStatistics
from depthsat_theory.statistics.linalg import (
    GRADIENT_ROUNDING_FACTOR,
    NOISE_ALPHA,
    Spectrum,
    default_rtol,
    default_tol,
    pinv_quadratic,
    resolve_spectrum,
    score_error,
    unit_roundoff,
)
from depthsat_theory.statistics.protocol import Reduction, StreamingStatistic, TiePool
from depthsat_theory.statistics.result import SaturationResult, StatisticsError
from depthsat_theory.statistics.tangent import TANGENT_GRAM_MAX_ELEMENTS, TangentStatistics, check_pair

__all__ = [
    "GRADIENT_ROUNDING_FACTOR",
    "NOISE_ALPHA",
    "TANGENT_GRAM_MAX_ELEMENTS",
    "FeatureStatistics",
    "GeneralStatistics",
    "Reduction",
    "SaturationResult",
    "Spectrum",
    "StatisticsError",
    "StreamingStatistic",
    "TangentProjector",
    "TangentStatistics",
    "TiePool",
    "check_pair",
    "default_rtol",
    "default_tol",
    "pinv_quadratic",
    "resolve_spectrum",
    "score_error",
    "statistics_for",
    "unit_roundoff",
]
