"""Insertion sites in torch models: capture ``z`` and ``g`` (the recorder).

A *site* is a submodule (by its name in ``model.named_modules()``) whose forward
output is the residual-stream tensor ``z`` at that depth.  :class:`SiteRecorder`
captures ``z`` for every chosen site with forward hooks and the activation gradient
``g = ∂ℓ/∂z`` of the *per-example* losses in the same backward pass, so all sites
cost one forward and one backward per batch.

The gradient is taken at an identity autograd node placed on the site's output;
it receives the gradient with respect to the site's output *before* any later
in-place operation, and works when the site's input does not require grad.  It is
the gradient with respect to an explicit additive perturbation ``δ = 0`` of the
site's output, ``g_i = ∂ℓ_i/∂δ_i`` (theory/definitions.md).

Conventions (theory/definitions.md):

* **Site names.**  ``"blocks.3"`` names a module that runs exactly once per forward
  pass (``calls="error"``, the default).  A module that runs several times per
  forward (a weight-shared block) has one site per *invocation*: occurrence ``k``
  (``k = 0, 1, …`` in call order, counted since the last :meth:`SiteRecorder.backward`
  or :meth:`SiteRecorder.reset`) is the site ``"name#k"``.  Name it explicitly, or
  pass ``calls="each"`` to record every occurrence of a bare ``"name"`` under the
  keys ``"name#0"``, ``"name#1"``, …  Each occurrence has its own ``z`` (that call's
  output) and ``g`` (the gradient of the loss with respect to a perturbation of that
  call's output only, including its effect through the later calls).
* **Structured outputs.**  A module returning a tuple/list (Hugging Face layers
  return ``(hidden_states, …)``) has the site tensor at index 0; a mapping
  (``dict``, ``transformers.ModelOutput``) at its first key; ``output_key`` selects
  another index/key.  The tapped tensor is put back into the returned structure so
  that everything downstream uses it.
* **BatchNorm.**  A BatchNorm that normalizes with batch statistics (train mode, or
  ``track_running_stats=False``) makes ``z``, ``g`` and the tangent map depend on
  the whole batch (theory/definitions.md): a :class:`SiteError` by default.
* **Dropout.**  Dropout in train mode (an ``nn.Dropout*``/``nn.AlphaDropout`` module, a
  ``nn.MultiheadAttention`` with ``dropout > 0``, a drop-path/stochastic-depth module, or a
  functional ``dropout``/``scaled_dot_product_attention(dropout_p > 0)`` call seen in the
  forward: :func:`dropout_guard`) makes ``z`` and ``g`` random, so scores drift between calls:
  always a :class:`SiteError` (call ``model.eval()``).
* **Gradients disabled.**  A site whose forward runs with gradients disabled (under
  ``torch.no_grad()``, or inside reentrant activation checkpointing,
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``, which also cannot be
  differentiated with :func:`torch.autograd.grad`) has no activation gradient: a
  :class:`SiteError` naming the fix (``use_reentrant=False``).
* **Reductions and padding** (see :func:`depthsat_theory.capture.probe.accumulate`): ``g`` is the gradient of the
  per-example loss ``ℓ_i`` (nats per example); padded positions are excluded from
  the losses and from the units of the statistics.
"""

from __future__ import annotations

import copy
import difflib
import warnings
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = [
    "NotFunctionPreservingError",
    "SiteError",
    "SiteRecorder",
    "dropout_guard",
    "parse_site",
    "resolve_module",
    "split_output",
]


class SiteError(ValueError):
    """A site name does not exist, or a site cannot be captured."""


class NotFunctionPreservingError(ValueError):
    """An inserted block changed the model's function at the origin."""


class _Tap(torch.autograd.Function):
    """Identity on the site tensor; its backward stores the incoming gradient."""

    @staticmethod
    def forward(ctx, z, anchor, slot):
        ctx.slot = slot
        return z.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.slot.append(grad.detach())
        return grad, torch.zeros((), dtype=grad.dtype, device=grad.device), None


def parse_site(site: str) -> tuple[str, int | None]:
    """Split a site name into ``(module_name, occurrence)``.

    Args:
        site: ``"name"`` or ``"name#k"`` (``k ≥ 0``: the ``k``-th call of the module in
            one forward pass).

    Returns:
        ``(name, k)`` with ``k = None`` for a bare name.

    Raises:
        SiteError: if the occurrence suffix is not a non-negative integer.
    """
    name, sep, occ = site.partition("#")
    if not sep:
        return site, None
    if not occ.isdigit():
        raise SiteError(f"bad site {site!r}: the occurrence suffix must be '#k' with k = 0, 1, …")
    return name, int(occ)


def resolve_module(model: nn.Module, name: str) -> nn.Module:
    """The submodule of ``model`` called ``name`` (a name of ``model.named_modules()``).

    Args:
        model: the model.
        name: a module name (``""``: the model itself).

    Returns:
        The submodule.

    Raises:
        SiteError: if ``model`` has no module of that name (the message lists up to five similar names).
    """
    mods = dict(model.named_modules())
    if name not in mods:
        parent = name.rpartition(".")[0]
        siblings = [n for n in mods if n and n.rpartition(".")[0] == parent]  # e.g. blocks.0 … blocks.3
        close = siblings[:8] or difflib.get_close_matches(name, [n for n in mods if n], n=5)
        hint = f"; similar: {', '.join(close)}" if close else ""
        raise SiteError(f"no module named {name!r} in {type(model).__name__}{hint}")
    return mods[name]


def split_output(output, key, where: str):
    """Split a module output into ``(site_tensor, rebuild)``.

    ``site_tensor`` is the site tensor in the output and ``rebuild(t)`` returns the output with
    the site tensor replaced by ``t`` (same container type).

    Args:
        output: the module output: a tensor, a mapping, a tuple or list, or an object with a
            tensor attribute named ``key``.
        key: which part of the output is the site tensor: a mapping key, a sequence index or an
            attribute name; ``None`` takes the tensor itself, the first key or index 0.
        where: how error messages name the module.

    Returns:
        ``(site_tensor, rebuild)``; ``rebuild`` writes a mapping in place and copies tuples, lists and
        attribute containers.

    Raises:
        SiteError: if ``key`` does not select a part of ``output``, or the output is of none of
            these kinds.
    """
    if isinstance(output, Tensor):
        if key not in (None, 0):
            raise SiteError(f"{where} returned a tensor; output_key {key!r} does not apply")
        return output, lambda t: t
    if isinstance(output, Mapping):
        if key is None:
            if len(output) == 0:
                raise SiteError(f"{where} returned an empty mapping")
            key = next(iter(output.keys()))
        if key not in output:
            raise SiteError(
                f"{where} returned a mapping without key {key!r}; keys: {', '.join(map(str, output.keys()))}"
            )

        def rebuild_map(t):
            old = output[key]
            cast(MutableMapping, output)[key] = t  # ModelOutput.__setitem__ also sets the attribute
            if hasattr(output, "__dict__") and vars(output).get(key, None) is old:
                object.__setattr__(output, key, t)
            return output

        return output[key], rebuild_map
    if isinstance(output, (tuple, list)):
        idx = 0 if key is None else key
        if not isinstance(idx, int) or not -len(output) <= idx < len(output):
            raise SiteError(
                f"{where} returned a {type(output).__name__} of length {len(output)}; "
                f"output_key must be an index into it, got {key!r}"
            )
        idx = idx % len(output)

        def rebuild_seq(t):
            if isinstance(output, list):
                new = list(output)
                new[idx] = t
                return new
            if hasattr(output, "_fields"):  # namedtuple
                return cast(Any, output)._replace(**{output._fields[idx]: t})
            return (*tuple(output[:idx]), t, *tuple(output[idx + 1 :]))

        return output[idx], rebuild_seq
    if isinstance(key, str) and isinstance(getattr(output, key, None), Tensor):

        def rebuild_attr(t):
            new = copy.copy(output)
            setattr(new, key, t)
            return new

        return getattr(output, key), rebuild_attr
    raise SiteError(
        f"{where} returned {type(output).__name__}, not a tensor, tuple or mapping "
        f"(pass output_key to name the site tensor)"
    )


def _batch_stat_norms(model: nn.Module) -> list[str]:
    """Names of BatchNorm modules that normalize with the statistics of the batch."""
    bad = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and (
            mod.training or not mod.track_running_stats or mod.running_mean is None
        ):
            bad.append(name or type(mod).__name__)
    return bad


def _check_batchnorm(model: nn.Module, policy: str) -> None:
    if policy not in ("error", "warn", "ignore"):
        raise ValueError(f"batchnorm must be 'error', 'warn' or 'ignore', got {policy!r}")
    if policy == "ignore":
        return
    bad = _batch_stat_norms(model)
    if not bad:
        return
    msg = (
        f"BatchNorm module(s) {', '.join(bad)} normalize with the statistics of the batch "
        f"(train mode or track_running_stats=False): z, g and the tangent map A then depend "
        f"on the whole batch, not on the example (theory/definitions.md); call model.eval()"
    )
    if policy == "error":
        raise SiteError(msg + " or pass batchnorm='warn'/'ignore'")
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


_DROP_PATH_NAMES = ("droppath", "stochasticdepth")


def _train_mode_dropout(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` that drop activations at random (train mode, rate > 0)."""
    bad = []
    for name, mod in model.named_modules():
        if not mod.training:
            continue
        if isinstance(mod, nn.modules.dropout._DropoutNd):
            rate = float(mod.p)
        elif isinstance(mod, nn.MultiheadAttention):
            rate = float(mod.dropout)
        elif type(mod).__name__.lower() in _DROP_PATH_NAMES:  # timm DropPath, torchvision StochasticDepth
            rate = float(getattr(mod, "drop_prob", getattr(mod, "p", 1.0)) or 0.0)
        else:
            continue
        if rate > 0:
            bad.append(name or type(mod).__name__)
    return bad


def _dropout_message(what: str) -> str:
    return (
        f"dropout in train mode ({what}) makes z and g random, so the scores change from call to call; "
        f"call model.eval() before probing"
    )


def _check_dropout(model: nn.Module) -> None:
    bad = _train_mode_dropout(model)
    if bad:
        raise SiteError(_dropout_message(f"module(s) {', '.join(bad[:5])}" + (", …" if len(bad) > 5 else "")))


def _functional_dropout_rate(func, args: tuple, kwargs: dict) -> float:
    """The drop rate of a functional call (``0`` for anything but an active dropout)."""
    name = getattr(func, "__name__", "")
    if name == "scaled_dot_product_attention":
        return float(kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0))
    if "dropout" not in name:
        return 0.0
    training = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
    rate = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
    return float(rate) if training else 0.0


class dropout_guard(TorchFunctionMode):
    """Context manager raising :class:`SiteError` on a functional dropout call that drops activations.

    Catches ``torch.nn.functional.dropout*``/``alpha_dropout``/``torch.dropout`` with
    ``training=True`` and ``p > 0`` and ``scaled_dot_product_attention`` with ``dropout_p > 0``
    (a ``TorchFunctionMode``: every torch call in the block passes through it).

    Raises:
        SiteError: on such a call (the message says to call ``model.eval()``).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        """Check the call, then run it unchanged."""
        kwargs = kwargs or {}
        if _functional_dropout_rate(func, args, kwargs) > 0:
            raise SiteError(_dropout_message(f"a functional {getattr(func, '__name__', func)} call"))
        return func(*args, **kwargs)


_NO_GRAD_MESSAGE = (
    "{what} (torch.no_grad, or torch.utils.checkpoint.checkpoint(..., use_reentrant=True), which "
    "torch.autograd.grad cannot differentiate): the activation gradient g cannot be taken; "
    "probe with gradients enabled and pass use_reentrant=False to checkpoint"
)


class SiteRecorder:
    """Context manager capturing site activations and activation gradients.

    Usage::

        with SiteRecorder(model, ["blocks.0", "blocks.1"]) as rec:
            losses = loss_fn(model(x), y)          # per-example losses, shape (B,)
            rec.backward(losses.sum())
            z, g = rec.z["blocks.0"], rec.g["blocks.0"]

    ``rec.backward`` computes only the site gradients (no parameter gradients).
    ``z`` is a detached copy of the site output ``(B, *shape)`` in the model's dtype
    and device; ``g`` has the same shape and dtype: the gradient of the scalar passed
    to :meth:`backward` with respect to an additive perturbation of that output
    (theory/definitions.md; pass the *sum* of per-example losses so that ``g_i = ∂ℓ_i/∂z_i``).

    Repeated modules: occurrence ``k`` of a module (its ``k``-th call since the last
    :meth:`backward`/:meth:`reset`, ``k = 0, 1, …``) is the site ``"name#k"``; with
    ``calls="each"`` a bare ``"name"`` records every occurrence under ``"name#k"``.
    :attr:`names` lists the keys recorded in the last forward pass.

    Args:
        model: any ``nn.Module``.
        sites: site names ``"module.name"`` or ``"module.name#k"``.
        calls: for bare names: ``"error"`` (default) — the module must run exactly
            once per forward, keys are the bare names; ``"each"`` — every call is
            its own occurrence ``"name#k"``.
        output_key: where the site tensor is in a structured output: ``None``
            (index 0 of a tuple/list, the first key of a mapping/``ModelOutput``), an
            index, a key, or ``{site: key}`` per site (keyed by module name).
        batchnorm: ``"error"`` (default), ``"warn"`` or ``"ignore"`` when a BatchNorm
            in ``model`` normalizes with batch statistics (checked on entry and at
            each :meth:`backward`).

    Raises:
        SiteError: if a site name does not exist, a site module did not run as
            required (exactly once for a bare name with ``calls="error"``, at least
            ``k + 1`` times for ``"name#k"``), its output holds no site tensor, a
            BatchNorm uses batch statistics (``batchnorm="error"``), dropout is active
            (train mode), or a site runs with gradients disabled (``torch.no_grad``,
            reentrant checkpointing).
        ValueError: on a bad ``calls``/``batchnorm`` value.
    """

    def __init__(
        self, model: nn.Module, sites: Sequence[str], *, calls: str = "error", output_key=None, batchnorm: str = "error"
    ):
        if calls not in ("error", "each"):
            raise ValueError(f"calls must be 'error' or 'each', got {calls!r}")
        if batchnorm not in ("error", "warn", "ignore"):
            raise ValueError(f"batchnorm must be 'error', 'warn' or 'ignore', got {batchnorm!r}")
        self.model = model
        self.sites = list(sites)
        self.calls = calls
        self.batchnorm = batchnorm
        self._output_key = output_key
        self.modules = {}
        self._requests: dict[str, dict] = {}
        for s in self.sites:
            base, occ = parse_site(s)
            self.modules[s] = resolve_module(model, base)
            req = self._requests.setdefault(base, {"bare": False, "occ": set()})
            if occ is None:
                req["bare"] = True
            else:
                req["occ"].add(occ)
        self._handles: list = []
        self.z: dict[str, Tensor] = {}
        self.g: dict[str, Tensor] = {}
        self.names: list[str] = []
        self.last_calls: dict[str, int] = {}
        self._slots: dict[str, list] = {}
        self._anchors: dict[str, Tensor] = {}
        self._calls: dict[str, int] = {}

    def __enter__(self) -> SiteRecorder:
        _check_batchnorm(self.model, self.batchnorm)
        _check_dropout(self.model)
        for base in self._requests:
            mod = resolve_module(self.model, base)
            self._handles.append(mod.register_forward_hook(self._hook(base)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _key_for(self, base: str):
        key = self._output_key
        if isinstance(key, Mapping):
            return key.get(base)
        return key

    def _hook(self, base: str):
        req = self._requests[base]

        def hook(module, inputs, output):
            k = self._calls.get(base, 0)
            self._calls[base] = k + 1
            keys = []
            if req["bare"]:
                if self.calls == "each":
                    keys.append(f"{base}#{k}")
                elif k == 0:
                    keys.append(base)
            if k in req["occ"] and f"{base}#{k}" not in keys:
                keys.append(f"{base}#{k}")
            if not keys:
                return None
            t, rebuild = split_output(output, self._key_for(base), f"site {base!r}")
            if not isinstance(t, Tensor):
                raise SiteError(f"site {base!r} returned {type(t).__name__}, not a tensor")
            if not torch.is_grad_enabled():
                raise SiteError(_NO_GRAD_MESSAGE.format(what=f"site {base!r} ran with gradients disabled"))
            anchor = torch.zeros((), dtype=t.dtype, device=t.device, requires_grad=True)
            slot: list = []
            zc = t.detach().clone()
            for key in keys:
                self._slots[key] = slot
                self._anchors[key] = anchor
                self.z[key] = zc
                if key not in self.names:
                    self.names.append(key)
            return rebuild(_Tap.apply(t, anchor, slot))

        return hook

    def reset(self) -> None:
        """Forget the current forward pass (occurrence counters, captured ``z``)."""
        self._calls.clear()
        self._slots.clear()
        self._anchors.clear()
        self.z.clear()
        self.names = []

    def _validate(self) -> None:
        for base, req in self._requests.items():
            n = self._calls.get(base, 0)
            if req["bare"] and self.calls == "error" and n != 1:
                self.reset()
                raise SiteError(
                    f"site {base!r} ran {n} times in one forward pass; a site must run exactly "
                    f"once (choose a module that is called once per forward, name one call "
                    f"'{base}#k', or pass calls='each' to record every call)"
                )
            if req["bare"] and n == 0:
                self.reset()
                raise SiteError(f"site {base!r} did not run in the forward pass")
            for k in sorted(req["occ"]):
                if k >= n:
                    self.reset()
                    raise SiteError(
                        f"site '{base}#{k}' does not exist: module {base!r} ran {n} "
                        f"time(s) in the forward pass (occurrences 0…{n - 1})"
                    )

    def _grad(self, loss: Tensor, retain_graph: bool) -> None:
        """Backpropagate ``loss`` to the taps of the current forward (the gradients land in the slots)."""
        anchors, seen = [], set()
        for key in self.names:
            a = self._anchors[key]
            if id(a) not in seen:
                seen.add(id(a))
                anchors.append(a)
        try:
            torch.autograd.grad(loss, anchors, allow_unused=True, retain_graph=retain_graph)
        except RuntimeError as exc:
            if "use_reentrant" not in str(exc):
                raise
            raise SiteError(_NO_GRAD_MESSAGE.format(what="the model runs reentrant activation checkpointing")) from None

    def gradients_of(self, loss: Tensor, keys: Sequence[str]) -> dict[str, Tensor]:
        """The site gradients of another scalar on the current forward, keeping the graph for :meth:`backward`.

        Args:
            loss: a scalar of the current forward pass (e.g. one example's loss).
            keys: recorded site keys (of :attr:`names`).

        Returns:
            ``{key: ∂loss/∂z}``, each shaped like ``z[key]`` (zeros where ``loss`` does not reach).

        Raises:
            SiteError: if the model uses reentrant activation checkpointing.
        """
        self._grad(loss, retain_graph=True)
        out = {}
        for key in keys:
            slot = self._slots[key]
            out[key] = slot[-1] if slot else torch.zeros_like(self.z[key])
        for key in self.names:  # every tap got this gradient: drop it before the real backward
            self._slots[key].clear()
        return out

    def backward(self, loss: Tensor) -> None:
        """Backpropagate ``loss`` to the sites and fill :attr:`g` (then reset the counters).

        Args:
            loss: a scalar: the *sum* of the per-example losses (theory/definitions.md, def-setting), so that
                ``g[i] = ∂ℓ_i/∂z_i``.  A batch mean gives ``g / B``
                (:func:`~depthsat_theory.capture.probe.accumulate` handles other reductions).

        Raises:
            SiteError: if a site did not run as required in the last forward pass, a
                BatchNorm uses batch statistics (``batchnorm="error"``), dropout is active
                (train mode), or the model uses reentrant activation checkpointing.
        """
        _check_batchnorm(self.model, self.batchnorm)
        _check_dropout(self.model)
        self._validate()
        self.g.clear()
        self._grad(loss, retain_graph=False)
        for key in self.names:
            slot = self._slots[key]
            self.g[key] = slot[0] if slot else torch.zeros_like(self.z[key])
        self.last_calls = dict(self._calls)
        self._calls.clear()
        self._slots.clear()
        self._anchors.clear()
