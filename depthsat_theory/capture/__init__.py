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
from depthsat_theory.capture.probe import (
    REDUCTIONS,
    ProbeBatch,
    accumulate,
    batch_size,
    call_model,
    probe_batches,
    reduce_losses,
    unpack_batch,
    update_statistics,
)
from depthsat_theory.capture.sites import (
    NotFunctionPreservingError,
    SiteError,
    SiteRecorder,
    parse_site,
    resolve_module,
    split_output,
)

__all__ = [
    "REDUCTIONS",
    "FirstStepSlope",
    "Insertion",
    "NotFunctionPreservingError",
    "ProbeBatch",
    "ResidualInsertion",
    "SiteError",
    "SiteRecorder",
    "accumulate",
    "batch_size",
    "call_model",
    "check_function_preserving",
    "first_output",
    "insert_block",
    "output_deviation",
    "parse_site",
    "probe_batches",
    "reduce_losses",
    "resolve_module",
    "split_output",
    "unpack_batch",
    "update_statistics",
]
