"""Exact ties at kinks downstream of insertion sites (theory/gradient.md, ``thm-gradient``).

T1 identifies autograd's gradient of an inserted block with ``b = ∇_θ J(0)`` only when every
elementary operation between the site and the loss is differentiable at its forward value.
A piecewise-linear primitive evaluated *exactly* at its kink (``relu(0)``, ``abs(0)``, a tie
in a max) breaks this: autograd then returns a one-sided convention, and a saturated verdict
can be wrong (``ex-kink-tie``: ``relu(z) − relu(−z)`` at ``z = 0`` gives autograd ``b = 0``
while ``J(θ) = θ``).  :class:`KinkCounter` counts, per site, the elements that sit exactly at
a kink in the operations that depend on the site's output in the same forward pass (and in
the loss), on tensors that require gradients.

Ties are attributed by data flow: each tensor of the forward pass carries the set of sites it
depends on, and a tie counts for the sites its operands depend on (an operation after a site in
execution order that does not depend on it is not counted for it).  Selections are covered through
the comparison that builds them: ``x > c``, ``x == c`` … count the elements exactly at ``c``, which
catches ``torch.where(z > 0, …)``, masks ``z * (z > 0)`` and hand-made kinks; ``sign``/``heaviside``
count zeros (``z * sign(z) = |z|``), ``floor``/``ceil``/``trunc``/``frac`` integers, ``round``
half-integers, ``sort``/``argsort``/``median``/``kthvalue``/``mode`` every tie along the sorted
dimension, ``topk`` ties among the ``k + 1`` best, ``argmax``/``argmin``/``cummax``/``cummin``
repeated extremes.  A max whose tied maxima are all locally constant is differentiable: a
max-pooling window or a ``max``/``amax``/``min`` reduction applied directly to a ``relu`` output
whose tied extremes are all zeros of strictly negative inputs is not counted (the usual conv →
relu → max-pool, which would otherwise make every such CNN undetermined).  Otherwise the count is
conservative (a max of tied but locally constant inputs, an equality test ``x == x.max()``, are
counted).  Still missed: ``aten`` operations called directly and C++ code that bypasses
``__torch_function__`` (their outputs are taken to depend on every site already run, but kinks
inside them are not seen), and integer casts (``x.long()``).
Continuous pre-activation laws put these ties on a null set
(``rem-kinks-null``), so on real data the count is usually ``0``.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from depthsat_theory.capture.sites import parse_site, resolve_module

__all__ = ["KINK_PRIMITIVES", "KinkCounter", "kink_ties"]


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _at(x: Tensor, value) -> int:
    if value is None:
        return 0
    if isinstance(value, Tensor):
        return int((x == value).sum())
    return int((x == float(value)).sum())


def _zero_ties(args: tuple, kwargs: dict) -> int:
    return _at(args[0], 0.0)


def _hardtanh_ties(args: tuple, kwargs: dict) -> int:
    x = args[0]
    return _at(x, _arg(args, kwargs, 1, "min_val", -1.0)) + _at(x, _arg(args, kwargs, 2, "max_val", 1.0))


def _relu6_ties(args: tuple, kwargs: dict) -> int:
    return _at(args[0], 0.0) + _at(args[0], 6.0)


def _hard3_ties(args: tuple, kwargs: dict) -> int:
    return _at(args[0], -3.0) + _at(args[0], 3.0)


def _threshold_ties(args: tuple, kwargs: dict) -> int:
    return _at(args[0], _arg(args, kwargs, 1, "threshold", 0.0))


def _clamp_ties(args: tuple, kwargs: dict) -> int:
    x = args[0]
    return _at(x, _arg(args, kwargs, 1, "min")) + _at(x, _arg(args, kwargs, 2, "max"))


def _pair_ties(args: tuple, kwargs: dict) -> int:
    other = _arg(args, kwargs, 1, "other")
    return _at(args[0], other) if other is not None else 0


def _reduce_ties(args: tuple, kwargs: dict, *, largest: bool) -> int:
    """Extra attainments of the max (min) along ``dim`` (whole tensor without one)."""
    x = args[0]
    dim = _arg(args, kwargs, 1, "dim")
    if isinstance(dim, Tensor) or x.numel() == 0:  # torch.max(a, b): elementwise
        return _at(x, dim) if isinstance(dim, Tensor) else 0
    if dim is None:
        ext = x.max() if largest else x.min()
        return max(int((x == ext).sum()) - 1, 0)
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    ext = x.amax(dim=dims, keepdim=True) if largest else x.amin(dim=dims, keepdim=True)
    return int(((x == ext).sum(dim=dims) - 1).clamp(min=0).sum())


def _reduce_dims(x: Tensor, args: tuple, kwargs: dict) -> tuple | None:
    """The reduced dimensions of a max/min-type reduction (``None``: the whole tensor)."""
    dim = _arg(args, kwargs, 1, "dim")
    if dim is None:
        return None
    return (dim,) if isinstance(dim, int) else tuple(dim)


def _masked_reduce_ties(x: Tensor, args: tuple, kwargs: dict, const: Tensor, *, largest: bool) -> int:
    """:func:`_reduce_ties` counting only reductions with a maximum (minimum) that is not locally constant."""
    dims = _reduce_dims(x, args, kwargs)
    if dims is None:
        x, const, dims = x.reshape(1, -1), const.reshape(1, -1), (1,)
    ext = x.amax(dim=dims, keepdim=True) if largest else x.amin(dim=dims, keepdim=True)
    tied = x == ext
    moving = (tied & ~const).any(dim=dims)
    return int(((tied.sum(dim=dims) - 1).clamp(min=0) * moving).sum())


def _compare_ties(args: tuple, kwargs: dict) -> int:
    """Elements exactly at the threshold of a comparison (``x > c`` selects discontinuously at ``x = c``)."""
    other = _arg(args, kwargs, 1, "other")
    if not isinstance(other, (Tensor, int, float, bool)):
        return 0
    return _at(args[0], other)


def _integer_ties(args: tuple, kwargs: dict) -> int:
    """``floor``/``ceil``/``trunc``/``frac`` jump at the integers."""
    x = args[0]
    return int((x == torch.floor(x)).sum()) if x.is_floating_point() else 0


def _half_integer_ties(args: tuple, kwargs: dict) -> int:
    """``round`` jumps at the half-integers (scaled by ``10^decimals``)."""
    x = args[0]
    if not x.is_floating_point():
        return 0
    y = x * (10.0 ** int(_arg(args, kwargs, 1, "decimals", 0) or 0))
    return int((y - torch.floor(y) == 0.5).sum())


def _adjacent_ties(v: Tensor, dim: int) -> int:
    """Equal neighbours along ``dim`` of sorted values ``v``."""
    n = v.shape[dim] if v.dim() else 0
    if n < 2:
        return 0
    return int((v.narrow(dim, 1, n - 1) == v.narrow(dim, 0, n - 1)).sum())


def _sort_ties(args: tuple, kwargs: dict, *, dim_default: int | None = -1) -> int:
    """``sort``/``argsort``/``msort``/``median``/``kthvalue``/``mode``: every tie along the sorted dimension."""
    x = args[0]
    if x.dim() == 0 or x.numel() == 0:
        return 0
    dim = kwargs.get("dim", dim_default)
    if dim_default is not None and len(args) > 1 and isinstance(args[1], int) and not isinstance(args[1], bool):
        dim = args[1]
    if dim is None:
        x, dim = x.reshape(-1), 0
    return _adjacent_ties(x.sort(dim=dim).values, dim)


def _kth_ties(args: tuple, kwargs: dict) -> int:
    """``kthvalue(x, k, dim)``: every tie along ``dim`` (conservative)."""
    x = args[0]
    if x.dim() == 0 or x.numel() == 0:
        return 0
    dim = _arg(args, kwargs, 2, "dim", -1)
    return _adjacent_ties(x.sort(dim=dim).values, dim)


def _topk_ties(args: tuple, kwargs: dict) -> int:
    """``topk(x, k, dim, largest)``: ties among the ``k + 1`` best along ``dim`` (inside or at the boundary)."""
    x = args[0]
    if x.dim() == 0 or x.numel() == 0:
        return 0
    k = int(_arg(args, kwargs, 1, "k"))
    dim = _arg(args, kwargs, 2, "dim", -1)
    largest = bool(_arg(args, kwargs, 3, "largest", True))
    v = x.sort(dim=dim, descending=largest).values
    return _adjacent_ties(v.narrow(dim, 0, min(k + 1, v.shape[dim])), dim)


def _cumulative_ties(args: tuple, kwargs: dict, *, largest: bool) -> int:
    """``cummax``/``cummin``: an element equal to the running extreme before it."""
    x = args[0]
    dim = _arg(args, kwargs, 1, "dim")
    if x.dim() == 0 or dim is None or x.shape[dim] < 2:
        return 0
    run = (torch.cummax if largest else torch.cummin)(x, dim).values
    n = x.shape[dim]
    return int((x.narrow(dim, 1, n - 1) == run.narrow(dim, 0, n - 1)).sum())


def _ntuple(value, ndim: int) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * ndim


def _pool_len(n: int, k: int, s: int, p: int, d: int, ceil: bool) -> int:
    """Output length of a max-pooling dimension (torch's ``pooling_output_shape``)."""
    span = d * (k - 1) + 1
    out = (n + 2 * p - span + (s - 1 if ceil else 0)) // s + 1
    if ceil and (out - 1) * s >= n + p:
        out -= 1
    return out


def _window_ties(cols: Tensor) -> int:
    """Extra attainments of the max over the last dimension (one window per row)."""
    ext = cols.amax(dim=-1, keepdim=True)
    return int(((cols == ext).sum(dim=-1) - 1).clamp(min=0).sum())


def _pool_windows(x: Tensor, args: tuple, kwargs: dict, ndim: int, fill: float) -> Tensor:
    """The max-pooling windows of ``x`` as rows ``(..., window)`` (out-of-bounds entries ``fill``)."""
    ks = _ntuple(_arg(args, kwargs, 1, "kernel_size"), ndim)
    stride = _ntuple(_arg(args, kwargs, 2, "stride") or ks, ndim)
    padding = _ntuple(_arg(args, kwargs, 3, "padding", 0), ndim)
    dilation = _ntuple(_arg(args, kwargs, 4, "dilation", 1), ndim)
    ceil = bool(_arg(args, kwargs, 5, "ceil_mode", False))
    first = x.dim() - ndim
    for i in range(ndim):
        dim, n = first + i, x.shape[first + i]
        k, s, p, d = ks[i], stride[i], padding[i], dilation[i]
        out, span = _pool_len(n, k, s, p, d, ceil), d * (k - 1) + 1
        right = max((out - 1) * s + span - n - p, 0)
        shape = list(x.shape)
        parts = []
        for width in (p, 0, right):
            shape[dim] = width
            parts.append(x.new_full(shape, fill) if width else None)
        x = torch.cat([t for t in (parts[0], x, parts[2]) if t is not None], dim=dim)
        x = x.unfold(dim, span, s).narrow(dim, 0, out)[..., ::d]
    return x.flatten(-ndim)


def _pool_ties(args: tuple, kwargs: dict, *, ndim: int, constant: Tensor | None = None) -> int:
    """Extra attainments of the max in each max-pooling window (1-, 2- and 3-D, any ``ceil_mode``).

    ``constant`` marks the elements of ``args[0]`` that are locally constant in the site (a
    ``relu`` output whose input was strictly negative): a window whose maxima are all such
    elements is locally constant, hence differentiable, and is not counted.
    """
    cols = _pool_windows(args[0], args, kwargs, ndim, float("-inf"))
    if constant is None:
        return _window_ties(cols)
    return _masked_ties(cols, _pool_windows(constant.to(cols.dtype), args, kwargs, ndim, 1.0) > 0)


def _adaptive_windows(x: Tensor, args: tuple, kwargs: dict, ndim: int, fill: float) -> Tensor:
    """The adaptive max-pooling windows of ``x`` as rows (torch's start/end rule; short ones ``fill``-padded)."""
    sizes = _ntuple(_arg(args, kwargs, 1, "output_size"), ndim)
    first = x.dim() - ndim
    for i in range(ndim):
        dim, n = first + i, x.shape[first + i]
        o = n if sizes[i] is None else int(sizes[i])
        windows = [x.narrow(dim, (j * n) // o, -((-(j + 1) * n) // o) - (j * n) // o) for j in range(o)]
        width = max(w.shape[dim] for w in windows)
        padded = []
        for w in windows:
            shape = list(w.shape)
            shape[dim] = width - w.shape[dim]
            padded.append(torch.cat([w, w.new_full(shape, fill)], dim=dim) if shape[dim] else w)
        x = torch.stack(padded, dim=dim).movedim(dim + 1, -1)
    return x.flatten(-ndim)


def _adaptive_ties(args: tuple, kwargs: dict, *, ndim: int, constant: Tensor | None = None) -> int:
    """Extra attainments of the max in each adaptive max-pooling window (``constant`` as for :func:`_pool_ties`)."""
    cols = _adaptive_windows(args[0], args, kwargs, ndim, float("-inf"))
    if constant is None:
        return _window_ties(cols)
    return _masked_ties(cols, _adaptive_windows(constant.to(cols.dtype), args, kwargs, ndim, 1.0) > 0)


def _masked_ties(cols: Tensor, const: Tensor) -> int:
    """Extra attainments per window, counting only windows with a maximum that is not locally constant."""
    tied = cols == cols.amax(dim=-1, keepdim=True)
    moving = (tied & ~const).any(dim=-1)
    return int(((tied.sum(dim=-1) - 1).clamp(min=0) * moving).sum())


def _shrink_ties(args: tuple, kwargs: dict) -> int:
    lambd = float(_arg(args, kwargs, 1, "lambd", 0.5))
    return _at(args[0], lambd) + _at(args[0], -lambd) if lambd else _at(args[0], 0.0)


def _elu_ties(args: tuple, kwargs: dict, *, name: str = "alpha", default: float = 1.0) -> int:
    """``elu`` has a kink at ``0`` unless ``alpha = 1``; ``selu`` always has one."""
    alpha = float(_arg(args, kwargs, 1, name, default))
    return _at(args[0], 0.0) if alpha != 1.0 else 0


#: the primitives whose kinks are looked for, with their tie counters
KINK_PRIMITIVES: dict[Callable, Callable[[tuple, dict], int]] = {
    F.relu: _zero_ties,
    torch.relu: _zero_ties,
    Tensor.relu: _zero_ties,
    torch.relu_: _zero_ties,
    Tensor.relu_: _zero_ties,
    F.relu_: _zero_ties,
    F.leaky_relu: _zero_ties,
    torch.abs: _zero_ties,
    Tensor.abs: _zero_ties,
    Tensor.__abs__: _zero_ties,
    F.hardtanh: _hardtanh_ties,
    F.relu6: _relu6_ties,
    F.hardswish: _hard3_ties,
    F.hardsigmoid: _hard3_ties,
    F.threshold: _threshold_ties,
    torch.clamp: _clamp_ties,
    Tensor.clamp: _clamp_ties,
    torch.clip: _clamp_ties,
    Tensor.clip: _clamp_ties,
    torch.maximum: _pair_ties,
    torch.minimum: _pair_ties,
    torch.max: lambda a, k: _reduce_ties(a, k, largest=True),
    Tensor.max: lambda a, k: _reduce_ties(a, k, largest=True),
    torch.amax: lambda a, k: _reduce_ties(a, k, largest=True),
    Tensor.amax: lambda a, k: _reduce_ties(a, k, largest=True),
    torch.min: lambda a, k: _reduce_ties(a, k, largest=False),
    Tensor.min: lambda a, k: _reduce_ties(a, k, largest=False),
    torch.amin: lambda a, k: _reduce_ties(a, k, largest=False),
    Tensor.amin: lambda a, k: _reduce_ties(a, k, largest=False),
    torch.clamp_min: lambda a, k: _at(a[0], _arg(a, k, 1, "min")),
    Tensor.clamp_min: lambda a, k: _at(a[0], _arg(a, k, 1, "min")),
    torch.clamp_max: lambda a, k: _at(a[0], _arg(a, k, 1, "max")),
    Tensor.clamp_max: lambda a, k: _at(a[0], _arg(a, k, 1, "max")),
    torch.prelu: _zero_ties,
    F.prelu: _zero_ties,
    F.rrelu: _zero_ties,
    F.elu: _elu_ties,
    F.selu: lambda a, k: _at(a[0], 0.0),
    F.hardshrink: _shrink_ties,
    F.l1_loss: lambda a, k: _at(a[0], _arg(a, k, 1, "target")),
    F.softshrink: _shrink_ties,
    F.max_pool1d: lambda a, k: _pool_ties(a, k, ndim=1),
    F.max_pool2d: lambda a, k: _pool_ties(a, k, ndim=2),
    F.max_pool3d: lambda a, k: _pool_ties(a, k, ndim=3),
    F.max_pool1d_with_indices: lambda a, k: _pool_ties(a, k, ndim=1),
    F.max_pool2d_with_indices: lambda a, k: _pool_ties(a, k, ndim=2),
    F.max_pool3d_with_indices: lambda a, k: _pool_ties(a, k, ndim=3),
    F.adaptive_max_pool1d: lambda a, k: _adaptive_ties(a, k, ndim=1),
    F.adaptive_max_pool2d: lambda a, k: _adaptive_ties(a, k, ndim=2),
    F.adaptive_max_pool3d: lambda a, k: _adaptive_ties(a, k, ndim=3),
    F.adaptive_max_pool1d_with_indices: lambda a, k: _adaptive_ties(a, k, ndim=1),
    F.adaptive_max_pool2d_with_indices: lambda a, k: _adaptive_ties(a, k, ndim=2),
    F.adaptive_max_pool3d_with_indices: lambda a, k: _adaptive_ties(a, k, ndim=3),
}


def _register(names: Sequence[str], counter: Callable[[tuple, dict], int], *, torch_too: bool = True) -> None:
    """Add ``Tensor.<name>`` (and ``torch.<name>``) for each name to :data:`KINK_PRIMITIVES`."""
    for name in names:
        for owner in (Tensor, torch) if torch_too else (Tensor,):
            func = getattr(owner, name, None)
            if func is not None:
                KINK_PRIMITIVES[func] = counter


# comparisons: a selection (``torch.where``, a boolean mask, ``x * (x > 0)``) jumps where the compared
# values are equal; ``where`` itself only sees the boolean condition, so its ties are counted here
_COMPARISONS = ("gt", "ge", "lt", "le", "eq", "ne", "greater", "greater_equal", "less", "less_equal", "not_equal")
_register(_COMPARISONS, _compare_ties)
_register(("__gt__", "__ge__", "__lt__", "__le__", "__eq__", "__ne__"), _compare_ties, torch_too=False)
_register(("sign", "sgn", "heaviside", "signbit", "bool"), _zero_ties)  # jump at 0 (z * sign(z) = |z|)
_register(("floor", "ceil", "trunc", "fix", "frac"), _integer_ties)
_register(("round",), _half_integer_ties)
_register(("sort", "argsort", "median", "nanmedian", "mode"), _sort_ties)
_register(("msort",), functools.partial(_sort_ties, dim_default=0))
_register(("kthvalue",), _kth_ties)
_register(("topk",), _topk_ties)
_register(("argmax",), lambda a, k: _reduce_ties(a, k, largest=True))
_register(("argmin",), lambda a, k: _reduce_ties(a, k, largest=False))
_register(("cummax",), functools.partial(_cumulative_ties, largest=True))
_register(("cummin",), functools.partial(_cumulative_ties, largest=False))

#: max/min reductions whose ties can be refined by a locally-constant mask (``amax`` after ``relu``)
_REDUCTIONS: dict[Callable, bool] = {
    f: largest
    for largest, names in ((True, ("max", "amax", "argmax")), (False, ("min", "amin", "argmin")))
    for owner in (torch, Tensor)
    for f in [getattr(owner, n) for n in names]
}


#: max-pooling functions and their dimension (their ties can be refined by a constant mask)
_POOLS: dict[Callable, tuple[Callable, int]] = {
    F.max_pool1d: (_pool_ties, 1),
    F.max_pool2d: (_pool_ties, 2),
    F.max_pool3d: (_pool_ties, 3),
    F.max_pool1d_with_indices: (_pool_ties, 1),
    F.max_pool2d_with_indices: (_pool_ties, 2),
    F.max_pool3d_with_indices: (_pool_ties, 3),
    F.adaptive_max_pool1d: (_adaptive_ties, 1),
    F.adaptive_max_pool2d: (_adaptive_ties, 2),
    F.adaptive_max_pool3d: (_adaptive_ties, 3),
    F.adaptive_max_pool1d_with_indices: (_adaptive_ties, 1),
    F.adaptive_max_pool2d_with_indices: (_adaptive_ties, 2),
    F.adaptive_max_pool3d_with_indices: (_adaptive_ties, 3),
}

#: ``relu`` forms whose output is locally constant (``0``) where the input is strictly negative
_RELUS = (F.relu, torch.relu, Tensor.relu, torch.relu_, Tensor.relu_, F.relu_)


def kink_ties(func: Callable, args: tuple, kwargs: dict | None = None, *, constant: Tensor | None = None) -> int:
    """Number of elements at a kink of ``func`` for this call (``0`` for other functions).

    Args:
        func: the called torch function (e.g. ``torch.nn.functional.relu``).
        args: its positional arguments; ``args[0]`` is the tensor tested.
        kwargs: its keyword arguments.
        constant: for max pooling, a boolean mask of the elements of ``args[0]`` known to be locally
            constant in the site (``relu`` outputs of strictly negative inputs); windows whose maxima
            are all such elements are not counted (``max(0, 0) = 0`` near a strictly negative input).

    Returns:
        The count of exact ties (``relu``/``leaky_relu``/``prelu``/``rrelu``/``abs``/``selu`` at ``0``,
        ``elu`` at ``0`` unless ``alpha = 1``, ``hardshrink``/``softshrink`` at ``±λ``,
        ``l1_loss`` at a zero residual, ``hardtanh``/``clamp``/``clamp_min``/``clamp_max`` at their bounds,
        ``maximum``/``minimum`` with equal arguments, extra attainments of a max/min reduction or of
        a max-pooling window (1-, 2-, 3-D, adaptive, any ``ceil_mode``, with or without indices);
        ``0`` when no tensor operand requires gradients (none can depend on the site).
    """
    counter = KINK_PRIMITIVES.get(func)
    if counter is None or not args or not isinstance(args[0], Tensor):
        return 0
    operands = [*args, *(kwargs or {}).values()]  # maximum(zeros, z): the site may be the second operand
    if not any(isinstance(t, Tensor) and t.requires_grad for t in operands):
        return 0
    with torch.no_grad():
        if constant is not None and func in _POOLS and constant.shape == args[0].shape:
            constant = constant & (args[0] == 0)  # still relu's zeros (not changed in place since)
            windowed, ndim = _POOLS[func]
            return windowed(args, kwargs or {}, ndim=ndim, constant=constant)
        if constant is not None and func in _REDUCTIONS and constant.shape == args[0].shape:
            dim = _arg(args, kwargs or {}, 1, "dim")
            if not isinstance(dim, Tensor):  # torch.max(a, b) is elementwise
                constant = constant & (args[0] == 0)
                return _masked_reduce_ties(args[0], args, kwargs or {}, constant, largest=_REDUCTIONS[func])
        return counter(args, kwargs or {})


def _tensors(obj, depth: int = 0) -> list[Tensor]:
    """The tensors in ``obj`` (an argument, a list/tuple/dict of them, a model output), two levels deep."""
    if isinstance(obj, Tensor):
        return [obj]
    if depth > 2 or obj is None or isinstance(obj, (int, float, bool, str)):
        return []
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o, depth + 1)]
    if isinstance(obj, dict):  # also transformers' ModelOutput (an OrderedDict)
        return [t for o in obj.values() for t in _tensors(o, depth + 1)]
    if isinstance(obj, Mapping):
        return [t for o in obj.values() for t in _tensors(o, depth + 1)]
    return []


_NOT_INPLACE = frozenset({"__init__", "__int__", "__index__", "__invert__", "__iter__"})


def _inplace(func: Callable) -> bool:
    """Whether ``func`` writes into its first argument (``relu_``, ``add_``, ``__iadd__``, ``__setitem__``)."""
    name = getattr(func, "__name__", "")
    if name == "__setitem__" or (name.startswith("__i") and name.endswith("__") and name not in _NOT_INPLACE):
        return True
    return name.endswith("_") and not name.startswith("_")


class _Mode(TorchFunctionMode):
    def __init__(self, owner: KinkCounter):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        if not owner.active:
            return func(*args, **kwargs)
        taint = owner.taint_of(_tensors(args) + (_tensors(list(kwargs.values())) if kwargs else []))
        x = args[0] if args and isinstance(args[0], Tensor) else None
        if taint:
            owner.count(func, args, kwargs, x, taint)
        mask = (x < 0).detach() if func in _RELUS and x is not None and x.requires_grad else None
        out = func(*args, **kwargs)
        owner.propagate(func, x, kwargs, out, taint)
        if mask is not None and isinstance(out, Tensor):
            owner._constant[id(out)] = (weakref.ref(out), mask)
        return out


class KinkCounter:
    """Context manager counting exact kink ties downstream of each site, per probe.

    Usage::

        counter = KinkCounter(model, ["blocks.0", "blocks.1"])
        with counter:
            loss = counter.wrap_loss(loss_fn)(model(x), y)   # one forward (any number)
        counter.ties   # {"blocks.0": 3, "blocks.1": 0}

    A forward pass starts at the model's forward pre-hook and ends when the wrapped loss
    function returns.  Ties are attributed by **data flow**: every tensor produced by a torch
    function in the window carries the set of sites it depends on (the union over its tensor
    operands; a site's output gets its own name; an in-place operation adds to its target and the
    target's base), and a tie found at a kink counts for exactly the sites its operands depend on.
    A tensor the counter has not seen is taken to depend on nothing if it is a leaf (parameters,
    inputs: no gradient flows through them to a site) and, conservatively, on every site already
    run in this forward otherwise (the output of a custom ``autograd.Function``, e.g. the
    recorder's tap, or of a path that bypasses ``__torch_function__``).  Use the same site names as
    :class:`~depthsat_theory.capture.sites.SiteRecorder` (``"name#k"`` for the ``k``-th call of a
    repeated module).

    Attributes:
        ties: site → number of exact ties at kinks downstream of it, summed over forwards.
        forwards: forward passes seen.
        total: ties found on tensors that depend on at least one site.
    """

    def __init__(self, model: nn.Module, sites: Sequence[str]):
        self.model = model
        self.sites = list(sites)
        self.ties: dict[str, int] = dict.fromkeys(self.sites, 0)
        self.forwards = 0
        self.total = 0
        self.active = False
        self._fired: frozenset[str] = frozenset()
        self._taint: dict[int, tuple] = {}  # id(tensor) → (weakref, frozenset of site names)
        self._calls: dict[str, int] = {}
        self._handles: list = []
        self._mode = _Mode(self)
        self._constant: dict[int, tuple] = {}  # id(relu output) → (weakref, locally constant mask)

    def taint_of(self, tensors: Sequence[Tensor]) -> frozenset[str]:
        """The sites the given tensors depend on (see the class docstring for unseen tensors).

        Args:
            tensors: the operands.

        Returns:
            The union of their site keys; an unseen tensor with a ``grad_fn`` counts as depending on every
            site fired so far.
        """
        out: frozenset[str] = frozenset()
        for t in tensors:
            known = self._taint.get(id(t))
            if known is not None and known[0]() is t:
                out |= known[1]
            elif t.grad_fn is not None:
                out |= self._fired
        return out

    def mark(self, t: Tensor, sites: frozenset[str]) -> None:
        """Record that ``t`` depends on ``sites`` (in addition to what it already depends on).

        Args:
            t: a tensor (not weak-referenceable tensors are skipped).
            sites: site keys ``t`` depends on.
        """
        key = id(t)
        known = self._taint.get(key)
        if known is not None and known[0]() is t:
            if not sites <= known[1]:
                self._taint[key] = (known[0], known[1] | sites)
            return
        with contextlib.suppress(TypeError):  # not weak-referenceable: left to the conservative rule
            self._taint[key] = (weakref.ref(t), sites)

    def count(self, func: Callable, args: tuple, kwargs: dict, x: Tensor | None, taint: frozenset[str]) -> None:
        """Add this call's kink ties to every site in ``taint``.

        Args:
            func: the torch function called.
            args: its positional arguments.
            kwargs: its keyword arguments.
            x: its first tensor operand (``None``: none).
            taint: the sites the operands depend on.
        """
        known = self._constant.get(id(x)) if x is not None else None
        constant = known[1] if known is not None and known[0]() is x else None
        n = kink_ties(func, args, kwargs, constant=constant)
        if n:
            self.total += n
            for key in taint:
                self.ties[key] += n

    def propagate(self, func: Callable, x: Tensor | None, kwargs: dict, out, taint: frozenset[str]) -> None:
        """Mark the call's outputs (and an in-place target and its base) with the operands' sites.

        Args:
            func: the torch function called.
            x: its first tensor operand (written to when ``func`` is in-place).
            kwargs: its keyword arguments (an ``out=`` target is marked too).
            out: the call's result (every tensor in it is marked).
            taint: the operands' sites.
        """
        written = [x] if x is not None and _inplace(func) else []
        if kwargs and "out" in kwargs:
            written += _tensors(kwargs["out"])
        for t in written + [b for b in (getattr(w, "_base", None) for w in written) if b is not None]:
            self.mark(t, taint)
        for t in _tensors(out):
            self.mark(t, taint)  # also the empty set: a seen tensor that depends on no site

    def _site_hook(self, base: str):
        def hook(module, args, output):
            occ = self._calls.get(base, 0)
            self._calls[base] = occ + 1
            keys = frozenset(k for k in (base, f"{base}#{occ}") if k in self.ties)
            if keys and self.active:
                self._fired |= keys
                for t in _tensors(output):
                    self.mark(t, keys)

        return hook

    def _start(self, module, args) -> None:
        self._finish()
        self.active = True
        self.forwards += 1

    def _finish(self) -> None:
        self._calls, self._constant, self._taint = {}, {}, {}
        self._fired = frozenset()
        self.active = False

    def wrap_loss(self, loss_fn: Callable) -> Callable:
        """``loss_fn`` whose kinks count too, closing the forward pass when it returns.

        Args:
            loss_fn: the per-example loss function.

        Returns:
            A function with the same signature and result that closes the forward pass after each call.
        """

        def wrapped(*args, **kwargs):
            try:
                return loss_fn(*args, **kwargs)
            finally:
                self._finish()

        return wrapped

    def __enter__(self) -> KinkCounter:
        self._handles.append(self.model.register_forward_pre_hook(self._start))
        for base in {parse_site(s)[0] for s in self.sites}:
            self._handles.append(resolve_module(self.model, base).register_forward_hook(self._site_hook(base)))
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._finish()
        for h in self._handles:
            h.remove()
        self._handles = []
