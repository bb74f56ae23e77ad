"""Multi-token prediction module (DeepSeek-V3 style), stored at checkpoint layer index `num_hidden_layers`.

For prediction depth k (GLM-5.3-Flash: k = 1) and position t:
    e_t   = Embedding(x_{t+k})                       (shared with the main model)
    u_t   = eh_proj([enorm(e_t); hnorm(h_t)])        (concatenation along features: [2D] -> [D])
    h'_t  = TransformerLayer(u)_t                    (DSA attention + MoE, pre-norm residual, no mHC)
    logits_t = OutputLayer(shared_head.norm(h'_t))   (output layer shared with the main model)
predicting x_{t+k+1}. `h` is the previous depth's h' (for k = 1: the main model's stream mean before its final
norm). Positions whose x_{t+k} lies past the sequence or on padding see a padding mask there and are left out
of the loss. The exact equations and loss are in docs/mtp.md; `predict` computes them (`Glm53Model` calls it).

The same layer also runs inside megatron's `MultiTokenPredictionBlock` (`GPTModel(mtp_block_spec=...)`): `forward`
has megatron's MTP-layer signature. megatron's wiring differs from docs/mtp.md in what it feeds the layer, not in
the layer: `h` for depth 1 is the decoder output *after* the final norm (`GPTModel._postprocess` hands the block
output to the MTP block), and a deeper module receives the previous depth's normed output; the loss is megatron's
(docs/usage.md). The padding rule (m_t and m_{t+k}) is applied here on both paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import nn

from ..compat.megatron import MTP_LAYER_RETURNS_PADDING_MASK
from ..transformer_config import Glm53TransformerConfig
from .documents import Documents
from .linear import ColumnLinear
from .masks import token_mask
from .norm import RMSNorm


@dataclass
class Glm53MtpSubmodules:
    transformer_layer: ModuleSpec | None = None


class Glm53MtpLayer(nn.Module):
    def __init__(
        self,
        config: Glm53TransformerConfig,
        submodules: Glm53MtpSubmodules,
        layer_number: int = 1,
        vp_stage: int | None = None,
        pg_collection: Any = None,
        standalone: bool = False,
        mtp_layer_pattern: Any = None,
        name: str | None = None,
    ) -> None:
        """`layer_number`: the prediction depth k (1-based), as megatron's MultiTokenPredictionBlock numbers it.
        `standalone`: built by `Glm53Model` (which calls `predict`), not by megatron's MTP block.
        `mtp_layer_pattern`, `name`: what megatron-core >= 0.19's MTP block passes every layer (a hybrid model's
        layer pattern, the module's name; compat/megatron.py); the GLM MTP layer has one structure."""
        super().__init__()
        cfg = config.glm
        if submodules.transformer_layer is None:
            raise ValueError("Glm53MtpLayer needs submodules.transformer_layer")
        if not standalone and config.mtp_num_layers is None:
            # GPTModel(mtp_block_spec=...) on a config built without mtp=True: megatron reads these two fields only
            # when it runs the MTP block (GPTModel._postprocess), so the spec's layer fills them in, as
            # make_transformer_config(cfg, mtp=True) would have. The decoder, built before, does not read them
            # without pipeline parallelism (with it, pass mtp=True: the final norm's stage depends on them).
            config.mtp_num_layers = cfg.num_nextn_predict_layers
            config.mtp_loss_scaling_factor = cfg.mtp_loss_weight
        if not standalone and config.mtp_num_layers != cfg.num_nextn_predict_layers:
            raise ValueError(
                f"GPTModel(mtp_block_spec=...) needs config.mtp_num_layers = {cfg.num_nextn_predict_layers} "
                f"(megatron reads it to split the MTP outputs), got {config.mtp_num_layers}: build the config with "
                f"glm53_ds.make_transformer_config(cfg, dtype, mtp=True)"
            )
        depth = layer_number
        self.depth = depth
        if pg_collection is not None and not hasattr(pg_collection, "tp"):
            pg_collection = (
                None  # megatron's MTP block passes only its CP group: the layer takes megatron's groups
            )
        d = cfg.hidden_size
        self.enorm = RMSNorm(config, d, eps=cfg.rms_norm_eps)
        self.hnorm = RMSNorm(config, d, eps=cfg.rms_norm_eps)
        self.eh_proj = ColumnLinear(config, 2 * d, d)
        self.transformer_layer = build_module(
            submodules.transformer_layer,
            config=config,
            layer_number=cfg.num_hidden_layers + depth,
            pg_collection=pg_collection,
        )
        self.final_layernorm = RMSNorm(config, d, eps=cfg.rms_norm_eps)  # released name: shared_head.norm

    def predict(
        self,
        hidden: torch.Tensor,
        next_embedding: torch.Tensor,
        attention_mask: torch.Tensor,
        packed_seq_params: PackedSeqParams | None = None,
        trailing_padding: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """docs/mtp.md: hidden, next_embedding [s, b, D]; attention_mask [b, s] bool, already m_t and m_{t+k} (and,
        for packed documents, t + k in t's document) -> (h' [s, b, D], normed h' for the head). `trailing_padding`:
        the caller knows the mask is exactly the last k positions of every document (no padding in the batch)."""
        u = self.eh_proj(torch.cat([self.enorm(next_embedding), self.hnorm(hidden)], dim=-1))
        h, _ = self.transformer_layer(
            u,
            attention_mask=attention_mask,
            packed_seq_params=packed_seq_params,
            trailing_padding=trailing_padding,
        )
        return h, self.final_layernorm(h)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        embedding: Any = None,
        padding_mask: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
        **unused: Any,
    ) -> tuple[torch.Tensor | None, ...]:
        """megatron's MTP-layer interface: input_ids / position_ids [b, s] of the previous depth (rolled here by
        one), hidden_states [s, b, D], embedding: GPTModel's. Returns (normed h', rolled ids, rolled positions), and
        the padding mask as given where megatron's block expects it back (compat/megatron.py)."""
        b, s = input_ids.shape
        next_ids = shift_left(input_ids, 1)
        next_positions = shift_left(position_ids, 1) if position_ids is not None else None
        tokens = token_mask(attention_mask, padding_mask, b, s)
        if tokens is None:
            tokens = torch.ones(b, s, dtype=torch.bool, device=input_ids.device)
        mask = tokens & shift_left(tokens, self.depth)  # m_t and m_{t+k}, k = this depth
        if packed_seq_params is not None:
            documents = Documents.from_packed_seq_params(packed_seq_params, s, b)
            mask = mask & documents.same_document(self.depth, mask.device)[None]
        next_embedding = embedding(input_ids=next_ids, position_ids=next_positions)
        _, normed = self.predict(hidden_states, next_embedding, mask, packed_seq_params)
        if MTP_LAYER_RETURNS_PADDING_MASK:  # unrolled: each depth shifts the block's mask by its own depth
            return normed, next_ids, next_positions, padding_mask
        return normed, next_ids, next_positions


def shift_left(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, t + k] along dim 1, positions past the end filled with 0 / False."""
    out = torch.zeros_like(x)
    if k < x.shape[1]:
        out[:, :-k] = x[:, k:]
    return out
