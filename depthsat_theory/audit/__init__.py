"""Audit a residual family before trusting its score (``depthsat audit``).

- :mod:`.loading`: :func:`load_family` (built-in spec, ``module:attr``, sympy expression);
- :mod:`.probe`: the documented default probe (:func:`synthetic_probe`);
- :mod:`.family`: :func:`audit_family` on a probe ``(z, g)``;
- :mod:`.model`: :func:`audit_model` at a site of a torch model (with the T1 gradient check);
- :mod:`.report`: :class:`AuditReport` and :func:`report_table`.
"""

from depthsat_theory.audit.family import JACOBIAN_BUDGET, audit_family
from depthsat_theory.audit.loading import AuditError, LoadedFamily, load_family
from depthsat_theory.audit.model import audit_model
from depthsat_theory.audit.probe import SYNTHETIC_PROBE, synthetic_probe
from depthsat_theory.audit.report import AuditReport, report_table

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
