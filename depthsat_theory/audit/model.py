"""Audit a residual family at a site of a torch model (:func:`audit_model`).

The probe ``(z, g)`` is captured with :func:`~depthsat_theory.capture.accumulate`; the family's
zero block is inserted after the site by :class:`~depthsat_theory.capture.Insertion`, which
measures the model-output deviation (``def-family``) and autograd's gradient of the inserted
block, compared with the statistics' ``b`` (T1, theory label ``thm-gradient``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from depthsat_theory.audit.family import audit_family, guarded, probe_layout
from depthsat_theory.audit.loading import AuditError, LoadedFamily
from depthsat_theory.audit.report import AuditReport
from depthsat_theory.capture import Insertion, SiteError, accumulate, resolve_module
from depthsat_theory.capture.kinks import KinkCounter
from depthsat_theory.families import ResidualFamily
from depthsat_theory.statistics import statistics_for
from depthsat_theory.vocabulary import Verdict

__all__ = ["audit_model"]


class _Collector:
    """An accumulator-like sink for :func:`~depthsat_theory.capture.accumulate` keeping ``(z, g)``."""

    def __init__(self) -> None:
        self.z: list[Tensor] = []
        self.g: list[Tensor] = []

    def update(self, z: Tensor, g: Tensor) -> None:
        self.z.append(z.detach().to(torch.float64).cpu())
        self.g.append(g.detach().to(torch.float64).cpu())


def _capture(model: torch.nn.Module, site: str, inputs, targets, loss, batch_size: int) -> tuple[Tensor, Tensor, int]:
    n = int(inputs.shape[0])
    batches = [(inputs[i : i + batch_size], targets[i : i + batch_size]) for i in range(0, n, batch_size)]
    sink = _Collector()
    counter = KinkCounter(model, [site])
    with counter:
        accumulate(model, [site], batches, counter.wrap_loss(loss), {site: sink})
    return torch.cat(sink.z), torch.cat(sink.g), counter.ties[site]


def _audit_layout(model: torch.nn.Module, site: str, z: Tensor):
    """The layout from the tensor rank; a channel-first ``Conv1d`` site ``(B, C, L)`` is refused."""
    from depthsat_theory.diagnose.discovery import rows_or_channels
    from depthsat_theory.vocabulary import Layout

    if z.dim() == 3 and rows_or_channels(resolve_module(model, site)) == Layout.IMAGE:
        raise AuditError(
            f"site {site!r} is a channel-first 1-D site (B, C, L) = {tuple(z.shape)} (its module ends with a 1-D "
            f"convolution, normalization or pooling): an audit inserts blocks on rows (T, d), which would take the "
            f"channels as units; pass layout='sequence' to audit it so on purpose, or use diagnose (positions as units)"
        )
    return probe_layout(z.dim())


def audit_model(
    family: ResidualFamily | LoadedFamily,
    model: torch.nn.Module,
    site: str,
    inputs,
    targets,
    loss: Callable[[Tensor, Tensor], Tensor],
    *,
    layout: str | None = None,
    probe: str = "model probe",
    batch_size: int = 256,
    strict: bool = True,
    sites: list[str] | None = None,
) -> AuditReport:
    """Audit a family at a site of a torch model on a probe batch.

    Captures ``z`` and the per-example ``g`` at ``site`` with
    :func:`~depthsat_theory.capture.accumulate`, inserts the family's zero block after the
    site (:class:`~depthsat_theory.capture.Insertion`) and measures the output deviation,
    then runs :func:`~depthsat_theory.audit.audit_family`; also compares autograd's gradient
    of the inserted block with the statistics' ``b`` (T1, ``gradient_check``, relative:
    ``max |b_autograd − b_statistics| / max |b|``; ``None`` if it cannot be computed).

    Args:
        family: the family (or a :class:`~depthsat_theory.audit.LoadedFamily`).
        model: the reference model (float64, eval mode recommended).
        site: module name of the site.
        inputs: the probe's inputs, a tensor with the examples along the first dimension.
        targets: the probe's targets, one per example (first dimension = examples).
        loss: per-example loss ``loss(model(x), y) -> (B,)``.
        layout: site layout (default: ``model.layout`` or from the tensor rank).
        probe: description for the report.
        batch_size: examples per forward/backward pass.
        strict: as in :func:`~depthsat_theory.audit.audit_family`.
        sites: the model's valid site names (for the error message; default
            ``model.site_names()`` when it exists).

    Returns:
        An :class:`~depthsat_theory.audit.AuditReport` with ``model_deviation`` and ``gradient_check``.

    Raises:
        SiteError: if ``site`` is not one of the model's sites.
        AuditError: a channel-first ``Conv1d`` site ``(B, C, L)`` without ``layout``.
        NotFunctionPreservingError, FamilyError, StatisticsError: as in
            :func:`~depthsat_theory.audit.audit_family`.
    """
    loaded = family if isinstance(family, LoadedFamily) else LoadedFamily(family, "object", "")
    site_names: Any = getattr(model, "site_names", None)
    valid = sites if sites is not None else (site_names() if site_names is not None else None)
    if valid is not None and site not in valid:
        raise SiteError(f"unknown site {site!r}; valid sites: {', '.join(valid)}")
    z, g, ties = _capture(model, site, inputs, targets, loss, batch_size)
    layout = layout or getattr(model, "layout", None) or _audit_layout(model, site, z)
    shape = tuple(z.shape[1:])
    fam = loaded.family
    spec = fam.spec or type(fam).__name__
    fam.check_site(shape, layout)
    with torch.no_grad():
        ref = model(inputs)
    block = guarded(spec, "building its block", lambda: fam.block(shape, layout, dtype=torch.float64))
    stats = statistics_for(fam, shape, layout)  # T1's b, accumulated once the audit has passed
    ins = guarded(
        spec,
        "running the model with the inserted block",
        lambda: Insertion(model, site, fam, stats, inputs, targets, loss, block=block, reference_output=ref, atol=None),
    )
    report = audit_family(loaded, z, g, layout=layout, probe=probe, strict=strict, model_deviation=ins.deviation)
    report.kink_ties = ties
    if ties:
        report.status = Verdict.UNDETERMINED
        report.notes.append(
            f"{ties} exact tie(s) at kinks after the site: J may not be differentiable at the origin and "
            f"autograd's b is a one-sided convention (thm-gradient, ex-kink-tie); the status is undetermined"
        )
    try:
        stats.update(z, g)
        report.gradient_check = ins.relative_gradient_error()
    except Exception:
        report.gradient_check = None
    return report
