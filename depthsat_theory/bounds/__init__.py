r"""Finite-sample intervals, certificates and the sample-size calculator (T7, ``theory/finite-sample.md``).

A probe of ``n`` examples drawn i.i.d. from the data distribution, independently of
training, gives the estimate :math:`\hat{s}` of the population score ``s`` of a zero-output
feature family at one site.  This package turns it into statements users can act on:

- :func:`interval_from_moments` / :meth:`BoundStatistics.interval` /
  :func:`interval_from_probe`: a :math:`(1 − δ)` confidence interval for ``s`` (or the
  ridge score :math:`s_λ`), label ``thm-finite-sample``, with a
  :class:`~depthsat_theory.vocabulary.Certificate` (``cor-certified-improvable``,
  ``cor-certified-saturated``), the family-free certificate from ``AG_rms``
  (``cor-agmax-certificate-finite``), the U-statistic of :math:`s^2` and an optional
  bootstrap interval (approximate, labelled as such);
- :func:`plan_bound`: the half-width for ``(n, δ, constants)``, or the probe size
  needed for a target half-width (formulas derived with sympy in :mod:`.formula`);
- :class:`SequentialCertifier`: the anytime-valid variant over checkpoints
  (``thm-sequential``).

Constants of the bound (Python arguments): ``grad_max`` :math:`γ ≥ ‖g(x)‖_F` a.s.;
``leverage_max`` :math:`L ≥ ℓ_λ(x) = \operatorname{tr}(Σ_λ^+ Σ_x)` a.s., or :math:`L = B^2/(μ + λ)` from
``feature_norm_max`` ``B`` with ``eig_floor`` :math:`μ` and/or ``ridge`` :math:`λ`;
``variance`` ``V``; ``dim`` :math:`D ≥ \operatorname{rank} Σ`.  When :math:`γ` or ``L`` are not given, the
probe's maxima are used and the result says so: a plug-in, not a guarantee.  Every
result lists each constant with its source (``user``, ``probe`` or ``derived``).
Errors are :class:`BoundError`, whose messages name these arguments.

Modules: :mod:`.constants` (argument checks, :class:`Constant`, resolving the
constants), :mod:`.terms` (the deviation terms :math:`ε_n`, :math:`Δ_n`, ``h_n``),
:mod:`.moments` (:class:`ProbeMoments`, :func:`estimate`), :mod:`.interval`
(:class:`ScoreInterval` and the interval), :mod:`.probe` (the interval of a dumped
probe), :mod:`.plan` (the calculator), :mod:`.formula` (sympy), :mod:`.sequential`,
:mod:`.statistics` (:class:`BoundStatistics`, streaming).
"""

from depthsat_theory.bounds.constants import BoundError, Constant, check_delta
from depthsat_theory.bounds.formula import Formulas, combined_required_n, formulas
from depthsat_theory.bounds.interval import (
    ScoreInterval,
    ag_rms_upper,
    bootstrap_interval,
    interval_from_moments,
    n_to_certify,
    unbiased_score_squared,
)
from depthsat_theory.bounds.moments import Estimate, ProbeMoments, estimate
from depthsat_theory.bounds.plan import BoundPlan, halfwidth, plan_bound, required_n
from depthsat_theory.bounds.probe import interval_from_probe
from depthsat_theory.bounds.sequential import SequentialCertifier, spending
from depthsat_theory.bounds.statistics import BoundStatistics

__all__ = [
    "BoundError",
    "BoundPlan",
    "BoundStatistics",
    "Constant",
    "Estimate",
    "Formulas",
    "ProbeMoments",
    "ScoreInterval",
    "SequentialCertifier",
    "ag_rms_upper",
    "bootstrap_interval",
    "check_delta",
    "combined_required_n",
    "estimate",
    "formulas",
    "halfwidth",
    "interval_from_moments",
    "interval_from_probe",
    "n_to_certify",
    "plan_bound",
    "required_n",
    "spending",
    "unbiased_score_squared",
]
