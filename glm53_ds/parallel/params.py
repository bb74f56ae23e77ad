"""What kind of parameter a tensor is, for reductions, norms, replica checks and checkpoints.

Routed-expert parameters carry `allreduce = False` (megatron's and DeepSpeed's shared convention, set by
`layers/moe/experts.py`): their replica group is the expert-data-parallel group, not the world.
"""

from __future__ import annotations

import torch
from torch import nn

# A module's attribute naming its buffers that are sharded like expert parameters (routed experts kept in
# block-FP8): a buffer cannot carry the `allreduce=False` tag, which a device move drops.
EXPERT_BUFFERS = "expert_buffers"


def expert_buffer_names(model: nn.Module) -> set[str]:
    """The state-dict names of the buffers of `model` that are sharded over EP x ETP (`EXPERT_BUFFERS`)."""
    return {
        f"{prefix}{'.' if prefix else ''}{name}"
        for prefix, module in model.named_modules()
        for name in module.__dict__.get(EXPERT_BUFFERS, ())
    }


def is_expert_param(p: torch.Tensor) -> bool:
    return getattr(p, "allreduce", True) is False


def is_sharded_param(p: torch.Tensor) -> bool:
    """Split over a model-parallel group (each rank a different slice), so never averaged with its peers."""
    return bool(getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False))
