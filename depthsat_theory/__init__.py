"""depthsat: first-order residual depth saturation (is this residual network deep enough?).

Public API (one concept per module):

- :mod:`~depthsat_theory.families`: residual families ``h_θ`` with ``h_0 ≡ 0``.
- :mod:`~depthsat_theory.tangent`: streaming tangent statistics, the projector ``Π``,
  saturation score ``s`` and the raw quantities (``r``, ``AG_rms``, ``AG_max``, ``ρ``).
- :mod:`~depthsat_theory.sites`: insertion sites in torch models (capture ``z``, ``g``;
  insert blocks; function-preservation check).
- :mod:`~depthsat_theory.optimizers`: zero-state first-step maps ``P``.
- :mod:`~depthsat_theory.bounds`: finite-sample confidence intervals, certificates and the
  sample-size calculator (T7).
- :mod:`~depthsat_theory.audit`: audits of a residual family (``depthsat audit``).
- :mod:`~depthsat_theory.symbolic`: the exact sympy engine answering the same questions.
- :mod:`~depthsat_theory.strategies`: hypothesis strategies for property-testing families.
- :mod:`~depthsat_theory.check`: the theorem checker behind ``depthsat check``.
- :mod:`~depthsat_theory.reference`: dense ``torch.func`` reference (tests).
"""

from .families import (
    FamilyError,
    FeatureFamily,
    GeneralFamily,
    ResidualFamily,
    parse_family,
)
from .optimizers import DESCENT_COMPATIBLE, UPDATES, ZeroStateUpdate, get_update, is_descent_compatible
from .sites import NotFunctionPreservingError, SiteError, SiteRecorder, accumulate, insert_block
from .tangent import (
    FeatureStatistics,
    GeneralStatistics,
    SaturationResult,
    StatisticsError,
    TangentProjector,
    statistics_for,
)

__version__ = "0.1.0"

__all__ = [
    "DESCENT_COMPATIBLE",
    "FamilyError",
    "FeatureFamily",
    "FeatureStatistics",
    "GeneralFamily",
    "GeneralStatistics",
    "NotFunctionPreservingError",
    "ResidualFamily",
    "SaturationResult",
    "SiteError",
    "SiteRecorder",
    "StatisticsError",
    "TangentProjector",
    "UPDATES",
    "ZeroStateUpdate",
    "accumulate",
    "get_update",
    "insert_block",
    "is_descent_compatible",
    "parse_family",
    "statistics_for",
]
