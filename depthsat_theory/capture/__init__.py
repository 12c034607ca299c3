"""Insertion sites in torch models: capture ``z`` and ``g``, the probe loop, block insertion."""

from depthsat_theory.capture.insertion import (
    FirstStepSlope,
    Insertion,
    ResidualInsertion,
    check_function_preserving,
    first_output,
    insert_block,
    output_deviation,
)
from depthsat_theory.capture.sites import (
    REDUCTIONS,
    NotFunctionPreservingError,
    SiteError,
    SiteRecorder,
    accumulate,
    parse_site,
    reduce_losses,
    resolve_module,
    split_output,
    update_statistics,
)

__all__ = [
    "REDUCTIONS",
    "FirstStepSlope",
    "Insertion",
    "NotFunctionPreservingError",
    "ResidualInsertion",
    "SiteError",
    "SiteRecorder",
    "accumulate",
    "check_function_preserving",
    "first_output",
    "insert_block",
    "output_deviation",
    "parse_site",
    "reduce_losses",
    "resolve_module",
    "split_output",
    "update_statistics",
]
