"""Smoothness at hidden sites (``prop-beta-composed``, ``cor-beta-chain``) and refuting a ``β`` on the
probe (``cor-beta-refuted``): the tool never reports as guaranteed a decrease the real step contradicts.

Independent truths: the closed form of ``ex-beta-misapplied`` (``F(θ) = ¾ sp(−2aθ) + ¼ sp(2aθ)``),
hand-composed chain constants, and ``½‖W‖²`` recomputed with numpy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from depthsat_theory.diagnose import diagnose
from depthsat_theory.diagnose.report import _beta_cell
from depthsat_theory.statistics.decrease import (
    ACTIVATION_CONSTANTS,
    chain_constants,
    composed_smoothness,
    cross_entropy_smoothness,
)


class _Deeper(nn.Module):
    def __init__(self, a: float):
        super().__init__()
        self.site = nn.Linear(1, 1, bias=False).double()
        self.scale = nn.Linear(1, 1, bias=False).double()
        self.head = nn.Linear(1, 2, bias=False).double()
        with torch.no_grad():
            self.site.weight.zero_()
            self.scale.weight.fill_(a)
            self.head.weight.copy_(torch.tensor([[1.0], [-1.0]], dtype=torch.float64))

    def forward(self, x):
        return self.head(self.scale(self.site(x)))


def _loss(out, y):
    return F.cross_entropy(out, y, reduction="none")


def _closed_form(a: float, theta: float) -> float:
    return 0.75 * math.log1p(math.exp(-2 * a * theta)) + 0.25 * math.log1p(math.exp(2 * a * theta))


def test_the_head_bound_one_map_deeper_is_refuted_and_never_printed_as_guaranteed():
    a = 3.0
    net = _Deeper(a)
    x, y = torch.ones(8, 1, dtype=torch.float64), torch.tensor([0, 0, 0, 1, 0, 0, 0, 1])
    res = diagnose(net, _loss, [(x, y)], sites=["site"], beta=1.0)  # ½‖W‖² = 1: the head's input bound
    sd = res["site"]
    assert sd.result.score == pytest.approx(a / 2, rel=1e-12)
    raised = _closed_form(a, 1.5) - math.log(2)  # the step θ = s/β = 3/2 (2.25 − 0.693 nats)
    assert raised == pytest.approx(1.5570, abs=1e-4)
    assert -sd.beta_check.decrease == pytest.approx(raised, rel=1e-10)
    assert sd.beta_status == "refuted" and sd.guaranteed_decrease is None
    assert sd.to_dict()["guaranteed_decrease"] is None and sd.to_dict()["beta_status"] == "refuted"
    assert any("refuted" in note for note in res.notes)
    assert _beta_cell(sd) == f"refuted: removed {-raised:.3g} < {(a / 2) ** 2 / 2:.3g}"
    # the composed constant a² (prop-beta-composed with L = a, H = 0) is consistent and its promise holds
    beta = composed_smoothness(net.head.weight, *chain_constants([net.scale]))
    assert beta == pytest.approx(a * a, rel=1e-12)
    ok = diagnose(net, _loss, [(x, y)], sites=["site"], beta=beta)["site"]
    assert ok.beta_status == "consistent"
    assert ok.guaranteed_decrease == pytest.approx((a / 2) ** 2 / (2 * a * a), rel=1e-12)
    assert math.log(2) - _closed_form(a, (a / 2) / beta) >= ok.guaranteed_decrease


def test_chain_constants_hand_composition():
    lin1, lin2 = nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        lin1.weight.copy_(torch.diag(torch.tensor([2.0, 1.0, 0.5])))
        lin2.weight.copy_(torch.diag(torch.tensor([-3.0, 1.0, 0.0])))
    c2 = 4 / (3 * math.sqrt(3))
    lip, curv = chain_constants([lin1, nn.Tanh(), lin2])
    assert lip == pytest.approx(6.0) and curv == pytest.approx(3 * c2 * 4)  # H = ‖A₂‖ c₂ ‖A₁‖²
    lip, curv = chain_constants([("residual", [lin1, nn.Tanh(), lin2])])
    assert lip == pytest.approx(7.0) and curv == pytest.approx(12 * c2)
    assert ACTIVATION_CONSTANTS["gelu"][1] == pytest.approx(math.sqrt(2 / math.pi))


@pytest.mark.parametrize("step", [nn.ReLU(), nn.LayerNorm(3), nn.GELU(approximate="tanh")])
def test_chain_constants_refuse_kinks_and_norms(step):
    with pytest.raises(ValueError, match="no smoothness constant is proven through"):
        chain_constants([nn.Linear(3, 3), step])


def test_composed_smoothness_reduces_to_the_head_bound():
    w = torch.randn(5, 4, dtype=torch.float64)
    assert composed_smoothness(w, 1.0, 0.0) == pytest.approx(cross_entropy_smoothness(w), rel=1e-12)
    want = 0.5 * np.linalg.norm(w.numpy(), 2) ** 2 * 4 + math.sqrt(2) * np.linalg.norm(w.numpy(), 2) * 0.5
    assert composed_smoothness(w, 2.0, 0.5, units_per_example=2) == pytest.approx(want / 2, rel=1e-12)
    with pytest.raises(ValueError, match="lipschitz"):
        composed_smoothness(w, -1.0, 0.0)


class _Tokens(nn.Module):
    """``(B, T, d)`` tokens ``↦`` site (Linear) ``↦`` tanh mixing ``↦`` per-token head; loss: token mean."""

    def __init__(self, d: int = 3, classes: int = 4):
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.site = nn.Linear(d, d).double()
        self.mix = nn.Linear(d, d).double()
        self.head = nn.Linear(d, classes).double()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))

    def forward(self, x):
        return self.head(torch.tanh(self.mix(self.site(x))))


def _token_loss(out, y):
    return F.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(1)


@pytest.mark.parametrize(("beta", "status"), [(0.05, "refuted"), (50.0, "consistent")])
def test_the_step_check_at_a_sequence_site_matches_an_independent_least_squares_step(beta, status):
    """The field ``Πg`` of the linear family is the least-squares fit of the per-token ``g`` on
    ``(z, 1)`` (numpy ``lstsq``, independent of the engine's eigensolves); inserting ``z ↦ z − fit/β``
    by hand and evaluating the loss gives the decrease the check must report."""
    net = _Tokens()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 5, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (6, 5), generator=gen)
    sd = diagnose(net, _token_loss, [(x[:3], y[:3]), (x[3:], y[3:])], sites=["site"], beta=beta)["site"]
    z = net.site(x).detach().requires_grad_(True)
    losses = _token_loss(net.head(torch.tanh(net.mix(z))), y)
    (g,) = torch.autograd.grad(losses.sum(), z)  # per-example activation gradients (def-setting)
    design = np.concatenate([z.detach().reshape(-1, 3).numpy(), np.ones((30, 1))], axis=1)
    coef, *_ = np.linalg.lstsq(design, g.reshape(-1, 3).numpy(), rcond=None)
    fit = torch.from_numpy(design @ coef).reshape(6, 5, 3)
    with torch.no_grad():
        before = float(_token_loss(net(x), y).mean())
        after = float(_token_loss(net.head(torch.tanh(net.mix(z - fit / beta))), y).mean())
    assert sd.beta_check is not None
    assert sd.beta_check.decrease == pytest.approx(before - after, rel=1e-8, abs=1e-12)
    promised = sd.result.score**2 / (2 * beta)
    assert sd.beta_status == ("refuted" if before - after < promised else "consistent") == status


def test_a_promise_below_the_loss_rounding_is_marked_untestable():
    """β = 10¹⁶: s²/(2β) ≈ 1e-16 nats, below the float64 rounding of J ≈ 0.69 (64u|J| ≈ 1e-14)."""
    net = _Deeper(3.0)
    x, y = torch.ones(8, 1, dtype=torch.float64), torch.tensor([0, 0, 0, 1, 0, 0, 0, 1])
    res = diagnose(net, _loss, [(x, y)], sites=["site"], beta=1e16)
    sd = res["site"]
    assert sd.guaranteed_decrease == pytest.approx(1.5**2 / 2e16)
    assert sd.beta_check.tolerance > 10 * sd.guaranteed_decrease
    assert sd.beta_status == "within rounding" and _beta_cell(sd).endswith("?")
    assert any("cannot test" in note for note in res.notes)


def test_second_order_refuses_cross_blocks_beyond_the_memory_limit(monkeypatch):
    """relu:4 at a width-8 site: 4·8·9 float64 = 2304 bytes per site; a 4000-byte limit fits one site."""
    from depthsat_theory.diagnose import beyond
    from depthsat_theory.diagnose.errors import DiagnoseError
    from depthsat_theory.tasks import ResidualMLP, classification_loss

    monkeypatch.setattr(beyond, "SECOND_ORDER_MAX_BYTES", 4000)
    net = ResidualMLP(in_dim=4, width=8, depth=2, n_classes=3).double().eval()
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))
    ok = diagnose(net, classification_loss, [(x, y)], sites=["blocks.0"], family="relu:4", second_order=True)
    assert ok["blocks.0"].saddle is not None
    with pytest.raises(DiagnoseError, match=r"at most 1 sites per run \(--sites\)"):
        diagnose(net, classification_loss, [(x, y)], sites=["blocks.0", "blocks.1"], family="relu:4", second_order=True)
