"""The gradient norm of the global-batch gradient under EP x ETP (what clipping must use).

After the reduction every rank holds the full, identical gradient of each replicated parameter and the reduced
gradient of its own expert shard. The squared global norm is therefore
    sum over replicated parameters (counted once) + sum over expert shards (summed over the EP x ETP group)
DeepSpeed 0.19.8's stage-0 `clip_grad_norm_` instead averages per-rank norms over its data-parallel group,
which differs as soon as experts are split over EP ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import nn

from .grad_sync import is_expert_param


def global_grad_norm(model: nn.Module) -> torch.Tensor:
    dense = torch.zeros((), dtype=torch.float64)
    expert = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is None:
            continue
        sq = p.grad.detach().double().square().sum().cpu()
        if is_expert_param(p):
            expert += sq
        else:
            dense += sq
    if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_expert_tensor_and_model_parallel_group()
        if dist.get_world_size(group) > 1:
            device = next(model.parameters()).device
            expert = expert.to(device)
            dist.all_reduce(expert, group=group)
            expert = expert.cpu()
    return torch.sqrt(dense + expert)


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip every gradient by the global norm (above); returns the norm before clipping."""
    norm = global_grad_norm(model)
    coef = max_norm / (norm.item() + 1e-6)
    if coef < 1.0:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm
