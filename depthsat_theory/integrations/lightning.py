"""A Lightning ``Callback`` that logs saturation scores during training.

Usage::

    from lightning.pytorch.loggers import CSVLogger
    from depthsat_theory.integrations.lightning import LightningSaturationCallback

    monitor = LightningSaturationCallback(probe_batches, loss_fn, every=50)
    trainer = lightning.Trainer(max_steps=1000, logger=CSVLogger("logs"), callbacks=[monitor])
    trainer.fit(module, train_loader)  # every 50 steps: depthsat/<site>/s_u, .../s_u_over_ag_rms, .../verdict, ...

The values go to every logger of the trainer (``trainer.loggers``: CSV, TensorBoard, ...) with
``log_metrics(metrics, step=trainer.global_step)``, at exactly the measured step (``pl_module.log``
would be subject to ``log_every_n_steps``); the loggers write on rank zero only. Under DDP every
rank measures and the probe is sharded over the ranks, the sums all-reduced
(:mod:`depthsat_theory.diagnose.distributed`; tested under ``torchrun``, not yet inside a
multi-process Trainer). The diagnosed model is the ``LightningModule``
itself (sites are its module names, e.g. ``net.blocks.0``), called as ``pl_module(inputs)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from depthsat_theory.extras import MissingExtraError
from depthsat_theory.integrations.monitor import SaturationMonitor

try:
    from lightning.pytorch import Callback
except ImportError as exc:
    raise MissingExtraError("lightning", "lightning", "depthsat_theory.integrations.lightning") from exc

__all__ = ["LightningSaturationCallback"]


class LightningSaturationCallback(Callback):
    """Diagnose the module's sites on a fixed probe set every ``every`` optimizer steps and log the scores.

    Args:
        batches: probe batches ``(inputs, targets)`` (as for :func:`~depthsat_theory.diagnose.diagnose`).
        loss_fn: per-example losses ``loss_fn(pl_module(inputs), targets) -> (B,)``.
        every: optimizer steps between measurements (at ``trainer.global_step = every, 2·every, …``).
        sites: site names of the ``LightningModule`` (default: discovered).
        family: the residual family (default ``"linear"``).
        prefix: first component of the metric names.
        **diagnose_kwargs: further keyword arguments of ``diagnose``.

    Attributes:
        monitor: the :class:`~depthsat_theory.integrations.SaturationMonitor` (last diagnosis, step).

    Raises:
        depthsat_theory.extras.MissingExtraError: ``lightning`` is not installed (extra ``lightning``).
    """

    def __init__(
        self,
        batches: Iterable,
        loss_fn: Callable,
        *,
        every: int,
        sites: list[str] | None = None,
        family: Any = "linear",
        prefix: str = "depthsat",
        **diagnose_kwargs: Any,
    ) -> None:
        super().__init__()
        self.monitor = SaturationMonitor(
            batches, loss_fn, every=every, sites=sites, family=family, prefix=prefix, **diagnose_kwargs
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """After a training batch: when optimizer step ``trainer.global_step`` is due, measure and log.

        Args:
            trainer: the Lightning ``Trainer`` (its ``global_step`` and ``loggers``).
            pl_module: the ``LightningModule`` being trained (measured).
            outputs: the training step's outputs (unused).
            batch: the batch (unused).
            batch_idx: the batch index (unused).
        """
        step = int(trainer.global_step)
        if not self.monitor.due(step):
            return
        metrics = self.monitor.measure(pl_module, step)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
