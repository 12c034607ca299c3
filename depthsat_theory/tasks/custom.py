"""Your own model: resolve a model *spec* to what :func:`~depthsat_theory.diagnose.diagnose` needs.

:func:`resolve_model` accepts three kinds of spec (``depthsat diagnose --model SPEC``):

* a registered name (:data:`~depthsat_theory.tasks.registry.MODELS`): a model trained here
  (``mlp``, ``cnn``, ``gpt``) or a zoo model (``smollm2``, ``minilm``, ...);
* ``hf:PATH``: a local Hugging Face causal language model checkpoint folder (``config.json``,
  the weights and the tokenizer, as written by ``model.save_pretrained(PATH)`` and
  ``tokenizer.save_pretrained(PATH)``), loaded offline in float32. Probe: windows of
  consecutive lines of a text file (or of the King James Bible shipped by the ``data`` extra),
  tokenized by the checkpoint's tokenizer (:func:`~depthsat_theory.tasks.zoo.causal_lm_batches`).
  Loss: next-token cross-entropy, the mean over the example's own predicted tokens (nats per
  token, :func:`~depthsat_theory.tasks.zoo.token_loss_masked`). Sites: the decoder layers
  (the ``nn.ModuleList`` of ``config.num_hidden_layers`` modules: ``model.layers.N`` for Llama,
  ``transformer.h.N`` for GPT-2), whose outputs are the residual stream;
* ``package.module:attr``: a zero-argument factory returning ``(model, loss_fn, batches)``,
  imported from exactly that module path (the current folder and ``PYTHONPATH``): ``model``
  an ``nn.Module``, ``loss_fn(output, targets) -> (B,)`` per-example losses, ``batches`` a
  non-empty list of ``(inputs, targets)`` (or ``(inputs, targets, mask)``, or Hugging Face
  mappings with ``"labels"``). Its sites are discovered
  (:func:`~depthsat_theory.diagnose.discover_sites`).

The model and every tensor of the batches are moved to ``device`` (``"auto"``: CUDA when
available). Errors name the Python argument (``spec``, ``n_batches``, ``batch_size``, ``text``,
``device``); the CLI respells them as its flags.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from depthsat_theory.vocabulary import Layout

__all__ = [
    "HF_DEFAULTS",
    "ModelSpecError",
    "ResolvedModel",
    "decoder_layer_sites",
    "resolve_device",
    "resolve_model",
    "to_device",
]

HF_DEFAULTS: tuple[int, int] = (16, 4)
"""Default ``(n_examples, batch_size)`` of an ``hf:PATH`` probe (as SmolLM2's in the zoo)."""

_HF_LOSS_UNITS = "nats per token (mean over the example's own non-padded predicted tokens)"


class ModelSpecError(ValueError):
    """A model spec that cannot be resolved: one line naming the argument and what to do."""


@dataclass
class ResolvedModel:
    """What :func:`~depthsat_theory.diagnose.diagnose` runs on.

    Attributes:
        model: the network, eval mode, on ``device``.
        loss_fn: ``loss_fn(output, targets) -> (B,)`` per-example losses.
        batches: the probe batches (tensors on ``device``).
        sites: the default site names, or ``None`` to discover them.
        layout: their :class:`~depthsat_theory.vocabulary.Layout`, or ``None`` to infer it.
        description: the model, probe and loss in one line.
        extra: further keyword arguments of :func:`~depthsat_theory.diagnose.diagnose`
            (``reduction``, ``mask_fn``, ``output_key``, ``loss_units``).
        device: where the model and the batches are.
        tokenizer: the model's Hugging Face tokenizer (``hf:`` folders and zoo language models), else
            ``None``; ``depthsat grow`` writes it next to the grown model.
    """

    model: nn.Module
    loss_fn: Callable[..., torch.Tensor]
    batches: list
    sites: list[str] | None
    layout: Layout | None
    description: str
    extra: dict = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tokenizer: Any = None


# ----------------------------------------------------------------------------- device
def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device of a ``device`` argument.

    Args:
        device: ``"cpu"``, ``"cuda"`` (the current CUDA device; under ``torchrun`` the rank's),
            ``"cuda:N"``, ``"auto"`` (CUDA when available, else CPU) or a ``torch.device``.

    Returns:
        The ``torch.device``.

    Raises:
        ModelSpecError: an unknown device, or CUDA asked for where none is available.
    """
    text = str(device).strip().lower()
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ModelSpecError(f"device {device!r}: CUDA is not available here; use cpu or auto")
        return torch.device("cuda", torch.cuda.current_device()) if text == "cuda" else torch.device(text)
    raise ModelSpecError(f"device {device!r} is not one of cpu, cuda, cuda:N, auto")


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it (nested tuples, lists, mappings) moved to ``device``.

    Args:
        obj: a tensor, or tuples/lists (named tuples included)/mappings nesting them; other values pass.
        device: the target device.

    Returns:
        A copy of the structure with the tensors on ``device`` (mappings become plain dicts).
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        moved = [to_device(v, device) for v in obj]
        return type(obj)(*moved) if hasattr(obj, "_fields") else type(obj)(moved)
    return obj


# ----------------------------------------------------------------------------- entry point
def resolve_model(
    spec: str,
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
    n_batches: int | None = None,
    batch_size: int | None = None,
    text: str | os.PathLike | None = None,
    max_tokens: int = 128,
    lines_per_example: int = 4,
) -> ResolvedModel:
    """Resolve a model spec: a registered name, ``hf:PATH`` or ``package.module:attr`` (module docstring).

    Args:
        spec: the model spec.
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (:func:`resolve_device`).
        seed: training seed of the models trained here; the probe sample's seed of text probes.
        n_batches: probe batches (``None``: the whole probe set; ``hf:``: 4 batches); a
            factory's first ``n_batches``.
        batch_size: examples per batch (default: the registry's, or 4 for ``hf:``); not for a factory.
        text: ``hf:`` only: a UTF-8 text file whose non-empty lines make the probe (default: the KJV verses).
        max_tokens: ``hf:`` only: tokens per example at most (truncation).
        lines_per_example: ``hf:`` only: consecutive lines per example.

    Returns:
        A :class:`ResolvedModel` on ``device``.

    Raises:
        ModelSpecError: an unknown name, a folder that is not a Hugging Face causal LM checkpoint
            (no ``config.json``, no weights, no tokenizer, another architecture, or an encoder such as
            BERT whose logits see later tokens), a missing
            module or attribute, a factory that raises or returns anything but
            ``(model, loss_fn, batches)``, bad counts, an unreadable ``text`` or a bad ``device``.
        depthsat_theory.extras.MissingExtraError: ``hf:`` without the ``models`` extra.
        depthsat_theory.tasks.data.DataUnavailableError: the KJV text without the ``data`` extra.
    """
    dev = resolve_device(device)
    if batch_size is not None and batch_size < 1:
        raise ModelSpecError(f"batch_size must be >= 1, got {batch_size}")
    if n_batches is not None and n_batches < 1:
        raise ModelSpecError(f"n_batches must be >= 1, got {n_batches}")
    if text is not None and not spec.startswith("hf:"):
        raise ModelSpecError(f"text applies to hf:PATH models only, not to spec {spec!r}")
    if spec.startswith("hf:"):
        res = _hf_model(spec[3:], seed, n_batches, batch_size, text, max_tokens, lines_per_example)
    elif ":" in spec:
        res = _factory_model(spec, n_batches, batch_size)
    else:
        res = _registered_model(spec, seed, n_batches, batch_size)
    res.model.to(dev)
    res.batches = [to_device(b, dev) for b in res.batches]
    res.device = dev
    return res


# ----------------------------------------------------------------------------- registered names
def _registered_model(name: str, seed: int, n_batches: int | None, batch_size: int | None) -> ResolvedModel:
    from depthsat_theory.tasks.training import KINDS

    if name in KINDS:
        return _trained_model(name, seed, n_batches, batch_size)
    try:
        from depthsat_theory.tasks import zoo
    except ImportError:  # the zoo's optional dependencies are missing: only the trained kinds remain
        zoo = None  # type: ignore[assignment]
    names = tuple(zoo.NAMES) if zoo is not None else ()
    if name not in names:
        raise ModelSpecError(
            f"unknown spec {name!r}; valid: {', '.join(tuple(KINDS) + names)}, hf:PATH (a Hugging Face "
            f"checkpoint folder) or package.module:attr (a factory returning (model, loss_fn, batches))"
        )
    return _zoo_model(zoo, name, seed, n_batches, batch_size)


def _cache_dir() -> Path:
    """The default weight cache (:func:`~depthsat_theory.tasks.training.default_cache_dir`), checked.

    Raises:
        ModelSpecError: if it exists and is a file.
    """
    from depthsat_theory.tasks.training import default_cache_dir

    path = default_cache_dir()
    if path.exists() and not path.is_dir():
        raise ModelSpecError(f"the weight cache {path} ($DEPTHSAT_CACHE) is a file, not a folder; point it at a folder")
    return path


def _trained_model(name: str, seed: int, n_batches: int | None, batch_size: int | None) -> ResolvedModel:
    """A model trained here (mlp, cnn, gpt): its probe set cut into batches of 64 by default."""
    from depthsat_theory.tasks.training import trained_task

    size = batch_size or 64
    task = trained_task(name, seed, cache_dir=_cache_dir())
    x, y = task.inputs, task.targets
    avail = -(-x.shape[0] // size)
    if n_batches is not None and n_batches > avail:
        raise ModelSpecError(
            f"n_batches {n_batches} exceeds the {name} probe set: {x.shape[0]} examples make {avail} batches of {size}"
        )
    count = avail if n_batches is None else n_batches
    batches = [(x[i * size : (i + 1) * size], y[i * size : (i + 1) * size]) for i in range(count)]
    desc = f"{name} (seed {seed}, {task.data} probe, {sum(b[0].shape[0] for b in batches)} examples)"
    model: Any = task.model
    return ResolvedModel(model, task.loss, batches, model.site_names(), Layout(task.layout), desc)


def zoo_diagnose_extras(zm: Any) -> dict:
    """The :func:`~depthsat_theory.diagnose` keywords a zoo model carries (``reduction``, ``mask_fn``, …).

    Args:
        zm: a zoo model (:class:`~depthsat_theory.tasks.zoo.ZooModel`-like); absent attributes are skipped.

    Returns:
        The keyword arguments to pass on; ``loss_units`` always ends in "per example".
    """
    extra = {k: getattr(zm, k) for k in ("reduction", "mask_fn", "output_key") if getattr(zm, k, None) is not None}
    units = getattr(zm, "loss_units", None)
    if isinstance(units, str):
        extra["loss_units"] = units if "example" in units else f"{units} per example"
    return extra


def _zoo_model(zoo: Any, name: str, seed: int, n_batches: int | None, batch_size: int | None) -> ResolvedModel:
    """A zoo model, with ``n_batches`` mapped to ``n_examples = n_batches · batch size``."""
    kw: dict = {"seed": seed, "cache_dir": _cache_dir()}
    if batch_size is not None:
        kw["batch_size"] = batch_size
    if n_batches is not None:
        kw["n_examples"] = n_batches * (batch_size or zoo.DEFAULTS[name][1])
    try:
        zm = zoo.load(name, **kw)
    except (ImportError, ValueError) as exc:  # zoo.ZooUnavailableError is an ImportError
        raise ModelSpecError(f"spec {name}: {exc}") from None
    batches = list(zm.batches)
    if n_batches is not None:
        if n_batches > len(batches):
            raise ModelSpecError(f"n_batches {n_batches} exceeds the {name} probe: {len(batches)} batches")
        batches = batches[:n_batches]
    return ResolvedModel(
        zm.model,
        zm.loss_fn,
        batches,
        list(zm.sites),
        zm.layout,
        zm.description,
        zoo_diagnose_extras(zm),
        tokenizer=getattr(zm, "tokenizer", None),  # image and encoder zoo models have none
    )


# ----------------------------------------------------------------------------- hf:PATH
def decoder_layer_sites(model: nn.Module) -> list[str]:
    """The decoder (or encoder) layers of a Hugging Face model: its residual-stream sites in depth order.

    Args:
        model: a ``transformers`` model with ``config.num_hidden_layers`` (GPT-2's ``n_layer`` included).

    Returns:
        ``[f"{name}.{i}" for i in range(L)]`` for the first ``nn.ModuleList`` of ``L =
        config.num_hidden_layers`` modules (``model.layers.N``, ``transformer.h.N``, ...).

    Raises:
        ModelSpecError: no such list.
    """
    n_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and n_layers and len(mod) == n_layers:
            return [f"{name}.{i}" for i in range(n_layers)]
    raise ModelSpecError(
        f"{type(model).__name__} has no list of config.num_hidden_layers = {n_layers} decoder layers; "
        f"use a package.module:attr factory and name the sites"
    )


def _read_lines(text: str | os.PathLike | None) -> tuple[list[str], str]:
    """The non-empty lines of ``text`` (default: the KJV verses) and a name for the description."""
    if text is None:
        from depthsat_theory.tasks.data import load_kjv_text

        return load_kjv_text().split("\n"), "the King James Bible"
    path = Path(text)
    if not path.is_file():
        raise ModelSpecError(f"text {path}: no such file")
    try:
        body = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelSpecError(f"text {path}: not a readable UTF-8 file ({type(exc).__name__})") from None
    return [ln for ln in body.splitlines() if ln.strip()], str(path)


def _hf_load(transformers: Any, path: Path, spec: str) -> tuple[nn.Module, Any]:
    """The causal LM (float32, eval mode, no KV cache) and the tokenizer of a checkpoint folder."""
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelSpecError(f"spec {spec!r}: config.json is not a Hugging Face config ({exc})") from None
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
    except ValueError as exc:
        raise ModelSpecError(
            f"spec {spec!r}: a {config.model_type!r} checkpoint is not a causal language model "
            f"(AutoModelForCausalLM: {str(exc).splitlines()[0]}); use a package.module:attr factory"
        ) from None
    except OSError as exc:
        raise ModelSpecError(
            f"spec {spec!r}: no readable weights ({str(exc).splitlines()[0]}); write them with model.save_pretrained"
        ) from None
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ModelSpecError(
            f"spec {spec!r}: no readable tokenizer in the folder ({type(exc).__name__}); "
            f"write one with tokenizer.save_pretrained"
        ) from None
    model.config.use_cache = False
    model.eval()
    _require_causal(model, config, spec)
    return model, tok


def _require_causal(model: nn.Module, config: Any, spec: str) -> None:
    """Refuse a model whose logits at a position depend on later tokens (not a causal LM).

    ``AutoModelForCausalLM`` also loads encoders (``bert``, ``roberta``, ... give a ``*LMHeadModel``
    with bidirectional attention when ``config.is_decoder`` is false): their next-token loss sees
    the token it predicts, so every score on it would be meaningless.  Two forwards of a 4-token
    window that differ only in the last token must give the same logits at the first three
    positions (exactly, up to a relative 1e-5) in a causal model.

    Raises:
        ModelSpecError: naming the class, ``config.is_decoder`` and what to do.
    """
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < 2:
        return
    ids = torch.arange(1, 5).remainder(vocab).view(1, 4)
    other = ids.clone()
    other[0, -1] = (ids[0, -1] + 1) % vocab
    with torch.no_grad():
        a = model(input_ids=ids).logits[0, :-1].double()
        b = model(input_ids=other).logits[0, :-1].double()
    if float((a - b).abs().max()) <= 1e-5 * (1.0 + float(a.abs().max())):
        return
    flag = getattr(config, "is_decoder", None)
    raise ModelSpecError(
        f"spec {spec!r}: {type(model).__name__} (model_type {config.model_type!r}, config.is_decoder = {flag}) is "
        f"not a causal language model: its logits at earlier positions change when only the last token changes, "
        f"so the next-token loss would see the token it predicts; give a decoder checkpoint (Llama, GPT-2, ...), "
        f'set "is_decoder": true in config.json if the model was trained as a decoder, or use a '
        f"package.module:attr factory with the encoder's own loss"
    )


def _hf_model(
    path_text: str,
    seed: int,
    n_batches: int | None,
    batch_size: int | None,
    text: str | os.PathLike | None,
    max_tokens: int,
    lines_per_example: int,
) -> ResolvedModel:
    from depthsat_theory.extras import require
    from depthsat_theory.tasks.zoo import causal_lm_batches, quiet_hf_loading, token_loss_masked

    spec = f"hf:{path_text}"
    path = Path(path_text).expanduser()
    if not path.is_dir():
        raise ModelSpecError(f"spec {spec!r}: no such folder")
    if not (path / "config.json").is_file():
        raise ModelSpecError(
            f"spec {spec!r}: not a Hugging Face checkpoint folder (no config.json); write one with "
            f"model.save_pretrained(PATH) and tokenizer.save_pretrained(PATH)"
        )
    transformers = require("transformers", extra="models", purpose="an hf:PATH model")
    lines, source = _read_lines(text)
    with quiet_hf_loading():
        model, tok = _hf_load(transformers, path, spec)
    size = batch_size or HF_DEFAULTS[1]
    n = (n_batches or HF_DEFAULTS[0] // HF_DEFAULTS[1]) * size
    try:
        batches = causal_lm_batches(tok, lines, n, size, seed, lines_per_example, max_tokens)
    except ValueError as exc:
        raise ModelSpecError(f"spec {spec!r} on {source}: {exc}") from None
    sites = decoder_layer_sites(model)
    cfg: Any = model.config
    desc = (
        f"{cfg.model_type} causal LM from {path} ({len(sites)} decoder layers x {cfg.hidden_size}, float32) on {n} "
        f"windows of {lines_per_example} consecutive lines of {source} (<= {max_tokens} tokens, right-padded); "
        f"loss: next-token cross-entropy, mean over the example's own predicted tokens"
    )
    return ResolvedModel(
        model, token_loss_masked, batches, sites, Layout.SEQUENCE, desc, {"loss_units": _HF_LOSS_UNITS}, tokenizer=tok
    )


# ----------------------------------------------------------------------------- package.module:attr
def _import_factory(spec: str) -> Callable[[], Any]:
    """The callable named by ``package.module:attr`` (imported from that module path only)."""
    module_name, _, attr = spec.partition(":")
    if not all(p.isidentifier() for p in module_name.split(".")) or not all(a.isidentifier() for a in attr.split(".")):
        raise ModelSpecError(f"spec {spec!r} is not package.module:attr (dotted Python names around one ':')")
    if os.getcwd() not in sys.path:  # the module resolves from the current folder too, as python -m does
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name + ".").startswith(exc.name + "."):
            raise ModelSpecError(
                f"spec {spec!r}: no module named {exc.name!r} (from the current folder or PYTHONPATH)"
            ) from None
        raise ModelSpecError(f"spec {spec!r}: importing {module_name} failed ({exc})") from None
    except Exception as exc:  # the user's module fails on import: one line, not a traceback
        raise ModelSpecError(f"spec {spec!r}: importing {module_name} failed ({type(exc).__name__}: {exc})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelSpecError(f"spec {spec!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelSpecError(
            f"spec {spec!r}: {attr} is a {type(obj).__name__}, not a factory; give a function returning "
            f"(model, loss_fn, batches)"
        )
    return obj


def _check_factory_output(spec: str, out: Any) -> tuple[nn.Module, Callable, list]:
    expect = "expected (model: nn.Module, loss_fn: callable, batches: a non-empty list of (inputs, targets))"
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        what = f"a {len(out)}-tuple" if isinstance(out, (tuple, list)) else f"a {type(out).__name__}"
        raise ModelSpecError(f"spec {spec!r} returned {what}; {expect}")
    model, loss_fn, batches = out
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"spec {spec!r} returned a {type(model).__name__} as the model; {expect}")
    if not callable(loss_fn):
        raise ModelSpecError(f"spec {spec!r} returned a {type(loss_fn).__name__} as loss_fn; {expect}")
    if isinstance(batches, (torch.Tensor, str, bytes, Mapping)) or not isinstance(batches, Iterable):
        raise ModelSpecError(f"spec {spec!r} returned a {type(batches).__name__} as the batches; {expect}")
    items = list(batches)
    if not items:
        raise ModelSpecError(f"spec {spec!r} returned no batches; {expect}")
    for i, b in enumerate(items):
        ok = (isinstance(b, (tuple, list)) and len(b) in (2, 3)) or (isinstance(b, Mapping) and "labels" in b)
        if not ok:
            raise ModelSpecError(
                f"spec {spec!r}: batch {i} is a {type(b).__name__}; each batch is (inputs, targets), "
                f"(inputs, targets, mask) or a mapping with 'labels'"
            )
    return model, loss_fn, items


def _factory_model(spec: str, n_batches: int | None, batch_size: int | None) -> ResolvedModel:
    if batch_size is not None:
        raise ModelSpecError(f"batch_size does not apply to spec {spec!r}: the factory makes its own batches")
    factory = _import_factory(spec)
    try:
        out = factory()
    except Exception as exc:  # the user's factory fails: one line naming it
        raise ModelSpecError(f"spec {spec!r}: the factory raised {type(exc).__name__}: {exc}") from None
    model, loss_fn, batches = _check_factory_output(spec, out)
    if n_batches is not None:
        if n_batches > len(batches):
            raise ModelSpecError(f"n_batches {n_batches} exceeds the {len(batches)} batches of spec {spec!r}")
        batches = batches[:n_batches]
    desc = f"{type(model).__name__} from {spec} ({len(batches)} probe batches)"
    return ResolvedModel(model, loss_fn, batches, None, None, desc)
