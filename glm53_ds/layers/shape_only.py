"""Shape-only stand-ins for the fused GPU kernels on meta tensors (the real-size dry run, plan/dry_run.py).

On CUDA the KDA core (fla's `chunk_kda`) and DSA sparse attention (`sparse_attention_triton.py`) are one fused kernel
each; their torch references loop in Python over chunks of tokens (2,048 KDA chunks and thousands of query blocks
per layer at 128k tokens), which on meta tensors would be millions of shape computations for the released model.
On meta tensors the model calls these stand-ins instead: each checks its kernel's contract (shapes, dtypes),
returns the output's shape, keeps for backward what the kernel keeps (its inputs; the sparse-attention kernel also
its output and fp32 log-sum-exp: what the activation planner, plan/activations.py, counts), allocates in backward
what the kernel's backward allocates besides its gradients (the DSA backward's chunk buffers), and hands back
gradients shaped as its inputs. Nothing else changes: every projection, norm, router, expert
GEMM, collective and the loss head run as they do on a GPU, shape by shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .dsa_workspace import backward_workspace

_operands: list[dict[str, int]] = []  # open `largest_operands` records


@contextmanager
def largest_operands() -> Iterator[dict[str, int]]:
    """Within: each stand-in called notes its kernel's largest operand (elements) in the yielded dict."""
    record: dict[str, int] = {}
    _operands.append(record)
    try:
        yield record
    finally:
        _operands.remove(record)


def _note(kernel: str, *tensors: torch.Tensor) -> None:
    for record in _operands:
        record[kernel] = max(record.get(kernel, 0), *(t.numel() for t in tensors))


def on_meta(*tensors: torch.Tensor) -> bool:
    return any(t.device.type == "meta" for t in tensors)


class _ShapeOnlyKernel(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, shape: torch.Size, dtype: torch.dtype, kept: tuple[torch.Size, ...],
        workspace: list[tuple[tuple[int, ...], torch.dtype]], *inputs: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        out = inputs[0].new_empty(shape, dtype=dtype)
        # `kept`: the fp32 statistics the kernel keeps beside its inputs and output (its log-sum-exp rows)
        statistics = [inputs[0].new_empty(s, dtype=torch.float32) for s in kept]
        ctx.save_for_backward(*inputs, *([out] if kept else []), *statistics)
        ctx.num_inputs, ctx.workspace = len(inputs), workspace
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = ctx.saved_tensors[: ctx.num_inputs]
        # the kernel's backward transients, alive while its gradients are made (the planner counts them)
        workspace = [inputs[0].new_empty(shape, dtype=dtype) for shape, dtype in ctx.workspace]
        grads = [torch.empty_like(t) if ctx.needs_input_grad[4 + i] else None for i, t in enumerate(inputs)]
        del workspace
        return (None, None, None, None, *grads)


def _expect(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the kernel's contract needs {shape}")


def kda_core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """The KDA contract (layers/kda_ops.py): q, k, g [b, s, h, dk], v [b, s, h, dv], beta [b, s, h] -> o like v."""
    b, s, h, dk = q.shape
    _expect("KDA k", k, (b, s, h, dk))
    _expect("KDA g", g, (b, s, h, dk))
    _expect("KDA beta", beta, (b, s, h))
    _expect("KDA v", v, (b, s, h, v.shape[-1]))
    _note("KDA (fla chunk_kda)", q, k, v, g, beta)
    return _ShapeOnlyKernel.apply(v.shape, q.dtype, (), [], q, k, v, g, beta)


def sparse_attention_core(q_lat: torch.Tensor, latent: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The DSA sparse-attention contract (layers/sparse_attention.py): q_lat [b, L, h, R], latent [b, L, R],
    tokens [b, L, W] int32 -> o_lat like q_lat."""
    b, length, _, rank = q_lat.shape
    _expect("sparse attention latent", latent, (b, length, rank))
    _expect("sparse attention tokens", tokens, (b, length, tokens.shape[-1]))
    if tokens.dtype != torch.int32:
        raise ValueError(f"sparse attention tokens: dtype {tokens.dtype}, the kernel's contract needs int32")
    _note("DSA sparse attention (Triton)", q_lat, latent, tokens)
    lse = torch.Size(q_lat.shape[:3])  # [b, L, h]: sparse_attention_triton keeps out and lse for backward
    workspace = backward_workspace(b, length, q_lat.shape[2], rank, tokens.shape[-1])
    return _ShapeOnlyKernel.apply(q_lat.shape, q_lat.dtype, (lse,), workspace, q_lat, latent, tokens)
