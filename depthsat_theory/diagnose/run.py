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

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from depthsat_theory.capture import (
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
    restore_anytime,
    restore_statistics,
    validate_header,
    write_checkpoint,
)
from depthsat_theory.diagnose.discovery import discover_sites, infer_layout
from depthsat_theory.diagnose.errors import CheckpointError, DiagnoseError
from depthsat_theory.diagnose.options import DiagnoseOptions, resolve_options
from depthsat_theory.diagnose.report import Diagnosis, SiteDiagnosis
from depthsat_theory.diagnose.stream import ANYTIME_PREFIX, AnytimeStreams
from depthsat_theory.families import FamilyError, FeatureFamily, ResidualFamily, parse_family
from depthsat_theory.statistics import Reduction, StatisticsError, StreamingStatistic, statistics_for
from depthsat_theory.statistics.feature import FeatureStatistics
from depthsat_theory.statistics.linalg import EIGH_BATCH_MAX_ELEMENTS, eigh_batched
from depthsat_theory.vocabulary import Layout

if TYPE_CHECKING:
    from depthsat_theory.diagnose.decision import SiteDecisions

__all__ = ["DiagnoseOptions", "ProbeLoss", "diagnose"]


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
    options: DiagnoseOptions | None = None,
    **overrides: Any,
) -> Diagnosis:
    """Saturation diagnosis of every site of ``model`` on a probe, in one pass per batch.

    For each batch ``(x, y)`` the model runs forward once with every site hooked
    (:class:`~depthsat_theory.capture.sites.SiteRecorder`), the per-example losses
    ``loss_fn(model(x), y)`` (shape ``(B,)``, nats per example) are summed and
    backpropagated once to all sites, and each site's float64 accumulator
    (:func:`~depthsat_theory.statistics.statistics_for`, or
    :class:`~depthsat_theory.bounds.statistics.BoundStatistics` with ``delta``) adds the batch.
    No parameter gradients are formed.

    The options (sites, family, ``delta``, checkpoint, layout, reduction, ``until_decided``, …) are the
    fields of :class:`~depthsat_theory.diagnose.options.DiagnoseOptions`, documented there; give them as
    ``options=DiagnoseOptions(...)``, as keywords, or both (keywords override the object's fields).

    With ``until_decided=True`` the probe is read batch by batch until every site is decided by the
    anytime-valid noise test (theory/decision.md, ``thm-anytime-noise-test``) or ``max_examples`` is
    reached; see :mod:`depthsat_theory.diagnose.stream`.

    Args:
        model: the reference network (put BatchNorm models in eval mode).
        loss_fn: per-example losses ``(B,)`` (or as ``reduction`` says); a batch-mean reduction would rescale
            ``g`` by ``1/B`` (theory/definitions.md, def-setting), so it is rejected by the shape check.
        batches: iterable of ``(inputs, targets)`` (or ``(inputs, targets, mask)``, or Hugging
            Face mappings with ``"labels"``: :func:`~depthsat_theory.capture.probe.unpack_batch`)
            in a fixed order (resuming and sharding address batches by their index).  Inputs
            may be a tensor or a dict of keyword tensors.
        options: a :class:`~depthsat_theory.diagnose.options.DiagnoseOptions` (default: all defaults).
        **overrides: any field of :class:`~depthsat_theory.diagnose.options.DiagnoseOptions`, replacing the
            one in ``options``.

    Returns:
        A :class:`Diagnosis` (the same on every rank under ``torchrun``).

    Raises:
        TypeError: a keyword that is not a field of ``DiagnoseOptions``.
        DiagnoseError: no discoverable sites, an empty probe, a NaN/Inf loss, losses of
            the wrong shape, a site the family does not fit, ``delta`` with a
            non-feature family, options that do not go together (messages name the probe batch or option).
        CheckpointError: a checkpoint of another configuration, of another format
            version, or an unreadable one.
        SiteError: an unknown site name, a site that runs other than once, or a nonzero
            activation gradient at padded positions.
    """
    from depthsat_theory.bounds import check_delta

    o = resolve_options(options, overrides)
    o.check()
    fam = parse_family(o.family) if isinstance(o.family, str) else o.family
    delta = o.delta
    if delta is not None:
        delta = check_delta(delta)
        if not isinstance(fam, FeatureFamily):
            raise DiagnoseError(
                f"delta needs a zero-output feature family; {fam.spec!r} is a general family (no finite-sample bound)"
            )
    total = o.total
    if total is None and isinstance(batches, Sized):
        total = len(batches)
    first, probe = _peek(batches)
    site_list = _resolve_sites(model, o.sites, first)
    betas = site_betas(o.beta, site_list)
    run = _Run(
        model=model,
        family=fam,
        sites=site_list,
        layouts=_resolve_layouts(model, site_list, o.layout),
        delta=delta,
        realizability=bool(o.realizability),
        probe_options=dict(
            reduction=o.reduction,
            mask_fn=o.mask_fn,
            output_key=o.output_key,
            batchnorm=o.batchnorm,
            batch_dim=o.batch_dim,
        ),
        beyond=Beyond(model, site_list, fam, kinks=o.kinks, second_order=o.second_order),
        betas=betas,
        gram=o.gram,
        products=o.products,
        anytime=_anytime_streams(o, fam, site_list),
    )
    run.decision = _decisions(model, site_list, first, fam, o.output_key, o.mask_fn, wanted=o.decision)
    run.open_checkpoint(o.checkpoint, o.config)
    if o.curvature and not (isinstance(batches, (list, tuple)) and isinstance(fam, FeatureFamily)):
        raise DiagnoseError("curvature needs the probe as a list or tuple of batches and a zero-output feature family")
    if o.curvature and o.reduction != "none":
        raise DiagnoseError(f"curvature needs per-example losses (reduction 'none'), not reduction {o.reduction!r}")
    n_batches = run.stream(loss_fn, probe, o.progress, total, o.checkpoint_every)
    run.reduce()
    out = run.finish(n_batches, o.bound_kwargs, o.description, o.loss_units)
    if o.second_order and run.start > 0:
        out.notes.append("saddle scores not reported: the cross blocks are not checkpointed (rerun without resuming)")
    if o.curvature:
        measure_curvatures(out, model, loss_fn, cast(list, batches), cast(FeatureFamily, fam), run.stats)
    if betas and _dist.world()[1] == 1:
        check_betas(out, model, loss_fn, batches, fam, run.stats, o.reduction)
    return out


def _anytime_streams(o: DiagnoseOptions, fam: ResidualFamily, sites: list[str]) -> AnytimeStreams | None:
    """The anytime tests of ``until_decided`` (``None`` without it); refuses what they cannot run on."""
    if not o.until_decided:
        return None
    if not isinstance(fam, FeatureFamily):
        raise DiagnoseError(
            f"until_decided needs a zero-output feature family (the anytime test uses its features); "
            f"{fam.spec!r} is a general family"
        )
    if _dist.world()[1] > 1:
        raise DiagnoseError(
            "until_decided runs in one process: the anytime test needs the probe as one ordered stream "
            "(run without torchrun, or without until_decided)"
        )
    return AnytimeStreams(fam, sites, o.max_examples)


def _decisions(model: nn.Module, sites: list[str], first, fam: ResidualFamily, output_key, mask_fn, *, wanted: bool):
    """The :class:`~depthsat_theory.diagnose.decision.SiteDecisions` of a ``decision=True`` run (else ``None``)."""
    from depthsat_theory.diagnose.decision import SiteDecisions, find_last_maps

    if not wanted:
        return None
    if not isinstance(fam, FeatureFamily):
        raise DiagnoseError(f"decision needs a zero-output feature family; {fam.spec!r} is a general family")
    try:
        maps, reasons = find_last_maps(model, sites, first, output_key=output_key, mask_fn=mask_fn)
    except (ValueError, RuntimeError) as exc:  # e.g. an in-place operation on a tapped output: decide nothing
        line = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        maps, reasons = {}, dict.fromkeys(sites, f"locating the last maps on probe batch 0 failed: {line}")
    return SiteDecisions(model, maps, reasons, fam)


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

    ``stop(next_size)`` (streaming until decided) is asked before each batch at or after ``start``, with
    ``None`` before fetching it and with its size after: ``True`` ends the probe there (the fetched batch is
    not counted).
    """

    def __init__(
        self,
        items: Iterable,
        stream: ProbeStream | None,
        mine: Callable[[int], bool],
        start: int,
        verify,
        stop: Callable[[int | None], bool] | None = None,
    ):
        self._it = iter(items)
        self.count = 0
        self.stream = stream
        self._mine = mine
        self._start = start
        self._verify = verify
        self._stop = stop

    def __iter__(self) -> _Counted:
        return self

    def _check(self) -> None:
        if self._verify is not None and self.count >= self._start:
            verify, self._verify = self._verify, None
            verify(self.stream)

    def _end(self, size: int | None) -> bool:
        """Whether the stop rule ends the probe before this batch (verifying the resumed stream first)."""
        if self._stop is None or self.count < self._start or not self._stop(size):
            return False
        self._check()
        return True

    def __next__(self):
        if self._end(None):
            raise StopIteration
        try:
            item = next(self._it)
        except StopIteration:
            self._check()
            raise
        if self._end(_size_of(item)):
            raise StopIteration
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
    anytime: AnytimeStreams | None = None
    decision: SiteDecisions | None = None

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
        if self.anytime is not None:  # a streamed run's tests and stopping rule: resume only with the same
            self.cfg["until_decided"] = {
                "max_examples": self.anytime.max_examples,
                "alpha": self.anytime.alpha,
                "prior_examples": self.anytime.prior_examples,
            }
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
            restore_statistics({**self.stats, LOSS_KEY: self.loss}, _without_anytime(tensors), ckpt)
            check_counts(ckpt, header, self.stats, self.loss.examples)
            self.shapes_checked = False
            if self.anytime is not None:
                self._make_anytime()
                restore_anytime(ckpt, header, _anytime_tensors(tensors), self.anytime)
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
        states: dict = {**self.stats, LOSS_KEY: self.loss}
        if self.anytime is not None and self.anytime.tests:
            header["anytime"] = dict(self.anytime.decided_batch)
            states.update({f"{ANYTIME_PREFIX}{s}": t for s, t in self.anytime.tests.items()})
        write_checkpoint(self.ckpt, header, states)

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
            if self.anytime is not None:
                if not self.anytime.tests:
                    self._make_anytime()
                self.anytime.update(pb.index, pb.z, pb.g, pb.mask)
        except (StatisticsError, SiteError) as exc:
            raise DiagnoseError(f"probe batch {pb.index}: {exc}") from None
        self.loss.update(pb.loss_total, pb.size)

    def _make_anytime(self) -> None:
        """The anytime tests, for the shapes and layouts of the site statistics."""
        cast(AnytimeStreams, self.anytime).make({s: self.stats[s].shape for s in self.sites}, self.layouts)

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
            None if self.anytime is None else self._stop,
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
        try:
            self._consume(loop, beyond, progress, todo, every)
        except SiteError:
            raise
        except ValueError as exc:
            if isinstance(exc, DiagnoseError):
                raise
            raise DiagnoseError(str(exc)) from None
        self._check_consumed(start, counted)
        if self.stats:
            self.save(max(counted.count, start), True)
        return counted.count

    def _consume(self, loop: Iterable, beyond: Beyond, progress, todo: int | None, every: int) -> None:
        """Add every probe batch of ``loop`` to the statistics (and the decision's rows), saving every ``every``."""
        done = 0
        decision = self.decision.context() if self.decision is not None else contextlib.nullcontext()
        with beyond.context(), decision:
            for pb in loop:
                self._add(pb)
                beyond.add(pb, self.layouts)
                if self.decision is not None:
                    self.decision.add(pb, self.layouts)
                done += 1
                if done % every == 0:
                    self.save(pb.index + 1, False)
                if progress is not None:
                    progress(done, todo)

    def _check_consumed(self, start: int, counted: _Counted) -> None:
        """Refuse a probe shorter than the checkpoint, and a budget below the first batch."""
        if start > counted.count:
            raise CheckpointError(
                f"checkpoint {self.ckpt} already holds {start} batches but this probe has only "
                f"{counted.count}; pass the same probe (the same batches) or another checkpoint path"
            )
        if self.anytime is not None and not self.stats and self.anytime.stopped == "budget":
            raise DiagnoseError(
                f"max_examples = {self.anytime.max_examples} is smaller than the first probe batch: give at "
                f"least one batch's examples"
            )

    def _stop(self, next_size: int | None) -> bool:
        """The streamed run's stopping rule (:meth:`AnytimeStreams.stop`) at the examples read so far."""
        return cast(AnytimeStreams, self.anytime).stop(self.loss.examples, next_size)

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
        notes = _notes(loss_units, self.realizability, self.delta, bk["candidates"]) + self._products_note()
        if self.anytime is not None:
            streams = self.anytime.outcomes(self.loss.examples)
            for sd in out:
                sd.stream = streams[sd.site]
            notes.append(self.anytime.note(self.loss.examples))
        if self.decision is not None:
            self.decision.finish(out, whole_probe=self.start == 0, world=_dist.world()[1])
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
            notes=notes,
            loss_units=loss_units,
            products=self.products,
            until_decided=self.anytime is not None,
            max_examples=None if self.anytime is None else self.anytime.max_examples,
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


def _anytime_tensors(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The checkpoint tensors of the anytime tests (:data:`~depthsat_theory.diagnose.stream.ANYTIME_PREFIX`)."""
    return {k: v for k, v in tensors.items() if k.startswith(ANYTIME_PREFIX)}


def _without_anytime(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The checkpoint tensors of the site statistics and the loss (everything but the anytime tests)."""
    return {k: v for k, v in tensors.items() if not k.startswith(ANYTIME_PREFIX)}


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
