"""Token-wise work over tiles of tokens (DeepSpeed ALST's tiled MLP), for the dense MLPs, the shared expert and the
mHC mixes under `moe_tile_bytes` (the routed experts tile inside `Glm53MoE`, with their routing).

A token-wise module (each output row depends only on its own input rows: the SwiGLU MLPs, `hc_pre`, `hc_post`) is
run over tiles of the sequence; with gradients each tile is a checkpoint, so the module's intermediates ([tokens,
2I] gate/up and the activation; mHC's fp32 copies of the n streams) exist for one tile at a time, in the forward and
in the backward. Each row is computed as untiled: the same result up to the order in which the weight gradients
sum the tiles' rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


def tile_rows(budget_bytes: int, hidden: int, intermediate: int, element_bytes: int) -> int:
    """Tokens per tile of a SwiGLU MLP within `budget_bytes` (its input and output rows, gate/up and the
    activation: (2 D + 3 I) elements per token); a very large number when there is no budget."""
    if budget_bytes <= 0:
        return 2**62
    return max(1, budget_bytes // ((2 * hidden + 3 * intermediate) * element_bytes))


# hc_pre's transients per token, measured: 218 KB at n = 4, D = 4096 (6.6x the bf16 streams): the flattened streams
# in fp32, their RMS norm and the weighted sums, about four fp32 copies of the n streams
MHC_FP32_COPIES = 4


def mhc_tile_rows(budget_bytes: int, hc_mult: int, hidden: int) -> int:
    """Tokens per tile of the mHC mixes within `budget_bytes` (`MHC_FP32_COPIES` fp32 copies of the n streams per
    token); a very large number when there is no budget."""
    if budget_bytes <= 0:
        return 2**62
    return max(1, budget_bytes // (MHC_FP32_COPIES * 4 * hc_mult * hidden))


def over_token_tiles(fn: Callable[..., Any], x: torch.Tensor, tokens: int, *more: torch.Tensor) -> Any:
    """fn(x, *more) for a token-wise `fn`, x [s, b, ...] and `more` tensors of the same s and b, over tiles of about
    `tokens` tokens (whole sequence positions: s is split, b kept); fn returns a tensor or a tuple of them, each
    [s, b, ...]."""
    s, b = x.shape[0], x.shape[1]
    rows = max(1, tokens // max(b, 1))
    if rows >= s:
        return fn(x, *more)
    outs = []
    # split, not slices: the inputs' gradient is assembled once from the tiles' (a slice's backward would write a
    # whole-size zero tensor per tile)
    for parts in zip(*(t.split(rows) for t in (x, *more)), strict=True):
        outs.append(checkpoint(fn, *parts, use_reentrant=False) if torch.is_grad_enabled() else fn(*parts))
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(column) for column in zip(*outs, strict=True))
    return torch.cat(outs)
