"""Access to the oracle: `transformers==5.23.0` glm5_next, built with tiny configs in-process (no downloads)."""

from __future__ import annotations

from typing import Any

from transformers.models.glm5_next import modeling_glm5_next as hf_modeling
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig


def hf_text_config(**fields: Any) -> Glm5NextTextConfig:
    """A tiny valid HF text config; `fields` override."""
    base: dict[str, Any] = dict(
        vocab_size=128,
        pad_token_id=0,
        hidden_size=32,
        num_hidden_layers=4,
        intermediate_size=64,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_nope_head_dim=8,
        v_head_dim=8,
        index_topk=8,
        index_kpool=4,
        index_head_dim=8,
        index_n_heads=2,
        linear_head_dim=8,
        linear_num_heads=2,
    )
    base.update(fields)
    return Glm5NextTextConfig(**base)


__all__ = ["hf_modeling", "hf_text_config"]
