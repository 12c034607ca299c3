r"""Rank sites with the family that is inserted: the zero-output layer copy's own tangent space.

A zero-output copy of layer ``i`` (:func:`~depthsat_theory.grow.hf.expand_layers`) adds
:math:`\sum_m W_m \varphi_m(h)` (plus the zeroed biases) to the stream, where :math:`W_m` are its
zeroed output projections and :math:`\varphi_m` their inputs, computed by the copy's own
attention and MLP at the origin.  It is the feature family with features
:math:`\tilde\varphi = (\varphi_1, \varphi_2, \dots, 1)` (``thm-cross-gradient``), so its score is
:math:`s^2 = \operatorname{tr}(G\Sigma^+G^\top)`, streamed by
:class:`~depthsat_theory.statistics.FeatureStatistics` like any feature family, with the same
noise test and rounding bound.  The features are read by hooks on the zeroed projections of a
model grown at every candidate site at once (each copy adds exactly zero, so each sees the
original stream and the original activation gradient).

Only copies whose zeroed parameters are the weights (and biases) of row-wise linear maps
(``nn.Linear``, GPT-2's ``Conv1D``) are such a family; fused mixture-of-experts weights are not
(the router gates each expert's features): :func:`copy_scores` refuses them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from depthsat_theory.capture.insertion import first_output
from depthsat_theory.capture.probe import call_model, unpack_batch
from depthsat_theory.families.base import FeatureFamily, to_rows
from depthsat_theory.grow.errors import GrowError
from depthsat_theory.vocabulary import Layout

__all__ = ["copy_scores", "copy_statistics"]


class _Tail(nn.Module):
    """``z ↦ z[..., d:]`` as rows: the copy's features, carried next to the stream."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.d = d

    def forward(self, z: Tensor) -> Tensor:
        return to_rows(z, Layout.SEQUENCE)[..., self.d :]


class _CopyFeatures(FeatureFamily):
    """The copy's features ``φ̃``, handed over as the last ``k`` entries of a ``(B, T, d + k)`` site tensor."""

    copies_input = True

    def __init__(self, d: int, k: int, bias: bool) -> None:
        super().__init__(f"layer-copy:{k}", bias=bias, layouts=(Layout.SEQUENCE,))
        self.d0, self.k0 = d, k

    def feature_dim(self, shape: Sequence[int], layout: str) -> int:
        return self.k0

    def _make_feature_map(self, shape: Sequence[int], layout: str) -> nn.Module:
        return _Tail(self.d0)


def _projections(model: nn.Module, zeroed: Sequence[str]) -> tuple[list[nn.Module], bool]:
    """The zeroed row-wise linear maps of one copy, and whether any of their biases is zeroed."""
    mods: dict[str, nn.Module] = {}
    bias = False
    for name in zeroed:
        path, _, leaf = name.rpartition(".")
        mod = model.get_submodule(path)
        kind = type(mod).__name__
        if kind not in ("Linear", "Conv1D") or leaf not in ("weight", "bias"):
            raise GrowError(
                f"{name} is not the weight or bias of a row-wise linear map ({kind}): the copy is not a feature "
                f"family to score (e.g. fused mixture-of-experts weights); rank with --family linear"
            )
        mods.setdefault(path, mod)
        bias |= leaf == "bias"
    return list(mods.values()), bias


def copy_scores(
    expansion: Any, loss_fn: Callable, batches: Sequence, *, progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    """The saturation result of each zero-output copy of an expansion, with the copy's own features.

    Args:
        expansion: an :class:`~depthsat_theory.grow.hf.Expansion` (its copies still at zero output).
        loss_fn: per-example loss ``loss_fn(output, targets) -> (B,)``.
        batches: probe batches (Hugging Face mappings with ``attention_mask``, or ``(inputs, targets)``).
        progress: ``progress(done, total)`` after each batch.

    Returns:
        ``{original site: SaturationResult}``: ``"model.layers.i"`` for the copy of layer ``i``.

    Raises:
        GrowError: a copy whose zeroed parameters are not row-wise linear maps, or a copy not at zero.
    """
    stats = copy_statistics(expansion, loss_fn, batches, progress=progress)
    return {site: st.result() for site, st in stats.items()}


def copy_statistics(
    expansion: Any, loss_fn: Callable, batches: Sequence, *, progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    """The streamed statistics (``G``, ``Σ``) of each zero-output copy, by original site (:func:`copy_scores`).

    Args:
        expansion: an :class:`~depthsat_theory.grow.hf.Expansion` (its copies still at zero output).
        loss_fn: per-example loss ``loss_fn(output, targets) -> (B,)``.
        batches: probe batches (Hugging Face mappings with ``attention_mask``, or ``(inputs, targets)``).
        progress: ``progress(done, total)`` after each batch.

    Returns:
        ``{original site: FeatureStatistics}``; the copy's feature columns are its zeroed maps' inputs in
        the order of ``expansion.zeroed``, then the constant when a bias is zeroed.

    Raises:
        GrowError: a copy whose zeroed parameters are not row-wise linear maps, or a copy not at zero.
    """
    from depthsat_theory.statistics import FeatureStatistics

    model = expansion.model
    layers = model.get_submodule(expansion.layer_list)
    sites = {
        f"{expansion.layer_list}.{j}": f"{expansion.layer_list}.{i}"
        for i, j in zip(expansion.positions, expansion.new_indices, strict=True)
    }
    if any(bool(model.get_parameter(n).detach().any()) for ns in expansion.zeroed.values() for n in ns):
        raise GrowError("the copies are not at zero output: score them right after expand_layers")
    feats: dict[str, list[Tensor]] = {}
    outs: dict[str, Tensor] = {}
    handles = []
    plan = {}
    for site in sites:
        mods, bias = _projections(model, expansion.zeroed[site])
        plan[site] = (mods, bias)

        def keep(_m: nn.Module, args: tuple, site: str = site) -> None:
            feats.setdefault(site, []).append(args[0].detach())

        def out_hook(_m: nn.Module, _a: tuple, out: Any, site: str = site) -> None:
            outs[site] = first_output(out)

        handles += [m.register_forward_pre_hook(keep) for m in mods]
        handles.append(layers[int(site.rsplit(".", 1)[1])].register_forward_hook(out_hook))
    stats: dict[str, FeatureStatistics] = {}
    try:
        for b, batch in enumerate(batches):
            x, y, _ = unpack_batch(batch)
            ell = loss_fn(call_model(model, x), y)
            grads = torch.autograd.grad(ell.sum(), [outs[s] for s in sites])
            mask = x.get("attention_mask") if isinstance(x, dict) else None
            for site, g in zip(sites, grads, strict=True):
                phi = torch.cat([f.to(torch.float64) for f in feats[site]], dim=-1)
                d, k = g.shape[-1], phi.shape[-1]
                z = torch.cat([outs[site].detach().to(torch.float64), phi], dim=-1)
                gz = torch.cat([g.to(torch.float64), torch.zeros_like(phi)], dim=-1)
                if site not in stats:
                    fam = _CopyFeatures(d, k, plan[site][1])
                    stats[site] = FeatureStatistics(fam, tuple(z.shape[1:]), Layout.SEQUENCE)
                stats[site].update(z, gz, None if mask is None else mask.bool())
            feats.clear()
            outs.clear()
            if progress is not None:
                progress(b + 1, len(batches))
    finally:
        for h in handles:
            h.remove()
    return {sites[s]: st for s, st in stats.items()}
