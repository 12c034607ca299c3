"""Insertion sites in torch models: capture ``z`` and ``g``, insert blocks.

A *site* is a submodule (by its name in ``model.named_modules()``) whose forward
output is the residual-stream tensor ``z`` at that depth.  :class:`SiteRecorder`
captures ``z`` for every chosen site with forward hooks and the activation gradient
``g = ∂ℓ/∂z`` of the *per-example* losses in the same backward pass, so all sites
cost one forward and one backward per batch.

The gradient is taken at an identity autograd node placed on the site's output;
it receives the gradient with respect to the site's output *before* any later
in-place operation, and works when the site's input does not require grad.  It is
the gradient with respect to an explicit additive perturbation ``δ = 0`` of the
site's output, ``g_i = ∂ℓ_i/∂δ_i`` (theory/definitions.md).

Conventions (theory/definitions.md):

* **Site names.**  ``"blocks.3"`` names a module that runs exactly once per forward
  pass (``calls="error"``, the default).  A module that runs several times per
  forward (a weight-shared block) has one site per *invocation*: occurrence ``k``
  (``k = 0, 1, …`` in call order, counted since the last :meth:`SiteRecorder.backward`
  or :meth:`SiteRecorder.reset`) is the site ``"name#k"``.  Name it explicitly, or
  pass ``calls="each"`` to record every occurrence of a bare ``"name"`` under the
  keys ``"name#0"``, ``"name#1"``, …  Each occurrence has its own ``z`` (that call's
  output) and ``g`` (the gradient of the loss with respect to a perturbation of that
  call's output only, including its effect through the later calls).
* **Structured outputs.**  A module returning a tuple/list (Hugging Face layers
  return ``(hidden_states, …)``) has the site tensor at index 0; a mapping
  (``dict``, ``transformers.ModelOutput``) at its first key; ``output_key`` selects
  another index/key.  The tapped tensor is put back into the returned structure so
  that everything downstream uses it.
* **BatchNorm.**  A BatchNorm that normalizes with batch statistics (train mode, or
  ``track_running_stats=False``) makes ``z``, ``g`` and the tangent map depend on
  the whole batch (theory/definitions.md): a :class:`SiteError` by default.
* **Reductions and padding** (see :func:`accumulate`): ``g`` is the gradient of the
  per-example loss ``ℓ_i`` (nats per example); padded positions are excluded from
  the losses and from the units of the statistics.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn

from depthsat_theory.statistics import StatisticsError

__all__ = [
    "REDUCTIONS",
    "NotFunctionPreservingError",
    "SiteError",
    "SiteRecorder",
    "accumulate",
    "parse_site",
    "reduce_losses",
    "resolve_module",
    "split_output",
    "update_statistics",
]

#: Loss reductions accepted by :func:`accumulate`.
REDUCTIONS = ("none", "sum", "mean", "token_mean")


class SiteError(ValueError):
    """A site name does not exist, or a site cannot be captured."""


class NotFunctionPreservingError(ValueError):
    """An inserted block changed the model's function at the origin."""


class _Tap(torch.autograd.Function):
    """Identity on the site tensor; its backward stores the incoming gradient."""

    @staticmethod
    def forward(ctx, z, anchor, slot):
        ctx.slot = slot
        return z.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.slot.append(grad.detach())
        return grad, torch.zeros((), dtype=grad.dtype, device=grad.device), None


def parse_site(site: str) -> tuple[str, int | None]:
    """Split a site name into ``(module_name, occurrence)``.

    Args:
        site: ``"name"`` or ``"name#k"`` (``k ≥ 0``: the ``k``-th call of the module in
            one forward pass).

    Returns:
        ``(name, k)`` with ``k = None`` for a bare name.

    Raises:
        SiteError: if the occurrence suffix is not a non-negative integer.
    """
    name, sep, occ = site.partition("#")
    if not sep:
        return site, None
    if not occ.isdigit():
        raise SiteError(f"bad site {site!r}: the occurrence suffix must be '#k' with k = 0, 1, …")
    return name, int(occ)


def resolve_module(model: nn.Module, name: str) -> nn.Module:
    mods = dict(model.named_modules())
    if name not in mods:
        close = [n for n in mods if n and name.split(".")[-1] in n][:5]
        hint = f"; similar: {', '.join(close)}" if close else ""
        raise SiteError(f"no module named {name!r} in {type(model).__name__}{hint}")
    return mods[name]


def split_output(output, key, where: str):
    """``(site_tensor, rebuild)``: the site tensor in a module output and a function
    returning the output with the site tensor replaced (same container type)."""
    if isinstance(output, Tensor):
        if key not in (None, 0):
            raise SiteError(f"{where} returned a tensor; output_key {key!r} does not apply")
        return output, lambda t: t
    if isinstance(output, Mapping):
        if key is None:
            if len(output) == 0:
                raise SiteError(f"{where} returned an empty mapping")
            key = next(iter(output.keys()))
        if key not in output:
            raise SiteError(
                f"{where} returned a mapping without key {key!r}; keys: {', '.join(map(str, output.keys()))}"
            )

        def rebuild_map(t):
            old = output[key]
            output[key] = t  # ModelOutput.__setitem__ also sets the attribute
            if hasattr(output, "__dict__") and vars(output).get(key, None) is old:
                object.__setattr__(output, key, t)
            return output

        return output[key], rebuild_map
    if isinstance(output, (tuple, list)):
        idx = 0 if key is None else key
        if not isinstance(idx, int) or not -len(output) <= idx < len(output):
            raise SiteError(
                f"{where} returned a {type(output).__name__} of length {len(output)}; "
                f"output_key must be an index into it, got {key!r}"
            )
        idx = idx % len(output)

        def rebuild_seq(t):
            if isinstance(output, list):
                new = list(output)
                new[idx] = t
                return new
            if hasattr(output, "_fields"):  # namedtuple
                return output._replace(**{output._fields[idx]: t})
            return (*tuple(output[:idx]), t, *tuple(output[idx + 1 :]))

        return output[idx], rebuild_seq
    if isinstance(key, str) and isinstance(getattr(output, key, None), Tensor):

        def rebuild_attr(t):
            new = copy.copy(output)
            setattr(new, key, t)
            return new

        return getattr(output, key), rebuild_attr
    raise SiteError(
        f"{where} returned {type(output).__name__}, not a tensor, tuple or mapping "
        f"(pass output_key to name the site tensor)"
    )


def _batch_stat_norms(model: nn.Module) -> list[str]:
    """Names of BatchNorm modules that normalize with the statistics of the batch."""
    bad = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and (
            mod.training or not mod.track_running_stats or mod.running_mean is None
        ):
            bad.append(name or type(mod).__name__)
    return bad


def _check_batchnorm(model: nn.Module, policy: str) -> None:
    if policy not in ("error", "warn", "ignore"):
        raise ValueError(f"batchnorm must be 'error', 'warn' or 'ignore', got {policy!r}")
    if policy == "ignore":
        return
    bad = _batch_stat_norms(model)
    if not bad:
        return
    msg = (
        f"BatchNorm module(s) {', '.join(bad)} normalize with the statistics of the batch "
        f"(train mode or track_running_stats=False): z, g and the tangent map A then depend "
        f"on the whole batch, not on the example (theory/definitions.md); call model.eval()"
    )
    if policy == "error":
        raise SiteError(msg + " or pass batchnorm='warn'/'ignore'")
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


class SiteRecorder:
    """Context manager capturing site activations and activation gradients.

    Usage::

        with SiteRecorder(model, ["blocks.0", "blocks.1"]) as rec:
            losses = loss_fn(model(x), y)          # per-example losses, shape (B,)
            rec.backward(losses.sum())
            z, g = rec.z["blocks.0"], rec.g["blocks.0"]

    ``rec.backward`` computes only the site gradients (no parameter gradients).
    ``z`` is a detached copy of the site output ``(B, *shape)`` in the model's dtype
    and device; ``g`` has the same shape and dtype: the gradient of the scalar passed
    to :meth:`backward` with respect to an additive perturbation of that output
    (theory/definitions.md; pass the *sum* of per-example losses so that ``g_i = ∂ℓ_i/∂z_i``).

    Repeated modules: occurrence ``k`` of a module (its ``k``-th call since the last
    :meth:`backward`/:meth:`reset`, ``k = 0, 1, …``) is the site ``"name#k"``; with
    ``calls="each"`` a bare ``"name"`` records every occurrence under ``"name#k"``.
    :attr:`names` lists the keys recorded in the last forward pass.

    Args:
        model: any ``nn.Module``.
        sites: site names ``"module.name"`` or ``"module.name#k"``.
        calls: for bare names: ``"error"`` (default) — the module must run exactly
            once per forward, keys are the bare names; ``"each"`` — every call is
            its own occurrence ``"name#k"``.
        output_key: where the site tensor is in a structured output: ``None``
            (index 0 of a tuple/list, the first key of a mapping/``ModelOutput``), an
            index, a key, or ``{site: key}`` per site (keyed by module name).
        batchnorm: ``"error"`` (default), ``"warn"`` or ``"ignore"`` when a BatchNorm
            in ``model`` normalizes with batch statistics (checked on entry and at
            each :meth:`backward`).

    Raises:
        SiteError: if a site name does not exist, a site module did not run as
            required (exactly once for a bare name with ``calls="error"``, at least
            ``k + 1`` times for ``"name#k"``), its output holds no site tensor, or a
            BatchNorm uses batch statistics (``batchnorm="error"``).
        ValueError: on a bad ``calls``/``batchnorm`` value.
    """

    def __init__(
        self, model: nn.Module, sites: Sequence[str], *, calls: str = "error", output_key=None, batchnorm: str = "error"
    ):
        if calls not in ("error", "each"):
            raise ValueError(f"calls must be 'error' or 'each', got {calls!r}")
        if batchnorm not in ("error", "warn", "ignore"):
            raise ValueError(f"batchnorm must be 'error', 'warn' or 'ignore', got {batchnorm!r}")
        self.model = model
        self.sites = list(sites)
        self.calls = calls
        self.batchnorm = batchnorm
        self._output_key = output_key
        self.modules = {}
        self._requests: dict[str, dict] = {}
        for s in self.sites:
            base, occ = parse_site(s)
            self.modules[s] = resolve_module(model, base)
            req = self._requests.setdefault(base, {"bare": False, "occ": set()})
            if occ is None:
                req["bare"] = True
            else:
                req["occ"].add(occ)
        self._handles: list = []
        self.z: dict[str, Tensor] = {}
        self.g: dict[str, Tensor] = {}
        self.names: list[str] = []
        self.last_calls: dict[str, int] = {}
        self._slots: dict[str, list] = {}
        self._anchors: dict[str, Tensor] = {}
        self._calls: dict[str, int] = {}

    def __enter__(self) -> SiteRecorder:
        _check_batchnorm(self.model, self.batchnorm)
        for base in self._requests:
            mod = resolve_module(self.model, base)
            self._handles.append(mod.register_forward_hook(self._hook(base)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _key_for(self, base: str):
        key = self._output_key
        if isinstance(key, Mapping):
            return key.get(base)
        return key

    def _hook(self, base: str):
        req = self._requests[base]

        def hook(module, inputs, output):
            k = self._calls.get(base, 0)
            self._calls[base] = k + 1
            keys = []
            if req["bare"]:
                if self.calls == "each":
                    keys.append(f"{base}#{k}")
                elif k == 0:
                    keys.append(base)
            if k in req["occ"] and f"{base}#{k}" not in keys:
                keys.append(f"{base}#{k}")
            if not keys:
                return None
            t, rebuild = split_output(output, self._key_for(base), f"site {base!r}")
            if not isinstance(t, Tensor):
                raise SiteError(f"site {base!r} returned {type(t).__name__}, not a tensor")
            anchor = torch.zeros((), dtype=t.dtype, device=t.device, requires_grad=True)
            slot: list = []
            zc = t.detach().clone()
            for key in keys:
                self._slots[key] = slot
                self._anchors[key] = anchor
                self.z[key] = zc
                if key not in self.names:
                    self.names.append(key)
            return rebuild(_Tap.apply(t, anchor, slot))

        return hook

    def reset(self) -> None:
        """Forget the current forward pass (occurrence counters, captured ``z``)."""
        self._calls.clear()
        self._slots.clear()
        self._anchors.clear()
        self.z.clear()
        self.names = []

    def _validate(self) -> None:
        for base, req in self._requests.items():
            n = self._calls.get(base, 0)
            if req["bare"] and self.calls == "error" and n != 1:
                self.reset()
                raise SiteError(
                    f"site {base!r} ran {n} times in one forward pass; a site must run exactly "
                    f"once (choose a module that is called once per forward, name one call "
                    f"'{base}#k', or pass calls='each' to record every call)"
                )
            if req["bare"] and n == 0:
                self.reset()
                raise SiteError(f"site {base!r} did not run in the forward pass")
            for k in sorted(req["occ"]):
                if k >= n:
                    self.reset()
                    raise SiteError(
                        f"site '{base}#{k}' does not exist: module {base!r} ran {n} "
                        f"time(s) in the forward pass (occurrences 0…{n - 1})"
                    )

    def backward(self, loss: Tensor) -> None:
        """Backpropagate ``loss`` to the sites and fill :attr:`g` (then reset the counters).

        Args:
            loss: a scalar: the *sum* of the per-example losses (theory/definitions.md, def-setting), so that
                ``g[i] = ∂ℓ_i/∂z_i``.  A batch mean gives ``g / B``
                (:func:`accumulate` handles other reductions).

        Raises:
            SiteError: if a site did not run as required in the last forward pass, or a
                BatchNorm uses batch statistics (``batchnorm="error"``).
        """
        _check_batchnorm(self.model, self.batchnorm)
        self._validate()
        anchors, seen = [], set()
        for key in self.names:
            a = self._anchors[key]
            if id(a) not in seen:
                seen.add(id(a))
                anchors.append(a)
        self.g.clear()
        torch.autograd.grad(loss, anchors, allow_unused=True)
        for key in self.names:
            slot = self._slots[key]
            self.g[key] = slot[0] if slot else torch.zeros_like(self.z[key])
        self.last_calls = dict(self._calls)
        self._calls.clear()
        self._slots.clear()
        self._anchors.clear()


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
        per-example gradients, and the batch's summed per-example loss (float, nats).

    Raises:
        ValueError: wrong shape for the reduction, an unknown reduction, NaN/Inf losses.
    """
    if not isinstance(raw, Tensor):
        raise ValueError(f"loss_fn must return a tensor, got {type(raw).__name__}")
    if not torch.isfinite(raw.detach()).all() and reduction != "token_mean":
        raise ValueError("the loss is NaN or Inf on the probe; cannot take gradients")
    if reduction == "none":
        if raw.dim() != 1 or raw.shape[0] != batch:
            raise ValueError(
                f"loss_fn must return per-example losses of shape (B,) = ({batch},), got "
                f"{tuple(raw.shape)} (pass reduction='mean'/'sum' for a batch-reduced scalar)"
            )
        return raw.sum(), float(raw.detach().sum())
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
        z, g: the site's ``(B, *shape)`` activations and per-example activation gradients.
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
    dropped by passing ``mask=`` to accumulators whose ``update`` takes it, else (for
    :mod:`depthsat_theory.statistics.tangent` accumulators of row-wise families) by accumulating
    the selected rows and merging; other accumulators raise :class:`SiteError` when
    a batch has padding.  Vector sites ``(B, d)`` are not masked.

    Args:
        model: the reference network (eval mode for BatchNorm).
        sites: site names (``"name"`` or ``"name#k"``, see :class:`SiteRecorder`).
        batches: iterable of ``(inputs, targets)`` or ``(inputs, targets, mask)``.
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

    Returns:
        The probe's mean loss ``J`` (nats per example, ``ℓ_i`` as above).

    Raises:
        SiteError: on unknown sites, a site without statistics, padding read by the
            model, train-mode BatchNorm, or padded rows an accumulator cannot drop.
        StatisticsError: from the accumulators on bad values.
        ValueError: if a loss is NaN/Inf, has the wrong shape for ``reduction``, an
            example has no real token, or ``reduction`` is unknown.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    total, count = 0.0, 0
    with SiteRecorder(model, sites, calls=calls, output_key=output_key, batchnorm=batchnorm) as rec:
        for batch in batches:
            if len(batch) == 3:
                x, y, mask = batch
            else:
                x, y = batch
                mask = mask_fn(x, y) if mask_fn is not None else None
            if mask is not None:
                mask = torch.as_tensor(mask).bool()
                if mask.dim() != 2:
                    raise ValueError(f"the padding mask must be (B, T) bool, got {tuple(mask.shape)}")
            bsz = _batch_size(x)
            rec.reset()
            raw = loss_fn(model(x), y)
            scalar, batch_total = reduce_losses(raw, reduction, bsz, mask)
            rec.backward(scalar)
            for key in rec.names:
                if key not in stats:
                    raise SiteError(f"no statistics for site {key!r} (recorded sites: {', '.join(rec.names)})")
                z, g = rec.z[key], rec.g[key]
                if mask is not None and z.dim() == 3 and tuple(mask.shape) == tuple(z.shape[:2]):
                    pad = ~mask.to(g.device)
                    if bool((g[pad] != 0).any()):
                        raise SiteError(
                            f"the activation gradient at site {key!r} is nonzero at padded "
                            f"positions: the model or the loss reads padding (pass the attention "
                            f"mask to the model and ignore padded tokens in the loss)"
                        )
                accs = stats[key] if isinstance(stats[key], (list, tuple)) else [stats[key]]
                for acc in accs:
                    update_statistics(acc, z, g, mask, key)
            total += batch_total
            count += bsz
            if on_batch is not None:
                on_batch(bsz)
    return total / max(count, 1)


def _batch_size(x) -> int:
    if isinstance(x, Tensor):
        return int(x.shape[0])
    if isinstance(x, Mapping):
        return _batch_size(next(iter(x.values())))
    return _batch_size(x[0])
