r"""Rank sites with the family that is inserted: the zero-output layer copy's own tangent space.

A zero-output copy of layer ``i`` (:func:`~depthsat_theory.grow.hf.expand_layers`) adds
:math:`\sum_m W_m \varphi_m(h)` (plus the zeroed biases) to the stream, where :math:`W_m` are its
zeroed output projections and :math:`\varphi_m` the features they see, computed by the copy's own
attention and MLP at the origin.  It is the feature family with features
:math:`\tilde\varphi = (\varphi_1, \varphi_2, \dots, 1)` (``thm-cross-gradient``), so its score is
:math:`s^2 = \operatorname{tr}(G\Sigma^+G^\top)`, streamed by
:class:`~depthsat_theory.statistics.FeatureStatistics` like any feature family, with the same
noise test and rounding bound.  The features are read by hooks on the zeroed maps of a model grown
at every candidate site at once (each copy adds exactly zero, so each sees the original stream and
the original activation gradient).

The features of a zeroed map are what multiplies its weights on the way to the stream
(``rem-moe-copy-features``):

- a row-wise linear map (``nn.Linear``, GPT-2's ``Conv1D``): its input;
- the fused experts of a mixture of experts (transformers' experts layout: ``down_proj``
  ``(E, d, I)``): expert ``e``'s activation ``a_e(h)`` times its router weight ``w_e(h)`` (zero for
  the experts not routed to), for every expert: the copy adds :math:`\sum_e w_e(h) W_e a_e(h)`, and
  the router sees only ``h``, so at the zero state this is linear in the ``W_e`` with features
  ``w_e a_e`` (the routing is first-order fixed);
- a projection whose output is scaled per token by a gate (:attr:`Architecture.gated
  <depthsat_theory.grow.hf.Architecture.gated>`: Qwen2-MoE's shared expert, scaled by
  ``sigmoid(shared_expert_gate(h))``): its input times the gate.

On the first batch the features are checked against T1: ``Σ_rows g φᵀ`` must equal autograd's
gradient of the zeroed maps; a copy whose maps reach the stream through a factor the table does
not declare fails that check and is refused in one line, rather than scored with wrong features.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from depthsat_theory.capture.insertion import first_output
from depthsat_theory.capture.probe import call_model, unpack_batch
from depthsat_theory.families.base import FeatureFamily, to_rows
from depthsat_theory.grow.errors import GrowError
from depthsat_theory.vocabulary import Layout

__all__ = ["copy_scores", "copy_statistics", "zeroed_statistics"]


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


_EXPERT_FLAGS = ("num_experts", "down_proj", "act_fn")


@dataclass
class ZeroedMap:
    """One zeroed map of a copy: its kind, its zeroed parameters, and the features it saw in the last forward.

    Attributes:
        path: the module's name in the model.
        module: the module (``nn.Linear``, ``Conv1D``, or fused experts).
        kind: ``"linear"`` (weight ``(d, k)``), ``"conv1d"`` (weight ``(k, d)``) or ``"experts"``
            (``down_proj`` ``(E, d, I)``, or ``(E, I, d)`` when ``is_transposed``).
        params: the zeroed parameters by leaf name (``weight``, ``bias``, ``down_proj``).
        width: the number of feature columns (``k``, or ``E·I``).
        gate: the module whose ``sigmoid`` output scales this map's output per token (``Architecture.gated``).
    """

    path: str
    module: nn.Module
    kind: str
    params: dict[str, nn.Parameter]
    width: int
    gate: nn.Module | None = None
    seen: dict[str, Tensor] = field(default_factory=dict)

    @property
    def weight(self) -> nn.Parameter | None:
        """The zeroed weight (``None`` when only the bias is zeroed)."""
        return self.params.get("down_proj" if self.kind == "experts" else "weight")

    def hooks(self) -> list:
        """Register the hooks that keep this map's features (and its gate) during a forward; returns the handles."""
        handles = [self.module.register_forward_pre_hook(self._keep, with_kwargs=True)]
        if self.gate is not None:
            handles.append(self.gate.register_forward_hook(self._keep_gate))
        return handles

    def _keep(self, _m: nn.Module, args: tuple, kwargs: dict) -> None:
        with torch.no_grad():
            if self.kind == "experts":
                self.seen["phi"] = _expert_features(self.module, *args, *kwargs.values())
            else:
                self.seen["phi"] = (args[0] if args else next(iter(kwargs.values()))).detach()

    def _keep_gate(self, _m: nn.Module, _a: tuple, out: Any) -> None:
        self.seen["gate"] = torch.sigmoid(first_output(out).detach())

    def features(self, lead: torch.Size) -> Tensor:
        """The features of the last forward, ``(*lead, width)`` float64 (times the gate when there is one)."""
        phi = self.seen["phi"].to(torch.float64).reshape(*lead, self.width)
        if self.gate is not None:
            phi = phi * self.seen["gate"].to(torch.float64).reshape(*lead, 1)
        return phi

    def block(self, weight: Tensor) -> Tensor:
        """A weight-shaped tensor (value or gradient) as the ``(d, width)`` block of ``G``'s layout."""
        if self.kind == "linear":
            return weight
        if self.kind == "conv1d":
            return weight.T
        n_exp = weight.shape[0]
        if getattr(self.module, "is_transposed", False):  # (E, I, d)
            return weight.permute(2, 0, 1).reshape(weight.shape[2], -1)
        return weight.permute(1, 0, 2).reshape(weight.shape[1], n_exp * weight.shape[2])

    def unblock(self, mat: Tensor) -> Tensor:
        """The inverse of :meth:`block`: a ``(d, width)`` block as a tensor shaped like the weight."""
        w = self.weight
        assert w is not None
        if self.kind == "linear":
            return mat.reshape(w.shape)
        if self.kind == "conv1d":
            return mat.T.reshape(w.shape)
        d = mat.shape[0]
        if getattr(self.module, "is_transposed", False):
            return mat.reshape(d, w.shape[0], w.shape[1]).permute(1, 2, 0)
        return mat.reshape(d, w.shape[0], w.shape[2]).permute(1, 0, 2)


def _expert_features(mod: nn.Module, hidden: Tensor, index: Tensor, weights: Tensor, *_: Any) -> Tensor:
    """``(N, E·I)``: expert ``e``'s activation times its router weight (zero where the token is not routed to it)."""
    m: Any = mod
    n, n_exp = hidden.shape[0], int(m.num_experts)
    w = torch.zeros(n, n_exp + 1, dtype=torch.float64, device=hidden.device)
    w.scatter_add_(1, index.long().clamp(max=n_exp), weights.to(torch.float64))
    up_w = m.gate_up_proj if m.has_gate else m.up_proj
    up = torch.einsum("nh,eho->neo" if m.is_transposed else "nh,eoh->neo", hidden, up_w)
    act = m._apply_gate(up.reshape(n * n_exp, -1)) if m.has_gate else m.act_fn(up)
    return (w[:, :n_exp, None] * act.reshape(n, n_exp, -1).to(torch.float64)).reshape(n, -1)


def _map_kind(mod: nn.Module, leaves: set[str], name: str) -> tuple[str, int]:
    kind = type(mod).__name__
    if kind in ("Linear", "Conv1D") and leaves <= {"weight", "bias"}:
        weight: Any = mod.weight
        return kind.lower(), int(weight.shape[1] if kind == "Linear" else weight.shape[0])
    m: Any = mod
    if all(hasattr(mod, a) for a in _EXPERT_FLAGS) and leaves == {"down_proj"} and m.down_proj.dim() == 3:
        extra = [f for f in ("has_bias", "has_post_expert_norm") if getattr(mod, f, False)]
        if not extra and hasattr(mod, "has_gate") and hasattr(mod, "is_transposed"):
            n_exp, a, b = m.down_proj.shape
            return "experts", n_exp * (a if m.is_transposed else b)
    raise GrowError(
        f"{name} is not the weight or bias of a row-wise linear map, nor the down projection of fused experts "
        f"without biases or post-expert norms ({kind}): the copy is not a feature family this module can read; "
        f"rank with --family linear"
    )


def zeroed_maps(
    model: nn.Module, site: str, zeroed: Sequence[str], gated: Sequence[tuple[str, str]] = ()
) -> tuple[list[ZeroedMap], bool]:
    """The zeroed maps of the copy at ``site`` in their order in ``zeroed``, and whether a bias is among them.

    Args:
        model: the grown model.
        site: the copy's module name (``"model.layers.1"``).
        zeroed: its zeroed parameter names (full names in ``model``).
        gated: ``(projection, gate)`` module names relative to the layer (:attr:`Architecture.gated`).

    Returns:
        ``(maps, bias)``.

    Raises:
        GrowError: a zeroed parameter that is not the weight or bias of a row-wise linear map, nor a fused
            experts' bias-free ``down_proj``.
    """
    by_path: dict[str, set[str]] = {}
    for name in zeroed:
        path, _, leaf = name.rpartition(".")
        by_path.setdefault(path, set()).add(leaf)
    gates = {f"{site}.{p}": f"{site}.{g}" for p, g in gated}
    maps = []
    for path, leaves in by_path.items():
        mod = model.get_submodule(path)
        kind, width = _map_kind(mod, leaves, f"{path}.{sorted(leaves)[0]}")
        gate = model.get_submodule(gates[path]) if path in gates else None
        params = {leaf: model.get_parameter(f"{path}.{leaf}") for leaf in leaves}
        maps.append(ZeroedMap(path, mod, kind, params, width, gate))
    return maps, any("bias" in m.params for m in maps)


def _check_features(site: str, maps: list[ZeroedMap], g: Tensor, lead: torch.Size, grads: Sequence[Tensor]) -> None:
    """T1 on one batch: ``Σ_rows g φᵀ`` equals autograd's gradient of each zeroed weight, or the copy is refused."""
    rows_g = g.detach().to(torch.float64).reshape(-1, g.shape[-1])
    for m, grad in zip([m for m in maps if m.weight is not None], grads, strict=True):
        phi = m.features(lead).reshape(-1, m.width)
        want = m.block(grad.detach().to(torch.float64))
        scale = rows_g.abs().T @ phi.abs()
        tol = float(torch.finfo(grad.dtype).eps) ** 0.5
        if bool(((rows_g.T @ phi - want).abs() > tol * (scale + 1e-3 * scale.max())).any()):
            raise GrowError(
                f"the features read at {m.path} do not give its gradient (T1) at the copy {site}: its output reaches "
                f"the stream through a factor the architecture table does not declare (Architecture.gated); "
                f"rank with --family linear"
            )


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
        GrowError: a copy whose zeroed parameters are neither row-wise linear maps nor fused experts'
            down projections, features that fail the T1 check, or a copy not at zero.
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
        ``{original site: FeatureStatistics}``; the copy's feature columns are its zeroed maps' features in
        the order of ``expansion.zeroed``, then the constant when a bias is zeroed.

    Raises:
        GrowError: as :func:`zeroed_statistics`.
    """
    sites = {
        f"{expansion.layer_list}.{j}": f"{expansion.layer_list}.{i}"
        for i, j in zip(expansion.positions, expansion.new_indices, strict=True)
    }
    gated = getattr(expansion.architecture, "gated", ())
    zeroed = {s: expansion.zeroed[s] for s in sites}
    stats = zeroed_statistics(expansion.model, zeroed, loss_fn, batches, gated=gated, progress=progress)
    return {sites[s]: st for s, st in stats.items()}


def _add_batch(
    stats: dict[str, Any], site: str, maps: list[ZeroedMap], bias: bool, out: Tensor, g: Tensor, mask: Any
) -> None:
    """Add one batch of the block at ``site`` to its :class:`FeatureStatistics` (created on the first batch)."""
    from depthsat_theory.statistics import FeatureStatistics

    phi = torch.cat([m.features(out.shape[:-1]) for m in maps], dim=-1)
    z = torch.cat([out.detach().to(torch.float64), phi], dim=-1)
    gz = torch.cat([g.to(torch.float64), torch.zeros_like(phi)], dim=-1)
    if site not in stats:
        fam = _CopyFeatures(g.shape[-1], phi.shape[-1], bias)
        stats[site] = FeatureStatistics(fam, tuple(z.shape[1:]), Layout.SEQUENCE)
    stats[site].update(z, gz, None if mask is None else mask.bool())


def _probe_batch(
    model: nn.Module, plan: dict, outs: dict[str, Tensor], loss_fn: Callable, batch: Any, first: bool, stats: dict
) -> None:
    """One probe batch: the blocks' activation gradients, the T1 check (first batch), the statistics' update."""
    x, y, _ = unpack_batch(batch)
    ell = loss_fn(call_model(model, x), y)
    weights: list[Tensor] = [w for maps, _ in plan.values() for m in maps if (w := m.weight) is not None]
    grads = torch.autograd.grad(ell.sum(), [outs[s] for s in plan] + (weights if first else []))
    mask = x.get("attention_mask") if isinstance(x, dict) else None
    k = len(plan)
    for site, g in zip(plan, grads[: len(plan)], strict=True):
        maps, bias = plan[site]
        if first:
            n_w = sum(m.weight is not None for m in maps)
            _check_features(site, maps, g, outs[site].shape[:-1], grads[k : k + n_w])
            k += n_w
        _add_batch(stats, site, maps, bias, outs[site], g, mask)


def zeroed_statistics(
    model: nn.Module,
    zeroed: Mapping[str, Sequence[str]],
    loss_fn: Callable,
    batches: Sequence,
    *,
    gated: Sequence[tuple[str, str]] = (),
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """The streamed statistics (``G``, ``Σ``) of zero-output blocks given by their zeroed maps, by block.

    Each block is a module whose output is the residual stream after it (a layer copy); its family is
    spanned by its zeroed maps' features (module docstring), read by hooks during the probe.

    Args:
        model: the model, its blocks at zero output.
        zeroed: ``{block module name: its zeroed parameter names}`` (full names in ``model``).
        loss_fn: per-example loss ``loss_fn(output, targets) -> (B,)``.
        batches: probe batches (Hugging Face mappings with ``attention_mask``, or ``(inputs, targets)``).
        gated: ``(projection, gate)`` module names relative to a block (:attr:`Architecture.gated`).
        progress: ``progress(done, total)`` after each batch.

    Returns:
        ``{block: FeatureStatistics}``: feature columns in the order of the block's zeroed maps, then the
        constant when a bias is zeroed.

    Raises:
        GrowError: a zeroed parameter that is not zero, nor the weight or bias of a row-wise linear map,
            nor a fused experts' ``down_proj``; features that do not give the zeroed weights' gradient (T1)
            on the first batch.

    Source: ``thm-cross-gradient`` (the family's ``G`` and ``Σ``), ``rem-moe-copy-features``.
    """
    if any(bool(model.get_parameter(n).detach().any()) for ns in zeroed.values() for n in ns):
        raise GrowError("the copies are not at zero output: score them right after expand_layers")
    plan = {site: zeroed_maps(model, site, names, gated) for site, names in zeroed.items()}
    outs: dict[str, Tensor] = {}
    handles = [m for maps, _ in plan.values() for mp in maps for m in mp.hooks()]

    def out_hook(_m: nn.Module, _a: tuple, out: Any, site: str) -> None:
        outs[site] = first_output(out)

    for site in plan:
        handles.append(model.get_submodule(site).register_forward_hook(lambda m, a, o, s=site: out_hook(m, a, o, s)))
    stats: dict[str, Any] = {}
    try:
        for b, batch in enumerate(batches):
            _probe_batch(model, plan, outs, loss_fn, batch, b == 0, stats)
            outs.clear()
            if progress is not None:
                progress(b + 1, len(batches))
    finally:
        for h in handles:
            h.remove()
    return stats
