"""Row permutations with a gather for a backward: x[index] for a permutation `index` and its inverse.

`index_select`'s generic backward zero-fills the input's shape and scatters into it (`index_add_`); for a
permutation the gradient is simply the inverse gather, one pass. The MoE's token sort and the EP dispatcher's
expert-order permutation use it.
"""

from __future__ import annotations

from typing import Any

import torch


def inverse_permutation(index: torch.Tensor) -> torch.Tensor:
    """The permutation undoing `index` (rows[index][inverse] == rows); device ops only."""
    return torch.empty_like(index).index_copy_(0, index, torch.arange(index.numel(), device=index.device))


def permute_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """x[index] for a permutation `index` whose inverse is `inverse`, differentiable."""
    return _PermuteRows.apply(x, index, inverse)


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None
