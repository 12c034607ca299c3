"""What the CLI reads: probe files, output paths and the model/batches of ``diagnose --model``.

Every problem is a :class:`UserError` naming the flag, reported as one line.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from depthsat_theory.cli.flags import respell

if TYPE_CHECKING:
    from depthsat_theory.tasks.custom import ResolvedModel

__all__ = ["MODEL_FLAGS", "UserError", "check_output_path", "check_writable", "diagnose_target", "load_probe"]


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
#: CLI flag of each argument :func:`~depthsat_theory.tasks.custom.resolve_model` names in its errors
MODEL_FLAGS: dict[str, str] = {
    "spec": "--model",
    "n_batches": "--batches",
    "batch_size": "--batch-size",
    "text": "--text",
    "device": "--device",
}


def diagnose_target(
    name: str,
    seed: int,
    n_batches: int | None,
    batch_size: int | None,
    *,
    device: str = "cpu",
    text: Path | None = None,
) -> ResolvedModel:
    """The model, loss and probe batches of ``diagnose --model SPEC``.

    A thin wrapper of :func:`~depthsat_theory.tasks.custom.resolve_model`.

    Args:
        name: the ``--model`` spec: ``mlp``, ``cnn``, ``gpt`` (trained here, cached), a zoo name,
            ``hf:PATH`` or ``package.module:attr``.
        seed: training seed (zoo and ``hf:``: probe/training seed).
        n_batches: probe batches (``None``: the whole probe set).
        batch_size: examples per batch (``None``: 64 here, the zoo model's own otherwise).
        device: ``--device``: ``cpu``, ``cuda`` or ``auto``.
        text: ``--text``: the text file of an ``hf:`` model's probe.

    Raises:
        UserError: whatever :func:`~depthsat_theory.tasks.custom.resolve_model` refuses, with its flags.
    """
    from depthsat_theory.tasks.custom import ModelSpecError, resolve_model

    try:
        return resolve_model(name, device=device, seed=seed, n_batches=n_batches, batch_size=batch_size, text=text)
    except ModelSpecError as exc:
        raise UserError(respell(str(exc), MODEL_FLAGS)) from None
