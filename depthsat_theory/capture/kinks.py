"""Exact ties at kinks downstream of insertion sites (theory/gradient.md, ``thm-gradient``).

T1 identifies autograd's gradient of an inserted block with ``b = ∇_θ J(0)`` only when every
elementary operation between the site and the loss is differentiable at its forward value.
A piecewise-linear primitive evaluated *exactly* at its kink (``relu(0)``, ``abs(0)``, a tie
in a max) breaks this: autograd then returns a one-sided convention, and a saturated verdict
can be wrong (``ex-kink-tie``: ``relu(z) − relu(−z)`` at ``z = 0`` gives autograd ``b = 0``
while ``J(θ) = θ``).  :class:`KinkCounter` counts, per site, the elements that sit exactly at
a kink in the operations executed after the site's output in the same forward pass (and in
the loss), on tensors that require gradients.

Execution order over-approximates data-flow order (an operation after the site that does not
depend on it is counted too), and a max whose tied inputs are locally constant is counted
although it is differentiable, except for a max-pooling window applied directly to a ``relu``
output whose maxima are all zeros of strictly negative inputs (the usual conv → relu → max-pool,
which would otherwise make every such CNN undetermined): the count is conservative, it never misses a tie of a listed
primitive.  Not listed (ties there are missed): ``torch.where`` selections, ``topk``/``sort``
ties, ``aten`` ops called directly, and kinks built from ``sign`` (``z * sign(z)``).
Continuous pre-activation laws put these ties on a null set
(``rem-kinks-null``), so on real data the count is usually ``0``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
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
        return counter(args, kwargs or {})


class _Mode(TorchFunctionMode):
    def __init__(self, owner: KinkCounter):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.owner.active:
            return func(*args, **kwargs)
        x = args[0] if args and isinstance(args[0], Tensor) else None
        known = self.owner._constant.get(id(x)) if x is not None else None
        constant = known[1] if known is not None and known[0]() is x else None
        self.owner.total += kink_ties(func, args, kwargs, constant=constant)
        mask = (x < 0).detach() if func in _RELUS and x is not None and x.requires_grad else None
        out = func(*args, **kwargs)
        if mask is not None and isinstance(out, Tensor):
            self.owner._constant[id(out)] = (weakref.ref(out), mask)
        return out


class KinkCounter:
    """Context manager counting exact kink ties downstream of each site, per probe.

    Usage::

        counter = KinkCounter(model, ["blocks.0", "blocks.1"])
        with counter:
            loss = counter.wrap_loss(loss_fn)(model(x), y)   # one forward (any number)
        counter.ties   # {"blocks.0": 3, "blocks.1": 0}

    A forward pass starts at the model's forward pre-hook and ends when the wrapped loss
    function returns; a tie found after site ``s``'s output in that window is counted for
    ``s``.  Use the same site names as :class:`~depthsat_theory.capture.sites.SiteRecorder`
    (``"name#k"`` for the ``k``-th call of a repeated module).

    Attributes:
        ties: site → number of exact ties at kinks downstream of it, summed over forwards.
        forwards: forward passes seen.
    """

    def __init__(self, model: nn.Module, sites: Sequence[str]):
        self.model = model
        self.sites = list(sites)
        self.ties: dict[str, int] = dict.fromkeys(self.sites, 0)
        self.forwards = 0
        self.total = 0
        self.active = False
        self._at: dict[str, int] = {}
        self._calls: dict[str, int] = {}
        self._handles: list = []
        self._mode = _Mode(self)
        self._constant: dict[int, tuple] = {}  # id(relu output) → (weakref, locally constant mask)

    def _site_hook(self, base: str):
        def hook(module, args, output):
            occ = self._calls.get(base, 0)
            self._calls[base] = occ + 1
            for key in (base, f"{base}#{occ}"):
                if key in self.ties and key not in self._at:
                    self._at[key] = self.total

        return hook

    def _start(self, module, args) -> None:
        self._finish()
        self.active = True
        self.forwards += 1

    def _finish(self) -> None:
        for key, at in self._at.items():
            self.ties[key] += self.total - at
        self._at, self._calls, self._constant = {}, {}, {}
        self.active = False

    def wrap_loss(self, loss_fn: Callable) -> Callable:
        """``loss_fn`` whose kinks count too, closing the forward pass when it returns."""

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
