"""Diagnose checkpoints: the statistics' state dicts in one safetensors file with a JSON header.

A checkpoint holds, for every statistic ``key`` (a site, or :data:`LOSS_KEY` for the
loss total), the tensors of
:meth:`~depthsat_theory.statistics.StreamingStatistic.state_dict` under ``"<key>/<name>"``,
and a JSON header (metadata key ``depthsat_diagnose``) with the configuration that must
match to resume, the number of batches consumed, the site shapes and a completion flag.
Files are written atomically (no pickle).

Format versions: ``1`` (before the statistics protocol: hand-listed fields, a ``dtype``
code) is refused with a one-line :class:`CheckpointError`; ``2`` is the current one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from depthsat_theory.diagnose.errors import CheckpointError
from depthsat_theory.io import atomic_write
from depthsat_theory.statistics import StreamingStatistic

__all__ = [
    "CHECKPOINT_VERSION",
    "LOSS_KEY",
    "check_version",
    "config_diff",
    "model_fingerprint",
    "read_checkpoint",
    "restore_statistics",
    "write_checkpoint",
]

#: Version of the checkpoint format written by :func:`write_checkpoint`.
CHECKPOINT_VERSION = 2

#: Key of the loss-total statistic in a checkpoint (not a module name: ``@`` cannot start one).
LOSS_KEY = "@loss"


def model_fingerprint(model: nn.Module) -> dict:
    """Class name, parameter count and ``Σ|θ|`` (12 digits) of a model, to refuse resuming another one."""
    with torch.no_grad():
        params = list(model.parameters())
        total = sum(float(p.detach().to(torch.float64).abs().sum()) for p in params)
    return {
        "class": type(model).__name__,
        "parameters": int(sum(p.numel() for p in params)),
        "abs_sum": f"{total:.12e}",
    }


def read_checkpoint(path: str | os.PathLike) -> tuple[dict, dict[str, Tensor]]:
    """Read a diagnose checkpoint: its JSON header and its tensors.

    The header has ``config`` (what must match to resume, including ``version``),
    ``batches`` (global batch index of the next batch to process: batches ``< batches``
    are in the sums), ``examples`` (this rank's examples in the sums), ``shapes`` and
    ``complete``.

    Raises:
        CheckpointError: if the file is not a readable diagnose checkpoint.
    """
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    try:
        with safe_open(os.fspath(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: not a readable safetensors file ({exc})") from None
    if "depthsat_diagnose" not in meta:
        raise CheckpointError(f"checkpoint {path}: not a depthsat diagnose checkpoint")
    try:
        header = json.loads(meta["depthsat_diagnose"])
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"checkpoint {path}: its header is not valid JSON ({exc})") from None
    if (
        not isinstance(header, dict)
        or not isinstance(header.get("config"), dict)
        or not isinstance(header.get("batches"), int)
        or not isinstance(header.get("shapes", {}), dict)
    ):
        raise CheckpointError(
            f"checkpoint {path}: malformed header (needs a 'config' object, an integer 'batches' "
            f"and a 'shapes' object); delete it or pass another checkpoint path"
        )
    return header, tensors


def check_version(path: str | os.PathLike, header: dict) -> None:
    """Refuse a checkpoint of another format version with a one-line :class:`CheckpointError`."""
    version = header.get("config", {}).get("version")
    if version != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {version}, this depthsat reads version "
            f"{CHECKPOINT_VERSION} only; delete it or pass another checkpoint path to start over"
        )


def write_checkpoint(path: Path, header: dict, stats: Mapping[str, StreamingStatistic]) -> None:
    """Write ``stats`` (key → statistic) and ``header`` atomically to ``path``."""
    from safetensors.torch import save

    tensors = {f"{key}/{name}": v.contiguous() for key, st in stats.items() for name, v in st.state_dict().items()}
    blob = save(tensors, metadata={"depthsat_diagnose": json.dumps(header, sort_keys=True)})
    atomic_write(path, lambda fh: fh.write(blob), binary=True)


def restore_statistics(stats: Mapping[str, StreamingStatistic], tensors: Mapping[str, Tensor]) -> None:
    """Load every statistic's state from the tensors of :func:`read_checkpoint`.

    Raises:
        CheckpointError: if a statistic's state is missing or malformed.
    """
    for key, st in stats.items():
        prefix = f"{key}/"
        try:
            st.load_state_dict({k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)})
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"checkpoint state of {key!r} is incomplete or malformed ({exc})") from None


def config_diff(a: dict, b: dict) -> list[str]:
    """The keys on which two configurations differ, sorted; nested objects as ``key.subkey``."""
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if va == vb:
            continue
        if isinstance(va, dict) and isinstance(vb, dict):
            out += [f"{k}.{sub}" for sub in config_diff(va, vb)]
        else:
            out.append(k)
    return out
