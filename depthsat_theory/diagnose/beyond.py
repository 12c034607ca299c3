"""What :func:`~depthsat_theory.diagnose.diagnose` reports beyond the first-order score.

- kink ties downstream of each site (:class:`~depthsat_theory.capture.kinks.KinkCounter`,
  ``thm-gradient``): a positive count makes the verdict ``undetermined``;
- the saddle score of the cross block
  (:class:`~depthsat_theory.statistics.secondorder.CrossBlockStatistics`, ``thm-strict-saddle``)
  with ``second_order=True``;
- the guaranteed finite-step decrease ``s²/(2β)`` (``thm-guaranteed-decrease``) with ``beta``,
  and the ``ε`` of "certified ε-saturated" derived from it
  (:func:`~depthsat_theory.statistics.decrease.epsilon_from_nats`); every given ``β`` is checked
  by running the step ``−Πg/β`` on the probe (:func:`check_betas`, ``cor-beta-refuted``), and a
  refuted one reports no decrease.

Kink ties are counted over the batches of this run (summed over the ranks under ``torchrun``), starting
from the counts stored in the checkpoint of a resumed run.  Cross blocks are not sharded or
checkpointed: ``second_order`` reports them only for a fresh single-process run.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from depthsat_theory.capture.curvature import field_curvature, step_decrease
from depthsat_theory.capture.kinks import KinkCounter
from depthsat_theory.capture.probe import update_statistics
from depthsat_theory.diagnose.errors import DiagnoseError
from depthsat_theory.families import FamilyError, FeatureFamily, ResidualFamily
from depthsat_theory.statistics.decrease import DEFAULT_EPSILON_NATS, epsilon_from_nats
from depthsat_theory.statistics.secondorder import CrossBlockStatistics
from depthsat_theory.vocabulary import Verdict

__all__ = ["SECOND_ORDER_MAX_BYTES", "Beyond", "check_betas", "site_betas"]

#: Largest total size of the streamed cross blocks of one run (all sites together), in bytes.  SmolLM2
#: at all 30 sites with ``relu:16`` needs 1.19 GiB (``16·576·577`` float64 per site).
SECOND_ORDER_MAX_BYTES = 8 * 2**30


def site_betas(beta: float | Mapping[str, float] | None, sites: list[str]) -> dict[str, float]:
    """``{site: β}`` from one ``β`` for every site or a mapping (sites without one are left out).

    Args:
        beta: ``None``, one ``β > 0`` for every site, or ``{site: β}``.
        sites: the diagnosed sites.

    Returns:
        ``{site: β}`` as floats (empty for ``None``).

    Raises:
        DiagnoseError: a ``β`` that is not a positive finite number, or one for an unknown site.
    """
    if beta is None:
        return {}
    raw = dict(beta) if isinstance(beta, Mapping) else dict.fromkeys(sites, beta)
    unknown = sorted(set(raw) - set(sites))
    if unknown:
        raise DiagnoseError(f"beta is given for unknown site(s) {unknown}; the sites are {sites}")
    out = {}
    for s, b in raw.items():
        if not isinstance(b, (int, float)) or not math.isfinite(b) or b <= 0:
            raise DiagnoseError(f"beta for site {s!r} must be a positive finite number, got {b!r}")
        out[s] = float(b)
    return out


class Beyond:
    """Kink counts and cross blocks streamed alongside the first-order statistics of one run."""

    def __init__(self, model: nn.Module, sites: list[str], family: ResidualFamily, *, kinks: bool, second_order: bool):
        if second_order and not isinstance(family, FeatureFamily):
            raise DiagnoseError(
                f"second_order needs a random-feature family (relu:K, gelu:K, tanh:K), not {family.spec!r}"
            )
        self.sites = sites
        self.family = family
        self.counter = KinkCounter(model, sites) if kinks else None
        self.second_order = second_order
        self.cross: dict[str, CrossBlockStatistics] = {}
        self.batches = 0

    def wrap_loss(self, loss_fn: Callable) -> Callable:
        """The loss function, closing each forward pass of the kink counter.

        Args:
            loss_fn: the per-example loss function.

        Returns:
            ``loss_fn`` itself without a kink counter, else :meth:`KinkCounter.wrap_loss` of it.
        """
        return loss_fn if self.counter is None else self.counter.wrap_loss(loss_fn)

    def context(self):
        """The kink counter's context (a no-op without one).

        Returns:
            The :class:`KinkCounter` (a context manager), or ``contextlib.nullcontext()``.
        """
        return self.counter if self.counter is not None else contextlib.nullcontext()

    def add(self, pb, layouts: Mapping[str, str]) -> None:
        """Feed one probe batch's ``(z, g)`` to the cross blocks (with ``second_order``).

        Args:
            pb: the :class:`~depthsat_theory.capture.probe.ProbeBatch` (site tensors ``z``, gradients ``g``
                and padding ``mask``).
            layouts: the layout of each site.

        Raises:
            DiagnoseError: if a site's cross block cannot be built (family or size) or all cross blocks
                together exceed :data:`SECOND_ORDER_MAX_BYTES`.
        """
        self.batches += 1
        if not self.second_order:
            return
        for s in self.sites:
            if s not in self.cross:
                try:
                    self.cross[s] = CrossBlockStatistics(self.family, tuple(pb.z[s].shape[1:]), layouts[s])  # type: ignore[arg-type]
                except FamilyError as exc:
                    raise DiagnoseError(f"site {s!r}: {exc}") from None
                self._check_memory()
            update_statistics(self.cross[s], pb.z[s], pb.g[s], pb.mask, s)  # padded rows dropped

    def _check_memory(self) -> None:
        """Refuse, in one line, cross blocks above :data:`SECOND_ORDER_MAX_BYTES` in all (before they grow)."""
        total = sum(c.blocks.numel() * c.blocks.element_size() for c in self.cross.values())
        if total > SECOND_ORDER_MAX_BYTES:
            per = total / len(self.cross)
            fit = max(int(SECOND_ORDER_MAX_BYTES // per), 1)
            raise DiagnoseError(
                f"second_order: the cross blocks of {len(self.cross)} of {len(self.sites)} sites already take "
                f"{total / 2**30:.2f} GiB (K·d·(d+1) float64 per site, limit {SECOND_ORDER_MAX_BYTES / 2**30:g} GiB): "
                f"diagnose at most {fit} sites per run (--sites) or use fewer features"
            )

    def reduce(self) -> None:
        """Sum the kink ties over the ranks under ``torchrun`` (a no-op in one process)."""
        from depthsat_theory.diagnose import distributed as _dist

        if self.counter is not None and _dist.world()[1] > 1:
            every = _dist.all_gather_objects(dict(self.counter.ties))
            self.counter.ties = {s: sum(int(t[s]) for t in every) for s in self.sites}

    def finish(self, site_results: list, betas: Mapping[str, float], whole_probe: bool) -> None:
        """Attach kink ties, saddle results and ``β`` to the :class:`SiteDiagnosis` list.

        Args:
            site_results: the :class:`SiteDiagnosis` of each site, changed in place.
            betas: ``{site: β}`` (sites without one get ``beta = None``).
            whole_probe: whether this process streamed the whole probe (not a resumed run): saddle results
                are attached only then (cross blocks are not checkpointed).  Kink ties always cover the whole
                probe: a resumed run starts from the checkpoint's counts.
        """
        for sd in site_results:
            if self.counter is not None:
                sd.result.kink_ties = self.counter.ties[sd.site]
                sd.result.saturated = sd.result.verdict is Verdict.SATURATED
            if sd.site in self.cross and whole_probe and _world() == 1:  # cross blocks are not sharded
                sd.saddle = self.cross[sd.site].result()
            sd.beta = betas.get(sd.site)


def _on_steepest_field(measure: Callable, sd, stats, run: tuple, **kw) -> tuple[Any, str | None]:
    """Run ``measure`` (:func:`field_curvature`, :func:`step_decrease`) along the steepest field at ``sd``'s site.

    Args:
        measure: the measurement, called as ``measure(model, loss_fn, batches, site, family, G, Σ, layout=…, **kw)``.
        sd: the :class:`SiteDiagnosis`.
        stats: ``{site: statistics}`` with the probe's ``G`` and ``Σ``.
        run: ``(model, loss_fn, batches, family)``.
        **kw: the measurement's own keyword arguments.

    Returns:
        ``(result, None)``, or ``(None, "site (Error: first line)")`` when the field cannot be inserted into the
        model or differentiated (e.g. an operation without a double backward).
    """
    model, loss_fn, batches, family = run
    st = stats[sd.site]
    try:
        out = measure(
            model, loss_fn, batches, sd.site, family, st.cross_gradient(), st.feature_gram(), layout=sd.layout, **kw
        )
    except (ValueError, RuntimeError, TypeError) as exc:
        return None, f"{sd.site} ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    return out, None


def measure_curvatures(
    diagnosis, model: nn.Module, loss_fn: Callable, batches: list, family: FeatureFamily, stats
) -> None:
    """Attach :class:`~depthsat_theory.capture.curvature.FieldCurvature` to every site of ``diagnosis``.

    Vector, sequence and image sites alike: the steepest field ``Πg = G Σ⁺ φ̃`` acts on every row (token,
    pixel) of the site tensor, as the block would.  A site where ``κ`` is not measured (``s = 0``: no
    steepest field; a model the field cannot be inserted into) keeps ``curvature = None`` and one note says
    why, so a missing value is never silent.
    """
    missing = []
    for sd in diagnosis.sites:
        if sd.result.score == 0:
            missing.append(f"{sd.site} (s = 0: no steepest field)")
            continue
        sd.curvature, failure = _on_steepest_field(
            field_curvature, sd, stats, (model, loss_fn, batches, family), score=sd.result.score
        )
        if failure is not None:
            missing.append(failure)
    if missing:
        diagnosis.notes.append(f"κ (--curvature) not measured at {', '.join(missing)}")


def check_betas(diagnosis, model: nn.Module, loss_fn: Callable, batches, family, stats, reduction: str) -> None:
    """Run the step ``−Πg/β`` on the probe at every site with a ``β`` (``cor-beta-refuted``).

    Sites where the step cannot be run (a streamed probe, a family without fixed features,
    batch-reduced losses) keep ``beta_check = None`` (status ``unchecked``),
    and a note says so: their ``s²/(2β)`` holds only if the given ``β`` is a smoothness constant there.

    Args:
        diagnosis: the :class:`Diagnosis`; its sites' ``beta_check`` and its ``notes`` are set in place.
        model: the diagnosed model.
        loss_fn: the loss function.
        batches: the probe (the step is run only for a list or tuple of batches).
        family: the family (the step is run only for a :class:`FeatureFamily`).
        stats: ``{site: statistics}`` with the probe's ``G`` and ``Σ``.
        reduction: the loss reduction (the step is run only for ``"none"``).
    """
    runnable = isinstance(batches, (list, tuple)) and isinstance(family, FeatureFamily) and reduction == "none"
    unchecked = []
    for sd in diagnosis.sites:
        if sd.beta is None or sd.result.score == 0:
            continue
        if not runnable:
            unchecked.append(sd.site)
            continue
        sd.beta_check, failure = _on_steepest_field(
            step_decrease, sd, stats, (model, loss_fn, batches, family), step=-1.0 / sd.beta
        )
        if failure is not None:
            unchecked.append(failure)
    refuted = [sd.site for sd in diagnosis.sites if sd.beta_status == "refuted"]
    if refuted:
        diagnosis.notes.append(
            f"β refuted at {', '.join(refuted)}: the step −Πg/β removed less than s²/(2β) on the probe, so β is not "
            "a smoothness constant there (cor-beta-refuted); no decrease is guaranteed, and an ε derived from this β "
            "bounds s but not the loss. ½‖W‖₂² holds at the head's input only (lem-ce-smoothness); deeper sites need "
            "prop-beta-composed"
        )
    small = [sd.site for sd in diagnosis.sites if sd.beta_status == "within rounding"]
    if small:
        diagnosis.notes.append(
            f"β at {', '.join(small)}: the promised s²/(2β) and what the step −Πg/β removed differ by less than the "
            "rounding of the loss, so the probe cannot test it (marked ?)"
        )
    if unchecked:
        diagnosis.notes.append(
            f"β not checked at {', '.join(unchecked)} (needs a list probe, a feature family and per-example "
            "losses): s²/(2β) there holds only if β is a smoothness constant at that site (marked ?)"
        )


def _world() -> int:
    from depthsat_theory.diagnose import distributed as _dist

    return _dist.world()[1]


def default_epsilon(bound_kwargs: Mapping, beta: float | None) -> dict:
    """``bound_kwargs`` with ``epsilon = sqrt(2 β ε_J)`` (``ε_J``: :data:`DEFAULT_EPSILON_NATS`) given ``β``."""
    out = dict(bound_kwargs)
    if beta is not None and out.get("epsilon") is None:
        out["epsilon"] = epsilon_from_nats(DEFAULT_EPSILON_NATS, beta)
    return out
