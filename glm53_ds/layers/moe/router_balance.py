"""Aux-loss-free load balancing: update `e_score_correction_bias` from expert loads after each optimizer step.

DeepSeek-V3's rule: bias_e += rate * sign(mean_load - load_e), with loads counted over every token of the
global batch: each MoE layer's per-rank counts (accumulated over the micro-batches of the step) are
all-reduced over `group` (the world by default), so the bias stays identical on every rank. `rate = 0` turns it
off.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .moe_layer import Glm53MoE

DEFAULT_RATE = 1e-3


@torch.no_grad()
def update_router_bias(
    model: nn.Module, rate: float = DEFAULT_RATE, reduce: bool = True, group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """Apply the update to every MoE layer and reset its load counts; returns max/mean load per layer.

    `reduce=False` uses this process's counts alone (a single-process model in a multi-rank job)."""
    stats: dict[str, float] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Glm53MoE):
            continue
        load = module.expert_load.clone()
        if reduce and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(load, group=group)
        mean = load.mean()
        if rate and mean > 0:
            bias = module.router.e_score_correction_bias
            bias += rate * torch.sign(mean - load).to(bias.dtype)
        stats[name] = (load.max() / mean).item() if mean > 0 else 0.0
        module.expert_load.zero_()
    return stats
