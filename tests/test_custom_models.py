"""Your own model from the CLI: ``diagnose --model hf:PATH`` and ``--model package.module:attr``.

Truth is derived independently of :mod:`depthsat_theory.tasks.custom`: for ``hf:`` the scores of
``diagnose`` on the saved model object in Python, on probe batches and a next-token loss built here;
for a factory the closed-form linear-family score ``s² = tr(G Σ⁺ Gᵀ)`` (numpy least squares) from
activation gradients taken by plain autograd.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_hf import VERSES, char_tokenizer, save_checkpoint, tiny_causal_lm
from typer.testing import CliRunner

from depthsat_theory.cli import app
from depthsat_theory.diagnose import diagnose
from depthsat_theory.tasks.custom import ModelSpecError, resolve_device, resolve_model, to_device

runner = CliRunner()
K = 4  # lines per example (resolve_model's default)


def _sites(arch, layers=2):
    return [f"model.layers.{i}" if arch == "llama" else f"transformer.h.{i}" for i in range(layers)]


def _next_token_loss(output, ids):
    """Per-example mean next-token cross-entropy of unpadded ``(B, T)`` windows (nats per token)."""
    logits = output.logits[:, :-1]
    return (
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        .view(ids.shape[0], -1)
        .mean(dim=1)
    )


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_cli_hf_checkpoint_matches_diagnose_on_the_model_object(tmp_path, arch):
    model = tiny_causal_lm(arch)
    ckpt = tmp_path / "ckpt"
    save_checkpoint(model, ckpt)
    n = 6  # n + K lines: the probe's windows are all of them, whatever the draw's order
    lines = VERSES[: n + K]
    (tmp_path / "probe.txt").write_text("\n\n".join(lines) + "\n")  # blank lines are skipped
    argv = ["diagnose", "--model", f"hf:{ckpt}", "--text", str(tmp_path / "probe.txt"), "--batches", "2"]
    argv += ["--batch-size", "3", "--json", str(tmp_path / "d.json"), "--device", "cpu", "-q"]
    out = runner.invoke(app, argv)
    assert out.exit_code == 0, out.output
    got = json.loads((tmp_path / "d.json").read_text())

    tok = char_tokenizer()
    windows = [torch.tensor(tok("\n".join(lines[s : s + K]))["input_ids"][:128]) for s in range(n)]
    assert len({w.shape[0] for w in windows}) == 1  # every window is truncated: no padding here
    ids = torch.stack(windows)
    batches = [
        ({"input_ids": ids[i : i + 3], "attention_mask": torch.ones_like(ids[i : i + 3])}, ids[i : i + 3])
        for i in (0, 3)
    ]
    ref = diagnose(model, _next_token_loss, batches, sites=_sites(arch), family="linear")
    with torch.no_grad():
        loss = float(torch.cat([_next_token_loss(model(**x), y) for x, y in batches]).mean())

    assert [s["site"] for s in got["sites"]] == _sites(arch)
    assert got["n"] == n and got["loss"] == pytest.approx(loss, rel=1e-6)
    for site, want in zip(got["sites"], ref.sites, strict=True):
        assert site["tangent_rank"] == want.result.tangent_rank
        for key in ("score", "ag_rms", "ag_max"):
            assert site[key] == pytest.approx(getattr(want.result, key), rel=1e-5), (site["site"], key)


def test_hf_checkpoint_default_text_is_the_kjv(tmp_path):
    save_checkpoint(tiny_causal_lm("llama", layers=1), tmp_path)
    res = resolve_model(f"hf:{tmp_path}", n_batches=1, batch_size=2)
    ((x, _labels),) = res.batches
    text = char_tokenizer().decode(x["input_ids"][0][x["attention_mask"][0].bool()])
    from depthsat_theory.tasks import load_kjv_text

    assert text.replace(" ", "") in load_kjv_text().replace(" ", "")  # a window of consecutive verses
    assert res.sites == ["model.layers.0"] and "King James" in res.description


FACTORY = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch import nn


    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.f = nn.Sequential(nn.Tanh(), nn.Linear(d, d))

        def forward(self, h):
            return h + self.f(h)


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(3, 4)
            self.blocks = nn.ModuleList([Block(4), Block(4)])
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            h = self.embed(x)
            for b in self.blocks:
                h = b(h)
            return self.head(h)


    def loss(out, y):
        return F.cross_entropy(out, y, reduction="none")


    def make():
        torch.manual_seed(0)
        net = Net().double().eval()
        x = torch.randn(40, 3, dtype=torch.float64)
        y = (x[:, 0] * x[:, 1] > 0).long()
        return net, loss, [(x[:20], y[:20]), (x[20:], y[20:])]


    def wrong_arity():
        net, loss_fn, batches = make()
        return net, batches


    def not_a_module():
        return "net", loss, [(torch.zeros(2, 3), torch.zeros(2))]


    def tensor_batches():
        net, loss_fn, batches = make()
        return net, loss_fn, torch.zeros(4, 3)


    def bad_batch():
        net, loss_fn, batches = make()
        return net, loss_fn, [torch.zeros(4, 3)]


    def raises():
        raise RuntimeError("no data here")


    NOT_CALLABLE = 3
    """
)


def _write_factory(tmp_path, monkeypatch, name):
    (tmp_path / f"{name}.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = importlib.util.spec_from_file_location(f"{name}_ref", tmp_path / f"{name}.py")
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)  # a second, independent import of the same file
    return ref


def _closed_form_scores(net, x, y):
    """s at blocks.0 and blocks.1 from per-example activation gradients (autograd) and numpy least squares."""
    scores = []
    for site in (0, 1):
        h = net.embed(x)
        for b in net.blocks[: site + 1]:
            h = b(h)
        z = h.detach().requires_grad_(True)
        out = z
        for b in net.blocks[site + 1 :]:
            out = b(out)
        (g,) = torch.autograd.grad(F.cross_entropy(net.head(out), y, reduction="sum"), z)
        zn, gn = z.detach().numpy(), g.numpy()
        phi = np.hstack([zn, np.ones((zn.shape[0], 1))])
        coef, *_ = np.linalg.lstsq(phi, gn, rcond=None)
        scores.append(float(np.sqrt(((phi @ coef) ** 2).sum() / zn.shape[0])))
    return scores


def test_cli_factory_module_attr_matches_closed_form(tmp_path, monkeypatch):
    ref = _write_factory(tmp_path, monkeypatch, "my_factory_a")
    out = runner.invoke(app, ["diagnose", "--model", "my_factory_a:make", "--json", str(tmp_path / "d.json"), "-q"])
    assert out.exit_code == 0, out.output
    got = json.loads((tmp_path / "d.json").read_text())
    net, _, batches = ref.make()
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    assert [s["site"] for s in got["sites"]] == ["blocks.0", "blocks.1"] and got["n"] == 40
    for site, want in zip(got["sites"], _closed_form_scores(net, x, y), strict=True):
        assert site["score"] == pytest.approx(want, rel=1e-9)


def test_resolve_model_moves_model_and_batches_to_the_device(tmp_path, monkeypatch, device):
    _write_factory(tmp_path, monkeypatch, "my_factory_b")
    res = resolve_model("my_factory_b:make", device=str(device), n_batches=1)
    assert res.device.type == device.type and len(res.batches) == 1
    assert all(p.device.type == device.type for p in res.model.parameters())
    assert all(t.device.type == device.type for t in res.batches[0])
    moved = to_device({"a": [torch.zeros(1)], "b": (torch.zeros(1), 3)}, device)
    assert moved["a"][0].device.type == device.type and moved["b"][1] == 3


def test_resolve_device_auto_and_errors():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("CPU") == torch.device("cpu")
    with pytest.raises(ModelSpecError, match="device 'tpu' is not one of"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ModelSpecError, match="CUDA is not available"):
            resolve_device("cuda")


def _hf_dir(tmp_path, what):
    d = tmp_path / what
    d.mkdir()
    if what in ("config-only", "no-tokenizer"):
        model = tiny_causal_lm("llama", layers=1)
        model.config.save_pretrained(str(d))
        if what == "no-tokenizer":
            model.save_pretrained(str(d))
    return d


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "hf:{tmp}/empty"], "not a Hugging Face checkpoint folder (no config.json)"),
        (["--model", "hf:{tmp}/missing"], "no such folder"),
        (["--model", "hf:{tmp}/config-only"], "no readable weights"),
        (["--model", "hf:{tmp}/no-tokenizer"], "no readable tokenizer"),
        (["--model", "no_such_module_xyz:make"], "no module named 'no_such_module_xyz'"),
        (["--model", "my_factory_c:nope"], "my_factory_c has no attribute 'nope'"),
        (["--model", "my_factory_c:NOT_CALLABLE"], "is a int, not a factory"),
        (["--model", "my_factory_c:wrong_arity"], "returned a 2-tuple; expected (model: nn.Module"),
        (["--model", "my_factory_c:not_a_module"], "returned a str as the model"),
        (["--model", "my_factory_c:tensor_batches"], "returned a Tensor as the batches"),
        (["--model", "my_factory_c:bad_batch"], "batch 0 is a Tensor"),
        (["--model", "my_factory_c:raises"], "the factory raised RuntimeError: no data here"),
        (["--model", "my_factory_c:make", "--batch-size", "4"], "--batch-size does not apply"),
        (["--model", "my_factory_c:make", "--batches", "3"], "--batches 3 exceeds the 2 batches"),
        (["--model", "bad spec:x"], "is not package.module:attr"),
        (["--model", "mlp", "--text", "{tmp}/t.txt"], "--text applies to hf:PATH models only"),
        (["--model", "mlp", "--device", "tpu"], "--device 'tpu' is not one of cpu, cuda"),
    ],
)
def test_cli_bad_model_specs_are_one_line_exit_2_nothing_written(tmp_path, monkeypatch, args, needle):
    _write_factory(tmp_path, monkeypatch, "my_factory_c")
    for what in ("empty", "config-only", "no-tokenizer"):
        _hf_dir(tmp_path, what)
    out_json = tmp_path / "d.json"
    argv = ["diagnose", *(a.replace("{tmp}", str(tmp_path)) for a in args), "--json", str(out_json), "-q"]
    out = runner.invoke(app, argv)
    assert out.exit_code == 2, out.output
    lines = [ln for ln in out.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], out.output
    assert not out_json.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["audit", "linear", "--model", "mlp", "--site", "blocks.1", "--device", "tpu"],
        ["check", "--instances", "1", "--device", "tpu", "-q"],
    ],
)
def test_cli_device_flag_errors(argv, tmp_path, model_cache, monkeypatch):
    monkeypatch.setenv("DEPTHSAT_CACHE", model_cache)
    monkeypatch.chdir(tmp_path)
    bad = runner.invoke(app, argv)
    lines = [ln for ln in bad.output.splitlines() if ln.startswith("error:")]
    assert bad.exit_code == 2 and len(lines) == 1 and "--device 'tpu' is not one of" in lines[0], bad.output
    assert not (tmp_path / "depthsat-report.json").exists()


def test_cli_audit_on_a_model_runs_on_the_device(model_cache, monkeypatch, device):
    monkeypatch.setenv("DEPTHSAT_CACHE", model_cache)
    base = ["audit", "linear", "--model", "mlp", "--site", "blocks.1", "--json"]
    ref, got = runner.invoke(app, base), runner.invoke(app, [*base, "--device", str(device)])
    assert ref.exit_code == 0 and got.exit_code == 0, got.output
    a, b = json.loads(ref.stdout), json.loads(got.stdout)
    assert a["score"] == pytest.approx(b["score"], rel=1e-9) and a["tangent_rank"] == b["tangent_rank"]


def test_cli_hf_checkpoint_padded_windows_score_as_unpadded_examples(tmp_path):
    """Short lines: the windows have different lengths and are right-padded in their batch; the
    statistics must equal those of the examples run one at a time (no padding at all)."""
    model = tiny_causal_lm("llama")
    save_checkpoint(model, tmp_path / "ckpt")
    n = 5
    lines = [v.split(",")[0][: 6 + 5 * i] for i, v in enumerate(VERSES[: n + K])]  # distinct lengths
    (tmp_path / "probe.txt").write_text("\n".join(lines))
    argv = ["diagnose", "--model", f"hf:{tmp_path / 'ckpt'}", "--text", str(tmp_path / "probe.txt")]
    argv += ["--batches", "1", "--batch-size", str(n), "--json", str(tmp_path / "d.json"), "-q"]
    out = runner.invoke(app, argv)
    assert out.exit_code == 0, out.output
    got = json.loads((tmp_path / "d.json").read_text())
    tok = char_tokenizer()
    singles = []
    for s in range(n):
        ids = torch.tensor([tok("\n".join(lines[s : s + K]))["input_ids"]])
        singles.append(({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids))
    assert len({b[1].shape[1] for b in singles}) > 1  # the batched run is padded
    ref = diagnose(model, _next_token_loss, singles, sites=_sites("llama"), family="linear")
    for site, want in zip(got["sites"], ref.sites, strict=True):
        for key in ("score", "ag_rms", "ag_max"):
            assert site[key] == pytest.approx(getattr(want.result, key), rel=1e-5), (site["site"], key)


def test_causal_lm_batches_labels_padding_and_draw():
    from depthsat_theory.tasks.zoo import causal_lm_batches

    tok = char_tokenizer()
    lines = ["ab", "cde", "f", "ghij", "k"]
    batches = causal_lm_batches(tok, lines, n=3, batch_size=2, seed=0, lines_per_example=2, max_tokens=4)
    assert [b[1].shape[0] for b in batches] == [2, 1]
    seen = set()
    for x, labels in batches:
        for ids, mask, lab in zip(x["input_ids"], x["attention_mask"], labels, strict=True):
            real = ids[mask.bool()].tolist()
            text = tok.decode(real).replace(" ", "")
            seen.add(text)
            assert len(real) <= 4 and mask[: len(real)].all() and not mask[len(real) :].any()  # right-padded
            assert (ids[len(real) :] == tok.pad_token_id).all()
            want = real[1:] + [-100] * (ids.shape[0] - len(real) + 1)  # next token; -100 at the end and padding
            assert lab.tolist() == want
    windows = {"\n".join(lines[s : s + 2])[:4].replace(" ", "") for s in range(3)}  # 3 starts of 5 - 2
    assert seen == windows
    with pytest.raises(ValueError, match="5 lines are too few"):
        causal_lm_batches(tok, lines, n=4, batch_size=2, seed=0, lines_per_example=2, max_tokens=4)


def test_integrations_package_imports_neither_framework():
    import subprocess
    import sys

    code = (
        "import sys, depthsat_theory.integrations as i; "
        "assert not {'transformers', 'lightning'} & set(sys.modules), sorted(sys.modules); "
        "assert i.SaturationMonitor and i.TrainerSaturationCallback and i.LightningSaturationCallback"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_cli_audit_factory_model_matches_closed_form(tmp_path, monkeypatch):
    ref = _write_factory(tmp_path, monkeypatch, "my_factory_d")
    out = runner.invoke(app, ["audit", "linear", "--model", "my_factory_d:make", "--site", "blocks.1", "--json"])
    assert out.exit_code == 0, out.output
    rep = json.loads(out.stdout)
    net, _, batches = ref.make()
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    assert rep["score"] == pytest.approx(_closed_form_scores(net, x, y)[1], rel=1e-9)
    assert rep["function_preserving"] and rep["model_deviation"] == 0.0 and rep["n"] == 40


def test_cli_audit_refuses_keyword_batches_and_unknown_sites(tmp_path, monkeypatch):
    _write_factory(tmp_path, monkeypatch, "my_factory_e")
    save_checkpoint(tiny_causal_lm("llama", layers=1), tmp_path / "ckpt")
    cases = [
        (["--model", f"hf:{tmp_path / 'ckpt'}", "--site", "model.layers.0"], "audit needs (inputs, targets) tensor"),
        (["--model", "my_factory_e:make", "--site", "blocks.7"], "unknown site 'blocks.7'; valid sites: blocks.0"),
    ]
    for args, needle in cases:
        out = runner.invoke(app, ["audit", "linear", *args])
        lines = [ln for ln in out.output.splitlines() if ln.startswith("error:")]
        assert out.exit_code == 2 and len(lines) == 1 and needle in lines[0], out.output


def _tiny_bert_dir(tmp_path, is_decoder):
    """A random 2-layer BERT (``BertForMaskedLM``) saved with the character tokenizer, built offline."""
    import transformers

    cfg = transformers.BertConfig(
        vocab_size=len(char_tokenizer().get_vocab()),
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=256,
        is_decoder=is_decoder,
    )
    torch.manual_seed(0)
    d = tmp_path / f"bert-decoder-{is_decoder}"
    transformers.BertForMaskedLM(cfg).eval().save_pretrained(str(d))
    char_tokenizer().save_pretrained(str(d))
    return d


def test_hf_bert_encoder_folder_is_refused_naming_what_is_wrong(tmp_path, monkeypatch):
    """``AutoModelForCausalLM`` loads a BERT folder as ``BertLMHeadModel`` with bidirectional attention;
    ``hf:`` refuses it in one line naming the class, ``config.is_decoder`` and the fixes, through the
    CLI (exit 2, nothing written) and the Python API.  The same weights with ``is_decoder = true``
    (a causal mask) are accepted: the refusal is about attention, not about the name BERT."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    enc = _tiny_bert_dir(tmp_path, is_decoder=False)
    # independent premise: this loaded model's first logit row does change with the last token
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(str(enc), local_files_only=True).eval()
    with torch.no_grad():
        a = m(input_ids=torch.tensor([[3, 4, 5, 6]])).logits[0, 0]
        b = m(input_ids=torch.tensor([[3, 4, 5, 7]])).logits[0, 0]
    assert not torch.allclose(a, b)
    with pytest.raises(ModelSpecError) as err:
        resolve_model(f"hf:{enc}", n_batches=1, batch_size=2)
    msg = str(err.value)
    for needle in (
        "BertLMHeadModel",
        "'bert'",
        "config.is_decoder = False",
        "not a causal language model",
        '"is_decoder": true',
        "package.module:attr",
    ):
        assert needle in msg, msg
    out_json = tmp_path / "d.json"
    out = runner.invoke(app, ["diagnose", "--model", f"hf:{enc}", "--json", str(out_json), "-q"])
    lines = [ln for ln in out.output.splitlines() if ln.startswith("error:")]
    assert out.exit_code == 2 and len(lines) == 1 and "not a causal language model" in lines[0], out.output
    assert not out_json.exists()
    dec = _tiny_bert_dir(tmp_path, is_decoder=True)
    res = resolve_model(f"hf:{dec}", n_batches=1, batch_size=2)
    assert type(res.model).__name__ == "BertLMHeadModel"
