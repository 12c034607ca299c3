"""The framework-free part of the training callbacks: when to measure, how, and what to log."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from depthsat_theory.diagnose import Diagnosis, diagnose
from depthsat_theory.families import ResidualFamily
from depthsat_theory.tasks.custom import to_device
from depthsat_theory.vocabulary import Verdict

__all__ = ["METRICS", "SaturationMonitor", "saturation_metrics"]

METRICS: tuple[str, ...] = ("s", "s_over_ag_rms", "ag_max")
"""Names of the logged quantities per site, ``s`` (``score``), ``s/AG_rms`` (``relative_score``) and ``AG_max``."""


def saturation_metrics(diagnosis: Diagnosis, prefix: str = "depthsat") -> dict[str, float]:
    """The logged scalars of a diagnosis: ``{f"{prefix}/{site}/{metric}": value}`` for :data:`METRICS`.

    Args:
        diagnosis: a :class:`~depthsat_theory.diagnose.Diagnosis`.
        prefix: the metric names' first component (TensorBoard groups by it).

    Returns:
        Per site, ``s`` = ``result.score`` (loss units per example per unit function-space step),
        ``s_over_ag_rms`` = ``result.relative_score`` (scale-free, in ``[0, 1]``) and
        ``ag_max`` = ``result.ag_max`` (the largest per-example ``‖g(x)‖_F``), as Python floats.
    """
    out: dict[str, float] = {}
    for site in diagnosis.sites:
        r = site.result
        out[f"{prefix}/{site.site}/s"] = float(r.score)
        out[f"{prefix}/{site.site}/s_over_ag_rms"] = float(r.relative_score)
        out[f"{prefix}/{site.site}/ag_max"] = float(r.ag_max)
    return out


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
            if sd.verdict_kind is Verdict.IMPROVABLE and sd.site not in self.decided:
                self.decided[sd.site] = step
                out[f"{self.prefix}/{sd.site}/decided_step"] = float(step)
        return out
