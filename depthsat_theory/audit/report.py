"""The audit's result: :class:`AuditReport` (JSON-ready) and :func:`report_table` (rich)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
from rich.table import Table

from depthsat_theory.vocabulary import Verdict

__all__ = ["AuditReport", "report_table"]


@dataclass
class AuditReport:
    """What :func:`audit_family` found (all norms in the probe's empirical measure).

    Attributes:
        family: family spec/name; ``source``: ``"builtin"``, ``"module"``, ``"sympy"``
            or ``"object"``; ``text``: the text it was loaded from (if any).
        probe: description of the probe; ``layout``; ``shape`` (per example);
            ``n`` examples; ``units``: rows (row-wise families) or examples (``unit =
            "tensor"``); ``distinct_units`` after pooling exactly equal units;
            ``dtype`` of the probe.
        function_preserving: ``max_deviation == 0`` (and ``model_deviation == 0``).
        max_deviation: ``max |h(0, z)|`` over the probe (``def-family``).
        model_deviation: max deviation of the model output after insertion (model
            audits), else ``None``.
        tangent_dim: ``p``, the number of tangent coordinates.
        tangent_rank: numerical rank of ``K`` (statistics: eigh of the scaled ``K``).
        rank_check: the same rank from an SVD of the scaled tangent Jacobian (or
            ``Φ̃``); ``rank_check_method`` says how; ``rank_agrees``.
        zero_tangent_columns: coordinates whose tangent column vanishes on the probe.
        parameter_redundancy: ``p − tangent_rank``.
        regular: ``tangent_rank == p`` (T4, see the module docstring).
        parameterization: ``"regular"``, ``"redundant"`` or ``"degenerate"``.
        degenerate: ``tangent_rank == 0``; ``rank_deficient``: ``tangent_rank < p``.
        realizability_defect: ``ρ̂`` (``None`` if ``m̂ = 0``); ``noise``:
            ``‖g − m̂‖ / AG_rms`` (within-tie variation of ``g``); ``defect_rtol``.
        ag_certificate: ``"exact"``, ``"conservative only"`` or ``"not applicable
            (degenerate)"``.
        score, relative_score, raw_score, ag_rms, ag_max, tol, activation_scaled_score:
            the saturation quantities (:class:`~depthsat_theory.statistics.SaturationResult`).
        status: a :class:`~depthsat_theory.vocabulary.Verdict`: ``"saturated"``, ``"undetermined"`` (kink ties),
            ``"improvable"`` or ``"degenerate"``.
        gradient_check: model audits: ``max |b_autograd − b_statistics| / max |b|`` (T1).
        kink_ties: model audits: exact ties at kinks after the site on the probe
            (:mod:`depthsat_theory.capture.kinks`); when positive the status is ``undetermined``
            (autograd's ``b`` is a one-sided convention, ``thm-gradient``).
        symbolic: sympy families: the symbolic engine's verdicts, else ``None``.
        notes: caveats to print with the report.
    """

    family: str
    source: str
    text: str
    probe: str
    layout: str
    shape: list
    n: int
    units: int
    distinct_units: int
    dtype: str
    function_preserving: bool
    max_deviation: float
    model_deviation: float | None
    tangent_dim: int
    tangent_rank: int
    rank_check: int | None
    rank_check_method: str
    rank_agrees: bool | None
    zero_tangent_columns: int
    parameter_redundancy: int
    regular: bool
    parameterization: str
    degenerate: bool
    rank_deficient: bool
    realizability_defect: float | None
    noise: float | None
    defect_rtol: float
    ag_certificate: str
    score: float
    relative_score: float | None
    raw_score: float | None
    ag_rms: float
    ag_max: float
    tol: float
    activation_scaled_score: float
    rtol: float
    status: Verdict
    gradient_check: float | None = None
    kink_ties: int | None = None
    symbolic: dict | None = None
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready dictionary (``nan`` and ``inf`` become ``None``/strings).

        Returns:
            The fields as nested plain Python values: ``nan`` as ``None``, ``±inf`` as ``"inf"``/``"-inf"``.
        """
        return _jsonable(asdict(self))


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer, np.bool_)):
        obj = obj.item()
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
    return obj


def report_table(report: AuditReport) -> Table:
    """A :class:`rich.table.Table` of the report (the CLI's human-readable output).

    Args:
        report: the audit's report.

    Returns:
        A table with one row per check (function preservation, tangent rank,
        parameterization, realizability, certificate, score and, for model audits, T1).
    """
    r = report

    def num(x, fmt=".4g"):
        return "n/a" if x is None else (format(x, fmt) if isinstance(x, float) else str(x))

    t = Table(title=f"depthsat audit: {r.family} ({r.source})", show_lines=False)
    t.add_column("check", no_wrap=True)
    t.add_column("verdict", no_wrap=True)
    t.add_column("evidence")
    fp_ev = f"max |h(0,u)| = {num(r.max_deviation)} on the probe"
    if r.model_deviation is not None:
        fp_ev += f"; model output deviation after insertion {num(r.model_deviation)}"
    if r.symbolic is not None:
        fp_ev += f"; symbolic h(0,u) = {r.symbolic['residual']}"
    t.add_row("function-preserving", "yes" if r.function_preserving else "NO", fp_ev)
    t.add_row(
        "tangent rank",
        f"{r.tangent_rank} / p = {r.tangent_dim}",
        f"rank K (eigh, rtol {r.rtol:.2g}); check: {num(r.rank_check)} by {r.rank_check_method}"
        + (f"; symbolic (generic units): {r.symbolic['tangent_rank']}" if r.symbolic else ""),
    )
    t.add_row(
        "parameterization",
        r.parameterization,
        f"redundancy p − rank = {r.parameter_redundancy}; zero tangent columns "
        f"{r.zero_tangent_columns}" + (f"; symbolic regular: {r.symbolic['regular']}" if r.symbolic else ""),
    )
    t.add_row(
        "realizability defect ρ̂",
        num(r.realizability_defect),
        f"raw score r̂ = {num(r.raw_score)}; within-tie noise ‖g − m̂‖/AG_rms = {num(r.noise)}; "
        f"{r.distinct_units} distinct of {r.units} units",
    )
    t.add_row(
        "AG_max certificate",
        r.ag_certificate,
        f"AG_max = {num(r.ag_max)}, AG_rms = {num(r.ag_rms)}; exact iff g ∈ T up to {r.defect_rtol:.1g}·AG_rms",
    )
    t.add_row(
        "score",
        r.status,
        f"s = {num(r.score)}, s/AG_rms = {num(r.relative_score)}, tol = {num(r.tol, '.3g')}, "
        f"s·z_rms = {num(r.activation_scaled_score)}",
    )
    if r.kink_ties is not None:
        t.add_row(
            "kink ties (T1)",
            "none" if r.kink_ties == 0 else f"{r.kink_ties}: undetermined",
            "exact ties of relu/abs/max/max-pool at their kinks after the site, on the probe (ex-kink-tie)",
        )
    if r.gradient_check is not None:
        t.add_row(
            "T1 gradient check",
            "ok" if r.gradient_check <= 1e-8 else "MISMATCH",
            f"max |b_autograd − b_statistics| / max |b| = {num(r.gradient_check, '.2g')}",
        )
    return t
