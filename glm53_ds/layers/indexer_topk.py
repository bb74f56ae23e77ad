"""The DSA indexer's score and top-k of pools (steps 2-3 of `dsa_indexer.py`) as one streaming Triton kernel: the
custom op `glm53::indexer_topk_triton`, its contract and fake implementation.

    q [b, r, Hi, d], head weights [b, r, Hi] fp32, pool keys [b, P, d], visible_from [b, P] int64,
    queries at key positions query_offset + i -> chosen pools [b, r, K] int32 (-1: no candidate left)

Score of query i and pool p: `sum_h w_h * relu(q_h . key_p * scale)` (fp32). Pool p is a candidate for a query at
key position t when `visible_from[p] <= t` (the last token of a complete pool; `NOT_VISIBLE` for a pool that never
is). The K chosen are the candidates of highest score, score descending; slots left over (fewer candidates than K)
hold -1.

Exactly equal scores (-0.0 equal to +0.0) are ranked by ascending pool index: the order of a stable sort, which
`torch.topk` does not promise. transformers (and the torch path, `indexer_impl=torch`, which is HF's expression
bitwise) take `torch.topk` of the masked scores, whose order among equal values is its implementation's: on this
CPU neither ascending nor descending index (measured), on CUDA another (pytorch/pytorch#127196, #27542), so HF's
own choice at a tie differs between devices. A kernel cannot reproduce both; this one takes the order torch's sort
gives with `stable=True`, the same on every device. Ties are common only in small models (a ReLU zeroes every
head of a pool: 20-30% of the scores of the 2-head test models are exactly 0); at the released 32 heads a tie
needs 32 ReLUs at zero or two fp32 sums equal to the bit. Where no two candidates' scores tie, the kernel chooses
what the torch path chooses, in its order (tests/layers/test_indexer_topk.py).

The kernel (`indexer_topk_triton.py`, imported lazily: `triton.jit` reads TRITON_INTERPRET at decoration time)
computes per block of queries the pool scores on the tensor cores, the ReLU and the head-weighted sum in registers,
and keeps a running top-K of int64 keys (the score's bits made order-preserving above, `LOW_BITS - p` below: no
two keys equal), writing only the [r, K] chosen pools: no [r, Hi, P] or [r, P] scores in memory. Its fake gives the
output's shape, so the planner's meta run counts what a GPU holds. The indexer runs without gradient; the indexer
loss (`DsaIndexer.kl_terms`) recomputes the chosen pools' scores in torch, with a gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import fused_kernels
from .fused_kernels import expect_shape

NOT_VISIBLE = 1 << 62  # visible_from of a pool that is no query's candidate (incomplete)
NO_CANDIDATE = -(1 << 63)  # the key of a (query, pool) that is not a candidate: below every candidate's
LOW_BITS = 0x7FFFFFFF  # the low half of a key: LOW_BITS - pool index (pools < 2^31)

# The kernel's entry point, registered by `indexer_topk_triton` when it is imported (lazily, by `DsaIndexer.select`:
# `triton.jit` reads TRITON_INTERPRET at decoration time). This module does not import it.
IMPLEMENTATIONS: dict[str, Callable[..., torch.Tensor]] = {}


def check_contract(
    q: torch.Tensor, head_weights: torch.Tensor, pool_keys: torch.Tensor, visible_from: torch.Tensor,
    visible_to: torch.Tensor | None = None,
) -> None:  # fmt: skip
    b, rows, heads, dim = q.shape
    expect_shape("indexer head weights", head_weights, (b, rows, heads))
    expect_shape("indexer pool keys", pool_keys, (b, pool_keys.shape[1], dim))
    expect_shape("indexer visible_from", visible_from, (b, pool_keys.shape[1]))
    if visible_to is not None:
        expect_shape("indexer visible_to", visible_to, (b, pool_keys.shape[1]))
    if (
        head_weights.dtype != torch.float32
        or visible_from.dtype != torch.int64
        or (visible_to is not None and visible_to.dtype != torch.int64)
    ):
        raise ValueError(
            f"indexer top-k: head weights {head_weights.dtype} and visible_from {visible_from.dtype}, the kernel's "
            f"contract needs float32 and int64 (visible_to too)"
        )


@torch.library.custom_op("glm53::indexer_topk_triton", mutates_args=())
def _triton_op(
    q: torch.Tensor, head_weights: torch.Tensor, pool_keys: torch.Tensor, visible_from: torch.Tensor,
    query_offset: int, n_select: int, scale: float, visible_to: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    if "triton" not in IMPLEMENTATIONS:
        raise RuntimeError(
            "glm53::indexer_topk_triton: the kernel is not loaded; import glm53_ds.layers.indexer_topk_triton first "
            "(DsaIndexer.select does)"
        )
    return IMPLEMENTATIONS["triton"](
        q, head_weights, pool_keys, visible_from, query_offset, n_select, scale, visible_to
    )


@_triton_op.register_fake
def _(
    q: torch.Tensor, head_weights: torch.Tensor, pool_keys: torch.Tensor, visible_from: torch.Tensor,
    query_offset: int, n_select: int, scale: float, visible_to: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    check_contract(q, head_weights, pool_keys, visible_from, visible_to)
    return q.new_empty((*q.shape[:2], n_select), dtype=torch.int32)


fused_kernels.register(fused_kernels.FusedKernel("DSA indexer top-k (Triton)", "glm53::indexer_topk_triton"))


def top_pools_fused(
    q: torch.Tensor, head_weights: torch.Tensor, pool_keys: torch.Tensor, visible_from: torch.Tensor,
    query_offset: int, n_select: int, scale: float, visible_to: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The kernel: queries q [b, r, Hi, d] at key positions `query_offset + i`, their head weights [b, r, Hi] fp32,
    pool keys [b, P, d] (q's dtype), visible_from [b, P] int64, visible_to [b, P] int64 or None (packed documents:
    a pool is a candidate for positions in [visible_from, visible_to); visible_to nondecreasing) -> chosen pools
    [b, r, n_select] int32, equal to `top_pools_stable` of the same scores."""
    check_contract(q, head_weights, pool_keys, visible_from, visible_to)
    return _triton_op(
        q, head_weights, pool_keys, visible_from, int(query_offset), int(n_select), float(scale), visible_to
    )


def order_keys(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """The kernel's int64 order keys of fp32 scores [..., P] (`indexer_topk_triton._order_key`): the score's bits
    made order-preserving in the high half, `LOW_BITS - pool` in the low half (no two equal: a larger key is a
    higher score or, at an equal score, a lower pool), non-candidates NO_CANDIDATE."""
    bits = torch.where(scores == 0, 0, scores.float().view(torch.int32))  # -0.0 as +0.0
    ordered = (bits ^ ((bits >> 31) & LOW_BITS)).long()
    pools = torch.arange(scores.shape[-1], device=scores.device)
    return ((ordered << 32) + (LOW_BITS - pools)).masked_fill(~candidates, NO_CANDIDATE)


def top_pools_stable(
    scores: torch.Tensor, candidates: torch.Tensor, n_select: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's choice in torch: scores [b, r, P] fp32, candidates [b, r, P] bool -> (chosen pools [b, r, K]
    int64, score descending and equal scores by ascending pool; whether each is a candidate [b, r, K])."""
    keys = order_keys(scores, candidates).topk(n_select, dim=-1).values
    return LOW_BITS - (keys & LOW_BITS), keys != NO_CANDIDATE
