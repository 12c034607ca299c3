"""Tests for depthsat_theory.capture.sites (site capture, block insertion, T1).

Expected values come from autograd on models built and cut into pieces here
(independently of the recorder's hooks), and from autograd through the model
with the block inserted (T1: ``b`` is the gradient of the mean probe loss).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from depthsat_theory.capture import (
    NotFunctionPreservingError,
    SiteError,
    SiteRecorder,
    accumulate,
    check_function_preserving,
    insert_block,
)
from depthsat_theory.families import GeneralFamily, parse_family
from depthsat_theory.statistics import statistics_for

DT = torch.float64


# ----------------------------------------------------------------------------- models
class Block(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class ResMLP(nn.Module):
    """Small residual MLP: sites ``embed``, ``blocks.0``, ``blocks.1`` (vector layout, d = 4)."""

    def __init__(self, in_dim=5, d=4, hidden=6, n_classes=3, depth=2):
        super().__init__()
        self.embed = nn.Linear(in_dim, d)
        self.blocks = nn.ModuleList(Block(d, hidden) for _ in range(depth))
        self.head = nn.Linear(d, n_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)

    def pieces(self, site: str):
        """``(before, after)`` with ``model(x) == after(before(x))`` and ``before(x)`` the site tensor."""
        idx = {"embed": 0, "blocks.0": 1, "blocks.1": 2}[site]
        mods = [self.embed, *self.blocks]

        def before(x):
            h = x
            for m in mods[: idx + 1]:
                h = m(h)
            return h

        def after(h):
            for m in mods[idx + 1 :]:
                h = m(h)
            return self.head(h)

        return before, after


class TinyCNN(nn.Module):
    """``stem`` (Conv) → ``stage`` (residual conv block) → pool → ``head``: image sites (3, 4, 4)."""

    def __init__(self, c=3, n_classes=3):
        super().__init__()
        self.stem = nn.Conv2d(1, c, 3, padding=1)
        self.stage = _ConvRes(c)
        self.head = nn.Linear(c, n_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.stage(self.stem(x))
        return self.head(h.mean(dim=(2, 3)))


class _ConvRes(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv(torch.relu(x))


class TinySeq(nn.Module):
    """Token model: ``embed`` → ``block`` (token MLP) → ``head``; sequence sites (T, 4)."""

    def __init__(self, vocab=7, d=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.block = Block(d, 6)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(self.embed(x)))


def ce_per_example(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


def token_ce_per_example(out: Tensor, y: Tensor) -> Tensor:
    """Each example's mean over its own tokens (theory/definitions.md, def-setting)."""
    return F.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(dim=1)


def _make_mlp(device, seed=0) -> ResMLP:
    torch.manual_seed(seed)
    return ResMLP().to(DT).to(device).eval()


def _mlp_data(device, n=10, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=gen, dtype=DT).to(device)
    y = torch.randint(0, 3, (n,), generator=gen).to(device)
    return x, y


def general_tanh_sq() -> GeneralFamily:
    def fn(theta: Tensor, u: Tensor) -> Tensor:
        d = u.shape[-1]
        return theta[:d] * torch.tanh(u) + theta[d:] * u**2

    return GeneralFamily(fn, lambda d: 2 * d, name="tanh-sq")


def _family(spec: str):
    return general_tanh_sq() if spec == "general" else parse_family(spec)


# ----------------------------------------------------------------------------- T1 helper
def check_t1(model, site, family, shape, layout, batches, loss_fn, device):
    """``b`` from streamed statistics == autograd gradient of the mean probe loss (T1)."""
    stats = statistics_for(family, shape, layout)
    j = accumulate(model, [site], batches, loss_fn, {site: stats})
    res = stats.result()

    x_all = torch.cat([x for x, _ in batches])
    y_all = torch.cat([y for _, y in batches])
    with torch.no_grad():
        j_ref = float(loss_fn(model(x_all), y_all).mean())
    assert math.isclose(j, j_ref, rel_tol=1e-12)

    block = family.block(shape, layout, dtype=DT, device=device)
    new_model, blk = insert_block(model, site, block)
    assert blk is block
    tangent = family.tangent_parameters(blk)
    tangent_ids = {id(p) for p in tangent}
    features = [p for p in blk.parameters() if id(p) not in tangent_ids]
    loss = loss_fn(new_model(x_all), y_all).mean()
    grads = torch.autograd.grad(loss, tangent + features, allow_unused=True)
    b_ref = torch.cat([gr.reshape(-1) for gr in grads[: len(tangent)]]).cpu().numpy()
    assert res.gradient.shape == b_ref.shape
    scale = max(1.0, float(abs(b_ref).max()))
    assert abs(res.gradient - b_ref).max() <= 1e-10 * scale
    for _p, gr in zip(features, grads[len(tangent) :], strict=False):
        assert gr is None or bool((gr == 0).all()), "feature parameters must get exactly zero gradient"
    # the original model is untouched by insertion
    assert new_model is not model
    return res, b_ref, features


# ============================================================================ 1. T1 on a residual MLP
@pytest.mark.parametrize("spec", ["linear", "relu:6", "preln:5", "product:2", "general"])
@pytest.mark.parametrize("site", ["embed", "blocks.0", "blocks.1"])
def test_t1_gradient_residual_mlp(spec, site, device):
    model = _make_mlp(device)
    x, y = _mlp_data(device, n=10)
    batches = [(x[:6], y[:6]), (x[6:], y[6:])]
    fam = _family(spec)
    res, b_ref, features = check_t1(model, site, fam, (4,), "vector", batches, ce_per_example, device)
    if spec == "product:2":
        assert res.degenerate and (b_ref == 0).all()
    else:
        assert abs(b_ref).max() > 1e-4  # non-trivial gradient: the comparison is not vacuous
    if spec in ("relu:6", "preln:5"):
        assert len(features) > 0  # feature weights exist and were checked to get zero gradient


# ============================================================================ 2. function preservation
@pytest.mark.parametrize(
    "spec", ["linear", "linear-nobias", "relu:6", "preln:5", "even:abs", "poly:2", "product:2", "general"]
)
def test_zero_blocks_are_function_preserving(spec, device):
    model = _make_mlp(device)
    x, _ = _mlp_data(device)
    fam = _family(spec)
    for site in ("embed", "blocks.1"):
        new_model, _ = insert_block(model, site, fam.block((4,), "vector", dtype=DT, device=device))
        assert check_function_preserving(model, new_model, x) == 0.0
        with torch.no_grad():
            assert torch.equal(model(x), new_model(x))


def test_not_function_preserving_raises(device):
    model = _make_mlp(device)
    x, _ = _mlp_data(device)

    def fn(theta: Tensor, u: Tensor) -> Tensor:
        return theta[: u.shape[-1]] * u + u * 0 + 1e-3

    fam = GeneralFamily(fn, lambda d: d, name="shifted")
    new_model, _ = insert_block(model, "blocks.0", fam.block((4,), "vector", dtype=DT, device=device))
    with pytest.raises(NotFunctionPreservingError):
        check_function_preserving(model, new_model, x)
    # the measured deviation is returned when it is within a stated tolerance
    with torch.no_grad():
        dev_ref = float((model(x) - new_model(x)).abs().max())
    assert dev_ref > 0
    assert check_function_preserving(model, new_model, x, atol=1.0) == dev_ref


def test_insert_block_errors():
    model = ResMLP().to(DT)
    blk = parse_family("linear").block((4,), "vector")
    with pytest.raises(SiteError):
        insert_block(model, "blocks.7", blk)
    with pytest.raises(SiteError):
        insert_block(model, "", blk)


# ============================================================================ 3. SiteRecorder
def _reference_zg(model: ResMLP, site: str, x: Tensor, y: Tensor):
    before, after = model.pieces(site)
    with torch.no_grad():
        z = before(x)
    z = z.clone().requires_grad_(True)
    loss = ce_per_example(after(z), y).sum()
    (g,) = torch.autograd.grad(loss, z)
    return z.detach(), g


def test_recorder_matches_piecewise_autograd(device):
    model = _make_mlp(device)
    x, y = _mlp_data(device)
    sites = ["embed", "blocks.0", "blocks.1"]
    with SiteRecorder(model, sites) as rec:
        losses = ce_per_example(model(x), y)
        rec.backward(losses.sum())
    for site in sites:
        z_ref, g_ref = _reference_zg(model, site, x, y)
        assert torch.allclose(rec.z[site], z_ref, rtol=0, atol=1e-14)
        assert torch.allclose(rec.g[site], g_ref, rtol=1e-12, atol=1e-15)
        assert float(g_ref.abs().max()) > 1e-4
    # recorder computes no parameter gradients, and hooks are removed on exit
    assert all(p.grad is None for p in model.parameters())
    for mod in model.modules():
        assert len(mod._forward_hooks) == 0


class _FirstIsParameterFree(nn.Module):
    """First site is a parameter-free module on an input that does not require grad."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Tanh()
        self.lin = nn.Linear(5, 3)

    def forward(self, x):
        return self.lin(self.pre(x))


def test_recorder_first_site_without_grad(device):
    torch.manual_seed(3)
    model = _FirstIsParameterFree().to(DT).to(device)
    x, y = _mlp_data(device)
    assert not x.requires_grad
    with SiteRecorder(model, ["pre"]) as rec:
        losses = ce_per_example(model(x), y)
        rec.backward(losses.sum())
    z = torch.tanh(x).clone().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(ce_per_example(model.lin(z), y).sum(), z)
    assert torch.allclose(rec.z["pre"], torch.tanh(x), rtol=0, atol=0)
    assert torch.allclose(rec.g["pre"], g_ref, rtol=1e-12, atol=1e-15)
    # same with every parameter frozen: the site output would not require grad at all
    for p in model.parameters():
        p.requires_grad_(False)
    with SiteRecorder(model, ["pre", "lin"]) as rec:
        losses = ce_per_example(model(x), y)
        rec.backward(losses.sum())
    assert torch.allclose(rec.g["pre"], g_ref, rtol=1e-12, atol=1e-15)
    out = model(x).detach().requires_grad_(True)
    (g_out,) = torch.autograd.grad(ce_per_example(out, y).sum(), out)
    assert torch.allclose(rec.g["lin"], g_out, rtol=1e-12, atol=1e-15)


class _InplaceNext(nn.Module):
    """A module that modifies its input in place (the site's output) before using it."""

    def __init__(self, d, inplace: bool):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.inplace = inplace

    def forward(self, x):
        if self.inplace:
            x.mul_(2)
            x = torch.relu_(x)
        else:
            x = torch.relu(x * 2)
        return self.lin(x)


class _InplaceModel(nn.Module):
    def __init__(self, inplace: bool):
        super().__init__()
        self.embed = nn.Linear(5, 4)
        self.next = _InplaceNext(4, inplace)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.next(self.embed(x)))


def test_recorder_with_inplace_op_after_site(device):
    torch.manual_seed(4)
    ref = _InplaceModel(inplace=False).to(DT).to(device)
    model = _InplaceModel(inplace=True).to(DT).to(device)
    model.load_state_dict(ref.state_dict())
    x, y = _mlp_data(device)
    with SiteRecorder(model, ["embed"]) as rec:
        losses = ce_per_example(model(x), y)
        rec.backward(losses.sum())
    # out-of-place reference, cut at the site
    with torch.no_grad():
        z_ref = ref.embed(x)
    z = z_ref.clone().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(ce_per_example(ref.head(ref.next(z)), y).sum(), z)
    assert torch.allclose(losses.detach(), ce_per_example(ref(x), y), rtol=1e-13, atol=0)
    assert torch.allclose(rec.z["embed"], z_ref, rtol=0, atol=1e-14)  # captured before the in-place op
    assert torch.allclose(rec.g["embed"], g_ref, rtol=1e-12, atol=1e-15)
    assert float(g_ref.abs().max()) > 1e-4


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.inp = nn.Linear(5, 4)

    def forward(self, x):
        return self.lin(self.lin(self.inp(x)))


def test_recorder_module_called_twice_raises(device):
    model = _Twice().to(DT).to(device)
    x, _ = _mlp_data(device)
    with SiteRecorder(model, ["lin"]) as rec:
        out = model(x)
        with pytest.raises(SiteError):
            rec.backward(out.sum())


def test_recorder_unknown_site_raises():
    model = ResMLP().to(DT)
    with pytest.raises(SiteError):
        SiteRecorder(model, ["blocks.5"])
    with pytest.raises(SiteError):
        accumulate(model, ["nope"], [], ce_per_example, {"nope": None})


def test_accumulate_rejects_bad_losses(device):
    model = _make_mlp(device)
    x, y = _mlp_data(device)
    stats = statistics_for(parse_family("linear"), (4,), "vector")
    with pytest.raises(ValueError):  # a batch-mean loss is not per-example
        accumulate(model, ["embed"], [(x, y)], lambda o, t: ce_per_example(o, t).mean(), {"embed": stats})
    with pytest.raises(ValueError):
        accumulate(model, ["embed"], [(x, y)], lambda o, t: ce_per_example(o, t) * float("nan"), {"embed": stats})


def test_accumulate_several_families_per_site(device):
    """A list of accumulators per site: each sees the same z, g as its own single run."""
    model = _make_mlp(device)
    x, y = _mlp_data(device)
    specs = ["linear", "relu:6"]
    both = [statistics_for(parse_family(s), (4,), "vector") for s in specs]
    accumulate(model, ["blocks.0"], [(x, y)], ce_per_example, {"blocks.0": both})
    for spec, acc in zip(specs, both, strict=False):
        single = statistics_for(parse_family(spec), (4,), "vector")
        z_ref, g_ref = _reference_zg(model, "blocks.0", x, y)
        single.update(z_ref, g_ref)
        assert math.isclose(acc.result().score, single.result().score, rel_tol=1e-12)


# ============================================================================ 4. image and sequence sites
def _cnn_data(device, n=6, seed=5):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 4, 4, generator=gen, dtype=DT).to(device)
    y = torch.randint(0, 3, (n,), generator=gen).to(device)
    return x, y


@pytest.mark.parametrize("spec", ["conv3x3:4", "conv1x1", "relu:5", "general"])
@pytest.mark.parametrize("site", ["stem", "stage"])
def test_image_site_t1_and_function_preserving(spec, site, device):
    torch.manual_seed(6)
    model = TinyCNN().to(DT).to(device).eval()
    x, y = _cnn_data(device)
    fam = _family(spec)
    shape = (3, 4, 4)
    new_model, _ = insert_block(model, site, fam.block(shape, "image", dtype=DT, device=device))
    assert check_function_preserving(model, new_model, x) == 0.0
    batches = [(x[:4], y[:4]), (x[4:], y[4:])]
    res, b_ref, features = check_t1(model, site, fam, shape, "image", batches, ce_per_example, device)
    assert abs(b_ref).max() > 1e-5
    if spec == "conv3x3:4":
        assert res.unit == "tensor" and len(features) > 0


def _seq_data(device, n=5, t=6, vocab=7, seed=7):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, t), generator=gen).to(device)
    y = torch.randint(0, vocab, (n, t), generator=gen).to(device)
    return x, y


@pytest.mark.parametrize("spec", ["attention:4", "linear", "preln:5"])
@pytest.mark.parametrize("site", ["embed", "block"])
def test_sequence_site_t1_and_function_preserving(spec, site, device):
    torch.manual_seed(8)
    model = TinySeq().to(DT).to(device).eval()
    x, y = _seq_data(device)
    fam = parse_family(spec)
    shape = (6, 4)
    new_model, _ = insert_block(model, site, fam.block(shape, "sequence", dtype=DT, device=device))
    assert check_function_preserving(model, new_model, x) == 0.0
    batches = [(x[:2], y[:2]), (x[2:], y[2:])]
    res, b_ref, features = check_t1(model, site, fam, shape, "sequence", batches, token_ce_per_example, device)
    assert abs(b_ref).max() > 1e-5
    if spec == "attention:4":
        assert res.unit == "tensor" and len(features) > 0


def test_sequence_recorder_gradient_is_per_example_token_mean(device):
    """g at a sequence site is the gradient of each example's own mean token loss."""
    torch.manual_seed(9)
    model = TinySeq().to(DT).to(device).eval()
    x, y = _seq_data(device)
    with SiteRecorder(model, ["embed"]) as rec:
        rec.backward(token_ce_per_example(model(x), y).sum())
    z = model.embed(x).detach().requires_grad_(True)
    logits = model.head(model.block(z))
    # per-example mean over tokens, written out explicitly
    logp = torch.log_softmax(logits, dim=-1)
    nll = -logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    (g_ref,) = torch.autograd.grad(nll.mean(dim=1).sum(), z)
    assert torch.allclose(rec.g["embed"], g_ref, rtol=1e-12, atol=1e-15)


# ----------------------------------------------------------------------------- the probe loop
def test_probe_batches_yields_per_example_gradients_and_skips_unselected(device):
    from depthsat_theory.capture import ProbeBatch, probe_batches

    model = _make_mlp(device)
    x, y = _mlp_data(device, n=9)
    batches = [(x[:3], y[:3]), (x[3:6], y[3:6]), (x[6:], y[6:])]
    mean_loss = lambda o, t: ce_per_example(o, t).mean()  # noqa: E731
    got = list(probe_batches(model, ["blocks.1"], batches, mean_loss, reduction="mean", select=lambda i: i != 1))
    assert [pb.index for pb in got] == [0, 2] and all(isinstance(pb, ProbeBatch) for pb in got)
    for pb, (xb, yb) in zip(got, [batches[0], batches[2]], strict=True):
        z_ref, g_ref = _reference_zg(model, "blocks.1", xb, yb)  # gradient of the per-example sum
        assert pb.size == 3 and pb.names == ["blocks.1"]
        assert torch.allclose(pb.z["blocks.1"], z_ref, rtol=0, atol=1e-14)
        assert torch.allclose(pb.g["blocks.1"], g_ref, rtol=1e-12, atol=1e-15)
        assert pb.loss_total == pytest.approx(float(ce_per_example(model(xb), yb).detach().sum()), rel=1e-14)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match=r"probe batch 1: .*per-example losses"):
        list(probe_batches(model, ["blocks.1"], batches, mean_loss, select=lambda i: i >= 1))


def test_probe_batch_update_feeds_the_statistics(device):
    from depthsat_theory.capture import probe_batches

    model = _make_mlp(device)
    x, y = _mlp_data(device, n=8)
    via_loop = statistics_for(parse_family("linear"), (4,), "vector")
    via_accumulate = statistics_for(parse_family("linear"), (4,), "vector")
    for pb in probe_batches(model, ["blocks.0"], [(x[:5], y[:5]), (x[5:], y[5:])], ce_per_example):
        pb.update({"blocks.0": via_loop})
    j = accumulate(model, ["blocks.0"], [(x[:5], y[:5]), (x[5:], y[5:])], ce_per_example, {"blocks.0": via_accumulate})
    assert via_loop.result().score == via_accumulate.result().score and via_loop.n == 8
    assert j == pytest.approx(float(ce_per_example(model(x), y).detach().mean()), rel=1e-14)


def test_probe_loop_releases_the_graph_below_the_sites_before_the_next_forward(device):
    """The backward stops at the highest site's taps; the graph below them must not outlive the batch.

    Truth by construction: the model keeps a weak reference to an activation saved for backward
    *below* the only site (``blocks.2`` of 3); when the next batch's forward starts, that
    activation must be gone (before the fix the loss of the previous batch kept it alive, so
    peak memory grew with the depth of the lowest site).
    """
    import weakref

    from depthsat_theory.capture import probe_batches

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4, dtype=torch.float64) for _ in range(3))
            self.head = nn.Linear(4, 3, dtype=torch.float64)
            self.below: list = []
            self.alive_at_forward: list[bool] = []

        def forward(self, x):
            self.alive_at_forward.append(any(r() is not None for r in self.below))
            h = torch.tanh(self.blocks[0](x))  # tanh saves its output for backward
            self.below.append(weakref.ref(h))
            for blk in self.blocks[1:]:
                h = h + blk(h)
            return self.head(h)

    net = Net().to(device).eval()
    gen = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(5, 4, generator=gen, dtype=torch.float64).to(device), torch.arange(5) % 3) for _ in range(3)
    ]
    for _ in probe_batches(
        net, ["blocks.2"], batches, lambda o, t: F.cross_entropy(o, t.to(o.device), reduction="none")
    ):
        pass
    assert net.alive_at_forward == [False, False, False]
