"""The framework-free part of the training callbacks: when to measure, how, and what to log."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from depthsat_theory.diagnose import Diagnosis, SiteDiagnosis, diagnose
from depthsat_theory.families import ResidualFamily
from depthsat_theory.tasks.custom import to_device
from depthsat_theory.vocabulary import Verdict

__all__ = ["METRICS", "VERDICT_CODES", "SaturationMonitor", "saturation_metrics", "site_metrics"]

METRICS: tuple[str, ...] = (
    "s_u",
    "s_u_over_ag_rms",
    "s_u_low",
    "s_u_high",
    "verdict",
    "noise_ratio",
    "plugin_s_over_ag_rms",
    "chance_over_ag_rms",
    "s",
    "s_over_ag_rms",
    "ag_max",
)
"""Names of the logged quantities per site, headline first (theory/decision.md, ``def-bias-corrected-score``).

``s_u`` (the bias-corrected score ``s_U``), ``s_u_over_ag_rms`` (``s_U/AG_rms``), ``s_u_low``/``s_u_high`` (its
interval, ``prop-headline-interval``), ``verdict`` (:data:`VERDICT_CODES`), ``noise_ratio`` (``n ŝ²/v̂``, compared
with ``χ²_{1,1−α}`` by the noise test), then the plug-in ``plugin_s_over_ag_rms`` beside its chance level
``chance_over_ag_rms`` (``prop-plugin-chance-level``), the plug-in ``s`` and ``s_over_ag_rms`` (same values as
``plugin_s_over_ag_rms``; kept for existing dashboards) and ``ag_max``.
"""

#: The logged ``verdict`` of a site as a number (loggers take scalars): improvable 1, undetermined 0.5,
#: saturated 0, degenerate −1.
VERDICT_CODES: dict[Verdict, float] = {
    Verdict.IMPROVABLE: 1.0,
    Verdict.UNDETERMINED: 0.5,
    Verdict.SATURATED: 0.0,
    Verdict.DEGENERATE: -1.0,
}


def site_metrics(site: SiteDiagnosis) -> dict[str, float]:
    """The :data:`METRICS` of one site, as Python floats (``nan`` where the headline is unavailable).

    Args:
        site: a :class:`~depthsat_theory.diagnose.SiteDiagnosis`.

    Returns:
        ``{metric: value}`` for every name of :data:`METRICS`; scores in loss units per example per unit
        function-space step, ratios scale-free.
    """
    r, h = site.result, site.headline
    nan = math.nan
    return {
        "s_u": nan if h is None else h.score,
        "s_u_over_ag_rms": nan if h is None else h.relative_score,
        "s_u_low": nan if h is None else h.low,
        "s_u_high": nan if h is None else h.high,
        "verdict": VERDICT_CODES[site.verdict],
        "noise_ratio": float(r.noise_ratio),
        "plugin_s_over_ag_rms": float(r.relative_score),
        "chance_over_ag_rms": nan if h is None else h.relative_chance,
        "s": float(r.score),
        "s_over_ag_rms": float(r.relative_score),
        "ag_max": float(r.ag_max),
    }


def saturation_metrics(diagnosis: Diagnosis, prefix: str = "depthsat") -> dict[str, float]:
    """The logged scalars of a diagnosis: ``{f"{prefix}/{site}/{metric}": value}`` for :data:`METRICS`.

    Args:
        diagnosis: a :class:`~depthsat_theory.diagnose.Diagnosis`.
        prefix: the metric names' first component (TensorBoard groups by it).

    Returns:
        Per site, the values of :func:`site_metrics` (headline, verdict code, noise ratio, plug-in and its chance
        level, ``AG_max``) as Python floats.
    """
    return {f"{prefix}/{sd.site}/{name}": value for sd in diagnosis.sites for name, value in site_metrics(sd).items()}


class SaturationMonitor:
    """Diagnose a model on a fixed probe set every ``every`` optimizer steps.

    Args:
        batches: the probe batches (as for :func:`~depthsat_theory.diagnose.diagnose`); held, and
            moved to the model's device when measured.
        loss_fn: per-example losses ``loss_fn(output, targets) -> (B,)``.
        every: measure at the optimizer steps ``every, 2·every, …`` (``>= 1``).
        sites: site names (default: discovered on the first measurement, then kept).
        family: the residual family (spec or object), as for ``diagnose``.
        prefix: first component of the metric names (:func:`saturation_metrics`).
        **diagnose_kwargs: further keyword arguments of ``diagnose`` (fields of
            :class:`~depthsat_theory.diagnose.DiagnoseOptions`: ``layout``, ``reduction``, ``mask_fn``,
            ``output_key``, ``loss_units``, ``until_decided``, ``max_examples``, ...; not ``checkpoint`` or
            ``delta``).  With ``until_decided=True`` each measurement streams the probe until every site is
            decided by the anytime noise test (``thm-anytime-noise-test``, level α per measurement) or
            ``max_examples`` is spent; the metrics add ``examples_used`` per site, and ``decided_step`` (the
            optimizer step) once, at the first measurement that decides the site.

    Attributes:
        diagnosis: the last :class:`~depthsat_theory.diagnose.Diagnosis` (``None`` before the first).
        step: the optimizer step it was measured at.
        decided: ``{site: optimizer step}`` of the first measurement at which the anytime test decided each
            site (``until_decided`` only; a site is reported decided once).  Each measurement is a level-α
            test of its own model; over many measurements the chance that some measurement decides a site
            whose score is zero throughout is not bounded by α.

    Raises:
        ValueError: ``every < 1``, an empty probe, or a ``checkpoint``/``delta`` keyword.
    """

    def __init__(
        self,
        batches: Iterable,
        loss_fn: Callable[..., torch.Tensor],
        *,
        every: int,
        sites: list[str] | None = None,
        family: str | ResidualFamily = "linear",
        prefix: str = "depthsat",
        **diagnose_kwargs: Any,
    ) -> None:
        if int(every) < 1:
            raise ValueError(f"every must be >= 1 optimizer step, got {every}")
        self.batches = list(batches)
        if not self.batches:
            raise ValueError("batches is empty: the monitor needs a fixed, non-empty probe set")
        bad = sorted({"checkpoint", "delta", "progress"} & set(diagnose_kwargs))
        if bad:
            raise ValueError(f"{', '.join(bad)} do not apply to a monitor (one diagnosis per measurement)")
        self.loss_fn = loss_fn
        self.every = int(every)
        self.sites = list(sites) if sites is not None else None
        self.family = family
        self.prefix = prefix
        self.kwargs = diagnose_kwargs
        self.diagnosis: Diagnosis | None = None
        self.step: int | None = None
        self.decided: dict[str, int] = {}
        self._placed: tuple[torch.device | None, list] = (None, self.batches)

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` is one to measure at (and was not measured yet).

        Args:
            step: the optimizer step count.

        Returns:
            ``True`` for a positive multiple of ``every`` other than the last step measured.
        """
        return step > 0 and step % self.every == 0 and step != self.step

    def _batches_on(self, device: torch.device) -> list:
        if self._placed[0] != device:
            self._placed = (device, [to_device(b, device) for b in self.batches])
        return self._placed[1]

    def measure(self, model: nn.Module, step: int) -> dict[str, float]:
        """Diagnose ``model`` now and return its :func:`saturation_metrics`.

        The model runs in eval mode (train-mode dropout would make ``g`` random) and every
        submodule is put back in its own mode (a submodule the user froze in eval mode stays so);
        the RNG streams (CPU and the model's CUDA device) are saved and restored, and
        no parameter gradient is formed (``diagnose`` differentiates with respect to the sites
        only), so the training run continues exactly as without the monitor.

        Args:
            model: the (unwrapped) model being trained.
            step: the optimizer step, stored in :attr:`step`.

        Returns:
            ``{f"{prefix}/{site}/{metric}": float}`` (with ``until_decided``: also ``examples_used`` per site and
            ``decided_step`` for a site decided for the first time).

        Raises:
            depthsat_theory.diagnose.DiagnoseError, depthsat_theory.capture.SiteError: as ``diagnose``.
        """
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        batches = self._batches_on(device)
        modes = [(m, m.training) for m in model.modules()]  # per module: a frozen BatchNorm stays in eval
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            model.eval()
            try:
                d = diagnose(model, self.loss_fn, batches, sites=self.sites, family=self.family, **self.kwargs)
            finally:
                for m, training in modes:
                    m.training = training
        if self.sites is None:
            self.sites = [s.site for s in d.sites]
        self.diagnosis, self.step = d, step
        metrics = saturation_metrics(d, self.prefix)
        if d.until_decided:
            metrics.update(self._decisions(d, step))
        return metrics

    def _decisions(self, d: Diagnosis, step: int) -> dict[str, float]:
        """A streamed measurement's metrics: examples used per site, and each new decision once, with its step."""
        out: dict[str, float] = {}
        for sd in d.sites:
            out[f"{self.prefix}/{sd.site}/examples_used"] = float(sd.examples_used or 0)
            if sd.verdict is Verdict.IMPROVABLE and sd.site not in self.decided:
                self.decided[sd.site] = step
                out[f"{self.prefix}/{sd.site}/decided_step"] = float(step)
        return out
