"""Deepen a residual MLP with zero-output blocks of its own kind, into the architecture built from scratch.

:func:`deepen` inserts new :class:`~depthsat_theory.tasks.models.MLPBlock` s into
``model.blocks`` whose output layer ``W2`` (weight and bias) is zero, so each new block is the
identity ``x + 0`` and the network computes the same function (``def-family``: a zero-output
insertion).  The grown model is a :class:`~depthsat_theory.tasks.models.ResidualMLP` of the
larger depth, the same architecture (same ``state_dict`` keys and shapes) as one built from
scratch, which is what growth-against-scratch compares (the paper's claim C2).  Function preservation
is checked with the library's check (:func:`depthsat_theory.grow._check.check_preserved`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from depthsat_theory.grow._check import check_preserved, reference_output
from depthsat_theory.grow.errors import GrowError
from depthsat_theory.tasks.models import BLOCK_ACTIVATIONS, MLPBlock, ResidualMLP

__all__ = ["Deepened", "deepen", "interleaved_positions"]


@dataclass
class Deepened:
    """The result of :func:`deepen`.

    Attributes:
        model: the grown :class:`ResidualMLP` (a copy; the original is not modified).
        positions: where each new block sits in the grown ``model.blocks``.
        new_params: the new blocks' parameters (to count or to give an optimizer).
        deviation: ``max |f(x) − f_grown(x)|`` on the probe (logit units).
        tolerance: the allowed deviation of the library's check.
    """

    model: ResidualMLP
    positions: list[int]
    new_params: list[nn.Parameter] = field(default_factory=list)
    deviation: float = 0.0
    tolerance: float = 0.0


def interleaved_positions(depth: int, new: int) -> list[int]:
    """Insertion points spreading ``new`` blocks evenly among ``depth`` old ones.

    Position ``i`` means "after old block ``i``" (``i = 0..depth-1``), taken as
    ``⌈(j + 1) depth / new⌉ − 1`` for ``j = 0..new-1`` (LLaMA-Pro's even spacing when
    ``new ≤ depth``; with more new blocks than old ones, several follow one old block).

    Args:
        depth: number of old blocks.
        new: number of new blocks.

    Returns:
        ``new`` non-decreasing positions in ``0..depth-1``, the last ``depth − 1``.

    Raises:
        GrowError: ``depth < 1`` or ``new < 1``.
    """
    if depth < 1 or new < 1:
        raise GrowError(f"need depth >= 1 and new >= 1 blocks, got depth={depth}, new={new}")
    return [-(-(j + 1) * depth // new) - 1 for j in range(new)]


def _activation_name(block: MLPBlock) -> str:
    for name, cls in BLOCK_ACTIVATIONS.items():
        if type(block.act) is cls:
            return name
    raise GrowError(f"block activation {type(block.act).__name__} is not one of {sorted(BLOCK_ACTIVATIONS)}")


def _zero_block(template: MLPBlock, seed: int) -> MLPBlock:
    """A fresh block shaped like ``template``: default-initialised ``LN``, ``W1``; ``W2 = 0``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        block = MLPBlock(template.W1.in_features, template.W1.out_features, _activation_name(template))
    block.to(dtype=template.W1.weight.dtype, device=template.W1.weight.device)
    with torch.no_grad():
        block.W2.weight.zero_()
        block.W2.bias.zero_()
    return block


def deepen(model: nn.Module, after: Sequence[int], probe: Tensor, *, seed: int = 0) -> Deepened:
    """Insert one zero-output :class:`MLPBlock` after each old block named in ``after``.

    Args:
        model: a trained :class:`ResidualMLP` with at least one block (not modified).
        after: indices of old blocks (``0..depth-1``; ``-1``: after the embedding, before block 0),
            one per new block; repeats put several new blocks after the same old block.
        probe: inputs ``(B, in_dim)`` on which function preservation is checked.
        seed: torch seed for the new blocks' ``W1`` (block ``j`` uses ``seed + j``).

    Returns:
        A :class:`Deepened`: the grown ``ResidualMLP`` of depth ``depth + len(after)``.

    Raises:
        GrowError: a model that is not a ``ResidualMLP`` with blocks, or an index out of range.
        NotFunctionPreservingError: the grown model's output moved beyond the library's tolerance.
    """
    if not isinstance(model, ResidualMLP) or len(model.blocks) == 0:
        raise GrowError("deepen takes a ResidualMLP with at least one block")
    depth = len(model.blocks)
    bad = [i for i in after if not -1 <= int(i) < depth]
    if bad or not after:
        raise GrowError(f"after: give 1 or more old block indices in -1..{depth - 1}, got {list(after)}")
    ref = reference_output(model, probe)
    grown = copy.deepcopy(model)
    template = grown.blocks[0]
    assert isinstance(template, MLPBlock)
    blocks: list[nn.Module] = []
    positions: list[int] = []
    new_params: list[nn.Parameter] = []
    order = sorted(int(i) for i in after)
    for i, old in [(-1, None), *enumerate(grown.blocks)]:
        if old is not None:
            blocks.append(old)
        for _ in range(order.count(i)):
            new = _zero_block(template, seed + len(positions))
            positions.append(len(blocks))
            blocks.append(new)
            new_params.extend(new.parameters())
    grown.blocks = nn.ModuleList(blocks)
    grown.train(model.training)
    deviation, tol = check_preserved(ref, grown, probe)
    return Deepened(grown, positions, new_params, deviation, tol)
