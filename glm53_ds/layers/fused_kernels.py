"""The fused kernels' contracts, as the planner reads them: which custom op is which kernel, and what its backward
allocates besides its gradients.

Each fused kernel is an op (`glm53::...`: a `torch.library.custom_op` for sparse attention and mHC, an operator
with a kernel per dispatch key for KDA, layers/kda_ops.py) whose meta implementation gives its outputs' shapes and
whose autograd keeps what the kernel keeps, so one model code path runs on CUDA, on CPU and on meta tensors (the
real-size dry run, plan/dry_run.py). Two things a fake implementation cannot show a dispatch mode are
declared here by the op's module: the kernel's name for the planner's reports (`plan/dry_run.py` records each
kernel's largest operand) and its backward's transient buffers (`plan/activations.py` counts them at the backward
op's call). Nothing here runs a kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Workspace = list[tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class FusedKernel:
    name: str  # as the planner reports it
    forward: str  # the forward op, "glm53::name"
    backward: str | None = None  # the backward op, if the kernel has one of its own
    workspace: Callable[..., Workspace] | None = None  # the backward op's arguments -> its transient buffers


KERNELS: dict[str, FusedKernel] = {}  # by forward op; filled when the op modules are imported


def register(kernel: FusedKernel) -> None:
    KERNELS[kernel.forward] = kernel


def _op_name(func: Any) -> str:
    """`torch.ops.glm53.x.default` -> "glm53::x"."""
    return getattr(func, "name", lambda: "")().split(".")[0]


def kernel_of_forward(func: Any) -> FusedKernel | None:
    """The fused kernel whose forward op `func` (an OpOverload, as a dispatch mode sees it) is, if any."""
    return KERNELS.get(_op_name(func))


def workspace_of_backward(func: Any, args: tuple[Any, ...]) -> Workspace:
    """The transient buffers the backward op `func` allocates for these arguments ([] for any other op)."""
    name = _op_name(func)
    for kernel in KERNELS.values():
        if kernel.backward == name and kernel.workspace is not None:
            return kernel.workspace(*args)
    return []


def expect_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    """A kernel contract's shape check (KDA: on every device; sparse attention: in its ops' meta implementations)."""
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the kernel's contract needs {shape}")
