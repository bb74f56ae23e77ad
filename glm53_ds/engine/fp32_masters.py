"""Full precision for the parameters HF keeps in fp32 (`Glm53Model._keep_in_fp32_modules_strict`: conv1d,
dt_bias, A_log, mHC base/scale) in a bf16/fp16 DeepSpeed run.

DeepSpeed 0.19.8 casts every parameter to the training dtype (it keeps only buffers in fp32) and then builds its
fp32 master copies from the cast values, so these parameters would start training from rounded values and be
saved rounded. The forward pass still sees the rounded parameter (the engine's storage is bf16; docs/numerics.md
measures that cost), but three things can keep the full values:
  - `capture` before `deepspeed.initialize` and `restore` after it: the masters start from the unrounded values;
  - `gather` when saving: checkpoints (and `--export-hf`) store the fp32 masters, as the released layout does;
  - `restore` after loading a model-only checkpoint, whose stored values are fp32.
How a master is reached is DeepSpeed-internal (`deepspeed_internals.fp32_master_accessors`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .deepspeed_internals import fp32_master_accessors


def fp32_kept_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    patterns = getattr(model, "_keep_in_fp32_modules_strict", ())
    return [(n, p) for n, p in model.named_parameters() if any(k in n for k in patterns)]


def capture(model: nn.Module) -> dict[str, torch.Tensor]:
    """fp32 copies of the fp32-kept parameters (call before `deepspeed.initialize` rounds them)."""
    return {n: p.detach().float().clone() for n, p in fp32_kept_parameters(model)}


def restore(engine: Any, values: dict[str, torch.Tensor]) -> int:
    """Set the fp32 masters of the rounded fp32-kept parameters to `values`; returns how many were set.
    Local (each rank sets its own fragment), but every rank must call it."""
    count = 0
    for name, param in fp32_kept_parameters(engine.module):
        if param.dtype == torch.float32 or name not in values:
            continue
        accessors = fp32_master_accessors(engine, param)
        if accessors is None:
            continue
        accessors[1](values[name].to(device=param.device, dtype=torch.float32))
        count += 1
    return count


def gather(engine: Any) -> dict[str, torch.Tensor]:
    """The fp32 masters of the rounded fp32-kept parameters, on the CPU. Collective under ZeRO (an all-reduce
    over each parameter's data-parallel group): every rank calls it."""
    out = {}
    for name, param in fp32_kept_parameters(engine.module):
        if param.dtype == torch.float32:
            continue
        accessors = fp32_master_accessors(engine, param)
        master = accessors[0]() if accessors is not None else None
        if master is not None:
            out[name] = master.detach().reshape(param.shape).float().cpu()
    return out
