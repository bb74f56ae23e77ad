"""What kind of parameter a tensor is, for reductions, norms, replica checks and checkpoints.

Routed-expert parameters carry `allreduce = False` (megatron's and DeepSpeed's shared convention, set by
`layers/moe/experts.py`): their replica group is the expert-data-parallel group, not the world.
"""

from __future__ import annotations

import torch


def is_expert_param(p: torch.Tensor) -> bool:
    return getattr(p, "allreduce", True) is False


def is_sharded_param(p: torch.Tensor) -> bool:
    """Split over a model-parallel group (each rank a different slice), so never averaged with its peers."""
    return bool(getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False))
