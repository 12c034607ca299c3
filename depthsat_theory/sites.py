"""Insertion sites in torch models: capture ``z`` and ``g``, insert blocks.

A *site* is a submodule (by its name in ``model.named_modules()``) whose forward
output is the residual-stream tensor ``z`` at that depth.  :class:`SiteRecorder`
captures ``z`` for every chosen site with forward hooks and the activation gradient
``g = ∂ℓ/∂z`` of the *per-example* losses in the same backward pass, so all sites
cost one forward and one backward per batch.

The gradient is taken at an identity autograd node placed on the site's output;
it receives the gradient with respect to the site's output *before* any later
in-place operation, and works when the site's input does not require grad.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

__all__ = [
    "SiteError",
    "NotFunctionPreservingError",
    "SiteRecorder",
    "ResidualInsertion",
    "insert_block",
    "check_function_preserving",
    "accumulate",
]


class SiteError(ValueError):
    """A site name does not exist, or a site cannot be captured."""


class NotFunctionPreservingError(ValueError):
    """An inserted block changed the model's function at the origin."""


class _Tap(torch.autograd.Function):
    """Identity on the site tensor; its backward stores the incoming gradient."""

    @staticmethod
    def forward(ctx, z, anchor, slot):  # noqa: D401
        ctx.slot = slot
        return z.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.slot.append(grad.detach())
        return grad, torch.zeros((), dtype=grad.dtype, device=grad.device), None


def _resolve(model: nn.Module, name: str) -> nn.Module:
    mods = dict(model.named_modules())
    if name not in mods:
        close = [n for n in mods if n and name.split(".")[-1] in n][:5]
        hint = f"; similar: {', '.join(close)}" if close else ""
        raise SiteError(f"no module named {name!r} in {type(model).__name__}{hint}")
    return mods[name]


class SiteRecorder:
    """Context manager capturing site activations and activation gradients.

    Usage::

        with SiteRecorder(model, ["blocks.0", "blocks.1"]) as rec:
            losses = loss_fn(model(x), y)          # per-example losses, shape (B,)
            rec.backward(losses.sum())
            z, g = rec.z["blocks.0"], rec.g["blocks.0"]

    ``rec.backward`` computes only the site gradients (no parameter gradients).

    Args:
        model: any ``nn.Module``.
        sites: module names whose outputs are site tensors (tuple outputs: the
            first element).

    Raises:
        SiteError: if a site name does not exist, or a site module ran other than
            exactly once in the forward pass.
    """

    def __init__(self, model: nn.Module, sites: Sequence[str]):
        self.model = model
        self.sites = list(sites)
        self.modules = {s: _resolve(model, s) for s in self.sites}
        self._handles: list = []
        self.z: dict[str, Tensor] = {}
        self.g: dict[str, Tensor] = {}
        self._slots: dict[str, list] = {}
        self._anchors: dict[str, Tensor] = {}
        self._calls: dict[str, int] = {}

    def __enter__(self) -> SiteRecorder:
        for name, mod in self.modules.items():
            self._handles.append(mod.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(module, inputs, output):
            self._calls[name] = self._calls.get(name, 0) + 1
            is_tuple = isinstance(output, tuple)
            t = output[0] if is_tuple else output
            if not isinstance(t, Tensor):
                raise SiteError(f"site {name!r} returned {type(t).__name__}, not a tensor")
            anchor = torch.zeros((), dtype=t.dtype, device=t.device, requires_grad=True)
            slot: list = []
            self._slots[name] = slot
            self._anchors[name] = anchor
            self.z[name] = t.detach().clone()
            tapped = _Tap.apply(t, anchor, slot)
            return (tapped,) + tuple(output[1:]) if is_tuple else tapped

        return hook

    def backward(self, loss: Tensor) -> None:
        """Backpropagate ``loss`` (a scalar: the *sum* of per-example losses) to the sites.

        Raises:
            SiteError: if a site did not run exactly once in the last forward pass.
        """
        for name in self.sites:
            calls = self._calls.get(name, 0)
            if calls != 1:
                raise SiteError(
                    f"site {name!r} ran {calls} times in one forward pass; a site must run "
                    f"exactly once (choose a module that is called once per forward)")
        anchors = [self._anchors[s] for s in self.sites]
        torch.autograd.grad(loss, anchors, allow_unused=True)
        for name in self.sites:
            slot = self._slots[name]
            if not slot:
                self.g[name] = torch.zeros_like(self.z[name])
            else:
                self.g[name] = slot[0]
        self._calls.clear()


def accumulate(model: nn.Module, sites: Sequence[str], batches: Iterable[tuple[Tensor, Tensor]],
               loss_fn: Callable[[Tensor, Tensor], Tensor], stats: dict,
               *, on_batch: Callable[[int], None] | None = None) -> float:
    """Stream site statistics over a probe: one forward and one backward per batch.

    Args:
        model: the reference network (eval mode for BatchNorm).
        sites: site names.
        batches: iterable of ``(inputs, targets)``.
        loss_fn: per-example losses ``(B,)`` (nats per example); the backward pass
            uses their sum so that ``g`` is the gradient of each example's own loss.
        stats: ``{site: accumulator}`` with an ``update(z, g)`` method (several
            families per site: pass a list of accumulators).
        on_batch: optional callback with the batch size (progress bars).

    Returns:
        The probe's mean loss ``J`` (nats per example).

    Raises:
        SiteError: on unknown sites; StatisticsError from the accumulators on bad values.
        ValueError: if a loss is NaN/Inf or has the wrong shape.
    """
    total, count = 0.0, 0
    with SiteRecorder(model, sites) as rec:
        for x, y in batches:
            losses = loss_fn(model(x), y)
            if losses.dim() != 1 or losses.shape[0] != _batch_size(x):
                raise ValueError(
                    f"loss_fn must return per-example losses of shape (B,), got {tuple(losses.shape)}")
            if not torch.isfinite(losses).all():
                raise ValueError("the loss is NaN or Inf on the probe; cannot take gradients")
            rec.backward(losses.sum())
            for s in sites:
                accs = stats[s] if isinstance(stats[s], (list, tuple)) else [stats[s]]
                for acc in accs:
                    acc.update(rec.z[s], rec.g[s])
            total += float(losses.detach().sum())
            count += int(losses.shape[0])
            if on_batch is not None:
                on_batch(int(losses.shape[0]))
    return total / max(count, 1)


def _batch_size(x) -> int:
    if isinstance(x, Tensor):
        return int(x.shape[0])
    if isinstance(x, dict):
        return _batch_size(next(iter(x.values())))
    return _batch_size(x[0])


class ResidualInsertion(nn.Module):
    """Wraps a site module ``f`` as ``x ↦ f(x) + h(f(x))`` (tuple outputs: first element)."""

    def __init__(self, site: nn.Module, block: nn.Module):
        super().__init__()
        self.site = site
        self.block = block

    def forward(self, *args, **kwargs):
        out = self.site(*args, **kwargs)
        if isinstance(out, tuple):
            return (out[0] + self.block(out[0]),) + tuple(out[1:])
        return out + self.block(out)


def insert_block(model: nn.Module, site: str, block: nn.Module) -> tuple[nn.Module, nn.Module]:
    """Insert ``block`` after ``site`` in a deep copy of ``model``.

    Returns:
        ``(new_model, block)`` where ``block`` is the inserted module inside the copy
        (its parameters are the new block's parameters).

    Raises:
        SiteError: if ``site`` does not exist or is the model itself.
    """
    _resolve(model, site)
    if site == "":
        raise SiteError("cannot insert after the whole model; name a submodule")
    new = copy.deepcopy(model)
    parent_name, _, child = site.rpartition(".")
    parent = _resolve(new, parent_name) if parent_name else new
    old = getattr(parent, child) if not child.isdigit() else parent[int(child)]
    wrapped = ResidualInsertion(old, block)
    if child.isdigit() and isinstance(parent, (nn.ModuleList, nn.Sequential)):
        parent[int(child)] = wrapped
    else:
        setattr(parent, child, wrapped)
    return new, wrapped.block


def check_function_preserving(model: nn.Module | Tensor, new_model: nn.Module, inputs, *,
                              atol: float | None = None) -> float:
    """Verify that an inserted block preserves the model's function at the origin.

    Args:
        model: the reference model, or its precomputed output on ``inputs``.
        new_model: the model with the block inserted.
        inputs: a probe batch accepted by both models.
        atol: allowed max absolute deviation of outputs (default: ``0`` for blocks
            whose output is an exact zero; pass a rounding bound otherwise).

    Returns:
        The max absolute deviation of the outputs.

    Raises:
        NotFunctionPreservingError: if the deviation exceeds ``atol`` or is NaN.
    """
    with torch.no_grad():
        a = model if isinstance(model, Tensor) else _first(model(inputs))
        b = _first(new_model(inputs))
    dev = float((a - b).abs().max()) if a.numel() else 0.0
    limit = 0.0 if atol is None else atol
    if not dev <= limit:
        raise NotFunctionPreservingError(
            f"the inserted block changes the model's output by {dev:.3g} (> {limit:.3g}) at the "
            f"origin: the family is not function-preserving (h(0, z) must be 0)")
    return dev


def _first(out):
    if isinstance(out, tuple):
        return out[0]
    if hasattr(out, "logits"):
        return out.logits
    return out
