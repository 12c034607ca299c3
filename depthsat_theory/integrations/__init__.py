"""Monitor saturation during training: callbacks for the Hugging Face ``Trainer`` and for Lightning.

Every ``every`` optimizer steps the callbacks run :func:`~depthsat_theory.diagnose.diagnose` on
a fixed probe set and log, per site, the headline ``s_U`` and ``s_U/AG_rms`` with its interval, the verdict
(as a number, :data:`VERDICT_CODES`), the noise ratio, the plug-in ``ŝ/AG_rms`` beside its chance level, and
``AG_max`` (:data:`METRICS`, :func:`saturation_metrics`) to the trainer's loggers, without touching the
training batches' gradients (the probe pass differentiates with respect to the site tensors only, and leaves
the parameters' ``.grad``, the model's train/eval mode and the RNG streams as they were).

* :class:`~depthsat_theory.integrations.huggingface.TrainerSaturationCallback`: a
  ``transformers.TrainerCallback`` (extra ``models``);
* :class:`~depthsat_theory.integrations.lightning.LightningSaturationCallback`: a
  ``lightning.pytorch.Callback`` (extra ``lightning``);
* :class:`SaturationMonitor`: the framework-free part both use.

The two framework modules are imported on first use, so this package needs neither.
"""

from __future__ import annotations

from typing import Any

from depthsat_theory.integrations.monitor import (
    METRICS,
    VERDICT_CODES,
    SaturationMonitor,
    saturation_metrics,
    site_metrics,
)

__all__ = [
    "METRICS",
    "VERDICT_CODES",
    "LightningSaturationCallback",
    "SaturationMonitor",
    "TrainerSaturationCallback",
    "saturation_metrics",
    "site_metrics",
]


def __getattr__(name: str) -> Any:
    if name == "TrainerSaturationCallback":
        from depthsat_theory.integrations.huggingface import TrainerSaturationCallback

        return TrainerSaturationCallback
    if name == "LightningSaturationCallback":
        from depthsat_theory.integrations.lightning import LightningSaturationCallback

        return LightningSaturationCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
