"""Tokens permuted by expert once per MoE layer, and back: device-side, no host sync, deterministic.

The router gives every token k (expert, weight) pairs. `RoutedTokens.sort` orders the T·k pairs by expert with one
stable sort; the tokens-per-expert counts come from the sorted ids by binary search (`searchsorted`, no `bincount`:
that reads the maximum on the host). Pair p = t·k + j is token t's j-th choice.

`gather` takes the rows of the sorted pairs from x [T, D]; its backward sums each token's k row gradients in
one reduction (not an `index_add_` with repeated indices, whose CUDA atomics add in a run-dependent order).
`combine` puts expert outputs back in pair order (a permutation: its backward is the inverse gather) and takes the
router-weighted sum over each token's k outputs in fp32 (`_WeightedSum`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...parallel.row_permutation import inverse_permutation, permute_rows


@dataclass(frozen=True)
class RoutedTokens:
    order: torch.Tensor  # [T·k] int64: pair indices sorted by expert (stable: ties keep pair order)
    inverse: torch.Tensor  # [T·k] int64: position of each pair in the sorted order
    experts: torch.Tensor  # [T·k] int64: the sorted expert ids
    counts: torch.Tensor  # [E] int64: pairs routed to each expert (on the device)
    top_k: int

    @classmethod
    def sort(cls, expert_ids: torch.Tensor, n_experts: int) -> RoutedTokens:
        """expert_ids [T, k] (global ids) -> the pairs sorted by expert."""
        experts, order = torch.sort(expert_ids.reshape(-1), stable=True)
        inverse = inverse_permutation(order)
        bounds = torch.searchsorted(experts, torch.arange(n_experts + 1, device=experts.device))
        return cls(order, inverse, experts, bounds.diff(), expert_ids.shape[1])

    @property
    def n_tokens(self) -> int:
        return self.order.numel() // self.top_k

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> rows of the sorted pairs [T·k, D]."""
        return _GatherPairs.apply(x, self)

    def combine(self, sorted_out: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """sorted_out [T·k, D] (row i: the output for pair `order[i]`), weights [T, k] -> sum_j w_j y_j [T, D]."""
        pairs = permute_rows(sorted_out, self.inverse, self.order).view(self.n_tokens, self.top_k, -1)
        return _WeightedSum.apply(pairs, weights).to(dtype)


class _GatherPairs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, routed: RoutedTokens) -> torch.Tensor:
        ctx.routed = routed
        return x.index_select(0, torch.div(routed.order, routed.top_k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        routed: RoutedTokens = ctx.routed
        per_pair = grad.index_select(0, routed.inverse).view(routed.n_tokens, routed.top_k, -1)
        return per_pair.sum(1), None


class _WeightedSum(torch.autograd.Function):
    """pairs [T, k, D], weights [T, k] (fp32) -> sum_j w_j y_j [T, D] accumulated in fp32 (or wider), one slot at a
    time: the [T, k, D] fp32 products are never held (only the inputs are kept for backward), and nothing rounds the
    router weights to the activation dtype."""

    @staticmethod
    def forward(ctx: Any, pairs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(pairs, weights)
        acc = torch.promote_types(pairs.dtype, torch.float32)
        out = torch.zeros(pairs.shape[0], pairs.shape[2], dtype=acc, device=pairs.device)
        for j in range(pairs.shape[1]):  # k slots (top-k, a constant)
            out.addcmul_(pairs[:, j], weights[:, j, None].to(acc))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        pairs, weights = ctx.saved_tensors
        acc = grad.dtype
        w = weights.to(acc)
        d_pairs = d_weights = None
        if ctx.needs_input_grad[0]:
            d_pairs = torch.empty_like(pairs)
            for j in range(pairs.shape[1]):
                d_pairs[:, j] = grad * w[:, j, None]
        if ctx.needs_input_grad[1]:
            d_weights = torch.stack([(grad * pairs[:, j]).sum(-1) for j in range(pairs.shape[1])], dim=1)
            d_weights = d_weights.to(weights.dtype)
        return d_pairs, d_weights
