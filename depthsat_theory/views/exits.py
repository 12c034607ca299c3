"""The residual stream at every depth, exit readouts, block influence and diminishing returns.

Conventions (one for every function here).  A residual model is a sequence of ``L`` residual
blocks ``z_l = B_l(z_{l-1})``, ``l = 1 … L``; ``z_0`` is the input of the first block (the
embedding or stem output).  *Depth* ``l`` means "``l`` blocks executed", so an exit at depth ``l``
reads ``z_l`` and there are ``L + 1`` exits ``l = 0 … L``.  The residual function of block ``l`` is
``f_l(z_{l-1}) = z_l − z_{l-1}`` (for a block with a post-addition ReLU, as the ResNet basic
block, this is the block's effective update, not its inner branch).

*Rows* are what a stopping decision is made for: one example for a ``(B, d)`` stream (MLP) or a
``(B, C, H, W)`` stream (CNN, flattened to ``C·H·W`` for norms and cosines, average-pooled over
``H, W`` for readouts, as the CNN's own head does), one token for a ``(B, T, d)`` stream
(language models).

Sources: seed 002 (Qi, "Optimal Depth of Neural Networks", arXiv 2506.16862: the forward pass as
an optimal stopping problem, the diminishing-returns condition on the residual functions); the
logit lens (nostalgebraist 2020); ShortGPT (Men et al. 2024, arXiv 2403.03853: block influence
``BI_l = 1 − E cos(z_{l-1}, z_l)`` over tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

__all__ = [
    "ExitTable",
    "StreamStates",
    "block_influence",
    "capture_stream",
    "diminishing_returns",
    "fit_linear_readouts",
    "logit_lens_table",
    "readout_table",
    "residual_blocks",
    "update_ratios",
]


def residual_blocks(model: nn.Module, names: Sequence[str] | None = None) -> list[tuple[str, nn.Module]]:
    """The model's residual blocks in depth order, as ``(name, module)``.

    Args:
        model: a residual model.
        names: module names of the blocks (``model.get_submodule`` paths, e.g. ``"blocks.3"`` or
            ``"model.layers.3"``); default: every child of ``model.blocks`` (the toolkit's
            ``ResidualMLP``, ``ResNetCNN`` and ``CharGPT``).

    Returns:
        ``[(name, block), …]``, at least one.

    Raises:
        ValueError: no names given and the model has no ``blocks`` ``ModuleList``, an empty list,
            or a name that is not a submodule.
    """
    if names is None:
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
            raise ValueError(
                f"{type(model).__name__} has no non-empty `blocks` ModuleList: pass the residual blocks' "
                "module names, e.g. names=['model.layers.0', …]"
            )
        return [(f"blocks.{i}", b) for i, b in enumerate(blocks)]
    if not names:
        raise ValueError("names: give at least one residual block")
    out = []
    for name in names:
        try:
            out.append((name, model.get_submodule(name)))
        except AttributeError:
            raise ValueError(f"{name!r} is not a submodule of {type(model).__name__}") from None
    return out


@dataclass
class StreamStates:
    """The residual stream at every depth of one forward pass.

    Attributes:
        states: ``L + 1`` tensors ``z_0 … z_L`` (``z_0`` the first block's input), each of the
            stream's shape ``(B, d)``, ``(B, T, d)`` or ``(B, C, H, W)``.
        names: the ``L`` block names (block ``l`` maps ``z_{l-1}`` to ``z_l``).
    """

    states: list[Tensor]
    names: list[str]

    @property
    def depth(self) -> int:
        """``L``, the number of blocks."""
        return len(self.states) - 1


def capture_stream(
    model: nn.Module,
    x: Tensor,
    names: Sequence[str] | None = None,
    *,
    grad: bool = False,
) -> tuple[Tensor, StreamStates]:
    """Run ``model(x)`` once and record each block's input and output (forward hooks).

    Args:
        model: the model (its mode is not changed).
        x: its input batch.
        names: the residual blocks (see :func:`residual_blocks`).
        grad: keep the autograd graph (for a training penalty); default: ``torch.no_grad``.

    Returns:
        ``(output, states)``: the model's output and the :class:`StreamStates`.

    Raises:
        ValueError: bad block names, a block that did not run, or blocks that did not run in a
            chain (block ``l``'s input is not block ``l-1``'s output: not a residual stream).
    """
    blocks = residual_blocks(model, names)
    ins: dict[int, Tensor] = {}
    outs: dict[int, Tensor] = {}

    def hook(i: int) -> Callable:
        def fn(_m: nn.Module, args: tuple, out: Tensor) -> None:
            ins[i] = args[0]
            outs[i] = out[0] if isinstance(out, tuple) else out

        return fn

    handles = [b.register_forward_hook(hook(i)) for i, (_, b) in enumerate(blocks)]
    try:
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            output = model(x)
    finally:
        for h in handles:
            h.remove()
    missing = [blocks[i][0] for i in range(len(blocks)) if i not in outs]
    if missing:
        raise ValueError(f"blocks {missing} did not run in the forward pass")
    for i in range(1, len(blocks)):
        if ins[i] is not outs[i - 1] and not (
            ins[i].shape == outs[i - 1].shape and torch.equal(ins[i].detach(), outs[i - 1].detach())
        ):
            raise ValueError(
                f"block {blocks[i][0]!r} does not read block {blocks[i - 1][0]!r}'s output: not one residual stream"
            )
    states = [ins[0]] + [outs[i] for i in range(len(blocks))]
    return output, StreamStates(states, [n for n, _ in blocks])


def stream_rows(z: Tensor) -> Tensor:
    """Stream → one row per decision: ``(B, d)``; ``(B, T, d)`` → ``(B·T, d)``; ``(B, C, H, W)`` → ``(B, C·H·W)``."""
    if z.dim() == 2:
        return z
    if z.dim() == 3:
        return z.reshape(-1, z.shape[-1])
    if z.dim() == 4:
        return z.reshape(z.shape[0], -1)
    raise ValueError(f"a stream of shape {tuple(z.shape)}: expected (B, d), (B, T, d) or (B, C, H, W)")


def _features(z: Tensor) -> Tensor:
    """Readout features per row: ``(B, C, H, W)`` average-pooled to ``(B, C)``, else :func:`stream_rows`."""
    return z.mean(dim=(2, 3)) if z.dim() == 4 else stream_rows(z)


def block_influence(states: StreamStates) -> np.ndarray:
    """ShortGPT's block influence ``BI_l = 1 − mean_rows cos(z_{l-1}, z_l)`` of every block.

    Args:
        states: the stream (:func:`capture_stream`).

    Returns:
        float64 ``(L,)``: ``0`` for a block that does not change the direction of any row (e.g. a
        zero block), ``2`` for ``z_l = −z_{l-1}``.  Rows where either vector is zero count as
        cosine ``1`` (no change of direction can be measured).

    Source: Men et al., ShortGPT (arXiv 2403.03853), eq. for BI, averaged over rows (tokens).
    """
    out = []
    for a, b in zip(states.states[:-1], states.states[1:], strict=True):
        ra, rb = stream_rows(a.detach()).double(), stream_rows(b.detach()).double()
        na, nb = ra.norm(dim=1), rb.norm(dim=1)
        ok = (na > 0) & (nb > 0)
        cos = torch.ones_like(na)
        cos[ok] = (ra[ok] * rb[ok]).sum(1) / (na[ok] * nb[ok])
        out.append(1.0 - float(cos.mean()))
    return np.asarray(out, dtype=np.float64)


def update_ratios(states: StreamStates) -> np.ndarray:
    """Relative size of each block's update, ``mean_rows ‖f_l(z_{l-1})‖ / ‖z_{l-1}‖``.

    Args:
        states: the stream.

    Returns:
        float64 ``(L,)`` (rows with ``z_{l-1} = 0`` are left out; NaN if all are).

    Source: seed 002's diminishing-returns condition is stated on the residual functions
    ``f_l``; this is its scale-free measurement.
    """
    out = []
    for a, b in zip(states.states[:-1], states.states[1:], strict=True):
        ra, rb = stream_rows(a.detach()).double(), stream_rows(b.detach()).double()
        na = ra.norm(dim=1)
        ok = na > 0
        out.append(float(((rb - ra)[ok].norm(dim=1) / na[ok]).mean()) if bool(ok.any()) else math.nan)
    return np.asarray(out, dtype=np.float64)


@dataclass
class ExitTable:
    """Per-row exit quantities at every depth ``l = 0 … L``.

    Attributes:
        losses: float64 ``(L+1, n)``: cross-entropy of the exit at depth ``l`` on row ``i``, nats
            per example (per token for language models).
        confidence: float64 ``(L+1, n)``: the exit's largest softmax probability.
        correct: bool ``(L+1, n)``: whether the exit's argmax is the target.
        units: the loss units in words.
        readout: how the exits were read (``"logit lens"`` or ``"fitted linear"``).
    """

    losses: np.ndarray
    confidence: np.ndarray
    correct: np.ndarray
    units: str = "nats per example"
    readout: str = ""

    def __post_init__(self) -> None:
        shapes = {self.losses.shape, self.confidence.shape, self.correct.shape}
        if len(shapes) != 1 or self.losses.ndim != 2 or self.losses.shape[1] == 0:
            raise ValueError(f"ExitTable: losses, confidence, correct must share one (L+1, n>0) shape, got {shapes}")
        if not np.all(np.isfinite(self.losses)):
            raise ValueError("ExitTable: non-finite exit loss")

    @property
    def depth(self) -> int:
        """``L``."""
        return self.losses.shape[0] - 1

    def mean_loss(self) -> np.ndarray:
        """``(L+1,)`` mean exit loss per depth.

        Returns:
            ``(L+1,)`` float64, nats.
        """
        return self.losses.mean(axis=1)

    def accuracy(self) -> np.ndarray:
        """``(L+1,)`` exit accuracy per depth.

        Returns:
            ``(L+1,)`` float64: the fraction of rows whose exit argmax is the target.
        """
        return self.correct.mean(axis=1)


def _table(logits: list[Tensor], y: Tensor, units: str, readout: str) -> ExitTable:
    yy = y.reshape(-1).long()
    losses, conf, corr = [], [], []
    for lg in logits:
        lg = lg.double().reshape(-1, lg.shape[-1])
        if lg.shape[0] != yy.shape[0]:
            raise ValueError(f"exit logits have {lg.shape[0]} rows but there are {yy.shape[0]} targets")
        logp = torch.log_softmax(lg, dim=-1)
        losses.append(-logp.gather(1, yy[:, None])[:, 0])
        conf.append(logp.exp().max(dim=-1).values)
        corr.append(lg.argmax(-1) == yy)
    return ExitTable(torch.stack(losses).numpy(), torch.stack(conf).numpy(), torch.stack(corr).numpy(), units, readout)


@torch.no_grad()
def logit_lens_table(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    norm: nn.Module | None = None,
    head: nn.Module | None = None,
    names: Sequence[str] | None = None,
    batch_size: int = 256,
) -> ExitTable:
    """Exit table of a language model by the logit lens: ``logits_l = head(norm(z_l))``.

    Args:
        model: the model (e.g. :class:`~depthsat_theory.tasks.models.CharGPT`).
        x: long ``(n, T)`` token ids.
        y: long ``(n, T)`` next tokens.
        norm: the final norm (default ``model.ln_f``).
        head: the unembedding (default ``model.head``).
        names: the residual blocks (see :func:`residual_blocks`).
        batch_size: rows of ``x`` per forward pass.

    Returns:
        An :class:`ExitTable` with ``n·T`` rows (tokens), nats per token; the depth-``L`` exit is the
        model's own output.

    Raises:
        ValueError: no ``norm``/``head`` given and the model has no ``ln_f``/``head``.
    """
    norm = getattr(model, "ln_f", None) if norm is None else norm
    head = getattr(model, "head", None) if head is None else head
    if norm is None or head is None:
        raise ValueError("logit lens: pass norm= and head= (the model has no ln_f/head attributes)")
    logits = _per_depth(model, x, names, batch_size, lambda z: head(norm(z)))
    return _table(logits, y, "nats per token", "logit lens")


@torch.no_grad()
def _per_depth(model: nn.Module, x: Tensor, names: Sequence[str] | None, batch_size: int, read) -> list[Tensor]:
    """``read(z_l)`` at every depth ``l``, over ``x`` in batches, concatenated per depth."""
    per_depth: list[list[Tensor]] = []
    for i in range(0, x.shape[0], batch_size):
        _, st = capture_stream(model, x[i : i + batch_size], names)
        for k, z in enumerate(st.states):
            if len(per_depth) <= k:
                per_depth.append([])
            per_depth[k].append(read(z))
    return [torch.cat(p) for p in per_depth]


def _stream_features(model: nn.Module, x: Tensor, names: Sequence[str] | None, batch_size: int) -> list[Tensor]:
    return _per_depth(model, x, names, batch_size, lambda z: _features(z).double())


@dataclass
class LinearReadouts:
    """One multinomial logistic readout per depth, on standardised features.

    Attributes:
        mean, scale: per depth, the train features' mean and standard deviation ``(k,)``.
        weight, bias: per depth, ``(n_classes, k)`` and ``(n_classes,)`` (float64).
        l2: the ridge weight used.
    """

    mean: list[Tensor]
    scale: list[Tensor]
    weight: list[Tensor]
    bias: list[Tensor]
    l2: float

    def logits(self, feats: list[Tensor]) -> list[Tensor]:
        """Per depth ``(n, n_classes)`` logits of per-depth features ``(n, k)``."""
        if len(feats) != len(self.weight):
            raise ValueError(f"{len(feats)} depths of features for {len(self.weight)} fitted readouts")
        return [
            ((f - m) / s) @ w.T + b
            for f, m, s, w, b in zip(feats, self.mean, self.scale, self.weight, self.bias, strict=True)
        ]


def _fit_logistic(f: Tensor, y: Tensor, n_classes: int, l2: float, max_iter: int) -> tuple[Tensor, Tensor]:
    w = torch.zeros(n_classes, f.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(n_classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=max_iter, tolerance_grad=1e-9, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(f @ w.T + b, y) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), b.detach()


def fit_linear_readouts(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    n_classes: int,
    *,
    l2: float = 1e-3,
    names: Sequence[str] | None = None,
    max_iter: int = 200,
    batch_size: int = 1024,
) -> LinearReadouts:
    """Fit a linear softmax readout at every depth on a training split.

    The features of depth ``l`` (``z_l`` per example; channel means for a CNN) are standardised
    with the training mean and standard deviation, then a multinomial logistic regression
    ``softmax(W z + b)`` is fitted by L-BFGS in float64 on the mean cross-entropy
    ``+ l2·‖W‖²_F`` (light ridge: the readout does not interpolate the training split).

    Args:
        model: the trained model (not modified).
        x: float ``(n, …)`` training inputs.
        y: long ``(n,)`` labels.
        n_classes: number of classes.
        l2: ridge weight (on the standardised features).
        names: the residual blocks (see :func:`residual_blocks`).
        max_iter: L-BFGS iterations.
        batch_size: rows per forward pass.

    Returns:
        The :class:`LinearReadouts` (evaluate them with :func:`readout_table` on a held-out split).

    Raises:
        ValueError: ``l2 < 0``, labels that are not ``(n,)`` in ``[0, n_classes)``.
    """
    if l2 < 0 or not math.isfinite(l2):
        raise ValueError(f"l2 must be a finite number >= 0, got {l2}")
    y = y.reshape(-1).long()
    if y.shape[0] != x.shape[0] or int(y.min()) < 0 or int(y.max()) >= n_classes:
        raise ValueError(f"labels: need {x.shape[0]} labels in [0, {n_classes}), got shape {tuple(y.shape)}")
    feats = _stream_features(model, x, names, batch_size)
    means, scales, ws, bs = [], [], [], []
    with torch.enable_grad():
        for f in feats:
            m, s = f.mean(0), f.std(0).clamp_min(1e-8)
            w, b = _fit_logistic((f - m) / s, y, n_classes, l2, max_iter)
            means.append(m)
            scales.append(s)
            ws.append(w)
            bs.append(b)
    return LinearReadouts(means, scales, ws, bs, l2)


def readout_table(
    model: nn.Module,
    readouts: LinearReadouts,
    x: Tensor,
    y: Tensor,
    *,
    names: Sequence[str] | None = None,
    units: str = "nats per example",
    batch_size: int = 1024,
) -> ExitTable:
    """Exit table of fitted readouts on a (held-out) split.

    Args:
        model: the model the readouts were fitted on.
        readouts: :func:`fit_linear_readouts`'s result.
        x: the split's inputs.
        y: its targets.
        names: the residual blocks.
        units: the loss units.
        batch_size: rows per forward pass.

    Returns:
        An :class:`ExitTable` of ``n`` rows.
    """
    feats = _stream_features(model, x, names, batch_size)
    return _table(readouts.logits(feats), y, units, "fitted linear")


def diminishing_returns(ratios: Sequence[float], exit_losses: Sequence[float], *, tol: float = 0.05) -> dict:
    """Seed 002's diminishing-returns condition, measured on one model.

    Two measurements per block ``l = 1 … L``: the relative update ``ρ_l = ‖f_l‖/‖z_{l-1}‖``
    (:func:`update_ratios`) and the decrease of the mean exit loss ``Δ_l = ℓ̄_{l-1} − ℓ̄_l``.
    The condition is read as "later blocks change the representation, and the exit loss, less":

    * ``updates_diminish``: ``ρ_{l+1} ≤ (1 + tol)·ρ_l`` for every ``l``;
    * ``loss_decrease_diminishes``: ``Δ_{l+1} ≤ Δ_l + tol·max_k |Δ_k|`` for every ``l``.

    Args:
        ratios: ``(L,)`` relative updates.
        exit_losses: ``(L+1,)`` mean exit losses per depth.
        tol: slack (relative for ``ρ``, a fraction of the largest ``|Δ|`` for ``Δ``).

    Returns:
        ``{"update_ratio": [...], "loss_decrease": [...], "updates_diminish": bool,
        "loss_decrease_diminishes": bool, "holds": both, "tol": tol}`` (with one block both hold).

    Raises:
        ValueError: ``len(exit_losses) != len(ratios) + 1``, no block, or non-finite values.
    """
    r = np.asarray(ratios, dtype=np.float64)
    el = np.asarray(exit_losses, dtype=np.float64)
    if r.ndim != 1 or r.size == 0 or el.shape != (r.size + 1,):
        raise ValueError(f"need L >= 1 ratios and L+1 exit losses, got {r.shape} and {el.shape}")
    if not (np.all(np.isfinite(r)) and np.all(np.isfinite(el))):
        raise ValueError("diminishing_returns: non-finite input")
    d = el[:-1] - el[1:]
    upd = bool(np.all(r[1:] <= (1 + tol) * r[:-1]))
    scale = float(np.max(np.abs(d))) if d.size else 0.0
    dec = bool(np.all(d[1:] <= d[:-1] + tol * scale))
    return {
        "update_ratio": r.tolist(),
        "loss_decrease": d.tolist(),
        "updates_diminish": upd,
        "loss_decrease_diminishes": dec,
        "holds": upd and dec,
        "tol": tol,
    }
