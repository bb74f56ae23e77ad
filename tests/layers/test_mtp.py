"""MTP (docs/mtp.md) against an independent reference built here from transformers' own modules.

The reference takes HF's main-model hidden state (the input of its final norm), HF's `Glm5NextTextAttention`
and `Glm5NextTextMoE` for the MTP layer (loaded from the released MTP tensors), and the equations of
docs/mtp.md written out in plain torch. Tolerance: fp32 MTP logits and loss <= 1e-5 relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import glm53_ds
from glm53_ds.config import Glm53Config
from glm53_ds.convert.names import TEXT_PREFIX
from tests.hf_reference import hf_modeling, hf_text_config
from tests.model_fixtures import CONFIG_A, add_mtp_tensors, batch, load_hf_reference, rel_err, save_tiny_hf


@pytest.fixture(scope="module")
def checkpoint_with_mtp(tmp_path_factory):
    """A save_pretrained checkpoint plus random MTP tensors under their released names."""
    path = tmp_path_factory.mktemp("hf_mtp")
    save_tiny_hf(path, CONFIG_A)
    return path, Glm53Config.from_hf(path), add_mtp_tensors(path, seed=7)


def _sub(tensors, prefix):
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def reference_mtp(hf, cfg, mtp_tensors, ids, mask, labels):
    """Independent MTP forward and loss (depth 1) from HF modules and the equations in docs/mtp.md."""
    n = cfg.num_hidden_layers
    p = f"{TEXT_PREFIX}layers.{n}."
    text = hf.model.language_model
    captured = {}
    hook = text.norm.register_forward_pre_hook(lambda _m, args: captured.setdefault("h", args[0]))
    lm_logits = hf(input_ids=ids, attention_mask=mask.long()).logits
    hook.remove()
    h = captured["h"]  # [b, s, D], the stream mean before the final norm

    ext = hf_text_config(**{**CONFIG_A, "num_hidden_layers": n + 1,
                            "layer_types": CONFIG_A["layer_types"] + ["indexed_attention"],
                            "indexer_types": CONFIG_A["indexer_types"] + ["full"],
                            "mlp_layer_types": CONFIG_A["mlp_layer_types"] + ["sparse"]})  # fmt: skip
    ext._attn_implementation = "eager"
    attn = hf_modeling.Glm5NextTextAttention(ext, n).eval()
    attn.load_state_dict(_sub(mtp_tensors, p + "self_attn."))
    moe = hf_modeling.Glm5NextTextMoE(ext)
    m = _sub(mtp_tensors, p + "mlp.")
    experts = range(cfg.n_routed_experts)
    moe.load_state_dict(
        {
            "gate.weight": m["gate.weight"],
            "gate.e_score_correction_bias": m["gate.e_score_correction_bias"],
            "experts.gate_up_proj": torch.stack(
                [
                    torch.cat([m[f"experts.{e}.gate_proj.weight"], m[f"experts.{e}.up_proj.weight"]])
                    for e in experts
                ]
            ),
            "experts.down_proj": torch.stack([m[f"experts.{e}.down_proj.weight"] for e in experts]),
            **{f"shared_experts.{k}": v for k, v in _sub(m, "shared_experts.").items()},
        }
    )

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    next_ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    next_mask = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)
    e = text.embed_tokens(next_ids)
    u = F.linear(torch.cat([rms(e, mtp_tensors[p + "enorm.weight"]), rms(h, mtp_tensors[p + "hnorm.weight"])], -1),
                 mtp_tensors[p + "eh_proj.weight"])  # fmt: skip
    mtp_mask = mask & next_mask
    a = u + attn(hidden_states=rms(u, mtp_tensors[p + "input_layernorm.weight"]), attention_mask=mtp_mask)[0]
    h2 = a + moe(rms(a, mtp_tensors[p + "post_attention_layernorm.weight"]))
    logits = hf.lm_head(rms(h2, mtp_tensors[p + "shared_head.norm.weight"]))
    target = torch.cat([labels[:, 2:], torch.full_like(labels[:, :2], -100)], dim=1)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)
    lm_loss = F.cross_entropy(
        lm_logits[:, :-1].reshape(-1, lm_logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    return logits, loss, lm_loss, mtp_mask


@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_mtp_matches_independent_reference(checkpoint_with_mtp, padding):
    path, cfg, mtp_tensors = checkpoint_with_mtp
    hf = load_hf_reference(path)
    model = glm53_ds.load_hf(str(path)).eval()
    assert model.mtp is not None and len(model.mtp) == 1
    ids, mask, labels = batch(cfg.vocab_size, s=30, padding=padding)
    with torch.no_grad():
        ref_logits, ref_mtp_loss, ref_lm_loss, mtp_mask = reference_mtp(
            hf, cfg, mtp_tensors, ids, mask, labels
        )
        logits = model.mtp_logits(ids, attention_mask=mask)[0]
        parts = model(ids, attention_mask=mask, labels=labels, return_parts=True)
        loss = parts.total
    assert rel_err(logits[mtp_mask], ref_logits[mtp_mask]) <= 1e-5
    assert abs(parts.mtp.item() - ref_mtp_loss.item()) <= 1e-5 * ref_mtp_loss.item()
    assert abs(parts.lm.item() - ref_lm_loss.item()) <= 1e-5 * ref_lm_loss.item()
    expected = ref_lm_loss + cfg.mtp_loss_weight * ref_mtp_loss
    assert rel_err(loss, expected) <= 1e-5


def test_mtp_weights_load_under_released_names(checkpoint_with_mtp):
    path, cfg, mtp_tensors = checkpoint_with_mtp
    model = glm53_ds.load_hf(str(path))
    state = model.state_dict()
    n = cfg.num_hidden_layers
    p = f"{TEXT_PREFIX}layers.{n}."
    assert torch.equal(state["mtp.0.eh_proj.weight"], mtp_tensors[p + "eh_proj.weight"])
    assert torch.equal(state["mtp.0.final_layernorm.weight"], mtp_tensors[p + "shared_head.norm.weight"])
    assert torch.equal(state["mtp.0.transformer_layer.mlp.experts.gate_up_proj"][3, : cfg.moe_intermediate_size],
                       mtp_tensors[p + "mlp.experts.3.gate_proj.weight"])  # fmt: skip
    # without MTP on request, the MTP tensors are skipped
    assert glm53_ds.load_hf(str(path), mtp=False).mtp is None


def test_mtp_loss_weight_is_configurable(checkpoint_with_mtp):
    path, cfg, _ = checkpoint_with_mtp
    model = glm53_ds.load_hf(str(path)).eval()
    ids, mask, labels = batch(cfg.vocab_size, s=20)
    model.glm.mtp_loss_weight = 0.0
    with torch.no_grad():
        parts = model(ids, attention_mask=mask, labels=labels, return_parts=True)
    assert abs(parts.total.item() - parts.lm.item()) <= 1e-6


def test_missing_mtp_requested_is_named(tmp_path):
    save_tiny_hf(tmp_path, CONFIG_A)
    with pytest.raises(ValueError, match=r"missing .*layers\.6\.eh_proj\.weight"):
        glm53_ds.load_hf(str(tmp_path), mtp=True)
