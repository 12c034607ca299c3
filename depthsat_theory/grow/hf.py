r"""Block expansion of Hugging Face transformers: zero-output copies of layers (LLaMA-Pro).

:func:`expand_layers` inserts after each listed layer a copy of it whose output projections
and their biases are zero, so the copy adds exactly :math:`0` to the residual stream: a
zero-output residual insertion in the sense of ``def-family`` (theory/definitions.md).  Its
feature maps (attention, gate/up projections, norms) are the copied layer's, held at their
trained values; the zeroed maps are the tangent coordinates :math:`\theta`, so their gradient
at the origin is the criterion's :math:`b = E[g\,\phi^\top]` (T1, ``thm-gradient``) and the
other parameters of the copy get zero gradient (T5, ``thm-zero-output``).

Supported (:data:`ARCHITECTURES`): Llama-like decoders (``LlamaForCausalLM``, SmolLM2, and any
model whose layers have ``self_attn.o_proj`` and ``mlp.down_proj``), GPT-2
(``GPT2LMHeadModel``, ``GPT2Model``), BERT (``BertModel``, ``BertFor*``).  BERT's layers are
post-LN (a LayerNorm after each residual sum), so a zeroed copy computes ``LN(LN(x)) ≠ x``:
the expansion is refused by the function-preservation check with that explanation; use
:func:`~depthsat_theory.grow.insert_blocks` there.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from depthsat_theory.grow._check import check_preserved, reference_output
from depthsat_theory.grow.errors import GrowError

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "Expansion",
    "drop_gguf_marker",
    "expand_layers",
    "find_architecture",
    "load_grown",
]


@dataclass(frozen=True)
class Architecture:
    """A family of Hugging Face models that :func:`expand_layers` can grow.

    Attributes:
        name: its name in messages.
        layer_lists: where the layer ``nn.ModuleList`` lives, tried in order (per model class).
        zeroed: the output projections of a layer (relative module names) zeroed in the copy.
        post_ln: whether a LayerNorm follows the residual sum (then a zeroed copy is not the identity).
    """

    name: str
    layer_lists: tuple[str, ...]
    zeroed: tuple[str, ...]
    post_ln: bool = False


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        "Llama-like decoder (LlamaForCausalLM, SmolLM2)",
        ("model.layers", "layers"),
        ("self_attn.o_proj", "mlp.down_proj"),
    ),
    Architecture("GPT-2 (GPT2LMHeadModel, GPT2Model)", ("transformer.h", "h"), ("attn.c_proj", "mlp.c_proj")),
    Architecture(
        "BERT (BertModel, BertFor*)",
        ("bert.encoder.layer", "encoder.layer"),
        ("attention.output.dense", "output.dense"),
        post_ln=True,
    ),
)
"""The supported architectures, matched by :func:`find_architecture`."""

_FALLBACK = "use depthsat_theory.grow.insert_blocks(model, {site: family}, probe=batch), which grows any nn.Module"


@dataclass
class Expansion:
    """The result of :func:`expand_layers`.

    Attributes:
        model: the grown model (a copy unless ``inplace``), in the original's train/eval mode.
        architecture: the matched :class:`Architecture`.
        layer_list: the module name of the layer list (``"model.layers"``, ...).
        positions: the original indices copied, ascending.
        new_indices: the indices of the new layers in the grown model, one per position.
        new_params: the new layers' parameters by site (``"model.layers.3"``), in
            ``named_parameters()`` order: what to add to an optimizer.
        zeroed: the zeroed parameters by site (the tangent coordinates ``θ``), named as in the grown model.
        deviation: ``max |f(x) − f_grown(x)|`` on the probe batch (output units, e.g. logits).
        tolerance: the allowed deviation (``64 u max(1, max |f(x)|)``).
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

    @property
    def sites(self) -> list[str]:
        """Module names of the new layers."""
        return list(self.new_params)


def find_architecture(model: nn.Module) -> tuple[Architecture, str]:
    """The supported architecture of ``model`` and the name of its layer list.

    Args:
        model: the model to match against :data:`ARCHITECTURES`.

    Returns:
        ``(architecture, path)``: the first :class:`Architecture` whose layer list at ``path``
        (e.g. ``"model.layers"``) is a non-empty ``nn.ModuleList`` whose first layer has all the
        modules it zeroes.

    Raises:
        GrowError: for any other model (the message names the supported ones and the fallback).
    """
    for arch in ARCHITECTURES:
        for path in arch.layer_lists:
            try:
                layers = model.get_submodule(path)
            except AttributeError:
                continue
            if isinstance(layers, nn.ModuleList) and len(layers) and _has_all(layers[0], arch.zeroed):
                return arch, path
    names = "; ".join(a.name for a in ARCHITECTURES)
    raise GrowError(f"expand_layers does not support {type(model).__name__} (supported: {names}); {_FALLBACK}")


def _has_all(layer: nn.Module, names: Sequence[str]) -> bool:
    try:
        return all(isinstance(layer.get_submodule(n), nn.Module) for n in names)
    except AttributeError:
        return False


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
    with torch.no_grad():
        for name in zeroed:
            for p in new.get_submodule(name).parameters(recurse=False):
                p.zero_()
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


def _update_config(config: Any, positions: list[int], n_layers: int) -> None:
    config.num_hidden_layers = n_layers + len(positions)
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) == n_layers:
        new = []
        for i, t in enumerate(types):
            new.append(t)
            if i in positions:
                new.append(t)
        config.layer_types = type(types)(new)


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


def expand_layers(
    model: nn.Module,
    positions: Sequence[int],
    *,
    init: str = "zero-output-copy",
    probe: Any = None,
    inplace: bool = False,
) -> Expansion:
    r"""Insert a zero-output copy of layer ``i`` after each original layer ``i`` in ``positions`` (LLaMA-Pro).

    The copy's output projections (Llama ``self_attn.o_proj`` and ``mlp.down_proj``; GPT-2
    ``attn.c_proj`` and ``mlp.c_proj``; BERT ``attention.output.dense`` and ``output.dense``)
    and their biases are zero, so on a pre-LN residual stream it adds exactly zero:

    .. math::

        x \mapsto x + W_o\,\mathrm{attn}(x) + W_d\,\phi(\cdot) = x \quad (W_o = W_d = 0).

    Every ``layer_idx`` is renumbered (the KV cache is indexed by it), ``config.num_hidden_layers``
    and ``config.layer_types`` (where present) are updated, and the new modules and parameters are
    flagged ``_is_hf_initialized`` so that ``post_init()`` / ``from_pretrained`` do not re-randomise
    them.  The grown model round-trips through ``save_pretrained`` / ``from_pretrained``; a model read
    from a GGUF file (de-quantized to float by transformers, as SmolLM2 in the zoo) loses its GGUF
    marker (:func:`drop_gguf_marker`), so that it can be trained and saved.

    Args:
        model: a supported Hugging Face model (:data:`ARCHITECTURES`); not modified unless ``inplace``.
        positions: original layer indices (``0 ≤ i < num_hidden_layers``), each at most once.
        init: ``"zero-output-copy"`` (the only initialisation).
        probe: a keyword batch (``{"input_ids": (B, T) long, ...}``) for the function-preservation
            check; default: 2 × 8 random token ids (seed 0).
        inplace: grow ``model`` itself (its parameters stay the same objects, so an existing
            optimizer stays valid for them).

    Returns:
        An :class:`Expansion`: the grown model, the new layers' parameters by site, the zeroed
        parameters, the measured output deviation (logit units) and its tolerance.

    Raises:
        GrowError: an unsupported architecture (the message names the supported ones and the
            :func:`~depthsat_theory.grow.insert_blocks` fallback), a position outside the layer
            list, a repeated position, an unknown ``init``, or a GPT-2 config with
            ``scale_attn_by_inverse_layer_idx``.
        NotFunctionPreservingError: the grown model's output moved on the probe by more than the
            dtype-scaled tolerance (always for post-LN BERT layers: ``LN(LN(x)) ≠ x``).

    Source: LLaMA-Pro block expansion (Wu et al., 2024, sec. 3.2); the zero-output insertion of
    theory/definitions.md (``def-family``), T1 and T5.
    """
    if init != "zero-output-copy":
        raise GrowError(f"unknown init {init!r}; the only one is 'zero-output-copy'")
    arch, path = find_architecture(model)
    config = getattr(model, "config", None)
    if config is None:
        raise GrowError(f"{type(model).__name__} has no .config: not a Hugging Face model; {_FALLBACK}")
    _refuse_layer_scaled(config)
    layers = model.get_submodule(path)
    assert isinstance(layers, nn.ModuleList)
    n_layers = len(layers)
    pos = _check_positions(positions, n_layers)
    if probe is None:
        probe = _default_probe(model, config)
    ref = reference_output(model, probe)
    grown = model if inplace else copy.deepcopy(model)
    glayers = grown.get_submodule(path)
    assert isinstance(glayers, nn.ModuleList)
    old = list(glayers)
    new_list: list[nn.Module] = []
    new_indices: list[int] = []
    for i, layer in enumerate(old):
        new_list.append(layer)
        if i in pos:
            new_list.append(_zero_output_copy(layer, arch.zeroed))
            new_indices.append(len(new_list) - 1)
    for i in range(len(glayers) - 1, -1, -1):
        del glayers[i]
    glayers.extend(new_list)
    _renumber(glayers)
    _update_config(grown.config, pos, n_layers)
    drop_gguf_marker(grown)
    exp = Expansion(grown, arch, path, pos, new_indices)
    for j in new_indices:
        site = f"{path}.{j}"
        exp.new_params[site] = list(glayers[j].parameters())
        exp.zeroed[site] = [
            f"{site}.{z}.{n}" for z in arch.zeroed for n, _ in glayers[j].get_submodule(z).named_parameters()
        ]
    why = (
        f": {arch.name} layers are post-LN (a LayerNorm after each residual sum), so a copy with zeroed output "
        f"projections computes LN(LN(x)) != x; {_FALLBACK}"
        if arch.post_ln
        else ""
    )
    exp.deviation, exp.tolerance = check_preserved(ref, grown, probe, why)
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
