"""Site discovery: the residual-stream sites of a model (ours, torchvision, Hugging Face) and their layouts."""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import chain

import torch
from torch import Tensor, nn

from depthsat_theory.capture import batch_size, call_model
from depthsat_theory.diagnose.errors import DiagnoseError
from depthsat_theory.vocabulary import Layout

__all__ = ["SITE_PATTERNS", "discover_sites", "infer_layout"]

#: Module-name patterns of residual-stream sites (searched in ``named_modules()``), in
#: the order they are tried; a model with ``site_names()`` (ours) uses that instead.
SITE_PATTERNS: dict[str, str] = {
    "torchvision ResNet block (layerN.M)": r"(?:^|\.)layer\d+\.\d+$",
    "ResNet stage (layerN)": r"(?:^|\.)layer\d+$",
    "GPT-2 style (transformer.h.N)": r"(?:^|\.)h\.\d+$",
    "Llama style (model.layers.N)": r"(?:^|\.)layers\.\d+$",
    "BERT style (encoder.layer.N)": r"(?:^|\.)encoder\.layer\.\d+$",
    "blocks.N": r"(?:^|\.)blocks\.\d+$",
}
_RESNET_BLOCKS = ("BasicBlock", "Bottleneck")


def infer_layout(shape: Sequence[int]) -> Layout:
    """Layout of a site from its per-example shape.

    ``(d,)`` is a vector, ``(T, d)`` a sequence and ``(C, H, W)`` an image.

    Raises:
        DiagnoseError: for other ranks.
    """
    layouts = {1: Layout.VECTOR, 2: Layout.SEQUENCE, 3: Layout.IMAGE}
    if len(shape) not in layouts:
        raise DiagnoseError(
            f"cannot infer a site layout from per-example shape {tuple(shape)}; expected (d,), (T, d) or (C, H, W)"
        )
    return layouts[len(shape)]


def _first_tensor(obj):
    if isinstance(obj, Tensor):
        return obj
    if isinstance(obj, (tuple, list)) and obj and isinstance(obj[0], Tensor):
        return obj[0]
    for key in ("last_hidden_state", "hidden_states"):
        val = getattr(obj, key, None)
        if isinstance(val, Tensor):
            return val
    return None


def discover_sites(model: nn.Module, example=None) -> list[str]:
    """Residual-stream sites of a model, in depth (execution) order.

    Rules, first match wins:

    1. ``model.site_names()`` when the model has it (:mod:`depthsat_theory.tasks.models`).
    2. Module names matching :data:`SITE_PATTERNS`: torchvision ResNet blocks
       ``layerN.M`` of type ``BasicBlock``/``Bottleneck`` (else the stages ``layerN``),
       GPT-style ``transformer.h.N``, Llama ``model.layers.N``, BERT
       ``encoder.layer.N``, ``blocks.N``.  With ``example`` (one probe input batch),
       one no-grad forward checks that each candidate runs exactly once and outputs
       a floating ``(B, *shape)`` tensor (tuple outputs: the first element) of the
       residual-stream shape: for transformer-style names the output must have the
       shape of the block's input; ResNet blocks/stages may change the shape.
       Candidates failing the check are dropped and the rest are ordered by
       execution.

    Args:
        model: any ``nn.Module``.
        example: optional probe inputs (a tensor, a tuple whose first element is
            the input, or a dict of keyword inputs) for the shape check.

    Returns:
        Site names usable with :class:`~depthsat_theory.capture.sites.SiteRecorder`.

    Raises:
        DiagnoseError: if no site is found.
    """
    site_names = getattr(model, "site_names", None)
    if callable(site_names):
        names = list(site_names())
        if names:
            return names
    found, kinds = _candidates(dict(model.named_modules()))
    # drop candidates nested inside another candidate (e.g. blocks.0.h.1)
    found = [n for n in found if not any(n != o and n.startswith(o + ".") for o in found)]
    if example is not None and found:
        found = _check_shapes(model, found, kinds, example)
    if not found:
        raise DiagnoseError(
            f"no residual-stream sites found in {type(model).__name__}: no module named like "
            f"{', '.join(SITE_PATTERNS)} with a residual-stream output; pass the module names "
            f"explicitly (sites=[...])"
        )
    return found


def _candidates(mods: dict[str, nn.Module]) -> tuple[list[str], dict[str, str]]:
    """Module names matching :data:`SITE_PATTERNS` and their kind (``"resnet"`` or ``"stream"``)."""
    blocks = [
        n
        for n in mods
        if re.search(SITE_PATTERNS["torchvision ResNet block (layerN.M)"], n)
        and type(mods[n]).__name__ in _RESNET_BLOCKS
    ]
    if blocks:
        return blocks, dict.fromkeys(blocks, "resnet")
    found = [n for n in mods if re.search(SITE_PATTERNS["ResNet stage (layerN)"], n)]
    kinds = dict.fromkeys(found, "resnet")
    for label, pat in SITE_PATTERNS.items():
        if "ResNet" in label:
            continue
        for n in mods:
            if n not in kinds and re.search(pat, n):
                found.append(n)
                kinds[n] = "stream"
    return found, kinds


def _check_shapes(model: nn.Module, names: list[str], kinds: dict, example) -> list[str]:
    mods = dict(model.named_modules())
    seen: dict[str, list] = {n: [] for n in names}
    order: list[str] = []
    x = example[0] if isinstance(example, (tuple, list)) else example

    def make(name):
        def hook(module, args, kwargs, output):
            inp = next((a for a in chain(args, kwargs.values()) if isinstance(a, Tensor)), None)
            out = _first_tensor(output)
            seen[name].append(
                (
                    None if inp is None else tuple(inp.shape),
                    None if out is None or not out.is_floating_point() else tuple(out.shape),
                )
            )
            if name not in order:
                order.append(name)

        return hook

    handles = [mods[n].register_forward_hook(make(n), with_kwargs=True) for n in names]
    try:
        with torch.no_grad():
            call_model(model, x)
    finally:
        for h in handles:
            h.remove()
    batch = batch_size(x)
    keep = []
    for n in order:
        if len(seen[n]) != 1:
            continue
        inp, out = seen[n][0]
        if out is None or len(out) < 2 or len(out) > 4 or batch not in out[: 2 if len(out) == 3 else 1]:
            continue  # not a floating (B, *shape) or sequence-first (T, B, d) tensor
        if kinds[n] == "stream" and inp != out:
            continue
        keep.append(n)
    return keep
