"""A Hugging Face ``transformers.TrainerCallback`` that logs saturation scores during training.

Usage::

    from depthsat_theory.integrations.huggingface import TrainerSaturationCallback

    trainer = Trainer(model=model, args=args, train_dataset=train)
    TrainerSaturationCallback(probe_batches, every=50).attach(trainer)
    trainer.train()  # every 50 steps: depthsat/<site>/s_u, .../s_u_over_ag_rms, .../verdict, ...

The values go through ``trainer.log``, the Trainer's own route: into ``trainer.state.log_history``
and to every ``report_to`` integration (TensorBoard, CSV, W&B, ...), on the main process. (A
callback's ``on_log`` sees the logs dict only after ``log_history`` and the reporting callbacks
registered before it have consumed it, so it cannot add values cleanly; hence :meth:`attach`.)
Under ``accelerate``/``torchrun`` every process measures and the probe is sharded over the
processes, the sums all-reduced (:mod:`depthsat_theory.diagnose.distributed`; tested under
``torchrun``, not yet inside a multi-process Trainer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from depthsat_theory.extras import MissingExtraError
from depthsat_theory.integrations.monitor import SaturationMonitor
from depthsat_theory.tasks.zoo import token_loss_masked

try:
    from transformers import TrainerCallback
except ImportError as exc:
    raise MissingExtraError("transformers", "models", "depthsat_theory.integrations.huggingface") from exc

__all__ = ["TrainerSaturationCallback"]


class TrainerSaturationCallback(TrainerCallback):
    """Diagnose the model's sites on a fixed probe set every ``every`` optimizer steps and log the scores.

    Args:
        batches: probe batches ``(inputs, labels)`` (``inputs`` a dict of keyword tensors, e.g.
            ``{"input_ids", "attention_mask"}``), or Hugging Face mappings with ``"labels"``.
        every: optimizer steps between measurements (at steps ``every, 2·every, …``).
        loss_fn: per-example losses ``loss_fn(output, labels) -> (B,)``; default
            :func:`~depthsat_theory.tasks.zoo.token_loss_masked` (next-token cross-entropy, nats
            per token, mean over the example's own predicted tokens; labels ``-100`` excluded).
        sites: site names (default: discovered, e.g. ``model.layers.N``).
        family: the residual family (default ``"linear"``).
        prefix: first component of the metric names.
        **diagnose_kwargs: further keyword arguments of :func:`~depthsat_theory.diagnose.diagnose`.

    Attributes:
        monitor: the :class:`~depthsat_theory.integrations.SaturationMonitor` (last diagnosis, step).

    Raises:
        depthsat_theory.extras.MissingExtraError: ``transformers`` is not installed (extra ``models``).
        RuntimeError: training starts before :meth:`attach`.
    """

    def __init__(
        self,
        batches: Iterable,
        *,
        every: int,
        loss_fn: Callable | None = None,
        sites: list[str] | None = None,
        family: Any = "linear",
        prefix: str = "depthsat",
        **diagnose_kwargs: Any,
    ) -> None:
        self.monitor = SaturationMonitor(
            batches,
            loss_fn or token_loss_masked,
            every=every,
            sites=sites,
            family=family,
            prefix=prefix,
            **diagnose_kwargs,
        )
        self._trainer: Any = None

    def attach(self, trainer: Any) -> TrainerSaturationCallback:
        """Register this callback with ``trainer`` (``trainer.add_callback``) and log through it.

        Args:
            trainer: a ``transformers.Trainer``.

        Returns:
            ``self``.
        """
        trainer.add_callback(self)
        self._trainer = trainer
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        """Refuse to run unattached: the values would have nowhere to go.

        Args:
            args: the ``TrainingArguments`` (unused).
            state: the ``TrainerState`` (unused).
            control: the ``TrainerControl``.
            **kwargs: the Trainer's other callback arguments (unused).

        Returns:
            ``control``, unchanged.

        Raises:
            RuntimeError: if :meth:`attach` was not called.
        """
        if self._trainer is None:
            raise RuntimeError(
                "TrainerSaturationCallback is not attached: call callback.attach(trainer) instead of "
                "passing it in Trainer(callbacks=[...])"
            )
        return control

    def on_step_end(self, args, state, control, model=None, **kwargs):
        """After optimizer step ``state.global_step``: measure when due and ``trainer.log`` the scores.

        ``trainer.log`` clears ``control.should_log``; it is restored, so that the Trainer still logs its
        own training loss at this step when it was due (otherwise that row would be dropped and the
        next one averaged over the longer window).

        Args:
            args: the ``TrainingArguments`` (unused).
            state: the ``TrainerState`` (its ``global_step``).
            control: the ``TrainerControl``.
            model: the model being trained (``None``: nothing is measured).
            **kwargs: the Trainer's other callback arguments (unused).

        Returns:
            ``control``, with ``should_log`` as before the measurement.
        """
        if model is not None and self.monitor.due(state.global_step):
            should_log = control.should_log
            self._trainer.log(self.monitor.measure(model, state.global_step))
            control.should_log = should_log
        return control
