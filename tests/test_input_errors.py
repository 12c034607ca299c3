"""Inputs that used to corrupt a verdict silently: each is now read right or refused.

Every expected value here is derived independently of the code under test: a hand-computed
count or shape, a dense float64 score from ``z`` and ``g`` taken with plain autograd, or the
content of the error message.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from depthsat_theory import parse_family, statistics_for
from depthsat_theory.capture import SiteError, accumulate, insert_block, unpack_batch
from depthsat_theory.diagnose import DiagnoseError, diagnose, discover_sites
from depthsat_theory.vocabulary import Layout


def per_example_ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def dense_linear_score(z: torch.Tensor, g: torch.Tensor) -> float:
    """s = sqrt(tr(G Σ⁺ Gᵀ)) of the linear family with bias, units = rows of ``z`` (n, U, d), by numpy.

    The inner product is E_x Σ_units (theory/definitions.md): G = (1/n) Σ g φ̃ᵀ, Σ = (1/n) Σ φ̃ φ̃ᵀ
    with φ̃ = (u, 1).
    """
    n = z.shape[0]
    u = z.detach().reshape(-1, z.shape[-1]).double().numpy()
    gg = g.detach().reshape(-1, g.shape[-1]).double().numpy()
    phi = np.concatenate([u, np.ones((u.shape[0], 1))], axis=1)
    G = gg.T @ phi / n
    S = phi.T @ phi / n
    return float(np.sqrt(np.trace(G @ np.linalg.pinv(S, rcond=1e-12) @ G.T)))


def site_z_g(model, site_module, x, y):
    """z and g = ∂ℓ_i/∂z at one module's output by plain autograd (retain_grad), as the module returns them."""
    box = {}

    def hook(m, inp, out):
        out.retain_grad()
        box["z"] = out

    h = site_module.register_forward_hook(hook)
    try:
        losses = per_example_ce(model(x), y)
    finally:
        h.remove()
    losses.sum().backward()
    return box["z"].detach(), box["z"].grad.detach()


# ----------------------------------------------------------------------------- 1. sequence-first sites
class TinyEncoder(nn.Module):
    """Inputs (B, T, 3) batch-first; the encoder layers run batch-first or sequence-first inside."""

    def __init__(self, batch_first: bool, layers: int = 2):
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Linear(3, 8)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first) for _ in range(layers)
        )
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.emb(x)
        if not self.batch_first:
            h = h.transpose(0, 1)
        for b in self.blocks:
            h = b(h)
        if not self.batch_first:
            h = h.transpose(0, 1)
        return self.head(h.mean(1))


def _encoder_pair(B=64, T=40):
    torch.manual_seed(0)
    seq = TinyEncoder(batch_first=False).double().eval()
    bat = TinyEncoder(batch_first=True).double().eval()
    bat.load_state_dict(seq.state_dict())
    x = torch.randn(B, T, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (B,))
    return seq, bat, x, y


def test_sequence_first_site_is_read_batch_first():
    seq, bat, x, y = _encoder_pair()
    sites = ["blocks.0", "blocks.1"]
    d_seq = diagnose(seq, per_example_ce, [(x[:32], y[:32]), (x[32:], y[32:])], sites=sites)
    d_bat = diagnose(bat, per_example_ce, [(x[:32], y[:32]), (x[32:], y[32:])], sites=sites)
    assert d_seq.n == 64 and d_bat.n == 64
    for site, sd_seq, sd_bat in zip(sites, d_seq.sites, d_bat.sites, strict=True):
        assert sd_seq.shape == (40, 8)  # per-example (T, d), not (B, d)
        z, g = site_z_g(bat, dict(bat.named_modules())[site], x, y)  # dense reference, batch-first model
        ref = dense_linear_score(z, g)
        assert sd_seq.result.score == pytest.approx(ref, rel=1e-8)
        assert sd_bat.result.score == pytest.approx(ref, rel=1e-8)


class RowBlock(nn.Module):
    """A block with no batch-first declaration of its own (row-wise: any leading dims)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h):
        return h + torch.tanh(self.lin(h))


class SeqFirstRows(nn.Module):
    def __init__(self, seq_first: bool):
        super().__init__()
        self.seq_first = seq_first
        self.blocks = nn.ModuleList([RowBlock()])
        self.head = nn.Linear(4, 3)

    def forward(self, x):  # x: (B, T, 4)
        h = x.transpose(0, 1) if self.seq_first else x
        h = self.blocks[0](h)
        return self.head(h.mean(1 if not self.seq_first else 0))


def test_sequence_first_with_t_equal_b_is_measured_or_declared():
    """T = B = 6: the shapes fit both readings; the first example's loss gradient tells them apart."""
    torch.manual_seed(1)
    seq = SeqFirstRows(True).double().eval()
    bat = SeqFirstRows(False).double().eval()
    bat.load_state_dict(seq.state_dict())
    x = torch.randn(6, 6, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    z, g = site_z_g(bat, bat.blocks[0], x, y)
    ref = dense_linear_score(z, g)
    for model in (seq, bat):
        d = diagnose(model, per_example_ce, [(x, y)], sites=["blocks.0"])
        assert d.n == 6 and d.sites[0].result.score == pytest.approx(ref, rel=1e-8)
    # batch-reduced losses cannot tell the examples apart: a declaration is required, never a guess
    mean_ce = lambda o, t: F.cross_entropy(o, t)  # noqa: E731
    with pytest.raises(SiteError, match=r"both \(B, T, d\) and \(T, B, d\) fit .*batch-reduced.*batch_dim=1"):
        diagnose(seq, mean_ce, [(x, y)], sites=["blocks.0"], reduction="mean")
    d = diagnose(seq, mean_ce, [(x, y)], sites=["blocks.0"], reduction="mean", batch_dim={"blocks.0": 1})
    assert d.sites[0].result.score == pytest.approx(ref, rel=1e-8)
    # T ≠ B: read from the shapes; a wrong declaration is an error naming the fix
    x2, y2 = torch.randn(5, 7, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    assert diagnose(seq, per_example_ce, [(x2, y2)], sites=["blocks.0"]).sites[0].shape == (7, 4)
    with pytest.raises(SiteError, match=r"batch dimension 0 .*should have size 5.*batch_dim"):
        diagnose(seq, per_example_ce, [(x2, y2)], sites=["blocks.0"], batch_dim=0)


def test_sequence_first_inputs_count_the_losses_examples():
    """Inputs (T, B, 3) and a sequence-first model: n is the number of per-example losses (64), not T."""
    seq, bat, x, y = _encoder_pair()

    class SeqInputs(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, xt):  # (T, B, 3)
            h = self.inner.emb(xt)
            for b in self.inner.blocks:
                h = b(h)
            return self.inner.head(h.mean(0))

    model = SeqInputs(seq).eval()
    xt = x.transpose(0, 1).contiguous()
    d = diagnose(model, per_example_ce, [(xt, y)], sites=["inner.blocks.1"])
    z, g = site_z_g(bat, bat.blocks[1], x, y)
    assert d.n == 64
    assert d.sites[0].result.score == pytest.approx(dense_linear_score(z, g), rel=1e-8)


@pytest.mark.parametrize("T", [40, 64])
def test_issue_reproducer_transformer_encoder_sequence_first(T):
    """The issue's reproducer: nn.TransformerEncoder(batch_first=False) fed (T, 64, d); T = B = 64 included."""

    class Enc(nn.Module):
        def __init__(self, bf):
            super().__init__()
            self.bf = bf
            layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=bf)
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.enc(x).mean(1 if self.bf else 0))

    torch.manual_seed(0)
    sf, bf = Enc(False).double().eval(), Enc(True).double().eval()
    bf.load_state_dict(sf.state_dict())
    x, y = torch.randn(T, 64, 8, dtype=torch.float64), torch.randint(0, 2, (64,))
    xb = x.transpose(0, 1).contiguous()
    d = diagnose(sf, per_example_ce, [(x, y)], sites=["enc"])
    z, g = site_z_g(bf, bf.enc, xb, y)
    assert d.n == 64 and d.sites[0].shape == (T, 8)
    assert d.sites[0].result.score == pytest.approx(dense_linear_score(z, g), rel=1e-8)


# ----------------------------------------------------------------------------- 2. dropout
class WithDropout(nn.Module):
    def __init__(self, functional: bool):
        super().__init__()
        self.functional = functional
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.drop = nn.Identity() if functional else nn.Dropout(0.5)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.blocks[0](x)
        h = F.dropout(h, 0.3, self.training) if self.functional else self.drop(h)
        return self.head(self.blocks[1](h))


@pytest.mark.parametrize("functional", [False, True])
def test_train_mode_dropout_is_refused(functional):
    torch.manual_seed(0)
    model = WithDropout(functional).train()
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    with pytest.raises(SiteError, match=r"dropout in train mode .*call model\.eval\(\)") as info:
        diagnose(model, per_example_ce, [(x, y)], sites=["blocks.0"])
    assert "\n" not in str(info.value)
    stats = {"blocks.0": statistics_for(parse_family("linear"), shape=(4,), layout="vector")}
    with pytest.raises(SiteError, match=r"model\.eval\(\)"):
        accumulate(model, ["blocks.0"], [(x, y)], per_example_ce, stats)
    model.eval()
    scores = [diagnose(model, per_example_ce, [(x, y)], sites=["blocks.0"]).sites[0].result.score for _ in range(2)]
    assert scores[0] == scores[1]


def test_dropout_with_zero_rate_is_accepted():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0), nn.Linear(4, 2)).train()
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    assert diagnose(model, per_example_ce, [(x, y)], sites=["0"]).n == 8


# ----------------------------------------------------------------------------- 3. Conv1d sites
class Conv1dNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv1d(3, 5, 3, padding=1)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Conv1d(5, 5, 3, padding=1), nn.BatchNorm1d(5), nn.ReLU())])
        self.head = nn.Linear(5, 2)

    def forward(self, x):  # (B, 3, L)
        h = self.stem(x)
        h = h + self.blocks[0](h)
        return self.head(h.mean(-1))


def test_conv1d_site_units_are_positions():
    torch.manual_seed(0)
    model = Conv1dNet().double().eval()
    B, C, L = 16, 5, 12
    x, y = torch.randn(B, 3, L, dtype=torch.float64), torch.randint(0, 2, (B,))
    d = diagnose(model, per_example_ce, [(x, y)], sites=["blocks.0"])
    sd = d.sites[0]
    assert sd.layout == Layout.IMAGE
    assert sd.shape == (C, 1, L)
    assert sd.result.tangent_dim == C * (C + 1)  # linear with bias on units of dimension C
    z, g = site_z_g(model, model.blocks[0], x, y)  # (B, C, L): units are the L positions
    ref = dense_linear_score(z.transpose(1, 2), g.transpose(1, 2))
    assert sd.result.score == pytest.approx(ref, rel=1e-8)


def test_transformer_sites_stay_sequences_and_an_ambiguous_3d_site_is_an_error():
    _, bat, x, y = _encoder_pair(B=8, T=5)
    assert diagnose(bat, per_example_ce, [(x, y)], sites=["blocks.0"]).sites[0].layout == Layout.SEQUENCE

    class Shift(nn.Module):  # no layer that tells rows from channels
        def forward(self, h):
            return h * 2.0

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 4)
            self.tap = Shift()
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.tap(self.lin(x)).mean(1))

    net = Net().double().eval()
    with pytest.raises(DiagnoseError, match=r"\(T, d\) or a channel-first signal.*layout='sequence'.*layout='image'"):
        diagnose(net, per_example_ce, [(x, y)], sites=["tap"])
    assert diagnose(net, per_example_ce, [(x, y)], sites=["tap"], layout="sequence").sites[0].shape == (5, 4)


# ----------------------------------------------------------------------------- 4. reentrant checkpointing
class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool | None):
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = x
        for b in self.blocks:
            h = b(h) if self.reentrant is None else checkpoint(b, h, use_reentrant=self.reentrant)
        return self.head(torch.tanh(h))


@pytest.mark.parametrize("site", ["blocks.0", "blocks.1"])
def test_reentrant_checkpointing_is_a_clear_error(site):
    torch.manual_seed(0)
    model = Checkpointed(reentrant=True).eval()
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that no checkpoint input requires grad
        with pytest.raises(SiteError, match=r"use_reentrant=True.*use_reentrant=False") as info:
            diagnose(model, per_example_ce, [(x, y)], sites=[site])
    assert "\n" not in str(info.value)


def test_non_reentrant_checkpointing_matches_the_plain_model():
    torch.manual_seed(0)
    plain = Checkpointed(reentrant=None).double().eval()
    ckpt = Checkpointed(reentrant=False).double().eval()
    ckpt.load_state_dict(plain.state_dict())
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 2, (8,))
    z, g = site_z_g(plain, plain.blocks[0], x, y)
    s = diagnose(ckpt, per_example_ce, [(x, y)], sites=["blocks.0"]).sites[0].result.score
    assert s == pytest.approx(dense_linear_score(z[:, None, :], g[:, None, :]), rel=1e-8)


# ----------------------------------------------------------------------------- 5. insert_block
class Cached(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4)])
        self.w = nn.Parameter(torch.ones(4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        self.cache = self.w * 2  # a non-leaf tensor attribute left by the forward
        return self.head(self.blocks[0](x) * self.cache)


def test_insert_block_copies_a_non_leaf_tensor_attribute():
    torch.manual_seed(0)
    model = Cached()
    x = torch.randn(5, 4)
    ref = model(x).detach()
    zero = nn.Linear(4, 4)
    nn.init.zeros_(zero.weight)
    nn.init.zeros_(zero.bias)
    new, block = insert_block(model, "blocks.0", zero)
    assert new.cache.is_leaf and torch.equal(new.cache, torch.full((4,), 2.0))
    assert not model.cache.is_leaf  # the original is untouched
    assert torch.equal(new(x), ref)  # a zero-output block preserves the function
    assert block is new.blocks[0].block


# ----------------------------------------------------------------------------- 6. Hugging Face mapping batches
class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8)])
        self.head = nn.Linear(8, 10)

    def forward(self, input_ids, attention_mask=None):
        return self.head(torch.tanh(self.blocks[0](self.emb(input_ids))))


def token_losses(out, labels):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), labels.reshape(-1), reduction="none").reshape(labels.shape)


def test_accumulate_takes_hugging_face_mapping_batches():
    torch.manual_seed(0)
    model = TinyLM().eval()
    ids = torch.randint(0, 10, (4, 6))
    mask = torch.ones_like(ids)
    hf = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    fam = parse_family("linear")
    stats = {"blocks.0": statistics_for(fam, shape=(6, 8), layout="sequence")}
    J = accumulate(model, ["blocks.0"], [hf], token_losses, stats, reduction="token_mean")
    with torch.no_grad():
        expected = float(token_losses(model(ids), ids).mean(1).mean())  # hand: mean over tokens, then examples
    assert pytest.approx(expected, rel=1e-6) == J
    d = diagnose(model, token_losses, [hf], sites=["blocks.0"], reduction="token_mean")
    assert d.n == 4 and d.sites[0].result.score == pytest.approx(stats["blocks.0"].result().score, rel=1e-12)
    x, y, m = unpack_batch(hf)
    assert set(x) == {"input_ids", "attention_mask"} and y is ids and m.dtype == torch.bool
    with pytest.raises(ValueError, match=r"'labels'.*got keys input_ids, attention_mask"):
        unpack_batch({"input_ids": ids, "attention_mask": mask})


# ----------------------------------------------------------------------------- 7. discovery
class SharedBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.blocks[0](x)
        h = h + self.blocks[1](h)
        h = h + self.blocks[1](h)  # the same block again: a second site tensor
        return self.head(h)


def test_a_block_run_twice_gives_one_site_per_call():
    torch.manual_seed(0)
    model = SharedBlocks().eval()
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    assert discover_sites(model, x) == ["blocks.0", "blocks.1#0", "blocks.1#1"]
    d = diagnose(model, per_example_ce, [(x, y)])
    assert [sd.site for sd in d.sites] == ["blocks.0", "blocks.1#0", "blocks.1#1"]


class MyBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + torch.relu(self.conv(x))


class CustomResNet(nn.Module):
    def __init__(self, leaf_layers: bool = False):
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, padding=1)
        make = (lambda: nn.Conv2d(4, 4, 3, padding=1)) if leaf_layers else (lambda: MyBlock(4))
        self.layer1 = nn.Sequential(make(), make())
        self.layer2 = nn.Sequential(make(), make())
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.layer2(self.layer1(self.stem(x))).mean((2, 3)))


def test_resnet_blocks_are_recognised_structurally_and_the_stage_fallback_is_stated():
    x = torch.randn(2, 1, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert discover_sites(CustomResNet(), x) == ["layer1.0", "layer1.1", "layer2.0", "layer2.1"]
    with pytest.warns(UserWarning, match=r"layer1\.0.*single layers, not residual blocks.*stages layer1, layer2"):
        assert discover_sites(CustomResNet(leaf_layers=True), x) == ["layer1", "layer2"]


def test_audit_of_a_conv1d_site_is_refused_without_a_layout():
    from depthsat_theory.audit import audit_model
    from depthsat_theory.audit.loading import AuditError

    torch.manual_seed(0)
    model = Conv1dNet().double().eval()
    x, y = torch.randn(8, 3, 12, dtype=torch.float64), torch.randint(0, 2, (8,))
    with pytest.raises(AuditError, match=r"channel-first 1-D site \(B, C, L\) = \(8, 5, 12\).*layout='sequence'"):
        audit_model(parse_family("linear"), model, "blocks.0", x, y, per_example_ce)
