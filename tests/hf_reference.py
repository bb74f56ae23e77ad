"""Access to the oracle: `transformers==5.23.0` glm5_next, built with tiny configs in-process (no downloads)."""

from __future__ import annotations

from typing import Any

from transformers.models.glm5_next import modeling_glm5_next as hf_modeling
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

# The smallest sizes that exercise every GLM-5.3 module; tests add the fields they care about.
BASE_TEXT: dict[str, Any] = dict(
    vocab_size=96,
    pad_token_id=0,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_nope_head_dim=8,
    v_head_dim=8,
    index_head_dim=8,
    index_n_heads=2,
    linear_head_dim=8,
    linear_num_heads=2,
    rms_norm_eps=1e-5,
)
# Four layers (KDA x3, DSA), one MoE layer with four experts.
TINY_TEXT: dict[str, Any] = dict(BASE_TEXT, num_hidden_layers=4, n_routed_experts=4, num_experts_per_tok=2,
                                 index_topk=8, index_kpool=4)  # fmt: skip
VISION: dict[str, Any] = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32,
                              projection_intermediate_size=32)  # fmt: skip


def hf_text_config(**fields: Any) -> Glm5NextTextConfig:
    """A tiny valid HF text config (TINY_TEXT); `fields` override."""
    return Glm5NextTextConfig(**{**TINY_TEXT, **fields})


__all__ = ["BASE_TEXT", "TINY_TEXT", "VISION", "hf_modeling", "hf_text_config"]
