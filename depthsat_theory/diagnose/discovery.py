"""Site discovery: the residual-stream sites of a model (ours, torchvision, Hugging Face) and their layouts."""

from __future__ import annotations

import re
import warnings
from collections import Counter
from collections.abc import Sequence
from itertools import chain

import torch
from torch import Tensor, nn

from depthsat_theory.capture import batch_size, call_model
from depthsat_theory.diagnose.errors import DiagnoseError
from depthsat_theory.vocabulary import Layout

__all__ = ["SITE_PATTERNS", "discover_sites", "infer_layout", "rows_or_channels"]

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


#: Leaf modules whose 3-D output ``(B, C, L)`` is channel-first: units are the ``L`` positions.
_CHANNEL_FIRST_1D = (
    nn.Conv1d,
    nn.ConvTranspose1d,
    nn.BatchNorm1d,
    nn.InstanceNorm1d,
    nn.MaxPool1d,
    nn.AvgPool1d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveMaxPool1d,
)
#: Leaf modules whose 3-D output ``(B, T, d)`` is a sequence of rows: units are the ``T`` rows.
_ROW_WISE = (nn.Linear, nn.LayerNorm, nn.RMSNorm, nn.Embedding, nn.MultiheadAttention, nn.GroupNorm)


def rows_or_channels(module: nn.Module) -> Layout | None:
    """``SEQUENCE`` or ``IMAGE`` (channel-first) from the last informative leaf of ``module``, else ``None``.

    The last leaf module (in registration order, the site module itself when it has no
    submodules) that is a 1-D convolution/normalization/pooling (channel-first) or a
    linear/normalization/attention/embedding layer acting on the last dimension (rows);
    activations, dropout and other layers are skipped.  Hugging Face ``transformers`` and
    ``depthsat_theory`` modules are sequences.

    Args:
        module: the site module.

    Returns:
        ``Layout.SEQUENCE``, ``Layout.IMAGE`` or ``None``.
    """
    if type(module).__module__.startswith(("transformers.", "depthsat_theory.")):
        return Layout.SEQUENCE
    for sub in reversed(list(module.modules())):
        if isinstance(sub, _CHANNEL_FIRST_1D):
            return Layout.IMAGE
        if isinstance(sub, _ROW_WISE):
            return Layout.SEQUENCE
    return None


def infer_layout(shape: Sequence[int], module: nn.Module | None = None, site: str = "") -> Layout:
    """Layout of a site from its per-example shape (and, for ``(·, ·)``, from its module).

    ``(d,)`` is a vector and ``(C, H, W)`` an image.  A 2-D per-example shape is either a
    sequence ``(T, d)`` (a transformer's residual stream: units are the ``T`` rows of
    dimension ``d``) or a channel-first 1-D signal ``(C, L)`` (a ``Conv1d`` network: units
    are the ``L`` positions of dimension ``C``, read as the image ``(C, 1, L)``).  The
    module tells which: the last leaf that is a 1-D convolution, ``BatchNorm1d``,
    ``InstanceNorm1d`` or 1-D pooling gives ``IMAGE`` (channel-first), the last that is a
    ``Linear``, ``LayerNorm``, ``RMSNorm``, ``GroupNorm``, ``Embedding`` or
    ``MultiheadAttention`` gives ``SEQUENCE``.

    Args:
        shape: the per-example shape of the site tensor.
        module: the site module (needed for 2-D shapes).
        site: the site's name, for error messages.

    Returns:
        The :class:`~depthsat_theory.vocabulary.Layout`; ``IMAGE`` for a channel-first ``(C, L)``
        site, whose tensors :func:`~depthsat_theory.diagnose.diagnose` reads as ``(C, 1, L)``.

    Raises:
        DiagnoseError: for ranks other than 1, 2, 3, or a 2-D shape whose module does not
            tell rows from channels (pass ``layout``).
    """
    layouts = {1: Layout.VECTOR, 3: Layout.IMAGE}
    if len(shape) in layouts:
        return layouts[len(shape)]
    if len(shape) != 2:
        raise DiagnoseError(
            f"cannot infer a site layout from per-example shape {tuple(shape)}; expected (d,), (T, d), (C, L) "
            f"or (C, H, W)"
        )
    found = None if module is None else rows_or_channels(module)
    if found is None:
        raise DiagnoseError(
            f"site {site!r} has per-example shape {tuple(shape)}: a sequence (T, d) or a channel-first signal "
            f"(C, L), and its module ({type(module).__name__}) does not say which; pass layout='sequence' "
            f"(units = rows) or layout='image' (units = positions, channels first), or {{site: layout}}"
        )
    return found


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
    2. Module names matching :data:`SITE_PATTERNS`: ResNet blocks ``layerN.M``
       (torchvision ``BasicBlock``/``Bottleneck``, or any composite module: one with
       submodules), else the stages ``layerN`` (with a warning when ``layerN.M`` modules
       exist but are single layers), GPT-style ``transformer.h.N``, Llama
       ``model.layers.N``, BERT ``encoder.layer.N``, ``blocks.N``.  With ``example`` (one
       probe input batch), one no-grad forward checks that each candidate outputs a
       floating ``(B, *shape)`` tensor (or sequence-first ``(T, B, d)``; tuple outputs: the
       first element) of the residual-stream shape: for transformer-style names the output
       must have the shape of the block's input; ResNet blocks/stages may change the shape.
       Candidates that do not run or fail the check are dropped and the rest are ordered
       by execution.  A module that runs ``c > 1`` times in the forward (a weight-shared
       block) outputs ``c`` site tensors: it gives the ``c`` sites ``name#0`` … ``name#{c-1}``
       (one per call, :class:`~depthsat_theory.capture.sites.SiteRecorder`), each checked on
       its own.

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


def _is_block(module: nn.Module) -> bool:
    """A residual block of a ResNet stage: a torchvision block, or any module with submodules (a composite)."""
    return type(module).__name__ in _RESNET_BLOCKS or any(True for _ in module.children())


def _candidates(mods: dict[str, nn.Module]) -> tuple[list[str], dict[str, str]]:
    """Module names matching :data:`SITE_PATTERNS` and their kind (``"resnet"`` or ``"stream"``).

    ``layerN.M`` modules are ResNet blocks when they are torchvision ``BasicBlock``/``Bottleneck``
    or, structurally, composite modules (with submodules); when ``layerN.M`` modules exist but
    none is a block (plain layers of an ``nn.Sequential`` stage), the stages ``layerN`` are the
    sites and a warning says so.
    """
    numbered = [n for n in mods if re.search(SITE_PATTERNS["torchvision ResNet block (layerN.M)"], n)]
    blocks = [n for n in numbered if _is_block(mods[n])]
    if blocks:
        return blocks, dict.fromkeys(blocks, "resnet")
    found = [n for n in mods if re.search(SITE_PATTERNS["ResNet stage (layerN)"], n)]
    if numbered and found:
        warnings.warn(
            f"site discovery: the modules {', '.join(numbered[:3])}{', …' if len(numbered) > 3 else ''} are single "
            f"layers, not residual blocks (no submodules), so the ResNet stages {', '.join(found[:3])}"
            f"{', …' if len(found) > 3 else ''} are the sites; pass sites=[...] to choose others",
            UserWarning,
            stacklevel=3,
        )
    kinds = dict.fromkeys(found, "resnet")
    for label, pat in SITE_PATTERNS.items():
        if "ResNet" in label:
            continue
        for n in mods:
            if n not in kinds and re.search(pat, n):
                found.append(n)
                kinds[n] = "stream"
    return found, kinds


def _site_shape_ok(kind: str, inp, out, batch: int) -> bool:
    """A floating ``(B, *shape)`` (or sequence-first ``(T, B, d)``) output; same shape as the input for streams."""
    if out is None or not 2 <= len(out) <= 4 or batch not in out[: 2 if len(out) == 3 else 1]:
        return False
    return kind != "stream" or inp == out


def _check_shapes(model: nn.Module, names: list[str], kinds: dict, example) -> list[str]:
    """The candidates that pass the shape check, in execution order; a module run ``c > 1`` times gives ``name#k``."""
    mods = dict(model.named_modules())
    calls: list[tuple[str, tuple | None, tuple | None]] = []  # (name, input shape, output shape) per call
    x = example[0] if isinstance(example, (tuple, list)) else example

    def make(name):
        def hook(module, args, kwargs, output):
            inp = next((a for a in chain(args, kwargs.values()) if isinstance(a, Tensor)), None)
            out = _first_tensor(output)
            calls.append(
                (
                    name,
                    None if inp is None else tuple(inp.shape),
                    None if out is None or not out.is_floating_point() else tuple(out.shape),
                )
            )

        return hook

    handles = [mods[n].register_forward_hook(make(n), with_kwargs=True) for n in names]
    try:
        with torch.no_grad():
            call_model(model, x)
    finally:
        for h in handles:
            h.remove()
    batch = batch_size(x)
    count = Counter(name for name, _, _ in calls)
    seen: Counter = Counter()
    keep = []
    for name, inp, out in calls:
        key = name if count[name] == 1 else f"{name}#{seen[name]}"
        seen[name] += 1
        if _site_shape_ok(kinds[name], inp, out, batch):
            keep.append(key)
    return keep
