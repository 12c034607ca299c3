"""The probe loop: unpack a batch, forward, reduce the losses, backward through the taps, mask, update.

:func:`probe_batches` is the one per-batch loop of the package: :func:`accumulate` (used by
the checker and the audit) and :func:`depthsat_theory.diagnose.diagnose` both run it.  Per
batch it

1. unpacks ``(inputs, targets)`` or ``(inputs, targets, mask)`` (:func:`unpack_batch`; a
   ``mask_fn`` or a Hugging Face ``attention_mask`` gives the padding mask),
2. runs the model forward once with every site tapped
   (:class:`~depthsat_theory.capture.sites.SiteRecorder`),
3. reduces the losses so that ``g`` is the gradient of each example's own loss
   (:func:`reduce_losses`, theory/definitions.md, def-setting),
4. backpropagates once to all sites (no parameter gradients),
5. checks that ``g = 0`` at padded positions of sequence sites,

and yields a :class:`ProbeBatch`, whose :meth:`ProbeBatch.update` feeds the statistics
(padded rows dropped, :func:`update_statistics`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from depthsat_theory.capture.batchdim import BatchDims, batch_first
from depthsat_theory.capture.sites import SiteError, SiteRecorder, dropout_guard
from depthsat_theory.statistics import StatisticsError

__all__ = [
    "REDUCTIONS",
    "ProbeBatch",
    "accumulate",
    "batch_size",
    "call_model",
    "probe_batches",
    "reduce_losses",
    "unpack_batch",
    "update_statistics",
]

#: Loss reductions accepted by :func:`accumulate` and :func:`probe_batches`.
REDUCTIONS = ("none", "sum", "mean", "token_mean")


def batch_size(x) -> int:
    """The batch size ``B`` of model inputs: a tensor, a mapping of tensors or a sequence of them.

    Args:
        x: a tensor, a mapping whose first value is an input, or a sequence whose first item is one.

    Returns:
        ``B``: the size of dimension 0 of the first tensor found.

    Raises:
        TypeError, IndexError: for inputs holding no tensor first.
    """
    if isinstance(x, Tensor):
        return int(x.shape[0])
    if isinstance(x, Mapping):
        return batch_size(next(iter(x.values())))
    return batch_size(x[0])


def call_model(model: nn.Module, x):
    """``model(**x)`` for keyword inputs (a mapping, e.g. Hugging Face), else ``model(x)``.

    Args:
        model: the model.
        x: its inputs: a mapping (passed as keyword arguments) or anything else (passed as is).

    Returns:
        The model's output.
    """
    return model(**x) if isinstance(x, Mapping) else model(x)


def unpack_batch(batch, mask_fn: Callable | None = None) -> tuple:
    """``(inputs, targets, mask)`` of a probe batch: the one batch-unpacking path of the package.

    Args:
        batch: ``(inputs, targets)``, ``(inputs, targets, mask)``, or a Hugging Face
            keyword batch: a mapping with a ``"labels"`` entry (``{"input_ids": …,
            "attention_mask": …, "labels": …}``), read as ``(the mapping without "labels",
            labels)``: the model gets the other entries as keywords and ``loss_fn`` the labels.
        mask_fn: ``mask_fn(inputs, targets) -> (B, T)`` bool padding mask for batches
            without one.  Without either, mapping inputs (Hugging Face) use their
            ``attention_mask`` (padding is excluded, theory/definitions.md, def-setting).

    Returns:
        ``(inputs, targets, mask)`` with ``mask`` a ``(B, T)`` bool tensor (``True`` at
        real tokens) or ``None``.

    Raises:
        ValueError: a batch of another form (a mapping without ``"labels"`` included), or a
            mask that is not 2-D.
    """
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise ValueError(
                f"a mapping probe batch must hold the targets under 'labels' (Hugging Face style), got keys "
                f"{', '.join(map(str, batch.keys())) or '(none)'}; or pass (inputs, targets) batches"
            )
        batch = ({k: v for k, v in batch.items() if k != "labels"}, batch["labels"])
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        raise ValueError(
            f"a probe batch must be (inputs, targets), (inputs, targets, mask) or a mapping with "
            f"'labels', got {type(batch).__name__}" + (f" of length {len(batch)}" if hasattr(batch, "__len__") else "")
        )
    x, y = batch[0], batch[1]
    mask = batch[2] if len(batch) == 3 else (mask_fn(x, y) if mask_fn is not None else None)
    if mask is None and isinstance(x, Mapping) and isinstance(x.get("attention_mask"), Tensor):
        mask = x["attention_mask"]
    if mask is not None:
        mask = torch.as_tensor(mask).bool()
        if mask.dim() != 2:
            raise ValueError(f"the padding mask must be (B, T) bool, got shape {tuple(mask.shape)}")
    return x, y, mask


def reduce_losses(raw: Tensor, reduction: str, batch: int, mask: Tensor | None):
    """The scalar to backpropagate so that site gradients are per-example gradients.

    Args:
        raw: what ``loss_fn`` returned: per-example losses ``(B,)`` (``"none"``), a scalar
            batch sum (``"sum"``) or batch mean (``"mean"``), or per-token losses ``(B, T)``
            (``"token_mean"``: each example's loss is the mean over its own real tokens).
        reduction: one of :data:`REDUCTIONS` (theory/definitions.md, def-setting: reductions matter).
        batch: the batch size ``B``.
        mask: optional padding mask ``(B, T)`` bool, ``True`` at real tokens.

    Returns:
        ``(backward_scalar, total_loss)``: the tensor whose gradient is the sum of the
        per-example gradients, and the batch's summed per-example loss (float, nats;
        summed in float64).

    Raises:
        ValueError: wrong shape for the reduction, an unknown reduction, NaN/Inf losses.
    """
    if not isinstance(raw, Tensor):
        raise ValueError(f"loss_fn must return a tensor, got {type(raw).__name__}")
    if not torch.isfinite(raw.detach()).all() and reduction != "token_mean":
        bad = int((~torch.isfinite(raw.detach())).sum())
        raise ValueError(
            f"the loss is NaN or Inf ({bad} value(s)) on the probe; cannot take gradients "
            f"(check the inputs and the model's dtype)"
        )
    if reduction == "none":
        if raw.dim() != 1 or raw.shape[0] != batch:
            raise ValueError(
                f"loss_fn must return per-example losses of shape (B,) = ({batch},), got "
                f"{tuple(raw.shape)} (pass reduction='mean'/'sum' for a batch-reduced scalar)"
            )
        return raw.sum(), float(raw.detach().to(torch.float64).sum())
    if reduction in ("sum", "mean"):
        if raw.dim() != 0:
            raise ValueError(f"reduction={reduction!r}: loss_fn must return a scalar, got shape {tuple(raw.shape)}")
        scale = batch if reduction == "mean" else 1
        return raw * scale, float(raw.detach()) * scale
    if reduction == "token_mean":
        if raw.dim() == 0:
            raise ValueError(
                "reduction='token_mean' needs per-token losses (B, T): a scalar mean over all "
                "non-padded tokens of the batch (the Hugging Face reduction) weights each example "
                "by its number of tokens and is not E_D ℓ with ℓ the example's own token mean "
                "(theory/definitions.md, def-setting), and the per-example losses cannot be recovered from it; return "
                "reduction='none' token losses from loss_fn"
            )
        if raw.dim() != 2 or raw.shape[0] != batch:
            raise ValueError(
                f"reduction='token_mean': loss_fn must return per-token losses (B, T) "
                f"with B = {batch}, got {tuple(raw.shape)}"
            )
        m = torch.ones_like(raw, dtype=torch.bool) if mask is None else mask.to(raw.device).bool()
        if m.shape != raw.shape:
            raise ValueError(
                f"the padding mask {tuple(m.shape)} does not match the per-token losses {tuple(raw.shape)}"
            )
        ntok = m.sum(dim=1)
        if bool((ntok == 0).any()):
            raise ValueError("an example has no non-padded token: its token-mean loss is undefined")
        kept = torch.where(m, raw, torch.zeros((), dtype=raw.dtype, device=raw.device))
        if not torch.isfinite(kept.detach()).all():
            raise ValueError("the loss is NaN or Inf on the probe; cannot take gradients")
        per_example = kept.sum(dim=1) / ntok.to(raw.dtype)
        return per_example.sum(), float(per_example.detach().sum())
    raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")


def update_statistics(acc, z: Tensor, g: Tensor, mask: Tensor | None, key: str) -> None:
    """``acc.update(z, g)``, passing the padding mask at sequence sites (padded rows dropped).

    Args:
        acc: a statistics accumulator (``update(z, g[, mask])``).
        z: the site's ``(B, *shape)`` activations.
        g: the per-example activation gradients at the site, same shape as ``z``.
        mask: optional ``(B, T)`` bool padding mask (ignored at vector sites).
        key: the site name, for error messages.

    Raises:
        SiteError: a mask that does not fit the site, or an accumulator that cannot drop
            padded rows (no ``mask=`` keyword, or a sequence-level family).
    """
    if mask is None or z.dim() == 2:  # no mask, or a per-example vector site (no positions)
        acc.update(z, g)
        return
    if z.dim() != 3 or tuple(mask.shape) != tuple(z.shape[:2]):
        raise SiteError(
            f"site {key!r} has tensors of shape {tuple(z.shape)}; a padding mask "
            f"{tuple(mask.shape)} applies to sequence sites (B, T, d) only"
        )
    mask = mask.to(z.device).bool()
    if "mask" not in inspect.signature(acc.update).parameters:
        if bool(mask.all()):
            acc.update(z, g)
            return
        raise SiteError(
            f"the accumulator {type(acc).__name__} at site {key!r} cannot drop padded "
            f"rows: its update() takes no mask= keyword"
        )
    try:
        acc.update(z, g, mask=mask)
    except StatisticsError as exc:
        raise SiteError(f"site {key!r}: {exc}") from None


@dataclass
class ProbeBatch:
    """One probe batch after the forward and backward pass of :func:`probe_batches`.

    Attributes:
        index: the batch's position in the probe (0-based, counting skipped batches).
        size: the batch size ``B``.
        loss_total: the batch's summed per-example loss (float64, loss units).
        mask: ``(B, T)`` bool padding mask (``True`` at real tokens) or ``None``.
        z: site → activations ``(B, *shape)`` (detached, the model's dtype and device).
        g: site → activation gradients of the per-example losses, same shapes.
        names: the recorded site keys, in recording order.
    """

    index: int
    size: int
    loss_total: float
    mask: Tensor | None
    z: dict[str, Tensor] = field(default_factory=dict)
    g: dict[str, Tensor] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)

    def update(self, stats: Mapping, keys: Sequence[str] | None = None) -> None:
        """Feed each site's ``(z, g)`` to its statistics, dropping padded rows.

        Args:
            stats: ``{site: statistic}`` or ``{site: [statistics]}`` (objects with
                ``update(z, g[, mask])``).
            keys: the sites to update (default: every recorded site).

        Raises:
            SiteError: a recorded site without statistics, or padded rows a statistic
                cannot drop (:func:`update_statistics`).
            StatisticsError: from the statistics on bad values.
        """
        for key in self.names if keys is None else keys:
            if key not in stats:
                raise SiteError(f"no statistics for site {key!r} (recorded sites: {', '.join(self.names)})")
            accs = stats[key] if isinstance(stats[key], (list, tuple)) else [stats[key]]
            for acc in accs:
                update_statistics(acc, self.z[key], self.g[key], self.mask, key)


def _first_input(x) -> Tensor | None:
    """The first tensor of model inputs (a tensor, a mapping or a sequence of them), or ``None``."""
    if isinstance(x, Tensor):
        return x
    items = x.values() if isinstance(x, Mapping) else x if isinstance(x, (tuple, list)) else ()
    return next((_first_input(v) for v in items if _first_input(v) is not None), None)


def _loss_batch(raw, reduction: str, x) -> int:
    """The batch size ``B``: that of the inputs, or the losses' length for sequence-first inputs ``(T, B, …)``.

    Per-example (``"none"``) or per-token (``"token_mean"``) losses of length ``B`` with inputs whose
    first tensor is ``(T, B, …)``, ``T ≠ B``, are a probe of ``B`` examples; any other length is left
    to :func:`reduce_losses` to reject.
    """
    bsz = batch_size(x)
    if reduction in ("none", "token_mean") and isinstance(raw, Tensor) and raw.dim() >= 1:
        first = _first_input(x)
        n = int(raw.shape[0])
        if n != bsz and first is not None and first.dim() >= 2 and int(first.shape[1]) == n:
            return n
    return bsz


def _first_example_loss(raw: Tensor, reduction: str, mask: Tensor | None) -> Tensor | None:
    """The first example's own loss (a scalar of the forward pass), or ``None`` for batch-reduced losses."""
    if reduction == "none":
        return raw[0]
    if reduction == "token_mean":
        row = raw[0] if mask is None else torch.where(mask[0].to(raw.device), raw[0], torch.zeros_like(raw[0]))
        return row.sum()
    return None


def _measure_batch_dims(rec: SiteRecorder, dims: BatchDims, raw, reduction: str, mask, bsz: int) -> None:
    """Measure the batch dimension of the sites whose shape and module leave it open (``T = B``)."""
    open_keys = [key for key in rec.names if dims.undecided(key, tuple(rec.z[key].shape), bsz)]
    if not open_keys:
        return
    loss0 = _first_example_loss(raw, reduction, mask)
    grads = {} if loss0 is None else rec.gradients_of(loss0, open_keys)
    for key in open_keys:
        dims.measure(key, grads.get(key), bsz)


def _check_padding(pb: ProbeBatch) -> None:
    mask = pb.mask
    if mask is None:
        return
    for key in pb.names:
        z, g = pb.z[key], pb.g[key]
        if z.dim() == 3 and tuple(mask.shape) == tuple(z.shape[:2]) and bool((g[~mask.to(g.device)] != 0).any()):
            raise SiteError(
                f"the activation gradient at site {key!r} is nonzero at padded "
                f"positions: the model or the loss reads padding (pass the attention "
                f"mask to the model and ignore padded tokens in the loss)"
            )


def probe_batches(
    model: nn.Module,
    sites: Sequence[str],
    batches: Iterable,
    loss_fn: Callable,
    *,
    reduction: str = "none",
    mask_fn: Callable | None = None,
    calls: str = "error",
    output_key=None,
    batchnorm: str = "error",
    select: Callable[[int], bool] | None = None,
    batch_dim: int | Mapping[str, int] | None = None,
) -> Iterator[ProbeBatch]:
    """The probe loop: one forward and one backward pass per batch for all sites.

    For each batch (with ``select(index)`` true): unpack (:func:`unpack_batch`), run
    ``loss_fn(call_model(model, inputs), targets)`` with every site tapped, reduce the
    losses (:func:`reduce_losses`) so that ``g`` is the gradient of each example's own
    loss, backpropagate to the sites, check ``g = 0`` at padded positions, and yield a
    :class:`ProbeBatch` (call :meth:`ProbeBatch.update` to feed statistics).

    Args:
        model: the reference network (eval mode for BatchNorm).
        sites: site names (``"name"`` or ``"name#k"``, see
            :class:`~depthsat_theory.capture.sites.SiteRecorder`).
        batches: iterable of ``(inputs, targets)``, ``(inputs, targets, mask)`` or Hugging Face
            mappings with ``"labels"`` (:func:`unpack_batch`).
        loss_fn: ``loss_fn(outputs, targets)``, reduced as ``reduction`` says.
        reduction: one of :data:`REDUCTIONS` (see :func:`accumulate`).
        mask_fn: optional ``mask_fn(inputs, targets) -> (B, T)`` bool padding mask.
        calls: ``"error"`` or ``"each"``: how bare site names treat a module that runs several
            times per forward, as in :class:`~depthsat_theory.capture.sites.SiteRecorder`.
        output_key: where the site tensor is in a structured output, as in
            :class:`~depthsat_theory.capture.sites.SiteRecorder`.
        batchnorm: ``"error"``, ``"warn"`` or ``"ignore"`` when a BatchNorm normalizes with batch
            statistics, as in :class:`~depthsat_theory.capture.sites.SiteRecorder`.
        select: optional ``select(index) -> bool``; batches it rejects are skipped
            without a forward pass (resuming, sharding).
        batch_dim: where the batch is in the site tensors: ``None`` (default: the dimension
            whose size is the number of per-example losses; when ``T = B``, the module's
            ``batch_first`` or one extra backward of the first example's loss on the first batch:
            :mod:`~depthsat_theory.capture.batchdim`),
            ``0`` (batch-first), ``1`` (sequence-first ``(T, B, d)``) or ``{site: dim}``.
            Sequence-first site tensors are yielded batch-first.

    Yields:
        One :class:`ProbeBatch` per selected batch, in probe order.

    Raises:
        ValueError: an unknown ``reduction``; a malformed batch or mask, or a loss that is
            NaN/Inf or of the wrong shape (message prefixed with ``probe batch i:``).
        SiteError: unknown sites, a site that did not run as required, train-mode
            BatchNorm or dropout, a site without a batch dimension of the losses' length (or
            an ambiguous one, ``T = B``, undeclared), or a nonzero gradient at padded positions.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    dims = BatchDims(model, batch_dim)
    with SiteRecorder(model, sites, calls=calls, output_key=output_key, batchnorm=batchnorm) as rec:
        checked = False
        for index, batch in enumerate(batches):
            if select is not None and not select(index):
                continue
            try:
                x, y, mask = unpack_batch(batch, mask_fn)
                rec.reset()
                if checked:
                    raw = loss_fn(call_model(model, x), y)
                else:  # functional dropout is looked for in the first forward pass
                    with dropout_guard():
                        raw = loss_fn(call_model(model, x), y)
                    checked = True
                bsz = _loss_batch(raw, reduction, x)
                scalar, total = reduce_losses(raw, reduction, bsz, mask)
            except SiteError:
                raise
            except ValueError as exc:
                raise ValueError(f"probe batch {index}: {exc}") from None
            _measure_batch_dims(rec, dims, raw, reduction, mask, bsz)
            rec.backward(scalar)
            # the backward reaches only the graph above the lowest site: the part below it (and its
            # saved activations) lives as long as the loss does, so drop the loss before the next
            # forward (peak memory then does not depend on where the sites are)
            del raw, scalar
            pb = ProbeBatch(index, bsz, total, mask, names=list(rec.names))
            for key in pb.names:
                dim = dims.dim(key, tuple(rec.z[key].shape), bsz)
                pb.z[key], pb.g[key] = batch_first(rec.z[key], dim), batch_first(rec.g[key], dim)
            _check_padding(pb)
            yield pb


def accumulate(
    model: nn.Module,
    sites: Sequence[str],
    batches: Iterable[tuple],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    stats: dict,
    *,
    on_batch: Callable[[int], None] | None = None,
    reduction: str = "none",
    mask_fn: Callable | None = None,
    calls: str = "error",
    output_key=None,
    batchnorm: str = "error",
    batch_dim: int | Mapping[str, int] | None = None,
) -> float:
    """Stream site statistics over a probe: one forward and one backward per batch.

    Every accumulator receives ``z`` and ``g`` with ``g`` the gradient of each
    example's *own* loss ``ℓ_i`` (nats per example, theory/definitions.md, def-setting), whatever the
    reduction ``loss_fn`` uses:

    * ``"none"`` (default): ``loss_fn`` returns per-example losses ``(B,)``; the
      backward pass uses their sum.
    * ``"sum"``: ``loss_fn`` returns ``Σ_i ℓ_i`` (a scalar); used as is.
    * ``"mean"``: ``loss_fn`` returns the batch mean ``(1/B) Σ_i ℓ_i``; its gradient
      is ``g / B``, so it is multiplied by ``B`` (the batch size of the inputs).
    * ``"token_mean"``: ``loss_fn`` returns per-token losses ``(B, T)``; each example's
      loss is the mean over its own non-padded tokens, ``ℓ_i = Σ_t m_it ℓ_it / Σ_t m_it``
      (theory/definitions.md, def-setting).  This is **not** the Hugging Face reduction, the mean over all
      non-padded tokens of the batch, ``Σ_{i,t} m ℓ / Σ_{i,t} m``, which weights each
      example by its token count (a different objective from ``E_D ℓ``); a scalar
      returned under ``"token_mean"`` is rejected because ``ℓ_i`` cannot be recovered
      from it.

    Padding: ``batches`` may yield ``(inputs, targets, mask)``, or ``mask_fn(inputs,
    targets)`` may give the mask: bool ``(B, T)``, ``True`` at real (non-padded)
    tokens.  The loss must ignore padded positions (``loss_fn`` does it for
    ``"none"``; ``"token_mean"`` applies the mask to the per-token losses).  At every
    sequence site ``(B, T, d)`` ``g`` must then be exactly ``0`` at padded positions
    (else the model or the loss reads padding: :class:`SiteError`), and the padded rows
    are dropped from the statistics, so their units count only real tokens.  Rows are
    dropped by passing ``mask=`` to accumulators whose ``update`` takes it (the tangent
    statistics of row-wise families); other accumulators raise :class:`SiteError` when
    a batch has padding (:func:`update_statistics`).  Vector sites ``(B, d)`` are not masked.

    Args:
        model: the reference network (eval mode for BatchNorm).
        sites: site names (``"name"`` or ``"name#k"``, see :class:`SiteRecorder`).
        batches: iterable of ``(inputs, targets)``, ``(inputs, targets, mask)`` or Hugging Face
            mappings with ``"labels"`` (:func:`unpack_batch`, the same as
            :func:`~depthsat_theory.diagnose.diagnose`).
        loss_fn: ``loss_fn(model(inputs), targets)``, reduced as ``reduction`` says.
        stats: ``{site: accumulator}`` with an ``update(z, g)`` method (several
            families per site: pass a list of accumulators).  With ``calls="each"`` the
            keys are the occurrences ``"name#k"``.
        on_batch: optional callback with the batch size (progress bars).
        reduction: one of :data:`REDUCTIONS` (above).
        mask_fn: optional ``mask_fn(inputs, targets) -> (B, T) bool`` (``True`` = keep),
            used when a batch has no mask of its own.
        calls: ``"error"`` or ``"each"``, as in :class:`SiteRecorder`.
        output_key: as in :class:`SiteRecorder`.
        batchnorm: as in :class:`SiteRecorder`.
        batch_dim: where the batch is in the site tensors (``None``: detected; ``0``, ``1``
            for sequence-first ``(T, B, d)`` sites, or ``{site: dim}``), as in :func:`probe_batches`;
            the accumulators always receive batch-first ``(B, *shape)`` tensors.

    Returns:
        The probe's mean loss ``J`` (nats per example, ``ℓ_i`` as above).

    Raises:
        SiteError: on unknown sites, a site without statistics, padding read by the
            model, train-mode BatchNorm or dropout, reentrant checkpointing, a site whose batch
            dimension cannot be found (or is ambiguous), or padded rows an accumulator cannot drop.
        StatisticsError: from the accumulators on bad values.
        ValueError: if a loss is NaN/Inf, has the wrong shape for ``reduction``, an
            example has no real token, or ``reduction`` is unknown.
    """
    total, count = 0.0, 0
    for pb in probe_batches(
        model,
        sites,
        batches,
        loss_fn,
        reduction=reduction,
        mask_fn=mask_fn,
        calls=calls,
        output_key=output_key,
        batchnorm=batchnorm,
        batch_dim=batch_dim,
    ):
        pb.update(stats)
        total += pb.loss_total
        count += pb.size
        if on_batch is not None:
            on_batch(pb.size)
    return total / max(count, 1)
