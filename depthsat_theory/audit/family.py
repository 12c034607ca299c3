"""Audit a residual family on a probe: function preservation, tangent rank, regularity, certificates.

:func:`audit_family` answers, for one residual family on one probe ``(z, g)``
(activations and per-example activation gradients at a site), the questions a user
asks before trusting a saturation score:

1. **Function preservation** (``def-family``): is ``h(0, u) = 0`` on every probe
   unit?  Measured as ``max |h(0, z)|`` over the probe (and, for a model site, as the
   max deviation of the model's output after inserting the block,
   :func:`~depthsat_theory.capture.check_function_preserving`); for sympy families the
   symbolic engine's exact verdict on ``h(0, u) ≡ 0`` counts too (a residual that
   vanishes on the probe but not identically is caught).  A family that is not
   function-preserving is rejected (:class:`~depthsat_theory.capture.NotFunctionPreservingError`).
2. **Tangent space** (``def-tangent``): ``p`` tangent coordinates and the numerical
   rank of ``K = E[AᵀA]`` on the probe's units; ``rank K = 0`` is *degenerate*
   (``T = {0}``, T4), reported apart from saturation.
3. **Regularity of the parameterization** (``thm-reparameterization``, T4).  On the
   probe, the parameterization is called *regular* when the tangent map
   ``v ↦ A v`` is injective, i.e. ``rank K = p``: every parameter direction moves
   ``h`` at first order, so locally ``θ`` is identifiable to first order and any
   reparameterization ``θ = χ(ξ)`` with ``Dχ(0)`` invertible keeps ``T``, ``Π`` and
   ``s`` (T4).  ``parameter_redundancy = p − rank K`` counts the first-order
   redundant directions (zero tangent columns, such as ``θ = ξ ⊙ ξ`` coordinates,
   plus linear dependencies such as ``t1·u + t2·u``); ``T``, ``Π`` and ``s`` do not
   depend on them, the gradient ``b`` and optimizer steps do.  The rank is computed
   twice: by the statistics (eigendecomposition of the diagonally scaled ``K``) and
   independently by an SVD of the diagonally scaled tangent Jacobian ``A`` (features
   ``Φ̃`` for feature families), with the same relative cutoff; disagreement means a
   singular value sits at the cutoff (numerically ambiguous rank).  For sympy families
   the engine's function-space rank of ``A`` (generic units, no probe) is reported as
   well; the parameterization is symbolically regular when it equals ``p``, and a
   probe rank below it means the probe does not separate the tangent directions.
4. **Realizability** (``thm-realizability``, T6): the defect
   ``ρ̂ = ‖m̂ − Π m̂‖ / ‖m̂‖`` with ``m̂`` pooling exactly equal units.  It is exact on
   finite/discrete populations and **biased upward for continuous units** (then
   ``m̂ = g`` and ``r̂ = AG_rms``), so a positive ``ρ̂`` on a continuous probe does not
   prove a positive population defect.
5. **Raw-gradient certificate**: ``AG_max = 0 ⇒ saturated`` always holds.  It is
   *exact* on the probe (``AG_max = 0 ⇔ saturated``) when ``g`` lies in ``T`` there:
   ``g = m̂`` (no within-tie variation of ``g``) and ``ρ̂ = 0``, both up to
   ``defect_rtol`` (relative to ``AG_rms``; default ``max(1e-8, 100 ε(dtype))``,
   the resolution of a Gram-based float64 projection).  Then ``s = r̂ = AG_rms``
   (T6).  Otherwise it is *conservative only*: ``AG_max > 0`` does not imply
   improvable.  For a degenerate family it is *not applicable*.
6. **Score**: ``s``, ``s / AG_rms`` and the verdict *saturated* (``s ≤ tol``),
   *improvable* or *degenerate*.

:func:`load_family` resolves the three ways of naming a family (see its docstring),
:func:`synthetic_probe` builds the documented default probe, and :func:`audit_model`
audits a family at a site of a torch model (a task from
:func:`~depthsat_theory.tasks.trained_task`).

Example::

    from depthsat_theory.audit import audit_family, load_family, synthetic_probe
    fam = load_family("poly:2")
    z, g, layout, label = synthetic_probe(fam.family)
    report = audit_family(fam, z, g, layout=layout, probe=label)
    print(report.status, report.tangent_rank, report.regular, report.ag_certificate)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from depthsat_theory.audit.loading import AuditError, LoadedFamily, symbolic_engine
from depthsat_theory.audit.report import AuditReport
from depthsat_theory.capture import NotFunctionPreservingError, SiteError
from depthsat_theory.families import FamilyError, FeatureFamily, ResidualFamily, to_rows
from depthsat_theory.statistics import SaturationResult, StatisticsError, statistics_for
from depthsat_theory.vocabulary import Layout, Verdict

__all__ = ["JACOBIAN_BUDGET", "audit_family", "guarded", "probe_layout"]

T = TypeVar("T")

#: Largest tangent Jacobian (entries) formed for the independent rank check of a
#: general family; larger probes use their first examples only (a lower bound).
JACOBIAN_BUDGET = 1 << 23

#: ``ρ̂`` is computed with pooling of exactly equal units only (the first note of every report).
_POOLING_NOTE = (
    "realizability defect pools exactly equal units only: exact on finite/discrete "
    "populations, biased upward for continuous units (then raw_score = ag_rms)"
)


def probe_layout(ndim: int) -> Layout:
    """The layout of probe tensors with ``ndim`` dimensions (batch first).

    Args:
        ndim: number of dimensions of the probe tensors, batch included.

    Returns:
        ``Layout.VECTOR``, ``Layout.SEQUENCE`` or ``Layout.IMAGE``.

    Raises:
        AuditError: unless ``ndim`` is 2 (``n × d``), 3 (``n × T × d``) or 4 (``n × C × H × W``).
    """
    try:
        return {2: Layout.VECTOR, 3: Layout.SEQUENCE, 4: Layout.IMAGE}[ndim]
    except KeyError:
        raise AuditError(
            f"probe tensors must have 2 (n × d), 3 (n × T × d) or 4 (n × C × H × W) dimensions, got {ndim}"
        ) from None


def _as_tensor(x, name: str) -> Tensor:
    t = x.detach() if isinstance(x, Tensor) else torch.from_numpy(np.asarray(x))
    if not torch.is_floating_point(t):
        raise StatisticsError(f"{name} must be float32 or float64, got {t.dtype}")
    return t.cpu()


def guarded(spec: str, what: str, fn: Callable[[], T]) -> T:
    """Run user-reachable family code; turn unexpected exceptions into one-line errors.

    Args:
        spec: the family's name, for the message.
        what: what the code was doing (``"building its block"``).
        fn: the code.

    Returns:
        ``fn()``.

    Raises:
        FamilyError: ``family SPEC failed while WHAT: TYPE: MESSAGE`` for any exception other
            than the toolkit's own (which pass through unchanged).
    """
    try:
        return fn()
    except (FamilyError, StatisticsError, AuditError, NotFunctionPreservingError, SiteError):
        raise
    except Exception as exc:
        raise FamilyError(f"family {spec!r} failed while {what}: {type(exc).__name__}: {exc}") from None


def _deviation(family: ResidualFamily, z64: Tensor, layout: str) -> float:
    p = family.param_dim(tuple(z64.shape[1:]))
    with torch.no_grad():
        out = family.functional(torch.zeros(p, dtype=torch.float64), z64, layout)
    if not isinstance(out, Tensor) or out.shape != z64.shape:
        shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise FamilyError(
            f"family {family.spec!r} returned {shape} for site tensors of shape "
            f"{tuple(z64.shape)}; a residual block must preserve the shape"
        )
    if out.numel() == 0:
        return 0.0
    dev = float(out.abs().max())
    return math.inf if math.isnan(dev) else dev


def _scaled_rank(mat: np.ndarray, rtol: float) -> int:
    """Rank of ``mat`` with unit-norm columns: ``#{σ² > rtol σ_max²}`` (SVD, zero columns dropped)."""
    norms = np.sqrt((mat * mat).sum(axis=0))
    live = norms > 0
    if not live.any():
        return 0
    sv = np.linalg.svd(mat[:, live] / norms[live], compute_uv=False)
    return int((sv * sv > rtol * sv[0] * sv[0]).sum())


def _independent_rank(family: ResidualFamily, z64: Tensor, layout: str, rtol: float) -> tuple[int, str, int]:
    """``(rank, method, zero columns)`` of the tangent map on the probe, not via ``K``.

    The zero-column count is ``-1`` when the Jacobian was formed on a subsample.
    """
    shape = tuple(z64.shape[1:])
    if isinstance(family, FeatureFamily):
        fmap = family.frozen_feature_map(shape, layout)
        with torch.no_grad():
            phi = family.augmented_features(fmap, z64).reshape(-1, family.augmented_dim(shape, layout)).numpy()
        d = family.site_dim(shape, layout)
        zero = int(d * (np.abs(phi).sum(axis=0) == 0).sum())
        return d * _scaled_rank(phi, rtol), "d · rank Φ̃ (SVD of the column-scaled feature matrix)", zero
    p = family.param_dim(shape)
    per_example = max(int(np.prod(shape)) * p, 1)
    m = max(1, min(z64.shape[0], JACOBIAN_BUDGET // per_example))
    theta0 = torch.zeros(p, dtype=torch.float64)
    sub = z64[:m]
    jac = torch.func.jacfwd(lambda th: family.functional(th, sub, layout))(theta0)
    a = jac.reshape(-1, p).detach().numpy()
    zero = int((np.abs(a).sum(axis=0) == 0).sum()) if m == z64.shape[0] else -1
    method = "SVD of the column-scaled tangent Jacobian A"
    if m < z64.shape[0]:
        method += f" on the first {m} of {z64.shape[0]} examples (a lower bound)"
    return _scaled_rank(a, rtol), method, zero


def _tie_noise(family: ResidualFamily, z: np.ndarray, g: np.ndarray, layout: str) -> tuple[float, int, int]:
    """``(‖g − m̂‖², distinct units, units)`` with ``m̂`` pooling exactly equal units (per example mass)."""
    if family.unit == "row":
        zu = to_rows(torch.from_numpy(z), layout).reshape(-1, _row_dim(z, layout)).numpy()
        gu = to_rows(torch.from_numpy(g), layout).reshape(zu.shape[0], -1).numpy()
    else:
        zu, gu = z.reshape(z.shape[0], -1), g.reshape(g.shape[0], -1)
    zu = zu + 0.0
    uniq, inv = np.unique(zu, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    sums = np.zeros((uniq.shape[0], gu.shape[1]))
    np.add.at(sums, inv, gu)
    counts = np.bincount(inv, minlength=uniq.shape[0])
    resid = gu - (sums / counts[:, None])[inv]
    return float((resid * resid).sum()) / z.shape[0], int(uniq.shape[0]), int(zu.shape[0])


def _row_dim(z: np.ndarray | Tensor, layout: str) -> int:
    return int(z.shape[1] if layout == Layout.IMAGE else z.shape[-1])


@dataclass
class _Probe:
    """A validated probe: the family, its site and the float64 tensors."""

    loaded: LoadedFamily
    spec: str
    zt: Tensor
    gt: Tensor
    layout: str
    shape: tuple[int, ...]

    @property
    def family(self) -> ResidualFamily:
        return self.loaded.family

    @property
    def z64(self) -> Tensor:
        return self.zt.to(torch.float64)


def _validate(family: ResidualFamily | LoadedFamily, z: Any, g: Any, layout: str | None) -> _Probe:
    loaded = family if isinstance(family, LoadedFamily) else LoadedFamily(family, "object", "")
    fam = loaded.family
    zt, gt = _as_tensor(z, "z"), _as_tensor(g, "g")
    if zt.shape != gt.shape:
        raise StatisticsError(f"z {tuple(zt.shape)} and g {tuple(gt.shape)} must have the same shape")
    layout = layout or probe_layout(zt.dim())
    shape = tuple(int(s) for s in zt.shape[1:])
    fam.check_site(shape, layout)
    if loaded.d is not None and _row_dim(zt, layout) != loaded.d:
        raise AuditError(
            f"family {loaded.text!r} acts on units of dimension d = {loaded.d} "
            f"(u1..u{loaded.d}), but the probe has d = {_row_dim(zt, layout)}"
        )
    return _Probe(loaded, fam.spec or type(fam).__name__, zt, gt, layout, shape)


def _preservation(pr: _Probe, strict: bool, model_deviation: float | None) -> tuple[float, dict | None, bool]:
    """``(max |h(0, z)|, symbolic verdict or None, function-preserving)``; raises if ``strict`` and not."""
    dev = guarded(pr.spec, "evaluating h(0, z)", lambda: _deviation(pr.family, pr.z64, pr.layout))
    symbolic = _symbolic_preservation(pr.loaded) if pr.loaded.symbolic is not None else None
    fp = dev == 0.0 and (model_deviation is None or model_deviation == 0.0)
    fp = fp and (symbolic is None or symbolic["function_preserving"])
    if strict and not fp:
        if dev != 0.0:
            where = f"max |h(0,u)| = {dev:.3g} on the probe"
        elif model_deviation:
            where = f"inserting it changes the model output by {model_deviation:.3g}"
        else:
            where = f"h(0,u) = {symbolic['residual'] if symbolic else '?'} symbolically (0 on the probe's units)"
        raise NotFunctionPreservingError(
            f"family {pr.loaded.text or pr.spec!r} is not function-preserving: {where} "
            f"(h(0, ·) must vanish identically)"
        )
    return dev, symbolic, fp


def _certificate(res: SaturationResult, noise: float, defect_rtol: float) -> str:
    """The raw-gradient certificate: exact iff ``g ∈ T`` on the probe (``g = m̂`` and ``ρ̂ = 0``)."""
    if res.tangent_rank == 0:
        return "not applicable (degenerate)"
    rho = res.realizability_defect
    if res.ag_rms == 0 or (
        not math.isnan(rho) and rho * res.raw_score <= defect_rtol * res.ag_rms and noise <= defect_rtol
    ):
        return "exact"  # g = 0, or g ∈ T on the probe (g = m̂ and ρ̂ = 0)
    return "conservative only"


def _notes(fam: ResidualFamily, res: SaturationResult, rank_check: int | None, cert: str) -> list[str]:
    p, rank = res.tangent_dim, res.tangent_rank
    notes = [_POOLING_NOTE]
    if rank == 0:
        notes.append(
            "degenerate family (rank K = 0, T = {0}): no first-order change is possible; this is not saturation (T4)"
        )
    elif rank != p:
        notes.append(
            f"redundant parameterization: {p - rank} of {p} parameter directions do not move h "
            f"at first order; T, Π and s are unaffected (T4), the gradient b and optimizer "
            f"steps are not"
        )
    if rank_check is not None and rank_check != rank:
        notes.append(
            f"numerical rank ambiguous: statistics give {rank}, the SVD check {rank_check} "
            f"(a singular value sits at the cutoff rtol = {res.rtol:.2g})"
        )
    if cert == "exact" and rank != 0:
        notes.append("g lies in T on this probe: s = AG_rms, so AG_max = 0 ⇔ saturated here (T6)")
    elif cert == "conservative only":
        notes.append(
            "AG_max = 0 would certify saturation, but AG_max > 0 does not imply improvable (g ∉ T on this probe; T6)"
        )
    if isinstance(fam, FeatureFamily):
        notes.append("feature parameters ψ have zero tangent and are not counted in p")
    return notes


def _verdict(res: SaturationResult) -> Verdict:
    return res.verdict  # the four outcomes of theory/numerics.md


def _zero_columns(stats: Any, counted: int) -> int:
    """Zero tangent columns: counted on the Jacobian, or from ``diag K`` when it was subsampled."""
    if counted >= 0:
        return counted
    return int((np.diag(stats.tangent_gram()) == 0).sum())


def _none_if_nan(x: float) -> float | None:
    return None if x != x else x


def audit_family(
    family: ResidualFamily | LoadedFamily,
    z,
    g,
    *,
    layout: str | None = None,
    probe: str = "user probe",
    strict: bool = True,
    defect_rtol: float | None = None,
    model_deviation: float | None = None,
) -> AuditReport:
    """Audit a residual family on a probe (see the module docstring for every verdict).

    Args:
        family: the family, or a :class:`~depthsat_theory.audit.LoadedFamily` (then its source
            and, for sympy families, the symbolic verdicts are reported).
        z: site activations, float32/float64 array or tensor ``(n, d)``, ``(n, T, d)``
            or ``(n, C, H, W)``.
        g: activation gradients of the per-example losses, same shape.
        layout: ``"vector"``, ``"sequence"`` or ``"image"`` (default: from ``z.ndim``).
        probe: a description of the probe for the report.
        strict: raise if the family is not function-preserving (default); with
            ``False`` the report is returned with ``function_preserving = False``.
        defect_rtol: relative tolerance of the certificate (module docstring); default
            ``max(1e-8, 100 eps(dtype))``.
        model_deviation: the model-output deviation after insertion (model audits).

    Returns:
        An :class:`~depthsat_theory.audit.AuditReport`.

    Raises:
        NotFunctionPreservingError: if ``strict`` and ``max |h(0, z)| > 0`` or
            ``model_deviation > 0`` (``def-family``).
        FamilyError: if the family does not fit the site, or its code fails on the probe.
        StatisticsError: on bad probe values (shape mismatch, NaN/Inf, empty).
        AuditError: on a probe with an unsupported number of dimensions, or a sympy
            family whose dimension differs from the probe's.
    """
    pr = _validate(family, z, g, layout)
    fam, z64 = pr.family, pr.z64
    dev, symbolic, fp = _preservation(pr, strict, model_deviation)

    stats = statistics_for(fam, pr.shape, pr.layout, pool_ties=True)
    guarded(pr.spec, "computing tangent statistics", lambda: stats.update(pr.zt, pr.gt))
    res = stats.result()
    rank_check, method, zero_cols = guarded(
        pr.spec, "computing the tangent Jacobian", lambda: _independent_rank(fam, z64, pr.layout, res.rtol)
    )
    zero_cols = _zero_columns(stats, zero_cols)
    noise2, distinct, units = _tie_noise(fam, z64.numpy(), pr.gt.to(torch.float64).numpy(), pr.layout)

    p, rank = res.tangent_dim, res.tangent_rank
    if defect_rtol is None:
        defect_rtol = max(1e-8, 100 * torch.finfo(pr.zt.dtype).eps)
    noise = math.sqrt(noise2) / res.ag_rms if res.ag_rms > 0 else 0.0
    cert = _certificate(res, noise, defect_rtol)
    parameterization = "degenerate" if rank == 0 else ("regular" if rank == p else "redundant")
    report = AuditReport(
        family=pr.spec,
        source=pr.loaded.source,
        text=pr.loaded.text,
        probe=probe,
        layout=pr.layout,
        shape=list(pr.shape),
        n=res.n,
        units=units,
        distinct_units=distinct,
        dtype=str(pr.zt.dtype).replace("torch.", ""),
        function_preserving=fp,
        max_deviation=dev,
        model_deviation=model_deviation,
        tangent_dim=p,
        tangent_rank=rank,
        rank_check=rank_check,
        rank_check_method=method,
        rank_agrees=None if rank_check is None else rank_check == rank,
        zero_tangent_columns=zero_cols,
        parameter_redundancy=p - rank,
        regular=rank == p,
        parameterization=parameterization,
        degenerate=rank == 0,
        rank_deficient=rank < p,
        realizability_defect=_none_if_nan(res.realizability_defect),
        noise=noise,
        defect_rtol=defect_rtol,
        ag_certificate=cert,
        score=res.score,
        relative_score=_none_if_nan(res.relative_score),
        raw_score=_none_if_nan(res.raw_score),
        ag_rms=res.ag_rms,
        ag_max=res.ag_max,
        tol=res.tol,
        activation_scaled_score=res.activation_scaled_score,
        rtol=res.rtol,
        status=_verdict(res),
        notes=_notes(fam, res, rank_check, cert),
    )
    if symbolic is not None:
        report.symbolic = _symbolic_verdicts(pr.loaded, report, symbolic)
    return report


def _symbolic_preservation(loaded: LoadedFamily) -> dict:
    """The engine's exact verdict on ``h(0, u) ≡ 0`` (``def-family``)."""
    sym = symbolic_engine()
    fp, residual = sym.is_function_preserving(loaded.symbolic)
    comps = [str(e) for e in residual]
    return {"function_preserving": bool(fp), "residual": comps[0] if len(comps) == 1 else "[" + ", ".join(comps) + "]"}


def _symbolic_verdicts(loaded: LoadedFamily, report: AuditReport, out: dict) -> dict:
    """The symbolic engine's verdicts on a sympy family, compared with the numeric ones.

    ``tangent_rank`` is the engine's function-space rank of ``A`` (generic units, no
    measure); the parameterization is symbolically regular when it equals ``p``.
    """
    sym = symbolic_engine()
    fam = loaded.symbolic
    rank = sym.tangent_rank(fam)
    out["tangent_rank"] = int(rank)
    out["degenerate"] = bool(sym.is_degenerate(fam))
    out["regular"] = int(rank) == report.tangent_dim
    out["rank_agrees_with_probe"] = int(rank) == report.tangent_rank
    if not out["rank_agrees_with_probe"]:
        report.notes.append(
            f"the symbolic (generic-unit) tangent rank is {rank} but the probe's is "
            f"{report.tangent_rank}: the probe does not separate the tangent directions"
        )
    return out
