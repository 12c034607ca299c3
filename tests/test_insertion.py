"""capture.Insertion and the checker's public helpers on a tiny float64 model.

Expected values are derived by hand, not from the statistics: for a block ``h(z) = W φ̃(z)``
inserted after a site with activations ``z`` and per-example activation gradients
``g_i = ∂ℓ_i/∂z_i`` (autograd on the *original* model), T1 gives ``∂J/∂W = E[g φ̃ᵀ]``; the
first step of plain SGD moves ``J`` at the rate ``−‖b‖²``; a block with ``h(0, z) = 1`` shifts
the output by ``head.weight @ 1``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from depthsat_theory.capture import FirstStepSlope, Insertion, NotFunctionPreservingError
from depthsat_theory.check import (
    Agreement,
    CheckConfig,
    evaluate,
    insert_on_probe,
    pool_family,
    probe_statistics,
    site_shapes,
    task_batches,
)
from depthsat_theory.families import GeneralFamily, parse_family
from depthsat_theory.optimizers import get_update
from depthsat_theory.statistics import statistics_for
from depthsat_theory.tasks import Task
from depthsat_theory.vocabulary import Verdict


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((out - y) ** 2).sum(dim=1)


@pytest.fixture(scope="module")
def task() -> Task:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(torch.float64)
    with torch.no_grad():
        for prm in model.parameters():
            prm.copy_(torch.randn(prm.shape, generator=gen, dtype=torch.float64))
    x = torch.randn(7, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(7, 2, generator=gen, dtype=torch.float64)
    return Task("tiny", "random", model, x, y, _loss, "vector", float("nan"), float("nan"))


def _mean_loss(task: Task) -> float:
    with torch.no_grad():
        return float(_loss(task.model(task.inputs), task.targets).mean())


def _site_z_g(task: Task) -> tuple[torch.Tensor, torch.Tensor]:
    """``z`` after the Tanh (site ``"1"``) and ``g_i = ∂ℓ_i/∂z_i``, by hand."""
    model = task.model
    with torch.no_grad():
        z = model[1](model[0](task.inputs))
    z = z.clone().requires_grad_(True)
    losses = _loss(model[2](z), task.targets)
    (g,) = torch.autograd.grad(losses.sum(), z)  # ℓ_i depends on z_i only
    return z.detach(), g


@pytest.mark.parametrize("spec", ["linear", "relu:5:2"])
def test_t1_gradient_is_the_hand_computed_cross_gradient(task, spec):
    fam = parse_family(spec)
    z, g = _site_z_g(task)
    stats = statistics_for(fam, (4,), "vector")
    stats.update(z, g)
    ins = Insertion(task.model, "1", fam, stats, task.inputs, task.targets, task.loss)
    assert ins.deviation == 0.0
    phi = fam.frozen_feature_map((4,), "vector")(z).squeeze(1)  # φ(z): (n, k)
    expected = torch.cat([(g.T @ phi / 7).reshape(-1), g.mean(0)])  # θ = (vec_row(W), c): (E[g φᵀ], E[g])
    assert torch.allclose(ins.b, expected, rtol=1e-12, atol=1e-15)
    assert ins.gradient_error <= ins.gradient_tol
    assert ins.relative_gradient_error() < 1e-12
    assert ins.feature_grad_max == 0.0  # ψ (the random projection) has zero gradient at W = 0
    assert ins.j0 == pytest.approx(_mean_loss(task), rel=1e-15)
    assert ins.z_rms == pytest.approx(math.sqrt(float((z**2).sum()) / 7), rel=1e-12)


def test_first_step_slope_of_sgd_is_minus_the_squared_gradient(task):
    ins = insert_on_probe(task, "1", parse_family("linear"))
    m = ins.first_step_slope(get_update("sgd"), step_scale=1e-3, steps=6)
    assert isinstance(m, FirstStepSlope)
    b2 = float(ins.b @ ins.b)
    assert m.predicted_slope == pytest.approx(-b2, rel=1e-12)
    assert m.observed_slope == pytest.approx(-b2, rel=1e-6)
    assert m.observed_decrease and m.ratio == pytest.approx(2.0, rel=1e-2)
    assert m.direction_norm == pytest.approx(math.sqrt(b2), rel=1e-9)  # SGD: P(b) = b
    assert len(m.etas) == 6 and all(a == pytest.approx(4 * b) for a, b in zip(m.etas, m.etas[1:], strict=False))
    ev = evaluate(ins, get_update("sgd"), CheckConfig())
    assert ev["agreement"] == Agreement.AGREE == "agree"
    assert ins.result.probe_verdict == Verdict.IMPROVABLE


def test_degenerate_family_is_reported_apart(task):
    ins = insert_on_probe(task, "1", parse_family("product:2"))
    assert ins.result.verdict == Verdict.DEGENERATE
    assert float(ins.b.abs().max()) == 0.0  # both factors zero: b = 0
    assert evaluate(ins, get_update("adam"), CheckConfig())["agreement"] == Agreement.DEGENERATE == "degenerate"


def test_a_block_with_nonzero_output_at_the_origin(task):
    fam = GeneralFamily(lambda th, u: th[0] * u + 1.0, 1, name="shift")
    stats = statistics_for(fam, (4,), "vector")
    with pytest.raises(NotFunctionPreservingError):
        Insertion(task.model, "1", fam, stats, task.inputs, task.targets, task.loss)
    ins = Insertion(task.model, "1", fam, stats, task.inputs, task.targets, task.loss, atol=None)
    head = task.model[2].weight.detach()
    assert ins.deviation == pytest.approx(float(head.sum(1).abs().max()), rel=1e-12)


def test_checker_helpers(task):
    diag = pool_family("diag-general")
    assert isinstance(diag, GeneralFamily) and diag.param_dim((4,)) == 8
    assert pool_family("poly:2").spec == "poly:2"
    assert site_shapes(task, ["0", "1", "2"]) == {"0": (4,), "1": (4,), "2": (2,)}
    sizes = [xb.shape[0] for xb, _ in task_batches(task, size=3)]
    assert sizes == [3, 3, 1]
    (lin, relu), loss = probe_statistics(task, [("1", parse_family("linear")), ("1", parse_family("relu:5"))])
    assert loss == pytest.approx(_mean_loss(task), rel=1e-12)
    assert lin.n == relu.n == 7
    z, g = _site_z_g(task)
    phi = torch.cat([z, torch.ones(7, 1, dtype=torch.float64)], 1)
    assert torch.allclose(torch.from_numpy(lin.cross_gradient()), g.T @ phi / 7, rtol=1e-12)


# ----------------------------------------------------------------------------- block dtype
def _float32_models():
    from depthsat_theory.tasks import CharGPT, ResidualMLP, ResNetCNN

    torch.manual_seed(0)
    mlp = ResidualMLP(in_dim=6, width=5, depth=2, n_classes=3).eval()
    cnn = ResNetCNN(channels=(4,), blocks_per_stage=1, n_classes=3).eval()
    gpt = CharGPT(vocab_size=7, d_model=8, n_layers=1, n_heads=2, seq_len=5).eval()
    return [
        (mlp, "blocks.0", (5,), "vector", torch.randn(4, 6), ["linear", "relu:7", "poly:2", "preln:4", "product:2"]),
        (cnn, "blocks.0", (4, 8, 8), "image", torch.randn(3, 1, 8, 8), ["conv1x1", "conv3x3:3", "linear"]),
        (gpt, "blocks.0", (5, 8), "sequence", torch.randint(0, 7, (2, 5)), ["attention:4", "linear"]),
    ]


@pytest.mark.parametrize("case", range(3))
def test_block_takes_the_float32_site_dtype(case):
    from depthsat_theory.capture import insert_block

    model, site, shape, layout, x, specs = _float32_models()[case]
    assert next(model.parameters()).dtype == torch.float32
    with torch.no_grad():
        ref = model(x)
    for spec in specs:
        fam = parse_family(spec)
        new, blk = insert_block(model, site, fam.block(shape, layout))
        assert {p.dtype for p in blk.parameters()} == {torch.float32}, spec
        out = new(x)
        assert out.dtype == torch.float32 and torch.equal(out.detach(), ref), spec  # function preserved exactly
        out.float().pow(2).sum().backward()
        assert all(p.grad is None or p.grad.dtype == torch.float32 for p in blk.parameters()), spec
        # a block used directly (no insert_block) follows the tensor it receives, parameters kept
        direct = fam.block(shape, layout)
        params = list(direct.parameters())
        z = torch.randn(2, *shape)
        assert torch.equal(direct(z), torch.zeros_like(z)) and direct(z).dtype == torch.float32
        assert [id(p) for p in direct.parameters()] == [id(p) for p in params]
        # an explicit dtype is kept
        pinned = fam.block(shape, layout, dtype=torch.float64)
        _, kept = insert_block(model, site, pinned)
        assert {p.dtype for p in kept.parameters()} == {torch.float64}, spec


class _PaddedLM(torch.nn.Module):
    """``input_ids (B, T)`` → embedding (the site ``embed``) → head; keyword ``attention_mask`` as in Hugging Face."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8, dtype=torch.float64)
        self.head = torch.nn.Linear(8, 11, dtype=torch.float64)

    def forward(self, input_ids, attention_mask=None):
        return self.head(self.embed(input_ids))


@pytest.mark.parametrize("side", ["left", "right"])
def test_inserted_attention_block_sees_the_attention_mask(side):
    """The inserted ``attention`` block's real rows equal its output on each unpadded sequence.

    Reference: the block's own feature map and ``out`` run on each sequence alone (no padding, no
    mask); with left padding a block blind to the mask would attend to the padded keys.
    """
    from depthsat_theory.capture import insert_block

    torch.manual_seed(0)
    model = _PaddedLM()
    fam = parse_family("attention:8")
    new, blk = insert_block(model, "embed", fam.block((5, 8), "sequence", dtype=torch.float64))
    with torch.no_grad():
        blk.out.weight.normal_()
        blk.out.bias.normal_()
    lengths = [5, 3, 1]
    ids = torch.randint(0, 11, (3, 5))
    mask = torch.zeros(3, 5, dtype=torch.bool)
    for i, n in enumerate(lengths):
        if side == "left":
            mask[i, 5 - n :] = True
        else:
            mask[i, :n] = True
    captured = {}
    handle = blk.register_forward_hook(lambda m, a, out: captured.__setitem__("h", out.detach()))
    new(input_ids=ids, attention_mask=mask)
    handle.remove()
    for i in range(3):
        real = mask[i]
        z = model.embed(ids[i][real][None]).detach()
        ref = blk.out(blk.features(z)).detach()[0]  # the unpadded sequence, no mask
        assert torch.allclose(captured["h"][i][real], ref, rtol=1e-12, atol=1e-12), (side, i)
    new(input_ids=ids)  # a pass without a mask clears it
    assert blk.padding_mask is None
