r"""Block expansion of Hugging Face transformers: zero-output copies of layers (LLaMA-Pro).

:func:`expand_layers` inserts after each listed layer a copy of it whose output projections
and their biases are zero, so the copy adds exactly :math:`0` to the residual stream: a
zero-output residual insertion in the sense of ``def-family`` (theory/definitions.md).  Its
feature maps (attention, gate/up projections, norms) are the copied layer's, held at their
trained values; the zeroed maps are the tangent coordinates :math:`\theta`, so their gradient
at the origin is the criterion's :math:`b = E[g\,\phi^\top]` (T1, ``thm-gradient``) and the
other parameters of the copy get zero gradient (T5, ``thm-zero-output``).

Architectures are data (:data:`ARCHITECTURES`, one row per family, matched by
``config.model_type``): where the layer list lives, which parameters of a layer are its residual
output projections (``fnmatch`` patterns: every expert's and the shared expert's down projection
in a mixture of experts), and which config lists follow the layers.  Rows: Llama-like decoders
(Llama, SmolLM2, Qwen2/3, Mistral, Gemma, StableLM, OLMo), Gemma-2/3, Starcoder2, Mixtral,
Qwen2/3-MoE, GPT-NeoX (Pythia), Phi, OPT, Falcon, GPT-2 and BERT.  Any other model with a layer
list is grown when :func:`discover_zeroed` finds parameters whose zeroing makes each copied layer
the identity on a random input, and refused in one line when none do.  Post-LN layers (BERT, OPT
with ``do_layer_norm_before=False``) have a LayerNorm after each residual sum, so a zeroed copy
computes ``LN(LN(x)) ≠ x``: the function-preservation check refuses them with that explanation;
use :func:`~depthsat_theory.grow.insert_blocks` there.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from depthsat_theory.capture.insertion import first_output
from depthsat_theory.capture.probe import call_model
from depthsat_theory.grow._check import check_preserved, reference_output
from depthsat_theory.grow.errors import GrowError

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "Expansion",
    "discover_zeroed",
    "drop_gguf_marker",
    "expand_layers",
    "find_architecture",
    "load_grown",
    "resolve_architecture",
    "zeroed_names",
]


@dataclass(frozen=True)
class Architecture:
    """A family of Hugging Face models that :func:`expand_layers` can grow, as data (one row of :data:`ARCHITECTURES`).

    Attributes:
        name: its name in messages.
        model_types: the ``config.model_type`` values of the family (the row is matched by them).
        layer_lists: where the layer ``nn.ModuleList`` lives, tried in order (per model class).
        zeroed: the residual output projections of a layer: ``fnmatch`` patterns of parameter names
            relative to the layer (weights, biases, every expert's and the shared expert's), zeroed in the copy.
        post_ln: whether a LayerNorm follows the residual sum (then a zeroed copy is not the identity).
        pre_ln_flag: a config flag that is false for the post-LN variant of the family (OPT's
            ``do_layer_norm_before``); ``""`` when there is none.
        per_layer: config lists with one entry per layer (``layer_types``): the copy's entry is duplicated.
        index_lists: config lists of layer indices (Qwen2-MoE's ``mlp_only_layers``): renumbered.
        sparse_step: a config field ``s`` that makes every ``s``-th layer sparse (``decoder_sparse_step``);
            when ``s > 1`` the dense layers are listed explicitly in ``index_lists[0]`` and ``s`` set to 1.
        gated: ``(projection, gate)`` module names relative to the layer: the projection's output reaches
            the stream scaled per token by ``sigmoid(gate(h))`` (Qwen2-MoE's shared expert), so its features
            for the copy's own score are its input times that gate (:mod:`~depthsat_theory.grow.copyscore`).
    """

    name: str
    model_types: tuple[str, ...]
    layer_lists: tuple[str, ...]
    zeroed: tuple[str, ...]
    post_ln: bool = False
    pre_ln_flag: str = ""
    per_layer: tuple[str, ...] = ("layer_types",)
    index_lists: tuple[str, ...] = ()
    sparse_step: str = ""
    gated: tuple[tuple[str, str], ...] = ()

    def is_post_ln(self, config: Any) -> bool:
        """Whether this model's layers are post-LN (a LayerNorm after each residual sum).

        Args:
            config: the model's config.

        Returns:
            ``post_ln``, or the negation of the config's ``pre_ln_flag`` when the row has one.
        """
        return self.post_ln or bool(self.pre_ln_flag and not getattr(config, self.pre_ln_flag, True))


_ATTN_MLP = ("self_attn.o_proj.*", "mlp.down_proj.*")
ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        "Llama-like decoder (Llama, SmolLM2, Qwen2, Qwen3, Mistral, Gemma, StableLM, OLMo)",
        ("llama", "qwen2", "qwen3", "mistral", "gemma", "stablelm", "olmo", "olmo2", "granite", "cohere"),
        ("model.layers", "layers"),
        _ATTN_MLP,
    ),
    Architecture("Gemma-2/3 (sandwich norms)", ("gemma2", "gemma3_text"), ("model.layers", "layers"), _ATTN_MLP),
    Architecture("Starcoder2", ("starcoder2",), ("model.layers", "layers"), ("self_attn.o_proj.*", "mlp.c_proj.*")),
    Architecture(
        "Mixtral (mixture of experts)",
        ("mixtral",),
        ("model.layers", "layers"),
        ("self_attn.o_proj.*", "mlp.experts.down_proj", "mlp.experts.*.w2.*"),
    ),
    Architecture(
        "Qwen2-MoE / Qwen3-MoE (mixture of experts with a shared expert)",
        ("qwen2_moe", "qwen3_moe"),
        ("model.layers", "layers"),
        (*_ATTN_MLP, "mlp.experts.down_proj", "mlp.experts.*.down_proj.*", "mlp.shared_expert.down_proj.*"),
        index_lists=("mlp_only_layers",),
        sparse_step="decoder_sparse_step",
        gated=(("mlp.shared_expert.down_proj", "mlp.shared_expert_gate"),),
    ),
    Architecture(
        "GPT-NeoX (Pythia)",
        ("gpt_neox",),
        ("gpt_neox.layers", "layers"),
        ("attention.dense.*", "mlp.dense_4h_to_h.*"),
    ),
    Architecture("Phi", ("phi",), ("model.layers", "layers"), ("self_attn.dense.*", "mlp.fc2.*")),
    Architecture(
        "OPT",
        ("opt",),
        ("model.decoder.layers", "decoder.layers"),
        ("self_attn.out_proj.*", "fc2.*"),
        pre_ln_flag="do_layer_norm_before",
    ),
    Architecture("Falcon", ("falcon",), ("transformer.h", "h"), ("self_attention.dense.*", "mlp.dense_4h_to_h.*")),
    Architecture("GPT-2", ("gpt2",), ("transformer.h", "h"), ("attn.c_proj.*", "mlp.c_proj.*")),
    Architecture(
        "BERT (BertModel, BertFor*)",
        ("bert",),
        ("bert.encoder.layer", "encoder.layer"),
        ("attention.output.dense.*", "output.dense.*"),
        post_ln=True,
    ),
)
"""The architectures :func:`expand_layers` knows, matched by ``config.model_type`` (:func:`find_architecture`);
any other model with a layer list goes through :func:`discover_zeroed` (the generic fallback)."""

_FALLBACK = "use depthsat_theory.grow.insert_blocks(model, {site: family}, probe=batch), which grows any nn.Module"


@dataclass
class Expansion:
    """The result of :func:`expand_layers`.

    Attributes:
        model: the grown model (a copy unless ``inplace``), in the original's train/eval mode.
        architecture: the matched :class:`Architecture` (for a discovered one, ``zeroed`` are the
            discovered parameter names of the first copied layer).
        layer_list: the module name of the layer list (``"model.layers"``, ...).
        positions: the original indices copied, ascending.
        new_indices: the indices of the new layers in the grown model, one per position.
        new_params: the new layers' parameters by site (``"model.layers.3"``), in
            ``named_parameters()`` order: what to add to an optimizer.
        zeroed: the zeroed parameters by site (the tangent coordinates ``θ``), named as in the grown model.
        deviation: ``max |f(x) − f_grown(x)|`` on the probe batch (output units, e.g. logits).
        tolerance: the allowed deviation (``64 u max(1, max |f(x)|)``).
        start: ``init="first-order"``: the :class:`~depthsat_theory.grow.start.FirstOrderStart`
            (step, gradient norm, line search); ``None`` for zero-output copies.
    """

    model: nn.Module
    architecture: Architecture
    layer_list: str
    positions: list[int]
    new_indices: list[int]
    new_params: dict[str, list[nn.Parameter]] = field(default_factory=dict)
    zeroed: dict[str, list[str]] = field(default_factory=dict)
    deviation: float = 0.0
    tolerance: float = 0.0
    start: Any = None

    @property
    def sites(self) -> list[str]:
        """Module names of the new layers."""
        return list(self.new_params)


def _layer_list(model: nn.Module, paths: Sequence[str]) -> str | None:
    for path in paths:
        try:
            layers = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(layers, nn.ModuleList) and len(layers):
            return path
    return None


def _largest_layer_list(model: nn.Module) -> str | None:
    """The module name of the longest ``nn.ModuleList`` whose length is ``config.num_hidden_layers``."""
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    best, size = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > size and (n is None or len(mod) == n):
            best, size = name, len(mod)
    return best


def _layers(model: nn.Module, path: str) -> nn.ModuleList:
    layers = model.get_submodule(path)
    if not isinstance(layers, nn.ModuleList):
        raise GrowError(f"{path} is a {type(layers).__name__}, not the nn.ModuleList of layers; {_FALLBACK}")
    return layers


def zeroed_names(layer: nn.Module, patterns: Sequence[str]) -> list[str]:
    """The parameter names of ``layer`` (relative) that match any of ``patterns`` (``fnmatch``), in order.

    Args:
        layer: one layer of the layer list.
        patterns: :attr:`Architecture.zeroed`.

    Returns:
        The matching names in ``named_parameters()`` order.
    """
    return [n for n, _ in layer.named_parameters() if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def find_architecture(model: nn.Module) -> tuple[Architecture, str]:
    """The known architecture of ``model`` (by ``config.model_type``) and the name of its layer list.

    Args:
        model: the model to match against :data:`ARCHITECTURES`.

    Returns:
        ``(architecture, path)``: the row whose ``model_types`` has ``config.model_type`` and whose
        layer list at ``path`` (e.g. ``"model.layers"``) is a non-empty ``nn.ModuleList`` whose first
        layer has a parameter the row zeroes.

    Raises:
        GrowError: no row matches (the message names the known families; :func:`expand_layers`
            then tries :func:`discover_zeroed`).
    """
    mtype = getattr(getattr(model, "config", None), "model_type", None)
    for arch in ARCHITECTURES:
        if mtype not in arch.model_types:
            continue
        path = _layer_list(model, arch.layer_lists)
        if path is not None and zeroed_names(_layers(model, path)[0], arch.zeroed):
            return arch, path
    names = "; ".join(a.name for a in ARCHITECTURES)
    raise GrowError(f"{type(model).__name__} (model_type {mtype!r}) is not in the architecture table ({names})")


def _layer_call(model: nn.Module, layer: nn.Module, probe: Any) -> tuple[tuple, dict]:
    """The positional and keyword arguments of ``layer``'s call during a forward pass of ``model`` on ``probe``."""
    seen: dict[str, Any] = {}

    def pre(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.setdefault("call", (args, dict(kwargs)))

    h = layer.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad():
            call_model(model, probe)
    finally:
        h.remove()
    if "call" not in seen:
        raise GrowError(f"the layer {type(layer).__name__} was not called on the probe batch; {_FALLBACK}")
    return seen["call"]


def _residual_input(args: tuple, kwargs: dict) -> Tensor:
    x = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(x, Tensor):
        raise GrowError(f"the layer's first input is not a tensor (got {type(x).__name__}); {_FALLBACK}")
    return x


def _is_identity(layer: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> bool:
    if args:
        args = (x, *args[1:])
    else:
        kwargs = {**kwargs, "hidden_states": x}
    with torch.no_grad():
        out = first_output(layer(*args, **kwargs))
    return out.shape == x.shape and torch.equal(out, x)


def discover_zeroed(model: nn.Module, layer_index: int, path: str, probe: Any) -> list[str]:
    """The residual output projections of a layer, found by making it the identity (generic fallback).

    The layer is called on a random input (standard normal, seed 0, the shape of its input on
    ``probe``) with the keyword arguments it gets on ``probe`` (masks, rotary embeddings).  First
    every parameter is zeroed (the layer must then be the identity ``x ↦ x``: exactly equal
    outputs); then each parameter gets its value back unless that breaks the identity: first the
    one-dimensional non-bias parameters (norm scales), then the others in definition order (input
    side first, so that an input projection is restored before the output projection it feeds).
    The parameters left at zero are a minimal set whose zeroing makes the layer the
    identity: on a pre-LN residual layer, the output projections and their biases.

    Args:
        model: a Hugging Face model (or any model ``probe`` can be fed to).
        layer_index: which layer of the list.
        path: the module name of the layer list.
        probe: a batch ``model`` accepts.

    Returns:
        The zeroed parameter names, relative to the layer, in ``named_parameters()`` order.

    Raises:
        GrowError: the layer is not the identity even with every parameter zeroed (post-LN, or not a
            residual layer), or it was not called on the probe.
    """
    layer = _layers(model, path)[layer_index]
    args, kwargs = _layer_call(model, layer, probe)
    x0 = _residual_input(args, kwargs)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(x0.shape, generator=gen, dtype=torch.float64).to(x0)
    trial = copy.deepcopy(layer)
    params = dict(trial.named_parameters())
    saved = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for p in params.values():
            p.zero_()
    if not _is_identity(trial, x, args, kwargs):
        raise GrowError(
            f"{path}.{layer_index} ({type(layer).__name__}) is not the identity even with every parameter zeroed "
            f"(a post-LN or non-residual layer): no zero-output copy exists; {_FALLBACK}"
        )
    keep = []
    scales = [n for n, p in params.items() if p.dim() == 1 and not n.endswith("bias")]  # norm scales first
    for name in scales + [n for n in params if n not in scales]:
        with torch.no_grad():
            params[name].copy_(saved[name])
        if not _is_identity(trial, x, args, kwargs):
            with torch.no_grad():
                params[name].zero_()
            keep.append(name)
    return [n for n in params if n in keep]


def _check_positions(positions: Sequence[int], n_layers: int) -> list[int]:
    out = []
    for p in positions:
        if isinstance(p, bool) or not isinstance(p, int):
            raise GrowError(f"positions must be layer indices (int), got {p!r}")
        if not 0 <= p < n_layers:
            raise GrowError(f"position {p} is outside the layer list: valid original indices are 0..{n_layers - 1}")
        out.append(p)
    if not out:
        raise GrowError("positions is empty: give at least one layer index")
    if len(set(out)) != len(out):
        raise GrowError(f"positions {list(positions)} repeat an index; give each layer at most once")
    return sorted(out)


def _zero_output_copy(layer: nn.Module, zeroed: Sequence[str]) -> nn.Module:
    new = copy.deepcopy(layer)
    params = dict(new.named_parameters())
    with torch.no_grad():
        for name in zeroed:
            params[name].zero_()
    mod: Any
    for mod in new.modules():  # transformers' initialisation skips flagged modules and parameters
        mod._is_hf_initialized = True
        for p in mod.parameters(recurse=False):
            p._is_hf_initialized = True
    return new


def _renumber(layers: nn.ModuleList) -> None:
    """Set every ``layer_idx`` attribute inside layer ``i`` to ``i`` (the KV cache is indexed by it)."""
    mod: Any
    for i, layer in enumerate(layers):
        for mod in layer.modules():
            if isinstance(getattr(mod, "layer_idx", None), int):
                mod.layer_idx = i


def _update_config(config: Any, arch: Architecture, origin: list[int], n_layers: int) -> None:
    """Config fields after the expansion; ``origin[j]`` is the original index of grown layer ``j``."""
    config.num_hidden_layers = len(origin)  # n_layer / num_layers through the config's attribute_map
    for name in arch.per_layer:
        vals = getattr(config, name, None)
        if isinstance(vals, (list, tuple)) and len(vals) == n_layers:
            setattr(config, name, type(vals)(vals[o] for o in origin))
    step = int(getattr(config, arch.sparse_step, 1) or 1) if arch.sparse_step else 1
    if step > 1 and arch.index_lists:
        dense = set(getattr(config, arch.index_lists[0], None) or [])
        setattr(config, arch.index_lists[0], sorted(dense | {i for i in range(n_layers) if (i + 1) % step}))
        setattr(config, arch.sparse_step, 1)
    for name in arch.index_lists:
        idx = getattr(config, name, None)
        if isinstance(idx, (list, tuple)):
            setattr(config, name, [j for j, o in enumerate(origin) if o in set(idx)])


def _default_probe(model: nn.Module, config: Any) -> dict:
    vocab = int(getattr(config, "vocab_size", 2) or 2)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 8), generator=gen)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}


def _refuse_layer_scaled(config: Any) -> None:
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        raise GrowError(
            "config.scale_attn_by_inverse_layer_idx is set: renumbering layer_idx would rescale the attention of "
            f"every later layer, so the growth cannot preserve the function; {_FALLBACK}"
        )


def _check_init(init: str, loss_fn: Any, batch: Any, held_out: Any) -> None:
    if init not in ("zero-output-copy", "first-order"):
        raise GrowError(f"unknown init {init!r}; use 'zero-output-copy' or 'first-order'")
    if init == "first-order" and (loss_fn is None or batch is None or held_out is None):
        raise GrowError("init='first-order' needs loss_fn, batch (for the gradient) and held_out (for the line search)")


def _zeroed_by_position(model: nn.Module, arch: Architecture, path: str, pos: list[int], probe: Any) -> dict:
    """The zeroed parameter names (relative) of each copied layer: the table's patterns, or discovered."""
    layers = _layers(model, path)
    discovered = arch.name.endswith("(discovered)")
    names = {
        i: discover_zeroed(model, i, path, probe) if discovered else zeroed_names(layers[i], arch.zeroed) for i in pos
    }
    for i, found in names.items():
        if not found:
            raise GrowError(f"{path}.{i} has no parameter matching {list(arch.zeroed)}; {_FALLBACK}")
    return names


def resolve_architecture(model: nn.Module, probe: Any = None) -> tuple[Architecture, str]:
    """The :data:`ARCHITECTURES` row of ``model``, or one discovered by :func:`discover_zeroed`.

    Args:
        model: a Hugging Face model.
        probe: a batch for the discovery (default: 2 × 8 random token ids, seed 0).

    Returns:
        ``(architecture, path)``; a discovered row is named ``"<Class> (discovered)"`` and zeroes the
        names found on layer 0 (each copied layer is searched again by :func:`expand_layers`).

    Raises:
        GrowError: no ``.config``, no layer list of ``config.num_hidden_layers`` layers, or a layer
            that no zeroing makes the identity.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise GrowError(f"{type(model).__name__} has no .config: not a Hugging Face model; {_FALLBACK}")
    try:
        return find_architecture(model)
    except GrowError as exc:
        path = _largest_layer_list(model)
        if path is None:
            raise GrowError(f"{exc}, and it has no layer list (nn.ModuleList) to grow; {_FALLBACK}") from None
    if probe is None:
        probe = _default_probe(model, config)
    names = discover_zeroed(model, 0, path, probe)
    mtype = str(getattr(config, "model_type", ""))
    return Architecture(f"{type(model).__name__} (discovered)", (mtype,), (path,), tuple(names)), path


def expand_layers(
    model: nn.Module,
    positions: Sequence[int],
    *,
    init: str = "zero-output-copy",
    probe: Any = None,
    inplace: bool = False,
    loss_fn: Any = None,
    batch: Any = None,
    held_out: Any = None,
) -> Expansion:
    r"""Insert a zero-output copy of layer ``i`` after each original layer ``i`` in ``positions`` (LLaMA-Pro).

    The copy's residual output projections (:attr:`Architecture.zeroed`: Llama ``self_attn.o_proj``
    and ``mlp.down_proj``, every expert's and the shared expert's down projection in a mixture of
    experts, ...) and their biases are zero, so on a pre-LN (or parallel) residual stream it adds
    exactly zero:

    .. math::

        x \mapsto x + W_o\,\mathrm{attn}(x) + W_d\,\phi(\cdot) = x \quad (W_o = W_d = 0).

    A model whose ``config.model_type`` is not in :data:`ARCHITECTURES` is grown when
    :func:`discover_zeroed` finds, for each copied layer, parameters whose zeroing makes it the identity.
    Every ``layer_idx`` is renumbered (the KV cache is indexed by it), ``config.num_hidden_layers``,
    the per-layer lists (``layer_types``) and layer-index lists (``mlp_only_layers``) are updated, and
    the new modules and parameters are flagged ``_is_hf_initialized`` so that ``post_init()`` /
    ``from_pretrained`` do not re-randomise them.  The grown model round-trips through
    ``save_pretrained`` / ``from_pretrained``; a model read from a GGUF file (de-quantized to float by
    transformers, as SmolLM2 in the zoo) loses its GGUF marker (:func:`drop_gguf_marker`), so that it
    can be trained and saved.

    Args:
        model: a Hugging Face model; not modified unless ``inplace``.
        positions: original layer indices (``0 ≤ i < num_hidden_layers``), each at most once.
        init: ``"zero-output-copy"``, or ``"first-order"``: then the copies' zeroed parameters start
            at the steepest step ``−t GΣ⁺/‖Πg‖`` (the field ``−t Πg/‖Πg‖``, ``Πg`` the activation
            gradient's projection on the copies' tangent space, on ``batch``) with ``t`` from a line search on
            ``held_out`` that includes ``t = 0`` (:func:`~depthsat_theory.grow.start.first_order_start`);
            the function-preservation check is made at ``t = 0``, before the step.
        probe: a keyword batch (``{"input_ids": (B, T) long, ...}``) for the function-preservation
            check and the discovery; default: 2 × 8 random token ids (seed 0).
        inplace: grow ``model`` itself (its parameters stay the same objects, so an existing
            optimizer stays valid for them).
        loss_fn: ``init="first-order"`` only: the per-example loss ``loss_fn(output, targets) -> (B,)``.
        batch: ``init="first-order"`` only: the batch of the gradient ``b``.
        held_out: ``init="first-order"`` only: the batch of the line search.

    Returns:
        An :class:`Expansion`: the grown model, the new layers' parameters by site, the zeroed
        parameters, the measured output deviation (logit units) and its tolerance.

    Raises:
        GrowError: no ``.config`` or layer list, a layer that no zeroing makes the identity (one
            line, naming the :func:`~depthsat_theory.grow.insert_blocks` fallback), a position outside
            the layer list, a repeated position, an unknown ``init``, or a GPT-2 config with
            ``scale_attn_by_inverse_layer_idx``.
        NotFunctionPreservingError: the grown model's output moved on the probe by more than the
            dtype-scaled tolerance (always for post-LN layers: ``LN(LN(x)) ≠ x``).

    Source: LLaMA-Pro block expansion (Wu et al., 2024, sec. 3.2); the zero-output insertion of
    theory/definitions.md (``def-family``), T1 and T5.
    """
    _check_init(init, loss_fn, batch, held_out)
    config = getattr(model, "config", None)
    if probe is None and config is not None:
        probe = _default_probe(model, config)
    arch, path = resolve_architecture(model, probe)
    _refuse_layer_scaled(config)
    layers = model.get_submodule(path)
    assert isinstance(layers, nn.ModuleList)
    n_layers = len(layers)
    pos = _check_positions(positions, n_layers)
    names = _zeroed_by_position(model, arch, path, pos, probe)
    ref = reference_output(model, probe)
    grown = model if inplace else copy.deepcopy(model)
    glayers = grown.get_submodule(path)
    assert isinstance(glayers, nn.ModuleList)
    old = list(glayers)
    new_list: list[nn.Module] = []
    new_indices: list[int] = []
    origin: list[int] = []
    for i, layer in enumerate(old):
        new_list.append(layer)
        origin.append(i)
        if i in pos:
            new_list.append(_zero_output_copy(layer, names[i]))
            new_indices.append(len(new_list) - 1)
            origin.append(i)
    for i in range(len(glayers) - 1, -1, -1):
        del glayers[i]
    glayers.extend(new_list)
    _renumber(glayers)
    _update_config(grown.config, arch, origin, n_layers)
    drop_gguf_marker(grown)
    exp = Expansion(grown, arch, path, pos, new_indices)
    for i, j in zip(pos, new_indices, strict=True):
        site = f"{path}.{j}"
        exp.new_params[site] = list(glayers[j].parameters())
        exp.zeroed[site] = [f"{site}.{n}" for n in names[i]]
    why = (
        f": {arch.name} layers are post-LN (a LayerNorm after each residual sum), so a copy with zeroed output "
        f"projections computes LN(LN(x)) != x; {_FALLBACK}"
        if arch.is_post_ln(config)
        else ""
    )
    exp.deviation, exp.tolerance = check_preserved(ref, grown, probe, why)
    if init == "first-order":
        from depthsat_theory.grow.start import first_order_start

        exp.start = first_order_start(grown, exp.zeroed, loss_fn, batch, held_out, gated=arch.gated)
    return exp


def drop_gguf_marker(model: nn.Module) -> None:
    """Forget that a model was read from a GGUF file: its weights were de-quantized to plain float tensors.

    transformers keeps a GGUF "quantizer" on such a model and refuses ``save_pretrained``; the
    parameters are ordinary float tensors, so the model is saved as an unquantized one.

    Args:
        model: a transformers model, changed in place (nothing happens unless its
            ``hf_quantizer`` is a GGUF one).
    """
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if quantizer is None or str(getattr(method, "value", method)).lower() != "gguf":
        return
    hf: Any = model
    hf.hf_quantizer = None
    hf.is_quantized = False
    config: Any = getattr(model, "config", None)
    if hasattr(config, "quantization_config"):
        del config.quantization_config


def load_grown(path: str | Path, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Reload a grown Hugging Face model written by ``save_pretrained`` (e.g. by ``depthsat grow``).

    Args:
        path: the model folder (``config.json`` and ``model.safetensors``).
        dtype: the parameters' dtype.

    Returns:
        The model (``AutoModelForCausalLM`` when the config names a causal LM, else ``AutoModel``), eval mode.

    Raises:
        GrowError: ``path`` is not a folder, or not a Hugging Face model folder (no or unreadable ``config.json``,
            no weights).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise GrowError(f"{folder} is not a folder; give the folder written by save_pretrained")
    if not (folder / "config.json").is_file():
        raise GrowError(f"{folder} is not a model folder (no config.json); save one with model.save_pretrained(folder)")
    if not any(folder.glob("*.safetensors")):
        raise GrowError(f"{folder} has a config.json but no *.safetensors weights; it is not a saved model")
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise GrowError(f"{folder}/config.json is not a Hugging Face config ({type(exc).__name__}: {exc})") from None
    archs = getattr(config, "architectures", None) or []
    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    cls = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    model = cls.from_pretrained(str(folder), local_files_only=True, dtype=dtype)
    return model.eval()
