"""FP8 import: block-scaled float8 weights (DeepSeek-V3 / GLM FP8 release convention).

A weight `W [out, in]` stored as `torch.float8_e4m3fn` (or e5m2) comes with `W_scale_inv` (named
`<name minus .weight>.weight_scale_inv`), fp32 of shape `[ceil(out / 128), ceil(in / 128)]`: the value of a
128 x 128 block is `fp8 * scale_inv[block]` (the stored scale is the inverse of the quantisation scale, so
dequantisation multiplies). Edge blocks are partial. Any other scale shape is refused.
"""

from __future__ import annotations

import math

import torch

BLOCK = 128


def is_fp8_scale_name(name: str) -> bool:
    return name.endswith("_scale_inv")


def dequantize_fp8(
    name: str, weight: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK
) -> torch.Tensor:
    if weight.dim() != 2:
        raise ValueError(f"{name}: FP8 weights must be 2-D [out, in], got shape {tuple(weight.shape)}")
    out_f, in_f = weight.shape
    expected = (math.ceil(out_f / block), math.ceil(in_f / block))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"{name}: unknown FP8 scale layout: weight_scale_inv has shape {tuple(scale_inv.shape)}, expected "
            f"{expected} ({block}x{block} blocks of a {out_f}x{in_f} weight)"
        )
    scale = scale_inv.float().repeat_interleave(block, 0)[:out_f].repeat_interleave(block, 1)[:, :in_f]
    return weight.float() * scale


def quantize_fp8(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for building test checkpoints: (fp8 weight, scale_inv)."""
    out_f, in_f = weight.shape
    rows, cols = math.ceil(out_f / block), math.ceil(in_f / block)
    scale_inv = torch.empty(rows, cols)
    q = torch.empty_like(weight, dtype=torch.float8_e4m3fn)
    finfo = torch.finfo(torch.float8_e4m3fn)
    for r in range(rows):
        for c in range(cols):
            blk = weight[r * block : (r + 1) * block, c * block : (c + 1) * block].float()
            s = blk.abs().max().clamp_min(1e-12) / finfo.max
            scale_inv[r, c] = s
            q[r * block : (r + 1) * block, c * block : (c + 1) * block] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale_inv
