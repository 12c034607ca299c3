"""Zero-state first-step maps ``P`` of real optimizers (T3)."""

from depthsat_theory.optimizers.updates import (
    DESCENT_COMPATIBLE,
    UPDATES,
    Lion,
    RotationOptimizer,
    SignSGD,
    ZeroStateUpdate,
    get_update,
    is_descent_compatible,
    threshold,
)

__all__ = [
    "DESCENT_COMPATIBLE",
    "UPDATES",
    "Lion",
    "RotationOptimizer",
    "SignSGD",
    "ZeroStateUpdate",
    "get_update",
    "is_descent_compatible",
    "threshold",
]
