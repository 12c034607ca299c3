"""Diagnose a whole network: every residual-stream site in one pass per probe batch.

Modules: :mod:`~depthsat_theory.diagnose.discovery` (sites and layouts),
:mod:`~depthsat_theory.diagnose.run` (:func:`diagnose`),
:mod:`~depthsat_theory.diagnose.options` (:class:`DiagnoseOptions`, its options),
:mod:`~depthsat_theory.diagnose.report` (results, table, plot),
:mod:`~depthsat_theory.diagnose.checkpoint` (resume), and
:mod:`~depthsat_theory.diagnose.distributed` (torchrun all-reduce).
"""

from depthsat_theory.diagnose.checkpoint import CHECKPOINT_VERSION, read_checkpoint
from depthsat_theory.diagnose.discovery import SITE_PATTERNS, discover_sites, infer_layout
from depthsat_theory.diagnose.distributed import (
    all_gather_objects,
    allreduce,
    allreduce_statistics,
    barrier,
    init_from_env,
    is_main,
    world,
)
from depthsat_theory.diagnose.errors import CheckpointError, DiagnoseError
from depthsat_theory.diagnose.options import DiagnoseOptions
from depthsat_theory.diagnose.report import Diagnosis, SiteDiagnosis
from depthsat_theory.diagnose.run import ProbeLoss, diagnose

__all__ = [
    "CHECKPOINT_VERSION",
    "SITE_PATTERNS",
    "CheckpointError",
    "DiagnoseError",
    "DiagnoseOptions",
    "Diagnosis",
    "ProbeLoss",
    "SiteDiagnosis",
    "all_gather_objects",
    "allreduce",
    "allreduce_statistics",
    "barrier",
    "diagnose",
    "discover_sites",
    "infer_layout",
    "init_from_env",
    "is_main",
    "read_checkpoint",
    "world",
]
