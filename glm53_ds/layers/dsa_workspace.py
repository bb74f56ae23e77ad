"""What the fused DSA backward (`sparse_attention_triton.py`) allocates besides its gradients, in one place: the
kernel sizes its chunks by it, and the planner adds it at the kernel's backward op (`sparse_attention_op.py`,
`fused_kernels.py`)."""

from __future__ import annotations

import torch

# The fused backward's per-slot latent gradients [rows, W, R] (and in fp32 ds [rows, H, W]) are made for a chunk of
# query rows at a time, under this many bytes (`sparse_attention_triton.sparse_backward`).
SLOT_GRAD_BYTES = 1 << 30


def buffer_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the backward's slot-gradient buffer for operands of `dtype`: bf16 for bf16 / fp16 operands
    (each slot gradient, fp32 inside its product, is rounded once before the fp32 sum over a key's references:
    the buffer's write and read back are the backward's largest memory traffic, halved), fp32 for fp32 (with
    ds)."""
    return torch.float32 if dtype == torch.float32 else torch.bfloat16


def chunk_rows(
    width: int,
    rank: int,
    heads: int,
    slot_grad_bytes: int = SLOT_GRAD_BYTES,
    dtype: torch.dtype = torch.float32,
    slot_gradients: bool = True,
) -> int:
    """Query rows per chunk of the fused backward: their slot gradients [rows, W, R] (unless `slot_gradients` is
    False: the atomic variant has none) and, in fp32, ds [rows, H, W] (in `buffer_dtype(dtype)`) fit
    `slot_grad_bytes`."""
    itemsize = buffer_dtype(dtype).itemsize
    ds = heads if dtype == torch.float32 else 0  # bf16 / fp16: ds stays in the fused kernel's registers
    return max(1, slot_grad_bytes // max(1, width * (rank * slot_gradients + ds) * itemsize))


def backward_workspace(
    b: int, length: int, heads: int, rank: int, width: int, dtype: torch.dtype = torch.float32,
    key_length: int | None = None,
) -> list[tuple[tuple[int, ...], torch.dtype]]:  # fmt: skip
    """What the fused backward allocates besides its gradients, at most at once (for the planner's count): one
    chunk's slot gradients (and ds, fp32 only), the fp32 latent-gradient accumulator [b Lk, R] (Lk = `key_length`,
    the keys' sequence: `length` unless the queries are a part of it), delta [b, L, h], and the chunk's sort (int32
    keys, int32 sorted keys, int64 order)."""
    rows = min(b * length, chunk_rows(width, rank, heads, dtype=dtype))
    buffer = buffer_dtype(dtype)
    ds = [((rows, heads, width), buffer)] if dtype == torch.float32 else []
    keys = length if key_length is None else key_length
    return [((rows, width, rank), buffer), *ds,
            ((b * keys, rank), torch.float32), ((b, length, heads), torch.float32),
            ((rows * width * 16,), torch.uint8)]  # fmt: skip
