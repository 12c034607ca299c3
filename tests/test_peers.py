"""The correspondence with GroMo (theory/peers.md, ``prop-gromo-decrease``), against GroMo's own code.

GroMo 0.1.0's ``LinearGrowingModule.compute_optimal_delta`` on a zero-initialized residual linear
layer returns ``parameter_update_decrease``; the independent truth is that number, and the test
asserts that the numeric engine's ``s²`` equals it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gromo.modules import linear_growing_module as gromo_linear  # the peers extra (./dev test installs it)
from torch import nn

from depthsat_theory.families import parse_family
from depthsat_theory.statistics import statistics_for


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gromo_parameter_update_decrease_is_the_squared_score(seed):
    torch.manual_seed(seed)
    n, d, c = 64, 5, 4
    x, y = torch.randn(n, d), torch.randint(0, c, (n,))
    enc, head = nn.Linear(d, d), nn.Linear(d, c)
    lin = gromo_linear.LinearGrowingModule(d, d, use_bias=True, name="blk")
    with torch.no_grad():
        lin.layer.weight.zero_()
        lin.layer.bias.zero_()
    lin.init_computation()
    z = torch.tanh(enc(x)).detach().requires_grad_(True)
    F.cross_entropy(head(z + lin(z)), y, reduction="sum").backward()
    lin.update_computation()
    _, _, decrease = lin.compute_optimal_delta()
    stats = statistics_for(parse_family("linear"), (d,), "vector")
    stats.update(z.detach().double(), z.grad.double())
    assert float(decrease) == pytest.approx(stats.result().score ** 2, rel=1e-5)
