"""The megatron `TransformerConfig` for GLM-5.3, carrying the full `Glm53Config` for the GLM-specific modules.

Megatron's own modules used here (dense `MLP` for the dense FFN and the shared expert, the tensor-parallel
linears, `TransformerBlock`/`TransformerLayer`) read the standard fields; the GLM modules (KDA, DSA/MLA, MoE,
mHC, MTP) read `config.glm`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from . import backends
from .compat.megatron import cuda_graph_whole_layer
from .config import Glm53Config
from .layers.chunked_ce import DEFAULT_CHUNK_BYTES
from .parallel.state import ensure_model_parallel

# Full recompute is refused with the layer losses (tests/layers/test_forward_record.py measures the loss of gradient);
# selective recompute (torch's non-reentrant checkpoint) keeps their graph.
FULL_RECOMPUTE_LOSSES = (
    "megatron's full recompute runs each layer's forward without autograd, so the gradients of the MoE balance "
    "loss and the DSA indexer loss would be lost"
)


@dataclass
class Glm53TransformerConfig(TransformerConfig):
    glm: Glm53Config = field(kw_only=True)  # required: every GLM module reads it
    # Kernel backends (glm53_ds/backends.py); the environment supplies only the defaults.
    attention_impl: str = field(default_factory=lambda: backends.default(backends.ATTENTION))
    kda_impl: str = field(default_factory=lambda: backends.default(backends.KDA))
    hc_post_impl: str = field(default_factory=lambda: backends.default(backends.HC_POST))
    sinkhorn_impl: str = field(default_factory=lambda: backends.default(backends.SINKHORN))
    indexer_impl: str = field(default_factory=lambda: backends.default(backends.INDEXER))
    moe_impl: str = field(default_factory=lambda: backends.default(backends.MOE))
    # Selective recompute of the mHC pre/post (megatron validates recompute_modules against its own list,
    # so "mhc" is carried here; make_transformer_config accepts it inside recompute_modules).
    recompute_mhc: bool = False
    # Sequence-wise auxiliary balance loss weight (DeepSeek-V3); 0 = off. GLM-5.3 balances with the router
    # bias (aux-loss-free); set e.g. cfg.router_aux_loss_coef to add this loss as well.
    moe_seq_aux_loss_coef: float = 0.0
    # Weight of the DSA indexer's own KL loss (docs/indexer_loss.md); 0 = the indexer is frozen (the LM loss gives
    # it no gradient, as in transformers).
    indexer_loss_coef: float = 0.0
    # LM / MTP loss over chunks of tokens: one chunk's fp32 logits stay within this many bytes (layers/chunked_ce.py);
    # 0 = the materialised [tokens, vocab] logits (the reference path).
    loss_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    # Full recompute only: each layer's kept inputs go to host memory in forward and come back one layer ahead of
    # the backward (layers/activation_offload.py); losses and gradients unchanged bitwise.
    offload_activations: bool = False
    # > 0: each MoE layer routes and computes its tokens in tiles whose expert activations stay within this many
    # bytes, each tile recomputed in backward (layers/moe/moe_layer.py); the MoE's peak is one tile's.
    moe_tile_bytes: int = 0
    # Module kinds (layers/block_fp8.py KINDS) whose frozen weights stay in the checkpoint's block-FP8, with its
    # (row, column) block size (quantization_config.weight_block_size): --base-quant fp8. Empty: dense weights.
    block_fp8_modules: tuple[str, ...] = ()
    block_fp8_block: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        if not isinstance(self.glm, Glm53Config):
            raise TypeError(
                f"Glm53TransformerConfig.glm must be a Glm53Config, got {type(self.glm).__name__}"
            )
        for name in backends.CHOICES:
            setattr(self, name, backends.check(name, getattr(self, name)))
        if self.recompute_granularity == "full" and (
            self.moe_seq_aux_loss_coef > 0 or self.indexer_loss_coef > 0
        ):
            raise ValueError(
                f"recompute_granularity='full' with moe_seq_aux_loss_coef={self.moe_seq_aux_loss_coef} / "
                f"indexer_loss_coef={self.indexer_loss_coef}: {FULL_RECOMPUTE_LOSSES}; use "
                "recompute_granularity='selective' (recompute_modules mhc, mlp, moe)"
            )
        if self.moe_tile_bytes < 0 or (self.moe_tile_bytes and self.moe_seq_aux_loss_coef > 0):
            raise ValueError(
                f"moe_tile_bytes={self.moe_tile_bytes}: must be >= 0, and 0 with moe_seq_aux_loss_coef > 0 (the "
                "sequence-wise balance loss needs the whole sequence's routing at once)"
            )
        if self.offload_activations and self.recompute_granularity != "full":
            raise ValueError(
                f"offload_activations with recompute_granularity={self.recompute_granularity!r}: what is offloaded "
                "is what full recompute keeps of each layer; use recompute_granularity='full'"
            )
        super().__post_init__()


def make_transformer_config(
    cfg: Glm53Config, dtype: torch.dtype = torch.float32, mtp: bool = False, **overrides: Any
) -> Glm53TransformerConfig:
    """Megatron config for `cfg`: parameters in `dtype` (HF's fp32-kept tensors stay fp32 regardless).

    `mtp=True` fills megatron's MTP fields (`mtp_num_layers`, `mtp_loss_scaling_factor = cfg.mtp_loss_weight`),
    which a stock `GPTModel(mtp_block_spec=...)` needs (`Glm53Model` runs its MTP itself and ignores them).
    `overrides`: any TransformerConfig field, e.g. `pipeline_model_parallel_size=2`. Sets up a world-1 process
    group and megatron parallel state when none exists, so the config can build modules right away."""
    ensure_model_parallel()
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    fields: dict[str, Any] = dict(
        glm=cfg,
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        kv_channels=cfg.v_head_dim,
        layernorm_epsilon=cfg.rms_norm_eps,
        normalization="RMSNorm",
        # Clamped SwiGLU exactly as HF: gate clamped above, up clamped both sides (megatron mlp.py glu()).
        gated_linear_unit=True,
        activation_func=F.silu,
        activation_func_clamp_value=cfg.swiglu_limit,
        bias_activation_fusion=False,
        add_bias_linear=False,
        bias_dropout_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.initializer_range,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # MoE sizes in megatron's fields (megatron validates expert parallelism against them); the GLM MoE
        # itself reads config.glm.
        num_moe_experts=cfg.n_routed_experts,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_router_topk=cfg.num_experts_per_tok,
        moe_shared_expert_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts or None,
        pipeline_dtype=dtype,  # megatron's p2p buffers, when pipeline_model_parallel_size > 1
        # megatron's default ("full") is deprecated by megatron itself, with a warning on every config; the
        # empty list is its replacement, the same whole-layer scope (the field's name: compat/megatron.py)
        **cuda_graph_whole_layer(),
    )
    if mtp:
        if cfg.num_nextn_predict_layers < 1:
            raise ValueError("mtp=True but the config has num_nextn_predict_layers = 0")
        fields.update(
            mtp_num_layers=cfg.num_nextn_predict_layers, mtp_loss_scaling_factor=cfg.mtp_loss_weight
        )
    modules = list(overrides.pop("recompute_modules", None) or [])
    if "mhc" in modules:
        modules.remove("mhc")
        fields["recompute_mhc"] = True
    if modules:
        fields["recompute_modules"] = modules
    elif fields.get("recompute_mhc"):
        fields["recompute_modules"] = []
    fields.update(overrides)
    return Glm53TransformerConfig(**fields)
