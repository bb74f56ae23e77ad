"""The experts' grouped GEMM, `torch._grouped_mm`, under `torch.compile` in every dtype.

torch's own op has a meta implementation that accepts bf16 only (torch 2.13: "Expected inputs of BF16 type"), so a
compiled fp32 model (the CPU path, and fp32 on a GPU) stops at its first grouped GEMM. Here bf16 goes to torch's op
as it is (inductor lowers it to its grouped-GEMM template on Hopper) and every other dtype through
`glm53::grouped_mm`, a custom op with a fake implementation for the two forms the experts use:

    a [N, K] x b [E, K, M], offs [E]  -> [N, M]      (rows through their group's matrix)
    a [K, N] x b [N, M],    offs [E]  -> [E, K, M]   (per group, the product over its rows: weight gradients)

No autograd: the experts' autograd functions (experts.py) call it in their forward and backward. The output is
contiguous (the real op's result made so: a no-op at the aligned sizes the grouped backend requires)."""

from __future__ import annotations

import torch


@torch.library.custom_op("glm53::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs).contiguous()


@_grouped_mm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[-1])


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm(a, b, offs=offs)` (module docstring)."""
    if a.dtype == torch.bfloat16:
        return torch._grouped_mm(a, b, offs=offs)
    return _grouped_mm_op(a, b, offs)
