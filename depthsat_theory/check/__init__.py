"""The theorem checker behind ``depthsat check``."""

from depthsat_theory.check.checker import (
    FAMILY_POOLS,
    CheckConfig,
    run_check,
    summarize,
    write_report_atomic,
)

__all__ = [
    "FAMILY_POOLS",
    "CheckConfig",
    "run_check",
    "summarize",
    "write_report_atomic",
]
