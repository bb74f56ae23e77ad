"""Process-group bootstrap for single-process use (tests, conversion, `load_hf` in a notebook) and small helpers.

`ensure_model_parallel()` creates a world-1 process group and megatron `parallel_state` (TP = PP = EP = 1) when
none exists, and leaves an existing setup (e.g. from `deepspeed launch/train.py`) alone.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from .. import compat


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def free_port() -> int:
    """A TCP port free on this host right now (for a single-node rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_model_parallel() -> None:
    compat.apply()
    if not dist.is_initialized():
        # A HashStore needs no network and no free port: right for one process.
        dist.init_process_group(default_backend(), store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
