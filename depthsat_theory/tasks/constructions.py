"""Exact saturated constructions (theory label ``ex-saturated``).

Each builds a :class:`~depthsat_theory.tasks.training.Task` in float64 together with the
sites and families at which the saturation score is *exactly* zero, so that the
theorem checker and the tests see ``s = 0`` while the activation gradient is not
zero (converse evidence for T6: ``g ≠ 0`` with ``s = 0``).

(a) :func:`lsq_readout`: a linear family (with an intercept exactly when the
    family has an output bias) at the *direct input* of a readout refitted by
    unregularized least squares on the probe; the loss is squared error.  At the
    optimum the residual ``e = Wz + c − y`` satisfies ``E[e zᵀ] = 0`` and ``E[e] = 0``,
    so ``G = E[Wᵀe φ̃ᵀ] = 0``.
(b) :func:`odd_network`: no biases anywhere, LayerNorm without ``β``, odd
    activations, squared error with odd targets, a probe symmetrized under
    ``x → −x``, and even features (``|u|``, ``u²``): ``g`` is odd and ``φ̃`` even in
    ``x``, so ``G = 0`` by symmetry.
"""

from __future__ import annotations

import copy
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from depthsat_theory.tasks.training import Task
from depthsat_theory.vocabulary import Layout

__all__ = [
    "LSQ_FAMILIES",
    "ODD_FAMILIES",
    "OddMLP",
    "lsq_readout",
    "odd_network",
    "squared_error",
]

#: Families saturated exactly at the readout input of :func:`lsq_readout`.
LSQ_FAMILIES = ("linear", "linear-nobias")
#: Families saturated exactly at every site of :func:`odd_network`.
ODD_FAMILIES = ("even:abs", "even:square")


def squared_error(out: Tensor, y: Tensor) -> Tensor:
    """Per-example squared error ``½ ‖out − y‖²`` (``(B,)``; squared-error units, not nats).

    Args:
        out: model outputs ``(B, *)``.
        y: targets of the same shape.

    Returns:
        The per-example losses ``(B,)``, in ``out``'s dtype.
    """
    return 0.5 * (out - y).pow(2).flatten(1).sum(1)


def lsq_readout(task: Task, readout_input: str = "ln_f", head: str = "head") -> tuple[Task, list[str]]:
    """Construction (a): refit a classifier's readout by least squares on the probe.

    Args:
        task: a trained vector-layout task whose ``head`` is an ``nn.Linear`` applied
            directly to the output of module ``readout_input``.
        readout_input: module whose output is the readout's direct input (the site).
        head: attribute name of the readout ``nn.Linear``.

    Returns:
        ``(new_task, [readout_input])``: the model with the refitted readout and the
        squared-error loss against one-hot targets, and the exactly saturated site.

    Raises:
        ValueError: if the task is not a vector-layout classifier with that head.
    """
    if task.layout != Layout.VECTOR or not isinstance(getattr(task.model, head, None), nn.Linear):
        raise ValueError("lsq_readout needs a vector-layout classifier with an nn.Linear head")
    model = copy.deepcopy(task.model).to(torch.float64).eval()
    feats: list[Tensor] = []
    mod = dict(model.named_modules())[readout_input]
    handle = mod.register_forward_hook(lambda m, i, o: feats.append(o.detach()))
    with torch.no_grad():
        model(task.inputs)
    handle.remove()
    z = feats[0].cpu().numpy()
    lin = getattr(model, head)
    n_out = lin.out_features
    y = np.eye(n_out)[task.targets.cpu().numpy()]
    design = np.hstack([z, np.ones((z.shape[0], 1))])
    beta, *_ = np.linalg.lstsq(design, y, rcond=None)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(beta[:-1].T.copy()))
        lin.bias.copy_(torch.from_numpy(beta[-1].copy()))
    targets = torch.from_numpy(y).to(task.inputs.device)
    with torch.no_grad():
        probe_loss = float(squared_error(model(task.inputs), targets).mean())
    new = Task(
        kind=f"{task.kind}-lsq",
        data=task.data,
        model=model,
        inputs=task.inputs,
        targets=targets,
        loss=squared_error,
        layout=Layout.VECTOR,
        train_loss=float("nan"),
        probe_loss=probe_loss,
    )
    return new, [readout_input]


class _OddBlock(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.ln = nn.LayerNorm(d, bias=False)
        self.fc1 = nn.Linear(d, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class OddMLP(nn.Module):
    """A residual MLP that is an odd function of its input (no biases, tanh, LN without β)."""

    layout: ClassVar[Layout] = Layout.VECTOR

    def __init__(self, in_dim: int = 8, width: int = 16, depth: int = 3, out_dim: int = 4):
        super().__init__()
        self.embed = nn.Linear(in_dim, width, bias=False)
        self.blocks = nn.ModuleList(_OddBlock(width, 2 * width) for _ in range(depth))
        self.head = nn.Linear(width, out_dim, bias=False)

    def site_names(self) -> list[str]:
        """``["embed", "blocks.0", ...]``.

        Returns:
            The residual-stream site names in depth order.
        """
        return ["embed"] + [f"blocks.{i}" for i in range(len(self.blocks))]

    def forward(self, x: Tensor) -> Tensor:
        """Outputs ``(B, out_dim)`` of inputs ``(B, in_dim)``; ``f(−x) = −f(x)``.

        Args:
            x: inputs ``(B, in_dim)``.

        Returns:
            Outputs ``(B, out_dim)`` in ``x``'s dtype.
        """
        h = self.embed(x)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)


def odd_network(seed: int = 0, n_half: int = 128, steps: int = 150) -> tuple[Task, list[str]]:
    """Construction (b): an odd residual MLP briefly trained on odd synthetic targets.

    The probe is ``{x_i} ∪ {−x_i}`` (``2·n_half`` examples, Gaussian ``x ∈ R^8``),
    targets ``y = sin(x M)`` (odd), loss ``½‖f(x) − y‖²``.  Training (Adam, float32,
    ``steps`` full-batch steps on a separate symmetrized sample) keeps the network
    odd, so every site is exactly saturated for :data:`ODD_FAMILIES`.

    Args:
        seed: seed of the weights, the mixing matrix and the samples.
        n_half: number of Gaussian inputs before symmetrization (the probe has ``2·n_half``).
        steps: number of Adam steps.

    Returns:
        ``(task, sites)`` with ``task.data == "synthetic"``.
    """
    gen = torch.Generator().manual_seed(seed)
    model = OddMLP()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[-1]))
    mix = torch.randn(8, 4, generator=gen)

    def sample(n: int) -> tuple[Tensor, Tensor]:
        x = torch.randn(n, 8, generator=gen)
        x = torch.cat([x, -x])
        return x, torch.sin(x @ mix)

    xt, yt = sample(256)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss = squared_error(model(xt), yt).mean()
    for _ in range(steps):
        opt.zero_grad()
        loss = squared_error(model(xt), yt).mean()
        loss.backward()
        opt.step()
    model = model.to(torch.float64).eval()
    xp, yp = sample(n_half)
    xp, yp = xp.double(), yp.double()
    with torch.no_grad():
        probe_loss = float(squared_error(model(xp), yp).mean())
    task = Task(
        kind="mlp-odd",
        data="synthetic",
        model=model,
        inputs=xp,
        targets=yp,
        loss=squared_error,
        layout=Layout.VECTOR,
        train_loss=float(loss.detach()),
        probe_loss=probe_loss,
    )
    return task, model.site_names()
