"""One protocol for every streaming statistic: declared state, ``update``, ``merge``, ``result``.

A streaming statistic (:class:`StreamingStatistic`) declares each piece of its state once,
with the reduction that combines two shards of a probe (:class:`Reduction`): ``SUM`` for
sums over examples (``Σ``, ``G``, ``K``, ``b``, counts, ``Σ‖g‖²``), ``MAX`` for maxima
(``AG_max``).  This mirrors ``torchmetrics.Metric.add_state(name, default,
dist_reduce_fx=...)``.  Everything else is generic code over the declaration:
:meth:`StreamingStatistic.merge`, :meth:`~StreamingStatistic.state_dict` /
:meth:`~StreamingStatistic.load_state_dict` (checkpoints, resume) and the torchrun
all-reduce (:func:`depthsat_theory.diagnose.distributed.allreduce_statistics`).

A statistic may hold *children* (other statistics, e.g. the exact-tie pool
:class:`TiePool` of the tangent statistics); their state appears under
``"<child>.<name>"``.  A statistic whose state has no fixed size (:class:`TiePool`: one
row per distinct unit) sets ``fixed_size = False``: it is reduced across processes by
gathering the state dicts and merging them, not by an all-reduce.

Why not ``torchmetrics.Metric`` itself: (1) its distributed sync all-gathers every state
and reduces locally (``dist_sync_fn`` is an all-gather), so each rank would hold
``world_size`` copies of every ``k̃ × k̃`` Gram and ``d × k̃`` cross-gradient, with one
collective per state and site, where ``diagnose`` needs one ``SUM`` and one ``MAX``
all-reduce of one flat float64 vector for all sites; (2) the exact-tie pool is a table
keyed by the unit's bytes and de-duplicated at every update, which a list (``"cat"``)
state would keep row by row until ``compute`` (memory ``O(units)`` instead of
``O(distinct units)``); (3) ``Metric`` is an ``nn.Module`` that wraps ``update`` and
caches ``compute()``, while ``result(rtol=..., tol=...)`` takes arguments and may be
called repeatedly.  The protocol below is the part of its design we need.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

import torch
from torch import Tensor

__all__ = ["Reduction", "StreamingStatistic", "TiePool"]


class Reduction(str, Enum):
    """How one state field of two shards combines: ``SUM`` (sums over examples) or ``MAX``."""

    SUM = "sum"
    MAX = "max"


class StreamingStatistic:
    """Base class of the streaming statistics: state declared once, merged and saved generically.

    Subclasses call :meth:`add_state` in ``__init__`` for every tensor of their state
    (float64, any shape fixed at construction; the tensors live in :attr:`states`),
    :meth:`add_child` for nested statistics,
    and implement ``update(...)`` and ``result(...)``.  They may override
    :meth:`check_compatible` (called by :meth:`merge`).

    Attributes:
        states: name → state tensor, as declared by :meth:`add_state` (updated in place or
            replaced by subclasses' ``update``).
        fixed_size: (class attribute) ``True`` when every state tensor has a size fixed
            at construction (all-reducible); ``False`` for statistics such as :class:`TiePool`.
    """

    fixed_size: bool = True

    def __init__(self) -> None:
        self.states: dict[str, Tensor] = {}
        self._reductions: dict[str, Reduction] = {}
        self._defaults: dict[str, Tensor] = {}
        self._children: dict[str, StreamingStatistic] = {}

    # ------------------------------------------------------------------ declaration
    def add_state(self, name: str, default: Tensor, reduction: Reduction | str) -> None:
        """Declare a state tensor ``states[name]`` with its default and reduction.

        Args:
            name: attribute name (no ``"."``).
            default: the initial value (cloned; kept to :meth:`reset`).
            reduction: ``"sum"`` or ``"max"`` (:class:`Reduction`).

        Raises:
            ValueError: on a duplicate or dotted name, or an unknown reduction.
        """
        if "." in name or name in self._reductions or name in self._children:
            raise ValueError(f"state name {name!r} is dotted or declared twice")
        self._reductions[name] = Reduction(reduction)
        base = default.detach()
        # an all-zero default is kept as a zero-stride view (no memory: a k̃ × k̃ Gram would otherwise be held
        # twice); reset() clones it into a fresh contiguous tensor
        zero = base.numel() > 1 and not bool(base.any())
        self._defaults[name] = (
            torch.zeros((), dtype=base.dtype, device=base.device).expand(base.shape) if zero else base.clone()
        )
        self.states[name] = base.clone()

    def add_child(self, name: str, child: StreamingStatistic) -> None:
        """Declare a nested statistic whose state is saved and merged under ``"<name>."``.

        Args:
            name: the child's name (no dot, not already a field or child).
            child: the nested statistic.

        Raises:
            ValueError: for a dotted or repeated name.
        """
        if "." in name or name in self._reductions or name in self._children:
            raise ValueError(f"child name {name!r} is dotted or declared twice")
        self._children[name] = child

    def child(self, name: str) -> StreamingStatistic:
        """The nested statistic declared as ``name`` by :meth:`add_child`.

        Args:
            name: the name given to :meth:`add_child`.

        Returns:
            The nested statistic.

        Raises:
            KeyError: for an undeclared name.
        """
        return self._children[name]

    def reductions(self) -> dict[str, Reduction]:
        """The fixed-size state fields and their reductions, children's as ``"child.name"``.

        Returns:
            ``{field: Reduction}`` (empty of own fields when ``fixed_size`` is false).
        """
        out = dict(self._reductions) if self.fixed_size else {}
        for cname, child in self._children.items():
            out.update({f"{cname}.{k}": v for k, v in child.reductions().items()})
        return out

    def variable_size_children(self) -> dict[str, StreamingStatistic]:
        """Nested statistics (at any depth, dotted paths) whose state has no fixed size.

        Returns:
            ``{dotted path: statistic}``.
        """
        out: dict[str, StreamingStatistic] = {}
        for cname, child in self._children.items():
            if not child.fixed_size:
                out[cname] = child
            out.update({f"{cname}.{k}": v for k, v in child.variable_size_children().items()})
        return out

    # ------------------------------------------------------------------ generic operations
    def check_compatible(self, other: StreamingStatistic) -> None:
        """Raise if ``other`` cannot be merged into ``self`` (default: its type or a subclass, same shapes).

        A subclass instance may be merged into its base: only the base's state is added.

        Args:
            other: the statistic to merge.

        Raises:
            TypeError: for another statistic type.
            ValueError: for state tensors of other shapes.
        """
        if not isinstance(other, type(self)):
            raise TypeError(f"cannot merge {type(other).__name__} into {type(self).__name__}")
        for name in self._reductions:
            a, b = self.states[name], other.states[name]
            if a.shape != b.shape:
                raise ValueError(f"state {name!r} has shape {tuple(b.shape)}, expected {tuple(a.shape)}")

    def merge(self, other: Any) -> Any:
        """Add another shard's state: ``SUM`` fields add, ``MAX`` fields take the maximum.

        Args:
            other: a statistic of the same type and configuration.

        Returns:
            ``self``.

        Raises:
            TypeError, ValueError: from :meth:`check_compatible`.
        """
        self.check_compatible(other)
        for name, red in self._reductions.items():
            mine = self.states[name]
            theirs = other.states[name].to(mine.device)
            self.states[name] = mine + theirs if red is Reduction.SUM else torch.maximum(mine, theirs)
        for cname, child in self._children.items():
            child.merge(other.child(cname))
        return self

    def reset(self) -> None:
        """Return every state field (and child) to its default."""
        for name, default in self._defaults.items():
            self.states[name] = default.clone(memory_format=torch.contiguous_format)
        for child in self._children.values():
            child.reset()

    def state_dict(self) -> dict[str, Tensor]:
        """The state as detached float64/int64 CPU tensors, children's under ``"child.name"``.

        Returns:
            ``{field: tensor}`` (copies), children's fields as ``"child.field"``.
        """
        out = {name: self.states[name].detach().cpu().clone() for name in self._reductions}
        for cname, child in self._children.items():
            out.update({f"{cname}.{k}": v for k, v in child.state_dict().items()})
        return out

    def load_state_dict(self, state: Mapping[str, Tensor], *, strict: bool = True) -> None:
        """Replace the state by ``state`` (as written by :meth:`state_dict`).

        Args:
            state: name → tensor; each tensor is reshaped to the declared field's shape and
                moved to the field's device.
            strict: require every declared fixed-size field to be present (an absent
                variable-size child then becomes empty); with ``strict=False`` absent
                fields and children keep their values.

        Raises:
            KeyError: a missing field with ``strict=True``.
            ValueError: a tensor with the wrong number of elements.
        """
        for name in self._reductions:
            if name not in state:
                if strict:
                    raise KeyError(f"state field {name!r} missing")
                continue
            old = self.states[name]
            val = state[name]
            if val.numel() != old.numel():
                raise ValueError(f"state field {name!r} has {val.numel()} elements, expected {old.numel()}")
            self.states[name] = val.detach().reshape(old.shape).to(old.device, old.dtype).clone()
        for cname, child in self._children.items():
            prefix = f"{cname}."
            sub = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            if sub or strict:  # a partial load leaves children without entries untouched
                child.load_state_dict(sub, strict=strict)


class TiePool(StreamingStatistic):
    """Exact-tie pooling: for every distinct unit ``u`` the sum of its values and its count.

    Used for the raw score ``r̂ = ‖m̂‖`` and the realizability defect ``ρ̂``
    (theory/definitions.md: ``m̂(u)`` is the mean of ``g`` over the probe's units equal
    to ``u``).  Units are compared bit for bit (``-0.0`` equals ``0.0``).  Memory grows
    with the number of distinct units; ``fixed_size = False``, so it is reduced across
    processes by gathering and merging.

    The state dict holds ``units`` ``(M, a)`` float64, ``sums`` ``(M, b)`` float64 and
    ``counts`` ``(M,)`` int64 in insertion order (empty when nothing was pooled).
    """

    fixed_size = False

    def __init__(self) -> None:
        super().__init__()
        self._table: dict[bytes, list] = {}

    def __len__(self) -> int:
        return len(self._table)

    def _add(self, key_unit: Tensor, total: Tensor, count: int) -> None:
        # float64 holds every bfloat16/float16/float32 value exactly, so equal float64 bytes are equal units
        # (numpy has no bfloat16: keying by the unit's own bytes raised a TypeError); + 0.0 maps -0.0 to 0.0
        unit = key_unit.detach().cpu().to(torch.float64) + 0.0
        key = unit.numpy().tobytes()
        slot = self._table.get(key)
        if slot is None:
            self._table[key] = [total.clone(), count, unit]
        else:
            slot[0] += total
            slot[1] += count

    def update(self, units: Tensor, values: Tensor) -> None:
        """Pool rows: ``units`` ``(N, a)`` (the keys) and ``values`` ``(N, b)`` float64.

        Args:
            units: the keys, ``(N, a)``, any floating dtype (bfloat16 included); rows are compared by value
                (``-0.0`` equals ``0.0``) and stored in float64, which holds every such value exactly.
            values: the values, ``(N, b)`` float64.
        """
        zc = units.detach().cpu().contiguous()
        uniq, inv = torch.unique(zc, dim=0, return_inverse=True)
        sums = torch.zeros(uniq.shape[0], values.shape[1], dtype=torch.float64).index_add_(0, inv, values.cpu())
        counts = torch.bincount(inv, minlength=uniq.shape[0]).tolist()
        for j in range(uniq.shape[0]):
            self._add(uniq[j], sums[j], counts[j])

    def merge(self, other: Any) -> Any:
        """Add another pool's units (equal units pool); returns ``self``.

        Args:
            other: another :class:`TiePool`.

        Returns:
            ``self``.

        Raises:
            TypeError: for another type.
            ValueError: if the pools' ``(unit, value)`` widths differ.
        """
        if not isinstance(other, TiePool):
            raise TypeError(f"cannot merge {type(other).__name__} into TiePool")
        mine, theirs = self._widths(), other._widths()
        if mine and theirs and mine != theirs:
            raise ValueError(f"cannot merge a tie pool of (unit, value) widths {theirs} into one of {mine}")
        for s, c, u in other._table.values():
            self._add(u, s, c)
        return self

    def reset(self) -> None:
        """Forget every pooled unit."""
        self._table = {}

    def _widths(self) -> tuple[int, int] | None:
        """``(unit width, value width)`` of the pooled rows; ``None`` when empty."""
        for total, _, unit in self._table.values():
            return int(unit.numel()), int(total.numel())
        return None

    def result(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(units (M, a), means (M, b), counts (M,))`` float64 (``M = 0``: empty tensors).

        ``means[j]`` is ``m̂(units[j])``, the mean value over the rows equal to ``units[j]``.

        Returns:
            The triple ``(units, means, counts)``.
        """
        sd = self.state_dict()
        if not sd:
            empty = torch.zeros(0, dtype=torch.float64)
            return empty.reshape(0, 0), empty.reshape(0, 0), empty
        counts = sd["counts"].to(torch.float64)
        return sd["units"].to(torch.float64), sd["sums"] / counts[:, None], counts

    def state_dict(self) -> dict[str, Tensor]:
        """``{"units", "sums", "counts"}`` (an empty dict when nothing was pooled).

        Returns:
            ``units`` ``(M, a)``, ``sums`` ``(M, b)`` float64 and ``counts`` ``(M,)`` int64, in insertion order.
        """
        if not self._table:
            return {}
        vals = list(self._table.values())
        return {
            "sums": torch.stack([s for s, _, _ in vals]).contiguous(),
            "counts": torch.tensor([c for _, c, _ in vals], dtype=torch.int64),
            "units": torch.stack([u for _, _, u in vals]).contiguous(),
        }

    def load_state_dict(self, state: Mapping[str, Tensor], *, strict: bool = True) -> None:
        """Replace the pool by ``state`` (missing keys: an empty pool).

        Args:
            state: ``{"units", "sums", "counts"}`` as written by :meth:`state_dict`.
            strict: unused (accepted for the :class:`StreamingStatistic` interface).
        """
        self._table = {}
        if "units" not in state:
            return
        units, sums, counts = state["units"], state["sums"], state["counts"]
        for j in range(units.shape[0]):
            self._add(units[j], sums[j], int(counts[j].item()))
