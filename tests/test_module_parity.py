"""Per-module parity with transformers' glm5_next, so that a failure points at one module.

Both models are loaded from one tiny checkpoint (CONFIG_A) and each module pair is fed the same input.
Tolerances (fp32): outputs and input gradients <= 1e-5 relative; DSA indexer selections and router top-k sets
exactly equal; router weights <= 1e-6.
"""

from __future__ import annotations

import pytest
import torch

import glm53_ds
from tests.model_fixtures import CONFIG_A, load_hf_reference, rel_err, save_tiny_hf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_modules")
    save_tiny_hf(path, CONFIG_A)
    hf = load_hf_reference(path)
    return hf.model.language_model, glm53_ds.load_hf(str(path)).eval()


def _inputs(b=2, s=40, d=32, padding=None, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, d, generator=g) * scale
    mask = torch.ones(b, s, dtype=torch.bool)
    if padding == "left":
        mask[0, :7] = False
    elif padding == "right":
        mask[1, -9:] = False
    return x, mask


def _compare(hf_fn, our_fn, x, tol=1e-5):
    """Outputs and input gradients of hf_fn([b, s, D]) and our_fn([s, b, D])."""
    x_hf = x.clone().requires_grad_(True)
    x_ours = x.clone().transpose(0, 1).requires_grad_(True)
    ref = hf_fn(x_hf)
    out = our_fn(x_ours).transpose(0, 1)
    assert rel_err(out, ref) <= tol, rel_err(out, ref)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
    ref.backward(g)
    out.backward(g)
    assert rel_err(x_ours.grad.transpose(0, 1), x_hf.grad) <= tol


@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_kda(models, padding):
    hf, ours = models
    x, mask = _inputs(padding=padding)
    hf_mask = None if padding is None else mask
    _compare(
        lambda t: hf.layers[0].self_attn(hidden_states=t, attention_mask=hf_mask),
        lambda t: ours.decoder.layers[0].self_attention(t, attention_mask=mask)[0],
        x,
    )


@pytest.mark.parametrize("padding", [None, "left", "right"])
@pytest.mark.parametrize("layer", [1, 4])
@pytest.mark.parametrize("block_bytes", [None, 1])
def test_indexer_selection_exactly_equal(models, padding, layer, block_bytes, monkeypatch):
    """Equal to HF's selection, also streamed one query row per block (block_bytes=1)."""
    hf, ours = models
    x, mask = _inputs(padding=padding, seed=layer)
    hf_attn, our_attn = hf.layers[layer].self_attn, ours.decoder.layers[layer].self_attention
    if block_bytes is not None:
        monkeypatch.setattr(our_attn.indexer, "score_block_bytes", block_bytes)
        assert our_attn.indexer.block_rows(x.shape[0], 8, x.device) == 1
    with torch.no_grad():
        q_resid = hf_attn.q_a_layernorm(hf_attn.q_a_proj(x))
        ref = hf_attn.indexer(hidden_states=x, q_resid=q_resid, attention_mask=mask, past_key_values=None)
        got = our_attn.indexer(x, q_resid, mask)
    assert got.dtype == ref.dtype == torch.int32
    assert torch.equal(got, ref)
    # sparse selection is really active: some valid query sees fewer keys than are visible to it
    visible = mask.long().cumsum(-1)
    assert bool(((got >= 0).sum(-1) < visible)[mask].any())


@pytest.mark.parametrize("padding", [None, "left"])
def test_mla_full_and_shared(models, padding):
    hf, ours = models
    x, mask = _inputs(padding=padding, seed=11)
    ref_out, _, ref_topk = hf.layers[1].self_attn(hidden_states=x, attention_mask=mask)
    out, topk = ours.decoder.layers[1].self_attention(x.transpose(0, 1), attention_mask=mask)
    assert rel_err(out.transpose(0, 1), ref_out) <= 1e-5
    assert torch.equal(topk, ref_topk)  # handed on to the shared layer 2
    # the shared layer reuses it
    _compare(
        lambda t: hf.layers[2].self_attn(hidden_states=t, attention_mask=mask, prev_topk_indices=ref_topk)[0],
        lambda t: ours.decoder.layers[2].self_attention(t, attention_mask=mask, shared_topk=topk)[0],
        x,
    )
    with pytest.raises(ValueError, match="layer 2: a 'shared' DSA layer needs"):
        ours.decoder.layers[2].self_attention(x.transpose(0, 1), attention_mask=mask)


def test_router_topk_and_weights(models):
    hf, ours = models
    x, _ = _inputs(s=50, seed=4)
    tokens = x.reshape(-1, 32)
    with torch.no_grad():
        _, ref_w, ref_idx = hf.layers[3].mlp.gate(tokens)
        _, w, idx = ours.decoder.layers[3].mlp.router(tokens)
    ref_order, order = ref_idx.sort(-1), idx.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    assert rel_err(w.gather(1, order.indices), ref_w.gather(1, ref_order.indices)) <= 1e-6
    # grouped routing is active: every token's experts lie in one group of 4 (n_group=2, topk_group=1)
    assert bool((idx // 4 == idx[:, :1] // 4).all())


def test_dense_mlp_with_active_clamp(models):
    hf, ours = models
    x, _ = _inputs(scale=3.0, seed=6)
    with torch.no_grad():
        pre = hf.layers[0].mlp.up_proj(x)
    assert bool((pre.abs() > CONFIG_A["swiglu_limit"]).any())  # the clamp changes values
    _compare(lambda t: hf.layers[0].mlp(t), lambda t: ours.decoder.layers[0].mlp(t)[0], x)


def test_moe_block(models):
    hf, ours = models
    x, _ = _inputs(scale=2.0, seed=8)
    _compare(lambda t: hf.layers[3].mlp(t), lambda t: ours.decoder.layers[3].mlp(t)[0], x)
