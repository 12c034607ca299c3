"""What the CLI reads: probe files, output paths and the model/batches of ``diagnose --model``.

Every problem is a :class:`UserError` naming the flag, reported as one line.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["DiagnoseTarget", "UserError", "check_output_path", "check_writable", "diagnose_target", "load_probe"]


class UserError(Exception):
    """Bad user input: reported as one line, exit status 2."""


# ----------------------------------------------------------------------------- paths
def check_writable(path: Path) -> None:
    """Refuse a ``--report`` path that cannot be written (a folder, or a missing/read-only folder).

    Raises:
        OSError: naming ``--report``.
    """
    if path.is_dir():
        raise OSError(f"--report {path} is a directory; give a file path")
    folder = path.resolve().parent
    if not folder.is_dir():
        raise OSError(f"--report folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise OSError(f"--report folder {folder} is not writable")


def check_output_path(flag: str, path: Path | None) -> None:
    """Refuse an output ``path`` that is not a file path in an existing folder.

    Raises:
        UserError: naming ``flag``.
    """
    if path is not None and (path.is_dir() or not path.resolve().parent.is_dir()):
        raise UserError(f"{flag} {path}: not a file path in an existing folder")


# ----------------------------------------------------------------------------- probe files
def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if path.is_dir():
        raise UserError(f"--probe {path} is a directory, not an .npz file")
    if not path.is_file():
        raise UserError(f"--probe {path}: no such file")
    if not zipfile.is_zipfile(path):
        raise UserError(f"--probe {path}: not an .npz archive; save one with numpy.savez(path, z=Z, g=G)")
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = [k for k in ("z", "g") if k not in data.files]
            if missing:
                raise UserError(
                    f"--probe {path}: missing array(s) {', '.join(missing)} (found: {', '.join(data.files) or 'none'})"
                )
            return data["z"], data["g"]
    except UserError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise UserError(f"--probe {path}: not a readable .npz file ({type(exc).__name__}: {exc})") from None


def _native_float(name: str, arr: np.ndarray) -> np.ndarray:
    if arr.dtype.kind != "f" or arr.dtype.itemsize not in (2, 4, 8):
        raise UserError(f"array {name} has dtype {arr.dtype}; expected float16, float32 or float64")
    return arr.astype(arr.dtype.newbyteorder("="), copy=False)


def load_probe(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Read a probe: an ``.npz`` archive with float arrays ``z`` and ``g``, each ``(n, d)``.

    Returns:
        ``(z, g)`` in native byte order, float16, float32 or float64 as stored (the rounding bound uses that dtype).

    Raises:
        UserError: a missing/unreadable file, missing arrays, a non-float dtype,
            mismatched or non-2-D shapes, an empty probe, or NaN/Inf.
    """
    z, g = _read_npz(path)
    z, g = _native_float("z", z), _native_float("g", g)
    for name, arr in (("z", z), ("g", g)):
        if arr.ndim != 2:
            raise UserError(f"array {name} has shape {arr.shape}; expected n × d")
    if z.shape != g.shape:
        raise UserError(f"z has shape {z.shape} but g has shape {g.shape}; they must match")
    if z.shape[0] == 0:
        raise UserError("the probe is empty (n = 0)")
    if z.shape[1] == 0:
        raise UserError("the probe has d = 0 columns")
    for name, arr in (("z", z), ("g", g)):
        if not np.isfinite(arr).all():
            raise UserError(f"array {name} contains NaN or Inf")
    return z, g


# ----------------------------------------------------------------------------- diagnose --model
@dataclass
class DiagnoseTarget:
    """What ``diagnose --model`` runs on.

    Attributes:
        model: the network; ``loss_fn``: its loss; ``batches``: the probe batches.
        sites: the default site names; ``layout``: their layout; ``description``: one line.
        extra: further keyword arguments of :func:`depthsat_theory.diagnose.diagnose`.
    """

    model: Any
    loss_fn: Any
    batches: list
    sites: list[str]
    layout: str
    description: str
    extra: dict = field(default_factory=dict)


def _check_counts(n_batches: int | None, batch_size: int | None) -> None:
    if batch_size is not None and batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {batch_size}")
    if n_batches is not None and n_batches < 1:
        raise UserError(f"--batches must be >= 1, got {n_batches}")


def _cache_dir(path: Path) -> Path:
    """``path`` checked to be a folder (or absent): the weight cache of ``diagnose``/``audit``.

    Raises:
        UserError: if it exists and is a file.
    """
    if path.exists() and not path.is_dir():
        raise UserError(f"the weight cache {path} ($DEPTHSAT_CACHE) is a file, not a folder; point it at a folder")
    return path


def _trained_target(name: str, seed: int, n_batches: int | None, batch_size: int | None) -> DiagnoseTarget:
    """A model trained here (mlp, cnn, gpt): its probe set cut into batches."""
    from depthsat_theory.tasks import default_cache_dir, trained_task

    size = batch_size or 64
    task = trained_task(name, seed, cache_dir=_cache_dir(default_cache_dir()))
    x, y = task.inputs, task.targets
    avail = -(-x.shape[0] // size)
    if n_batches is not None and n_batches > avail:
        raise UserError(
            f"--batches {n_batches} exceeds the {name} probe set: {x.shape[0]} examples make {avail} batches of {size}"
        )
    count = avail if n_batches is None else n_batches
    batches = [(x[i * size : (i + 1) * size], y[i * size : (i + 1) * size]) for i in range(count)]
    desc = f"{name} (seed {seed}, {task.data} probe, {sum(b[0].shape[0] for b in batches)} examples)"
    model: Any = task.model
    return DiagnoseTarget(model, task.loss, batches, model.site_names(), task.layout, desc)


def _zoo_extra(zm: Any) -> dict:
    extra = {k: getattr(zm, k) for k in ("reduction", "mask_fn", "output_key") if getattr(zm, k, None) is not None}
    units = getattr(zm, "loss_units", None)
    if isinstance(units, str):
        extra["loss_units"] = units if "example" in units else f"{units} per example"
    return extra


def _zoo_target(zoo: Any, name: str, seed: int, n_batches: int | None, batch_size: int | None) -> DiagnoseTarget:
    """A zoo model, with ``--batches N`` mapped to ``n_examples = N · batch size``."""
    from depthsat_theory.tasks import default_cache_dir

    kw: dict = {"seed": seed, "cache_dir": _cache_dir(default_cache_dir())}
    if batch_size is not None:
        kw["batch_size"] = batch_size
    if n_batches is not None:
        kw["n_examples"] = n_batches * (batch_size or zoo.DEFAULTS[name][1])
    try:
        zm = zoo.load(name, **kw)
    except (ImportError, ValueError) as exc:  # zoo.ZooUnavailableError is an ImportError
        raise UserError(f"--model {name}: {exc}") from None
    batches = list(zm.batches)
    if n_batches is not None:
        if n_batches > len(batches):
            raise UserError(f"--batches {n_batches} exceeds the {name} probe: {len(batches)} batches")
        batches = batches[:n_batches]
    return DiagnoseTarget(zm.model, zm.loss_fn, batches, list(zm.sites), zm.layout, zm.description, _zoo_extra(zm))


def _zoo_module() -> Any:
    """``depthsat_theory.tasks.zoo``, or ``None`` when its optional dependencies are missing."""
    try:
        from depthsat_theory.tasks import zoo
    except ImportError:
        return None
    return zoo


def diagnose_target(name: str, seed: int, n_batches: int | None, batch_size: int | None) -> DiagnoseTarget:
    """The model, loss and probe batches of ``diagnose --model NAME``.

    Args:
        name: ``mlp``, ``cnn``, ``gpt`` (trained here, cached) or a zoo name.
        seed: training seed (zoo: probe/training seed).
        n_batches: probe batches (``None``: the whole probe set).
        batch_size: examples per batch (``None``: 64 here, the zoo model's own otherwise).

    Raises:
        UserError: an unknown model, bad counts, or a zoo model that cannot be loaded.
    """
    from depthsat_theory.tasks import KINDS

    _check_counts(n_batches, batch_size)
    if name in KINDS:
        return _trained_target(name, seed, n_batches, batch_size)
    zoo = _zoo_module()
    names = tuple(getattr(zoo, "NAMES", ())) if zoo is not None else ()
    if name not in names:
        raise UserError(f"unknown --model {name!r}; valid: {', '.join(tuple(KINDS) + names)}")
    return _zoo_target(zoo, name, seed, n_batches, batch_size)
