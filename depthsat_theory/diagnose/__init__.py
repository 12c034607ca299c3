"""Diagnose a whole network: every residual-stream site in one pass per probe batch."""

from depthsat_theory.diagnose.distributed import (
    all_gather_objects,
    allreduce,
    barrier,
    init_from_env,
    is_main,
    world,
)
from depthsat_theory.diagnose.run import (
    SITE_PATTERNS,
    CheckpointError,
    DiagnoseError,
    Diagnosis,
    SiteDiagnosis,
    diagnose,
    discover_sites,
    infer_layout,
    read_checkpoint,
)

__all__ = [
    "SITE_PATTERNS",
    "CheckpointError",
    "DiagnoseError",
    "Diagnosis",
    "SiteDiagnosis",
    "all_gather_objects",
    "allreduce",
    "barrier",
    "diagnose",
    "discover_sites",
    "infer_layout",
    "init_from_env",
    "is_main",
    "read_checkpoint",
    "world",
]
