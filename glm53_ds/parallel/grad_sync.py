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


def _install_norm_fixes(engine: Any) -> None:
    """Clipping must use the norm of the global-batch gradient.

    - stage 0 with a plain optimizer: DeepSpeed's `clip_grad_norm_` averages per-rank norms over its data-parallel
      group, which is not the global norm once experts are split over EP ranks; it is replaced by
      `grad_norm.clip_grad_norm` (replicated parameters once, expert shards summed over EP x ETP).
    - BF16_Optimizer: on ETP ranks other than 0 it has no replicated gradient to count and stacks an empty list;
      a zero placeholder keeps its (otherwise correct) computation going.
    ZeRO-1/2 compute the global norm correctly once expert shards carry `tensor_model_parallel`
    (deepspeed_setup.prepare_model_for_deepspeed); tests/test_expert_parallel.py checks every mode.
    """
    from .grad_norm import clip_grad_norm

    optimizer = engine.optimizer
    if not hasattr(optimizer, "get_grads_for_norm") and not hasattr(
        optimizer, "reduce_independent_p_g_buckets_and_remove_grads"
    ):
        if not (engine.fp16_enabled() or engine.bfloat16_enabled()):

            def clip_fp32_gradients() -> None:
                engine._global_grad_norm = clip_grad_norm(engine.module, engine.gradient_clipping())

            engine.clip_fp32_gradients = clip_fp32_gradients
    if hasattr(optimizer, "get_grads_for_norm"):
        original = optimizer.get_grads_for_norm

        def get_grads_for_norm(for_clipping: bool = False) -> Any:
            result = original(for_clipping=for_clipping)
            if not for_clipping and isinstance(result, tuple) and not result[0]:
                device = next(engine.module.parameters()).device
                result[0].append(torch.zeros(1, dtype=torch.float32, device=device))
            return result

        optimizer.get_grads_for_norm = get_grads_for_norm


def install_gradient_sync(engine: Any, layout: ParallelLayout) -> bool:
    """Install on a DeepSpeed engine; returns True when the ETP pre-averaging was needed.

    The clipping-norm fixes are installed in every layout."""
    if getattr(engine, "glm53_grad_sync", None) is not None:
        raise RuntimeError("the gradient-sync patch is already installed on this engine")
    _install_norm_fixes(engine)
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
