"""Fused Triton kernels for DSA sparse attention in the absorbed latent form (contract: `sparse_attention.py`).

    q_lat [b, L, h, R], latent [b, L, R], tokens [b, L, W] int32 (-1 = empty) -> o_lat [b, L, h, R]

Forward (`_fwd_kernel`): one program per (query, block of heads). It walks the query's W slots in blocks, gathers
the selected latent rows [BLOCK_W, R] once for all its heads, and runs an online softmax: s = q_lat c^T (a
[heads x R] x [R x BLOCK_W] dot), acc = sum p c. It writes o_lat and the log-sum-exp per head; nothing of size
[L, W] or [L, L] touches memory. A query with no valid slot writes 0 and lse = -inf (the wrapper's blind-row rule
replaces such rows).

Backward, deterministic (no floating-point atomics anywhere):
  - `_bwd_dq_kernel`, one program per (query, block of heads): recomputes p from the lse, dp = dO c^T,
    ds = p (dp - delta) with delta = sum_r dO o, and dq_lat = scaling · ds c.
  - `_bwd_slots_kernel`, one program per (query, block of slots), all heads in a loop: each slot's latent gradient
    g = scaling · ds^T q_lat + p^T dO, written to a buffer [rows, W, R] for a chunk of queries.
  - `_segment_sum_kernel`, one program per (key token, block of R): the chunk's slots sorted by the token they read
    (a stable sort, the inverse token -> slots map) and summed in that fixed order into d_latent.
  The buffer is filled chunk by chunk of query rows (`SLOT_GRAD_BYTES`), so memory stays bounded at any length.

bf16 or fp32 operands, fp32 accumulation (fp32 dots in IEEE precision, not TF32). R and h need not be powers of 2
(masked); R up to 512 (the released kv_lora_rank). Triton's CPU interpreter (TRITON_INTERPRET=1) computes bf16
dots wrongly (triton 3.9), so there the operands are upcast to fp32 first: the same products (bf16 x bf16 is exact
in fp32), the same fp32 accumulation.

This module is imported lazily: `triton.jit` decides at decoration time whether to use Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import backends

# The per-slot latent gradients of one chunk of query rows stay under this many bytes (fp32 [rows, W, R]).
SLOT_GRAD_BYTES = 1 << 30


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _load_slots(t_ptr, c_ptr, bi, i, offs_w, W, offs_r, mask_r, s_tb, s_tl, s_tw, s_cb, s_cl, s_cr):
    """Query i's slots offs_w: which are valid, and their latent rows [BLOCK_W, BLOCK_R] (0 where not)."""
    tok = tl.load(t_ptr + bi * s_tb + i * s_tl + offs_w * s_tw, mask=offs_w < W, other=-1).to(tl.int64)
    valid = tok >= 0
    c = tl.load(
        c_ptr + bi * s_cb + tok[:, None] * s_cl + offs_r[None, :] * s_cr,
        mask=valid[:, None] & mask_r[None, :], other=0.0,
    )  # fmt: skip
    return valid, c


@triton.jit
def _fwd_kernel(
    q_ptr, c_ptr, t_ptr, o_ptr, lse_ptr,
    L, W, H, R, scaling,
    s_qb, s_ql, s_qh, s_qr,
    s_cb, s_cl, s_cr,
    s_tb, s_tl, s_tw,
    s_ob, s_ol, s_oh, s_or,
    BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr,
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

    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for w0 in range(0, W, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        valid, c = _load_slots(
            t_ptr, c_ptr, bi, i, offs_w, W, offs_r, mask_r, s_tb, s_tl, s_tw, s_cb, s_cl, s_cr
        )  # [BLOCK_W], [BLOCK_W, BLOCK_R]
        s = _dot(q, tl.trans(c), UPCAST, PRECISION) * scaling  # [BLOCK_H, BLOCK_W]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(c.dtype), c, UPCAST, PRECISION)
        m = m_new
    seen = denom > 0
    out = acc / tl.where(seen, denom, 1.0)[:, None]
    tl.store(
        o_ptr + bi * s_ob + i * s_ol + offs_h[:, None] * s_oh + offs_r[None, :] * s_or,
        out.to(o_ptr.dtype.element_ty), mask=q_mask,
    )  # fmt: skip
    lse = tl.where(seen, m + tl.log(tl.where(seen, denom, 1.0)), float("-inf"))
    tl.store(lse_ptr + row * H + offs_h, lse, mask=mask_h)


@triton.jit
def _bwd_dq_kernel(
    q_ptr, c_ptr, t_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    L, W, H, R, scaling,
    s_qb, s_ql, s_qh, s_qr,
    s_cb, s_cl, s_cr,
    s_tb, s_tl, s_tw,
    BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dO, dq are contiguous [b, L, H, R]; lse, delta contiguous [b, L, H]."""
    row = tl.program_id(0).to(tl.int64)
    bi, i = row // L, row % L
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    mask_h, mask_r = offs_h < H, offs_r < R
    q_mask = mask_h[:, None] & mask_r[None, :]
    q = tl.load(
        q_ptr + bi * s_qb + i * s_ql + offs_h[:, None] * s_qh + offs_r[None, :] * s_qr, mask=q_mask, other=0.0
    )
    dense = row * H * R + offs_h[:, None] * R + offs_r[None, :]
    do = tl.load(do_ptr + dense, mask=q_mask, other=0.0)
    lse = tl.load(lse_ptr + row * H + offs_h, mask=mask_h, other=float("-inf"))
    delta = tl.load(delta_ptr + row * H + offs_h, mask=mask_h, other=0.0)
    lse_safe = tl.where(lse == float("-inf"), float("inf"), lse)  # rows without slots: p = 0

    dq = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for w0 in range(0, W, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        valid, c = _load_slots(
            t_ptr, c_ptr, bi, i, offs_w, W, offs_r, mask_r, s_tb, s_tl, s_tw, s_cb, s_cl, s_cr
        )  # [BLOCK_W], [BLOCK_W, BLOCK_R]
        s = _dot(q, tl.trans(c), UPCAST, PRECISION) * scaling
        p = tl.where(valid[None, :], tl.exp(s - lse_safe[:, None]), 0.0)  # [BLOCK_H, BLOCK_W]
        dp = _dot(do, tl.trans(c), UPCAST, PRECISION)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(c.dtype), c, UPCAST, PRECISION)
    tl.store(dq_ptr + dense, (dq * scaling).to(dq_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _bwd_slots_kernel(
    q_ptr, c_ptr, t_ptr, do_ptr, lse_ptr, delta_ptr, g_ptr,
    row0, L, W, H, R, scaling,
    s_qb, s_ql, s_qh, s_qr,
    s_cb, s_cl, s_cr,
    s_tb, s_tl, s_tw,
    BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """g [rows, W, R] fp32: the latent gradient each slot of query rows row0 ... row0 + rows - 1 sends."""
    local = tl.program_id(0).to(tl.int64)
    row = row0 + local
    bi, i = row // L, row % L
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_r = tl.arange(0, BLOCK_R)
    mask_w, mask_r = offs_w < W, offs_r < R
    valid, c = _load_slots(
        t_ptr, c_ptr, bi, i, offs_w, W, offs_r, mask_r, s_tb, s_tl, s_tw, s_cb, s_cl, s_cr
    )  # [BLOCK_W], [BLOCK_W, BLOCK_R]
    g = tl.zeros([BLOCK_W, BLOCK_R], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        q_mask = mask_h[:, None] & mask_r[None, :]
        q = tl.load(
            q_ptr + bi * s_qb + i * s_ql + offs_h[:, None] * s_qh + offs_r[None, :] * s_qr,
            mask=q_mask,
            other=0.0,
        )
        do = tl.load(do_ptr + row * H * R + offs_h[:, None] * R + offs_r[None, :], mask=q_mask, other=0.0)
        lse = tl.load(lse_ptr + row * H + offs_h, mask=mask_h, other=float("-inf"))
        delta = tl.load(delta_ptr + row * H + offs_h, mask=mask_h, other=0.0)
        lse_safe = tl.where(lse == float("-inf"), float("inf"), lse)
        s = _dot(q, tl.trans(c), UPCAST, PRECISION) * scaling
        p = tl.where(valid[None, :], tl.exp(s - lse_safe[:, None]), 0.0)  # [BLOCK_H, BLOCK_W]
        dp = _dot(do, tl.trans(c), UPCAST, PRECISION)
        ds = p * (dp - delta[:, None]) * scaling
        g += _dot(tl.trans(ds).to(q.dtype), q, UPCAST, PRECISION)
        g += _dot(tl.trans(p).to(do.dtype), do, UPCAST, PRECISION)
    ptrs = g_ptr + local * W * R + offs_w[:, None] * R + offs_r[None, :]
    tl.store(ptrs, g, mask=mask_w[:, None] & mask_r[None, :])


@triton.jit
def _segment_sum_kernel(
    g_ptr, order_ptr, starts_ptr, dc_ptr, R,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    """dc [b * L, R] fp32 += the slot gradients of each key token, in the sorted order (deterministic)."""
    key = tl.program_id(0).to(tl.int64)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    start = tl.load(starts_ptr + key)
    end = tl.load(starts_ptr + key + 1)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for e in range(start, end):
        slot = tl.load(order_ptr + e)
        acc += tl.load(g_ptr + slot * R + offs_r, mask=mask_r, other=0.0)
    ptrs = dc_ptr + key * R + offs_r
    tl.store(ptrs, tl.load(ptrs, mask=mask_r, other=0.0) + acc, mask=mask_r)


def _blocks(heads: int, rank: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_W, BLOCK_R): dots want every side >= 16; the [BLOCK_H, R] accumulator bounds BLOCK_H."""
    block_r = max(16, triton.next_power_of_2(rank))
    block_h = max(16, min(triton.next_power_of_2(heads), 64 if block_r <= 128 else 16))
    return block_h, 32 if block_r <= 256 else 16, block_r


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
    """o_lat [b, L, h, R] (q_lat's dtype) and lse [b, L, h] fp32."""
    b, length, heads, rank = q_lat.shape
    width = tokens.shape[-1]
    block_h, block_w, block_r = _blocks(heads, rank)
    upcast, precision = _modes(q_lat.dtype)
    out = torch.empty_like(q_lat)
    lse = torch.empty(b, length, heads, dtype=torch.float32, device=q_lat.device)
    if b * length == 0:
        return out, lse
    grid = (b * length, triton.cdiv(heads, block_h))
    _fwd_kernel[grid](
        q_lat, latent, tokens, out, lse, length, width, heads, rank, scaling,
        *_strides(q_lat), *_strides(latent), *_strides(tokens), *_strides(out),
        BLOCK_H=block_h, BLOCK_W=block_w, BLOCK_R=block_r, UPCAST=upcast, PRECISION=precision,
    )  # fmt: skip
    return out, lse


def sparse_backward(
    q_lat: torch.Tensor,
    latent: torch.Tensor,
    tokens: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    scaling: float,
    slot_grad_bytes: int = SLOT_GRAD_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq_lat [b, L, h, R], d_latent [b, L, R]), deterministic."""
    b, length, heads, rank = q_lat.shape
    width = tokens.shape[-1]
    block_h, block_w, block_r = _blocks(heads, rank)
    upcast, precision = _modes(q_lat.dtype)
    grad_out = grad_out.contiguous()
    delta = (grad_out.float() * out.float()).sum(-1).contiguous()  # [b, L, h]
    dq = torch.empty_like(q_lat, memory_format=torch.contiguous_format)
    d_latent = torch.zeros(b * length, rank, dtype=torch.float32, device=latent.device)
    n_rows = b * length
    if n_rows == 0 or width == 0:
        return dq.zero_(), d_latent.view(b, length, rank).to(latent.dtype)
    common = (length, width, heads, rank, scaling, *_strides(q_lat), *_strides(latent), *_strides(tokens))
    meta = dict(BLOCK_H=block_h, BLOCK_W=block_w, BLOCK_R=block_r, UPCAST=upcast, PRECISION=precision)
    _bwd_dq_kernel[(n_rows, triton.cdiv(heads, block_h))](
        q_lat, latent, tokens, grad_out, lse, delta, dq, *common, **meta
    )

    # the flat key each slot reads (b * L for an empty slot: sorted last, summed nowhere)
    batch_offset = (torch.arange(b, device=tokens.device) * length)[:, None, None]
    keys = torch.where(tokens >= 0, tokens.long() + batch_offset, n_rows).reshape(n_rows, width)
    chunk = max(1, slot_grad_bytes // max(1, width * rank * 4))
    key_index = torch.arange(n_rows + 1, device=tokens.device)
    seg_block = min(block_r, 128)
    for row0 in range(0, n_rows, chunk):
        rows = min(chunk, n_rows - row0)
        g = torch.empty(rows, width, rank, dtype=torch.float32, device=latent.device)
        _bwd_slots_kernel[(rows, triton.cdiv(width, block_w))](
            q_lat, latent, tokens, grad_out, lse, delta, g, row0, *common, **meta
        )
        sorted_keys, order = torch.sort(keys[row0 : row0 + rows].flatten(), stable=True)
        starts = torch.searchsorted(
            sorted_keys, key_index
        )  # [n_rows + 1]: each key's run in the sorted order
        _segment_sum_kernel[(n_rows, triton.cdiv(rank, seg_block))](
            g, order, starts, d_latent, rank, BLOCK_R=seg_block
        )
    return dq, d_latent.view(b, length, rank).to(latent.dtype)


class _SparseLatentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_lat, latent, tokens, scaling):
        out, lse = sparse_forward(q_lat, latent, tokens, scaling)
        ctx.save_for_backward(q_lat, latent, tokens, out, lse)
        ctx.scaling = scaling
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q_lat, latent, tokens, out, lse = ctx.saved_tensors
        dq, d_latent = sparse_backward(q_lat, latent, tokens, out, lse, grad_out, ctx.scaling)
        return dq, d_latent, None, None


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
    return _SparseLatentAttention.apply(q_lat, latent, tokens.to(torch.int32), float(scaling))
