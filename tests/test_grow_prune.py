"""prune_candidates: the first-order removal change, block influence and measured removal, each checked independently.

- the first-order change is the derivative at t = 0 of t ↦ J(h_out − tΔ): a central difference in t
  (float64, hooks that scale the layer's update) must agree;
- the measured removal equals the loss of a copy with the layer deleted from its ModuleList;
- block influence equals 1 − mean cos over rows computed with numpy.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from depthsat_theory.grow import GrowError  # noqa: E402
from depthsat_theory.grow.prune import prune_candidates  # noqa: E402
from depthsat_theory.tasks.zoo import token_loss_masked  # noqa: E402

V = 61
SITES = ["transformer.h.0", "transformer.h.1", "transformer.h.2"]


def _gpt2():
    """A GPT-2 in float64 (its LayerNorms compute in float64; Llama's RMSNorm rounds through float32)."""
    cfg = transformers.GPT2Config(n_embd=16, n_layer=3, n_head=2, vocab_size=V, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def _batches():
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        ids = torch.randint(0, V, (3, 7), generator=gen)
        labels = torch.full_like(ids, -100)
        labels[:, :-1] = ids[:, 1:]
        labels[0, 4:] = -100  # a shorter example
        out.append(({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels))
    return out


def _mean_loss(model, batches):
    with torch.no_grad():
        ells = [token_loss_masked(model(**x), y) for x, y in batches]
    return float(torch.cat(ells).sum()) / sum(int(e.shape[0]) for e in ells)


def _scaled(model, site, t):
    def hook(_m, args, kwargs, out):
        h_in = args[0] if args else kwargs["hidden_states"]
        h = out[0] if isinstance(out, tuple) else out
        new = h - t * (h - h_in)
        return (new, *out[1:]) if isinstance(out, tuple) else new

    return model.get_submodule(site).register_forward_hook(hook, with_kwargs=True)


def test_first_order_removal_is_the_derivative_and_removal_is_deletion():
    model = _gpt2()
    batches = _batches()
    rk = prune_candidates(model, token_loss_masked, batches, SITES, measure=True)
    j0 = _mean_loss(model, batches)
    assert rk.loss == pytest.approx(j0, rel=1e-14) and rk.n == 6
    eps = 1e-5
    for i, c in enumerate(rk.candidates):
        hs = []
        for t in (eps, -eps):
            h = _scaled(model, c.site, t)
            hs.append(_mean_loss(model, batches))
            h.remove()
        deriv = (hs[0] - hs[1]) / (2 * eps)
        assert c.first_order_change == pytest.approx(deriv, rel=1e-6, abs=1e-10)
        cut = copy.deepcopy(model)
        del cut.transformer.h[i]
        cut.config.num_hidden_layers = 2
        cut.config.use_cache = False  # (the KV cache is indexed by the unrenumbered layer_idx)
        assert c.removal_change == pytest.approx(_mean_loss(cut, batches) - j0, rel=1e-10, abs=1e-12)
    assert len({c.first_order_change for c in rk.candidates}) == 3


def test_block_influence_against_numpy():
    model = _gpt2()
    batches = _batches()
    rk = prune_candidates(model, token_loss_masked, batches, SITES)
    states = {}

    def keep(name):
        def hook(_m, args, kwargs, out):
            states.setdefault(name, []).append(
                ((args[0] if args else kwargs["hidden_states"]).detach().numpy(), out[0].detach().numpy())
                if isinstance(out, tuple)
                else ((args[0] if args else kwargs["hidden_states"]).detach().numpy(), out.detach().numpy())
            )

        return hook

    hs = [model.get_submodule(s).register_forward_hook(keep(s), with_kwargs=True) for s in SITES]
    _mean_loss(model, batches)
    for h in hs:
        h.remove()
    for c in rk.candidates:
        cos = []
        for a, b in states[c.site]:
            a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
            cos.extend((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)))
        assert c.block_influence == pytest.approx(1 - float(np.mean(cos)), rel=1e-12)
        assert c.removal_change is None
    with pytest.raises(GrowError, match="at least one site"):
        prune_candidates(model, token_loss_masked, batches, [])
