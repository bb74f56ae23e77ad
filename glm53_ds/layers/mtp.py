"""Multi-token prediction module (DeepSeek-V3 style), stored at checkpoint layer index `num_hidden_layers`.

For prediction depth k (GLM-5.3-Flash: k = 1) and position t:
    e_t   = Embedding(x_{t+k})                       (shared with the main model)
    u_t   = eh_proj([enorm(e_t); hnorm(h_t)])        (concatenation along features: [2D] -> [D])
    h'_t  = TransformerLayer(u)_t                    (DSA attention + MoE, pre-norm residual, no mHC)
    logits_t = OutputLayer(shared_head.norm(h'_t))   (output layer shared with the main model)
predicting x_{t+k+1}. `h` is the previous depth's h' (for k = 1: the main model's stream mean before its final
norm). Positions whose x_{t+k} lies past the sequence or on padding see a padding mask there and are left out
of the loss. The exact equations and loss are in docs/mtp.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import nn

from ..transformer_config import Glm53TransformerConfig
from .linear import ColumnLinear
from .norm import RMSNorm


@dataclass
class Glm53MtpSubmodules:
    transformer_layer: ModuleSpec | None = None


class Glm53MtpLayer(nn.Module):
    def __init__(
        self,
        config: Glm53TransformerConfig,
        submodules: Glm53MtpSubmodules,
        depth: int = 1,
        pg_collection: Any = None,
    ) -> None:
        super().__init__()
        cfg = config.glm
        if submodules.transformer_layer is None:
            raise ValueError("Glm53MtpLayer needs submodules.transformer_layer")
        self.depth = depth
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

    def forward(
        self, hidden: torch.Tensor, next_embedding: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, next_embedding [s, b, D]; attention_mask [b, s] -> (h' [s, b, D], normed h' for the head)."""
        u = self.eh_proj(torch.cat([self.enorm(next_embedding), self.hnorm(hidden)], dim=-1))
        h, _ = self.transformer_layer(u, attention_mask=attention_mask)
        return h, self.final_layernorm(h)
