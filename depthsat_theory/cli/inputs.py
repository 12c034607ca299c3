"""What the CLI reads: probe files, output paths, devices and the model/batches of ``diagnose``/``audit --model``.

Every problem is a :class:`UserError` naming the flag, reported as one line.
"""

from __future__ import annotations

import copy
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from depthsat_theory.cli.flags import respell
from depthsat_theory.io import check_output

if TYPE_CHECKING:
    from depthsat_theory.tasks.custom import ResolvedModel

__all__ = [
    "MODEL_FLAGS",
    "UserError",
    "audit_target",
    "check_output_path",
    "check_writable",
    "diagnose_target",
    "load_probe",
    "model_sites",
    "parse_device",
]


class UserError(Exception):
    """Bad user input: reported as one line, exit status 2."""


# ----------------------------------------------------------------------------- paths
def check_writable(path: Path) -> None:
    """Refuse a ``--report`` path that cannot be written (a folder, or a missing/read-only folder).

    Args:
        path: the ``--report`` file path (``-``: stdout).

    Raises:
        OSError: naming ``--report``.
    """
    try:
        check_output("--report", path)
    except ValueError as exc:
        raise OSError(str(exc)) from None


def check_output_path(flag: str, path: Path | None, *, stdout: bool = True, folder: bool = False) -> None:
    """Refuse, before any work, an output ``path`` that could not be written at the end.

    A file path needs an existing folder in which a file can be created (tried, not inferred from the
    mode bits: root ignores them, a read-only mount does not); ``-`` (stdout) and existing special files
    (``/dev/stdout``) are accepted where ``stdout`` is (:func:`depthsat_theory.io.check_output`).

    Args:
        flag: the option's name, e.g. ``"--json"``.
        path: the output path (``None``: nothing to check).
        stdout: whether ``-`` and special files are accepted (not for ``--plot`` or ``--checkpoint``).
        folder: ``path`` is a new or empty folder (``grow --out``).

    Raises:
        UserError: one line naming ``flag``.
    """
    if path is None:
        return
    try:
        check_output(flag, path, stdout=stdout, folder=folder)
    except ValueError as exc:
        raise UserError(str(exc)) from None


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

    Args:
        path: the ``.npz`` file.

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

    Returns:
        The :class:`~depthsat_theory.tasks.custom.ResolvedModel` (model, loss, batches, sites, description).

    Raises:
        UserError: whatever :func:`~depthsat_theory.tasks.custom.resolve_model` refuses, with its flags.
    """
    from depthsat_theory.tasks.custom import ModelSpecError, resolve_model

    try:
        return resolve_model(name, device=device, seed=seed, n_batches=n_batches, batch_size=batch_size, text=text)
    except ModelSpecError as exc:
        raise UserError(respell(str(exc), MODEL_FLAGS)) from None


def audit_target(model: str, seed: int, device: str, site: str) -> tuple:
    """A zoo model or factory for ``audit --model``: a float64 copy, its probe batches joined into one tensor pair.

    The audit inserts float64 blocks and compares float64 outputs, so a float32 model is audited
    as a float64 copy (floating inputs and targets converted too).

    Args:
        model: the ``--model`` spec (see :func:`diagnose_target`).
        seed: ``--seed``.
        device: ``--device``.
        site: ``--site`` (named in the probe description only).

    Returns:
        ``(model, inputs, targets, loss_fn, layout, sites, probe description)``.

    Raises:
        UserError: what :func:`diagnose_target` refuses, or batches that are not ``(inputs, targets)`` tensors.
    """
    target = diagnose_target(model, seed, None, None, device=device)
    pairs = [b for b in target.batches if isinstance(b, (tuple, list)) and len(b) == 2]
    if len(pairs) != len(target.batches) or not all(isinstance(t, torch.Tensor) for b in pairs for t in b):
        raise UserError(
            f"--model {model}: audit needs (inputs, targets) tensor batches; keyword (Hugging Face) or masked "
            f"batches are for depthsat diagnose"
        )
    x, y = (torch.cat([b[i] for b in pairs]) for i in (0, 1))
    x, y = (t.to(torch.float64) if t.is_floating_point() else t for t in (x, y))
    net = copy.deepcopy(target.model).to(torch.float64)
    label = f"{target.description} (audited in float64), {x.shape[0]} examples, site {site}"
    return net, x, y, target.loss_fn, target.layout, target.sites, label


def model_sites(net: Any, x: torch.Tensor) -> list[str] | None:
    """The model's valid sites for the audit: its ``site_names()``, else discovered, else ``None`` (any module).

    Args:
        net: the model.
        x: an input batch for the site discovery.

    Returns:
        The site names, or ``None`` when discovery fails (every module is then allowed).
    """
    from depthsat_theory.diagnose import DiagnoseError, discover_sites

    if callable(getattr(net, "site_names", None)):
        return list(net.site_names())
    try:
        return discover_sites(net, x)
    except DiagnoseError:
        return None


def parse_device(device: str) -> torch.device:
    """``--device`` as a ``torch.device`` (:func:`~depthsat_theory.tasks.custom.resolve_device`).

    Args:
        device: ``cpu``, ``cuda`` or ``auto``.

    Returns:
        The resolved ``torch.device``.

    Raises:
        UserError: an unknown device, or CUDA where there is none.
    """
    from depthsat_theory.tasks.custom import ModelSpecError, resolve_device

    try:
        return resolve_device(device)
    except ModelSpecError as exc:
        raise UserError(respell(str(exc), MODEL_FLAGS)) from None
