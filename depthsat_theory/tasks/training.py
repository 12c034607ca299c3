"""Deterministic, CPU-fast training of the small residual models, with a weight cache.

:func:`trained_task` trains one of the models of :mod:`depthsat_theory.tasks.models`
on its data set (float32, Adam, fully seeded), converts it to float64 in eval
mode and bundles it with an independent probe set and a per-example loss in a
:class:`Task`. Trained float32 weights can be cached as ``.safetensors`` files
(never pickle) keyed by kind, seed and a hash of the training configuration.

Kinds:

* ``"mlp"``: :class:`~depthsat_theory.tasks.models.ResidualMLP` on digits;
* ``"cnn"``: :class:`~depthsat_theory.tasks.models.ResNetCNN` on digits (8x8 images);
* ``"gpt"``: :class:`~depthsat_theory.tasks.models.CharGPT` on KJV characters.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from depthsat_theory.io import atomic_write
from depthsat_theory.tasks.data import CharVocabulary, digits_split, kjv_sequences, load_kjv_text
from depthsat_theory.tasks.models import CharGPT, ResidualMLP, ResNetCNN, classification_loss, token_loss
from depthsat_theory.tasks.registry import Source, model_names
from depthsat_theory.vocabulary import Layout

__all__ = [
    "CACHE_ENV_VAR",
    "KINDS",
    "CacheDirError",
    "Task",
    "default_cache_dir",
    "load_or_train",
    "resolve_cache_dir",
    "task_config",
    "train_classifier",
    "train_gpt",
    "trained_task",
    "weight_cache_path",
]

CACHE_ENV_VAR = "DEPTHSAT_CACHE"

# Bump when the training procedure changes in a way not captured by the config.
_TRAINING_VERSION = 1

_CONFIGS: dict[str, dict[str, Any]] = {
    "mlp": {
        "data": "digits",
        "model": {"in_dim": 64, "width": 64, "depth": 4, "n_classes": 10, "activation": "gelu"},
        "probe_size": 512,
        "epochs": 12,
        "batch_size": 64,
        "lr": 3e-3,
    },
    "cnn": {
        "data": "digits",
        "model": {"in_channels": 1, "channels": [16, 32], "blocks_per_stage": 2, "n_classes": 10},
        "probe_size": 512,
        "epochs": 8,
        "batch_size": 64,
        "lr": 3e-3,
    },
    "gpt": {
        "data": "kjv",
        "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64},
        "probe_sequences": 32,
        "train_eval_sequences": 128,
        "steps": 300,
        "batch_size": 32,
        "lr": 5e-3,
    },
}

KINDS: tuple[str, ...] = model_names(Source.TRAINED)
"""The trained kinds, the registry's :attr:`~depthsat_theory.tasks.registry.Source.TRAINED` models."""
if set(KINDS) != set(_CONFIGS):  # pragma: no cover - a registry/config mismatch is a programming error
    raise RuntimeError(f"registry kinds {KINDS} and training configurations {tuple(_CONFIGS)} differ")


@dataclass
class Task:
    """A trained model with its probe set and per-example loss.

    Attributes:
        kind: one of :data:`KINDS` (``"mlp"``, ``"cnn"`` or ``"gpt"``).
        data: ``"digits"`` or ``"kjv"``.
        model: the trained model, float64, eval mode, parameters requiring grad.
        inputs: probe inputs: float64 ``(n, 64)`` for mlp, float64
            ``(n, 1, 8, 8)`` for cnn, long ``(n, T)`` token ids for gpt.
        targets: probe targets: long ``(n,)`` labels, or long ``(n, T)``
            next tokens for gpt.
        loss: per-example loss ``loss(model(inputs), targets) -> (n,)`` in nats.
        layout: site layout of the model (:class:`~depthsat_theory.vocabulary.Layout`).
        train_loss: mean per-example training loss of the returned float64
            model, in nats (digits: all training examples; gpt: a fixed sample
            of training-split windows).
        probe_loss: mean per-example probe loss of the float64 model, in nats.
    """

    kind: str
    data: str
    model: nn.Module
    inputs: Tensor
    targets: Tensor
    loss: Callable[[Tensor, Tensor], Tensor]
    layout: Layout
    train_loss: float
    probe_loss: float


def task_config(kind: str) -> dict[str, Any]:
    """Training configuration of a kind (a copy).

    Args:
        kind: one of :data:`KINDS`.

    Returns:
        A JSON-serialisable dict of model and training hyperparameters.

    Raises:
        ValueError: on an unknown kind.
    """
    _check_kind(kind)
    return json.loads(json.dumps(_CONFIGS[kind]))


def _check_kind(kind: str) -> None:
    if kind not in _CONFIGS:
        raise ValueError(f"unknown kind {kind!r}; valid kinds: {', '.join(KINDS)}")


def _cache_key(kind: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    payload: dict[str, Any] = {"kind": kind, "version": _TRAINING_VERSION, "config": _CONFIGS[kind]}
    if extra:
        payload["extra"] = extra
    return payload


def _build_model(kind: str, vocab_size: int | None = None) -> nn.Module:
    cfg = dict(_CONFIGS[kind]["model"])
    if kind == "mlp":
        return ResidualMLP(**cfg)
    if kind == "cnn":
        cfg["channels"] = tuple(cfg["channels"])
        return ResNetCNN(**cfg)
    assert vocab_size is not None
    return CharGPT(vocab_size, **cfg)


def weight_cache_path(cache_dir: str | os.PathLike, name: str, seed: int, key: dict[str, Any]) -> Path:
    """Where the weights of a model trained here are cached.

    float32 reductions depend on the number of intra-op threads, so training is only reproducible
    at a fixed thread count: weights trained at another count are kept apart.

    Args:
        cache_dir: the cache folder.
        name: the model's registry name (``"mlp"``, ``"mnist-resnet"``, ...).
        seed: the training seed.
        key: a JSON-serialisable description of everything the weights depend on (configuration,
            version); its SHA-256 (first 10 hex digits) is part of the file name.

    Returns:
        ``<cache_dir>/<name>-seed<seed>-threads<T>-<hash>.safetensors``.
    """
    chash = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    # the thread count stays in the name because the results depend on it: 10-20 Adam steps of the mlp, cnn
    # and gpt recipes at 1 and at 2 intra-op threads gave different weights for all three (checked 2026-12-02,
    # torch 2.13.0+cpu, MKL/libgomp); a thread-free key would hand a run weights it could not reproduce
    return Path(cache_dir) / f"{name}-seed{seed}-threads{torch.get_num_threads()}-{chash}.safetensors"


def _save_weights(path: Path, model: nn.Module, metadata: dict[str, str]) -> None:
    """Atomically save a float32 state dict to ``path`` with safetensors."""
    from safetensors.torch import save

    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = save(state, metadata=metadata)
    atomic_write(path, lambda fh: fh.write(blob), binary=True)


def _load_weights(path: Path, model: nn.Module) -> bool:
    """Load cached weights into ``model``; False (with a warning) if unusable."""
    from safetensors.torch import load_file

    try:
        state = load_file(str(path))
        model.load_state_dict(state, strict=True)
    except Exception as exc:  # corrupt or stale file: retrain and overwrite
        warnings.warn(f"ignoring unusable weight cache {path}: {exc}", RuntimeWarning, stacklevel=4)
        return False
    return True


def load_or_train(
    model: nn.Module,
    train: Callable[[], None],
    *,
    name: str,
    seed: int,
    key: dict[str, Any],
    config: dict[str, Any],
    cache_dir: str | os.PathLike | None,
) -> bool:
    """Load a model's weights from the weight cache, or train it and cache the result.

    Cache files are ``.safetensors`` (never pickle), written atomically; an unusable file
    (corrupt, stale) is reported with a ``RuntimeWarning``, retrained and overwritten.

    Args:
        model: the freshly built model (its weights are replaced in place).
        train: trains ``model`` in place (called only when no usable cache file exists).
        name: the model's registry name (the file-name prefix).
        seed: the training seed.
        key: what the weights depend on (hashed into the file name, :func:`weight_cache_path`).
        config: the training configuration, stored in the file's metadata.
        cache_dir: the cache folder; ``None``: ``$DEPTHSAT_CACHE`` when set, else no caching.

    Returns:
        ``True`` if the weights were loaded from the cache, ``False`` if ``model`` was trained.

    Raises:
        CacheDirError: if the cache location exists and is not a folder.
    """
    cdir = resolve_cache_dir(cache_dir)
    path = weight_cache_path(cdir, name, seed, key) if cdir is not None else None
    if path is not None and path.is_file() and _load_weights(path, model):
        return True
    train()
    if path is not None:
        _save_weights(path, model, {"kind": name, "seed": str(seed), "config": json.dumps(config, sort_keys=True)})
    return False


def _train_digits(kind: str, model: nn.Module, x: Tensor, y: Tensor, seed: int) -> None:
    train_classifier(model, x, y, seed, _CONFIGS[kind])


def train_classifier(model: nn.Module, x: Tensor, y: Tensor, seed: int, cfg: dict[str, Any]) -> None:
    """Train a classifier in place: Adam with a one-cycle schedule on mean cross-entropy.

    The batch order is drawn from a ``torch.Generator`` seeded with ``seed``; the model ends in
    eval mode.

    Args:
        model: maps ``x[idx]`` to logits ``(B, classes)``; trained in place.
        x: training inputs ``(n, ...)``, the model's dtype.
        y: labels, long ``(n,)``.
        seed: seed of the batch order.
        cfg: ``epochs``, ``batch_size`` and ``lr`` (the peak learning rate).
    """
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    n = x.shape[0]
    bs = cfg["batch_size"]
    total = cfg["epochs"] * ((n + bs - 1) // bs)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], total_steps=total)
    model.train()
    for _ in range(cfg["epochs"]):
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n, bs):
            idx = perm[i : i + bs]
            loss = classification_loss(model(x[idx]), y[idx]).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    model.eval()


def train_gpt(model: nn.Module, windows: Tensor, *, steps: int | None = None, start: int = 0) -> None:
    """The ``gpt`` task's recipe (AdamW, OneCycle over the recipe's steps) on batches ``[start, start + steps)``.

    ``start > 0`` begins a fresh optimizer at that point of the schedule (``benchmarks/depth_or_training.py``
    trains an under-trained model on, to compare training longer with growth).

    Args:
        model: a character GPT (``depthsat_theory.tasks.CharGPT``), trained in place (float32).
        windows: ``(N, T + 1)`` int64 token windows; batch ``s`` is rows ``[s·B, (s+1)·B)`` of the recipe's ``B``.
        steps: how many steps (default: to the end of the recipe's schedule).
        start: the schedule step to begin at.
    """
    cfg = _CONFIGS["gpt"]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    total, bs = cfg["steps"], cfg["batch_size"]
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], total_steps=total)
    with warnings.catch_warnings():  # move the schedule to step `start` (no optimizer step yet: warned)
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(start):
            sched.step()
    model.train()
    for s in range(start, start + (total - start if steps is None else steps)):
        batch = windows[s * bs : (s + 1) * bs]
        loss = token_loss(model(batch[:, :-1]), batch[:, 1:]).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    model.eval()


@torch.no_grad()
def _mean_loss(model: nn.Module, loss: Callable[[Tensor, Tensor], Tensor], x: Tensor, y: Tensor) -> float:
    return float(loss(model(x), y).mean())


class CacheDirError(ValueError):
    """The weight-cache location is not a usable folder."""


def default_cache_dir() -> Path:
    """The weight cache every command uses unless told otherwise: ``$DEPTHSAT_CACHE``, else ``~/.cache/depthsat``.

    ``check``, ``audit --model`` and ``diagnose --model`` all cache by default (a trained model
    is retrained only when its cache file is missing or unusable: minutes at 2 threads against
    seconds).

    Returns:
        The cache folder (not created here).
    """
    return Path(os.environ.get(CACHE_ENV_VAR) or Path.home() / ".cache" / "depthsat")


def resolve_cache_dir(cache_dir: str | os.PathLike | None) -> Path | None:
    """The weight-cache folder: ``cache_dir``, else ``$DEPTHSAT_CACHE`` when set, else ``None``.

    Args:
        cache_dir: an explicit folder, or ``None``.

    Returns:
        The folder (not created here), or ``None`` for no cache.

    Raises:
        CacheDirError: if the location exists and is not a folder (the message names it).
    """
    if cache_dir is not None:
        path, what = Path(cache_dir), "the cache folder"
    else:
        env = os.environ.get(CACHE_ENV_VAR)
        if not env:
            return None
        path, what = Path(env), f"${CACHE_ENV_VAR}"
    if path.exists() and not path.is_dir():
        raise CacheDirError(f"{what} {path} is a file, not a folder; point it at a folder for the trained weights")
    return path


def trained_task(kind: str, seed: int = 0, *, cache_dir: str | os.PathLike | None = None) -> Task:
    """Train (or load from cache) a model and return it with its probe set.

    Training is float32 with Adam and is deterministic given ``seed`` and the
    number of torch threads (data split, initialisation and batch order are all
    seeded; the caller's global RNG state is preserved; float32 reductions depend
    on the thread count, which is part of the cache name). The trained model is converted with
    ``.to(torch.float64).eval()``.

    Data: digits kinds use :func:`~depthsat_theory.tasks.data.digits_split` with a
    512-example probe disjoint from the 1,285 training examples; ``"gpt"``
    trains on random windows of the first 90 % of the KJV text and probes with
    32 sequences of length 64 from the last 10 %.

    Args:
        kind: ``"mlp"``, ``"cnn"`` or ``"gpt"``.
        seed: training seed.
        cache_dir: directory for cached float32 weights
            (``<cache_dir>/<kind>-seed<seed>-threads<T>-<config hash>.safetensors``). If
            ``None``, the ``DEPTHSAT_CACHE`` environment variable is used when
            set; otherwise nothing is cached.

    Returns:
        A :class:`Task`.

    Raises:
        ValueError: on an unknown kind.
        CacheDirError: if the cache location exists and is not a folder.
        depthsat_theory.tasks.data.DataUnavailableError: if the data cannot be loaded.
    """
    _check_kind(kind)
    seed = int(seed)
    cfg = _CONFIGS[kind]
    cdir = resolve_cache_dir(cache_dir)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if cfg["data"] == "digits":
            x_tr, y_tr, x_pr, y_pr = digits_split(seed, probe_size=cfg["probe_size"])
            x_tr, x_pr = x_tr.float(), x_pr.float()
            if kind == "cnn":
                x_tr = x_tr.reshape(-1, 1, 8, 8)
                x_pr = x_pr.reshape(-1, 1, 8, 8)
            loss_fn: Callable[[Tensor, Tensor], Tensor] = classification_loss
            model = _build_model(kind)
            extra = None

            def train() -> None:
                _train_digits(kind, model, x_tr, y_tr, seed)

        else:
            vocab = CharVocabulary(load_kjv_text())
            T = cfg["model"]["seq_len"]
            probe = kjv_sequences(vocab, cfg["probe_sequences"], T, seed=2 * seed + 1, split="probe")
            x_pr, y_pr = probe[:, :-1], probe[:, 1:]
            train_eval = kjv_sequences(vocab, cfg["train_eval_sequences"], T, seed=2 * seed + 2, split="train")
            x_tr, y_tr = train_eval[:, :-1], train_eval[:, 1:]
            loss_fn = token_loss
            model = _build_model(kind, vocab.size)
            extra = {"vocab": "".join(vocab.chars)}

            def train() -> None:
                windows = kjv_sequences(vocab, cfg["steps"] * cfg["batch_size"], T, seed=2 * seed, split="train")
                train_gpt(model, windows)

        load_or_train(model, train, name=kind, seed=seed, key=_cache_key(kind, extra), config=cfg, cache_dir=cdir)

    model = model.to(torch.float64).eval()
    model.requires_grad_(True)
    if x_pr.is_floating_point():
        x_pr = x_pr.to(torch.float64)
        x_tr = x_tr.to(torch.float64)
    return Task(
        kind=kind,
        data=cfg["data"],
        model=model,
        inputs=x_pr,
        targets=y_pr,
        loss=loss_fn,
        layout=Layout(model.layout),
        train_loss=_mean_loss(model, loss_fn, x_tr, y_tr),
        probe_loss=_mean_loss(model, loss_fn, x_pr, y_pr),
    )
