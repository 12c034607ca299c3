"""``diagnose(decision=True)``: the per-site decision between depth and more training (theory/decision.md).

The model is a residual net ``z_out = z_in + o(ψ) `` with ``ψ = relu(p(x))`` or a selection of the inputs, and
``o`` an ``nn.Linear``: :func:`~depthsat_theory.diagnose.decision.find_last_maps` must locate ``o`` from the
model alone.  Truth, independent of the engine:

- (a) exact rationals (``fractions.Fraction``) on a dyadic linear residual net: the Schur form of
  ``prop-beyond-training`` and the influence moment of ``prop-beyond-noise-test``
  (``test_decision_beyond.exact_scores``), from rows built here by hand;
- (b) an under-trained last map: ``s²_old = tr(G_o Σ_oo⁻¹ G_oᵀ)`` with ``G_o`` the **parameter gradient** of the
  probe loss (autograd on ``o``'s weights, not the feature cross-gradient the engine forms), and training
  ``o`` alone then recovers the teacher's loss;
- (c) a last map solved to stationarity by least squares, and a teacher with a missing block (a product
  ``x₁x₂`` no existing parameter can make): *add depth here*;
- (d) pure noise: *add depth here* at most at the level (binomial bound over seeds).
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from test_decision_beyond import exact_scores, hadamard
from torch import nn

from depthsat_theory.decision import DepthDecision
from depthsat_theory.diagnose import diagnose
from depthsat_theory.diagnose.decision import SiteDecisions, find_last_maps
from depthsat_theory.vocabulary import Verdict

F = Fraction


class Block(nn.Module):
    """``z_out = z_in + o(ψ)``: ``z_in = s(x)``, ``ψ = relu(p(x))`` (or ``p(x)`` when ``act`` is off)."""

    def __init__(self, d_in: int, hidden: int, d: int, act: bool = True, bias: bool = True):
        super().__init__()
        self.s = nn.Linear(d_in, d, bias=False)
        self.p = nn.Linear(d_in, hidden, bias=False)
        self.o = nn.Linear(hidden, d, bias=bias)
        self.act = act

    def hidden(self, x):
        h = self.p(x)
        return torch.relu(h) if self.act else h

    def forward(self, x):
        return self.s(x) + self.o(self.hidden(x))


class Net(nn.Module):
    """The block, then the squared error ``½‖z − y‖²`` (identity head: ``g = z − y``) or ``½(z₀ − y)²``
    (``read_first``: the head reads the stream's first coordinate, ``g = (z₀ − y) e₀``)."""

    def __init__(self, *args, read_first: bool = False, **kw):
        super().__init__()
        self.block = Block(*args, **kw)
        self.read_first = read_first

    def forward(self, x):
        z = self.block(x)
        return z[:, :1] if self.read_first else z


def sq_loss(out, y):
    return 0.5 * ((out - y) ** 2).sum(-1)


def run(net, x, y, family="linear", batch=16):
    probe = [(x[i : i + batch], y[i : i + batch]) for i in range(0, len(x), batch)]
    return diagnose(net, sq_loss, probe, sites=["block"], family=family, decision=True, kinks=False)


def _set(lin: nn.Linear, w, b=None):
    with torch.no_grad():
        lin.weight.copy_(torch.as_tensor(np.asarray(w), dtype=torch.float64))
        if b is not None:
            lin.bias.copy_(torch.as_tensor(np.asarray(b), dtype=torch.float64))


def test_last_map_is_located_and_others_are_not():
    """``o`` writes into the stream with the identity Jacobian; ``s`` too (``z_in``); ``p`` does not (through relu)."""
    net = Net(3, 4, 2).double()
    x = torch.randn(8, 3, dtype=torch.float64)
    maps, reasons = find_last_maps(net, ["block"], (x, x[:, :2]))
    assert maps == {"block": ["block.s", "block.o"]} and not reasons
    # a site whose output is not a sum with a linear map: the reason says so
    seq = nn.Sequential(nn.Linear(3, 3), nn.Tanh()).double()
    maps, reasons = find_last_maps(seq, ["1"], (x, x))
    assert maps == {} and "identity Jacobian" in reasons["1"]


def _linear_case(n: int = 64):
    """A dyadic linear residual net, ``ψ`` = three Hadamard columns of the input (exact in float64)."""
    h = hadamard(n)
    x = torch.tensor(h[:, 1:6], dtype=torch.float64)  # inputs H₁…H₅
    net = Net(5, 3, 1, act=False).double()
    _set(net.block.s, [[0.0, 0.0, 0.0, 0.0, 0.5]])  # z_in = ½ H₅
    _set(net.block.p, np.eye(3, 5))  # ψ = (H₁, H₂, H₃)
    _set(net.block.o, [[0.25, -0.5, 0.0]], [0.125])
    y = torch.tensor((0.75 * h[:, 1] - 0.5 * h[:, 4] + 0.25 * h[:, 3] * h[:, 5])[:, None])
    return h, x, y, net


def test_linear_model_matches_the_rational_closed_form():
    """(a) Every score and noise moment of the decision equals the exact Schur form on rows built by hand."""
    h, x, y, net = _linear_case()
    n = len(h)
    res = run(net, x, y)
    sd = res["block"]
    # by hand: ψ̃ = (H₁, H₂, H₃, 1) for the last map o (with its bias) and s (no bias, input H₅): ψ̃ of both maps
    psi = np.c_[h[:, 1:6], h[:, 1:4], np.ones(n)]  # s's input x, then o's input and its constant
    z = 0.5 * h[:, 5] + 0.25 * h[:, 1] - 0.5 * h[:, 2] + 0.125
    g = (z - y.numpy()[:, 0])[:, None]
    phi = np.c_[z, np.ones(n)]
    ex = exact_scores(psi, phi, g)
    assert sd.stationarity.score**2 == pytest.approx(float(ex["old"]), rel=1e-12, abs=1e-15)
    assert sd.beyond_training.score**2 == pytest.approx(float(ex["beyond"]), rel=1e-12, abs=1e-15)
    assert sd.stationarity.noise_variance == pytest.approx(float(ex["v_old"]), rel=1e-12)
    assert sd.beyond_training.noise_variance == pytest.approx(float(ex["v_beyond"]), rel=1e-12, abs=1e-15)
    # JSON keys and the table column
    d = json.loads(json.dumps(res.to_dict(), allow_nan=False))["sites"][0]
    assert d["decision"] == sd.decision.value and d["decision_reason"] == sd.decision_reason
    assert d["stationarity"]["score"] == pytest.approx(sd.stationarity.score)
    assert d["beyond_training"]["verdict"] == sd.beyond_training.verdict.value
    assert "decision" in [c.header for c in res.table().columns]


def test_linear_model_closed_form_values():
    """(a) The hand values: g = z − y ∈ span(H₁, H₂, 1) ⊕ span(H₃H₅); the existing span holds H₁…H₅ and 1."""
    _, x, y, net = _linear_case()
    sd = run(net, x, y)["block"]
    # g = ½H₅ + ¼H₁ − ½H₂ + ⅛ − ¾H₁ + ½H₄ − ¼H₃H₅ = −½H₁ − ½H₂ + ½H₄ + ½H₅ + ⅛ − ¼H₃H₅
    # Π_old g drops the H₃H₅ part (orthogonal to H₁…H₅ and 1): s²_old = 4·¼ + 1/64 = 65/64
    assert sd.stationarity.score**2 == pytest.approx(65 / 64, rel=1e-12)
    # φ̃ = (z, 1) lies in the existing span (z = ½H₅ + ¼H₁ − ½H₂ + ⅛): nothing beyond training
    assert sd.beyond_training.tangent_rank == 0
    assert sd.decision is DepthDecision.TRAIN_LONGER


class StreamBlock(nn.Module):
    """``z = x + o(p(x))``: the stream ``x`` itself is ``z_in`` (no map makes it), ``p`` linear (no activation)."""

    def __init__(self):
        super().__init__()
        self.p = nn.Linear(2, 1, bias=False)
        self.o = nn.Linear(1, 2)

    def forward(self, x):
        return x + self.o(self.p(x))


class StreamNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = StreamBlock()

    def forward(self, x):
        return self.block(x)


def test_linear_model_with_a_direction_beyond_training():
    """(a) ``x = (H₁, H₅)``, ``ψ = H₁``: the existing tangent is span(H₁, 1) per coordinate, the linear family adds H₅.

    By hand (``o = [[½], [¼]]``, bias ``(⅛, 0)``, ``y = (½H₅ + ¼H₃, −¾H₁ + ½H₅)``):
    ``g = (3/2 H₁ + ⅛ − ½H₅ − ¼H₃, H₁ + ½H₅)``, so ``s²_old = 9/4 + 1/64 + 1 = 209/64`` and
    ``s²_beyond = ¼ + ¼ = ½`` (the H₅ coefficients); the noise moments from the rational Schur form.
    """
    n = 64
    h = hadamard(n)
    x = torch.tensor(np.c_[h[:, 1], h[:, 5]])
    y = torch.tensor(np.c_[0.5 * h[:, 5] + 0.25 * h[:, 3], -0.75 * h[:, 1] + 0.5 * h[:, 5]])
    net = StreamNet().double()
    _set(net.block.p, [[1.0, 0.0]])
    _set(net.block.o, [[0.5], [0.25]], [0.125, 0.0])
    sd = run(net, x, y)["block"]
    assert sd.decision_reason.endswith("(existing last map: block.o)")
    assert sd.stationarity.score**2 == pytest.approx(209 / 64, rel=1e-12)
    assert sd.beyond_training.score**2 == pytest.approx(0.5, rel=1e-12)
    z = np.c_[1.5 * h[:, 1] + 0.125, h[:, 5] + 0.25 * h[:, 1]]
    g = z - y.numpy()
    ex = exact_scores(np.c_[h[:, 1], np.ones(n)], np.c_[z, np.ones(n)], g)
    assert ex["old"] == F(209, 64) and ex["beyond"] == F(1, 2)
    assert sd.stationarity.noise_variance == pytest.approx(float(ex["v_old"]), rel=1e-12)
    assert sd.beyond_training.noise_variance == pytest.approx(float(ex["v_beyond"]), rel=1e-12)
    # both noise ratios n ŝ²/v̂ are far above 3.84 here: both improvable, so the beyond score decides
    assert sd.stationarity.verdict is Verdict.IMPROVABLE and sd.beyond_training.verdict is Verdict.IMPROVABLE
    assert sd.decision is DepthDecision.ADD_DEPTH


def _features_case(seed: int, n: int, teacher):
    """A 4-d stream ``z = s(x) + o(relu(p x))`` read at ``z₀``, ``x ~ N(0, I₃)``, 6 random ReLU hidden units.

    ``s`` copies ``x`` into ``z₁…z₃``; row 0 of ``s`` and ``o`` is solved by least squares on ``(x, ψ̃)``, so every
    existing map is stationary (``g`` is zero outside ``z₀``, so the other rows' gradients are zero).
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    net = Net(3, 6, 4, read_first=True).double()
    with torch.no_grad():
        net.block.p.weight.copy_(torch.randn(6, 3, generator=gen, dtype=torch.float64))
    y = teacher(x, gen, net)
    with torch.no_grad():
        psi = torch.cat([x, net.block.hidden(x), torch.ones(n, 1, dtype=torch.float64)], 1)
        sol = torch.linalg.lstsq(psi, y).solution[:, 0]
        net.block.s.weight.copy_(torch.cat([sol[None, :3], torch.eye(3, dtype=torch.float64)]))
        net.block.o.weight.zero_()
        net.block.o.weight[0] = sol[3:-1]
        net.block.o.bias.zero_()
        net.block.o.bias[0] = sol[-1]
    return x, y, net


def test_under_trained_last_map_says_train_longer_first():
    """(b) A realisable teacher, the existing maps at half their fitted values: s_old from the parameter gradient.

    The loss is quadratic in the existing maps' parameters, so training them to their optimum (least
    squares on ``(x, ψ̃)``) removes exactly ``½ s²_old``: an independent closed form of the stationarity score.
    """

    def teacher(x, gen, net):  # the model's own architecture: realisable by the existing maps
        with torch.no_grad():
            hidden = net.block.hidden(x) @ torch.linspace(-1, 1, 6, dtype=torch.float64)[:, None]
        return 2.0 * x[:, :1] + hidden + 0.05 * torch.randn(len(x), 1, generator=gen, dtype=torch.float64)

    x, y, net = _features_case(3, 512, teacher)
    with torch.no_grad():  # the existing maps at half their trained values
        for p in (net.block.s.weight, net.block.o.weight, net.block.o.bias):
            p.mul_(0.5)
    sd = run(net, x, y, family="relu:16")["block"]
    # independent: the gradient of the mean probe loss in the parameters of s and o, by autograd
    net.zero_grad()
    loss = sq_loss(net(x), y).mean()
    loss.backward()
    grad = torch.cat([net.block.s.weight.grad, net.block.o.weight.grad, net.block.o.bias.grad[:, None]], 1)
    with torch.no_grad():
        psi = torch.cat([x, net.block.hidden(x), torch.ones(len(x), 1, dtype=torch.float64)], 1)
        s_old2 = float(torch.trace(grad @ torch.linalg.pinv(psi.T @ psi / len(x), hermitian=True) @ grad.T))
        best = torch.linalg.lstsq(psi, y).solution  # the existing maps trained to their optimum
        trained = float(sq_loss(psi @ best, y).mean())
    before = float(loss.detach())
    assert sd.stationarity.score**2 == pytest.approx(s_old2, rel=1e-8)
    assert sd.stationarity.score**2 / 2 == pytest.approx(before - trained, rel=1e-8)
    assert sd.stationarity.verdict is Verdict.IMPROVABLE
    assert sd.beyond_training.verdict is not Verdict.IMPROVABLE
    assert sd.decision is DepthDecision.TRAIN_LONGER
    print(
        f"(b) s_old/AG_rms = {sd.stationarity.relative_score:.3f}, s_beyond/AG_rms = "
        f"{sd.beyond_training.relative_score:.3f} (noise ratio {sd.beyond_training.noise_ratio:.2f}); "
        f"loss {before:.4f} -> {trained:.4f} with the existing maps trained"
    )


def _product_teacher(x, gen, net=None):
    return x[:, :1] * x[:, 1:2] + 0.1 * torch.randn(len(x), 1, generator=gen, dtype=torch.float64)


def test_stationary_last_map_with_a_missing_block_says_add_depth_here():
    """(c) o solved exactly (G_o = 0 up to rounding), teacher x₁x₂ outside every existing direction."""
    x, y, net = _features_case(4, 1024, _product_teacher)
    net.zero_grad()
    sq_loss(net(x), y).mean().backward()
    for p in (net.block.s.weight, net.block.o.weight, net.block.o.bias):  # stationary (autograd on the parameters)
        assert float(p.grad.abs().max()) < 1e-10
    sd = run(net, x, y, family="relu:32")["block"]
    assert sd.stationarity.verdict is not Verdict.IMPROVABLE
    assert sd.beyond_training.verdict is Verdict.IMPROVABLE
    assert sd.decision is DepthDecision.ADD_DEPTH
    print(
        f"(c) s_old/AG_rms = {sd.stationarity.relative_score:.3g}, s_beyond/AG_rms = "
        f"{sd.beyond_training.relative_score:.3f}, noise ratio {sd.beyond_training.noise_ratio:.1f}"
    )


def test_pure_noise_says_add_depth_at_most_at_the_level():
    """(d) y independent of x, o stationary: *add depth here* in at most α + 3 sd of 60 seeds."""
    hits, reps = 0, 60
    ratios = []
    for seed in range(reps):
        x, y, net = _features_case(
            100 + seed, 256, lambda x, gen, net: torch.randn(len(x), 1, generator=gen, dtype=torch.float64)
        )
        sd = run(net, x, y, family="relu:8", batch=64)["block"]
        hits += sd.decision is DepthDecision.ADD_DEPTH
        ratios.append(sd.beyond_training.noise_ratio)
    print(f"(d) add depth in {hits}/{reps}; median beyond noise ratio {np.median(ratios):.2f}")
    assert hits / reps <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / reps)


def test_unlocated_site_and_general_family():
    """A site without a linear last map is undetermined with that reason; a general family is refused."""
    seq = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)).double()
    x = torch.randn(32, 3, dtype=torch.float64)
    y = torch.randn(32, 1, dtype=torch.float64)
    res = diagnose(seq, sq_loss, [(x, y)], sites=["1"], decision=True, kinks=False)
    assert res["1"].decision is DepthDecision.UNDETERMINED and "identity Jacobian" in res["1"].decision_reason
    assert res["1"].stationarity is None
    from depthsat_theory.diagnose import DiagnoseError

    with pytest.raises(DiagnoseError, match="feature family"):
        diagnose(seq, sq_loss, [(x, y)], sites=["1"], family="product:1", decision=True)


def test_over_budget_is_undetermined():
    x, y, net = _features_case(5, 64, _product_teacher)
    probe = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    import depthsat_theory.diagnose.decision as dec

    old = dec.DECISION_MAX_BYTES
    try:
        dec.DECISION_MAX_BYTES = 4000
        res = diagnose(net, sq_loss, probe, sites=["block"], decision=True, kinks=False)
    finally:
        dec.DECISION_MAX_BYTES = old
    sd = res["block"]
    assert sd.decision is DepthDecision.UNDETERMINED and "budget" in sd.decision_reason


def test_not_requested_is_none():
    x, y, net = _features_case(6, 32, _product_teacher)
    sd = diagnose(net, sq_loss, [(x, y)], sites=["block"], kinks=False)["block"]
    assert sd.decision is None and sd.to_dict()["decision"] is None
    assert SiteDecisions is not None


def test_cli_decision_json_and_table():
    """``depthsat diagnose --decision``: every site has the keys; the embedding site (a linear map of the input,
    so the linear family's ``φ̃ = (z, 1)`` lies in its tangent) has no direction beyond training."""
    from typer.testing import CliRunner

    from depthsat_theory.cli import app

    args = ["diagnose", "--model", "mlp", "--batches", "1", "--batch-size", "16", "-q", "--decision", "--json", "-"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout[out.stdout.index("{") :])
    vocab = {d.value for d in DepthDecision}
    for site in data["sites"]:
        assert site["decision"] in vocab and site["decision_reason"]
        assert {"stationarity", "beyond_training"} <= set(site)
    embed = data["sites"][0]
    assert embed["site"] == "embed" and embed["beyond_training"]["tangent_rank"] == 0
    assert embed["decision"] == DepthDecision.ENOUGH_DEPTH.value or embed["stationarity"]["verdict"] == "improvable"


@pytest.mark.parametrize(
    ("arch", "sites", "last"),
    [
        ("llama", ["model.layers.0", "model.layers.1"], "mlp.down_proj"),
        ("gpt2", ["transformer.h.0", "transformer.h.1"], "mlp.c_proj"),
    ],
)
def test_last_maps_of_hugging_face_blocks(arch, sites, last):
    """Pre-LN Hugging Face blocks (tuple outputs; GPT-2's ``Conv1D``): the MLP's output projection, not the
    attention's (the MLP reads the attention's output, so its Jacobian to the block output is not the identity)."""
    from tiny_hf import tiny_causal_lm

    model = tiny_causal_lm(arch)
    ids = torch.randint(0, 10, (2, 8), generator=torch.Generator().manual_seed(0))
    maps, reasons = find_last_maps(model, sites, {"input_ids": ids, "labels": ids})
    assert maps == {s: [f"{s}.{last}"] for s in sites} and not reasons
