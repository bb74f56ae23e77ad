"""Routed experts stored as grouped tensors, computed token-group by expert (dropless).

`gate_up_proj [E_local, 2 * I_local, D]` (rows: gate, then up) and `down_proj [E_local, D, I_local]` hold this
rank's `ExpertShard` (`parallel/expert_shard.py`): its experts and, under expert tensor parallelism, its slice of
each expert's intermediate dimension. The parameters carry `allreduce = False` (megatron's convention for
expert-parallel parameters): their replicas are the ranks holding the same shard, not the world. Clamped SwiGLU as HF: gate clamped above at `swiglu_limit`, up
clamped to [-limit, limit].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...parallel.expert_shard import ExpertShard
from ...transformer_config import Glm53TransformerConfig


class GroupedExperts(nn.Module):
    def __init__(self, config: Glm53TransformerConfig, shard: ExpertShard | None = None) -> None:
        super().__init__()
        cfg = config.glm
        self.shard = shard or ExpertShard.for_config(cfg)
        self.num_local_experts = self.shard.num_local
        self.first_expert = self.shard.first_expert
        self.intermediate = self.shard.local_intermediate
        self.swiglu_limit = cfg.swiglu_limit
        dtype = config.params_dtype
        self.gate_up_proj = nn.Parameter(
            torch.empty(self.num_local_experts, 2 * self.intermediate, cfg.hidden_size, dtype=dtype)
        )
        self.down_proj = nn.Parameter(
            torch.empty(self.num_local_experts, cfg.hidden_size, self.intermediate, dtype=dtype)
        )
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=cfg.initializer_range)
        nn.init.normal_(self.down_proj, mean=0.0, std=cfg.initializer_range)
        self.gate_up_proj.allreduce = False  # type: ignore[attr-defined]
        self.down_proj.allreduce = False  # type: ignore[attr-defined]

    def expert_ffn(self, local_expert: int, x: torch.Tensor) -> torch.Tensor:
        """One expert's (slice of its) FFN on its tokens x [n, D] -> [n, D]."""
        gate, up = F.linear(x, self.gate_up_proj[local_expert]).chunk(2, dim=-1)
        if self.swiglu_limit is not None:
            gate = gate.clamp(max=self.swiglu_limit)
            up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        return F.linear(F.silu(gate) * up, self.down_proj[local_expert])

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, D], expert_ids / weights [T, k] (global expert ids) -> weighted sum of local experts [T, D]."""
        out = torch.zeros_like(x)
        local_ids = expert_ids - self.first_expert
        for e in range(self.num_local_experts):
            token_idx, slot = torch.where(local_ids == e)
            if token_idx.numel() == 0:
                continue
            y = self.expert_ffn(e, x[token_idx]) * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out
