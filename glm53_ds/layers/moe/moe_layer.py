"""GLM-5.3 MoE block: router -> routed experts (dropless) + shared expert (a megatron dense MLP)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from torch import nn

from ...transformer_config import Glm53TransformerConfig
from .experts import GroupedExperts
from .router import TopKRouter


class Glm53MoE(nn.Module):
    def __init__(self, config: Glm53TransformerConfig, **unused: Any) -> None:
        super().__init__()
        cfg = config.glm
        assert cfg is not None
        self.router = TopKRouter(config)
        self.experts = GroupedExperts(config)
        self.shared_experts: MLP | None = None
        if cfg.n_shared_experts > 0:
            # megatron's MLP sizes linear_fc2 from config.ffn_hidden_size, so give it a config of its own
            # (as megatron's SharedExpertMLP does).
            shared_config = copy.copy(config)
            shared_config.ffn_hidden_size = cfg.moe_intermediate_size * cfg.n_shared_experts
            self.shared_experts = MLP(
                shared_config,
                MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                ffn_hidden_size=shared_config.ffn_hidden_size,
            )
        # Per-expert token counts of the last forward (this rank's tokens), for load balancing and logging.
        self.last_expert_load: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        """hidden_states [s, b, D] -> ([s, b, D], None)."""
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])  # [T, D]
        _, weights, expert_ids = self.router(tokens)
        with torch.no_grad():
            self.last_expert_load = torch.bincount(expert_ids.flatten(), minlength=self.router.num_experts)
        out = self.experts(tokens, expert_ids, weights).view_as(hidden_states)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)[0]
        return out, None
