"""The gradient norm of the global-batch gradient under EP x ETP (what clipping must use).

After the reduction every rank holds the full, identical gradient of each replicated parameter and the reduced
gradient of its own expert shard. The squared global norm is therefore
    sum over replicated parameters (counted once) + sum over expert shards (summed over the EP x ETP group)
where an expert tensor whole on every ETP rank of its shard (`etp_replicated`: LoRA's `gate_up_A` / `down_B`,
layers/lora.py) is counted on ETP rank 0 only.
DeepSpeed 0.19.8's stage-0 `clip_grad_norm_` instead averages per-rank norms over its data-parallel group,
which differs as soon as experts are split over EP ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .params import is_expert_param


def global_grad_norm(
    model: nn.Module, expert_group: dist.ProcessGroup | None, etp_rank: int = 0
) -> torch.Tensor:
    """`expert_group`: the ranks whose expert shards together make all experts (EP x ETP; the layout's
    `pg_collection.tp_ep`), or None in a single process; `etp_rank`: this rank's place in its ETP group."""
    dense = torch.zeros((), dtype=torch.float64)
    expert = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is None or (etp_rank > 0 and getattr(p, "etp_replicated", False)):
            continue
        sq = p.grad.detach().double().square().sum().cpu()
        if is_expert_param(p):
            expert += sq
        else:
            dense += sq
    if expert_group is not None and dist.get_world_size(expert_group) > 1:
        device = next(model.parameters()).device
        expert = expert.to(device)
        dist.all_reduce(expert, group=expert_group)
        expert = expert.cpu()
    return torch.sqrt(dense + expert)


def clip_grad_norm(
    model: nn.Module, max_norm: float, expert_group: dist.ProcessGroup | None, etp_rank: int = 0
) -> torch.Tensor:
    """Clip every gradient by the global norm (above); returns the norm before clipping."""
    norm = global_grad_norm(model, expert_group, etp_rank)
    coef = max_norm / (norm.item() + 1e-6)
    if coef < 1.0:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm
