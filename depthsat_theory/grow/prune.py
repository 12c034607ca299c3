r"""Which layer can be removed: block influence and the first-order loss change of removing it.

Removing a residual layer ``h_out = h_in + Δ(h_in)`` replaces its output by its input, a step
``−Δ`` of the stream at the layer's output; to first order the loss changes by

.. math::

    \delta J_{\text{remove}} \approx -\,\mathbb{E}\,\langle g, \Delta\rangle,
    \qquad g = \partial J / \partial h_{\text{out}},

the activation gradient at the site (``rem-removal-first-order``, theory/zero-output.md).  Next to it
:func:`prune_candidates` gives ShortGPT's block influence ``1 − mean cos(h_in, h_out)``
(:func:`~depthsat_theory.views.exits.block_influence`) and, when asked, the measured change of
actually removing each layer (its output replaced by its input, one forward per layer and batch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from depthsat_theory.capture.insertion import first_output
from depthsat_theory.capture.probe import call_model, unpack_batch
from depthsat_theory.grow.errors import GrowError

__all__ = ["PruneCandidate", "PruneRanking", "prune_candidates", "removal_loss"]


@dataclass
class PruneCandidate:
    """One layer's removal figures (loss units per example, as the loss function's).

    Attributes:
        site: the layer's module name.
        block_influence: ``1 − mean_rows cos(h_in, h_out)`` (0: the layer does not turn the stream).
        first_order_change: ``−E⟨g, Δ⟩``, the predicted loss change of removing the layer.
        removal_change: the measured loss change of removing it (``None`` unless measured).
    """

    site: str
    block_influence: float
    first_order_change: float
    removal_change: float | None = None


@dataclass
class PruneRanking:
    """Layers ranked for removal: the smallest predicted loss increase first.

    Attributes:
        loss: the model's mean probe loss (per example).
        candidates: one :class:`PruneCandidate` per site, in depth order.
        n: examples.
    """

    loss: float
    candidates: list[PruneCandidate] = field(default_factory=list)
    n: int = 0

    def order(self, key: str = "first_order_change") -> list[str]:
        """Sites by ascending ``key`` (``first_order_change``, ``block_influence`` or ``removal_change``).

        Args:
            key: a :class:`PruneCandidate` field.

        Returns:
            The site names, the best removal candidate first.
        """
        return [c.site for c in sorted(self.candidates, key=lambda c: getattr(c, key))]

    def to_dict(self) -> dict:
        """JSON-ready dictionary.

        Returns:
            ``{"loss", "n", "candidates": [...]}``.
        """
        return {"loss": self.loss, "n": self.n, "candidates": [vars(c).copy() for c in self.candidates]}


def _stream_in(args: tuple, kwargs: dict) -> Tensor:
    x = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(x, Tensor):
        raise GrowError("a site's first input is not a tensor: removal needs a layer h_in -> h_in + Δ(h_in)")
    return x


def _replace_first(out: Any, new: Tensor) -> Any:
    if isinstance(out, tuple):
        return (new, *out[1:])
    if isinstance(out, list):
        return [new, *out[1:]]
    return new


def _mean_loss(model: nn.Module, loss_fn: Callable, batches: Sequence) -> tuple[float, int]:
    tot, n = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            x, y, _ = unpack_batch(batch)
            ell = loss_fn(call_model(model, x), y)
            tot += float(ell.double().sum())
            n += int(ell.shape[0])
    return tot / n, n


def removal_loss(model: nn.Module, loss_fn: Callable, batches: Sequence, site: str) -> float:
    """The mean probe loss with layer ``site`` removed (its output replaced by its input).

    Args:
        model: the model (unchanged afterwards).
        loss_fn: per-example loss ``loss_fn(output, targets) -> (B,)``.
        batches: probe batches.
        site: the layer's module name.

    Returns:
        The mean loss per example without the layer.
    """

    def skip(_m: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        return _replace_first(out, _stream_in(args, kwargs))

    h = model.get_submodule(site).register_forward_hook(skip, with_kwargs=True)
    try:
        return _mean_loss(model, loss_fn, batches)[0]
    finally:
        h.remove()


def prune_candidates(
    model: nn.Module,
    loss_fn: Callable,
    batches: Sequence,
    sites: Sequence[str],
    *,
    measure: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> PruneRanking:
    r"""Block influence and first-order removal change of every site, one forward+backward per batch.

    For each batch, hooks record every site's input ``h_in`` and output ``h_out`` and the gradient
    ``g`` of the batch's summed per-example loss at ``h_out``; the first-order change of removing
    the site is :math:`-\sum \langle g, h_{out} - h_{in}\rangle / n` over all batches (``n``
    examples).  Each site must map the residual stream to itself (same shape in and out).

    Args:
        model: the model (not modified).
        loss_fn: per-example loss ``loss_fn(output, targets) -> (B,)``.
        batches: probe batches (``(inputs, targets)`` or Hugging Face mappings).
        sites: the residual layers' module names.
        measure: also measure the loss with each layer removed (one more forward per site and batch).
        progress: ``progress(done, total)`` after each batch.

    Returns:
        A :class:`PruneRanking` (loss units per example).

    Raises:
        GrowError: no sites or batches, or a site whose output shape differs from its input's.

    Source: ShortGPT (Men et al., 2024) for block influence; ``rem-removal-first-order`` (theory/zero-output.md).
    """
    if not sites or not batches:
        raise GrowError("prune_candidates needs at least one site and one probe batch")
    from depthsat_theory.views.exits import StreamStates, block_influence

    fo = dict.fromkeys(sites, 0.0)
    bi = dict.fromkeys(sites, 0.0)
    rows = dict.fromkeys(sites, 0)
    n = 0
    seen: dict[str, tuple[Tensor, Tensor]] = {}

    def make(name: str) -> Callable:
        def hook(_m: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            h_in, h_out = _stream_in(args, kwargs), first_output(out)
            if h_in.shape != h_out.shape:
                raise GrowError(f"site {name}: output {tuple(h_out.shape)} != input {tuple(h_in.shape)}")
            seen[name] = (h_in.detach(), h_out)

        return hook

    handles = [model.get_submodule(s).register_forward_hook(make(s), with_kwargs=True) for s in sites]
    try:
        for k, batch in enumerate(batches):
            x, y, _ = unpack_batch(batch)
            ell = loss_fn(call_model(model, x), y)
            outs = [seen[s][1] for s in sites]
            grads = torch.autograd.grad(ell.sum(), outs, allow_unused=True)
            n += int(ell.shape[0])
            for s, g in zip(sites, grads, strict=True):
                h_in, h_out = seen[s][0], seen[s][1].detach()
                fo[s] -= 0.0 if g is None else float((g.double() * (h_out - h_in).double()).sum())
                r = h_in.shape[0] if h_in.dim() == 4 else h_in[..., 0].numel()
                bi[s] += float(block_influence(StreamStates([h_in, h_out], [s]))[0]) * r
                rows[s] += r
            seen.clear()
            if progress is not None:
                progress(k + 1, len(batches))
    finally:
        for h in handles:
            h.remove()
    loss, _ = _mean_loss(model, loss_fn, batches)
    ranking = PruneRanking(loss, n=n)
    for s in sites:
        removed = removal_loss(model, loss_fn, batches, s) - loss if measure else None
        ranking.candidates.append(PruneCandidate(s, bi[s] / rows[s], fo[s] / n, removed))
    return ranking
