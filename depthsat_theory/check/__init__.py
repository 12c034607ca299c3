"""The theorem checker behind ``depthsat check``."""

from depthsat_theory.check.checker import (
    FAMILY_POOLS,
    KIND_LAYOUTS,
    Agreement,
    CheckConfig,
    CheckContext,
    evaluate,
    insert_on_probe,
    pool_family,
    predicted_verdict,
    probe_batches,
    probe_statistics,
    run_check,
    site_shapes,
    summarize,
    write_report_atomic,
)

__all__ = [
    "FAMILY_POOLS",
    "KIND_LAYOUTS",
    "Agreement",
    "CheckConfig",
    "CheckContext",
    "evaluate",
    "insert_on_probe",
    "pool_family",
    "predicted_verdict",
    "probe_batches",
    "probe_statistics",
    "run_check",
    "site_shapes",
    "summarize",
    "write_report_atomic",
]
