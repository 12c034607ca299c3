"""depthsat_theory.grow: insert_blocks, zero-state parameter groups, the first-step preview, rank_sites.

Independent truths: the gradient of the inserted block against a dense autograd reference on the
*original* model (``b = Σ_i g_i φ(z_i)ᵀ`` with ``g_i = ∂J/∂z_i``, T1), Adam's and SGD-momentum's
first step from zero state in closed form (``m₁ = (1 − β₁) b``, ``θ₁ = −η b/(|b| + ε)``;
``buf₁ = b``, ``θ₁ = −η b``), the first-order rate ``−η‖b‖²`` of SGD, and hand-derived orders.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from depthsat_theory.capture import SiteError
from depthsat_theory.diagnose import Diagnosis, SiteDiagnosis
from depthsat_theory.families import FamilyError, ResidualFamily
from depthsat_theory.grow import (
    BY_CERTIFIED,
    BY_HEADLINE,
    BY_POINT,
    GrowError,
    NotFunctionPreservingError,
    even_positions,
    insert_blocks,
    preview_first_step,
    rank_sites,
    zero_state_param_groups,
)
from depthsat_theory.vocabulary import Layout, Verdict


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class _Net(nn.Module):
    def __init__(self, d: int = 5, depth: int = 3, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(4, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(depth))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _setup(device, n=40, seed=0):
    torch.manual_seed(seed)
    net = _Net().double().to(device).eval()
    x = torch.randn(n, 4, dtype=torch.float64, device=device)
    y = torch.randint(0, 3, (n,), device=device)
    return net, x, y


def _ce(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


def _site_grad(net, site_mod, x, y):
    """Dense reference on the original model: the site tensor z and g = ∂J/∂z (J the mean loss)."""
    store = {}

    def hook(_m, _i, out):
        out.retain_grad()
        store["z"] = out

    h = site_mod.register_forward_hook(hook)
    loss = _ce(net(x), y).mean()
    h.remove()
    loss.backward()
    net.zero_grad()
    return store["z"].detach(), store["z"].grad.detach()


# ----------------------------------------------------------------------------- insert_blocks
def test_insert_blocks_preserves_function_and_gradient_is_b(device):
    net, x, y = _setup(device)
    g = insert_blocks(net, {"blocks.0": "linear", "blocks.2": "relu:6:3"}, probe=x, seed=1)
    assert g.sites == ["blocks.0", "blocks.2"]
    assert g.deviation == 0.0 and g.tolerance > 0
    assert g.shapes == {"blocks.0": (5,), "blocks.2": (5,)} and g.layouts["blocks.0"] == Layout.VECTOR
    assert all(p.device.type == device.type for ps in g.new_params.values() for p in ps)
    assert net.blocks[0].__class__ is _Block  # the original is untouched
    theta = g.tangent_params()
    for ps in theta.values():
        assert all(float(p.detach().abs().max()) == 0.0 for p in ps)  # the tangent coordinates start at zero
    loss = _ce(g.model(x), y).mean()
    params = [p for ps in g.new_params.values() for p in ps]
    grads = dict(zip(map(id, params), torch.autograd.grad(loss, params, allow_unused=True), strict=True))
    # linear at blocks.0: b = (Σ g zᵀ, Σ g) on the original model
    z, gz = _site_grad(net, net.blocks[0], x, y)
    w, c = theta["blocks.0"]
    torch.testing.assert_close(grads[id(w)], gz.T @ z, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(grads[id(c)], gz.sum(0), rtol=1e-10, atol=1e-14)
    # relu features at blocks.2: b = Σ g φ(z)ᵀ; the feature parameters get zero gradient (T1)
    z2, g2 = _site_grad(net, net.blocks[2], x, y)
    block = g.blocks["blocks.2"]
    with torch.no_grad():
        phi = block.features(z2)
    w2 = theta["blocks.2"][0]
    torch.testing.assert_close(grads[id(w2)], g2.T @ phi.reshape(z2.shape[0], -1), rtol=1e-10, atol=1e-14)
    tid = {id(p) for p in theta["blocks.2"]}
    for p in g.new_params["blocks.2"]:
        if id(p) not in tid:
            gp = grads[id(p)]
            assert gp is None or float(gp.abs().max()) == 0.0


def test_insert_blocks_inplace_keeps_parameters():
    net, x, _ = _setup(torch.device("cpu"))
    before = [id(p) for p in net.parameters()]
    g = insert_blocks(net, {"blocks.1": "linear"}, probe=x, inplace=True)
    assert g.model is net
    ids = {id(p) for p in net.parameters()}
    assert set(before) <= ids and len(ids) == len(before) + 2


class _NotZero(ResidualFamily):
    """A 'family' whose block is not zero at the origin."""

    spec = "not-zero"

    def param_dim(self, shape):
        return shape[-1] ** 2

    def functional(self, theta, z, layout):
        return z @ theta.view(z.shape[-1], z.shape[-1])

    def block(self, shape, layout, *, dtype=None, device=None):
        lin = nn.Linear(shape[-1], shape[-1], bias=False).to(torch.float64)
        nn.init.constant_(lin.weight, 0.1)
        return lin


def test_insert_blocks_bad_input():
    net, x, _ = _setup(torch.device("cpu"))
    with pytest.raises(GrowError, match="needs probe="):
        insert_blocks(net, {"blocks.0": "linear"})
    with pytest.raises(SiteError, match="nope"):
        insert_blocks(net, {"nope": "linear"}, probe=x)
    with pytest.raises(FamilyError, match=r"site 'blocks.0' \(per-example shape \(5,\), vector layout\).*does not fit"):
        insert_blocks(net, {"blocks.0": "conv1x1"}, probe=x)
    with pytest.raises(NotFunctionPreservingError, match="not function-preserving"):
        insert_blocks(net, {"blocks.0": _NotZero()}, probe=x)
    with pytest.raises(GrowError, match="no sites"):
        insert_blocks(net, {}, probe=x)


# ----------------------------------------------------------------------------- zero-state groups
def _trained_opt(kind):
    torch.manual_seed(0)
    old = nn.Linear(3, 2).double()
    opt = (
        torch.optim.Adam(old.parameters(), lr=1e-2)
        if kind == "adam"
        else torch.optim.SGD(old.parameters(), lr=1e-2, momentum=0.9)
    )
    x = torch.randn(8, 3, dtype=torch.float64)
    for _ in range(2):
        opt.zero_grad()
        old(x).pow(2).sum().backward()
        opt.step()
    return old, opt, x


@pytest.mark.parametrize("kind", ["adam", "momentum"])
def test_zero_state_param_groups(kind):
    old, opt, x = _trained_opt(kind)
    saved = {
        id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()} for p in old.parameters()
    }
    new = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    group = zero_state_param_groups(opt, {"site": [new]}, lr=0.5)
    assert group["lr"] == 0.5 and group["params"] == [new] and len(opt.param_groups) == 2
    assert len(opt.state[new]) == 0
    opt.zero_grad()
    loss = old(x).pow(2).sum() + (new * torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)).sum() * 3
    loss.backward()
    b = new.grad.clone()
    old_grads = {id(p): p.grad.clone() for p in old.parameters()}
    opt.step()
    if kind == "adam":  # closed form from zero state: m1 = (1-β1) b, v1 = (1-β2) b², θ1 = -η b / (|b| + ε)
        torch.testing.assert_close(opt.state[new]["exp_avg"], 0.1 * b)
        torch.testing.assert_close(opt.state[new]["exp_avg_sq"], 0.001 * b * b)
        torch.testing.assert_close(new.detach(), -0.5 * b / (b.abs() + 1e-8))
    else:  # buf1 = b, θ1 = -η b
        torch.testing.assert_close(opt.state[new]["momentum_buffer"], b)
        torch.testing.assert_close(new.detach(), -0.5 * b)
    for p in old.parameters():  # the old state went on from where it was, not from zero
        prev, gp = saved[id(p)], old_grads[id(p)]
        if kind == "adam":
            torch.testing.assert_close(opt.state[p]["exp_avg"], 0.9 * prev["exp_avg"] + 0.1 * gp)
        else:
            torch.testing.assert_close(opt.state[p]["momentum_buffer"], 0.9 * prev["momentum_buffer"] + gp)


def test_zero_state_freeze_old_and_errors():
    old, opt, x = _trained_opt("adam")
    frozen = [p.detach().clone() for p in old.parameters()]
    state = [opt.state[p]["exp_avg"].clone() for p in old.parameters()]
    new = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    zero_state_param_groups(opt, [new], freeze_old=True)
    assert not any(p.requires_grad for p in old.parameters())
    (old(x).sum() + new.sum()).backward()
    opt.step()
    for p, f, s in zip(old.parameters(), frozen, state, strict=True):
        assert torch.equal(p.detach(), f) and torch.equal(opt.state[p]["exp_avg"], s)
    assert float(new.detach().abs().max()) > 0
    with pytest.raises(GrowError, match="already in the optimizer"):
        zero_state_param_groups(opt, [new])
    with pytest.raises(GrowError, match="empty"):
        zero_state_param_groups(opt, {})


# ----------------------------------------------------------------------------- preview
@pytest.mark.parametrize("update", ["sgd", "adam"])
def test_preview_agrees_to_second_order(update, device):
    net, x, y = _setup(device, n=64)
    g = insert_blocks(net, {"blocks.1": "linear"}, probe=x)
    z, gz = _site_grad(net, net.blocks[1], x, y)
    b = torch.cat([(gz.T @ z).reshape(-1), gz.sum(0)])  # dense reference of b (T1)
    errs = []
    for lr in (1e-2, 1e-3, 1e-4):
        pv = preview_first_step(g.model, _ce, (x, y), g.new_params, update=update, lr=lr)
        rate = (b * b).sum() if update == "sgd" else (b * b / (b.abs() + 1e-8)).sum()
        assert pv.predicted_change == pytest.approx(-lr * float(rate), rel=1e-9)
        assert pv.observed_change < 0
        errs.append(abs(pv.ratio - 1))
    # O(η²) agreement: the relative error falls about tenfold per decade of η
    assert errs[1] < 0.3 * errs[0] and errs[2] < 0.3 * errs[1] and errs[2] < 1e-3
    assert all(float(p.detach().abs().max()) == 0 for p in g.tangent_params()["blocks.1"])  # parameters restored


# ----------------------------------------------------------------------------- rank_sites
def _sd(site, depth, rel, ag=2.0, lower=None, vacuous=False, verdict=Verdict.UNDETERMINED, plugin=None, n=10):
    """A site whose headline is ``s_U/AG_rms = rel`` and whose plug-in is ``ŝ/AG_rms = plugin``.

    The default plug-in ``max(1 − rel/2, rel)`` falls as ``rel`` grows below 2/3 (noise reads higher than signal).

    ``v̂ = n ŝ² − (n − 1) s_U²`` makes ``(n ŝ² − v̂)/(n − 1) = s_U²`` (``def-bias-corrected-score``): the plug-in
    order is the reverse of the headline's, so a ranking by the plug-in fails.
    """
    plugin = (max(1.0 - rel / 2, rel) if rel == rel else rel) if plugin is None else plugin
    s, s_u = plugin * ag, rel * ag
    res = SimpleNamespace(
        relative_score=plugin,
        score=s,
        ag_rms=ag,
        n=n,
        noise_variance=n * s * s - (n - 1) * s_u * s_u,
        alpha=0.05,
        noise_ratio=float("nan"),
        verdict=verdict,
        verdict_reason="",
    )
    iv = None if lower is None else SimpleNamespace(score_lower=lower, vacuous=vacuous, certificate="not certified")
    return SiteDiagnosis(site, depth, Layout.VECTOR, (4,), res, iv)  # type: ignore[arg-type]


def _diag(sites, delta=None):
    return Diagnosis(sites, "linear", 10, 1, 0.5, delta=delta)


def test_rank_sites_headline_and_certified():
    d = _diag(
        [_sd("a", 0, 0.2), _sd("b", 1, 0.6), _sd("c", 2, float("nan"), verdict=Verdict.DEGENERATE), _sd("e", 3, 0.4)]
    )
    r = rank_sites(d)
    assert r.by == BY_HEADLINE == BY_POINT and "no confidence intervals" in r.reason
    assert [s.site for s in r.sites] == ["b", "e", "a", "c"] and r.top(2) == ["b", "e"]  # the plug-in says a, e, b
    assert r.sites[0].key == pytest.approx(0.6) and r.sites[0].relative_headline == pytest.approx(0.6)
    assert r.sites[0].relative_score == pytest.approx(0.7) and r.sites[0].to_dict()["relative_headline"] is not None
    # certified: lower ends 0.1, 0.9, 0.5 over AG_rms 2 -> 0.05, 0.45, 0.25: b, e, a (the headline order of a/e flips)
    d = _diag([_sd("a", 0, 0.9, lower=0.1), _sd("b", 1, 0.6, lower=0.9), _sd("e", 2, 0.3, lower=0.5)], delta=0.05)
    r = rank_sites(d)
    assert r.by == BY_CERTIFIED and [s.site for s in r.sites] == ["b", "e", "a"]
    assert r.sites[0].key == pytest.approx(0.45)
    # one vacuous interval: back to the headline, and the reason says so
    d = _diag([_sd("a", 0, 0.9, lower=0.1), _sd("b", 1, 0.6, lower=0.0, vacuous=True)], delta=0.05)
    r = rank_sites(d)
    assert r.by == BY_HEADLINE and "vacuous" in r.reason and [s.site for s in r.sites] == ["a", "b"]
    with pytest.raises(GrowError, match="cannot pick 3 sites"):
        r.top(3)


def test_even_positions():
    assert even_positions(32, 8) == [3, 7, 11, 15, 19, 23, 27, 31]  # LLaMA-Pro: after every 4th of 32 layers
    assert even_positions(30, 2) == [14, 29]
    assert even_positions(5, 5) == [0, 1, 2, 3, 4]
    with pytest.raises(GrowError):
        even_positions(3, 4)


def _two_group_adam():
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(3, dtype=torch.float64))
    c = nn.Parameter(torch.randn(2, dtype=torch.float64))
    opt = torch.optim.AdamW(
        [{"params": [a], "lr": 0.5, "betas": (0.75, 0.875), "weight_decay": 0.25}, {"params": [c], "lr": 0.25}],
        lr=1.0,
        eps=2.0**-20,
    )
    return a, c, opt


def _step(opt, params):
    opt.zero_grad()
    sum((p * p).sum() for p in params).backward()
    opt.step()


def test_zero_state_group_copies_hyperparameters_and_lambda_schedule():
    """The new group is group 0's twin: same hyperparameters; LambdaLR gives it 0.5 · 2^-e, as group 0 (exact)."""
    a, c, opt = _two_group_adam()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda e: 0.5**e, lambda e: 1.0])
    for _ in range(3):
        _step(opt, [a, c])
        sched.step()
    new = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    group = zero_state_param_groups(opt, [new], like=0, schedulers=[sched])
    assert {k: v for k, v in group.items() if k != "params"} == {
        k: v for k, v in opt.param_groups[0].items() if k != "params"
    }
    assert group["betas"] == (0.75, 0.875) and group["weight_decay"] == 0.25 and group["eps"] == 2.0**-20
    assert group["lr"] == 0.5 * 2.0**-3
    for e in range(4, 9):
        _step(opt, [a, c, new])
        sched.step()
        assert group["lr"] == 0.5 * 2.0**-e and opt.param_groups[1]["lr"] == 0.25
    assert sched.get_last_lr()[-1] == 0.5 * 2.0**-8
    assert float(new.detach().abs().max()) == 0.0  # (zero gradient of Σ p² at 0, weight decay of 0: stays 0)


def test_zero_state_group_cosine_schedule_and_lr_override():
    """CosineAnnealingLR: the new group follows η_t = η_min + (η_0 − η_min)(1 + cos(π t/T))/2 with its own η_0."""
    import math

    a, c, opt = _two_group_adam()
    T = 10
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=T, eta_min=0.0)
    for _ in range(2):
        _step(opt, [a, c])
        sched.step()
    twin = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    zero_state_param_groups(opt, [twin], like=1, schedulers=[sched])
    for t in range(3, T + 1):
        _step(opt, [a, c, twin])
        sched.step()
        want = 0.25 * (1 + math.cos(math.pi * t / T)) / 2
        assert opt.param_groups[2]["lr"] == pytest.approx(want, rel=1e-12, abs=1e-15)
        assert opt.param_groups[2]["lr"] == pytest.approx(opt.param_groups[1]["lr"], rel=1e-12, abs=1e-15)
    with pytest.raises(GrowError, match=r"like=5 is not a parameter group index \(the optimizer has 3 groups\)"):
        zero_state_param_groups(opt, [nn.Parameter(torch.zeros(1))], like=5)
    with pytest.raises(GrowError, match="not a torch LR scheduler"):
        zero_state_param_groups(opt, [nn.Parameter(torch.zeros(1))], schedulers=[object()])
    a, c, opt = _two_group_adam()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5**e)
    sched.step()
    new = nn.Parameter(torch.zeros(1, dtype=torch.float64))
    zero_state_param_groups(opt, [new], like=0, lr=0.125, schedulers=[sched])
    _step(opt, [a, c, new])
    sched.step()
    assert opt.param_groups[2]["lr"] == 0.125 * 0.25 and opt.param_groups[0]["lr"] == 0.5 * 0.25
