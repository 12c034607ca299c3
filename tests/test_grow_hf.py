"""expand_layers on tiny random Hugging Face models built from configs (Llama, Qwen2, GPT-2, BERT), offline.

Independent truths: the original model's logits and greedy tokens; the gradient of the zeroed
``o_proj``/``down_proj`` against a dense reference built from the *original* model's activation
gradient at layer ``i`` (``∂W J = Σ_t g_t ⊗ φ_t``, T1) and features computed from the copied
layer's own modules; exact zeros for every other parameter of the copy (T5).
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from depthsat_theory.grow import (  # noqa: E402
    GrowError,
    NotFunctionPreservingError,
    expand_layers,
    find_architecture,
    load_grown,
)

V = 101


def _llama(**kw):
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        max_position_embeddings=64,
        **kw,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def _gpt2(**kw):
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=V, n_positions=64, **kw)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _bert(cls=None):
    cfg = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=V
    )
    return (cls or transformers.BertModel)(cfg).eval()


def _ids(seed=1, b=2, t=7):
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def _out(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_expand_decoder_roundtrip_and_cache(make, tmp_path):
    torch.manual_seed(0)
    model = make()
    ids = _ids()
    ref = _out(model, ids)
    exp = expand_layers(model, [1, 0])
    grown = exp.model
    assert exp.positions == [0, 1] and exp.new_indices == [1, 3] and exp.deviation == 0.0
    assert grown.config.num_hidden_layers == 4 and model.config.num_hidden_layers == 2
    layers = grown.get_submodule(exp.layer_list)
    assert len(layers) == 4 and len(model.get_submodule(exp.layer_list)) == 2
    for i, layer in enumerate(layers):
        idx = [m.layer_idx for m in layer.modules() if isinstance(getattr(m, "layer_idx", None), int)]
        assert idx and set(idx) == {i}
    for names in exp.zeroed.values():
        assert names and all(float(grown.get_parameter(n).detach().abs().max()) == 0.0 for n in names)
    assert torch.equal(_out(grown, ids), ref)
    grown.post_init()  # must not re-randomise the zeroed copies
    grown.init_weights()
    assert torch.equal(_out(grown, ids), ref)
    grown.save_pretrained(tmp_path)
    back = load_grown(tmp_path)
    assert back.config.num_hidden_layers == 4
    assert torch.equal(_out(back, ids), ref)
    prompt = ids[:1, :3]
    kw = dict(max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
    want = model.generate(prompt, **kw)
    assert torch.equal(grown.generate(prompt, **kw), want)
    assert torch.equal(back.generate(prompt, **kw), want)


def test_expand_updates_layer_types():
    cfg = transformers.Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        use_sliding_window=True,
        sliding_window=4,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    exp = expand_layers(model, [1])
    assert exp.model.config.layer_types == [
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ]
    assert exp.model.config.num_hidden_layers == 4
    ids = _ids(t=9)
    assert torch.equal(_out(exp.model, ids), _out(model, ids))


def _grad_at_layer_output(model, layer, ids):
    """Original model: the layer's output x and g = ∂J/∂x, J the mean next-token cross-entropy."""
    store = {}

    def hook(_m, _i, out):
        t = out[0] if isinstance(out, tuple) else out
        t.retain_grad()
        store["x"] = t

    h = layer.register_forward_hook(hook)
    out = model(input_ids=ids, labels=ids)
    h.remove()
    out.loss.backward()
    model.zero_grad()
    return store["x"].detach(), store["x"].grad.detach()


def test_zeroed_maps_gradient_is_b_llama():
    """T1/T5: ∂J/∂W_down = Σ_t g_t φ_tᵀ and ∂J/∂W_o = Σ_t g_t c_tᵀ; every other new parameter has zero gradient."""
    torch.manual_seed(0)
    model = _llama().double()
    ids = _ids(t=9)
    x, g = _grad_at_layer_output(model, model.model.layers[0], ids)
    exp = expand_layers(model, [0])
    new = exp.model.model.layers[1]
    ctx = {}

    def keep_input(_m, inp, _out):
        ctx["c"] = inp[0].detach()  # (returns None: the output is not replaced)

    h = new.self_attn.o_proj.register_forward_hook(keep_input)
    out = exp.model(input_ids=ids, labels=ids)
    h.remove()
    params = dict(new.named_parameters())
    grads = dict(zip(params, torch.autograd.grad(out.loss, list(params.values())), strict=True))
    mlp = new.mlp
    with torch.no_grad():  # the copy's features on the original stream (the copy's attention adds 0)
        u = new.post_attention_layernorm(x)
        phi = mlp.act_fn(mlp.gate_proj(u)) * mlp.up_proj(u)
    flat_g = g.reshape(-1, g.shape[-1])
    want_down = flat_g.T @ phi.reshape(-1, phi.shape[-1])
    want_o = flat_g.T @ ctx["c"].reshape(-1, ctx["c"].shape[-1])
    torch.testing.assert_close(grads["mlp.down_proj.weight"], want_down, rtol=1e-9, atol=1e-13)
    torch.testing.assert_close(grads["self_attn.o_proj.weight"], want_o, rtol=1e-9, atol=1e-13)
    assert float(want_down.abs().max()) > 1e-6 and float(want_o.abs().max()) > 1e-6
    for name, gr in grads.items():
        if name not in ("mlp.down_proj.weight", "self_attn.o_proj.weight"):
            assert float(gr.abs().max()) == 0.0, name


def test_bert_fresh_preserved_trained_like_refused():
    torch.manual_seed(0)
    model = _bert()
    exp = expand_layers(model, [0])  # fresh LayerNorms (γ = 1, β = 0): LN is idempotent up to rounding
    assert exp.model.config.num_hidden_layers == 3 and exp.deviation <= exp.tolerance
    wrapped = _bert(transformers.BertForSequenceClassification)
    assert find_architecture(wrapped)[1] == "bert.encoder.layer"
    with torch.no_grad():
        for layer in model.encoder.layer:
            for ln in (layer.attention.output.LayerNorm, layer.output.LayerNorm):
                ln.weight.uniform_(0.5, 1.5)
                ln.bias.normal_(0, 0.3)
    with pytest.raises(NotFunctionPreservingError, match=r"post-LN.*LN\(LN\(x\)\) != x.*insert_blocks"):
        expand_layers(model, [0])


def test_expand_bad_input(tmp_path):
    model = _llama()
    with pytest.raises(GrowError, match=r"position 2 is outside the layer list: valid original indices are 0\.\.1"):
        expand_layers(model, [2])
    with pytest.raises(GrowError, match="repeat"):
        expand_layers(model, [0, 0])
    with pytest.raises(GrowError, match=r"unknown init .random.; use .zero-output-copy. or .first-order."):
        expand_layers(model, [0], init="random")
    with pytest.raises(GrowError, match=r"Sequential has no \.config: not a Hugging Face model; use .*insert_blocks"):
        expand_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)), [0])
    with pytest.raises(GrowError, match="scale_attn_by_inverse_layer_idx"):
        expand_layers(_gpt2(scale_attn_by_inverse_layer_idx=True), [0])
    assert model.config.num_hidden_layers == 2 and len(model.model.layers) == 2
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(GrowError, match=r"not a model folder \(no config\.json\)"):
        load_grown(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(GrowError, match=r"no \*\.safetensors weights"):
        load_grown(tmp_path)
    with pytest.raises(GrowError, match="not a folder"):
        load_grown(tmp_path / "notes.txt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "notes.txt"]  # nothing written


@pytest.mark.parametrize("freeze_old", [False, True])
def test_grow_pipeline_trains_with_trainer(freeze_old):
    """grow() on a tiny Llama: layer copies, transformers.Trainer from zero state, the old weights frozen or not."""
    from depthsat_theory.grow.run import grow
    from depthsat_theory.tasks.zoo import token_loss_masked

    torch.manual_seed(0)
    model = _llama()
    ids = _ids(b=3, t=10)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    batch = ({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels)
    with torch.no_grad():
        j0 = float(token_loss_masked(model(**batch[0]), labels).mean())
    rep = grow(
        model,
        token_loss_masked,
        [batch],
        sites=None if freeze_old else ["model.layers.0", "model.layers.1"],  # None: discovered
        blocks=1,
        positions="1",
        train_steps=3,
        freeze_old=freeze_old,
        lr=1e-3,
    )
    assert rep.method == "expand_layers" and rep.trainer == "transformers.Trainer"
    assert rep.new_sites == ["model.layers.2"] and rep.deviation == 0.0
    assert rep.loss_before == pytest.approx(j0, rel=1e-6)
    assert len(rep.train_losses) == 3 and rep.train_losses[0] == pytest.approx(j0, rel=1e-5)
    assert rep.first_step["j0"] == pytest.approx(j0, rel=1e-6) and rep.first_step["predicted_change"] < 0
    assert rep.loss_after < rep.loss_before
    grown = rep.model
    same = [
        torch.equal(p, grown.get_parameter(n)) for n, p in model.named_parameters() if n.startswith("model.layers.0")
    ]
    assert all(same) if freeze_old else not all(same)
    assert all(p.requires_grad for p in grown.parameters())  # flags restored after training
    new_down = grown.model.layers[2].mlp.down_proj.weight
    assert float(new_down.detach().abs().max()) > 0  # the zeroed map moved


def test_drop_gguf_marker_only_for_gguf():
    from types import SimpleNamespace

    from depthsat_theory.grow import drop_gguf_marker

    def fake(method):
        cfg = SimpleNamespace(quantization_config={"quant_method": method})
        q = SimpleNamespace(quantization_config=SimpleNamespace(quant_method=method))
        return SimpleNamespace(hf_quantizer=q, is_quantized=True, config=cfg)

    m = fake("gguf")
    drop_gguf_marker(m)
    assert m.hf_quantizer is None and m.is_quantized is False and not hasattr(m.config, "quantization_config")
    m = fake("bitsandbytes")  # really quantized weights: left alone
    drop_gguf_marker(m)
    assert m.hf_quantizer is not None and m.is_quantized and hasattr(m.config, "quantization_config")


def test_insert_blocks_into_llama_sequence_site():
    """insert_blocks on a Hugging Face decoder layer: sequence layout inferred, b = Σ_t g_t (z_t, 1)ᵀ (T1)."""
    from depthsat_theory.grow import insert_blocks
    from depthsat_theory.vocabulary import Layout

    torch.manual_seed(0)
    model = _llama().double()
    ids = _ids(t=9)
    z, g = _grad_at_layer_output(model, model.model.layers[1], ids)
    growth = insert_blocks(model, {"model.layers.1": "linear"}, probe={"input_ids": ids})
    assert growth.layouts["model.layers.1"] == Layout.SEQUENCE and growth.shapes["model.layers.1"] == (9, 32)
    assert growth.deviation == 0.0
    w, c = growth.tangent_params()["model.layers.1"]
    loss = growth.model(input_ids=ids, labels=ids).loss
    gw, gc = torch.autograd.grad(loss, [w, c])
    fz, fg = z.reshape(-1, 32), g.reshape(-1, 32)
    torch.testing.assert_close(gw, fg.T @ fz, rtol=1e-9, atol=1e-13)
    torch.testing.assert_close(gc, fg.sum(0), rtol=1e-9, atol=1e-13)


def test_zeroed_maps_gradient_is_b_gpt2():
    """GPT-2 (Conv1D: W is (in, out)): ∂J/∂W_c_proj = Σ_t φ_t g_tᵀ, ∂J/∂bias = Σ_t g_t; the rest of the copy: 0."""
    torch.manual_seed(0)
    model = _gpt2().double()
    ids = _ids(t=9)
    x, g = _grad_at_layer_output(model, model.transformer.h[1], ids)
    exp = expand_layers(model, [1])
    new = exp.model.transformer.h[2]
    out = exp.model(input_ids=ids, labels=ids)
    params = dict(new.named_parameters())
    grads = dict(zip(params, torch.autograd.grad(out.loss, list(params.values())), strict=True))
    with torch.no_grad():  # the copy's MLP features on the original stream (its attention adds 0)
        phi = new.mlp.act(new.mlp.c_fc(new.ln_2(x)))
    fg = g.reshape(-1, 32)
    torch.testing.assert_close(grads["mlp.c_proj.weight"], phi.reshape(-1, phi.shape[-1]).T @ fg, rtol=1e-9, atol=1e-13)
    torch.testing.assert_close(grads["mlp.c_proj.bias"], fg.sum(0), rtol=1e-9, atol=1e-13)
    torch.testing.assert_close(grads["attn.c_proj.bias"], fg.sum(0), rtol=1e-9, atol=1e-13)
    zeroed = {"mlp.c_proj.weight", "mlp.c_proj.bias", "attn.c_proj.weight", "attn.c_proj.bias"}
    assert float(grads["attn.c_proj.weight"].abs().max()) > 0
    for name, gr in grads.items():
        if name not in zeroed:
            assert float(gr.abs().max()) == 0.0, name


class _LinearBlock(torch.nn.Module):
    """``x ↦ x + W (A x) + c``: a zero-output linear family with fixed features ``A x`` (A dyadic)."""

    def __init__(self, a):
        super().__init__()
        self.inner = torch.nn.Linear(a.shape[1], a.shape[0], bias=False).double()
        self.out = torch.nn.Linear(a.shape[0], a.shape[1]).double()
        with torch.no_grad():
            self.inner.weight.copy_(a)
            self.out.weight.zero_()
            self.out.bias.zero_()

    def forward(self, x):
        return x + self.out(self.inner(x))


class _LinearNet(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        self.block = _LinearBlock(a)

    def forward(self, x):
        return self.block(x)


def _half_sq(out, y):
    """Per-example ½ Σ_{t,j} (out − y)²: the activation gradient at the block's output is ``out − y``."""
    return 0.5 * ((out - y) ** 2).sum(dim=(1, 2))


def _dyadic(seed, shape, scale):
    return torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(seed)).double() * scale / 8


def test_first_order_start_is_the_projected_step():
    """init='first-order' on a linear family with exact dyadic data and non-isotropic features: the weights are
    −t C/‖Πg‖ with C the least-squares fit of the activation gradient by the features (numpy lstsq), not the
    plain gradient's direction (which differs here); the held-out loss is recomputed; t = 0 is bitwise the
    original function."""
    import numpy as np

    from depthsat_theory.grow.start import first_order_start

    a = torch.tensor([[1.0, 0.5, 0.0], [0.0, 0.25, 2.0]], dtype=torch.float64)  # k = 2 features of d = 3
    scale = torch.tensor([1.0, 4.0, 0.25], dtype=torch.float64)  # non-isotropic inputs
    x, hx = _dyadic(1, (4, 8, 3), scale), _dyadic(3, (4, 8, 3), scale)
    w_true = torch.tensor([[0.5, -0.25], [0.0, 0.5], [-0.5, 0.25]], dtype=torch.float64)
    y = x + (x @ a.T) @ w_true.T + _dyadic(2, (4, 8, 3), torch.ones(3)) / 4
    hy = hx + (hx @ a.T) @ w_true.T + _dyadic(4, (4, 8, 3), torch.ones(3)) / 4
    model = _LinearNet(a)
    zeroed = {"block": ["block.out.weight", "block.out.bias"]}
    # the reference, independently: rows of features (with the constant) and of g = x − y at the zero state
    phi = np.concatenate([(x @ a.T).reshape(-1, 2).numpy(), np.ones((32, 1))], axis=1)
    g = (x - y).reshape(-1, 3).numpy()
    c = np.linalg.lstsq(phi, g, rcond=None)[0].T  # (d, k̃): Πg = C φ̃
    s_ref = float(np.sqrt(((phi @ c.T) ** 2).sum() / 4))  # ‖Πg‖ per example
    plain = g.T @ phi / 4  # G, the plain gradient of the zeroed coordinates
    cos = float((plain * c).sum() / np.linalg.norm(plain) / np.linalg.norm(c))
    assert cos < 0.99  # the old code's direction is not the projected step's here
    st = first_order_start(model, zeroed, _half_sq, (x, y), (hx, hy))
    assert st.step > 0 and st.projected_norm == pytest.approx(s_ref, rel=1e-9)
    want = -st.step * c / s_ref
    np.testing.assert_allclose(model.block.out.weight.detach().numpy(), want[:, :2], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(model.block.out.bias.detach().numpy(), want[:, 2], rtol=1e-9, atol=1e-12)
    with torch.no_grad():
        field = hx @ a.T @ torch.from_numpy(want[:, :2]).T + torch.from_numpy(want[:, 2])
        got = float(_half_sq(hx + field, hy).mean())
    assert got == pytest.approx(st.held_out_loss, rel=1e-12)
    assert st.held_out_loss == min(v for _, v in st.searched) < st.searched[0][1]
    kept = _LinearNet(a)
    res = first_order_start(kept, zeroed, _half_sq, (x, y), (hx, hy), grid=[])
    assert res.step == 0.0
    with torch.no_grad():
        assert torch.equal(kept(hx), hx) and torch.equal(kept(x), x)
    with pytest.raises(GrowError, match="are not zero"):
        first_order_start(model, zeroed, _half_sq, (x, y), (hx, hy))


def _mixtral64():
    cfg = transformers.MixtralConfig(
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        num_local_experts=4,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).double().eval()
    model.set_experts_implementation("eager")
    return model


@pytest.mark.parametrize("make", [_llama, _gpt2, _mixtral64], ids=["llama", "gpt2", "mixtral"])
def test_first_order_start_of_layer_copies(make):
    """expand_layers(init='first-order') (nn.Linear, Conv1D, fused experts): the start's first-order change per unit t,
    ⟨b, θ(t)/t⟩ with b the autograd gradient of the zeroed maps (T1), is −‖Πg‖; the held-out loss is recomputed."""
    from depthsat_theory.tasks.zoo import token_loss_masked

    torch.manual_seed(0)
    model = make().double()

    def batch(seed):
        ids = _ids(seed=seed, b=3, t=9)
        labels = torch.full_like(ids, -100)
        labels[:, :-1] = ids[:, 1:]
        return ({"input_ids": ids}, labels)

    train, held = batch(1), batch(1)  # held-out = the gradient batch: a descent direction must help for small t
    zero = expand_layers(model, [0])
    names = next(iter(zero.zeroed.values()))
    params = [zero.model.get_parameter(n) for n in names]
    b = torch.autograd.grad(token_loss_masked(zero.model(**train[0]), train[1]).mean(), params)
    exp = expand_layers(model, [0], init="first-order", loss_fn=token_loss_masked, batch=train, held_out=held)
    st = exp.start
    assert st.step > 0
    slope = sum(float((g * exp.model.get_parameter(n).detach()).sum()) for n, g in zip(names, b, strict=True))
    assert slope / st.step == pytest.approx(-st.projected_norm, rel=1e-6)
    with torch.no_grad():
        got = float(token_loss_masked(exp.model(**held[0]), held[1]).mean())
    assert got == pytest.approx(st.held_out_loss, rel=1e-12)
    assert st.held_out_loss == min(v for _, v in st.searched) < st.searched[0][1]
    with pytest.raises(GrowError, match="needs loss_fn, batch"):
        expand_layers(model, [0], init="first-order")


def test_copy_scores_use_the_copy_tangent():
    """The copy's own family (GPT-2 in float64): G equals the autograd gradient of its zeroed maps (T1); Σ's
    MLP block equals the Gram of the copy's MLP features computed from its modules; s² = tr(G Σ⁺ Gᵀ) (numpy)."""
    import numpy as np

    from depthsat_theory.grow.copyscore import copy_scores, copy_statistics
    from depthsat_theory.tasks.zoo import token_loss_masked

    torch.manual_seed(0)
    model = _gpt2().double()
    ids = _ids(t=9, b=3)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    labels[0, 5:] = -100
    batch = ({"input_ids": ids, "attention_mask": mask}, labels)
    exp = expand_layers(model, [0, 1])
    stats = copy_statistics(exp, token_loss_masked, [batch])
    assert sorted(stats) == ["transformer.h.0", "transformer.h.1"]
    st = stats["transformer.h.0"]
    names = exp.zeroed["transformer.h.1"]
    assert [n.split(".", 3)[3] for n in names] == [
        "attn.c_proj.weight",
        "attn.c_proj.bias",
        "mlp.c_proj.weight",
        "mlp.c_proj.bias",
    ]
    params = [exp.model.get_parameter(n) for n in names]
    b = torch.autograd.grad(token_loss_masked(exp.model(**batch[0]), labels).mean(), params, allow_unused=True)
    big_g = np.asarray(st.cross_gradient())
    d = 32
    np.testing.assert_allclose(big_g[:d, :d], b[0].numpy().T, rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(big_g[:d, d:-1], b[2].numpy().T, rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(big_g[:d, -1], b[1].numpy(), rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(big_g[:d, -1], b[3].numpy(), rtol=1e-9, atol=1e-13)
    assert not big_g[d:].any()
    x = {}
    h = model.transformer.h[0].register_forward_hook(
        lambda _m, _a, out: x.__setitem__("h", out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        model(**batch[0])
    h.remove()
    new = exp.model.transformer.h[1]
    with torch.no_grad():
        phi = new.mlp.act(new.mlp.c_fc(new.ln_2(x["h"])))[mask.bool()]
    sigma = np.asarray(st.feature_gram())
    np.testing.assert_allclose(sigma[d:-1, d:-1], (phi.T @ phi).numpy() / 3, rtol=1e-9, atol=1e-12)
    res = copy_scores(exp, token_loss_masked, [batch])["transformer.h.0"]
    want = float(np.trace(big_g @ np.linalg.pinv(sigma, rcond=1e-10, hermitian=True) @ big_g.T))
    assert res.score**2 == pytest.approx(want, rel=1e-6)
    assert res.score > 0


def test_copy_scores_refuse_unreadable_maps():
    """Fused experts are read (test_grow_hf_archs); experts with a post-expert norm are no feature family: refused."""
    from depthsat_theory.grow.copyscore import copy_scores
    from depthsat_theory.tasks.zoo import token_loss_masked

    cfg = transformers.MixtralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        num_local_experts=4,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).eval()
    exp = expand_layers(model, [0])
    exp.model.model.layers[1].mlp.experts.has_post_expert_norm = True
    ids = _ids()
    with pytest.raises(
        GrowError, match=r"mlp\.experts\.down_proj is not the weight or bias of a row-wise linear map, nor"
    ):
        copy_scores(exp, token_loss_masked, [({"input_ids": ids}, ids)])


def test_grow_auto_ranks_with_the_copy_family():
    """grow(positions='auto') on a GPT-2: the chosen layer is the one whose copy has the largest own s_U/AG_rms."""
    from depthsat_theory.grow.copyscore import copy_scores
    from depthsat_theory.grow.run import grow
    from depthsat_theory.tasks.zoo import token_loss_masked

    torch.manual_seed(0)
    model = _gpt2()
    ids = _ids(b=3, t=10)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    batch = ({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels)
    rep = grow(model, token_loss_masked, [batch], sites=None, blocks=1, positions="auto")
    scores = copy_scores(expand_layers(model, [0, 1]), token_loss_masked, [batch])
    # the headline s_U/AG_rms = sqrt(max(0, (n ŝ² − v̂)/(n − 1)))/AG_rms of each copy (def-bias-corrected-score)
    head = {
        s: math.sqrt(max(0.0, (r.n * r.score**2 - r.noise_variance) / (r.n - 1))) / r.ag_rms for s, r in scores.items()
    }
    best = max(scores, key=lambda s: (head[s], -list(scores).index(s)))
    assert [c["site"] for c in rep.chosen] == [best]
    assert "zero-output layer copy" in rep.ranking["by"]
    ranked = rep.ranking["sites"]
    # n = 3 examples: n ŝ² − v̂ cancels to rounding level at a copy with no signal, hence the absolute tolerance
    want = sorted(head.values(), reverse=True)
    assert [r["relative_headline"] for r in ranked] == pytest.approx(want, rel=1e-9, abs=1e-6)
    assert any("inserted family" in n for n in rep.notes)
