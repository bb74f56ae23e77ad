"""Named model configurations for `--model-config`.

- `tiny`: a few-hundred-thousand-parameter GLM-5.3 (KDA x3 + DSA, dense + MoE, mHC, MTP) for CPU smoke runs,
  with a byte-level vocabulary (256 bytes + end-of-document + padding).
- `glm-5.3-flash`: the released architecture (transformers' `Glm5NextTextConfig` defaults).
"""

from __future__ import annotations

from ..config import Glm53Config

BYTE_VOCAB = 256 + 2  # bytes, then <eod> = 256, <pad> = 257


def tiny() -> Glm53Config:
    return Glm53Config(
        vocab_size=BYTE_VOCAB,
        pad_token_id=257,
        eos_token_id=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "indexed_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        indexer_types=["full"] * 4,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_topk=32,
        index_kpool=8,
        index_head_dim=16,
        index_n_heads=2,
        linear_head_dim=16,
        linear_num_heads=2,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        hc_mult=4,
        max_position_embeddings=4096,
        num_nextn_predict_layers=1,
    )


def glm53_flash() -> Glm53Config:
    return Glm53Config()


PRESETS = {"tiny": tiny, "glm-5.3-flash": glm53_flash}

# Router-bias update rate (aux-loss-free balancing) when --router-bias-update-rate is not given. 1e-3 is
# DeepSeek-V3's rate for batches of millions of tokens. The tiny preset's 128-token batches collapse to two
# experts within 10 steps and stay there at 1e-3 (max/mean load 4.0 of a possible 4.0 at step 60 of the README
# job); 1e-2 brings them back (1.6-2.1 from step 40, final LM loss 2.62 instead of 2.66).
DEFAULT_ROUTER_BIAS_UPDATE_RATE = 1e-3
PRESET_ROUTER_BIAS_UPDATE_RATE = {"tiny": 1e-2}


def preset(name: str) -> Glm53Config:
    if name not in PRESETS:
        raise ValueError(f"--model-config {name!r}: not a file and not a preset; presets: {sorted(PRESETS)}")
    return PRESETS[name]()


def named_config(name: str) -> Glm53Config:
    """What `--model-config NAME` names: a preset's config, or a config.json's (the trainer and the planner)."""
    return preset(name) if name in PRESETS else Glm53Config.from_hf(name)
