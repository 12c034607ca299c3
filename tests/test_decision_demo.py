"""The decision on trained residual MLPs: *train longer first* vs *add depth here* (theory/decision.md).

Two small regression models with squared error (``½(f(x) − y)²`` per example, ``x ~ N(0, I₂)``, noise 0.3):

- **stationary, with a missing block**: ``y = x₁x₂ + ε`` and a residual block of one ReLU unit, trained by
  L-BFGS to a stationary point.  Decision *add depth here*; and indeed more training of the existing
  parameters gains nothing while a new block, trained, lowers the loss.
- **under-trained last map**: the teacher's own architecture (4 ReLU units) with the block's last map at half
  its value.  Decision *train longer first*; and indeed training that map alone recovers the teacher's loss.

The outcomes after training are the independent truth the first-order decision is checked against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from depthsat_theory.decision import DepthDecision, beyond_training


class ResidualMLP(nn.Module):
    """``z₁ = x + W_o relu(A x + a) + c_o``, output ``head(z₁)``; optionally one more block at ``z₁``."""

    def __init__(self, hidden: int, extra: int = 0) -> None:
        super().__init__()
        self.a, self.o, self.head = nn.Linear(2, hidden), nn.Linear(hidden, 2), nn.Linear(2, 1)
        self.extra = nn.Sequential(nn.Linear(2, extra), nn.ReLU(), nn.Linear(extra, 2)) if extra else None
        if self.extra is not None:
            nn.init.zeros_(self.extra[2].weight)
            nn.init.zeros_(self.extra[2].bias)

    def parts(self, x):
        psi = F.relu(self.a(x))
        return x + self.o(psi), psi

    def forward(self, x):
        z1, _ = self.parts(x)
        if self.extra is not None:
            z1 = z1 + self.extra(z1)
        return self.head(z1)[:, 0]


def loss_of(net, x, y):
    return 0.5 * ((net(x) - y) ** 2).mean()


def lbfgs(params, closure_loss, rounds: int = 6) -> None:
    opt = torch.optim.LBFGS(
        params,
        max_iter=300,
        tolerance_grad=1e-12,
        tolerance_change=1e-15,
        history_size=30,
        line_search_fn="strong_wolfe",
    )

    def closure():
        opt.zero_grad()
        val = closure_loss()
        val.backward()
        return val

    for _ in range(rounds):
        opt.step(closure)


def decision_of(net, x, y):
    """Site ``z₁``; ``T_old``: the last map (``ψ̃ = (relu(Ax + a), 1)``); new family: 32 random ReLUs of ``z₁``."""
    z1, psi = net.parts(x)
    z1 = z1.detach().requires_grad_(True)
    (g,) = torch.autograd.grad((0.5 * (net.head(z1)[:, 0] - y) ** 2).sum(), z1)
    gen = torch.Generator().manual_seed(1)
    r, b = (
        torch.randn(2, 32, generator=gen, dtype=torch.float64),
        0.5 * torch.randn(32, generator=gen, dtype=torch.float64),
    )
    ones = torch.ones(len(x), 1, dtype=torch.float64)
    phi = torch.cat([F.relu(z1.detach() @ r + b), ones], 1)
    return beyond_training(torch.cat([psi.detach(), ones], 1), phi, g)


def _data(n: int = 1024):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 2, generator=gen, dtype=torch.float64)
    return x, 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)


def test_stationary_model_with_a_missing_block_says_add_depth_here_and_depth_pays():
    torch.set_num_threads(1)
    x, eps = _data()
    y = x[:, 0] * x[:, 1] + eps
    torch.manual_seed(0)
    net = ResidualMLP(hidden=1).double()
    lbfgs(list(net.parameters()), lambda: loss_of(net, x, y))
    res = decision_of(net, x, y)
    assert res.decision is DepthDecision.ADD_DEPTH, res.reason
    before = loss_of(net, x, y).item()
    lbfgs(list(net.parameters()), lambda: loss_of(net, x, y), rounds=2)  # more training of what exists
    trained = loss_of(net, x, y).item()
    grown = ResidualMLP(hidden=1, extra=32).double()
    grown.load_state_dict(net.state_dict(), strict=False)
    assert abs(loss_of(grown, x, y).item() - trained) < 1e-12  # the inserted block starts at zero output
    lbfgs(list(grown.parameters()), lambda: loss_of(grown, x, y), rounds=2)
    assert before - trained < 1e-6 < 0.01 < trained - loss_of(grown, x, y).item()


def test_under_trained_last_map_says_train_longer_first_and_training_recovers_the_loss():
    torch.set_num_threads(1)
    x, eps = _data()
    torch.manual_seed(1)
    teacher = ResidualMLP(hidden=4).double()
    with torch.no_grad():
        teacher.o.weight.mul_(3)
    y = teacher(x).detach() + eps
    student = ResidualMLP(hidden=4).double()
    student.load_state_dict(teacher.state_dict())
    with torch.no_grad():
        student.o.weight.mul_(0.5)
    res = decision_of(student, x, y)
    assert res.decision is DepthDecision.TRAIN_LONGER, res.reason
    gap = loss_of(student, x, y).item() - loss_of(teacher, x, y).item()
    lbfgs(list(student.o.parameters()), lambda: loss_of(student, x, y), rounds=2)  # the last map only
    assert gap > 0.005 and loss_of(student, x, y).item() <= loss_of(teacher, x, y).item() + 1e-9
