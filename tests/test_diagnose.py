"""Tests for depthsat_theory.diagnose.run (whole-network diagnosis, checkpoints, CLI).

Expected values are computed here independently of the diagnose code path: site
tensors and activation gradients are captured with a hook that swaps the site output
for a fresh leaf tensor, one site and one backward pass at a time (the naive per-site
loop), and scored with the dense ``torch.func`` reference (SVD least squares on the
stacked Jacobian) and with plain numpy for the raw quantities.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from depthsat_theory.bounds import BoundStatistics
from depthsat_theory.capture import sites as sites_mod
from depthsat_theory.cli import app
from depthsat_theory.diagnose import CheckpointError, DiagnoseError, diagnose, discover_sites, read_checkpoint
from depthsat_theory.engines import dense_saturation
from depthsat_theory.families import parse_family
from depthsat_theory.tasks import CharGPT, ResidualMLP, ResNetCNN, classification_loss, token_loss

DT = torch.float64
ROOT = Path(__file__).resolve().parents[1]


def _mlp_problem(seed=0, n=37, batch=8, width=5, depth=3):
    torch.manual_seed(seed)
    model = ResidualMLP(in_dim=6, width=width, depth=depth, n_classes=3).to(DT).eval()
    x = torch.randn(n, 6, dtype=DT)
    y = torch.randint(0, 3, (n,))
    batches = [(x[i : i + batch], y[i : i + batch]) for i in range(0, n, batch)]
    return model, x, y, batches


def _naive_site(model, site, x, y, loss_fn):
    """z and g at one site: the site output is replaced by a leaf; one backward for this site."""
    mod = dict(model.named_modules())[site]
    box = {}

    def hook(m, inp, out):
        t = out[0] if isinstance(out, tuple) else out
        leaf = t.detach().clone().requires_grad_(True)
        box["z"] = leaf
        return (leaf, *out[1:]) if isinstance(out, tuple) else leaf

    h = mod.register_forward_hook(hook)
    try:
        losses = loss_fn(model(x), y)
    finally:
        h.remove()
    (g,) = torch.autograd.grad(losses.sum(), box["z"])
    return box["z"].detach(), g


# ----------------------------------------------------------------------------- values
@pytest.mark.parametrize("spec", ["linear", "poly:2", "linear-nobias"])
def test_scores_match_naive_per_site_loop_and_dense_reference(spec):
    model, x, y, batches = _mlp_problem()
    fam = parse_family(spec)
    d = diagnose(model, classification_loss, batches, family=spec, realizability=True)
    assert [s.site for s in d.sites] == model.site_names()
    assert d.n == x.shape[0] and d.batches == len(batches)
    assert d.loss == pytest.approx(float(classification_loss(model(x), y).detach().mean()), rel=1e-12)
    for sd in d.sites:
        z, g = _naive_site(model, sd.site, x, y, classification_loss)
        ref = dense_saturation(fam, z, g, "vector")
        gn = g.reshape(g.shape[0], -1).pow(2).sum(1)
        ag_rms, ag_max = math.sqrt(float(gn.mean())), math.sqrt(float(gn.max()))
        r = sd.result
        assert r.score == pytest.approx(ref.score, rel=1e-9, abs=1e-14)
        assert r.tangent_rank == ref.tangent_rank
        assert r.ag_rms == pytest.approx(ag_rms, rel=1e-12)
        assert r.ag_max == pytest.approx(ag_max, rel=1e-12)
        assert r.relative_score == pytest.approx(ref.score / ag_rms, rel=1e-9)
        # continuous units, no ties: the pooled r̂ equals AG_rms and ρ̂ = ‖g − Πg‖/‖g‖
        assert r.raw_score == pytest.approx(ag_rms, rel=1e-12)
        resid = g.numpy() - ref.projection
        rho = math.sqrt(float((resid**2).sum()) / x.shape[0]) / ag_rms
        assert r.realizability_defect == pytest.approx(rho, rel=1e-8)
        assert r.score <= r.raw_score * (1 + 1e-12) and r.ag_rms <= r.ag_max * (1 + 1e-12)


def test_discrete_probe_ties_give_exact_r_and_rho():
    """Each input repeated 3×: r̂ = ‖mean g over copies‖ exactly (independent numpy pooling)."""
    model, x, y, _ = _mlp_problem(n=9)
    # same input with different labels -> g differs between copies, m̂ pools them
    xr = x.repeat(3, 1)
    yr = torch.cat([y, (y + 1) % 3, (y + 2) % 3])
    # the same input tensor in every batch: one computation on the same memory gives the same bits (a copy at another
    # offset may take another kernel path: MKL's results can depend on alignment)
    batches = [(x, yr[i : i + 9]) for i in range(0, xr.shape[0], 9)]
    d = diagnose(model, classification_loss, batches, sites=["blocks.1"], realizability=True)
    _, g = _naive_site(model, "blocks.1", xr, yr, classification_loss)
    m = g.reshape(3, 9, -1).mean(0).numpy()  # copies of unit j are j, j+9, j+18
    r_hat = math.sqrt(float((m**2).sum(1).mean()))
    assert d["blocks.1"].result.raw_score == pytest.approx(r_hat, rel=1e-10)
    assert d["blocks.1"].result.raw_score < d["blocks.1"].result.ag_rms


def test_sequence_and_image_sites_match_naive_loop():
    torch.manual_seed(1)
    gpt = CharGPT(vocab_size=7, d_model=8, n_layers=2, n_heads=2, seq_len=6).to(DT).eval()
    xs = torch.randint(0, 7, (5, 6))
    ys = torch.randint(0, 7, (5, 6))
    cnn = ResNetCNN(channels=(4, 6), blocks_per_stage=1, n_classes=3).to(DT).eval()
    xi = torch.randn(6, 1, 8, 8, dtype=DT)
    yi = torch.randint(0, 3, (6,))
    for model, x, y, loss, layout in (
        (gpt, xs, ys, token_loss, "sequence"),
        (cnn, xi, yi, classification_loss, "image"),
    ):
        batches = [(x[:3], y[:3]), (x[3:], y[3:])]
        d = diagnose(model, loss, batches, family="linear")
        for sd in d.sites:
            assert sd.layout == layout
            z, g = _naive_site(model, sd.site, x, y, loss)
            ref = dense_saturation(parse_family("linear"), z, g, layout)
            assert sd.result.score == pytest.approx(ref.score, rel=1e-9)
            assert sd.result.tangent_rank == ref.tangent_rank


def test_one_forward_and_one_backward_per_batch(monkeypatch):
    model, _, _, batches = _mlp_problem(n=40, batch=8)
    forwards = []
    model.register_forward_pre_hook(lambda m, a: forwards.append(1))
    backwards = []
    orig = sites_mod.SiteRecorder.backward

    def counting(self, loss):
        backwards.append(len(self.sites))
        return orig(self, loss)

    monkeypatch.setattr(sites_mod.SiteRecorder, "backward", counting)
    d = diagnose(model, classification_loss, batches, family="linear")
    assert len(d.sites) == 4
    assert len(forwards) == len(batches) == 5
    assert backwards == [4] * 5  # one backward per batch, reaching all four sites


def test_interval_matches_bound_statistics_with_union_bound():
    model, x, y, batches = _mlp_problem(n=64, batch=16)
    fam = parse_family("linear")
    d = diagnose(model, classification_loss, batches, family="linear", delta=0.1)
    for sd in d.sites:
        z, g = _naive_site(model, sd.site, x, y, classification_loss)
        acc = BoundStatistics(fam, (z.shape[1],), "vector")
        acc.update(z, g)
        ref = acc.interval(0.1, candidates=len(d.sites))
        assert sd.interval.candidates == 4
        assert sd.interval.score_lower == pytest.approx(ref.score_lower, rel=1e-9, abs=1e-14)
        assert sd.interval.score_upper == pytest.approx(ref.score_upper, rel=1e-9)
        assert sd.interval.certificate == ref.certificate


def test_batch_mean_reduction_gives_per_example_gradients():
    model, _, _, batches = _mlp_problem()
    ref = diagnose(model, classification_loss, batches)
    mean = diagnose(model, lambda o, t: classification_loss(o, t).mean(), batches, reduction="mean")
    for a, b in zip(ref.sites, mean.sites, strict=False):
        assert a.result.score == pytest.approx(b.result.score, rel=1e-12)
        assert a.result.ag_max == pytest.approx(b.result.ag_max, rel=1e-12)
    assert mean.loss == pytest.approx(ref.loss, rel=1e-12)


def test_padding_mask_drops_padded_rows():
    """Right-padded sequences in a causal model: statistics over the real tokens only."""
    torch.manual_seed(2)
    model = CharGPT(vocab_size=7, d_model=8, n_layers=2, n_heads=2, seq_len=6).to(DT).eval()
    x = torch.randint(0, 7, (6, 6))
    y = torch.randint(0, 7, (6, 6))
    lengths = torch.tensor([6, 3, 4, 6, 5, 2])
    mask = torch.arange(6)[None, :] < lengths[:, None]

    def per_token(logits, t):
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), t, reduction="none")

    d = diagnose(
        model, per_token, [(x[:3], y[:3], mask[:3]), (x[3:], y[3:], mask[3:])], reduction="token_mean", family="linear"
    )

    def per_example(logits, t):  # each example's mean over its own real tokens
        return (per_token(logits, t) * mask).sum(1) / mask.sum(1)

    for sd in d.sites:
        z, g = _naive_site(model, sd.site, x, y, per_example)
        assert float(g[~mask].abs().max()) == 0.0  # causal model: padding does not reach real losses
        zr, gr = z[mask].numpy(), g[mask].numpy()
        phi = np.hstack([zr, np.ones((zr.shape[0], 1))])
        big_g, sigma = gr.T @ phi / 6, phi.T @ phi / 6
        s2 = float(np.trace(big_g @ np.linalg.pinv(sigma, rcond=1e-12) @ big_g.T))
        assert sd.result.score == pytest.approx(math.sqrt(s2), rel=1e-8)
        assert sd.result.units == int(mask.sum())
    assert d.loss == pytest.approx(float(per_example(model(x), y).detach().mean()), rel=1e-12)


# ----------------------------------------------------------------------------- sites
class BasicBlock(nn.Module):  # the torchvision class name
    def __init__(self, c_in, c_out):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x))


class TinyTorchvisionResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, 3, padding=1)
        self.layer1 = nn.Sequential(BasicBlock(3, 3), BasicBlock(3, 3))
        self.layer2 = nn.Sequential(BasicBlock(3, 4))
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        h = self.layer2(self.layer1(self.conv1(x)))
        return self.fc(h.mean((2, 3)))


class Layer(nn.Module):
    def __init__(self, d, tuple_out=False, kw=False):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.tuple_out = tuple_out

    def forward(self, hidden_states, attention_mask=None):
        out = hidden_states + self.lin(hidden_states)
        return (out, None) if self.tuple_out else out


class Shrink(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d - 1)

    def forward(self, x):
        return self.lin(x)


class HFLike(nn.Module):
    """``model.layers.N`` (Llama, tuple outputs, keyword call) or ``encoder.layer.N`` (BERT)."""

    def __init__(self, style, d=4):
        super().__init__()
        inner = nn.Module()
        inner.emb = nn.Embedding(5, d)
        if style == "llama":
            inner.layers = nn.ModuleList(Layer(d, tuple_out=True) for _ in range(3))
            self.model = inner
        else:
            inner.layer = nn.ModuleList(Layer(d, tuple_out=True) for _ in range(2))
            self.encoder = inner
        self.style = style
        self.head = nn.Linear(d, 5)

    def forward(self, input_ids, attention_mask=None):
        inner = self.model if self.style == "llama" else self.encoder
        h = inner.emb(input_ids)
        for lay in inner.layers if self.style == "llama" else inner.layer:
            h = lay(hidden_states=h)[0]
        return self.head(h)


class GPT2Like(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(5, d)
        self.transformer.h = nn.ModuleList([Layer(d), Layer(d)])
        self.blocks = nn.ModuleList([Shrink(d)])  # a 'blocks.N' that is not a residual stream
        self.head = nn.Linear(d - 1, 5)

    def forward(self, idx):
        h = self.transformer.wte(idx)
        for lay in self.transformer.h:
            h = lay(h)
        return self.head(self.blocks[0](h))


def test_discover_sites_patterns():
    ids = torch.randint(0, 5, (2, 3))
    assert discover_sites(TinyTorchvisionResNet(), torch.randn(2, 1, 4, 4)) == ["layer1.0", "layer1.1", "layer2.0"]
    assert discover_sites(HFLike("llama"), ids) == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert discover_sites(HFLike("bert"), ids) == ["encoder.layer.0", "encoder.layer.1"]
    # blocks.0 changes the shape: not a residual-stream site
    assert discover_sites(GPT2Like(), ids) == ["transformer.h.0", "transformer.h.1"]
    assert discover_sites(ResidualMLP(width=4, depth=2)) == ["embed", "blocks.0", "blocks.1"]
    with pytest.raises(DiagnoseError, match="no residual-stream sites"):
        discover_sites(nn.Sequential(nn.Linear(2, 2)), torch.randn(3, 2))


def test_diagnose_discovers_hf_like_tuple_sites_and_sequence_layout():
    torch.manual_seed(0)
    model = HFLike("llama").to(DT)
    ids = torch.randint(0, 5, (6, 3))

    def loss(logits, y):
        return token_loss(logits, y)

    d = diagnose(model, loss, [(ids[:3], ids[:3]), (ids[3:], ids[3:])], family="linear")
    assert [s.site for s in d.sites] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert all(s.layout == "sequence" and s.shape == (3, 4) for s in d.sites)


# ----------------------------------------------------------------------------- errors
def test_bad_inputs_raise_one_clear_error():
    model, x, y, batches = _mlp_problem()
    with pytest.raises(DiagnoseError, match="probe is empty"):
        diagnose(model, classification_loss, [])
    with pytest.raises(DiagnoseError, match="NaN or Inf"):
        xn = x[:8].clone()
        xn[2, 0] = float("nan")
        diagnose(model, classification_loss, [batches[0], (xn, y[:8])])
    with pytest.raises(DiagnoseError, match="per-example losses"):
        diagnose(model, lambda o, t: classification_loss(o, t).mean(), batches)
    with pytest.raises(DiagnoseError, match="does not fit"):
        diagnose(model, classification_loss, batches, family="conv3x3:4")
    with pytest.raises(DiagnoseError, match="no residual-stream sites"):
        diagnose(nn.Sequential(nn.Linear(6, 3)).to(DT), classification_loss, batches)
    with pytest.raises(DiagnoseError, match="feature family"):
        diagnose(model, classification_loss, batches, family="product:1", delta=0.1)
    with pytest.raises(sites_mod.SiteError, match="no module named"):
        diagnose(model, classification_loss, batches, sites=["nope"])


# ----------------------------------------------------------------------------- outputs
def test_json_and_plot_outputs(tmp_path):
    model, x, _, batches = _mlp_problem()
    d = diagnose(model, classification_loss, batches, delta=0.2, realizability=True, description="toy")
    d.write_json(tmp_path / "d.json")
    data = json.loads((tmp_path / "d.json").read_text())
    assert data["n"] == x.shape[0] and len(data["sites"]) == 4
    assert data["sites"][2]["score"] == pytest.approx(d.sites[2].result.score, rel=1e-15)
    assert data["sites"][0]["interval"]["delta"] == 0.2
    paths = d.plot(tmp_path / "fig.png")
    assert [p.name for p in paths] == ["fig.png", "fig.svg"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in paths[1].read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".depthsat-")]  # no temp files left


# ----------------------------------------------------------------------------- checkpoints
def _flat(d):
    return {(s.site, k): v for s in d.sites for k, v in s.result.to_dict().items() if isinstance(v, float)}


def _same(a, b, rel=1e-12):
    fa, fb = _flat(a), _flat(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fa[k] == pytest.approx(fb[k], rel=rel, abs=1e-300), k


def test_checkpoint_resume_after_interrupt_in_process(tmp_path):
    model, _, _, batches = _mlp_problem(n=60, batch=6)
    full = diagnose(model, classification_loss, batches, delta=0.1, realizability=True)
    ck = tmp_path / "ck.safetensors"

    def stop(done, total):
        if done == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        diagnose(model, classification_loss, batches, delta=0.1, realizability=True, checkpoint=ck, progress=stop)
    header, _ = read_checkpoint(ck)
    assert header["batches"] == 4 and header["examples"] == 24 and not header["complete"]
    seen = []
    res = diagnose(
        model,
        classification_loss,
        batches,
        delta=0.1,
        realizability=True,
        checkpoint=ck,
        progress=lambda k, t: seen.append((k, t)),
    )
    assert res.resumed_from == 4 and seen[-1] == (6, 6)
    _same(res, full, rel=0)
    for a, b in zip(res.sites, full.sites, strict=False):
        assert a.interval.to_dict() == b.interval.to_dict()
    assert read_checkpoint(ck)[0]["complete"]
    # a mismatched configuration is rejected
    with pytest.raises(CheckpointError, match=r"another configuration.*family"):
        diagnose(model, classification_loss, batches, family="poly:2", delta=0.1, realizability=True, checkpoint=ck)
    with pytest.raises(CheckpointError, match=r"another configuration.*batch_dim"):
        diagnose(model, classification_loss, batches, delta=0.1, realizability=True, checkpoint=ck, batch_dim=0)
    with pytest.raises(CheckpointError, match="already holds 10 batches"):
        diagnose(model, classification_loss, batches[:3], delta=0.1, realizability=True, checkpoint=ck)
    (tmp_path / "junk").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable"):
        diagnose(model, classification_loss, batches, checkpoint=tmp_path / "junk")


_KILL_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from depthsat_theory.diagnose.run import diagnose
    from depthsat_theory.tasks.models import ResidualMLP, classification_loss
    torch.manual_seed(0)
    model = ResidualMLP(in_dim=6, width=5, depth=3, n_classes=3).to(torch.float64).eval()
    x = torch.randn(400, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (400,))
    batches = [(x[i:i + 5], y[i:i + 5]) for i in range(0, 400, 5)]
    slow = sys.argv[2] == "slow"
    d = diagnose(model, classification_loss, batches, family="poly:2", realizability=True,
                 checkpoint=sys.argv[1] if sys.argv[1] != "-" else None,
                 progress=(lambda k, t: time.sleep(0.05)) if slow else None)
    d.write_json(sys.argv[3])
""")


def test_checkpoint_survives_sigkill(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_KILL_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    ck = tmp_path / "ck.safetensors"
    proc = subprocess.Popen([sys.executable, str(script), str(ck), "slow", str(tmp_path / "x.json")], env=env)
    try:
        deadline = time.time() + 60
        k = 0
        while time.time() < deadline:
            if ck.exists():
                k = read_checkpoint(ck)[0]["batches"]
                if k >= 5:
                    break
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    header = read_checkpoint(ck)[0]
    assert 5 <= header["batches"] < 80 and not header["complete"]
    subprocess.run(
        [sys.executable, str(script), str(ck), "fast", str(tmp_path / "resumed.json")], env=env, check=True, timeout=120
    )
    subprocess.run(
        [sys.executable, str(script), "-", "fast", str(tmp_path / "full.json")], env=env, check=True, timeout=120
    )
    a = json.loads((tmp_path / "resumed.json").read_text())
    b = json.loads((tmp_path / "full.json").read_text())
    assert a["resumed_from"] == header["batches"] and b["resumed_from"] == 0
    for sa, sb in zip(a["sites"], b["sites"], strict=False):
        for key in ("score", "ag_rms", "ag_max", "raw_score", "realizability_defect", "tangent_rank", "n"):
            assert sa[key] == pytest.approx(sb[key], rel=1e-12), key


# ----------------------------------------------------------------------------- CLI
runner = CliRunner()


@pytest.fixture
def cache_env(monkeypatch, model_cache):
    monkeypatch.setenv("DEPTHSAT_CACHE", model_cache)


def test_cli_diagnose_table_json_plot(tmp_path, cache_env):
    out = runner.invoke(
        app,
        [
            "diagnose",
            "--model",
            "mlp",
            "--batches",
            "2",
            "--batch-size",
            "32",
            "--delta",
            "0.1",
            "--rho",
            "--json",
            str(tmp_path / "d.json"),
            "--plot",
            str(tmp_path / "p"),
            "-q",
        ],
    )
    assert out.exit_code == 0, out.output
    assert "blocks.3" in out.output and "depthsat diagnose:" in out.output
    data = json.loads((tmp_path / "d.json").read_text())
    assert all(s["headline"] is not None and s["certificate"] is not None for s in data["sites"])
    assert data["n"] == 64 and [s["site"] for s in data["sites"]] == ["embed"] + [f"blocks.{i}" for i in range(4)]
    assert (tmp_path / "p.png").is_file() and (tmp_path / "p.svg").is_file()


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--model", "nope"], "unknown --model"),
        (["--model", "mlp", "--family", "conv3x3:4"], "does not fit"),
        (["--model", "mlp", "--family", "bogus"], "bad family spec"),
        (["--model", "mlp", "--sites", "nope"], "no module named"),
        (["--model", "mlp", "--batches", "0"], "--batches must be"),
        (["--model", "mlp", "--batches", "99"], "exceeds"),
        (["--model", "mlp", "--delta", "2"], "delta"),
    ],
)
def test_cli_diagnose_bad_input_exit_2(args, msg, cache_env):
    out = runner.invoke(app, ["diagnose", *args, "-q"])
    assert out.exit_code == 2, out.output
    lines = [ln for ln in out.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and msg in lines[0], out.output


def test_cli_checkpoint_mismatch_exit_2(tmp_path, cache_env):
    ck = tmp_path / "ck"
    ok = runner.invoke(app, ["diagnose", "--model", "mlp", "--batches", "2", "--checkpoint", str(ck), "-q"])
    assert ok.exit_code == 0, ok.output
    again = runner.invoke(app, ["diagnose", "--model", "mlp", "--batches", "2", "--checkpoint", str(ck), "-q"])
    assert again.exit_code == 0 and "resumed from checkpoint after 2 batches" in again.output
    bad = runner.invoke(app, ["diagnose", "--model", "mlp", "--batch-size", "32", "--checkpoint", str(ck), "-q"])
    assert bad.exit_code == 2 and "another configuration" in bad.output
    assert "differs in: --batch-size" in bad.output  # the CLI names its flag, not the key "user"


def test_cli_zoo_names_are_dispatched_to_zoo_load(monkeypatch, tmp_path):
    """A stand-in ``depthsat_theory.tasks.zoo`` (the real one loads pretrained weights offline)."""
    import types

    import depthsat_theory

    torch.manual_seed(0)
    net = HFLike("llama").to(DT)
    ids = torch.randint(0, 5, (4, 3))
    mask = torch.tensor([[True, True, True], [True, True, False], [True, True, True], [True, False, False]])
    calls = {}

    def per_token(logits, y):
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none")

    def load(name, batch_size=8, seed=0, cache_dir=None):
        calls["args"] = (name, batch_size, seed)
        calls["cache_dir"] = cache_dir
        return types.SimpleNamespace(
            model=net,
            loss_fn=per_token,
            batches=[(ids[:2], ids[:2], mask[:2]), (ids[2:], ids[2:], mask[2:])],
            sites=["model.layers.0", "model.layers.2"],
            layout="sequence",
            description="fake-llama",
            reduction="token_mean",
        )

    fake = types.SimpleNamespace(NAMES=("fake-llama",), load=load)
    monkeypatch.setitem(sys.modules, "depthsat_theory.tasks.zoo", fake)
    import depthsat_theory.tasks

    monkeypatch.setattr(depthsat_theory.tasks, "zoo", fake)
    out = runner.invoke(
        app, ["diagnose", "--model", "fake-llama", "--batch-size", "2", "-q", "--json", str(tmp_path / "z.json")]
    )
    assert out.exit_code == 0, out.output
    assert calls["args"] == ("fake-llama", 2, 0)
    assert str(calls["cache_dir"]) == os.environ.get("DEPTHSAT_CACHE", str(Path.home() / ".cache" / "depthsat"))
    data = json.loads((tmp_path / "z.json").read_text())
    assert [s["site"] for s in data["sites"]] == ["model.layers.0", "model.layers.2"]
    assert data["sites"][0]["units"] == int(mask.sum())  # padded rows dropped
    bad = runner.invoke(app, ["diagnose", "--model", "nope", "-q"])
    assert bad.exit_code == 2 and "fake-llama" in bad.output


def test_dict_inputs_with_attention_mask_and_changing_length():
    """HF-style keyword batches padded per batch (T = 3, then 5): padded rows are dropped."""
    torch.manual_seed(4)
    model = HFLike("llama").to(DT)
    ids_a, ids_b = torch.randint(0, 5, (2, 3)), torch.randint(0, 5, (3, 5))
    m_a = torch.tensor([[1, 1, 1], [1, 1, 0]])
    m_b = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])

    def loss(logits, y):  # per-example mean over real tokens (targets -100 at padding)
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none", ignore_index=-100)
        return ce.sum(1) / (y != -100).sum(1)

    batches = [
        ({"input_ids": i, "attention_mask": m}, i.masked_fill(m == 0, -100)) for i, m in ((ids_a, m_a), (ids_b, m_b))
    ]
    d = diagnose(model, loss, batches, family="linear", realizability=True)
    for sd in d.sites:
        rows_z, rows_g = [], []
        for x, y in batches:
            z, g = _naive_site(model, sd.site, x["input_ids"], y, loss)
            keep = x["attention_mask"].bool()
            assert float(g[~keep].abs().max()) == 0.0
            rows_z.append(z[keep].numpy())
            rows_g.append(g[keep].numpy())
        zr, gr = np.vstack(rows_z), np.vstack(rows_g)
        phi = np.hstack([zr, np.ones((zr.shape[0], 1))])
        big_g, sigma = gr.T @ phi / 5, phi.T @ phi / 5
        s2 = float(np.trace(big_g @ np.linalg.pinv(sigma, rcond=1e-12) @ big_g.T))
        assert sd.result.score == pytest.approx(math.sqrt(s2), rel=1e-8)
        assert sd.result.units == int(m_a.sum() + m_b.sum()) == 16 and sd.shape == (5, 4)
    with pytest.raises(DiagnoseError, match="pad the probe"):
        cnn = ResNetCNN(channels=(4,), blocks_per_stage=1, n_classes=3).to(DT).eval()
        diagnose(
            cnn,
            classification_loss,
            [
                (torch.randn(2, 1, 8, 8, dtype=DT), torch.tensor([0, 1])),
                (torch.randn(2, 1, 6, 6, dtype=DT), torch.tensor([0, 1])),
            ],
        )


def test_cli_real_zoo_digits_mlp(cache_env):
    zoo = pytest.importorskip("depthsat_theory.tasks.zoo")
    if "digits-mlp" not in getattr(zoo, "NAMES", ()):
        pytest.skip("no digits-mlp in the zoo")
    out = runner.invoke(app, ["diagnose", "--model", "digits-mlp", "--batches", "1", "--batch-size", "32", "-q"])
    assert out.exit_code == 0, out.output
    assert "blocks.3" in out.output and "n = 32" in out.output


def test_checkpoint_of_format_1_is_refused_in_one_line(tmp_path, cache_env):
    """A checkpoint written before the statistics protocol (format 1) is refused clearly."""
    from safetensors.torch import save

    model, _, _, batches = _mlp_problem(n=24, batch=6)
    ck = tmp_path / "old.safetensors"
    # the format-1 layout, written by hand: hand-listed fields per site, a "dtype" code, "loss"
    k, d = 6, 5
    tensors = {"loss": torch.tensor([1.0, 6.0], dtype=torch.float64)}
    for site in discover_sites(model):
        tensors |= {
            f"{site}/sigma": torch.eye(k, dtype=torch.float64),
            f"{site}/cross": torch.zeros(d, k, dtype=torch.float64),
            f"{site}/n": torch.tensor([6.0], dtype=torch.float64),
            f"{site}/units": torch.tensor([6.0], dtype=torch.float64),
            f"{site}/g_sq": torch.tensor([1.0], dtype=torch.float64),
            f"{site}/z_sq": torch.tensor([1.0], dtype=torch.float64),
            f"{site}/g_max": torch.tensor([1.0], dtype=torch.float64),
            f"{site}/dtype": torch.tensor([1.0], dtype=torch.float64),
        }
    header = {"config": {"version": 1}, "batches": 1, "examples": 6, "complete": False, "shapes": {}}
    ck.write_bytes(save(tensors, metadata={"depthsat_diagnose": json.dumps(header)}))
    with pytest.raises(CheckpointError, match=r"format version 1.*version 4 only") as info:
        diagnose(model, classification_loss, batches, checkpoint=ck)
    assert "\n" not in str(info.value)
    # the CLI reports it on one line and exits 2
    out = runner.invoke(app, ["diagnose", "--model", "mlp", "--batches", "1", "--checkpoint", str(ck), "-q"])
    assert out.exit_code == 2 and "format version 1" in out.output


def test_checkpoint_holds_the_statistics_state_dicts(tmp_path):
    """The checkpoint is the protocol's state dicts: restoring them gives the same result."""
    from depthsat_theory.diagnose import ProbeLoss
    from depthsat_theory.statistics import statistics_for

    model, _, _, batches = _mlp_problem(n=24, batch=6)
    ck = tmp_path / "ck.safetensors"
    full = diagnose(model, classification_loss, batches, realizability=True, checkpoint=ck)
    header, tensors = read_checkpoint(ck)
    assert header["config"]["version"] == 4 and header["complete"]
    site = full.sites[0].site
    st = statistics_for(parse_family("linear"), header["shapes"][site], full.sites[0].layout, pool_ties=True)
    st.load_state_dict({k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith(f"{site}/")})
    assert st.n == 24 and st.result().score == full.sites[0].result.score
    assert st.result().raw_score == full.sites[0].result.raw_score
    loss = ProbeLoss()
    loss.load_state_dict({k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("@loss/")})
    assert loss.examples == 24 and loss.result() == full.loss


def test_one_verdict_per_site_everywhere_and_the_certificate_beside_it():
    """One verdict field (API, result, JSON, table); ``--delta`` adds a certificate and never changes the verdict."""
    import warnings

    from depthsat_theory.vocabulary import Certificate, Layout, Verdict

    model, _, _, batches = _mlp_problem(n=40, batch=8)
    plain = diagnose(model, classification_loss, batches)
    bounded = diagnose(model, classification_loss, batches, delta=0.1)
    assert all(s.layout is Layout.VECTOR for s in plain.sites)
    for p, b in zip(plain.sites, bounded.sites, strict=True):
        assert isinstance(p.verdict, Verdict) and p.verdict is p.result.verdict
        assert b.verdict is p.verdict  # the interval never replaces the verdict
        assert p.certificate is None and isinstance(b.certificate, Certificate)
        assert b.certificate.value == b.interval.certificate
        for sd in (p, b):
            d = sd.to_dict()
            assert d["verdict"] == sd.verdict.value and "verdict_detail" not in d
            assert d["certificate"] == (None if sd.certificate is None else sd.certificate.value)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert p.verdict_kind is p.verdict  # the deprecated alias
        assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    for diag in (plain, bounded):
        cols = diag.columns()
        rows = [diag._row(sd, cols) for sd in diag.sites]
        assert [r[cols.index("verdict")] for r in rows] == [sd.verdict.value for sd in diag.sites]
    cols = bounded.columns()
    assert "certificate" in cols and cols.index("verdict") < cols.index("certificate")
    certs = [bounded._row(sd, cols)[cols.index("certificate")] for sd in bounded.sites]
    assert certs == [sd.certificate.value for sd in bounded.sites]
    assert "certificate" not in plain.columns()


@pytest.mark.parametrize(
    ("header", "match"),
    [
        ("{oops", "header is not valid JSON"),
        ("[1, 2]", "malformed header"),
        (json.dumps({"config": {"version": 2}, "shapes": {}}), "malformed header"),
    ],
)
def test_malformed_checkpoint_header_is_one_clear_line(tmp_path, header, match):
    from safetensors.torch import save

    model, _, _, batches = _mlp_problem(n=12, batch=6)
    ck = tmp_path / "bad.safetensors"
    ck.write_bytes(save({"loss": torch.zeros(2, dtype=torch.float64)}, metadata={"depthsat_diagnose": header}))
    with pytest.raises(CheckpointError, match=match) as info:
        diagnose(model, classification_loss, batches, checkpoint=ck)
    assert "\n" not in str(info.value)


def test_diagnose_errors_name_arguments_and_the_cli_names_flags():
    from depthsat_theory.cli.flags import user_message
    from depthsat_theory.diagnose.checkpoint import config_diff

    model, _, _, batches = _mlp_problem(n=12, batch=6)
    with pytest.raises(DiagnoseError, match=r"^checkpoint_every must be >= 1$") as info:
        diagnose(model, classification_loss, batches, checkpoint_every=0)
    assert user_message(info.value) == "--checkpoint-every must be >= 1"
    old = {"version": 2, "user": {"model": "mlp", "batch_size": 64, "seed": 0}}
    new = {"version": 2, "user": {"model": "mlp", "batch_size": 32, "seed": 1}}
    assert config_diff(old, new) == ["user.batch_size", "user.seed"]


# ----------------------------------------------------------------------------- checkpoint: probe stream, tampering
def _interrupted_checkpoint(tmp_path, model, batches, after=3, loss=classification_loss, **kw):
    ck = tmp_path / "ck.safetensors"

    def stop(done, total):
        if done == after:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        diagnose(model, loss, batches, checkpoint=ck, progress=stop, **kw)
    return ck


def test_resume_with_another_batching_or_probe_is_refused(tmp_path):
    """Resuming 512 examples with another batching counted n = 608; now refused."""
    torch.manual_seed(0)
    model = ResidualMLP(in_dim=6, width=5, depth=2, n_classes=3).to(DT).eval()
    x, y = torch.randn(512, 6, dtype=DT), torch.randint(0, 3, (512,))

    def batches(b, xx=x, yy=y):
        return [(xx[i : i + b], yy[i : i + b]) for i in range(0, 512, b)]

    ck = _interrupted_checkpoint(tmp_path, model, batches(64))
    assert read_checkpoint(ck)[0]["examples"] == 3 * 64  # hand count: three batches of 64
    head = f"checkpoint {ck} was written for another probe stream: "
    tail = (
        "; resume with the same batches in the same order (same batch size, data and shuffling), "
        "or delete it or pass another checkpoint path to start over"
    )
    cases = [
        (batches(32), "batch 0 has 32 examples here but 64 in the checkpoint"),
        (batches(64, x + 1.0), "batch 0 holds other inputs or targets than in the checkpoint"),
        (batches(64, x, (y + 1) % 3), "batch 0 holds other inputs or targets than in the checkpoint"),
        (batches(64)[:1] + batches(64)[2:3] + batches(64)[1:2] + batches(64)[3:], "batch 2 holds other inputs"),
        (
            batches(64)[:1] + batches(64, x + 1.0)[1:2] + batches(64)[2:],  # only the middle batch differs
            "the batches before the resume point differ from those in the checkpoint (other data or order)",
        ),
    ]
    for probe, what in cases:
        with pytest.raises(CheckpointError) as info:
            diagnose(model, classification_loss, probe, checkpoint=ck)
        msg = str(info.value)
        assert msg.startswith(head + what) and msg.endswith(tail) and "\n" not in msg, msg
    # the refused attempts left the checkpoint as it was: an honest resume gives the uninterrupted numbers
    res = diagnose(model, classification_loss, batches(64), checkpoint=ck)
    full = diagnose(model, classification_loss, batches(64))
    assert res.resumed_from == 3 and res.n == 512 == full.n
    _same(res, full, rel=0)
    # a finished checkpoint refuses another batching too (the double count of the issue)
    with pytest.raises(CheckpointError, match="batch 0 has 32 examples here but 64"):
        diagnose(model, classification_loss, batches(32), checkpoint=ck)


def _tamper(ck, *, header=None, tensors=None, raw=None):
    """Rewrite a checkpoint: ``header(dict) -> dict|str``, ``tensors(dict) -> dict`` or raw bytes."""
    from safetensors.torch import safe_open, save

    if raw is not None:
        ck.write_bytes(raw(ck.read_bytes()))
        return
    with safe_open(str(ck), framework="pt") as fh:
        meta = fh.metadata()
        ts = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    head = json.loads(meta["depthsat_diagnose"])
    head = header(head) if header else head
    ts = tensors(ts) if tensors else ts
    ck.write_bytes(save(ts, metadata={"depthsat_diagnose": head if isinstance(head, str) else json.dumps(head)}))


def _set(d, key, value):
    d = dict(d)
    d[key] = value
    return d


def _without(d, key):
    return {k: v for k, v in d.items() if k != key}


SITE0 = "embed"  # first site of ResidualMLP and of the CLI's mlp
TAMPERINGS = [
    ("bad-json", dict(header=lambda h: "{oops"), "its header is not valid JSON"),
    ("truncated", dict(raw=lambda b: b[: len(b) // 2]), "not a readable safetensors file"),
    ("garbage", dict(raw=lambda b: b"\x00" * 7), "not a readable safetensors file"),
    ("batches-str", dict(header=lambda h: _set(h, "batches", 2.5)), "malformed header"),
    ("batches-neg", dict(header=lambda h: _set(h, "batches", -1)), "header field 'batches' is -1"),
    ("examples", dict(header=lambda h: _set(h, "examples", "many")), "header field 'examples'"),
    ("complete", dict(header=lambda h: _set(h, "complete", 1)), "header field 'complete'"),
    ("shapes", dict(header=lambda h: _set(h, "shapes", _set(h["shapes"], SITE0, ["x"]))), f"'shapes.{SITE0}'"),
    ("shape-lie", dict(header=lambda h: _set(h, "shapes", _set(h["shapes"], SITE0, [7]))), f"'{SITE0}/sigma'"),
    ("probe", dict(header=lambda h: _set(h, "probe", 3)), "header field 'probe'"),
    (
        "shape",
        dict(tensors=lambda t: _set(t, f"{SITE0}/sigma", t[f"{SITE0}/sigma"][:-1])),
        f"'{SITE0}/sigma' has shape",
    ),
    (
        "reshaped",
        dict(tensors=lambda t: _set(t, f"{SITE0}/cross", t[f"{SITE0}/cross"].T.contiguous())),
        f"'{SITE0}/cross' has shape",
    ),
    ("dtype", dict(tensors=lambda t: _set(t, f"{SITE0}/sigma", t[f"{SITE0}/sigma"].float())), "has dtype float32"),
    ("missing", dict(tensors=lambda t: _without(t, f"{SITE0}/g_sq")), f"tensor '{SITE0}/g_sq' is missing"),
    ("extra", dict(tensors=lambda t: _set(t, "junk/x", torch.zeros(2))), "tensor 'junk/x' is not a state"),
    ("nan", dict(tensors=lambda t: _set(t, f"{SITE0}/g_sq", torch.tensor(float("nan"), dtype=DT))), "NaN or Inf"),
    ("count", dict(tensors=lambda t: _set(t, f"{SITE0}/n", t[f"{SITE0}/n"] + 1)), f"tensor '{SITE0}/n' holds"),
    ("loss-count", dict(tensors=lambda t: _set(t, "@loss/examples", t["@loss/examples"] * 2)), "'@loss/examples'"),
]


@pytest.mark.parametrize(("name", "how", "field"), TAMPERINGS, ids=[t[0] for t in TAMPERINGS])
def test_tampered_checkpoint_is_one_line_naming_the_field(tmp_path, name, how, field):
    model, _, _, batches = _mlp_problem(n=30, batch=6)
    ck = _interrupted_checkpoint(tmp_path, model, batches, after=2, realizability=True)
    _tamper(ck, **how)
    with pytest.raises(CheckpointError) as info:
        diagnose(model, classification_loss, batches, checkpoint=ck, realizability=True)
    msg = str(info.value)
    assert "\n" not in msg and f"checkpoint {ck}" in msg, msg
    assert "is damaged or incompatible" in msg and field in msg, msg
    assert msg.endswith("delete it or pass another checkpoint path to start over"), msg


@pytest.mark.parametrize(
    ("name", "how", "field"),
    [t for t in TAMPERINGS if t[0] in {"bad-json", "truncated", "dtype", "extra", "nan"}],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_cli_tampered_checkpoint_exit_2(tmp_path, cache_env, name, how, field):
    ck = tmp_path / "ck"
    args = ["diagnose", "--model", "mlp", "--batches", "2", "--batch-size", "16", "--checkpoint", str(ck), "-q"]
    assert runner.invoke(app, args).exit_code == 0
    _tamper(ck, **how)
    out = runner.invoke(app, args)
    assert out.exit_code == 2, out.output
    lines = [ln for ln in out.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.output
    assert "is damaged or incompatible" in lines[0] and field in lines[0], out.output
    assert "internal error" not in out.output and "probe batch" not in out.output


# ----------------------------------------------------------------------------- attention with padding
def _stacked_reference(fam, zs, gs):
    """``s`` of unpadded sequences scored separately: the torch.func tangent Jacobian of each, stacked.

    ``s² = ‖Π g‖² / n`` with ``Π`` the least-squares projector onto the columns of the stacked
    Jacobian (one row block per real token and coordinate), ``n`` the number of sequences.
    """
    p = fam.param_dim(tuple(zs[0].shape))
    theta0 = torch.zeros(p, dtype=DT)
    for z in zs:  # build the frozen feature map of each length outside the transform
        fam.functional(theta0, z[None], "sequence")
    jac = [torch.func.jacrev(lambda th, z=z: fam.functional(th, z[None], "sequence").reshape(-1))(theta0) for z in zs]
    a = torch.cat(jac).numpy()
    gv = torch.cat([g.reshape(-1) for g in gs]).numpy()
    coef, *_ = np.linalg.lstsq(a, gv, rcond=1e-12)
    return math.sqrt(float(((a @ coef) ** 2).sum()) / len(zs))


def test_attention_statistics_honour_the_padding_mask():
    from depthsat_theory.statistics import statistics_for

    torch.manual_seed(7)
    fam = parse_family("attention:6")
    lengths, left = [5, 3, 2, 4], [False, False, True, True]  # right and left padding
    z = torch.randn(4, 5, 4, dtype=DT)
    g = torch.randn(4, 5, 4, dtype=DT)
    mask = torch.zeros(4, 5, dtype=torch.bool)
    for i, (n_i, lft) in enumerate(zip(lengths, left, strict=True)):
        if lft:
            mask[i, 5 - n_i :] = True
        else:
            mask[i, :n_i] = True
    assert mask.tolist()[2] == [False, False, False, True, True]
    g[~mask] = 0.0
    z[~mask] = 100.0  # padded activations must not matter
    for m in (None, torch.ones(4, 5, dtype=torch.bool)):  # no mask and an all-ones mask agree
        st = statistics_for(fam, (5, 4), "sequence")
        st.update(z[:1], g[:1], mask=m if m is None else m[:1])
        assert st.result().score == pytest.approx(_stacked_reference(fam, [z[0]], [g[0]]), rel=1e-9)
    st = statistics_for(fam, (5, 4), "sequence")
    st.update(z, g, mask=mask)
    res = st.result()
    zs, gs = [z[i][mask[i]] for i in range(4)], [g[i][mask[i]] for i in range(4)]
    assert res.score == pytest.approx(_stacked_reference(fam, zs, gs), rel=1e-9)
    assert res.units == sum(lengths) == 14 and res.n == 4
    bound = BoundStatistics(fam, (5, 4), "sequence")
    bound.update(z, g, mask=mask)
    assert bound.result().score == pytest.approx(res.score, rel=1e-12)
    with pytest.raises(Exception, match=r"tie pooling .*needs unpadded batches"):
        statistics_for(fam, (5, 4), "sequence", pool_ties=True).update(z, g, mask=mask)


def test_diagnose_attention_on_padded_keyword_batches():
    """HF keyword batches with an attention_mask (padded, and all ones): equal to the unpadded sequences."""
    torch.manual_seed(5)
    model = HFLike("llama").to(DT)
    ids = torch.randint(0, 5, (4, 5))
    masks = [torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]), torch.ones(2, 5, dtype=torch.long)]

    def loss(logits, y):
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none", ignore_index=-100)
        return ce.sum(1) / (y != -100).sum(1)

    batches = [
        ({"input_ids": ids[2 * j : 2 * j + 2], "attention_mask": m}, ids[2 * j : 2 * j + 2].masked_fill(m == 0, -100))
        for j, m in enumerate(masks)
    ]
    fam = parse_family("attention:4")
    d = diagnose(model, loss, batches, family="attention:4")
    for sd in d.sites:
        zs, gs = [], []
        for x, y in batches:
            z, g = _naive_site(model, sd.site, x["input_ids"], y, loss)
            keep = x["attention_mask"].bool()
            zs += [z[i][keep[i]] for i in range(z.shape[0])]
            gs += [g[i][keep[i]] for i in range(z.shape[0])]
        assert sd.result.score == pytest.approx(_stacked_reference(fam, zs, gs), rel=1e-8)
        assert sd.result.units == 18 and sd.result.n == 4


def test_diagnose_caches_trained_models_by_default(monkeypatch, tmp_path):
    """``diagnose --model mlp`` passes the default weight cache to the trainer (``audit --model`` shares the default).

    Truth: ``$DEPTHSAT_CACHE`` when set, else ``$HOME/.cache/depthsat`` (as ``check`` does); before,
    ``diagnose`` passed none and retrained on every call.
    """
    import depthsat_theory.tasks.training as tasks
    from depthsat_theory.cli.inputs import UserError, diagnose_target

    seen: list = []

    def fake_trained_task(kind, seed=0, *, cache_dir=None):
        seen.append(cache_dir)
        raise RuntimeError("stop")

    monkeypatch.setattr(tasks, "trained_task", fake_trained_task)
    monkeypatch.delenv("DEPTHSAT_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match="stop"):
        diagnose_target("mlp", 0, None, None)
    monkeypatch.setenv("DEPTHSAT_CACHE", str(tmp_path / "c"))
    with pytest.raises(RuntimeError, match="stop"):
        diagnose_target("mlp", 0, None, None)
    assert [str(p) for p in seen] == [str(tmp_path / ".cache" / "depthsat"), str(tmp_path / "c")]
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("DEPTHSAT_CACHE", str(tmp_path / "file"))
    with pytest.raises(UserError, match="is a file, not a folder"):
        diagnose_target("mlp", 0, None, None)


def test_an_unknown_site_lists_the_sites_next_to_it():
    from depthsat_theory.capture import sites as sites_mod

    model = nn.Sequential()
    model.add_module("blocks", nn.ModuleList([nn.Linear(2, 2) for _ in range(4)]))
    # a missing index: the message lists the modules next to it, in the model's order
    with pytest.raises(sites_mod.SiteError, match=r"'blocks\.9'.*similar: blocks\.0, blocks\.1, blocks\.2, blocks\.3$"):
        sites_mod.resolve_module(model, "blocks.9")
    with pytest.raises(
        sites_mod.SiteError, match=r"similar: blocks\.1, "
    ):  # a misspelt parent: the nearest names, closest first
        sites_mod.resolve_module(model, "blokcs.1")


# ----------------------------------------------------------------------------- checkpoint: every verdict input
def _tied_half_problem():
    """A float16 net whose ReLU after site ``1`` meets exact zeros in the first two batches only.

    Dyadic weights and inputs: the float16 pre-activations are exact, so the ties are known by hand
    (``x₁ = x₂`` zeroes unit 0, ``x₁ = 0`` zeroes unit 1).
    """
    w1 = torch.tensor([[1.0, -1.0], [1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]) / 2
    w2 = torch.tensor([[1.0, 0.5, -0.5, 0.25], [-1.0, 0.25, 0.5, 0.5], [0.5, -0.25, 0.25, -1.0]])
    net = nn.Sequential(nn.Linear(2, 4), nn.Identity(), nn.ReLU(), nn.Linear(4, 3))
    with torch.no_grad():
        net[0].weight.copy_(w1), net[0].bias.zero_(), net[3].weight.copy_(w2), net[3].bias.zero_()
    net = net.half().eval()
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(1, 8, (48, 2), generator=gen) / 4
    x[:, 1] = x[:, 0] + torch.randint(1, 4, (48,), generator=gen) / 4
    x = x.to(torch.float16)  # 0 < x₁ < x₂: no pre-activation is 0 so far
    x[:6, 1] = x[:6, 0]  # batches 0 and 1 (8 examples each): 6 ties at unit 0
    x[8:11, 0] = 0.0  # 3 ties at unit 1
    with torch.no_grad():
        y = net(x).float().argmin(1)  # labels the net gets wrong: a large activation gradient along the features
    batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 48, 8)]
    pre = x.double() @ w1.double().T
    return net, batches, int((pre == 0).sum())


def _half_loss(out, y):
    return nn.functional.cross_entropy(out.float(), y, reduction="none")


@pytest.mark.parametrize("rho", [False, True])
def test_resumed_run_counts_the_kink_ties_of_the_restored_batches(tmp_path, rho):
    """Interrupted after the tied batches and resumed: the same ties, verdict and scores as uninterrupted.

    Before, the resumed run dropped the restored batches' ties and called the site *improvable*.
    """
    net, batches, ties = _tied_half_problem()
    assert ties == 9
    full = diagnose(net, _half_loss, batches, sites=["1"], realizability=rho)
    assert full["1"].result.kink_ties == ties and full["1"].verdict.value == "undetermined"
    blind = diagnose(net, _half_loss, batches, sites=["1"], realizability=rho, kinks=False)
    assert blind["1"].verdict.value == "improvable"  # the ties alone decide: dropping them flips the verdict
    ck = _interrupted_checkpoint(tmp_path, net, batches, after=3, sites=["1"], realizability=rho, loss=_half_loss)
    assert read_checkpoint(ck)[0]["kink_ties"] == {"1": ties}
    res = diagnose(net, _half_loss, batches, sites=["1"], realizability=rho, checkpoint=ck)
    assert res.resumed_from == 3
    a, b = res["1"], full["1"]
    assert a.result.kink_ties == ties and a.verdict is b.verdict
    assert a.result.n == b.result.n == 48
    _same(res, full, rel=0)


def test_checkpoint_of_format_3_without_tie_counts_is_refused(tmp_path):
    """A version-3 checkpoint has no kink tie counts: resuming it could call an undetermined site improvable."""
    from safetensors.torch import load_file, save_file

    net, batches, _ = _tied_half_problem()
    ck = _interrupted_checkpoint(tmp_path, net, batches, after=3, sites=["1"], loss=_half_loss)
    header, _ = read_checkpoint(ck)
    header["config"]["version"] = 3
    del header["kink_ties"]
    save_file(load_file(ck), ck, metadata={"depthsat_diagnose": json.dumps(header)})
    with pytest.raises(CheckpointError, match=r"format version 3.*kink tie counts") as info:
        diagnose(net, _half_loss, batches, sites=["1"], checkpoint=ck)
    assert "\n" not in str(info.value)
