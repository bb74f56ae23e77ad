"""Activation recompute keeps numerics identical (and really recomputes); the public spec functions build
layers inside plain megatron-core code."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_block import TransformerBlock

import glm53_ds
from glm53_ds.config import Glm53Config
from glm53_ds.layers.kda import KimiDeltaAttention
from glm53_ds.layers.lora import LoraSpec, is_lora_param
from glm53_ds.layers.lora_targets import apply_lora
from glm53_ds.layers.mla import SparseMLA
from glm53_ds.layers.moe import Glm53MoE
from glm53_ds.layers.norm import StreamMeanRMSNorm
from glm53_ds.specs import get_glm53_block_spec, get_glm53_layer_spec, get_glm53_mtp_block_spec
from glm53_ds.transformer_config import make_transformer_config
from glm53_ds.transformer_layer import Glm53TransformerLayer
from tests.model_fixtures import CONFIG_A

CFG = Glm53Config.from_text_dict(CONFIG_A)
RECOMPUTE = {
    "full-uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
    "selective-mhc-mlp": dict(recompute_granularity="selective", recompute_modules=["mhc", "mlp", "moe"]),
    "selective-mhc": dict(recompute_granularity="selective", recompute_modules=["mhc"]),
}


# The padded batch runs the sparse attention path (the default off CUDA). Its queries allowed nothing (padding rows)
# took HF's gradient through rows found on the host (nonzero, index_put) until issue 27; recompute then differed by
# 1e-12..1e-9 absolute in the latent's gradient. The closed form (`blind_rows._BlindRows`) is bitwise.
PADDED_ATTENTION = "sparse"


def _loss_and_grads(model, counters, padded=True):
    model.train()
    ids = torch.randint(1, CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids, dtype=torch.bool)
    if padded:
        mask[0, :3] = False
    counters.clear()
    loss = model(ids, attention_mask=mask, labels=ids.masked_fill(~mask, -100))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _count_calls(model, counters):
    layer = model.decoder.layers[3]
    modules = [("attention", layer.self_attention), ("attn_hc", layer.attn_hc), ("mlp", layer.mlp),
               ("mtp", model.mtp[0].transformer_layer.self_attention)]  # fmt: skip
    for name, module in modules:
        module.register_forward_pre_hook(lambda *_, n=name: counters.__setitem__(n, counters.get(n, 0) + 1))


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    model = glm53_ds.build_model(CFG, mtp=True, attention_impl=PADDED_ATTENTION)
    counters: dict[str, int] = {}
    _count_calls(model, counters)
    loss, grads = _loss_and_grads(model, counters)
    assert counters == {"attention": 1, "attn_hc": 1, "mlp": 1, "mtp": 1}
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    return state, loss, grads


@pytest.mark.parametrize("mode", ["full-uniform", "selective-mhc-mlp"])
def test_sparse_attention_recompute_is_bitwise_without_padding(mode):
    torch.manual_seed(0)
    ref = glm53_ds.build_model(CFG, mtp=True, attention_impl="sparse")
    ref_loss, ref_grads = _loss_and_grads(ref, {}, padded=False)
    state = {k: v for k, v in ref.state_dict().items() if not k.endswith("_extra_state")}
    model = glm53_ds.build_model(CFG, mtp=True, attention_impl="sparse", **RECOMPUTE[mode])
    model.load_state_dict(state, strict=False)
    loss, grads = _loss_and_grads(model, {}, padded=False)
    assert torch.equal(loss, ref_loss)
    for n in grads:
        assert torch.equal(grads[n], ref_grads[n]), n


@pytest.mark.parametrize("mode", sorted(RECOMPUTE))
def test_recompute_is_bitwise_identical_and_recomputes(reference, mode):
    state, ref_loss, ref_grads = reference
    model = glm53_ds.build_model(CFG, mtp=True, attention_impl=PADDED_ATTENTION, **RECOMPUTE[mode])
    model.load_state_dict(state, strict=False)
    counters: dict[str, int] = {}
    _count_calls(model, counters)
    loss, grads = _loss_and_grads(model, counters)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        assert torch.equal(grads[n], ref_grads[n]), n
    expected = {  # full recompute covers the MTP layer too (either method; before: never recomputed)
        "full-uniform": {"attention": 2, "attn_hc": 2, "mlp": 2, "mtp": 2},
        "full-block": {"attention": 1, "attn_hc": 1, "mlp": 1, "mtp": 2},  # layer 3: outside the first 3
        "selective-mhc-mlp": {"attention": 1, "attn_hc": 2, "mlp": 2, "mtp": 1},
        "selective-mhc": {"attention": 1, "attn_hc": 2, "mlp": 1, "mtp": 1},
    }[mode]
    assert counters == expected


def test_layer_specs_choose_modules_by_schedule():
    for number in range(1, CFG.num_hidden_layers + 1):
        spec = get_glm53_layer_spec(CFG, number)
        sub = spec.submodules
        assert spec.module is Glm53TransformerLayer
        linear = CFG.layer_types[number - 1] == "linear_attention"
        assert sub.self_attention.module is (KimiDeltaAttention if linear else SparseMLA)
        assert (sub.mlp is Glm53MoE) == (CFG.mlp_layer_types[number - 1] == "sparse")
        assert sub.attn_hc.params["norm_eps"] == sub.ffn_hc.params["norm_eps"] == CFG.rms_norm_eps
    mtp = get_glm53_layer_spec(CFG, CFG.num_hidden_layers + 1).submodules
    assert mtp.attn_hc is None and mtp.ffn_hc is None and mtp.mlp is Glm53MoE
    assert len(get_glm53_mtp_block_spec(CFG).layer_specs) == 1
    with pytest.raises(ValueError, match="layer_number 0 is outside"):
        get_glm53_layer_spec(CFG, 0)


def test_block_spec_in_plain_megatron_block():
    """A user's own megatron code: TransformerBlock from the exported spec maps [s, b, h] -> [s, b, h] (the streams
    live inside the block: expanded by the first layer, averaged by the block's final norm)."""
    config = make_transformer_config(CFG)
    block = TransformerBlock(config, get_glm53_block_spec(CFG))
    assert len(block.layers) == CFG.num_hidden_layers
    assert isinstance(block.final_layernorm, StreamMeanRMSNorm)
    x = torch.randn(12, 2, CFG.hidden_size)
    out = block(x, attention_mask=torch.ones(2, 12, dtype=torch.bool))
    assert out.shape == x.shape
    packed = TransformerBlock(config, get_glm53_block_spec(CFG), post_layer_norm=False)(
        x, attention_mask=None
    )
    assert packed.shape == (12 * CFG.hc_mult, 2, CFG.hidden_size)  # streams, packed for megatron's p2p
    layer = build_module(get_glm53_layer_spec(config, 1), config=config, layer_number=1)
    assert isinstance(layer, Glm53TransformerLayer) and layer.uses_mhc


@pytest.mark.parametrize("mode", ["full-uniform", "selective-mhc-mlp"])
def test_lora_under_recompute_is_bitwise_identical(reference, mode):
    """LoRA adapters (their forward hooks, the grouped expert GEMMs, MLA's absorbed kv_b_proj) recomputed: loss and
    every adapter gradient bitwise those of the run without recompute. Control: other adapter values differ.
    Before: under full recompute the decoder's adapters got no gradient at all (the frozen embedding's output has
    none, and megatron's reentrant checkpoint then returns outputs without one); the frozen base no longer hides
    that."""
    state = reference[0]
    spec = LoraSpec(rank=2, alpha=4.0)
    results = []
    for recompute, seed in ((None, 5), (mode, 5), (mode, 6)):
        model = glm53_ds.build_model(
            CFG, mtp=True, attention_impl=PADDED_ATTENTION, **RECOMPUTE.get(recompute or "", {})
        )
        model.load_state_dict(state, strict=False)
        apply_lora(model, spec)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # B nonzero: the adapters change the model and get A gradients too
            for name, p in model.named_parameters():
                p.requires_grad_(is_lora_param(name))
                if is_lora_param(name):
                    p.copy_(0.2 * torch.randn(p.shape, generator=g))
        loss, grads = _loss_and_grads(model, {})
        results.append((loss, grads))
    (loss, grads), (again, regrads), (other, _) = results
    assert grads and all(is_lora_param(n) for n in grads)
    assert torch.equal(loss, again) and not torch.equal(loss, other)
    for n in grads:
        assert torch.equal(grads[n], regrads[n]), n
