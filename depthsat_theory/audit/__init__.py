"""Audit a residual family before trusting its score (``depthsat audit``)."""

from depthsat_theory.audit.core import (
    JACOBIAN_BUDGET,
    SYNTHETIC_PROBE,
    AuditError,
    AuditReport,
    LoadedFamily,
    audit_family,
    audit_model,
    load_family,
    report_table,
    synthetic_probe,
)

__all__ = [
    "JACOBIAN_BUDGET",
    "SYNTHETIC_PROBE",
    "AuditError",
    "AuditReport",
    "LoadedFamily",
    "audit_family",
    "audit_model",
    "load_family",
    "report_table",
    "synthetic_probe",
]
