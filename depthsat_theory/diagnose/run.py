r"""Diagnose a whole network: the saturation score at every residual-stream site in one pass.

:func:`diagnose` streams, for every insertion site of a model at once, the float64
tangent statistics of one residual family (theory/definitions.md) over a probe, with **one
forward and one backward pass per probe batch for all sites**
(the probe loop :func:`~depthsat_theory.capture.probe.probe_batches`), and reports per site

- ``s = ‖Π g‖`` (``def-score``; ``s² = tr(G Σ⁺ Gᵀ)`` for zero-output feature
  families, ``thm-cross-gradient``), the scale-free ``s / AG_rms ∈ [0, 1]``;
- the raw quantities ``AG_rms = sqrt(E‖g‖_F²)``, ``AG_max = max_x ‖g(x)‖_F`` and, on
  request (``realizability=True``), ``r̂ = ‖m̂‖`` and ``ρ̂ = ‖m̂ − Π m̂‖/‖m̂‖`` with ties
  pooled exactly (exact on finite/discrete populations, biased upward for continuous
  units: ``r̂ → AG_rms``);
- the numerical tangent rank (``rank K``; ``0``: *degenerate*, never "saturated");
- with ``delta``: the ``(1 − δ)`` interval of :mod:`depthsat_theory.bounds`
  (``thm-finite-sample``), union-bounded over the sites compared (``candidates`` =
  number of sites), with plug-in constants from the probe unless given.

Units: ``g`` is the gradient of the *per-example* loss (nats per example; for token
models the example's mean over its own tokens, theory/definitions.md, def-setting), so every score is in nats
per example per unit function-space step.  Scores are not comparable across sites
(theory label ``def-score``): compare ``s / AG_rms`` or ``s · z_rms``.

Memory per site is ``O(d k̃ + k̃²)`` (``O(p²)`` for general families) whatever the
probe size; only tie pooling grows with the number of distinct units.

Long runs: ``checkpoint=PATH`` saves the statistics' state dicts atomically
(:mod:`depthsat_theory.diagnose.checkpoint`: safetensors, no pickle; its JSON header
holds the configuration and the number of batches consumed)
every ``checkpoint_every`` batches; rerunning with the same path resumes after the
last saved batch and returns the same numbers as an uninterrupted run (the sums are
restored bit for bit and the remaining batches are added in the same order).
Under ``torchrun`` the probe is sharded and the sums all-reduced
(:mod:`depthsat_theory.diagnose.distributed`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import cast

import torch
from torch import Tensor, nn

from depthsat_theory.capture import (
    REDUCTIONS,
    ProbeBatch,
    SiteError,
    SiteRecorder,
    parse_site,
    probe_batches,
    resolve_module,
    unpack_batch,
)
from depthsat_theory.capture.probe import batch_size
from depthsat_theory.diagnose import distributed as _dist
from depthsat_theory.diagnose.beyond import Beyond, check_betas, default_epsilon, measure_curvatures, site_betas
from depthsat_theory.diagnose.checkpoint import (
    CHECKPOINT_VERSION,
    LOSS_KEY,
    ProbeStream,
    check_counts,
    check_version,
    config_diff,
    model_fingerprint,
    read_checkpoint,
    restore_statistics,
    validate_header,
    write_checkpoint,
)
from depthsat_theory.diagnose.discovery import discover_sites, infer_layout
from depthsat_theory.diagnose.errors import CheckpointError, DiagnoseError
from depthsat_theory.diagnose.report import Diagnosis, SiteDiagnosis
from depthsat_theory.families import FamilyError, FeatureFamily, ResidualFamily, parse_family
from depthsat_theory.statistics import Reduction, StatisticsError, StreamingStatistic, statistics_for
from depthsat_theory.statistics.feature import GRAM_MODES, PRODUCT_DTYPES, FeatureStatistics
from depthsat_theory.statistics.linalg import EIGH_BATCH_MAX_ELEMENTS, eigh_batched
from depthsat_theory.vocabulary import Layout

__all__ = ["ProbeLoss", "diagnose"]


def _adapt_length(acc, site: str, z: Tensor, index: int) -> None:
    """Let a row-wise family's accumulator take a sequence site of another length ``T``.

    Probes padded per batch have a different ``T`` in every batch.  The statistics of a
    row-wise family (``unit = "row"``) are sums over rows and do not depend on ``T``, so
    only the accumulator's shape check is moved; anything else is an error.
    """
    new = tuple(int(v) for v in z.shape[1:])
    if acc.layout == Layout.SEQUENCE and acc.family.unit == "row" and len(new) == 2 and new[-1] == acc.shape[-1]:
        acc.shape = new
        return
    raise DiagnoseError(
        f"probe batch {index}: site {site!r} has per-example shape {new}, earlier batches had "
        f"{acc.shape}; only row-wise families at sequence sites accept a length that changes "
        f"between batches (family {acc.family.spec!r}, layout '{acc.layout}'): pad the probe "
        f"to one shape"
    )


def diagnose(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    batches: Iterable[tuple],
    *,
    sites: Sequence[str] | None = None,
    family: str | ResidualFamily = "linear",
    delta: float | None = None,
    realizability: bool = False,
    progress: Callable[[int, int | None], None] | None = None,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 1,
    layout: str | dict | None = None,
    total: int | None = None,
    config: dict | None = None,
    description: str = "",
    bound_kwargs: dict | None = None,
    reduction: str = "none",
    mask_fn: Callable | None = None,
    output_key=None,
    batchnorm: str = "error",
    loss_units: str = "nats per example",
    batch_dim: int | dict | None = None,
    beta: float | Mapping[str, float] | None = None,
    second_order: bool = False,
    kinks: bool = True,
    curvature: bool = False,
    gram: str = "auto",
    products: str = "float64",
) -> Diagnosis:
    """Saturation diagnosis of every site of ``model`` on a probe, in one pass per batch.

    For each batch ``(x, y)`` the model runs forward once with every site hooked
    (:class:`~depthsat_theory.capture.sites.SiteRecorder`), the per-example losses
    ``loss_fn(model(x), y)`` (shape ``(B,)``, nats per example) are summed and
    backpropagated once to all sites, and each site's float64 accumulator
    (:func:`~depthsat_theory.statistics.statistics_for`, or
    :class:`~depthsat_theory.bounds.statistics.BoundStatistics` with ``delta``) adds the batch.
    No parameter gradients are formed.

    Args:
        model: the reference network (put BatchNorm models in eval mode).
        loss_fn: per-example losses ``(B,)``; a batch-mean reduction would rescale
            ``g`` by ``1/B`` (theory/definitions.md, def-setting), so it is rejected by the shape check.
        batches: iterable of ``(inputs, targets)`` (or ``(inputs, targets, mask)``, or Hugging
            Face mappings with ``"labels"``: :func:`~depthsat_theory.capture.probe.unpack_batch`)
            in a fixed order (resuming and sharding address batches by their index).  Inputs
            may be a tensor or a dict of keyword tensors.
        sites: module names; default :func:`discover_sites` (shape check on the
            first batch: one extra no-grad forward, only when the model has no
            ``site_names()``).
        family: a :class:`~depthsat_theory.families.base.ResidualFamily` or a spec string
            (:func:`~depthsat_theory.families.parse_family`), the same at every site.
        delta: ``δ ∈ (0, 1)``: add the ``(1 − δ)`` interval (zero-output feature
            families only), union-bounded over the sites (``candidates = len(sites)``).
        realizability: pool exactly equal units to report ``r̂`` and ``ρ̂``
            (memory grows with the number of distinct units).
        progress: called after each processed batch with ``(batches done on this
            rank, total or None)``.
        checkpoint: path of a checkpoint file (see :func:`read_checkpoint`); resumed
            from when it exists and matches, rewritten atomically every
            ``checkpoint_every`` batches and at the end.  Under ``torchrun`` each rank
            uses ``<path>.rank<r>-of-<N>``.
        checkpoint_every: batches between checkpoint writes.
        layout: a layout for all sites, or ``{site: layout}``; default: the model's
            ``layout`` attribute, else inferred from the site tensor's rank and, for
            ``(B, ·, ·)`` site tensors, from the site module
            (:func:`~depthsat_theory.diagnose.discovery.infer_layout`): ``"sequence"`` reads
            ``(B, T, d)`` as ``T`` rows of dimension ``d``; ``"image"`` reads a channel-first
            ``(B, C, L)`` (``Conv1d``) as the image ``(B, C, 1, L)``: ``L`` units of dimension ``C``.
        total: the number of batches (for ``progress``; default ``len(batches)`` when
            available).
        config: extra JSON-serialisable configuration that must match to resume
            (e.g. the CLI's model name and batch size).
        description: free text stored in the result.
        bound_kwargs: passed to :meth:`~depthsat_theory.bounds.statistics.BoundStatistics.interval`
            (``grad_max``, ``leverage_max``, ``epsilon``, …).
        reduction: how ``loss_fn`` reduces (:data:`~depthsat_theory.capture.probe.REDUCTIONS`):
            ``"none"`` per-example ``(B,)``; ``"sum"``/``"mean"`` a scalar over the batch
            (``mean`` is multiplied by ``B``); ``"token_mean"`` per-token ``(B, T)``
            losses averaged over each example's own non-padded tokens.  ``g`` is always
            the gradient of each example's own loss (as in
            :func:`~depthsat_theory.capture.probe.accumulate`).
        mask_fn: ``mask_fn(inputs, targets) -> (B, T)`` bool padding mask (``True`` at
            real tokens) for batches without one; batches may also be
            ``(inputs, targets, mask)``.  Padded rows are dropped from the statistics of
            sequence sites and must have ``g = 0``.  Default for dict (Hugging Face)
            inputs: their ``attention_mask``.
        output_key: where the site tensor is in a structured output (``None``, an index, a key, or
            ``{site: key}``), as in :class:`~depthsat_theory.capture.sites.SiteRecorder`.
        batchnorm: ``"error"``, ``"warn"`` or ``"ignore"`` when a BatchNorm normalizes with batch
            statistics, as in :class:`~depthsat_theory.capture.sites.SiteRecorder`.
        loss_units: units of the per-example loss, for the outputs (scores are in
            these units per unit function-space step).
        batch_dim: where the batch is in the site tensors: ``None`` (default: the dimension
            whose size is the number of per-example losses; a 3-D site with ``T = B`` is decided by
            its module's ``batch_first`` or by the support of the first example's loss gradient, else
            needs a declaration), ``0`` (batch-first), ``1``
            (sequence-first ``(T, B, d)``, e.g. ``nn.TransformerEncoderLayer(batch_first=False)``)
            or ``{site: dim}`` (:mod:`depthsat_theory.capture.batchdim`).
        beta: the smoothness ``β`` of the loss in the added field (one for every site or
            ``{site: β}``; e.g. :func:`~depthsat_theory.statistics.decrease.cross_entropy_smoothness`
            at a site feeding a linear cross-entropy head): each site then reports the guaranteed
            decrease ``s²/(2β)`` in loss units (``thm-guaranteed-decrease``), and with ``delta``
            the ``ε`` of "certified ε-saturated" defaults to ``sqrt(2 β · 10⁻³)`` (``10⁻³`` nats).
            ``½‖W‖₂²`` is proven at the head's input only (``lem-ce-smoothness``); deeper sites need
            ``prop-beta-composed``.  Every given ``β`` is checked on the probe (a list probe, a
            feature family, per-example losses, a vector site): the step ``−Πg/β`` is run, and
            where it removes less than ``s²/(2β)`` the site's ``beta_status`` is ``"refuted"`` and
            no decrease is reported (``cor-beta-refuted``); elsewhere ``"consistent"`` or ``"unchecked"``.
        second_order: also stream the cross block of the Hessian and report the saddle score
            (``thm-strict-saddle``; random-feature families ``relu:K``/``gelu:K``/``tanh:K``; fresh
            single-process runs only: not checkpointed or sharded).
        kinks: count exact ties at kinks after each site (``thm-gradient``); a positive count makes
            the verdict ``undetermined``.  Summed over the ranks under ``torchrun``; the counts of the
            batches in a checkpoint are stored with it, so a resumed run counts the whole probe.
        curvature: also measure ``κ``, the curvature of the loss along the steepest field ``Πg``
            (one more forward and double backward per batch and site: ``batches`` must be a list
            or tuple; per-example losses, unmasked), and report the local decrease ``s²/(2κ)``
            of the quadratic model (:mod:`depthsat_theory.capture.curvature`; not a guarantee).
        gram: ``"auto"`` (default), ``"features"`` or ``"units"``: whether feature-family sites stream the
            ``k̃ × k̃`` Gram or keep the unit rows (:class:`~depthsat_theory.statistics.FeatureStatistics`,
            theory/numerics.md ``thm-unit-gram``; the same ``ŝ`` within its bound); ignored by general families.
        products: ``"float64"`` (default) or ``"float32"``: the dtype of the per-batch products of
            feature-family sites, summed in float64 either way (``"float32"``: about half the cost, with
            the wider rounding bound and resolution of thm-score-error, so more sites may be
            ``undetermined``); ignored by general families.

    Returns:
        A :class:`Diagnosis` (the same on every rank under ``torchrun``).

    Raises:
        DiagnoseError: no discoverable sites, an empty probe, a NaN/Inf loss, losses of
            the wrong shape, a site the family does not fit, ``delta`` with a
            non-feature family (messages name the probe batch).
        CheckpointError: a checkpoint of another configuration, of another format
            version, or an unreadable one.
        SiteError: an unknown site name, a site that runs other than once, or a nonzero
            activation gradient at padded positions.
    """
    from depthsat_theory.bounds import check_delta

    fam = parse_family(family) if isinstance(family, str) else family
    if delta is not None:
        delta = check_delta(delta)
        if not isinstance(fam, FeatureFamily):
            raise DiagnoseError(
                f"delta needs a zero-output feature family; {fam.spec!r} is a general family (no finite-sample bound)"
            )
    if reduction not in REDUCTIONS:
        raise DiagnoseError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if gram not in GRAM_MODES:
        raise DiagnoseError(f"gram must be one of {', '.join(GRAM_MODES)}, got {gram!r}")
    if products not in PRODUCT_DTYPES:
        raise DiagnoseError(f"products must be one of {', '.join(PRODUCT_DTYPES)}, got {products!r}")
    if checkpoint_every < 1:
        raise DiagnoseError("checkpoint_every must be >= 1")
    if total is None and isinstance(batches, Sized):
        total = len(batches)
    first, probe = _peek(batches)
    site_list = _resolve_sites(model, sites, first)
    betas = site_betas(beta, site_list)
    run = _Run(
        model=model,
        family=fam,
        sites=site_list,
        layouts=_resolve_layouts(model, site_list, layout),
        delta=delta,
        realizability=bool(realizability),
        probe_options=dict(
            reduction=reduction, mask_fn=mask_fn, output_key=output_key, batchnorm=batchnorm, batch_dim=batch_dim
        ),
        beyond=Beyond(model, site_list, fam, kinks=kinks, second_order=second_order),
        betas=betas,
        gram=gram,
        products=products,
    )
    run.open_checkpoint(checkpoint, config)
    if curvature and not (isinstance(batches, (list, tuple)) and isinstance(fam, FeatureFamily)):
        raise DiagnoseError("curvature needs the probe as a list or tuple of batches and a zero-output feature family")
    if curvature and reduction != "none":
        raise DiagnoseError(f"curvature needs per-example losses (reduction 'none'), not reduction {reduction!r}")
    n_batches = run.stream(loss_fn, probe, progress, total, checkpoint_every)
    run.reduce()
    out = run.finish(n_batches, bound_kwargs, description, loss_units)
    if second_order and run.start > 0:
        out.notes.append("saddle scores not reported: the cross blocks are not checkpointed (rerun without resuming)")
    if curvature:
        measure_curvatures(out, model, loss_fn, cast(list, batches), cast(FeatureFamily, fam), run.stats)
    if betas and _dist.world()[1] == 1:
        check_betas(out, model, loss_fn, batches, fam, run.stats, reduction)
    return out


def _peek(batches: Iterable) -> tuple[object, Iterable]:
    """The first batch and an iterable over all batches (the first included)."""
    it = iter(batches)
    try:
        first = next(it)
    except StopIteration:
        raise DiagnoseError("the probe is empty (no batches)") from None
    return first, chain([first], it)


def _resolve_sites(model: nn.Module, sites: Sequence[str] | None, first) -> list[str]:
    if sites is None:
        try:
            example = unpack_batch(first)[0]
        except ValueError as exc:
            raise DiagnoseError(str(exc)) from None
        sites = discover_sites(model, example)
    names = list(sites)
    if not names:
        raise DiagnoseError("no sites to diagnose (an empty site list)")
    if len(set(names)) != len(names):
        raise DiagnoseError(f"duplicate site names in {names}")
    for s in names:  # unknown names fail before any work
        SiteRecorder(model, [s])
    return names


def _resolve_layouts(model: nn.Module, sites: list[str], layout: str | dict | None) -> dict:
    model_layout = getattr(model, "layout", None)
    if not (isinstance(model_layout, str) and model_layout in {m.value for m in Layout}):
        model_layout = None
    if isinstance(layout, dict):
        return {s: None if v is None else Layout(v) for s, v in layout.items()}
    chosen = layout or model_layout
    return dict.fromkeys(sites, None if chosen is None else Layout(chosen))


class ProbeLoss(StreamingStatistic):
    """The probe's loss total and example count (both ``SUM`` states): ``J = total / examples``."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.zeros((), dtype=torch.float64), Reduction.SUM)
        self.add_state("examples", torch.zeros((), dtype=torch.float64), Reduction.SUM)

    def update(self, total: float, examples: int) -> None:
        """Add a batch's summed per-example loss (float64) and its size.

        Args:
            total: the batch's summed per-example loss (loss units).
            examples: the batch's number of examples.
        """
        self.states["total"] += total
        self.states["examples"] += float(examples)

    def result(self) -> float:
        """The mean loss ``J`` (loss units per example); ``nan`` when empty.

        Returns:
            ``J`` as a float.
        """
        n = float(self.states["examples"])
        return float(self.states["total"]) / n if n else float("nan")

    @property
    def examples(self) -> int:
        """Number of examples seen."""
        return round(float(self.states["examples"]))


class _Counted:
    """An iterator over the probe's batches that counts them and fingerprints this rank's.

    With a checkpoint, every batch this rank consumes (``index % world == rank``) enters
    ``stream`` (:class:`~depthsat_theory.diagnose.checkpoint.ProbeStream`); when resuming
    after ``start`` batches, the fingerprint of the batches before ``start`` is compared with
    the stored one (``verify``) as soon as the probe reaches ``start``, before any new batch
    is processed.
    """

    def __init__(self, items: Iterable, stream: ProbeStream | None, mine: Callable[[int], bool], start: int, verify):
        self._it = iter(items)
        self.count = 0
        self.stream = stream
        self._mine = mine
        self._start = start
        self._verify = verify

    def __iter__(self) -> _Counted:
        return self

    def _check(self) -> None:
        if self._verify is not None and self.count >= self._start:
            verify, self._verify = self._verify, None
            verify(self.stream)

    def __next__(self):
        try:
            item = next(self._it)
        except StopIteration:
            self._check()
            raise
        if self.count >= self._start:
            self._check()
        index = self.count
        self.count += 1
        if self.stream is not None and self._mine(index):
            self.stream.add(index, _size_of(item), item)
        return item


def _size_of(batch) -> int:
    """The batch size of a probe batch, ``-1`` when it cannot be read (the probe loop reports that)."""
    try:
        return batch_size(unpack_batch(batch)[0])
    except (ValueError, TypeError, IndexError, KeyError, StopIteration, AttributeError):
        return -1


@dataclass
class _Run:
    """The state of one :func:`diagnose` run: configuration, statistics, checkpoint."""

    model: nn.Module
    family: ResidualFamily
    sites: list[str]
    layouts: dict
    delta: float | None
    realizability: bool
    probe_options: dict
    stats: dict = field(default_factory=dict)
    shapes: dict = field(default_factory=dict)
    loss: ProbeLoss = field(default_factory=ProbeLoss)
    ckpt: Path | None = None
    cfg: dict = field(default_factory=dict)
    start: int = 0
    stored_probe: dict | None = None
    stream_fp: ProbeStream | None = None
    shapes_checked: bool = True
    beyond: Beyond | None = None
    betas: dict = field(default_factory=dict)
    gram: str = "auto"
    products: str = "float64"

    def open_checkpoint(self, checkpoint: str | os.PathLike | None, config: dict | None) -> None:
        """Fix the configuration and resume from ``checkpoint`` when it exists and matches."""
        rank, world = _dist.world()
        self.cfg = {
            "version": CHECKPOINT_VERSION,
            "sites": self.sites,
            "family": self.family.spec,
            "delta": self.delta,
            "realizability": self.realizability,
            "reduction": self.probe_options["reduction"],
            "batch_dim": self.probe_options["batch_dim"],
            "world_size": world,
            "rank": rank,
            "layouts": {s: self.layouts.get(s) for s in self.sites},
            "model": model_fingerprint(self.model) if checkpoint is not None else None,
            "user": config or {},
            "kinks": self._counter() is not None,
        }
        if self.products != "float64":  # the float32 products' state and bound: resume only with the same
            self.cfg["products"] = self.products
        if checkpoint is None:
            return
        ckpt = Path(checkpoint)
        if world > 1:
            ckpt = ckpt.with_name(f"{ckpt.name}.rank{rank}-of-{world}")
        if ckpt.is_dir():
            raise CheckpointError(f"checkpoint {ckpt} is a directory; give a file path")
        if not ckpt.resolve().parent.is_dir():
            raise CheckpointError(f"checkpoint folder {ckpt.resolve().parent} does not exist")
        self.ckpt = ckpt
        self.stream_fp = ProbeStream()
        if ckpt.exists():
            self._resume(ckpt)

    def _resume(self, ckpt: Path) -> None:
        header, tensors = read_checkpoint(ckpt)
        check_version(ckpt, header)
        diff = config_diff(header.get("config", {}), json.loads(json.dumps(self.cfg)))
        if diff:
            raise CheckpointError(
                f"checkpoint {ckpt} was written for another configuration (differs in: "
                f"{', '.join(diff)}); delete it or pass another checkpoint path"
            )
        validate_header(ckpt, header, self.sites)
        self._restore_ties(ckpt, header)
        self.start = header["batches"]
        self.stored_probe = header["probe"]
        if header.get("shapes"):
            try:
                self.make_stats(header["shapes"])
            except DiagnoseError as exc:
                raise CheckpointError(
                    f"checkpoint {ckpt} is damaged or incompatible: header field 'shapes' ({exc}); "
                    f"delete it or pass another checkpoint path to start over"
                ) from None
            restore_statistics({**self.stats, LOSS_KEY: self.loss}, tensors, ckpt)
            check_counts(ckpt, header, self.stats, self.loss.examples)
            self.shapes_checked = False
        elif tensors:
            restore_statistics({LOSS_KEY: self.loss}, tensors, ckpt)

    def _counter(self):
        """The run's kink counter (``None``: kinks not counted)."""
        return None if self.beyond is None else self.beyond.counter

    def _restore_ties(self, ckpt: Path, header: dict) -> None:
        """Start the kink counter from the ties of the restored batches (a verdict input, ``thm-gradient``)."""
        counter, ties = self._counter(), header.get("kink_ties")
        if counter is None:
            return
        if ties is None:  # the configuration says kinks were counted: the field was lost
            raise CheckpointError(
                f"checkpoint {ckpt} is damaged or incompatible: header field 'kink_ties' is missing; "
                f"delete it or pass another checkpoint path to start over"
            )
        counter.ties = {s: int(ties[s]) for s in self.sites}

    def _verify_stream(self, stream: ProbeStream | None) -> None:
        """Refuse to resume on a probe stream other than the one the checkpoint consumed."""
        if self.stored_probe is None or stream is None:
            return
        what = stream.mismatch(self.stored_probe)
        if what is not None:
            raise CheckpointError(
                f"checkpoint {self.ckpt} was written for another probe stream: {what}; resume with "
                f"the same batches in the same order (same batch size, data and shuffling), or "
                f"delete it or pass another checkpoint path to start over"
            )

    def make_stats(self, shape_map: Mapping) -> None:
        """One statistic per site (:class:`BoundStatistics` with ``delta``) for these shapes."""
        from depthsat_theory.bounds import BoundStatistics

        for s in self.sites:
            shp = tuple(shape_map[s])
            lay = self.layouts.get(s) or infer_layout(shp, resolve_module(self.model, parse_site(s)[0]), s)
            if lay == Layout.IMAGE and len(shp) == 2:  # a channel-first 1-D site (C, L), read as (C, 1, L)
                shp = (shp[0], 1, shp[1])
            self.layouts[s] = lay
            try:
                if self.delta is not None:
                    self.stats[s] = BoundStatistics(
                        cast(FeatureFamily, self.family),
                        shp,
                        lay,
                        pool_ties=self.realizability,
                        gram=self.gram,
                        products=self.products,
                    )
                else:
                    self.stats[s] = statistics_for(
                        self.family, shp, lay, pool_ties=self.realizability, gram=self.gram, products=self.products
                    )
            except FamilyError as exc:
                raise DiagnoseError(f"site {s!r} ({lay}, per-example shape {shp}): {exc}") from None
            self.shapes[s] = shp

    def save(self, batches: int, complete: bool) -> None:
        """Write the checkpoint (if any): ``batches`` = the next global batch index."""
        if self.ckpt is None:
            return
        header = {
            "config": self.cfg,
            "batches": batches,
            "examples": self.loss.examples,
            "complete": complete,
            "shapes": {s: list(v) for s, v in self.shapes.items()},
            "probe": (self.stream_fp or ProbeStream()).to_header(),
            "kink_ties": None if (c := self._counter()) is None else {k: int(v) for k, v in c.ties.items()},
        }
        write_checkpoint(self.ckpt, header, {**self.stats, LOSS_KEY: self.loss})

    def _check_restored_shapes(self, pb: ProbeBatch) -> None:
        """After a resume, the site shapes of the first new batch must fit the restored statistics."""
        self.shapes_checked = True
        for s in self.sites:
            new, acc = tuple(int(v) for v in pb.z[s].shape[1:]), self.stats[s]
            row_seq = acc.layout == Layout.SEQUENCE and acc.family.unit == "row" and len(new) == 2
            if new != acc.shape and not (row_seq and new[-1] == acc.shape[-1]):
                raise CheckpointError(
                    f"checkpoint {self.ckpt} is damaged or incompatible: header field 'shapes.{s}' is "
                    f"{list(acc.shape)} but the site has per-example shape {list(new)} on this probe; "
                    f"delete it or pass another checkpoint path to start over"
                )

    def _add(self, pb: ProbeBatch) -> None:
        fresh = not self.stats
        if fresh:
            self.make_stats({s: tuple(pb.z[s].shape[1:]) for s in self.sites})
        for s in self.sites:  # channel-first 1-D sites (B, C, L) are images (B, C, 1, L)
            if self.layouts[s] == Layout.IMAGE and pb.z[s].dim() == 3:
                pb.z[s], pb.g[s] = pb.z[s].unsqueeze(2), pb.g[s].unsqueeze(2)
        if not fresh and not self.shapes_checked:
            self._check_restored_shapes(pb)
        try:
            for s in self.sites:
                if tuple(pb.z[s].shape[1:]) != self.stats[s].shape:
                    _adapt_length(self.stats[s], s, pb.z[s], pb.index)
                    self.shapes[s] = tuple(max(a, b) for a, b in zip(self.shapes[s], self.stats[s].shape, strict=False))
            pb.update(self.stats, self.sites)
        except (StatisticsError, SiteError) as exc:
            raise DiagnoseError(f"probe batch {pb.index}: {exc}") from None
        self.loss.update(pb.loss_total, pb.size)

    def stream(self, loss_fn: Callable, probe: Iterable, progress, total: int | None, every: int) -> int:
        """Run the probe loop over this rank's remaining batches; returns the probe's batch count."""
        rank, world = _dist.world()
        start = self.start
        todo = None if total is None else sum(1 for i in range(start, total) if i % world == rank)
        counted = _Counted(
            probe,
            self.stream_fp,
            lambda i: i % world == rank,
            start,
            self._verify_stream if self.stored_probe is not None else None,
        )
        beyond = self.beyond or Beyond(self.model, self.sites, self.family, kinks=False, second_order=False)
        loop = probe_batches(
            self.model,
            self.sites,
            counted,
            beyond.wrap_loss(loss_fn),
            select=lambda i: i >= start and i % world == rank,
            **self.probe_options,
        )
        done = 0
        try:
            with beyond.context():
                for pb in loop:
                    self._add(pb)
                    beyond.add(pb, self.layouts)
                    done += 1
                    if done % every == 0:
                        self.save(pb.index + 1, False)
                    if progress is not None:
                        progress(done, todo)
        except SiteError:
            raise
        except ValueError as exc:
            if isinstance(exc, DiagnoseError):
                raise
            raise DiagnoseError(str(exc)) from None
        if start > counted.count:
            raise CheckpointError(
                f"checkpoint {self.ckpt} already holds {start} batches but this probe has only "
                f"{counted.count}; pass the same probe (the same batches) or another checkpoint path"
            )
        if self.stats:
            self.save(max(counted.count, start), True)
        return counted.count

    def reduce(self) -> None:
        """All-reduce the statistics over the ranks (a no-op in one process)."""
        if _dist.world()[1] > 1:
            metas = _dist.all_gather_objects({s: list(v) for s, v in self.shapes.items()} if self.stats else None)
            meta = next((m for m in metas if m), None)
            if meta is None:
                raise DiagnoseError("the probe is empty (no examples on any rank)")
            if not self.stats:
                self.make_stats(meta)
            _dist.allreduce_statistics([self.stats[s] for s in self.sites] + [self.loss])
        if not self.stats or self.loss.examples == 0:
            raise DiagnoseError("the probe is empty (no examples)")

    def finish(self, n_batches: int, bound_kwargs: dict | None, description: str, loss_units: str) -> Diagnosis:
        """Per-site results (and intervals) as a :class:`Diagnosis`."""
        bk = dict(bound_kwargs or {})
        bk.setdefault("candidates", len(self.sites))
        out = []
        results = _site_results(self.stats, self.sites)
        for depth, s in enumerate(self.sites):
            res = results[s]
            kw = default_epsilon(bk, self.betas.get(s))
            iv = self.stats[s].interval(self.delta, **kw) if self.delta is not None else None
            out.append(SiteDiagnosis(s, depth, self.layouts[s], self.shapes[s], res, iv))
        if self.beyond is not None:
            self.beyond.reduce()
            self.beyond.finish(out, self.betas, whole_probe=self.start == 0)
        return Diagnosis(
            sites=out,
            family=self.family.spec,
            n=self.loss.examples,
            batches=n_batches,
            loss=self.loss.result(),
            delta=self.delta,
            realizability=self.realizability,
            world_size=_dist.world()[1],
            resumed_from=self.start,
            description=description,
            notes=_notes(loss_units, self.realizability, self.delta, bk["candidates"]) + self._products_note(),
            loss_units=loss_units,
            products=self.products,
        )

    def _products_note(self) -> list[str]:
        """The float32 products' error model, stated with the table (nothing for float64 products)."""
        if self.products == "float64":
            return []
        feats = [acc for acc in self.stats.values() if isinstance(acc, FeatureStatistics)]
        l32 = max((acc._product_summands() for acc in feats), default=0)
        return [
            f"{self.products} batch products (opt-in): '± rounding' includes their float32 sums of length "
            f"L_32 = {l32}; Gram eigenvalues below 2η are dropped and count as unresolved, so verdicts move "
            f"only toward 'undetermined' (theory/numerics.md, thm-score-error)"
        ]


def _site_results(stats: Mapping, sites: list[str]) -> dict:
    """Every site's ``result()``, the Gram eigensolves of feature-family sites batched across sites.

    Sites with the same Gram size and device are decomposed together by :func:`eigh_batched`, in groups
    of at most :data:`~depthsat_theory.statistics.linalg.EIGH_BATCH_MAX_ELEMENTS` entries, each group's
    results computed before the next group's Grams are formed (memory: one group, not every site).
    """
    groups: dict[tuple, list[str]] = {}
    for s in sites:
        acc = stats[s]
        if isinstance(acc, FeatureStatistics):
            groups.setdefault((acc.k, str(acc.states["sigma"].device)), []).append(s)
    out: dict = {}
    for (k, dev), names in groups.items():
        per_call = max(1, EIGH_BATCH_MAX_ELEMENTS // (k * k))
        for i in range(0, len(names), per_call):
            inputs = {s: stats[s].eigh_input() for s in names[i : i + per_call]}
            ready = [s for s, m in inputs.items() if m is not None]
            eigs = dict(zip(ready, eigh_batched([inputs[s] for s in ready], device=dev), strict=True))
            del inputs
            for s in names[i : i + per_call]:
                out[s] = stats[s].result(eig=eigs.pop(s)) if s in eigs else stats[s].result()
    for s in sites:
        if s not in out:
            out[s] = stats[s].result()
    return {s: out[s] for s in sites}


def _notes(loss_units: str, realizability: bool, delta: float | None, candidates: int) -> list[str]:
    notes = [f"scores in {loss_units} per unit function-space step; not comparable across sites (compare s_U/AG_rms)"]
    if realizability:
        notes.append(
            "r̂ and ρ̂ pool exactly equal units only: exact on finite/discrete populations, "
            "biased upward for continuous units (r̂ → AG_rms)"
        )
    if delta is not None:
        notes.append(
            f"intervals union-bounded over {candidates} sites; constants not given are "
            f"probe plug-ins (lower bounds of the essential suprema), so the coverage is not "
            f"guaranteed unless they were supplied"
        )
    return notes
