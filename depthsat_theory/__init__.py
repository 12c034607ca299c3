"""depthsat: first-order residual depth saturation (is this residual network deep enough?).

Public API, one concept per subpackage:

- :mod:`~depthsat_theory.families`: residual families ``h_θ`` with ``h_0 ≡ 0`` and the spec registry.
- :mod:`~depthsat_theory.statistics`: streaming tangent statistics, the projector ``Π``, the
  saturation score ``s`` and the raw quantities (``r``, ``AG_rms``, ``AG_max``, ``ρ``).
- :mod:`~depthsat_theory.capture`: insertion sites in torch models (capture ``z``, ``g``; the
  probe loop; insert blocks; function-preservation check).
- :mod:`~depthsat_theory.optimizers`: zero-state first-step maps ``P``.
- :mod:`~depthsat_theory.bounds`: finite-sample intervals, certificates, sample-size calculator (T7).
- :mod:`~depthsat_theory.diagnose`: every site of a network in one pass per probe batch.
- :mod:`~depthsat_theory.audit`: audits of a residual family (``depthsat audit``).
- :mod:`~depthsat_theory.check`: the theorem checker behind ``depthsat check``.
- :mod:`~depthsat_theory.engines`: the dense ``torch.func`` reference and the exact sympy engine.
- :mod:`~depthsat_theory.tasks`: data, models, training, exact constructions, pretrained zoo.
- :mod:`~depthsat_theory.strategies`: hypothesis strategies for property-testing families.
- :mod:`~depthsat_theory.vocabulary`: the :class:`Layout` and :class:`Verdict` enums.
"""

# libgomp's default wait policy spins idle threads: on a loaded machine two spinning torch threads made
# a plain forward+backward 9x slower than one thread (benchmarks/README.md, "Threads"); a passive wait
# costs nothing measurable on an idle one.  Read once, when torch loads: effective if depthsat is
# imported first (the CLI, the benchmarks), and an explicit OMP_WAIT_POLICY is never overridden.
import os as _os

_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from depthsat_theory.capture import NotFunctionPreservingError, SiteError, SiteRecorder, accumulate, insert_block
from depthsat_theory.families import FamilyError, FeatureFamily, GeneralFamily, ResidualFamily, parse_family
from depthsat_theory.optimizers import DESCENT_COMPATIBLE, UPDATES, ZeroStateUpdate, get_update, is_descent_compatible
from depthsat_theory.statistics import (
    FeatureStatistics,
    GeneralStatistics,
    SaturationResult,
    StatisticsError,
    TangentProjector,
    statistics_for,
)
from depthsat_theory.vocabulary import Layout, Verdict

__version__ = "0.1.0"

__all__ = [
    "DESCENT_COMPATIBLE",
    "UPDATES",
    "FamilyError",
    "FeatureFamily",
    "FeatureStatistics",
    "GeneralFamily",
    "GeneralStatistics",
    "Layout",
    "NotFunctionPreservingError",
    "ResidualFamily",
    "SaturationResult",
    "SiteError",
    "SiteRecorder",
    "StatisticsError",
    "TangentProjector",
    "Verdict",
    "ZeroStateUpdate",
    "accumulate",
    "get_update",
    "insert_block",
    "is_descent_compatible",
    "parse_family",
    "statistics_for",
]
