"""Token-wise work over tiles of tokens (DeepSpeed ALST's tiled MLP), for the dense MLPs and the shared expert under
`moe_tile_bytes` (the routed experts tile inside `Glm53MoE`, with their routing).

A token-wise module (each output row depends only on its own input row: the SwiGLU MLPs) is run over tiles of the
sequence; with gradients each tile is a checkpoint, so the module's intermediates ([tokens, 2I] gate/up, the
activation) exist for one tile at a time, in the forward and in the backward. Each row is computed as untiled: the
same result up to the order in which the weight gradients sum the tiles' rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint


def tile_rows(budget_bytes: int, hidden: int, intermediate: int, element_bytes: int) -> int:
    """Tokens per tile of a SwiGLU MLP within `budget_bytes` (its input and output rows, gate/up and the
    activation: (2 D + 3 I) elements per token); a very large number when there is no budget."""
    if budget_bytes <= 0:
        return 2**62
    return max(1, budget_bytes // ((2 * hidden + 3 * intermediate) * element_bytes))


def over_token_tiles(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tokens: int
) -> torch.Tensor:
    """fn(x) for a token-wise `fn` and x [s, b, D], over tiles of about `tokens` tokens (whole sequence positions:
    s is split, b kept)."""
    s, b = x.shape[0], x.shape[1]
    rows = max(1, tokens // max(b, 1))
    if rows >= s:
        return fn(x)
    outs = []
    for start in range(0, s, rows):
        part = x[start : start + rows]
        outs.append(checkpoint(fn, part, use_reentrant=False) if torch.is_grad_enabled() else fn(part))
    return torch.cat(outs)
