"""Process-group bootstrap for single-process use (tests, conversion, `load_hf` in a notebook).

`ensure_model_parallel()` creates a world-1 process group and megatron `parallel_state` (TP = PP = EP = 1) when
none exists, and leaves an existing setup (e.g. from `deepspeed launch/train.py`) alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from .. import compat


def ensure_model_parallel() -> None:
    compat.apply()
    if not dist.is_initialized():
        # A HashStore needs no network and no free port: right for one process.
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
