"""Route megatron's CUDA RNG state helpers to the CPU generator (installed only when CUDA is absent).

megatron.core.tensor_parallel.random looks these functions up as module globals at call time, in
`CheckpointFunction` (forward: save states; backward: restore them before recomputing) and in
`CudaRNGStatesTracker.add/fork`, so replacing the two globals is enough.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel import random as megatron_random


def _get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def install() -> None:
    if torch.cuda.is_available():
        raise RuntimeError("the CPU RNG shim is only for machines without CUDA")
    megatron_random._get_cuda_rng_state = _get_rng_state
    megatron_random._set_cuda_rng_state = _set_rng_state
