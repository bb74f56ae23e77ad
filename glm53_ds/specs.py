"""Megatron layer specs for GLM-5.3-Flash, for use in any megatron-core model.

    from glm53_ds.specs import get_glm53_block_spec
    block = TransformerBlock(transformer_config, get_glm53_block_spec(cfg), post_layer_norm=False)

`layer_number` is 1-based, as megatron numbers layers; the MTP layer is `num_hidden_layers + 1` (checkpoint
index `num_hidden_layers`). Decoder layers carry mHC streams `[s, b, hc_mult, h]`; the MTP layer does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from .config import Glm53Config
from .layers.kda import KimiDeltaAttention
from .layers.mla import SparseMLA
from .layers.moe import Glm53MoE
from .layers.mtp import Glm53MtpLayer, Glm53MtpSubmodules
from .layers.norm import RMSNorm
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
        module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
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
    return ModuleSpec(module=Glm53TransformerLayer, submodules=submodules)


def get_glm53_block_spec(config: Glm53Config | Glm53TransformerConfig) -> TransformerBlockSubmodules:
    """All decoder layers; the block's final norm is left to the model (the streams are averaged first)."""
    cfg = _glm(config)
    return TransformerBlockSubmodules(
        layer_specs=[get_glm53_layer_spec(cfg, i + 1) for i in range(cfg.num_hidden_layers)], layer_norm=None
    )


@dataclass
class Glm53MtpBlockSubmodules:
    layer_specs: list[ModuleSpec] = field(default_factory=list)


def get_glm53_mtp_block_spec(config: Glm53Config | Glm53TransformerConfig) -> Glm53MtpBlockSubmodules:
    """One MTP module per prediction depth (GLM-5.3-Flash has one)."""
    cfg = _glm(config)
    n = cfg.num_hidden_layers
    return Glm53MtpBlockSubmodules(
        layer_specs=[
            ModuleSpec(
                module=Glm53MtpLayer,
                params=dict(depth=d + 1),
                submodules=Glm53MtpSubmodules(transformer_layer=get_glm53_layer_spec(cfg, n + d + 1)),
            )
            for d in range(cfg.num_nextn_predict_layers)
        ]
    )
