"""expand_layers on every common decoder, each from a tiny random config built offline.

For each architecture (Llama, Qwen2, Mistral, Gemma, GPT-NeoX/Pythia serial and parallel, Phi, OPT, Falcon old
and new decoder, StableLM, Starcoder2, Gemma-2, Gemma-3, Mixtral, Qwen2-MoE; GPT-2 is in test_grow_hf.py, and a
model type outside the table is grown through the generic fallback):

- the grown model's logits equal the original's (exactly: the copy adds ``x + 0``);
- ``save_pretrained`` then plain ``AutoModelForCausalLM.from_pretrained`` gives the same logits;
- cached greedy ``generate`` gives the original's tokens, before and after the reload;
- the zeroed maps' gradient equals the criterion's ``b = Σ_t g_t · ∂Δ_t/∂θ`` (T1), computed
  independently: ``g`` is the *original* model's activation gradient at layer ``i``'s output and
  ``Δ(x; θ)`` the copied layer called alone on the original stream (a ``torch.func.vjp``); every other
  parameter of the copy has exactly zero gradient (T5).
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from depthsat_theory.grow import GrowError, NotFunctionPreservingError, expand_layers  # noqa: E402
from depthsat_theory.grow.hf import discover_zeroed  # noqa: E402

V = 101
_BASE = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, vocab_size=V, max_position_embeddings=64)
_KV = dict(num_key_value_heads=2)


def _cfg(name: str, **kw):
    return getattr(transformers, name)(**kw)


ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=64, **_KV)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=64, **_KV)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(intermediate_size=64, **_KV)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(intermediate_size=64, head_dim=8, **_KV)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(intermediate_size=64)),
    "gpt_neox_serial": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(intermediate_size=64, use_parallel_residual=False)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(intermediate_size=64)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=64, word_embed_proj_dim=32)),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict()),
    "falcon_new": ("FalconConfig", "FalconForCausalLM", dict(new_decoder_architecture=True, num_kv_heads=2)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(intermediate_size=64, **_KV)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(intermediate_size=64, **_KV)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(intermediate_size=64, head_dim=8, sliding_window=4, **_KV)),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(intermediate_size=64, head_dim=8, sliding_window=4, sliding_window_pattern=2, **_KV),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=64, num_local_experts=4, **_KV)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            intermediate_size=64,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            **_KV,
        ),
    ),
}


def _build(key: str, dtype=torch.float32):
    cfg_name, cls_name, kw = ARCHS[key]
    cfg = _cfg(cfg_name, **{**_BASE, **kw})
    cfg.pad_token_id = 0
    cfg.bos_token_id = 1
    cfg.eos_token_id = 2
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).to(dtype).eval()
    if dtype == torch.float64 and key in ("mixtral", "qwen2_moe"):
        model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    with torch.no_grad():  # trained-like: no parameter (bias, norm) left at its neutral initial value
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _ids(seed=1, b=2, t=9):
    return torch.randint(3, V, (b, t), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("key", list(ARCHS))
def test_expand_roundtrip_generate(key, tmp_path):
    model = _build(key)
    ids = _ids()
    ref = _logits(model, ids)
    exp = expand_layers(model, [0, 2])
    grown = exp.model
    assert exp.new_indices == [1, 4] and exp.deviation == 0.0
    assert grown.config.num_hidden_layers == 5 and model.config.num_hidden_layers == 3
    for names in exp.zeroed.values():
        assert names and all(float(grown.get_parameter(n).detach().abs().max()) == 0.0 for n in names)
    assert torch.equal(_logits(grown, ids), ref)
    grown.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    assert back.config.num_hidden_layers == 5
    assert torch.equal(_logits(back, ids), ref)
    prompt = ids[:1, :3]
    kw = dict(max_new_tokens=10, do_sample=False, use_cache=True, pad_token_id=0)
    want = model.generate(prompt, **kw)
    assert torch.equal(grown.generate(prompt, **kw), want)
    assert torch.equal(back.generate(prompt, **kw), want)


def _stream_and_grad(model, i, ids):
    """Original model: layer i's call (args, kwargs), its output x and g = ∂J/∂x (J the mean next-token loss)."""
    layers = model.get_submodule(_layer_path(model))
    store = {}

    def pre(_m, args, kwargs):
        store["call"] = (args, dict(kwargs))

    def hook(_m, _i, out):
        t = out[0] if isinstance(out, tuple) else out
        t.retain_grad()
        store["x"] = t

    h1 = layers[i].register_forward_pre_hook(pre, with_kwargs=True)
    h2 = layers[i].register_forward_hook(hook)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    h1.remove()
    h2.remove()
    out.loss.backward()
    model.zero_grad()
    return store["call"], store["x"].detach(), store["x"].grad.detach()


def _layer_path(model):
    for path in ("model.layers", "gpt_neox.layers", "model.decoder.layers", "transformer.h"):
        try:
            return path if isinstance(model.get_submodule(path), torch.nn.ModuleList) else None
        except AttributeError:
            continue
    raise AssertionError("no layer list")


def _detach(v):
    if isinstance(v, torch.Tensor):
        return v.detach()
    if isinstance(v, tuple):
        return tuple(_detach(t) for t in v)
    return v


@pytest.mark.parametrize("key", list(ARCHS))
def test_zeroed_maps_gradient_is_b(key):
    """T1/T5 for every family: ∂J/∂θ at the zero-output copy = Σ_t g_t ∂Δ_t/∂θ; the copy's other parameters: 0."""
    model = _build(key, torch.float64)
    ids = _ids(t=9)
    i = 1
    (args, kwargs), x, g = _stream_and_grad(model, i, ids)
    exp = expand_layers(model, [i])
    site = next(iter(exp.zeroed))
    new = exp.model.get_submodule(site)
    params = dict(new.named_parameters())
    out = exp.model(input_ids=ids, labels=ids, use_cache=False)
    grads = dict(zip(params, torch.autograd.grad(out.loss, list(params.values())), strict=True))
    zeroed = [n[len(site) + 1 :] for n in exp.zeroed[site]]
    # the criterion: the copy called alone on the original stream x, contracted with the original g
    alone = {n: p.detach().clone().requires_grad_(n in zeroed) for n, p in params.items()}
    kwargs = {k: _detach(v) for k, v in kwargs.items()}
    rest = tuple(_detach(a) for a in args[1:])
    outs = torch.func.functional_call(new, alone, (x, *rest), kwargs)
    delta = (outs[0] if isinstance(outs, tuple) else outs) - x
    want = torch.autograd.grad((g * delta).sum(), [alone[n] for n in zeroed])
    for n, w in zip(zeroed, want, strict=True):
        torch.testing.assert_close(grads[n], w, rtol=1e-9, atol=1e-13)
    assert max(float(w.abs().max()) for w in want) > 1e-6
    for n, gr in grads.items():
        if n not in zeroed:
            assert float(gr.abs().max()) == 0.0, n


def test_config_lists_follow_the_copies():
    """layer_types duplicated for the copy; Qwen2-MoE's decoder_sparse_step made explicit as mlp_only_layers."""
    g3 = expand_layers(_build("gemma3"), [0]).model.config
    assert g3.layer_types == ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    moe = _build("qwen2_moe")  # step 2: layer 1 sparse, layers 0 and 2 dense
    assert [type(layer.mlp).__name__ for layer in moe.model.layers] == ["Qwen2MoeMLP", "Qwen2MoeSparseMoeBlock"] * 1 + [
        "Qwen2MoeMLP"
    ]
    cfg = expand_layers(moe, [1]).model.config
    assert cfg.decoder_sparse_step == 1 and cfg.mlp_only_layers == [0, 3]


def test_opt_post_ln_refused():
    model = _build("opt")
    model.config.do_layer_norm_before = False
    for layer in model.model.decoder.layers:
        layer.do_layer_norm_before = False
    with pytest.raises(NotFunctionPreservingError, match=r"OPT layers are post-LN.*insert_blocks"):
        expand_layers(model, [0])


def test_generic_fallback_finds_output_projections(tmp_path):
    """A model type outside the table: the layer's output projections are found by making it the identity."""
    model = _build("starcoder2")
    model.config.model_type = "my_decoder"  # not in ARCHITECTURES
    exp = expand_layers(model, [1])
    assert exp.architecture.name == "Starcoder2ForCausalLM (discovered)"
    assert [n.split(".", 3)[3] for n in exp.zeroed["model.layers.2"]] == [
        "self_attn.o_proj.weight",
        "self_attn.o_proj.bias",
        "mlp.c_proj.weight",
        "mlp.c_proj.bias",
    ]
    ids = _ids()
    assert torch.equal(_logits(exp.model, ids), _logits(model, ids))


def test_generic_fallback_refuses_post_ln():
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    probe = {"input_ids": _ids()}
    with pytest.raises(GrowError, match=r"encoder\.layer\.0 \(BertLayer\) is not the identity even with every"):
        discover_zeroed(model, 0, "encoder.layer", probe)


def _moe(key):
    """A float64 MoE model with narrow experts: a probe of 120 tokens has more rows than the copy has features."""
    cfg_name, cls_name, kw = ARCHS[key]
    narrow = (
        dict(intermediate_size=8)
        if key == "mixtral"
        else dict(moe_intermediate_size=8, shared_expert_intermediate_size=8)
    )
    cfg = _cfg(cfg_name, **{**_BASE, **kw, **narrow})
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).double().eval()
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("key", ["mixtral", "qwen2_moe"])
def test_moe_copy_scored_with_its_own_tangent(key):
    """An MoE copy is ranked with its own family: features read independently as the Jacobian of the copy (called alone
    on the original stream) w.r.t. its zeroed maps (every expert's down projection, router-weighted; the shared
    expert's, gated), G the autograd gradient of the zeroed maps (T1), s² = tr(G Σ⁺ Gᵀ) in numpy; and the score
    refuses, by its T1 check, a table that forgets Qwen2-MoE's shared-expert gate."""
    import dataclasses

    import numpy as np

    from depthsat_theory.grow.copyscore import copy_scores, copy_statistics
    from depthsat_theory.tasks.zoo import token_loss_masked

    model = _moe(key)
    i, ids = 1, _ids(b=4, t=30)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    batch = ({"input_ids": ids}, labels)
    exp = expand_layers(model, [i])
    site = next(iter(exp.zeroed))
    names = exp.zeroed[site]
    assert any(n.endswith("mlp.experts.down_proj") for n in names)
    res = copy_scores(exp, token_loss_masked, [batch])[f"{_layer_path(model)}.{i}"]
    # the reference: the copy alone on the original stream x, its zeroed maps at zero
    (args, kwargs), x, _ = _stream_and_grad(model, i, ids)
    new = exp.model.get_submodule(site)
    params = {n: p.detach().clone() for n, p in new.named_parameters()}
    rel = [n[len(site) + 1 :] for n in names]
    kwargs = {k: _detach(v) for k, v in kwargs.items()}
    rest = tuple(_detach(a) for a in args[1:])

    def first_row(*theta):
        outs = torch.func.functional_call(new, {**params, **dict(zip(rel, theta, strict=True))}, (x, *rest), kwargs)
        return ((outs[0] if isinstance(outs, tuple) else outs) - x)[..., 0]

    jac = torch.func.jacrev(first_row, argnums=tuple(range(len(rel))))(*(params[n] for n in rel))
    cols, grads = [], []
    b = torch.autograd.grad(
        token_loss_masked(exp.model(**batch[0]), labels).mean(), [exp.model.get_parameter(n) for n in names]
    )
    for n, j, gr in zip(rel, jac, b, strict=True):
        if n.endswith("experts.down_proj"):  # (B, T, E, d, I): row 0 of every expert's map
            cols.append(j[:, :, :, 0, :].reshape(*ids.shape, -1))
            grads.append(gr.permute(1, 0, 2).reshape(gr.shape[1], -1))
        elif n.endswith("weight"):  # (B, T, d, k)
            cols.append(j[:, :, 0, :])
            grads.append(gr)
    phi = torch.cat(cols, dim=-1).reshape(-1, sum(c.shape[-1] for c in cols)).numpy()
    assert phi.shape[0] > phi.shape[1]  # more rows than features: the tangent space is a proper subspace
    sigma = phi.T @ phi / ids.shape[0]
    big_g = torch.cat(grads, dim=1).numpy()
    want = float(np.trace(big_g @ np.linalg.pinv(sigma, rcond=1e-10, hermitian=True) @ big_g.T))
    assert res.score**2 == pytest.approx(want, rel=1e-6) and res.score > 0
    np.testing.assert_allclose(
        copy_statistics(exp, token_loss_masked, [batch])[f"{_layer_path(model)}.{i}"].cross_gradient()[:32],
        big_g,
        rtol=1e-9,
        atol=1e-13,
    )
    if key == "qwen2_moe":
        exp.architecture = dataclasses.replace(exp.architecture, gated=())
        with pytest.raises(GrowError, match=r"shared_expert\.down_proj do not give its gradient \(T1\)"):
            copy_scores(exp, token_loss_masked, [batch])


@pytest.mark.parametrize("key", ["mixtral", "qwen2_moe"])
def test_grow_auto_ranks_moe_with_the_copy_family(key):
    """grow(positions='auto') on a float32 MoE (default experts kernel): ranked by the copies' own scores, in order."""
    from depthsat_theory.grow.copyscore import copy_scores
    from depthsat_theory.grow.run import grow
    from depthsat_theory.tasks.zoo import token_loss_masked

    model = _build(key)
    ids = _ids(b=3, t=10)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    batch = ({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels)
    rep = grow(model, token_loss_masked, [batch], sites=None, blocks=1, positions="auto")
    assert "zero-output layer copy" in rep.ranking["by"]
    scores = copy_scores(expand_layers(model, [0, 1, 2]), token_loss_masked, [batch])
    # ranked by the headline s_U/AG_rms = sqrt(max(0, (n ŝ² − v̂)/(n − 1)))/AG_rms (def-bias-corrected-score)
    heads = [math.sqrt(max(0.0, (r.n * r.score**2 - r.noise_variance) / (r.n - 1))) / r.ag_rms for r in scores.values()]
    assert [r["relative_headline"] for r in rep.ranking["sites"]] == pytest.approx(
        sorted(heads, reverse=True), rel=1e-9
    )
    assert sorted(r["relative_score"] for r in rep.ranking["sites"]) == sorted(
        r.relative_score for r in scores.values()
    )
