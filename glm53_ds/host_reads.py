"""The model's reads of device values on the host, each with what stands in for it in a shape-only run.

A forward reads a few device values on the host: the input's token range (model.py), the rows per expert (the
MoE's loop experts and its EP dispatch), the pools a padded batch completes (the DSA indexer). Each is a
synchronisation on CUDA (counted by tests/test_host_syncs.py). The planner's dry run runs the same forward on meta
tensors, which hold no values: there each read returns the stand-in its caller declares (`shape_only`: balanced
routing, every pool, no range to check). Like a fused kernel's fake implementation (layers/fused_kernels.py), the
stand-in sits beside the read, and the model files keep one code path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

StandIn = TypeVar("StandIn")


def to_list(values: torch.Tensor, shape_only: Callable[[], StandIn]) -> list[Any] | StandIn:
    """`values.tolist()` (one host sync); on meta tensors `shape_only()`."""
    if values.is_meta:
        return shape_only()
    return values.tolist()


def true_indices(mask: torch.Tensor, shape_only: Callable[[], StandIn]) -> torch.Tensor | StandIn:
    """The indices of a 1-D mask's true entries (a host sync: their number sizes the result); on meta tensors
    `shape_only()`."""
    if mask.is_meta:
        return shape_only()
    return mask.nonzero()[:, 0]
