"""Megatron layer specs for GLM-5.3-Flash: the whole decoder, for a stock megatron-core `GPTModel`.

    tconfig = glm53_ds.make_transformer_config(cfg, dtype)
    model = GPTModel(tconfig, get_glm53_block_spec(cfg), vocab_size=cfg.vocab_size, max_sequence_length=S,
                     position_embedding_type="none", mtp_block_spec=get_glm53_mtp_block_spec(cfg))  # MTP optional

The block spec owns the mHC stream lifecycle: its first layer expands the embedding `[s, b, h]` into hc_mult
streams, the layers hand the streams on packed as `[s*hc_mult, b, h]`, and its `layer_norm` (the block's final
norm) averages them and applies the final RMSNorm, so the block maps `[s, b, h] -> [s, b, h]` like any megatron
decoder. `layer_number` is 1-based, as megatron numbers layers; the MTP layer is `num_hidden_layers + 1`
(checkpoint index `num_hidden_layers`). Pipeline stages: `get_glm53_block_spec(tconfig, pp_rank=r)` returns the
layers of stage r (megatron's split rules); docs/usage.md has the rest.
"""

from __future__ import annotations

from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlockSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from .config import Glm53Config
from .layers.kda import KimiDeltaAttention
from .layers.linear import RowParallelLinearWithGroup
from .layers.mla import SparseMLA
from .layers.moe import Glm53MoE
from .layers.mtp import Glm53MtpLayer, Glm53MtpSubmodules
from .layers.norm import RMSNorm, StreamMeanRMSNorm
from .mhc import HyperConnection
from .transformer_config import Glm53TransformerConfig
from .transformer_layer import Glm53LayerSubmodules, Glm53TransformerLayer


def _glm(config: Glm53Config | Glm53TransformerConfig) -> Glm53Config:
    if isinstance(config, Glm53TransformerConfig):
        if config.glm is None:
            raise ValueError("Glm53TransformerConfig.glm is not set")
        return config.glm
    return config


def _hyper_connection_spec(cfg: Glm53Config) -> ModuleSpec:
    return ModuleSpec(
        module=HyperConnection,
        params=dict(
            hidden_size=cfg.hidden_size,
            hc_mult=cfg.hc_mult,
            hc_eps=cfg.hc_eps,
            sinkhorn_iters=cfg.hc_sinkhorn_iters,
            norm_eps=cfg.rms_norm_eps,  # the text rms_norm_eps at every mHC site, never hc_eps
        ),
    )


def _dense_mlp_spec() -> ModuleSpec:
    return ModuleSpec(
        module=MLP,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinearWithGroup),
    )


def get_glm53_layer_spec(config: Glm53Config | Glm53TransformerConfig, layer_number: int) -> ModuleSpec:
    """Spec of decoder layer `layer_number` (1-based), or of the MTP layer (`num_hidden_layers + 1` and up)."""
    cfg = _glm(config)
    index = layer_number - 1
    n = cfg.num_hidden_layers
    if index < 0 or index >= n + cfg.num_nextn_predict_layers:
        raise ValueError(
            f"layer_number {layer_number} is outside 1..{n + cfg.num_nextn_predict_layers} "
            f"({n} decoder layers + {cfg.num_nextn_predict_layers} MTP)"
        )
    is_mtp = index >= n
    linear = not is_mtp and cfg.layer_types[index] == "linear_attention"
    sparse = is_mtp or cfg.mlp_layer_types[index] == "sparse"
    submodules = Glm53LayerSubmodules(
        input_layernorm=RMSNorm,
        self_attention=ModuleSpec(module=KimiDeltaAttention)
        if linear
        else ModuleSpec(module=SparseMLA, params=dict(layer_index=index)),
        pre_mlp_layernorm=RMSNorm,
        mlp=Glm53MoE if sparse else _dense_mlp_spec(),
        attn_hc=None if is_mtp else _hyper_connection_spec(cfg),
        ffn_hc=None if is_mtp else _hyper_connection_spec(cfg),
    )
    params = dict(expands_streams=True) if index == 0 else {}
    return ModuleSpec(module=Glm53TransformerLayer, params=params, submodules=submodules)


def get_glm53_block_spec(
    config: Glm53Config | Glm53TransformerConfig, vp_stage: int | None = None, pp_rank: int | None = None
) -> TransformerBlockSubmodules:
    """The decoder layers of one pipeline stage (all of them without pipeline parallelism) and the final
    stream-mean + RMSNorm as the block's `layer_norm`.

    A `Glm53TransformerConfig` with `pipeline_model_parallel_size > 1` selects stage `pp_rank` (default: megatron's
    current pipeline rank) by megatron's own split (`num_layers_in_first/last_pipeline_stage`, layouts). A stage may
    not begin with a 'shared' DSA layer: its top-k selection comes from the previous layer, and megatron's
    pipeline sends only the hidden states."""
    cfg = _glm(config)
    specs = [get_glm53_layer_spec(cfg, i + 1) for i in range(cfg.num_hidden_layers)]
    if isinstance(config, Glm53TransformerConfig) and config.pipeline_model_parallel_size > 1:
        offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
        count = get_num_layers_to_build(config, vp_stage, pp_rank)
        _check_stage_start(cfg, offset, count)
        specs = specs[offset : offset + count]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=StreamMeanRMSNorm)


def _check_stage_start(cfg: Glm53Config, offset: int, count: int) -> None:
    """Refuse a stage that starts with a 'shared' DSA layer (its selection comes from the previous layer, which
    then sits on the previous stage; the config guarantees a shared layer directly follows a full one)."""
    i = offset
    if count > 0 and cfg.layer_types[i] == "indexed_attention" and cfg.indexer_types[i] == "shared":
        raise ValueError(
            f"pipeline split: a stage starts at layer {i} (0-based), a 'shared' DSA layer that reuses layer "
            f"{i - 1}'s top-k selection, which megatron's pipeline does not send; move the split "
            f"(num_layers_in_first_pipeline_stage / pipeline_model_parallel_layout) so that no stage starts "
            f"with a 'shared' layer"
        )


def get_glm53_mtp_block_spec(
    config: Glm53Config | Glm53TransformerConfig,
) -> MultiTokenPredictionBlockSubmodules:
    """megatron's `MultiTokenPredictionBlock` spec: one GLM MTP layer per prediction depth (GLM-5.3-Flash: one).
    `GPTModel(mtp_block_spec=...)` needs `make_transformer_config(cfg, mtp=True)`; layers/mtp.py says where
    megatron's MTP wiring differs from docs/mtp.md."""
    cfg = _glm(config)
    n = cfg.num_hidden_layers
    return MultiTokenPredictionBlockSubmodules(
        layer_specs=[
            ModuleSpec(
                module=Glm53MtpLayer,
                submodules=Glm53MtpSubmodules(transformer_layer=get_glm53_layer_spec(cfg, n + d + 1)),
            )
            for d in range(cfg.num_nextn_predict_layers)
        ]
    )
