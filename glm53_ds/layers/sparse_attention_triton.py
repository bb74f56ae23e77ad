"""Fused Triton kernels for DSA sparse attention in the absorbed latent form (contract: `sparse_attention.py`).

    q_lat [b, L, h, R], latent [b, Lk, R], tokens [b, L, W] int32 (into the Lk keys, -1 = empty) -> o_lat [b, L, h, R]

Shaped like FlashMLA's sparse prefill: a query's heads are the rows of its matrix products. One program per query
holds all of the rank's heads (up to 64: a [64 x R] tile, the M of one Hopper warpgroup MMA, so wgmma on sm_90),
gathers each selected latent row once for all of them (not once per block of heads), and walks the W slots in
blocks of `BLOCK_W`. Fewer heads (a smaller model: sequence parallelism splits the queries, not the heads, mla.py)
make a smaller tile (at least 16 rows: Ampere-style MMAs where the tile is under 64 rows, the same one gather per
query).

Forward (`_fwd_kernel`): an online softmax in base 2 (the scale pre-multiplied by log2(e), `exp2`): s = q_lat c^T
[heads x BLOCK_W], acc = acc * alpha + p c, the accumulator rescaled lazily (only when a block raises some head's
max by more than RESCALE_LOG2); o_lat and the natural-log LSE per head written once. Nothing of size [L, W] or
[L, L] touches memory. A query with no valid slot writes 0 and lse = -inf (the wrapper's blind-row rule
replaces such rows).

Backward, deterministic (no floating-point atomics) and linear in L:
  - bf16 / fp16, `_bwd_query_kernel`, one program per query, all heads, all slots, each latent row gathered once
    for the five matrix products, computed as three: q and dO held as one tile with interleaved rows, qdo
    [2h, R]; sd = qdo c^T (s and dp), p recomputed from the LSE, ds = p (dp - delta); dq += ds c (fp32 in
    registers, stored once); the slots' latent gradients g^T = qdo^T [ds; p] ([R, BLOCK_W], fp32 inside) written
    to the chunk's buffer [rows, W, R] in bf16 (`dsa_workspace.buffer_dtype`). ds never leaves the program.
  - fp32 (IEEE dots on CUDA cores; [2h, R] in fp32 would not fit): `_bwd_slots_kernel`, one program per (query,
    block of slots): s, dp, ds, g = ds^T q + p^T dO to the buffer, ds to the chunk's [rows, H, W];
    `_bwd_dq_kernel`: dq = ds c.
  - per chunk: the chunk's slot references (int32 keys, the chunk's own [rows, W]) sorted stably by the key token
    they read, and `_segment_sum_kernel`, one program per block of `BLOCK_E` sorted references, adds each run of
    one key that starts in its block, in that order, `BLOCK_F` rows at a time, into d_latent. The programs a chunk
    launches are bounded by its references (rows x W), never by L: the whole backward launches O(L W) programs and
    sorts O(L W) keys, with no [L, W] int64 tensor.
  The chunk (`SLOT_GRAD_BYTES` of slot gradients and ds) keeps the buffer bounded at any length.

bf16 or fp32 operands, fp32 accumulation (fp32 dots in IEEE precision, not TF32; bf16: the slot gradients are
rounded to bf16 once each, then summed per key in fp32). R and h need not be powers of 2 (masked); R up to 512 (the
released kv_lora_rank), h up to 64 per program (more: several head blocks forward; the backward refuses them, naming
the limit). Triton's CPU interpreter (TRITON_INTERPRET=1) computes bf16 dots wrongly (triton 3.9), so there the
operands are upcast to fp32 first: the same products (bf16 x bf16 is exact in fp32), the same fp32 accumulation.

The autograd of these kernels is the custom op `glm53::sparse_attention_triton` (sparse_attention_op.py: what it
keeps, its fake implementation for meta tensors). This module is imported lazily: `triton.jit` decides at decoration
time whether to use Triton's interpreter.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import backends
from . import sparse_attention_op
from .dsa_workspace import SLOT_GRAD_BYTES, buffer_dtype, chunk_rows
from .sparse_attention_op import sparse_attention_fused

MAX_HEADS = 64  # heads per program: the backward holds all of a query's heads in one tile
LOG2E = math.log2(math.e)
RESCALE_LOG2 = tl.constexpr(8.0)  # the forward's lazy rescale threshold (log2 units: a factor 256)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _load_slots(
    t_ptr, c_ptr, bi, i, offs_w, W, offs_r, mask_r, s_tb, s_tl, s_tw, s_cb, s_cl, s_cr, EVEN_R: tl.constexpr
):  # fmt: skip
    """Query i's slots offs_w: the key tokens they read (int64, -1 = empty), which are valid, and their latent rows
    [BLOCK_W, BLOCK_R] (0 where not). EVEN_R (R == BLOCK_R): no column mask, fewer predicates held across the
    loop."""
    tok = tl.load(t_ptr + bi * s_tb + i * s_tl + offs_w * s_tw, mask=offs_w < W, other=-1).to(tl.int64)
    valid = tok >= 0
    if EVEN_R:
        mask = valid[:, None]
    else:
        mask = valid[:, None] & mask_r[None, :]
    c = tl.load(c_ptr + bi * s_cb + tok[:, None] * s_cl + offs_r[None, :] * s_cr, mask=mask, other=0.0)
    return tok, valid, c


@triton.jit
def _fwd_kernel(
    q_ptr, c_ptr, t_ptr, o_ptr, lse_ptr,
    L, W, H, R, scale_log2,
    s_qb, s_ql, s_qh, s_qr,
    s_cb, s_cl, s_cr,
    s_tb, s_tl, s_tw,
    s_ob, s_ol, s_oh, s_or,
    BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr, EVEN_R: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    bi, i = row // L, row % L
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    mask_h, mask_r = offs_h < H, offs_r < R
    q_mask = mask_h[:, None] & mask_r[None, :]
    q = tl.load(
        q_ptr + bi * s_qb + i * s_ql + offs_h[:, None] * s_qh + offs_r[None, :] * s_qr, mask=q_mask, other=0.0
    )

    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max, base 2
    denom = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for w0 in range(0, W, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        _, valid, c = _load_slots(
            t_ptr, c_ptr, bi, i, offs_w, W, offs_r, mask_r, s_tb, s_tl, s_tw, s_cb, s_cl, s_cr, EVEN_R
        )  # [BLOCK_W], [BLOCK_W, BLOCK_R]: gathered once for every head
        s = _dot(q, tl.trans(c), UPCAST, PRECISION) * scale_log2  # [BLOCK_H, BLOCK_W], log2 units
        s = tl.where(valid[None, :], s, float("-inf"))
        m_block = tl.max(s, 1)
        # Lazy rescale: the [BLOCK_H, R] accumulator is rescaled only when some head's max grows by more than
        # RESCALE_LOG2 (p stays <= 2^RESCALE_LOG2 otherwise: exact in fp32, in range in bf16), not every block.
        grows = m_block > m  # where it does, m_block is finite: m_block - m never computes inf - inf
        if tl.max(tl.where(grows, m_block - tl.where(grows, m, 0.0), 0.0), 0) > RESCALE_LOG2:
            m_new = tl.maximum(m, m_block)
            alpha = tl.exp2(m - tl.where(m_new == float("-inf"), 0.0, m_new))
            denom = denom * alpha
            acc = acc * alpha[:, None]
            m = m_new
        p = tl.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None])
        denom = denom + tl.sum(p, 1)
        acc = acc + _dot(p.to(c.dtype), c, UPCAST, PRECISION)
    seen = denom > 0
    out = acc / tl.where(seen, denom, 1.0)[:, None]
    tl.store(
        o_ptr + bi * s_ob + i * s_ol + offs_h[:, None] * s_oh + offs_r[None, :] * s_or,
        out.to(o_ptr.dtype.element_ty), mask=q_mask,
    )  # fmt: skip
    ln2: tl.constexpr = 0.6931471805599453
    lse = tl.where(seen, (m + tl.log2(tl.where(seen, denom, 1.0))) * ln2, float("-inf"))
    tl.store(lse_ptr + row * H + offs_h, lse, mask=mask_h)


@triton.jit
def _bwd_query_kernel(
    q_ptr, c_ptr, t_ptr, do_ptr, lse_ptr, delta_ptr, g_ptr, dq_ptr, dc_ptr,
    row0, L, LK, W, H, R, scaling,
    s_qb, s_ql, s_qh, s_qr,
    s_cb, s_cl, s_cr,
    s_tb, s_tl, s_tw,
    BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr, EVEN_R: tl.constexpr,
    ATOMIC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """bf16 / fp16: query row0 + program 0, all its heads and all its slots, BLOCK_W at a time; the five matrix
    products of the backward as three. q and dO stay in one tile with their rows interleaved, qdo [2 BLOCK_H, R]
    (row 2h head h's q, 2h + 1 its dO), loaded once:
      sd = qdo c^T [2 BLOCK_H, BLOCK_W]: s = q c^T and dp = dO c^T together (128 rows at 64 heads: each warpgroup
           computes its own 64, where a 64-row product feeding another is computed whole on both);
      ds = scaling p (dp - delta), p recomputed from the LSE; dq += ds c (fp32 [BLOCK_H, R], stored once);
      g^T = qdo^T [ds; p] [R, BLOCK_W]: the slots' latent gradients ds^T q + p^T dO in one product (fp32 sums,
           stored in the dtype of the chunk's buffer [rows, W, R]; ATOMIC: added into d_latent instead).
    Nothing else is buffered: ds never leaves registers. dO contiguous [b, L, H, R]; lse, delta [b, L, H]."""
    local = tl.program_id(0).to(tl.int64)
    row = row0 + local
    bi, i = row // L, row % L
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_k = tl.arange(0, 2 * BLOCK_H)
    head_k, is_do = offs_k // 2, (offs_k % 2) == 1
    qdo = tl.load(
        tl.where(is_do[:, None], do_ptr + row * H * R + head_k[:, None] * R + offs_r[None, :],
                 q_ptr + bi * s_qb + i * s_ql + head_k[:, None] * s_qh + offs_r[None, :] * s_qr),
        mask=(head_k < H)[:, None] & mask_r[None, :], other=0.0,
    )  # fmt: skip
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    lse = tl.load(lse_ptr + row * H + offs_h, mask=mask_h, other=float("-inf"))
    delta = tl.load(delta_ptr + row * H + offs_h, mask=mask_h, other=0.0)
    lse_safe = tl.where(lse == float("-inf"), float("inf"), lse)  # rows without slots: p = 0
    dq = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for w0 in range(0, W, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        tok, valid, c = _load_slots(
            t_ptr, c_ptr, bi, i, offs_w, W, offs_r, mask_r, s_tb, s_tl, s_tw, s_cb, s_cl, s_cr, EVEN_R
        )  # [BLOCK_W] x2, [BLOCK_W, BLOCK_R]: gathered once for every head and all five products
        sd = _dot(qdo, tl.trans(c), UPCAST, PRECISION)  # [2 BLOCK_H, BLOCK_W]
        s, dp = tl.split(tl.permute(tl.reshape(sd, [BLOCK_H, 2, BLOCK_W]), (0, 2, 1)))
        p = tl.where(valid[None, :], tl.exp(s * scaling - lse_safe[:, None]), 0.0)  # [BLOCK_H, BLOCK_W]
        ds = p * (dp - delta[:, None]) * scaling
        dq += _dot(ds.to(c.dtype), c, UPCAST, PRECISION)
        pair = tl.reshape(tl.permute(tl.join(ds, p), (0, 2, 1)), [2 * BLOCK_H, BLOCK_W])  # rows as in qdo
        g_t = _dot(tl.trans(qdo), pair.to(qdo.dtype), UPCAST, PRECISION)  # [BLOCK_R, BLOCK_W]
        if ATOMIC:  # the measured alternative: fp32 reductions straight into d_latent, in no fixed order
            tl.atomic_add(dc_ptr + (bi * LK + tok)[None, :] * R + offs_r[:, None], g_t,
                          mask=valid[None, :] & mask_r[:, None], sem="relaxed")  # fmt: skip
        else:
            tl.store(g_ptr + local * W * R + offs_w[None, :] * R + offs_r[:, None], g_t.to(g_ptr.dtype.element_ty),
                     mask=(offs_w < W)[None, :] & mask_r[:, None])  # fmt: skip
    tl.store(dq_ptr + row * H * R + offs_h[:, None] * R + offs_r[None, :], dq.to(dq_ptr.dtype.element_ty),
             mask=mask_h[:, None] & mask_r[None, :])  # fmt: skip


@triton.jit
def _bwd_slots_kernel(
    q_ptr, c_ptr, t_ptr, do_ptr, lse_ptr, delta_ptr, g_ptr, ds_ptr, dc_ptr,
    row0, L, LK, W, H, R, scaling,
    s_qb, s_ql, s_qh, s_qr,
    s_cb, s_cl, s_cr,
    s_tb, s_tl, s_tw,
    BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr, SUB_R: tl.constexpr,
    ATOMIC: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """fp32 (IEEE dots on CUDA cores: the fused kernel's [2 H, R] tile would not fit): query row0 + program 0,
    slots program 1 (a block of BLOCK_W), all heads: four matrix products, each over SUB_R columns of the latent
    at a time: s = q c^T and dp = dO c^T [heads x slots], then ds = scaling p (dp - delta) and the slots' latent
    gradients g = ds^T q + p^T dO [slots x R] to the chunk's buffer [rows, W, R] (ATOMIC: into d_latent); ds
    [heads x slots] to the chunk's buffer [rows, H, W] for `_bwd_dq_kernel`."""
    local = tl.program_id(0).to(tl.int64)
    row = row0 + local
    bi, i = row // L, row % L
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_h = tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, SUB_R)
    mask_h, mask_w = offs_h < H, offs_w < W
    tok = tl.load(t_ptr + bi * s_tb + i * s_tl + offs_w * s_tw, mask=mask_w, other=-1).to(tl.int64)
    valid = tok >= 0
    s = tl.zeros([BLOCK_H, BLOCK_W], dtype=tl.float32)
    dp = tl.zeros([BLOCK_H, BLOCK_W], dtype=tl.float32)
    for r0 in range(0, BLOCK_R, SUB_R):
        offs_r = r0 + offs_s
        mask_r = offs_r < R
        c = tl.load(c_ptr + bi * s_cb + tok[:, None] * s_cl + offs_r[None, :] * s_cr,
                    mask=valid[:, None] & mask_r[None, :], other=0.0)  # fmt: skip
        q = tl.load(q_ptr + bi * s_qb + i * s_ql + offs_h[:, None] * s_qh + offs_r[None, :] * s_qr,
                    mask=mask_h[:, None] & mask_r[None, :], other=0.0)  # fmt: skip
        do = tl.load(do_ptr + row * H * R + offs_h[:, None] * R + offs_r[None, :],
                     mask=mask_h[:, None] & mask_r[None, :], other=0.0)  # fmt: skip
        s += tl.dot(q, tl.trans(c), input_precision=PRECISION)  # 1
        dp += tl.dot(do, tl.trans(c), input_precision=PRECISION)  # 2
    lse = tl.load(lse_ptr + row * H + offs_h, mask=mask_h, other=float("-inf"))
    delta = tl.load(delta_ptr + row * H + offs_h, mask=mask_h, other=0.0)
    lse_safe = tl.where(lse == float("-inf"), float("inf"), lse)  # rows without slots: p = 0
    p = tl.where(valid[None, :], tl.exp(s * scaling - lse_safe[:, None]), 0.0)  # [BLOCK_H, BLOCK_W]
    ds = p * (dp - delta[:, None]) * scaling
    tl.store(
        ds_ptr + local * H * W + offs_h[:, None] * W + offs_w[None, :],
        ds,
        mask=mask_h[:, None] & mask_w[None, :],
    )
    for r0 in range(0, BLOCK_R, SUB_R):
        offs_r = r0 + offs_s
        mask_r = offs_r < R
        q = tl.load(q_ptr + bi * s_qb + i * s_ql + offs_h[:, None] * s_qh + offs_r[None, :] * s_qr,
                    mask=mask_h[:, None] & mask_r[None, :], other=0.0)  # fmt: skip
        do = tl.load(do_ptr + row * H * R + offs_h[:, None] * R + offs_r[None, :],
                     mask=mask_h[:, None] & mask_r[None, :], other=0.0)  # fmt: skip
        g = tl.dot(tl.trans(ds), q, input_precision=PRECISION)  # 3
        g += tl.dot(tl.trans(p), do, input_precision=PRECISION)  # 4
        if ATOMIC:
            tl.atomic_add(dc_ptr + (bi * LK + tok)[:, None] * R + offs_r[None, :], g,
                          mask=valid[:, None] & mask_r[None, :], sem="relaxed")  # fmt: skip
        else:
            tl.store(g_ptr + local * W * R + offs_w[:, None] * R + offs_r[None, :], g,
                     mask=mask_w[:, None] & mask_r[None, :])  # fmt: skip


@triton.jit
def _bwd_dq_kernel(
    c_ptr, t_ptr, ds_ptr, dq_ptr,
    row0, L, W, H, R,
    s_cb, s_cl, s_cr,
    s_tb, s_tl, s_tw,
    BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr, EVEN_R: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """fp32: query row0 + program 0, heads program 1: dq [H, R] = ds c over its slots (the fifth product; bf16 /
    fp16 compute it in `_bwd_query_kernel`). dq contiguous [b, L, H, R]; ds the chunk's [rows, H, W] fp32."""
    local = tl.program_id(0).to(tl.int64)
    row = row0 + local
    bi, i = row // L, row % L
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    mask_h, mask_r = offs_h < H, offs_r < R
    dq = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for w0 in range(0, W, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        _, valid, c = _load_slots(
            t_ptr, c_ptr, bi, i, offs_w, W, offs_r, mask_r, s_tb, s_tl, s_tw, s_cb, s_cl, s_cr, EVEN_R
        )  # [BLOCK_W], [BLOCK_W, BLOCK_R]
        ds = tl.load(ds_ptr + local * H * W + offs_h[:, None] * W + offs_w[None, :],
                     mask=mask_h[:, None] & (offs_w < W)[None, :], other=0.0)  # fmt: skip
        dq += tl.dot(ds, c, input_precision=PRECISION)  # 5
    tl.store(dq_ptr + row * H * R + offs_h[:, None] * R + offs_r[None, :], dq.to(dq_ptr.dtype.element_ty),
             mask=mask_h[:, None] & mask_r[None, :])  # fmt: skip


@triton.jit
def _segment_sum_kernel(
    g_ptr, keys_ptr, order_ptr, dc_ptr, n, R, empty,
    BLOCK_E: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """dc [b * L, R] fp32 += the slot gradients of each key whose run (in the sorted references keys / order of
    one chunk) starts in this program's block of BLOCK_E positions, summed in the sorted order, BLOCK_F rows at a
    time (a fixed reduction tree: deterministic). `empty`: the key of an empty slot, summed nowhere."""
    block = tl.program_id(0).to(tl.int64)
    e0 = block * BLOCK_E
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_f = tl.arange(0, BLOCK_F)
    for e in range(e0, tl.minimum(e0 + BLOCK_E, n)):
        key = tl.load(keys_ptr + e)
        previous = tl.load(keys_ptr + e - 1, mask=e > 0, other=-1)
        if (key != previous) & (key != empty):  # a run starts here: it is this program's
            acc = tl.zeros([BLOCK_R], dtype=tl.float32)
            f = e
            more = True
            while more:
                at = f + offs_f
                in_run = (at < n) & (tl.load(keys_ptr + at, mask=at < n, other=-1) == key)
                slots = tl.load(order_ptr + at, mask=in_run, other=0)
                rows = tl.load(g_ptr + slots[:, None] * R + offs_r[None, :], mask=in_run[:, None] & mask_r[None, :],
                               other=0.0)  # fmt: skip
                acc += tl.sum(rows.to(tl.float32), 0)
                f += BLOCK_F
                more = tl.sum(in_run.to(tl.int32), 0) == BLOCK_F
            ptrs = dc_ptr + key.to(tl.int64) * R + offs_r
            tl.store(ptrs, tl.load(ptrs, mask=mask_r, other=0.0) + acc, mask=mask_r)


def _latent_block(rank: int) -> int:
    """BLOCK_R: the latent whole, a power of 2 (masked beyond R), at least 16 (an MMA's K)."""
    return max(16, triton.next_power_of_2(rank))


def _head_tile(heads: int) -> int:
    """A tile holding all of a query's heads: a power of 2, at least 16 rows (an MMA's M), at most MAX_HEADS."""
    return min(MAX_HEADS, max(16, triton.next_power_of_2(heads)))


def _blocks(heads: int, rank: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_W, BLOCK_R, warps) of the forward kernel (the fp32 dq kernel takes its BLOCK_H and
    warps). bf16 / fp16: all of a query's heads in one tile (at least 16 rows for the MMA, at most 64), the
    latent whole, slot blocks as large as the [BLOCK_H, R] accumulators leave registers for without a spill
    inside the slot loop (compiled for sm_90, at R 512: 64 heads x 32 slots, 64 slots in the loop spill; fewer
    heads x 64 slots). The slot block is the N of the score product s = q c^T, which Triton places on both
    warpgroups alike (its layout rule for a product feeding another: warps along M, and M is only 64 heads),
    as 64 x (BLOCK_W / 2) x 16 wgmma instructions: 16 slots made them 64 x 8 x 16, bound by reading the
    [64 x 16] q operand from shared memory once per 8 slots. fp32 (IEEE dots on CUDA cores, no tensor-core path to
    shape for): 16-head tiles, which compile without spills."""
    block_r = _latent_block(rank)
    if dtype == torch.float32:
        return 16, 16, block_r, 4
    block_h = _head_tile(heads)
    warps = 8 if block_h * block_r >= 64 * 256 else 4
    return block_h, 32 if block_h * block_r >= 64 * 512 else 64, block_r, warps


def _query_blocks(heads: int, rank: int, atomic: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_H, BLOCK_W, BLOCK_R, warps, stages) of the bf16 / fp16 backward (`_bwd_query_kernel`), chosen by
    compiling for sm_90 at R 512 (`benchmarks/sm90_compile.py`): the largest slot block whose loop keeps the fp32
    dq accumulator [BLOCK_H, R] and g^T [R, BLOCK_W] in registers without a spill. 64 heads: qdo [128, R], the M
    of two warpgroups; 32 slots with 2 pipeline stages (3 stages spill 6 loads / stores per iteration; the atomic
    variant's scattered addresses need 16 slots). 17 to 32 heads are padded to the 64-head tile: at 32 rows the
    score product is computed on both warpgroups and 16 slots still spill (25 per iteration); the padding costs
    tensor work only, where the kernel's gathers and buffer writes per query are the same. 16 heads or fewer: a
    16-head tile (qdo [32, R]) with 16 slots (the product's K is at least 16)."""
    block_r = _latent_block(rank)
    if heads > 16:
        return MAX_HEADS, 16 if atomic else 32, block_r, 8, 2
    return 16, 16, block_r, 8, 2


# the fp32 backward (`_bwd_slots_kernel`, `_bwd_dq_kernel`): slot blocks of 64 over the latent in sub-blocks of 32
# columns (all heads: a slot's gradient sums over them); dq over blocks of 16 slots in 16-head tiles
FP32_SLOT_BLOCK, FP32_SUB_R, FP32_DQ_SLOT_BLOCK = 64, 32, 16


def _modes(dtype: torch.dtype) -> tuple[bool, str]:
    return (
        backends.triton_interpreter_enabled() and dtype != torch.float32,
        "ieee" if dtype == torch.float32 else "tf32",
    )


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.stride())


def sparse_forward(
    q_lat: torch.Tensor, latent: torch.Tensor, tokens: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """o_lat [b, L, h, R] (q_lat's dtype) and lse [b, L, h] fp32 (natural log)."""
    b, length, heads, rank = q_lat.shape
    width = tokens.shape[-1]
    block_h, block_w, block_r, warps = _blocks(heads, rank, q_lat.dtype)
    upcast, precision = _modes(q_lat.dtype)
    out = torch.empty_like(q_lat)
    lse = torch.empty(b, length, heads, dtype=torch.float32, device=q_lat.device)
    if b * length == 0:
        return out, lse
    grid = (b * length, triton.cdiv(heads, block_h))
    _fwd_kernel[grid](
        q_lat, latent, tokens, out, lse, length, width, heads, rank, scaling * LOG2E,
        *_strides(q_lat), *_strides(latent), *_strides(tokens), *_strides(out),
        BLOCK_H=block_h, BLOCK_W=block_w, BLOCK_R=block_r, EVEN_R=rank == block_r, UPCAST=upcast,
        PRECISION=precision, num_warps=warps,
    )  # fmt: skip
    return out, lse


SEGMENT_BLOCK_E, SEGMENT_BLOCK_F = 256, 16


def sparse_backward(
    q_lat: torch.Tensor,
    latent: torch.Tensor,
    tokens: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    scaling: float,
    slot_grad_bytes: int = SLOT_GRAD_BYTES,
    latent_grad: str = "sorted",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq_lat [b, L, h, R], d_latent [b, L, R]). `latent_grad`: "sorted" (the default and the only one the model
    uses: deterministic, the slot gradients buffered and summed per key in a fixed order) or "atomic" (the slot
    gradients added into d_latent with fp32 atomics: no buffer, no sort, no segment sum, and not bitwise
    reproducible). "atomic" exists for `benchmarks/dsa_kernel.py` to measure against "sorted" on a GPU: the
    issue allows it as an option only where a measurement shows it pays."""
    if latent_grad not in ("sorted", "atomic"):
        raise ValueError(f"sparse attention kernel backward: latent_grad {latent_grad!r}: sorted or atomic")
    atomic = latent_grad == "atomic"
    b, length, heads, rank = q_lat.shape
    width, key_length = tokens.shape[-1], latent.shape[1]
    if heads > MAX_HEADS:
        raise ValueError(f"sparse attention kernel backward: {heads} heads per rank; at most {MAX_HEADS} (use "
                         "sequence parallelism, or attention_impl='sparse')")  # fmt: skip
    fp32 = q_lat.dtype == torch.float32
    upcast, precision = _modes(q_lat.dtype)
    grad_out = grad_out.contiguous()
    delta = (grad_out.float() * out.float()).sum(-1).contiguous()  # [b, L, h]
    dq = torch.empty_like(q_lat, memory_format=torch.contiguous_format)
    d_latent = torch.zeros(b * key_length, rank, dtype=torch.float32, device=latent.device)
    n_rows = b * length
    if n_rows == 0 or width == 0:
        return dq.zero_(), d_latent.view(b, key_length, rank).to(latent.dtype)
    strides = (*_strides(q_lat), *_strides(latent), *_strides(tokens))
    chunk = chunk_rows(width, rank, heads, slot_grad_bytes, q_lat.dtype, slot_gradients=not atomic)
    buffer = buffer_dtype(q_lat.dtype)
    block_r = _latent_block(rank)
    seg_r = min(block_r, 128)
    empty = b * key_length  # the key of an empty slot: sorted last, summed nowhere
    flat = tokens.reshape(n_rows, width)
    for row0 in range(0, n_rows, chunk):
        rows = min(chunk, n_rows - row0)
        g = torch.empty(0 if atomic else rows, width, rank, dtype=buffer, device=latent.device)
        if fp32:
            ds = torch.empty(rows, heads, width, dtype=torch.float32, device=latent.device)
            _bwd_slots_kernel[(rows, triton.cdiv(width, FP32_SLOT_BLOCK))](
                q_lat, latent, tokens, grad_out, lse, delta, g, ds, d_latent, row0, length, key_length, width, heads,
                rank, scaling, *strides, BLOCK_H=_head_tile(heads), BLOCK_W=FP32_SLOT_BLOCK, BLOCK_R=block_r,
                SUB_R=min(FP32_SUB_R, block_r), ATOMIC=atomic, PRECISION=precision, num_warps=8,
            )  # fmt: skip
            block_h, _, _, warps = _blocks(heads, rank, q_lat.dtype)
            _bwd_dq_kernel[(rows, triton.cdiv(heads, block_h))](
                latent, tokens, ds, dq, row0, length, width, heads, rank, *strides[4:],
                BLOCK_H=block_h, BLOCK_W=FP32_DQ_SLOT_BLOCK, BLOCK_R=block_r, EVEN_R=rank == block_r,
                PRECISION=precision, num_warps=warps,
            )  # fmt: skip
        else:
            block_h, block_w, _, warps, stages = _query_blocks(heads, rank, atomic)
            _bwd_query_kernel[(rows,)](
                q_lat, latent, tokens, grad_out, lse, delta, g, dq, d_latent, row0, length, key_length, width,
                heads, rank, scaling, *strides, BLOCK_H=block_h, BLOCK_W=block_w, BLOCK_R=block_r, EVEN_R=rank == block_r,
                ATOMIC=atomic, UPCAST=upcast, PRECISION=precision, num_warps=warps, num_stages=stages,
            )  # fmt: skip
        if atomic:
            continue
        # the chunk's references by the key token they read: int32, this chunk's rows only
        first = (
            torch.arange(row0, row0 + rows, device=tokens.device, dtype=torch.int32) // length * key_length
        )
        part = flat[row0 : row0 + rows]
        keys = torch.where(part >= 0, part + first[:, None], empty).flatten()
        sorted_keys, order = torch.sort(keys, stable=True)
        n = rows * width
        _segment_sum_kernel[(triton.cdiv(n, SEGMENT_BLOCK_E), triton.cdiv(rank, seg_r))](
            g, sorted_keys, order, d_latent, n, rank, empty,
            BLOCK_E=SEGMENT_BLOCK_E, BLOCK_F=SEGMENT_BLOCK_F, BLOCK_R=seg_r,
        )  # fmt: skip
    return dq, d_latent.view(b, key_length, rank).to(latent.dtype)


sparse_attention_op.IMPLEMENTATIONS["triton"] = (sparse_forward, sparse_backward)


def sparse_attention_triton(
    q_lat: torch.Tensor, latent: torch.Tensor, tokens: torch.Tensor, scaling: float
) -> torch.Tensor:
    """The kernels' o_lat [b, L, h, R] (rows without a valid slot: 0), differentiable in q_lat and latent."""
    if q_lat.dtype != latent.dtype or q_lat.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"sparse attention kernel: q_lat and latent must share one of float32 / bfloat16 / float16, got "
            f"{q_lat.dtype} and {latent.dtype}"
        )
    if q_lat.shape[-1] > 512:
        raise ValueError(f"sparse attention kernel: latent width {q_lat.shape[-1]} > 512 is not supported")
    return sparse_attention_fused(q_lat, latent, tokens.to(torch.int32), scaling)
