"""The DSA indexer's score and top-K as one streaming Triton kernel (contract and order: `indexer_topk.py`).

    q [b, r, Hi, d], head weights [b, r, Hi] fp32, pool keys [b, P, d], visible_from [b, P] int64, visible_to
    [b, P] int64 or None -> chosen pools [b, r, K] int32, score descending, equal scores by ascending pool, -1 for
    no candidate

One program per (block of `BLOCK_M` queries, sequence). Its queries' heads are the rows of one product: q as
[BLOCK_M x Hi, d] (64 rows at the released 32 heads: the M of one Hopper warpgroup MMA), held for the whole sweep.
Over the pools, `K2` at a time (K2: K rounded up to a power of 2, at least 16), in sub-blocks of `BLOCK_P`:
  - s = q key^T [BLOCK_M x Hi, BLOCK_P] (tensor cores, fp32 accumulation), relu(s * scale) * w_h, summed over the
    heads -> scores [BLOCK_M, BLOCK_P] fp32;
  - each score becomes its int64 order key (`_order_key`: the fp32 bits made order-preserving in the high half,
    `LOW_BITS - p` in the low half, so no two keys are equal and a larger key is a higher score or, at an equal
    score, a lower pool), non-candidates `NO_CANDIDATE`; the sub-blocks fill one [BLOCK_M, K2] block of keys;
  - when some key of the block beats the lowest of the running top-K2 of its query, the block is sorted ascending,
    the elementwise max with the running list (sorted descending) holds the top K2 of both as a bitonic sequence,
    and one bitonic merge sorts it descending (the bitonic top-k of Shanbhag et al.): O(K2 log^2 K2) compares per
    K2 pools, in registers.
The sweep stops at the last pool a block's last query may see (`bound`, from the pools' visibility: causal blocks
score about half the pools) and, in a packed row (`visible_to`: a pool is a candidate only before its document's
end), starts at the first pool whose document reaches the block's first query (`first`): a block scores the pools
of its own documents only. Nothing of size [r, P] touches memory: the program writes its [BLOCK_M, K] pools once.

The kernel's choice equals the torch path's wherever no two candidates' scores tie (`indexer_topk.py` on ties) and
the two compute the same fp32 order: the scores differ only in the order of the fp32 sums over d and over the heads
(a few ulp), which reorders two pools only when their scores are that close. bf16 / fp16 operands multiply exactly into fp32, as the torch
path's upcast does; fp32 products use IEEE dots (not TF32). Triton's CPU interpreter computes bf16 dots wrongly
(triton 3.9): there the operands are upcast first (`sparse_attention_triton._dot`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .indexer_topk import IMPLEMENTATIONS, LOW_BITS, NO_CANDIDATE, NOT_VISIBLE
from .sparse_attention_triton import _dot, _modes

ROWS, MAX_POOL_BLOCK, WARPS = 128, 64, 8
FP32_ROWS, FP32_POOL_BLOCK = 32, 32
_NO_CANDIDATE = tl.constexpr(NO_CANDIDATE)
_NOT_VISIBLE = tl.constexpr(NOT_VISIBLE)
_LOW_BITS = tl.constexpr(LOW_BITS)


@triton.jit
def _order_key(score, pool):
    """int64 keys of fp32 scores and int pool indices: score descending, then pool ascending."""
    bits = tl.where(score == 0.0, 0, score.to(tl.int32, bitcast=True))  # -0.0 as +0.0
    ordered = bits ^ ((bits >> 31) & _LOW_BITS)
    return (ordered.to(tl.int64) << 32) + (_LOW_BITS - pool.to(tl.int64))


@triton.jit
def _indexer_topk_kernel(
    q_ptr, w_ptr, k_ptr, vis_ptr, vis_to_ptr, first_ptr, bound_ptr, out_ptr,
    L, P, H, D, K, query_offset, scale, n_blocks,
    s_qb, s_ql, s_qh, s_qd,
    s_wb, s_wl, s_wh,
    s_kb, s_kp, s_kd,
    s_vb, s_vp,
    s_tb, s_tp,
    s_ob, s_ol, s_ok,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    K2: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, DOCUMENTS: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    bi = tl.program_id(1).to(tl.int64)
    offs_m = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(
        tl.int64
    )  # row offsets past 2^31 elements at 1M tokens
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m, mask_h, mask_d = offs_m < L, offs_h < H, offs_d < D
    q = tl.load(
        q_ptr + bi * s_qb + offs_m[:, None, None] * s_ql + offs_h[None, :, None] * s_qh + offs_d[None, None, :] * s_qd,
        mask=mask_m[:, None, None] & mask_h[None, :, None] & mask_d[None, None, :], other=0.0,
    )  # fmt: skip
    q = tl.reshape(q, [BLOCK_M * BLOCK_H, BLOCK_D])  # row m * BLOCK_H + h: query m's head h
    w = tl.load(
        w_ptr + bi * s_wb + offs_m[:, None] * s_wl + offs_h[None, :] * s_wh,
        mask=mask_m[:, None] & mask_h[None, :], other=0.0,
    )  # fmt: skip
    w = tl.reshape(w, [BLOCK_M * BLOCK_H])  # padded heads and rows: 0
    positions = query_offset + offs_m
    N_SUB: tl.constexpr = K2 // BLOCK_P
    sub = tl.arange(0, N_SUB)

    top = tl.full([BLOCK_M, K2], _NO_CANDIDATE, tl.int64)  # the running top K2, sorted descending
    reach = tl.load(
        bound_ptr + bi * n_blocks + block
    )  # pools up to the last candidate of the block's last query
    first = tl.load(first_ptr + bi * n_blocks + block)  # from the first pool of the block's first document
    for p0 in range(first, reach, K2):
        keys = tl.full([BLOCK_M, N_SUB, BLOCK_P], _NO_CANDIDATE, tl.int64)
        for j in range(
            N_SUB
        ):  # a loop, not unrolled: one pipeline of key loads (unrolled, one per sub-block)
            offs_p = p0 + j * BLOCK_P + tl.arange(0, BLOCK_P)
            mask_p = offs_p < P
            key = tl.load(
                k_ptr + bi * s_kb + offs_p[:, None] * s_kp + offs_d[None, :] * s_kd,
                mask=mask_p[:, None] & mask_d[None, :], other=0.0,
            )  # fmt: skip
            s = _dot(q, tl.trans(key), UPCAST, PRECISION)  # [BLOCK_M * BLOCK_H, BLOCK_P]
            s = tl.maximum(s * scale, 0.0) * w[:, None]
            score = tl.sum(tl.reshape(s, [BLOCK_M, BLOCK_H, BLOCK_P]), axis=1)  # [BLOCK_M, BLOCK_P]
            vis = tl.load(vis_ptr + bi * s_vb + offs_p * s_vp, mask=mask_p, other=_NOT_VISIBLE)
            seen = vis[None, :] <= positions[:, None]
            if DOCUMENTS:  # and before the end of the pool's document
                vis_to = tl.load(vis_to_ptr + bi * s_tb + offs_p * s_tp, mask=mask_p, other=0)
                seen = seen & (positions[:, None] < vis_to[None, :])
            sub_keys = tl.where(seen, _order_key(score, offs_p[None, :]), _NO_CANDIDATE)
            keys = tl.where((sub == j)[None, :, None], sub_keys[:, None, :], keys)
        keys = tl.reshape(keys, [BLOCK_M, K2])
        beats = tl.max(tl.max((keys > tl.min(top, 1)[:, None]).to(tl.int32), 1), 0)
        if beats > 0:
            top = tl.bitonic_merge(tl.maximum(top, tl.sort(keys)), descending=True)

    pools = tl.where(top == _NO_CANDIDATE, -1, _LOW_BITS - (top & 0xFFFFFFFF)).to(tl.int32)
    offs_k = tl.arange(0, K2)
    tl.store(
        out_ptr + bi * s_ob + offs_m[:, None] * s_ol + offs_k[None, :] * s_ok, pools,
        mask=mask_m[:, None] & (offs_k < K)[None, :],
    )  # fmt: skip


def blocks(heads: int, dim: int, n_select: int, dtype: torch.dtype) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_H, BLOCK_D, BLOCK_P, K2, warps): heads and d padded to powers of 2 (d at least 16: an MMA's
    K), as many queries as make `ROWS` product rows (at least 16: an MMA's M), K2 = K rounded up to a power of 2 (at
    least 16: an MMA's N), pool sub-blocks of at most `MAX_POOL_BLOCK`. fp32 (IEEE dots on CUDA cores, no
    tensor-core path to shape for) takes `FP32_ROWS` and `FP32_POOL_BLOCK`."""
    fp32 = dtype == torch.float32
    block_h = triton.next_power_of_2(heads)
    block_m = max(1, (FP32_ROWS if fp32 else ROWS) // block_h, 16 // block_h)
    k2 = max(16, triton.next_power_of_2(n_select))
    block_p = min(FP32_POOL_BLOCK if fp32 else MAX_POOL_BLOCK, k2)
    return block_m, block_h, max(16, triton.next_power_of_2(dim)), block_p, k2, 4 if fp32 else WARPS


def reach(visible_from: torch.Tensor, last_positions: torch.Tensor) -> torch.Tensor:
    """[b, n] int32: per sequence and query block, how many pools lie up to the last candidate of the block's last
    query (key position `last_positions` [n]): no pool after it is a candidate of the block."""
    earliest_after = visible_from.flip(-1).cummin(-1).values.flip(-1)  # [b, P]: nondecreasing
    positions = last_positions[None, :].expand(visible_from.shape[0], -1).contiguous()
    return torch.searchsorted(earliest_after, positions, right=True).to(torch.int32)


def first_pools(visible_to: torch.Tensor, first_positions: torch.Tensor) -> torch.Tensor:
    """[b, n] int32: per sequence and query block, the first pool a query of the block may see: the first whose
    document ends after the block's first query (key position `first_positions` [n]; `visible_to` nondecreasing)."""
    positions = first_positions[None, :].expand(visible_to.shape[0], -1).contiguous()
    return torch.searchsorted(visible_to.contiguous(), positions, right=True).to(torch.int32)


def indexer_topk(
    q: torch.Tensor, head_weights: torch.Tensor, pool_keys: torch.Tensor, visible_from: torch.Tensor,
    query_offset: int, n_select: int, scale: float, visible_to: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    b, rows, heads, dim = q.shape
    n_pools = pool_keys.shape[1]
    out = torch.empty(b, rows, n_select, dtype=torch.int32, device=q.device)
    if b * rows * n_select == 0:
        return out
    if n_select > n_pools:
        raise ValueError(f"indexer top-k: {n_select} pools to choose of {n_pools}")
    if (
        pool_keys.dtype != q.dtype
    ):  # both in fp32, as the torch path multiplies them (never rounding either down)
        q, pool_keys = q.float(), pool_keys.float()
    block_m, block_h, block_d, block_p, k2, warps = blocks(heads, dim, n_select, q.dtype)
    upcast, precision = _modes(q.dtype)
    n_blocks = triton.cdiv(rows, block_m)
    last = torch.arange(n_blocks, device=q.device) * block_m + block_m - 1
    bound = reach(visible_from, last.clamp(max=rows - 1) + query_offset)
    documents = visible_to is not None
    if visible_to is None:
        visible_to, first = visible_from, torch.zeros_like(bound)  # (not read)
    else:
        first = first_pools(visible_to, last - (block_m - 1) + query_offset)
    _indexer_topk_kernel[(n_blocks, b)](
        q, head_weights, pool_keys, visible_from, visible_to, first, bound, out,
        rows, n_pools, heads, dim, n_select, query_offset, scale, n_blocks,
        *q.stride(), *head_weights.stride(), *pool_keys.stride(), *visible_from.stride(), *visible_to.stride(),
        *out.stride(),
        BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_P=block_p, K2=k2, UPCAST=upcast,
        PRECISION=precision, DOCUMENTS=documents, num_warps=warps,
    )  # fmt: skip
    return out


IMPLEMENTATIONS["triton"] = indexer_topk
