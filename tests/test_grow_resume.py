"""grow: progress, held-out evaluation, and training interrupted and resumed from a checkpoint.

Independent truths: an uninterrupted run's final weights (bitwise, CPU); the held-out loss of the
ungrown and of the trained model computed directly from the batches; the step count of the progress calls.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from depthsat_theory.grow import GrowError  # noqa: E402
from depthsat_theory.grow.run import grow  # noqa: E402
from depthsat_theory.tasks.zoo import token_loss_masked  # noqa: E402

V = 61


def _llama():
    cfg = transformers.LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=V,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _batches(n=3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, V, (2, 8), generator=gen)
        labels = torch.full_like(ids, -100)
        labels[:, :-1] = ids[:, 1:]
        out.append(({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels))
    return out


def _mlp():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(16, 4, generator=gen), torch.randn(16, 2, generator=gen)) for _ in range(3)]
    return net, batches


def _mse(out, y):
    return ((out - y) ** 2).sum(-1)


class _Stop(Exception):
    pass


def _kw(model_kind):
    if model_kind == "llama":
        return _llama(), token_loss_masked, _batches(), dict(sites=None, positions="1", lr=1e-2)
    net, batches = _mlp()
    return net, _mse, batches, dict(sites=["0", "1", "2"], positions="1", lr=1e-2)


@pytest.mark.parametrize("kind", ["llama", "mlp"])
@pytest.mark.parametrize(("every", "stop_at"), [(1, 3), (2, 3)])
def test_interrupted_and_resumed_equals_uninterrupted(kind, every, stop_at, tmp_path):
    """Ctrl-C after step 3 of 6, rerun with the same checkpoint: bitwise the uninterrupted run's weights and losses."""
    model, loss, batches, kw = _kw(kind)
    full = grow(model, loss, batches, blocks=1, train_steps=6, **kw)
    path = tmp_path / "train.ckpt"

    def stop(phase, done, total):
        if phase == "train" and done == stop_at:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        grow(
            model, loss, batches, blocks=1, train_steps=6, checkpoint=path, checkpoint_every=every, progress=stop, **kw
        )
    assert path.is_file()
    steps = []
    resumed = grow(
        model,
        loss,
        batches,
        blocks=1,
        train_steps=6,
        checkpoint=path,
        checkpoint_every=every,
        progress=lambda ph, d, t: steps.append(d) if ph == "train" else None,
        **kw,
    )
    saved = stop_at - stop_at % every
    assert steps == list(range(saved + 1, 7))
    assert resumed.train_losses == full.train_losses and len(full.train_losses) == 6
    a, b = dict(full.model.named_parameters()), dict(resumed.model.named_parameters())
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n
    assert resumed.loss_after == full.loss_after


def test_checkpoint_of_another_run_refused(tmp_path):
    model, loss, batches, kw = _kw("mlp")
    path = tmp_path / "c.ckpt"
    grow(model, loss, batches, blocks=1, train_steps=2, checkpoint=path, **kw)
    with pytest.raises(GrowError, match=r"was written by another run \(steps 2, now 3\)"):
        grow(model, loss, batches, blocks=1, train_steps=3, checkpoint=path, **kw)
    (tmp_path / "junk.ckpt").write_bytes(b"not safetensors")
    with pytest.raises(GrowError, match="is not a grow checkpoint"):
        grow(model, loss, batches, blocks=1, train_steps=2, checkpoint=tmp_path / "junk.ckpt", **kw)


def test_held_out_loss_before_after_and_progress():
    model, loss, batches, kw = _kw("llama")
    held = _batches(n=2, seed=7)
    calls: dict[str, list] = {}
    rep = grow(
        model,
        loss,
        batches,
        blocks=1,
        train_steps=4,
        eval_batches=held,
        progress=lambda ph, d, t: calls.setdefault(ph, []).append((d, t)),
        **kw,
    )

    def mean_loss(m):
        with torch.no_grad():
            ells = [loss(m(**x), y) for x, y in held]
        return float(torch.cat(ells).sum()) / sum(int(e.shape[0]) for e in ells)

    assert rep.eval_loss_before == pytest.approx(mean_loss(model), rel=1e-12)
    assert rep.eval_loss_after == pytest.approx(mean_loss(rep.model), rel=1e-12)
    assert rep.eval_loss_after != rep.eval_loss_before
    assert calls["train"] == [(k, 4) for k in range(1, 5)]
    assert calls["probe"][-1][0] == 3
    assert [d for d, _ in calls["eval"]] == [1, 2, 1, 2, 3, 1, 2]  # held-out before; probe and held-out after
    assert any("memorisation" in n for n in rep.notes) and any("held-out" in n for n in rep.notes)
