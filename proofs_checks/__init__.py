"""Machine checks of every labelled claim in ``theory/`` (T1–T7 and the numerics page).

One module per claim; each registers checks with :func:`proofs_checks._registry.check`.
Run them with ``python -m proofs_checks`` or ``depthsat proofs`` (both call :func:`run_and_report`
with a :class:`Context`).
"""

from ._registry import CHECKS, Check, Context, Outcome, Row, check, load_all, run_checks
from ._report import run_and_report

#: claim modules, imported by :func:`proofs_checks._registry.load_all` in this order
MODULES = (
    "t1_gradient",
    "t2_iff",
    "t3_updates",
    "t4_reparameterization",
    "t5_zero_output",
    "t6_realizability",
    "t7_finite_sample",
    "t8_numerics",
    "t9_beyond",
    "t10_hidden_beta",
    "t11_decision",
)

__all__ = [
    "CHECKS",
    "MODULES",
    "Check",
    "Context",
    "Outcome",
    "Row",
    "check",
    "load_all",
    "run_and_report",
    "run_checks",
]
