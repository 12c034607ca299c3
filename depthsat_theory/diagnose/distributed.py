"""Sharded probes under ``torchrun``: all-reduce streamed statistics (``depthsat diagnose``).

Every statistic :mod:`depthsat_theory.diagnose.run` streams declares each state field
with its reduction (:class:`~depthsat_theory.statistics.StreamingStatistic`): a *sum* over
probe examples (``Σ``, ``G``, ``Σ_x G_xᵀ G_x``, ``K``, ``b``, counts, ``Σ‖g‖²``,
``Σ‖z‖²``, the loss total) or a *maximum* (``AG_max``, the largest feature norm).  A probe
split into shards therefore gives the statistics of the whole probe after one ``SUM``
all-reduce of the sums and one ``MAX`` all-reduce of the maxima
(:func:`allreduce_statistics`); only the optional exact-tie pooling (``r̂``, ``ρ̂``) needs
an all-gather of its per-unit table.

Sharding convention: with ``N`` processes, rank ``r`` takes the probe batches of
global index ``r, r + N, r + 2N, …``.  The reduced numbers equal a single process's
up to floating-point summation order (relative differences ~1e-15).

Backends: ``gloo`` on CPU, ``nccl`` when CUDA is available (tensors are moved to the
current CUDA device for the collective and back to float64 CPU).  The nccl path has
not been run on a GPU in this project's tests (they use gloo on CPU).

Errors: a rank that fails (a NaN loss on its shard, say) prints its one-line error and
exits; the other ranks then fail in the collective (or wait for ``torchrun``'s timeout).
"""

from __future__ import annotations

import atexit
import copy
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from depthsat_theory.statistics import Reduction, StreamingStatistic

__all__ = ["all_gather_objects", "allreduce", "allreduce_statistics", "barrier", "init_from_env", "is_main", "world"]


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` when there is none.

    Returns:
        ``(rank, world_size)``.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    """``True`` on rank 0 (and in a single process): the rank that prints and writes.

    Returns:
        Whether this process is rank 0.
    """
    return world()[0] == 0


def init_from_env(backend: str | None = None) -> bool:
    """Join the process group described by ``torchrun``'s environment, if any.

    Reads ``WORLD_SIZE``/``RANK``/``MASTER_ADDR``/``MASTER_PORT`` (set by ``torchrun``).
    Does nothing when ``WORLD_SIZE`` is unset or ``1``, or when a group exists already. A group
    created here is destroyed at interpreter exit.

    Args:
        backend: ``"gloo"`` or ``"nccl"`` (default: ``nccl`` if CUDA is available,
            else ``gloo``).

    Returns:
        ``True`` if this process is part of a group of more than one process.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend)
    atexit.register(_destroy)  # a group left alive at exit can abort the process (std::terminate in gloo)
    return True


def _destroy() -> None:
    """Tear down the group this module created (registered with :mod:`atexit`)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def allreduce(sums: Tensor, maxima: Tensor) -> tuple[Tensor, Tensor]:
    """All-reduce a float64 vector of sums (``SUM``) and one of maxima (``MAX``).

    Args:
        sums: 1-D float64 tensor (counts are carried exactly up to 2⁵³).
        maxima: 1-D float64 tensor.

    Returns:
        The reduced ``(sums, maxima)`` as float64 CPU tensors (the inputs unchanged
        in a single process).
    """
    if world()[1] == 1:
        return sums, maxima
    dev = _device()
    s = sums.detach().to(dev, torch.float64).contiguous()
    m = maxima.detach().to(dev, torch.float64).contiguous()
    dist.all_reduce(s, op=dist.ReduceOp.SUM)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    return s.cpu(), m.cpu()


def all_gather_objects(obj) -> Sequence:
    """Every rank's ``obj`` in rank order (``[obj]`` in a single process).

    Args:
        obj: a picklable object.

    Returns:
        A list of ``world_size`` objects, index = rank.
    """
    if world()[1] == 1:
        return [obj]
    out: list = [None] * world()[1]
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if world()[1] > 1:
        dist.barrier()


def allreduce_statistics(stats: Sequence[StreamingStatistic]) -> None:
    """Reduce streaming statistics over every rank, in place, from their declared reductions.

    All fixed-size ``SUM`` fields of all statistics travel in one float64 ``SUM``
    all-reduce and all ``MAX`` fields in one ``MAX`` all-reduce
    (:meth:`~depthsat_theory.statistics.StreamingStatistic.reductions`); variable-size
    children (the exact-tie pools) are all-gathered and merged in rank order.  Every
    rank must pass statistics of the same configuration in the same order.  A no-op in
    a single process.

    Args:
        stats: the statistics of this rank (e.g. one per site, plus the loss total).
    """
    if world()[1] == 1:
        return
    parts: dict[Reduction, list[tuple[int, str, Tensor]]] = {Reduction.SUM: [], Reduction.MAX: []}
    for i, st in enumerate(stats):
        state = st.state_dict()
        for name, red in st.reductions().items():
            parts[red].append((i, name, state[name].to(torch.float64)))
    flat = {red: torch.cat([v.reshape(-1) for _, _, v in p]) if p else torch.zeros(0) for red, p in parts.items()}
    flat[Reduction.SUM], flat[Reduction.MAX] = allreduce(flat[Reduction.SUM], flat[Reduction.MAX])
    new: list[dict[str, Tensor]] = [{} for _ in stats]
    for red, p in parts.items():
        off = 0
        for i, name, v in p:
            new[i][name] = flat[red][off : off + v.numel()].reshape(v.shape).to(v.dtype)
            off += v.numel()
    for st, state in zip(stats, new, strict=True):
        st.load_state_dict(state, strict=False)
    pools = [st.variable_size_children() for st in stats]
    if not any(pools):
        return
    gathered = all_gather_objects([{path: child.state_dict() for path, child in pool.items()} for pool in pools])
    for i, pool in enumerate(pools):
        for path, child in pool.items():
            child.reset()
            for per_rank in gathered:
                part = copy.deepcopy(child)
                part.load_state_dict(per_rank[i][path])
                child.merge(part)
