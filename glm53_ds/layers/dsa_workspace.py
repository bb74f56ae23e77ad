"""What the fused DSA backward (`sparse_attention_triton.py`) allocates besides its gradients, in one place: the
kernel sizes its chunks by it, and the planner adds it at the kernel's backward op (`sparse_attention_op.py`,
`fused_kernels.py`)."""

from __future__ import annotations

import torch

# The fused backward's per-slot latent gradients (fp32 [rows, W, R]) and ds (fp32 [rows, H, W]) are made for a chunk
# of query rows at a time, under this many bytes (`sparse_attention_triton.sparse_backward`).
SLOT_GRAD_BYTES = 1 << 30


def chunk_rows(width: int, rank: int, heads: int, slot_grad_bytes: int = SLOT_GRAD_BYTES) -> int:
    """Query rows per chunk of the fused backward: their fp32 slot gradients [rows, W, R] and ds [rows, H, W]
    fit `slot_grad_bytes`."""
    return max(1, slot_grad_bytes // max(1, width * (rank + heads) * 4))


def backward_workspace(
    b: int, length: int, heads: int, rank: int, width: int
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """What the fused backward allocates besides its gradients, at most at once (for the planner's count): one
    chunk's slot gradients and ds, the fp32 latent-gradient accumulator [b L, R], delta [b, L, h], and the chunk's
    sort (int32 keys, int32 sorted keys, int64 order)."""
    rows = min(b * length, chunk_rows(width, rank, heads))
    return [((rows, width, rank), torch.float32), ((rows, heads, width), torch.float32),
            ((b * length, rank), torch.float32), ((b, length, heads), torch.float32),
            ((rows * width * 16,), torch.uint8)]  # fmt: skip
