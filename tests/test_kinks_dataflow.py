"""Kink ties at selections (``where``, masks, ``sign``, ``sort``/``topk``), ``amax`` after ``relu``, and
attribution by data flow ( ``thm-gradient``, ``ex-kink-tie``).

Independent truth: each downstream function below is known in closed form (``where(z>0, z, 0) +
where(z<0, z, 0) = z``, ``z + z·sign(z) = z + |z|``, ``max(z, 0) − max(−z, 0) = z`` via ``sort`` and
``topk``), so the one-sided derivatives of ``J(θ)`` for the bias family ``h = θ`` are written down by
hand and checked by evaluating ``J`` at ``±h``; autograd's gradient at the tie differs from them, and
the counter must count the ties (the verdict is then ``undetermined``).  Tie counts are hand counts.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from depthsat_theory.capture.kinks import KinkCounter, kink_ties
from depthsat_theory.diagnose import diagnose
from depthsat_theory.vocabulary import Verdict


def _zero(z: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(z)


#: name → (downstream map L(z), right derivative of J at θ = 0, left derivative, ties per example)
DOWNSTREAM = {
    "where": (lambda z: torch.where(z > 0, z, 0.0) + torch.where(z < 0, z, 0.0), 1.0, 1.0, 2),
    "mask": (lambda z: z * (z > 0) + z * (z < 0), 1.0, 1.0, 2),
    "sign": (lambda z: z + z * torch.sign(z), 2.0, 0.0, 1),
    "sort": (
        lambda z: (
            torch.sort(torch.stack([z, _zero(z)], -1), -1).values[..., -1]
            - torch.sort(torch.stack([-z, _zero(z)], -1), -1).values[..., -1]
        ),
        1.0,
        1.0,
        2,
    ),
    "topk": (
        lambda z: (
            torch.topk(torch.stack([z, _zero(z)], -1), 1).values[..., 0]
            - torch.topk(torch.stack([-z, _zero(z)], -1), 1).values[..., 0]
        ),
        1.0,
        1.0,
        2,
    ),
}


class _Site(nn.Module):
    """``x ↦ L(site(x))`` with a zeroed ``Linear(1, 1)`` site (so ``z = 0`` on every example)."""

    def __init__(self, downstream):
        super().__init__()
        self.site = nn.Linear(1, 1).double()
        self.downstream = downstream
        with torch.no_grad():
            self.site.weight.zero_()
            self.site.bias.zero_()

    def forward(self, x):
        return self.downstream(self.site(x))


@pytest.mark.parametrize("name", sorted(DOWNSTREAM))
def test_selection_ties_make_a_wrong_autograd_gradient_undetermined(name):
    fn, right, left, per = DOWNSTREAM[name]
    n = 6
    x = torch.randn(n, 1, dtype=torch.float64)
    net = _Site(fn)

    def loss(out, _y):
        return out.sum(1)

    def j(theta: float) -> float:
        with torch.no_grad():
            net.site.bias.fill_(theta)
            val = float(loss(net(x), None).mean())
            net.site.bias.zero_()
        return val

    h = 2.0**-10  # exact in binary: the maps are piecewise linear, so the differences are exact
    assert (j(h) - j(0.0)) / h == right and (j(0.0) - j(-h)) / h == left  # the closed form holds
    net.zero_grad()
    loss(net(x), None).mean().backward()
    autograd = float(net.site.bias.grad)
    assert not (left == right == autograd), "the example must break autograd at the tie"
    res = diagnose(net, loss, [(x, torch.zeros(n))], sites=["site"])
    r = res["site"].result
    assert r.kink_ties == per * n
    assert r.verdict is Verdict.UNDETERMINED and "kink" in r.verdict_reason


def test_new_primitives_hand_counts():
    x = torch.tensor([0.0, 1.5, -2.0, 0.0, 2.5, 1.5], requires_grad=True)
    assert kink_ties(torch.Tensor.__gt__, (x, 0.0)) == 2
    assert kink_ties(torch.ge, (x, 1.5)) == 2
    assert kink_ties(torch.sign, (x,)) == 2
    assert kink_ties(torch.floor, (x,)) == 3  # 0, −2, 0
    assert kink_ties(torch.round, (x,)) == 3  # 1.5, 2.5, 1.5
    assert kink_ties(torch.sort, (x,)) == 2  # (0, 0) and (1.5, 1.5)
    assert kink_ties(torch.topk, (x, 2)) == 1  # 2.5, 1.5, 1.5: which 1.5 is kept flips → 1
    assert kink_ties(torch.topk, (x, 1)) == 0  # 2.5 > 1.5
    y = torch.tensor([3.0, 1.0, 1.0, 0.0], requires_grad=True)
    assert kink_ties(torch.topk, (y, 1)) == 0 and kink_ties(torch.topk, (y, 2)) == 1
    assert kink_ties(torch.topk, (y, 1), {"largest": False}) == 0
    assert kink_ties(torch.argmax, (torch.tensor([[1.0, 1.0], [0.0, 2.0]], requires_grad=True), 1)) == 1
    assert kink_ties(torch.cummax, (torch.tensor([1.0, 0.0, 1.0, 2.0], requires_grad=True), 0)) == 1
    assert kink_ties(torch.sign, (x.detach(),)) == 0  # no gradient: cannot depend on the site


def test_topk_boundary_tie_is_counted():
    """``topk(x, 2)`` of (2.5, 1.5, 1.5): which 1.5 is kept flips under a perturbation → one tie."""
    x = torch.tensor([1.5, 2.5, 1.5], requires_grad=True)
    assert kink_ties(torch.topk, (x, 2)) == 1


def test_amax_of_clamped_relu_zeros_is_not_a_tie():
    """relu → amax over a row: a row of strictly negative inputs has maxima that are locally constant
    zeros (``max(0, 0, 0) = 0`` stays 0 nearby: differentiable, autograd right) → 0; a row with an input
    exactly 0 has relu's own tie (1) plus the tied maxima, one not locally constant (2) → 3; a row
    (2, 2, −1) has one extra attainment (1).  Hand count 4; the same values without relu's mask count 2 more."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.site = nn.Identity()

        def forward(self, x):
            return torch.relu(self.site(x)).amax(dim=1)

    x = torch.tensor([[-1.0, -2.0, -3.0], [0.0, -1.0, -2.0], [2.0, 2.0, -1.0]])
    net = Net()
    counter = KinkCounter(net, ["site"])
    with counter:
        counter.wrap_loss(lambda out, _y: out)(net(x.clone().requires_grad_(True) * 1.0), None)
    assert counter.ties == {"site": 4}
    assert kink_ties(torch.amax, (torch.relu(x).requires_grad_(True), 1)) == 2 + 2 + 1


class _Branches(nn.Module):
    """Site ``a`` feeds the output linearly; an independent branch with a relu tie runs *after* ``a``
    in execution order but does not depend on it; site ``b`` is upstream of that relu."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(1, 1).double()
        self.b = nn.Linear(1, 1).double()
        with torch.no_grad():
            self.a.weight.fill_(1.0)
            self.a.bias.zero_()
            self.b.weight.fill_(1.0)
            self.b.bias.zero_()

    def forward(self, x):
        za = self.a(x)
        zb = torch.relu(self.b(x))  # executed after site a, independent of it; ties where x = 0
        return za + zb


def test_ties_are_attributed_by_data_flow_not_execution_order():
    x = torch.tensor([[0.0], [1.0], [0.0], [-1.0]] * 8, dtype=torch.float64)  # 16 zeros
    net = _Branches()
    counter = KinkCounter(net, ["a", "b"])
    with counter:
        counter.wrap_loss(lambda out, _y: out.sum(1))(net(x), None)
    assert counter.ties == {"a": 0, "b": 16}
    # independent truth for a: J is linear in a's bias (d/dθ of mean(za + zb) is exactly 1 both ways)
    loss = lambda out, _y: out.sum(1)  # noqa: E731
    res = diagnose(net, loss, [(x, torch.zeros(32))], sites=["a", "b"])
    assert res["a"].result.kink_ties == 0 and res["a"].result.verdict is Verdict.IMPROVABLE
    assert res["b"].result.kink_ties == 16 and res["b"].result.verdict is Verdict.UNDETERMINED


def test_in_place_writes_carry_the_site_into_their_target():
    """``buf[:, 0] = z`` and ``view.copy_(z)`` make ``buf`` depend on the site: a relu tie on ``buf``
    counts (hand count: z = 0 on both rows → 2 ties per write path)."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.site = nn.Linear(1, 1)
            with torch.no_grad():
                self.site.weight.zero_()
                self.site.bias.zero_()

        def forward(self, x):
            z = self.site(x)
            buf = torch.ones(x.shape[0], 2) * 1.0
            buf[:, 0] = z[:, 0]
            other = torch.ones(x.shape[0], 1) * 1.0
            other.view(-1).copy_(z[:, 0])
            return torch.relu(buf[:, :1]) + torch.relu(other)

    net = Net()
    counter = KinkCounter(net, ["site"])
    with counter:
        counter.wrap_loss(lambda out, _y: out.sum(1))(net(torch.randn(2, 1)), None)
    assert counter.ties == {"site": 2 + 2}
