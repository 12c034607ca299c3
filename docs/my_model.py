"""A user's own model for the README's example: a residual MLP, briefly trained, and its probe.

``factory()`` returns what depthsat needs from your code: ``(model, loss_fn, batches)``.
"""

import torch
from torch import nn


class Block(nn.Module):
    """A residual block ``h + f(h)``."""

    def __init__(self, d):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d))

    def forward(self, h):  # noqa: D102
        return h + self.f(h)


class Net(nn.Module):
    """Input layer, ``depth`` residual blocks (the sites ``blocks.0``, ``blocks.1``, …), output layer."""

    def __init__(self, d=16, depth=3):
        super().__init__()
        self.inp, self.out = nn.Linear(4, d), nn.Linear(d, 1)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))  # sites blocks.0, blocks.1, ...

    def forward(self, x):  # noqa: D102
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def loss_fn(out, target):
    """Squared error, one loss per example: shape ``(B,)``."""
    return ((out - target) ** 2).sum(dim=1)


def factory():
    """``(model, loss_fn, batches)``: the model after 30 Adam steps, and 8 probe batches of 1,024 examples."""
    torch.manual_seed(0)
    x = torch.randn(8192, 4)
    y = torch.sin(3 * x[:, :1]) * x[:, 1:2]
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(30):  # a short training run: this network is far from deep enough
        opt.zero_grad()
        loss_fn(model(x), y).mean().backward()
        opt.step()
    batches = [(x[i : i + 1024], y[i : i + 1024]) for i in range(0, 8192, 1024)]
    return model, loss_fn, batches
