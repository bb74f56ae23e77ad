"""Small, documented adaptations of megatron-core 0.16.1 for machines without CUDA.

Applied by `glm53_ds.compat.apply()` (called when glm53_ds sets up parallel state) and only where needed:
on a machine with CUDA nothing is changed, so results on GPUs are megatron's own.

- `cpu_rng`: megatron's activation checkpointing (`tensor_parallel.checkpoint`, used by full recompute) and
  its RNG tracker save/restore the *CUDA* generator state; without CUDA they fail in
  `torch.cuda.get_rng_state`. The CPU generator state takes that role.
"""

from __future__ import annotations

import torch

from . import cpu_rng

_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    if not torch.cuda.is_available():
        cpu_rng.install()
    _applied = True


__all__ = ["apply"]
