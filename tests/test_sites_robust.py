"""Robust activation capture: each case derives ``g`` independently.

The reference ``g`` is always ``∂(Σ_i ℓ_i)/∂δ`` for an explicit additive perturbation
``δ = 0`` written into a hand-built forward pass at the site (theory/definitions.md), taken with
autograd in float64 — never through :class:`SiteRecorder`'s hooks.  Statistics are
checked against T1 (autograd through the inserted block) and against sums written
out over the non-padded rows.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from depthsat_theory.capture import (
    SiteError,
    SiteRecorder,
    accumulate,
    check_function_preserving,
    insert_block,
    parse_site,
)
from depthsat_theory.families import GeneralFamily, parse_family
from depthsat_theory.statistics import statistics_for

DT = torch.float64


def ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


def _data(device, n=8, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=gen, dtype=DT).to(device)
    y = torch.randint(0, 3, (n,), generator=gen).to(device)
    return x, y


class Block(nn.Module):
    def __init__(self, d=4, hidden=6):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x, delta=None):
        return x + self.fc2(torch.tanh(self.fc1(x)))


def _t1(model, site, family, shape, layout, batches, loss_of, stats, device, output_key=None):
    """``b`` of the streamed statistics == autograd gradient of the mean loss through
    the block inserted at ``site`` (T1); returns the reference gradient."""
    res = stats.result()
    block = family.block(shape, layout, dtype=DT, device=device)
    new_model, blk = insert_block(model, site, block, output_key=output_key)
    tangent = family.tangent_parameters(blk)
    n = sum(int(b[0].shape[0]) for b in batches)
    loss = sum(loss_of(new_model, b).sum() for b in batches) / n
    grads = torch.autograd.grad(loss, tangent)
    b_ref = torch.cat([gr.reshape(-1) for gr in grads]).cpu().numpy()
    assert abs(b_ref).max() > 1e-5  # not vacuous
    assert abs(res.gradient - b_ref).max() <= 1e-10 * max(1.0, float(abs(b_ref).max()))
    return b_ref


# ============================================================================ 1. in-place after the site
class _InplaceAfter(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(5, 4)
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x, delta=None):
        h = self.embed(x)
        if delta is not None:
            h = h + delta
        h = torch.relu_(h.mul_(2)) if delta is None else torch.relu(h * 2)
        return self.head(self.lin(h))


def test_inplace_after_site_matches_explicit_delta(device):
    torch.manual_seed(0)
    model = _InplaceAfter().to(DT).to(device)
    x, y = _data(device)
    with SiteRecorder(model, ["embed"]) as rec:
        rec.backward(ce(model(x), y).sum())
    delta = torch.zeros(x.shape[0], 4, dtype=DT, device=device, requires_grad=True)
    (g_ref,) = torch.autograd.grad(ce(model(x, delta), y).sum(), delta)
    assert float(g_ref.abs().max()) > 1e-4
    assert torch.allclose(rec.g["embed"], g_ref, rtol=1e-12, atol=1e-15)
    with torch.no_grad():
        assert torch.equal(rec.z["embed"], model.embed(x))  # captured before the in-place ops


# ============================================================================ 2. repeated modules
class _Shared(nn.Module):
    """A weight-shared residual block applied twice: sites ``shared#0``, ``shared#1``."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 4)
        self.shared = Block()
        self.head = nn.Linear(4, 3)

    def forward(self, x, d0=None, d1=None):
        z0 = self.shared(self.inp(x))
        if d0 is not None:
            z0 = z0 + d0
        z1 = self.shared(z0)
        if d1 is not None:
            z1 = z1 + d1
        return self.head(z1)


def _shared_ref(model, x, y):
    d0 = torch.zeros(x.shape[0], 4, dtype=DT, device=x.device, requires_grad=True)
    d1 = torch.zeros_like(d0, requires_grad=True)
    g0, g1 = torch.autograd.grad(ce(model(x, d0, d1), y).sum(), (d0, d1))
    with torch.no_grad():
        z0 = model.shared(model.inp(x))
        z1 = model.shared(z0)
    return (z0, g0), (z1, g1)


@pytest.mark.parametrize("mode", ["explicit", "each"])
def test_repeated_module_each_call_is_an_occurrence(mode, device):
    torch.manual_seed(1)
    model = _Shared().to(DT).to(device)
    x, y = _data(device)
    sites, kw = (["shared#0", "shared#1"], {}) if mode == "explicit" else (["shared"], {"calls": "each"})
    with SiteRecorder(model, sites, **kw) as rec:
        for _ in range(2):  # counters restart after each backward
            rec.backward(ce(model(x), y).sum())
            assert rec.names == ["shared#0", "shared#1"]
            assert rec.last_calls == {"shared": 2}
    for k, (z_ref, g_ref) in enumerate(_shared_ref(model, x, y)):
        assert float(g_ref.abs().max()) > 1e-4
        assert torch.allclose(rec.z[f"shared#{k}"], z_ref, rtol=0, atol=1e-14)
        assert torch.allclose(rec.g[f"shared#{k}"], g_ref, rtol=1e-12, atol=1e-15)
    # the two occurrences really differ (the test is not vacuous)
    assert not torch.allclose(rec.g["shared#0"], rec.g["shared#1"])
    # central finite differences in float64 on a few coordinates of δ_k
    for k in range(2):
        for i, j in ((0, 0), (3, 2), (7, 1)):
            e = torch.zeros(x.shape[0], 4, dtype=DT, device=device)
            e[i, j] = 1e-6
            with torch.no_grad():
                kw_p = {f"d{k}": e}
                kw_m = {f"d{k}": -e}
                fd = (ce(model(x, **kw_p), y).sum() - ce(model(x, **kw_m), y).sum()) / 2e-6
            assert abs(float(fd) - float(rec.g[f"shared#{k}"][i, j])) < 1e-8


def test_repeated_module_single_occurrence_and_errors(device):
    torch.manual_seed(1)
    model = _Shared().to(DT).to(device)
    x, y = _data(device)
    (_, _), (_, g1) = _shared_ref(model, x, y)
    with SiteRecorder(model, ["shared#1"]) as rec:
        rec.backward(ce(model(x), y).sum())
    assert rec.names == ["shared#1"]
    assert torch.allclose(rec.g["shared#1"], g1, rtol=1e-12, atol=1e-15)
    with SiteRecorder(model, ["shared"]) as rec:  # default calls="error"
        out = model(x)
        with pytest.raises(SiteError, match="calls='each'"):
            rec.backward(ce(out, y).sum())
    with SiteRecorder(model, ["shared#2"]) as rec:
        out = model(x)
        with pytest.raises(SiteError, match="ran 2 time"):
            rec.backward(ce(out, y).sum())
    with pytest.raises(SiteError):
        SiteRecorder(model, ["shared#x"])
    assert parse_site("a.b#3") == ("a.b", 3) and parse_site("a.b") == ("a.b", None)
    with pytest.raises(ValueError):
        SiteRecorder(model, ["shared"], calls="sometimes")
    # calls="each" on a module that runs once: the single occurrence "name#0"
    with SiteRecorder(model, ["inp"], calls="each") as rec:
        rec.backward(ce(model(x), y).sum())
    assert rec.names == ["inp#0"] and rec.z["inp#0"].shape == (x.shape[0], 4)


@pytest.mark.parametrize("spec", ["linear", "relu:6"])
def test_repeated_module_accumulate_t1_per_occurrence(spec, device):
    """Statistics per occurrence == T1 with the block inserted after that call only."""
    torch.manual_seed(2)
    model = _Shared().to(DT).to(device)
    x, y = _data(device, n=10)
    batches = [(x[:6], y[:6]), (x[6:], y[6:])]
    fam = parse_family(spec)
    stats = {f"shared#{k}": statistics_for(fam, (4,), "vector") for k in range(2)}
    j = accumulate(model, ["shared"], batches, ce, stats, calls="each")
    with torch.no_grad():
        assert math.isclose(j, float(ce(model(x), y).mean()), rel_tol=1e-12)
    refs = []
    for k in range(2):
        new_model, _ = insert_block(model, f"shared#{k}", fam.block((4,), "vector", dtype=DT, device=device))
        assert check_function_preserving(model, new_model, x) == 0.0
        refs.append(
            _t1(
                model,
                f"shared#{k}",
                fam,
                (4,),
                "vector",
                batches,
                lambda m, b: ce(m(b[0]), b[1]),
                stats[f"shared#{k}"],
                device,
            )
        )
    assert not np.allclose(refs[0], refs[1])
    # the occurrence counter restarts at every forward of the root, also in a deep copy
    new_model, blk = insert_block(model, "shared#1", fam.block((4,), "vector", dtype=DT, device=device))
    with torch.no_grad():
        for p in blk.parameters():
            p.add_(0.1)
    copied = copy.deepcopy(new_model)
    with torch.no_grad():
        expect = model.head(
            new_model.shared.block(model.shared(model.shared(model.inp(x)))) + model.shared(model.shared(model.inp(x)))
        )
        for m in (new_model, copied, copied, new_model):
            assert torch.allclose(m(x), expect, rtol=1e-13, atol=1e-14)
    # statistics keyed by the bare name are refused (which occurrence would they be?)
    with pytest.raises(SiteError, match="no statistics"):
        accumulate(model, ["shared"], batches, ce, {"shared": statistics_for(fam, (4,), "vector")}, calls="each")


# ============================================================================ 3. structured outputs
Pair = namedtuple("Pair", ["hidden", "extra"])


@dataclass
class FakeModelOutput(OrderedDict):
    """Mimics ``transformers.ModelOutput``: a dataclass + ordered mapping kept in sync."""

    last_hidden_state: Tensor | None = None
    attentions: Tensor | None = None

    def __post_init__(self):
        for k in ("last_hidden_state", "attentions"):
            v = getattr(self, k)
            if v is not None:
                OrderedDict.__setitem__(self, k, v)

    def __setitem__(self, key, value):
        OrderedDict.__setitem__(self, key, value)
        object.__setattr__(self, key, value)


class _HFLayer(nn.Module):
    """A layer returning a structure; downstream uses the hidden states from it."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.block = Block()

    def forward(self, h):
        out = self.block(h)
        aux = out.detach() * 0 + 1  # unrelated extra output
        if self.kind == "tuple":
            return (out, aux)
        if self.kind == "namedtuple":
            return Pair(out, aux)
        if self.kind == "list":
            return [out, aux]
        if self.kind == "dict":
            return {"aux": aux, "hidden": out}
        return FakeModelOutput(last_hidden_state=out, attentions=aux)


class _HFModel(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.embed = nn.Linear(5, 4)
        self.layer = _HFLayer(kind)
        self.head = nn.Linear(4, 3)

    def forward(self, x, delta=None):
        out = self.layer(self.embed(x))
        if self.kind == "dict":
            h = out["hidden"]
        elif self.kind == "modeloutput":
            h = out.last_hidden_state  # attribute access, as HF code does
        else:
            h = out[0]
        if delta is not None:
            h = h + delta
        return self.head(torch.relu(h) + h)


KEYS = {"tuple": None, "namedtuple": None, "list": None, "dict": "hidden", "modeloutput": None}


@pytest.mark.parametrize("kind", list(KEYS))
def test_structured_outputs_are_tapped_in_place(kind, device):
    torch.manual_seed(3)
    model = _HFModel(kind).to(DT).to(device)
    x, y = _data(device)
    key = KEYS[kind]
    with SiteRecorder(model, ["layer"], output_key=key) as rec:
        rec.backward(ce(model(x), y).sum())
    delta = torch.zeros(x.shape[0], 4, dtype=DT, device=device, requires_grad=True)
    (g_ref,) = torch.autograd.grad(ce(model(x, delta), y).sum(), delta)
    assert float(g_ref.abs().max()) > 1e-4
    with torch.no_grad():
        z_ref = model.layer.block(model.embed(x))
    assert torch.equal(rec.z["layer"], z_ref)
    # a nonzero, exact g proves downstream used the tapped tensor
    assert torch.allclose(rec.g["layer"], g_ref, rtol=1e-12, atol=1e-15)
    # the same site with insert_block: function preserving and T1
    fam = parse_family("linear")
    stats = statistics_for(fam, (4,), "vector")
    accumulate(model, ["layer"], [(x, y)], ce, {"layer": stats}, output_key=key)
    new_model, _ = insert_block(model, "layer", fam.block((4,), "vector", dtype=DT, device=device), output_key=key)
    assert check_function_preserving(model, new_model, x) == 0.0
    _t1(model, "layer", fam, (4,), "vector", [(x, y)], lambda m, b: ce(m(b[0]), b[1]), stats, device, output_key=key)


def test_structured_output_errors(device):
    model = _HFModel("dict").to(DT).to(device)
    x, y = _data(device)
    with SiteRecorder(model, ["layer"], output_key="nope"), pytest.raises(SiteError, match="without key"):
        model(x)
    with SiteRecorder(model, ["layer"], output_key={"layer": "hidden"}) as rec:
        rec.backward(ce(model(x), y).sum())
    assert float(rec.g["layer"].abs().max()) > 1e-4


# ============================================================================ 4. first site without grad
def test_first_site_input_without_grad(device):
    torch.manual_seed(4)
    model = nn.Sequential(nn.Tanh(), nn.Linear(5, 3)).to(DT).to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    x, y = _data(device)
    with SiteRecorder(model, ["0"]) as rec:
        rec.backward(ce(model(x), y).sum())
    delta = torch.zeros(x.shape[0], 5, dtype=DT, device=device, requires_grad=True)
    (g_ref,) = torch.autograd.grad(ce(model[1](torch.tanh(x) + delta), y).sum(), delta)
    assert torch.allclose(rec.g["0"], g_ref, rtol=1e-12, atol=1e-15)


# ============================================================================ 5. BatchNorm
class _BNModel(nn.Module):
    def __init__(self, track=True):
        super().__init__()
        self.embed = nn.Linear(5, 4)
        self.bn = nn.BatchNorm1d(4, track_running_stats=track)
        self.head = nn.Linear(4, 3)

    def forward(self, x, delta=None):
        h = self.embed(x)
        if delta is not None:
            h = h + delta
        return self.head(torch.tanh(self.bn(h)))


def test_batchnorm_eval_mode_and_train_mode_error(device):
    torch.manual_seed(5)
    model = _BNModel().to(DT).to(device)
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    model.eval()
    x, y = _data(device)
    with SiteRecorder(model, ["embed"]) as rec:
        rec.backward(ce(model(x), y).sum())
    delta = torch.zeros(x.shape[0], 4, dtype=DT, device=device, requires_grad=True)
    (g_ref,) = torch.autograd.grad(ce(model(x, delta), y).sum(), delta)
    assert torch.allclose(rec.g["embed"], g_ref, rtol=1e-12, atol=1e-15)
    # per-example in eval mode: example 0 alone gives the same g (no batch coupling)
    with SiteRecorder(model, ["embed"]) as rec1:
        rec1.backward(ce(model(x[:1]), y[:1]).sum())
    assert torch.allclose(rec1.g["embed"], g_ref[:1], rtol=1e-12, atol=1e-15)

    model.train()
    with pytest.raises(SiteError, match="BatchNorm"):
        SiteRecorder(model, ["embed"]).__enter__()
    stats = statistics_for(parse_family("linear"), (4,), "vector")
    with pytest.raises(SiteError, match=r"model\.eval"):
        accumulate(model, ["embed"], [(x, y)], ce, {"embed": stats})
    with pytest.warns(RuntimeWarning, match="BatchNorm"), SiteRecorder(model, ["embed"], batchnorm="warn") as rec:
        rec.backward(ce(model(x), y).sum())
    model.eval()
    with SiteRecorder(model, ["embed"]) as rec:  # switching to train inside the context
        out = model(x)
        model.train()
        with pytest.raises(SiteError):
            rec.backward(ce(out, y).sum())
    # eval mode without running statistics still normalizes with the batch
    nostats = _BNModel(track=False).to(DT).to(device).eval()
    with pytest.raises(SiteError, match="track_running_stats"), SiteRecorder(nostats, ["embed"]):
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with SiteRecorder(nostats, ["embed"], batchnorm="ignore"):
            pass


# ============================================================================ 6. padded batches
class _CausalSeq(nn.Module):
    """Token model with causal mixing (prefix means): right padding cannot affect real
    tokens.  ``leaky=True`` mixes with the *last* position, so padding leaks."""

    def __init__(self, vocab=7, d=4, leaky=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.block = Block(d, 6)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)
        self.leaky = leaky

    def forward(self, x, delta=None):
        h = self.block(self.embed(x))
        if delta is not None:
            h = h + delta
        t = h.shape[1]
        if self.leaky:
            ctx = h[:, -1:, :].expand_as(h)
        else:
            ctx = h.cumsum(1) / torch.arange(1, t + 1, dtype=h.dtype, device=h.device)[:, None]
        return self.head(h + torch.tanh(self.mix(ctx)))


def _padded(device, n=5, t=6, vocab=7, seed=7):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, t), generator=gen).to(device)
    y = torch.randint(0, vocab, (n, t), generator=gen).to(device)
    lengths = torch.tensor([6, 3, 1, 4, 5])[:n]
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(device)
    y = y.masked_fill(~mask, -100)  # HF convention for ignored labels
    return x, y, mask


def tok_losses(out, y):
    """Per-token losses (B, T), 0 at ignored labels."""
    return F.cross_entropy(out.transpose(1, 2), y, reduction="none", ignore_index=-100)


def masked_mean(out, y):
    """Each example's mean over its own non-padded tokens (theory/definitions.md, def-setting)."""
    m = (y != -100).to(out.dtype)
    return (tok_losses(out, y) * m).sum(1) / m.sum(1)


def _block_site_ref(model, x, y):
    delta = torch.zeros(*x.shape, 4, dtype=DT, device=x.device, requires_grad=True)
    (g,) = torch.autograd.grad(masked_mean(model(x, delta), y).sum(), delta)
    return g


def test_padded_g_is_zero_at_padding_and_matches_unpadded_examples(device):
    torch.manual_seed(8)
    model = _CausalSeq().to(DT).to(device).eval()
    x, y, mask = _padded(device)
    with SiteRecorder(model, ["block"]) as rec:
        rec.backward(masked_mean(model(x), y).sum())
    g = rec.g["block"]
    g_ref = _block_site_ref(model, x, y)
    assert torch.allclose(g, g_ref, rtol=1e-12, atol=1e-15)
    assert bool((g[~mask] == 0).all())
    # each example alone, unpadded, has the same g on its real tokens
    for i in range(x.shape[0]):
        t_i = int(mask[i].sum())
        xi, yi = x[i : i + 1, :t_i], y[i : i + 1, :t_i]
        with SiteRecorder(model, ["block"]) as rec_i:
            rec_i.backward(masked_mean(model(xi), yi).sum())
        assert torch.allclose(rec_i.g["block"][0], g[i, :t_i], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("how", ["tuple", "mask_fn", "token_mean"])
def test_padded_rows_are_dropped_from_statistics(how, device):
    torch.manual_seed(9)
    model = _CausalSeq().to(DT).to(device).eval()
    x, y, mask = _padded(device)
    fam = parse_family("linear")
    gen_fam = GeneralFamily(lambda th, u: th[:4] * torch.tanh(u) + th[4:] * u**2, lambda d: 8, name="tanh-sq")
    relu = parse_family("relu:5")  # random frozen features: the dropped-row path must reuse them
    stats = [
        statistics_for(fam, (6, 4), "sequence", pool_ties=True),
        statistics_for(gen_fam, (6, 4), "sequence"),
        statistics_for(relu, (6, 4), "sequence"),
    ]
    idx = [[0, 1, 2], [3, 4]]
    if how == "tuple":
        batches = [(x[i], y[i], mask[i]) for i in idx]
        j = accumulate(model, ["block"], batches, masked_mean, {"block": stats})
    elif how == "mask_fn":
        batches = [(x[i], y[i]) for i in idx]
        j = accumulate(model, ["block"], batches, masked_mean, {"block": stats}, mask_fn=lambda xb, yb: yb != -100)
    else:
        batches = [(x[i], y[i], mask[i]) for i in idx]
        j = accumulate(model, ["block"], batches, tok_losses, {"block": stats}, reduction="token_mean")
    with torch.no_grad():
        assert math.isclose(j, float(masked_mean(model(x), y).mean()), rel_tol=1e-12)
    n_units = int(mask.sum())
    assert n_units < mask.numel()
    for acc in stats:
        assert acc.n == x.shape[0]
        assert acc.units == n_units  # units exclude the padded positions
    # linear family: φ̃ = (u, 1) over the non-padded rows only, written out
    with torch.no_grad():
        z = model.block(model.embed(x))
    g = _block_site_ref(model, x, y)
    rows = torch.cat([z[mask], torch.ones(n_units, 1, dtype=DT, device=device)], 1)
    n = x.shape[0]
    sigma_ref = (rows.T @ rows / n).cpu().numpy()
    cross_ref = (g[mask].T @ rows / n).cpu().numpy()
    lin = stats[0]
    assert np.allclose(lin.feature_gram(), sigma_ref, rtol=1e-12, atol=1e-14)
    assert np.allclose(lin.cross_gradient(), cross_ref, rtol=1e-12, atol=1e-15)
    res = lin.result()
    s_ref = math.sqrt(np.trace(cross_ref @ np.linalg.pinv(sigma_ref) @ cross_ref.T))
    assert math.isclose(res.score, s_ref, rel_tol=1e-9)
    g_all = g.flatten(1)
    assert math.isclose(res.ag_max, float(g_all.norm(dim=1).max()), rel_tol=1e-12)
    # T1 for both families (padding contributes nothing to b since g = 0 there)
    for fam_i, acc in ((fam, lin), (gen_fam, stats[1]), (relu, stats[2])):
        _t1(model, "block", fam_i, (6, 4), "sequence", [(x, y)], lambda m, b: masked_mean(m(b[0]), b[1]), acc, device)
    # without the mask the padded rows would be counted
    plain = statistics_for(fam, (6, 4), "sequence")
    accumulate(model, ["block"], [(x, y)], masked_mean, {"block": plain})
    assert plain.units == mask.numel()
    assert not np.allclose(plain.feature_gram(), sigma_ref)


def test_padding_errors(device):
    torch.manual_seed(10)
    x, y, mask = _padded(device)
    # a model that reads the padding: g at padded positions is nonzero
    leaky = _CausalSeq(leaky=True).to(DT).to(device).eval()
    stats = statistics_for(parse_family("linear"), (6, 4), "sequence")
    with pytest.raises(SiteError, match="padded positions"):
        accumulate(leaky, ["block"], [(x, y, mask)], masked_mean, {"block": stats})
    # a sequence-level family that does not mask padding itself cannot have rows dropped
    # (attention masks its padded keys: tests/test_diagnose.py::test_attention_statistics_honour_the_padding_mask)
    from depthsat_theory.families import GeneralFamily

    model = _CausalSeq().to(DT).to(device).eval()
    seq = GeneralFamily(lambda th, u: th[0] * u.cumsum(1), 1, name="cumsum", unit="tensor", layouts=("sequence",))
    with pytest.raises(SiteError, match="cannot drop padded rows"):
        accumulate(model, ["block"], [(x, y, mask)], masked_mean, {"block": statistics_for(seq, (6, 4), "sequence")})
    # an accumulator that takes mask= receives it, with g = 0 at padding
    seen = {}

    class Sink:
        def update(self, z, g, mask=None):
            seen.update(z=z, g=g, mask=mask)

    accumulate(model, ["block"], [(x, y, mask)], masked_mean, {"block": Sink()})
    assert torch.equal(seen["mask"], mask) and bool((seen["g"][~mask] == 0).all())

    class PlainSink:
        def update(self, z, g):
            pass

    with pytest.raises(SiteError, match="cannot drop padded rows"):
        accumulate(model, ["block"], [(x, y, mask)], masked_mean, {"block": PlainSink()})
    accumulate(model, ["block"], [(x, y, torch.ones_like(mask))], masked_mean, {"block": PlainSink()})


# ============================================================================ 7. reductions
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_batch_reductions_give_per_example_g(reduction, device):
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(5, 4), Block(), nn.Linear(4, 3)).to(DT).to(device)
    x, y = _data(device, n=10)
    batches = [(x[:7], y[:7]), (x[7:], y[7:])]  # unequal batch sizes
    fam = parse_family("relu:5")
    ref = statistics_for(fam, (4,), "vector")
    j_ref = accumulate(model, ["1"], batches, ce, {"1": ref})
    got = statistics_for(fam, (4,), "vector")
    red = (lambda o, t: ce(o, t).mean()) if reduction == "mean" else (lambda o, t: ce(o, t).sum())
    j = accumulate(model, ["1"], batches, red, {"1": got}, reduction=reduction)
    assert math.isclose(j, j_ref, rel_tol=1e-13)
    assert np.allclose(got.cross_gradient(), ref.cross_gradient(), rtol=1e-12, atol=1e-16)
    assert math.isclose(got.result().score, ref.result().score, rel_tol=1e-10)
    # and the per-example g itself, against an explicit δ
    sink = {}

    class Sink:
        def update(self, z, g):
            sink.setdefault("g", []).append(g)

    accumulate(model, ["1"], batches, red, {"1": Sink()}, reduction=reduction)
    delta = torch.zeros(10, 4, dtype=DT, device=device, requires_grad=True)
    (g_ref,) = torch.autograd.grad(ce(model[2](model[1](model[0](x)) + delta), y).sum(), delta)
    assert torch.allclose(torch.cat(sink["g"]), g_ref, rtol=1e-12, atol=1e-16)


def test_token_mean_reduction_rules(device):
    torch.manual_seed(12)
    model = _CausalSeq().to(DT).to(device).eval()
    x, y, mask = _padded(device)
    stats = statistics_for(parse_family("linear"), (6, 4), "sequence")

    # the Hugging Face scalar (mean over all real tokens of the batch) is rejected
    def hf(o, t):
        return F.cross_entropy(o.transpose(1, 2), t, ignore_index=-100)

    with pytest.raises(ValueError, match="not E_D"):
        accumulate(model, ["block"], [(x, y, mask)], hf, {"block": stats}, reduction="token_mean")
    # ... and it is a different objective: its B-scaled gradient is not the per-example one
    delta = torch.zeros(*x.shape, 4, dtype=DT, device=device, requires_grad=True)
    (g_hf,) = torch.autograd.grad(hf(model(x, delta), y) * x.shape[0], delta)
    assert not torch.allclose(g_hf, _block_site_ref(model, x, y), rtol=1e-3)
    with pytest.raises(ValueError, match="per-example losses"):  # a scalar under "none"
        accumulate(model, ["block"], [(x, y, mask)], hf, {"block": stats})
    with pytest.raises(ValueError, match="reduction must be"):
        accumulate(model, ["block"], [(x, y, mask)], hf, {"block": stats}, reduction="batchmean")
    with pytest.raises(ValueError, match="no non-padded token"):
        empty = mask.clone()
        empty[0] = False
        accumulate(model, ["block"], [(x, y, empty)], tok_losses, {"block": stats}, reduction="token_mean")
