"""Top-k router with HF's semantics (`Glm5NextTextTopkRouter`).

scores = sigmoid(x W^T) in fp32; `e_score_correction_bias` is added for *selection only* (aux-loss-free load
balancing); with `n_group > 1` experts are first restricted to the `topk_group` groups whose two best biased
scores sum highest; the chosen experts' unbiased scores are normalised to sum 1 (`norm_topk_prob`) and scaled
by `routed_scaling_factor`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...transformer_config import Glm53TransformerConfig


class TopKRouter(nn.Module):
    e_score_correction_bias: torch.Tensor

    def __init__(self, config: Glm53TransformerConfig) -> None:
        super().__init__()
        cfg = config.glm
        self.num_experts = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, cfg.hidden_size, dtype=config.params_dtype))
        nn.init.normal_(self.weight, mean=0.0, std=cfg.initializer_range)
        # fp32 buffer, identical on every rank; updated by the load balancer, not by the optimizer.
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> (scores [T, E] fp32, weights [T, k] fp32, expert ids [T, k] int64)."""
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid()
        biased = scores + self.e_score_correction_bias
        if self.n_group > 1:
            per_group = self.num_experts // self.n_group
            group_scores = biased.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
            groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool()
            expert_mask = (
                group_mask.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.num_experts)
            )
            biased = biased.masked_fill(~expert_mask, float("-inf"))
        ids = torch.topk(biased, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, weights * self.scaling, ids
