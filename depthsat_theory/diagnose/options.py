"""The options of :func:`~depthsat_theory.diagnose.diagnose`, in one documented object shared by the API and the CLI.

``diagnose(model, loss_fn, batches, options=DiagnoseOptions(...))`` and the keyword form
``diagnose(model, loss_fn, batches, delta=0.05, ...)`` are the same call: every keyword of
:func:`diagnose` is a field of :class:`DiagnoseOptions`.  Keywords given together with ``options``
**override** the options' fields (``dataclasses.replace``), so a shared options object can be varied per
call; an unknown keyword is a :class:`TypeError` naming the fields.  The ``depthsat diagnose`` command
builds one :class:`DiagnoseOptions` from its flags (``depthsat_theory.cli.app``).

To add an option: add a field here (with its docstring entry and default), check it in
:meth:`DiagnoseOptions.check`, and read it in :func:`~depthsat_theory.diagnose.run.diagnose`; the CLI
flag, if any, fills the field.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from depthsat_theory.diagnose.errors import DiagnoseError
from depthsat_theory.families import ResidualFamily

__all__ = ["DiagnoseOptions", "resolve_options"]


@dataclass(frozen=True, kw_only=True)
class DiagnoseOptions:
    """Everything :func:`~depthsat_theory.diagnose.diagnose` takes besides the model, the loss and the probe.

    Scores are in the loss's units (``loss_units``, default nats per example) per unit function-space step
    (theory/definitions.md, ``def-score``).  Defaults reproduce ``diagnose(model, loss_fn, batches)``.

    Attributes:
        sites: module names of the insertion sites; ``None`` (default): discovered
            (:func:`~depthsat_theory.diagnose.discovery.discover_sites`; one extra no-grad forward when the
            model has no ``site_names()``).
        family: the residual family at every site: a spec string
            (:func:`~depthsat_theory.families.parse_family`, default ``"linear"``) or a
            :class:`~depthsat_theory.families.base.ResidualFamily`.
        delta: ``δ ∈ (0, 1)``: add the ``(1 − δ)`` interval (``thm-finite-sample``, zero-output feature
            families only), union-bounded over the sites; ``None`` (default): no interval.
        realizability: pool exactly equal units to report ``r̂`` and ``ρ̂`` (memory grows with the number of
            distinct units).
        progress: ``progress(batches done on this rank, total or None)`` after each processed batch.
        checkpoint: path of a checkpoint file (safetensors); resumed from when it exists and matches,
            rewritten atomically every ``checkpoint_every`` batches and at the end
            (:mod:`depthsat_theory.diagnose.checkpoint`).
        checkpoint_every: probe batches between checkpoint writes (``≥ 1``).
        layout: ``"vector"``, ``"sequence"`` or ``"image"`` for all sites, or ``{site: layout}``; ``None``:
            the model's ``layout`` attribute, else inferred
            (:func:`~depthsat_theory.diagnose.discovery.infer_layout`).
        total: the number of probe batches, for ``progress`` (default ``len(batches)`` when available).
        config: extra JSON-serialisable configuration that must match to resume from a checkpoint.
        description: free text stored in the result (model name, probe).
        bound_kwargs: passed to :meth:`~depthsat_theory.bounds.statistics.BoundStatistics.interval`
            (``grad_max``, ``leverage_max``, ``epsilon``, …).
        reduction: how ``loss_fn`` reduces: ``"none"`` (per-example ``(B,)``, default), ``"sum"``, ``"mean"``
            (multiplied by ``B``) or ``"token_mean"`` (per-token ``(B, T)``; each example's mean over its own
            tokens) (:data:`~depthsat_theory.capture.probe.REDUCTIONS`).
        mask_fn: ``mask_fn(inputs, targets) -> (B, T)`` bool padding mask (``True`` at real tokens) for
            batches without one; default for dict (Hugging Face) inputs: their ``attention_mask``.
        output_key: where the site tensor is in a structured output (``None``, an index, a key, or
            ``{site: key}``), as in :class:`~depthsat_theory.capture.sites.SiteRecorder`.
        batchnorm: ``"error"`` (default), ``"warn"`` or ``"ignore"`` when a BatchNorm normalizes with batch
            statistics.
        loss_units: units of the per-example loss, for the outputs (default ``"nats per example"``).
        batch_dim: where the batch is in the site tensors: ``None`` (inferred), ``0``, ``1`` or
            ``{site: dim}`` (:mod:`depthsat_theory.capture.batchdim`).
        beta: smoothness ``β`` of the loss in the added field (one for every site or ``{site: β}``), in
            (loss units) per (function-space step)²: report the guaranteed decrease ``s²/(2β)``
            (``thm-guaranteed-decrease``), each ``β`` checked on the probe (``cor-beta-refuted``).
        second_order: also stream the Hessian's cross block and report the saddle score
            (``thm-strict-saddle``; ``relu:K``/``gelu:K``/``tanh:K``; fresh single-process runs only).
        kinks: count exact ties at kinks after each site (``thm-gradient``; default ``True``); a positive
            count makes the verdict ``undetermined``.
        curvature: also measure the curvature ``κ`` along ``Πg`` and report ``s²/(2κ)`` (a list/tuple
            probe, per-example losses, a feature family).
        gram: ``"auto"`` (default), ``"features"`` or ``"units"``: what feature-family sites stream
            (theory/numerics.md, ``thm-unit-gram``).
        products: ``"float64"`` (default) or ``"float32"``: dtype of the per-batch products of feature-family
            sites (``thm-score-error``).
        until_decided: stream the probe until every site is decided by the anytime-valid noise test
            (theory/decision.md, ``thm-anytime-noise-test``) or the budget is spent, instead of reading the
            whole probe; a decided site's verdict is the anytime test's (*improvable* at level
            :data:`~depthsat_theory.statistics.linalg.NOISE_ALPHA` whatever the stopping), and an undecided
            site's never rests on the fixed-size noise test (zero-output feature families, one process,
            no ``delta``).
        max_examples: with ``until_decided``, the budget in probe examples: no batch that would take the
            total above it is read (``None``: the whole probe is the budget).
        decision: also decide, per site, between *add depth here*, *train longer first*, *enough depth* and
            *undetermined* (theory/decision.md, ``def-depth-decision``): the stationarity score of the existing
            last linear map writing into the stream at the site and the score beyond training of the family
            (:mod:`depthsat_theory.diagnose.decision`; zero-output feature families only; rows held up to
            :data:`~depthsat_theory.diagnose.decision.DECISION_MAX_BYTES`; one process, not resumed; not with
            ``until_decided``, whose optional stopping the decision's fixed-size tests do not allow for).
    """

    sites: Sequence[str] | None = None
    family: str | ResidualFamily = "linear"
    delta: float | None = None
    realizability: bool = False
    progress: Callable[[int, int | None], None] | None = None
    checkpoint: str | os.PathLike | None = None
    checkpoint_every: int = 1
    layout: str | dict | None = None
    total: int | None = None
    config: dict | None = None
    description: str = ""
    bound_kwargs: dict | None = None
    reduction: str = "none"
    mask_fn: Callable | None = None
    output_key: Any = None
    batchnorm: str = "error"
    loss_units: str = "nats per example"
    batch_dim: int | dict | None = None
    beta: float | Mapping[str, float] | None = None
    second_order: bool = False
    kinks: bool = True
    curvature: bool = False
    gram: str = "auto"
    products: str = "float64"
    until_decided: bool = False
    max_examples: int | None = None
    decision: bool = False

    def check(self) -> None:
        """Refuse options that cannot go together or are out of range, before any work.

        Raises:
            DiagnoseError: naming the option and what to do.
        """
        from depthsat_theory.capture import REDUCTIONS
        from depthsat_theory.statistics.feature import GRAM_MODES, PRODUCT_DTYPES

        for name, value, allowed in (
            ("reduction", self.reduction, REDUCTIONS),
            ("gram", self.gram, GRAM_MODES),
            ("products", self.products, PRODUCT_DTYPES),
        ):
            if value not in allowed:
                raise DiagnoseError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if self.checkpoint_every < 1:
            raise DiagnoseError("checkpoint_every must be >= 1")
        if self.decision and self.until_decided:
            raise DiagnoseError(
                "decision does not go with until_decided: the decision's noise tests are fixed-size and would lose "
                "their level under the anytime stopping (run them separately)"
            )
        if self.max_examples is not None:
            if not self.until_decided:
                raise DiagnoseError("max_examples needs until_decided (it is the budget of a streamed run)")
            if isinstance(self.max_examples, bool) or int(self.max_examples) != self.max_examples:
                raise DiagnoseError(f"max_examples must be a whole number of examples, got {self.max_examples!r}")
            if self.max_examples < 1:
                raise DiagnoseError(f"max_examples must be >= 1 (or None: the whole probe), got {self.max_examples}")
        if self.until_decided:
            self._check_streaming()

    def _check_streaming(self) -> None:
        """What ``until_decided`` cannot combine with (each refused in one line)."""
        if self.delta is not None:
            raise DiagnoseError(
                "until_decided with delta: the (1 - delta) interval is a fixed-size bound whose coverage does not "
                "hold when the anytime test chooses the probe size; run without delta (or without until_decided)"
            )
        if self.second_order or self.curvature:
            raise DiagnoseError(
                "until_decided streams a probe of data-dependent length; second_order and curvature need the "
                "whole probe: run them without until_decided"
            )


def resolve_options(options: DiagnoseOptions | None, overrides: Mapping[str, Any]) -> DiagnoseOptions:
    """``options`` (default :class:`DiagnoseOptions`) with the keyword ``overrides`` replacing its fields.

    Args:
        options: the options object, or ``None``.
        overrides: keywords given to :func:`~depthsat_theory.diagnose.diagnose` besides ``options``.

    Returns:
        The options to run with.

    Raises:
        TypeError: for ``options`` that is not a :class:`DiagnoseOptions` or a keyword that is not one of
            its fields (the message lists them).
    """
    if options is None:
        options = DiagnoseOptions()
    elif not isinstance(options, DiagnoseOptions):
        raise TypeError(f"options must be a DiagnoseOptions, got {type(options).__name__}")
    names = {f.name for f in dataclasses.fields(DiagnoseOptions)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(
            f"diagnose() got unexpected keyword(s) {', '.join(unknown)}; its options are the fields of "
            f"DiagnoseOptions: {', '.join(sorted(names))}"
        )
    return dataclasses.replace(options, **overrides) if overrides else options
