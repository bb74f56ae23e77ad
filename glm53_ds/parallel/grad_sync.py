"""The gradient-sync patch: every replicated parameter's reduced gradient is the mean over all its replicas.

Non-expert parameters are replicated on every rank and every rank sees different tokens, so their gradient
must be averaged over the whole world (DP x EP x ETP). DeepSpeed averages over its data-parallel group, which
(with ETP as its model-parallel group) leaves out the ETP peers: replicas then drift apart silently
(../shared/notes/deepspeed_moe.md measured 0.19 after 3 bf16 steps at world 8).

The patch pre-averages each non-expert gradient over the ETP group right before DeepSpeed's own reduction:
    g <- all_reduce(g, ETP) / ETP;   DeepSpeed: g <- all_reduce(g, DP) / DP        => mean over DP x ETP = world
Both are linear and idempotent on values already equal across ETP, so it is correct at every call site and
with gradient accumulation. Hook points (DeepSpeed 0.19.8):
  - stage 0 and BF16_Optimizer: `engine._reduce_non_expert_gradients(grads, ...)` (all non-expert buckets);
  - ZeRO-1/2: `optimizer.reduce_independent_p_g_buckets_and_remove_grads(param, i)` (per parameter, every
    path including overlap_comm and gradient accumulation).
Expert parameters (`allreduce == False`) and tensor-parallel-sharded parameters are never touched. With
ETP = 1 DeepSpeed's group is already complete and nothing is installed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from .initialize import ParallelLayout


def is_expert_param(p: torch.Tensor) -> bool:
    return getattr(p, "allreduce", True) is False


def is_sharded_param(p: torch.Tensor) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False))


def _pre_average(tensors: Iterable[torch.Tensor], group: dist.ProcessGroup, size: int) -> None:
    for t in tensors:
        dist.all_reduce(t, group=group)
        t.div_(size)


def install_gradient_sync(engine: Any, layout: ParallelLayout) -> bool:
    """Install on a DeepSpeed engine; returns True when installed (False: DeepSpeed's group is complete)."""
    if getattr(engine, "glm53_grad_sync", None) is not None:
        raise RuntimeError("the gradient-sync patch is already installed on this engine")
    if layout.etp == 1:
        engine.glm53_grad_sync = "not needed"
        return False
    group, size = layout.etp_group, layout.etp
    optimizer = engine.optimizer
    if hasattr(optimizer, "reduce_independent_p_g_buckets_and_remove_grads"):  # ZeRO-1/2
        original = optimizer.reduce_independent_p_g_buckets_and_remove_grads

        def reduce_param(param: torch.Tensor, i: int) -> Any:
            if param.grad is not None and not is_expert_param(param) and not is_sharded_param(param):
                _pre_average([param.grad.data], group, size)
            return original(param, i)

        optimizer.reduce_independent_p_g_buckets_and_remove_grads = reduce_param
    else:  # stage 0 and BF16_Optimizer
        original_reduce = engine._reduce_non_expert_gradients

        def reduce_non_expert(grads: list[torch.Tensor], elements_per_buffer: int) -> Any:
            _pre_average(grads, group, size)
            return original_reduce(grads, elements_per_buffer)

        engine._reduce_non_expert_gradients = reduce_non_expert
    engine.glm53_grad_sync = "installed"
    return True
