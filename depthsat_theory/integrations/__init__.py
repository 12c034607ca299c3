"""Monitor saturation during training: callbacks for the Hugging Face ``Trainer`` and for Lightning.

Every ``every`` optimizer steps the callbacks run :func:`~depthsat_theory.diagnose.diagnose` on
a fixed probe set and log, per site, ``s``, ``s/AG_rms`` and ``AG_max``
(:func:`saturation_metrics`) to the trainer's loggers, without touching the training batches'
gradients (the probe pass differentiates with respect to the site tensors only, and leaves
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

from depthsat_theory.integrations.monitor import METRICS, SaturationMonitor, saturation_metrics

__all__ = [
    "METRICS",
    "LightningSaturationCallback",
    "SaturationMonitor",
    "TrainerSaturationCallback",
    "saturation_metrics",
]


def __getattr__(name: str) -> Any:
    if name == "TrainerSaturationCallback":
        from depthsat_theory.integrations.huggingface import TrainerSaturationCallback

        return TrainerSaturationCallback
    if name == "LightningSaturationCallback":
        from depthsat_theory.integrations.lightning import LightningSaturationCallback

        return LightningSaturationCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
