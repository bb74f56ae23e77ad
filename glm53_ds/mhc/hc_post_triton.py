"""Fused Triton kernels for `hc_post` (see `hc_post_op.py` for the math and rounding contract).

Forward: one program per (token, block of D columns). It loads `x` once, each residual stream once, and the
token's `post [n]` / `comb [n, n]`, and writes all `n` output streams for its columns: the residual is read once
per token and no intermediate touches memory.

Backward: one program per token, looping over D in blocks. `grad_x` and `grad_residual` are written per block;
`grad_post [n]` and `grad_comb [n, n]` are reductions over D, accumulated in fp32 registers across the loop and
stored once (no atomics, deterministic), in their inputs' dtype.

This module is imported lazily: `triton.jit` decides at decoration time whether to use Triton's interpreter
(`TRITON_INTERPRET=1`), so the variable must be set before the first Triton `hc_post` call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round_fp32(x, dtype: tl.constexpr):
    """Round fp32 values to `dtype` (round to nearest even), returned as fp32.

    bf16 is rounded with integer ops: Triton's CPU interpreter truncates fp32->bf16 casts while GPUs round to
    nearest even, and the kernel must round the same way in both (HF's bf16 expression rounds to nearest even).
    The final store of an already-representable value is then exact under either cast.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (((bits >> 16) & 1) + 0x7FFF)
        bits = (bits >> 16) << 16
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _hc_post_fwd_kernel(
    x_ptr,
    res_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    D,
    stride_xt,
    stride_xd,
    stride_rt,
    stride_rh,
    stride_rd,
    stride_pt,
    stride_ph,
    stride_ct,
    stride_ci,
    stride_cj,
    stride_ot,
    stride_oh,
    stride_od,
    H: tl.constexpr,
    HP: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    offs_h = tl.arange(0, HP)
    mask_h = offs_h < H
    act = out_ptr.dtype.element_ty

    # post [HP], rounded to the activation dtype as HF's post.to(dtype)
    post = tl.load(post_ptr + t * stride_pt + offs_h * stride_ph, mask=mask_h, other=0.0)
    post = _round_fp32(post.to(tl.float32), act)
    x = tl.load(x_ptr + t * stride_xt + offs_d * stride_xd, mask=mask_d, other=0.0).to(tl.float32)
    expanded = post[:, None] * x[None, :]  # [HP, BLOCK_D]

    mixed = tl.zeros([HP, BLOCK_D], dtype=tl.float32)
    for hp in tl.static_range(H):
        r = tl.load(res_ptr + t * stride_rt + hp * stride_rh + offs_d * stride_rd, mask=mask_d, other=0.0)
        # comb[hp, :]: the weights from old stream hp to every new stream h
        c = tl.load(comb_ptr + t * stride_ct + hp * stride_ci + offs_h * stride_cj, mask=mask_h, other=0.0)
        c = _round_fp32(c.to(tl.float32), act)
        mixed += c[:, None] * r.to(tl.float32)[None, :]

    out = _round_fp32(_round_fp32(expanded, act) + _round_fp32(mixed, act), act)
    out_ptrs = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(out_ptrs, out.to(act), mask=mask_h[:, None] & mask_d[None, :])


@triton.jit
def _hc_post_bwd_kernel(
    g_ptr,
    x_ptr,
    res_ptr,
    post_ptr,
    comb_ptr,
    gx_ptr,
    gres_ptr,
    gpost_ptr,
    gcomb_ptr,
    D,
    stride_gt,
    stride_gh,
    stride_gd,
    stride_xt,
    stride_xd,
    stride_rt,
    stride_rh,
    stride_rd,
    stride_pt,
    stride_ph,
    stride_ct,
    stride_ci,
    stride_cj,
    stride_gxt,
    stride_gxd,
    stride_grt,
    stride_grh,
    stride_grd,
    stride_gpt,
    stride_gph,
    stride_gct,
    stride_gci,
    stride_gcj,
    H: tl.constexpr,
    HP: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, HP)
    mask_h = offs_h < H
    act = gres_ptr.dtype.element_ty

    post = tl.load(post_ptr + t * stride_pt + offs_h * stride_ph, mask=mask_h, other=0.0)
    post = _round_fp32(post.to(tl.float32), act)
    grad_post = tl.zeros([HP], dtype=tl.float32)
    grad_comb = tl.zeros([HP, HP], dtype=tl.float32)

    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        mask_hd = mask_h[:, None] & mask_d[None, :]
        g = tl.load(
            g_ptr + t * stride_gt + offs_h[:, None] * stride_gh + offs_d[None, :] * stride_gd,
            mask=mask_hd,
            other=0.0,
        ).to(tl.float32)  # [HP, BLOCK_D]
        x = tl.load(x_ptr + t * stride_xt + offs_d * stride_xd, mask=mask_d, other=0.0).to(tl.float32)

        grad_x = tl.sum(post[:, None] * g, axis=0)  # sum_h post[h] g[h]
        tl.store(
            gx_ptr + t * stride_gxt + offs_d * stride_gxd,
            _round_fp32(grad_x, gx_ptr.dtype.element_ty).to(gx_ptr.dtype.element_ty),
            mask=mask_d,
        )
        grad_post += tl.sum(g * x[None, :], axis=1)

        for hp in tl.static_range(H):
            c = tl.load(
                comb_ptr + t * stride_ct + hp * stride_ci + offs_h * stride_cj, mask=mask_h, other=0.0
            )
            c = _round_fp32(c.to(tl.float32), act)
            grad_r = tl.sum(c[:, None] * g, axis=0)  # sum_h comb[hp, h] g[h]
            tl.store(
                gres_ptr + t * stride_grt + hp * stride_grh + offs_d * stride_grd,
                _round_fp32(grad_r, act).to(act),
                mask=mask_d,
            )
            r = tl.load(res_ptr + t * stride_rt + hp * stride_rh + offs_d * stride_rd, mask=mask_d, other=0.0)
            row = tl.sum(g * r.to(tl.float32)[None, :], axis=1)  # [h] -> grad_comb[hp, h]
            grad_comb += tl.where(offs_h[:, None] == hp, row[None, :], 0.0)

    tl.store(
        gpost_ptr + t * stride_gpt + offs_h * stride_gph,
        _round_fp32(grad_post, gpost_ptr.dtype.element_ty).to(gpost_ptr.dtype.element_ty),
        mask=mask_h,
    )
    tl.store(
        gcomb_ptr + t * stride_gct + offs_h[:, None] * stride_gci + offs_h[None, :] * stride_gcj,
        _round_fp32(grad_comb, gcomb_ptr.dtype.element_ty).to(gcomb_ptr.dtype.element_ty),
        mask=mask_h[:, None] & mask_h[None, :],
    )


def _block_d(d: int, hp: int) -> int:
    # Keep the [HP, BLOCK_D] fp32 tiles at <= 4096 elements per program (registers), at least 16 wide.
    return max(16, min(triton.next_power_of_2(d), 4096 // hp))


def _flatten(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collapse the leading dims into one token dim. Strides are passed to the kernels, so non-contiguous inputs
    are read in place whenever the leading dims can be viewed as one; otherwise reshape copies."""
    n, d = residual.shape[-2:]
    return x.reshape(-1, d), residual.reshape(-1, n, d), post.reshape(-1, n), comb.reshape(-1, n, n)


def hc_post_forward(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    n, d = residual.shape[-2:]
    out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    x2, r3, p2, c3 = _flatten(x, residual, post, comb)
    tokens = r3.shape[0]
    if tokens == 0 or d == 0:
        return out
    o3 = out.view(-1, n, d)
    hp = triton.next_power_of_2(n)
    block_d = _block_d(d, hp)
    grid = (tokens, triton.cdiv(d, block_d))
    _hc_post_fwd_kernel[grid](
        x2,
        r3,
        p2,
        c3,
        o3,
        d,
        *x2.stride(),
        *r3.stride(),
        *p2.stride(),
        *c3.stride(),
        *o3.stride(),
        H=n,
        HP=hp,
        BLOCK_D=block_d,
    )
    return out


def hc_post_backward(
    grad_out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n, d = residual.shape[-2:]
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grad_res = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    grad_post = torch.zeros(post.shape, dtype=post.dtype, device=post.device)
    grad_comb = torch.zeros(comb.shape, dtype=comb.dtype, device=comb.device)
    x2, r3, p2, c3 = _flatten(x, residual, post, comb)
    tokens = r3.shape[0]
    if tokens == 0 or d == 0:
        return grad_x, grad_res, grad_post, grad_comb
    g3 = grad_out.reshape(-1, n, d)
    gx2, gr3 = grad_x.view(-1, d), grad_res.view(-1, n, d)
    gp2, gc3 = grad_post.view(-1, n), grad_comb.view(-1, n, n)
    hp = triton.next_power_of_2(n)
    block_d = _block_d(d, hp)
    _hc_post_bwd_kernel[(tokens,)](
        g3,
        x2,
        r3,
        p2,
        c3,
        gx2,
        gr3,
        gp2,
        gc3,
        d,
        *g3.stride(),
        *x2.stride(),
        *r3.stride(),
        *p2.stride(),
        *c3.stride(),
        *gx2.stride(),
        *gr3.stride(),
        *gp2.stride(),
        *gc3.stride(),
        H=n,
        HP=hp,
        BLOCK_D=block_d,
    )
    return grad_x, grad_res, grad_post, grad_comb
