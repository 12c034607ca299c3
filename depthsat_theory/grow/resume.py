"""Resumable training after growth: a batch schedule fixed in advance and an atomic training checkpoint.

A training run of ``steps`` steps takes the probe batches in a schedule fixed before the first
step (:func:`batch_schedule`), so a run can stop after any step and continue from there.  A
:class:`TrainCheckpoint` file (one safetensors file, written atomically) holds everything the
next steps depend on: the trainable parameters, the optimizer state, the step, the losses so
far, the torch RNG state, and a fingerprint of the run (steps, learning rate, schedule, new
sites) that a resumed run must match.  Continuing from a checkpoint written after step ``s``
gives bitwise the weights of an uninterrupted run on a deterministic device (CPU).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from depthsat_theory.grow.errors import GrowError
from depthsat_theory.io import atomic_write

__all__ = ["TrainCheckpoint", "batch_schedule"]

_FORMAT = "depthsat-grow-train-checkpoint/1"


def batch_schedule(steps: int, n_batches: int, seed: int, sampling: str) -> list[int]:
    """The batch index of every training step, fixed before training.

    Args:
        steps: the number of steps.
        n_batches: the number of probe batches (``≥ 1``).
        seed: seed of the random order.
        sampling: ``"sequential"`` (``0, 1, …, n−1, 0, 1, …``) or ``"random"`` (a fresh random
            permutation of the batches per pass, ``torch.randperm`` with a generator seeded ``seed``).

    Returns:
        ``steps`` batch indices in ``0 .. n_batches − 1``.

    Raises:
        GrowError: an unknown ``sampling`` or no batches.
    """
    if n_batches < 1:
        raise GrowError("no probe batches to train on")
    if sampling == "sequential":
        return [s % n_batches for s in range(steps)]
    if sampling != "random":
        raise GrowError(f"unknown sampling {sampling!r}; use 'random' or 'sequential'")
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while len(order) < steps:
        order.extend(int(i) for i in torch.randperm(n_batches, generator=gen))
    return order[:steps]


def _trainable(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, nn.Parameter]:
    """The model's parameters that the optimizer updates, by name."""
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    return {n: p for n, p in model.named_parameters() if id(p) in ids}


@dataclass
class TrainCheckpoint:
    """The state of an interrupted training run, in one safetensors file (``--checkpoint PATH``).

    Attributes:
        path: the checkpoint file.
        fingerprint: what the run was (steps, lr, schedule, new sites, ...): a resumed run must match it.
        step: steps done when it was written.
        losses: the training loss of each step done (on the step's batch, before its update).
    """

    path: Path
    fingerprint: dict
    step: int = 0
    losses: list[float] = field(default_factory=list)

    def save(self, model: nn.Module, opt: torch.optim.Optimizer, step: int, losses: Sequence[float]) -> None:
        """Write the checkpoint after ``step`` steps, atomically (readers see the old file or the new one).

        Args:
            model: the model being trained (its trainable parameters are written).
            opt: its optimizer (state tensors and parameter groups are written).
            step: steps done.
            losses: the losses of those steps.
        """
        from safetensors.torch import save

        self.step, self.losses = step, list(losses)
        tensors: dict[str, Tensor] = {
            f"param/{n}": p.detach().contiguous().cpu() for n, p in _trainable(model, opt).items()
        }
        sd = opt.state_dict()
        scalars: dict[str, dict] = {}
        for idx, st in sd["state"].items():
            for k, v in st.items():
                if isinstance(v, Tensor):
                    tensors[f"optim/{idx}/{k}"] = v.detach().contiguous().cpu()
                else:
                    scalars.setdefault(str(idx), {})[k] = v
        tensors["rng/torch"] = torch.get_rng_state()
        meta = {
            "format": _FORMAT,
            "fingerprint": self.fingerprint,
            "step": step,
            "losses": list(losses),
            "param_groups": sd["param_groups"],
            "scalars": scalars,
        }
        data = save(tensors, metadata={"depthsat": json.dumps(meta, allow_nan=True)})
        atomic_write(self.path, lambda fh: fh.write(data), binary=True)

    def restore(self, model: nn.Module, opt: torch.optim.Optimizer) -> bool:
        """Load the checkpoint into ``model`` and ``opt`` if the file exists.

        Args:
            model: the freshly grown model (same structure as the one saved).
            opt: its freshly built optimizer.

        Returns:
            ``True`` when a checkpoint was loaded (then :attr:`step` and :attr:`losses` are set),
            ``False`` when there is no file yet.

        Raises:
            GrowError: the file is not such a checkpoint, or it was written by a different run
                (the differing fingerprint field is named).
        """
        if not self.path.exists():
            return False
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(self.path))
            meta = json.loads(_metadata(self.path).get("depthsat", "{}"))
        except (SafetensorError, OSError, ValueError) as exc:
            raise GrowError(
                f"--checkpoint {self.path} is not a grow checkpoint ({type(exc).__name__}: {exc})"
            ) from None
        if meta.get("format") != _FORMAT:
            raise GrowError(f"--checkpoint {self.path} is not a grow training checkpoint; give a new path")
        for key, want in self.fingerprint.items():
            got = meta["fingerprint"].get(key)
            if got != want:
                raise GrowError(
                    f"--checkpoint {self.path} was written by another run ({key} {got!r}, now {want!r}); "
                    f"rerun with the same options or give a new path"
                )
        params = _trainable(model, opt)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(tensors[f"param/{n}"])
        state: dict[int, dict] = {}
        for key, t in tensors.items():
            if key.startswith("optim/"):
                _, idx, k = key.split("/", 2)
                state.setdefault(int(idx), {})[k] = t
        for idx, extra in meta["scalars"].items():
            state.setdefault(int(idx), {}).update(extra)
        opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        torch.set_rng_state(tensors["rng/torch"])
        self.step, self.losses = int(meta["step"]), [float(v) for v in meta["losses"]]
        return True

    @staticmethod
    def fingerprint_of(**fields: Any) -> dict:
        """A JSON round-trip of ``fields`` (so a saved and a fresh fingerprint compare equal).

        Args:
            **fields: JSON-serialisable run settings.

        Returns:
            The fields after ``json.loads(json.dumps(...))``.
        """
        return json.loads(json.dumps(fields))


def _metadata(path: os.PathLike) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return fh.metadata() or {}
