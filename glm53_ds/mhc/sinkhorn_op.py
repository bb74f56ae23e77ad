"""mHC's Sinkhorn normalisation as a custom op over the fused Triton kernels (`sinkhorn_triton.py`), with a fake
implementation and its backward registered, so eager runs, `torch.compile` (one opaque node each way) and the
planner's meta runs see the same contract:

    comb [..., n, n] fp32 -> the normalised [..., n, n] fp32 (contiguous); the backward keeps only comb.

`hyper_connection.sinkhorn(..., impl="triton")` calls it (`sinkhorn_impl`, glm53_ds/backends.py: `auto` is this op
on CUDA, the torch Function elsewhere). On CPU tensors the kernels run under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..layers import fused_kernels

MAX_HC_MULT_TRITON = 8  # the kernels hold a block of tokens' [n, n] matrices in registers


def check_contract(comb: torch.Tensor) -> None:
    n = comb.shape[-1] if comb.dim() >= 2 else 0
    if comb.dim() < 2 or comb.shape[-2] != n or not 1 <= n <= MAX_HC_MULT_TRITON:
        raise ValueError(
            f"sinkhorn (Triton): comb must be [..., n, n] with n in 1..{MAX_HC_MULT_TRITON}, got {tuple(comb.shape)}"
        )
    if comb.dtype != torch.float32:
        raise TypeError(f"sinkhorn (Triton): comb must be fp32 (mHC's mixing weights are), got {comb.dtype}")


def _kernels() -> Any:
    from . import sinkhorn_triton  # lazy: Triton reads TRITON_INTERPRET when the kernels are defined

    return sinkhorn_triton


@torch.library.custom_op("glm53::sinkhorn_triton", mutates_args=())
def _sinkhorn_op(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    return _kernels().sinkhorn_forward(comb, iters, eps)


@_sinkhorn_op.register_fake
def _(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    check_contract(comb)
    return torch.empty_like(comb, memory_format=torch.contiguous_format)


@torch.library.custom_op("glm53::sinkhorn_triton_backward", mutates_args=())
def _sinkhorn_backward_op(grad: torch.Tensor, comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    return _kernels().sinkhorn_backward(grad, comb, iters, eps)


@_sinkhorn_backward_op.register_fake
def _(grad: torch.Tensor, comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    return torch.empty_like(comb, memory_format=torch.contiguous_format)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    comb, iters, eps = inputs
    ctx.save_for_backward(comb)
    ctx.iters, ctx.eps = iters, eps


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    (comb,) = ctx.saved_tensors
    return _sinkhorn_backward_op(grad, comb, ctx.iters, ctx.eps), None, None


_sinkhorn_op.register_autograd(_backward, setup_context=_setup_context)
fused_kernels.register(
    fused_kernels.FusedKernel(
        "mHC Sinkhorn (Triton)", "glm53::sinkhorn_triton", "glm53::sinkhorn_triton_backward"
    )
)


def sinkhorn_fused(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The fused kernels: comb [..., n, n] fp32 -> [..., n, n], differentiable in comb."""
    check_contract(comb)  # on every device, as the fake implementation does
    return _sinkhorn_op(comb, int(iters), float(eps))
