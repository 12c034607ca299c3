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
although it is differentiable: the count is conservative, it never misses a tie of a listed
primitive.  Continuous pre-activation laws put these ties on a null set
(``rem-kinks-null``), so on real data the count is usually ``0``.
"""

from __future__ import annotations

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


def _pool_ties(args: tuple, kwargs: dict, *, ndim: int) -> int:
    """Extra attainments of the max in each max-pooling window (1-D and 2-D pooling)."""
    x = args[0]
    ks = _arg(args, kwargs, 1, "kernel_size")
    stride = _arg(args, kwargs, 2, "stride") or ks
    padding = _arg(args, kwargs, 3, "padding", 0)
    dilation = _arg(args, kwargs, 4, "dilation", 1)
    if ndim == 1:
        x, ks, stride, padding, dilation = x.unsqueeze(-2), (1, ks), (1, stride), (0, padding), (1, dilation)
    lead = x.shape[:-2]
    img = x.reshape(-1, 1, *x.shape[-2:])
    if padding not in (0, (0, 0)):
        img = F.pad(img, _pad4(padding), value=float("-inf"))
    cols = F.unfold(img, kernel_size=ks, dilation=dilation, stride=stride)  # (N, window, L)
    del lead
    ext = cols.amax(dim=1, keepdim=True)
    return int(((cols == ext).sum(dim=1) - 1).clamp(min=0).sum())


def _pad4(padding) -> tuple[int, int, int, int]:
    ph, pw = (padding, padding) if isinstance(padding, int) else padding
    return (pw, pw, ph, ph)


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
    F.max_pool1d: lambda a, k: _pool_ties(a, k, ndim=1),
    F.max_pool2d: lambda a, k: _pool_ties(a, k, ndim=2),
}


def kink_ties(func: Callable, args: tuple, kwargs: dict | None = None) -> int:
    """Number of elements at a kink of ``func`` for this call (``0`` for other functions).

    Args:
        func: the called torch function (e.g. ``torch.nn.functional.relu``).
        args: its positional arguments; ``args[0]`` is the tensor tested.
        kwargs: its keyword arguments.

    Returns:
        The count of exact ties (``relu``/``leaky_relu``/``abs`` at ``0``, ``hardtanh``/``clamp``
        at its bounds, ``maximum``/``minimum`` with equal arguments, extra attainments of a
        max/min reduction or of a max-pooling window); ``0`` when ``args[0]`` does not require
        gradients (it cannot depend on the site).
    """
    counter = KINK_PRIMITIVES.get(func)
    if counter is None or not args or not isinstance(args[0], Tensor) or not args[0].requires_grad:
        return 0
    with torch.no_grad():
        return counter(args, kwargs or {})


class _Mode(TorchFunctionMode):
    def __init__(self, owner: KinkCounter):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.owner.active:
            self.owner.total += kink_ties(func, args, kwargs)
        return func(*args, **kwargs)


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
        self._at, self._calls = {}, {}
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
