"""The block-FP8 grouped GEMM for CUDA (layers/block_fp8.py has the contract and the torch reference).

`grouped_mm(x, weight, offs, transpose)`: rows `x [N, k]` in groups (`offs`: each group's end, int32 on the device)
times their group's weight, `W^T` (`transpose`: the forward) or `W` (the input gradient), W dequantised tile by tile:
each program takes BLOCK_M rows of one group and BLOCK_N output columns, and per step of BLOCK_K loads the FP8 tile
of W, its block scales (through the row / column block tables), dequantises it in registers exactly as the reference
does (`fp8 -> fp32`, times the fp32 scale, rounded to nearest even once to the activation dtype) and feeds the
tensor cores; nothing of W is ever written dequantised. fp32 accumulation; the sums' order is the kernel's, not
cuBLAS's (the bound against the reference is stated by its test).

No host sync: the group of a program is found on the device (the running count of each group's row tiles, one
vector load per program); programs past the last tile return at once. The FP8 bytes are decoded with integer
operations (e4m3fn: sign, 4-bit exponent of bias 7, 3-bit mantissa, subnormals; its one NaN code), the same on a GPU
and in Triton's interpreter, where the tests run it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..mhc.hc_post_triton import _round_fp32

# (BLOCK_M, BLOCK_N, BLOCK_K): bf16 / fp16 on wgmma, two warpgroups of 64 x 64 x 16 (benchmarks/sm90_compile.py:
# 145 registers, no spill under Triton 3.9, 138-192 under the GPU image's 3.6; with 4 warps, one 64 x 128 x 16
# warpgroup, 3.9 needed 247 and 3.6 spilled inside the K loop); fp32 (FMA, no tensor cores) in tiles a thread's
# registers hold
TILES = {2: (64, 128, 64), 4: (32, 64, 16)}
WARPS = {2: 8, 4: 4}


@triton.jit
def _e4m3_to_fp32(bits):
    """float8_e4m3fn bytes (uint8) -> fp32 values."""
    b = bits.to(tl.int32)
    exponent = (b >> 3) & 0xF
    mantissa = b & 0x7
    normal = ((b & 0x80) << 24) | ((exponent + 120) << 23) | (mantissa << 20)  # 127 - 7 = 120
    value = tl.where(
        exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True)
    )
    value = tl.where((exponent == 0) & ((b & 0x80) != 0), -value, value)  # subnormals' sign
    return tl.where((b & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def _block_fp8_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, k_block_ptr, o_block_ptr, offs_ptr, tile_end_ptr, out_ptr,
    K, O, E,  # noqa: E741
    stride_xm, stride_xk, stride_we, stride_wk, stride_wo, stride_se, stride_sk, stride_so, stride_om, stride_oo,
    E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    groups = tl.arange(0, E_POW2)
    tile_ends = tl.load(tile_end_ptr + groups, mask=groups < E, other=2**30)
    group = tl.sum((tile_ends <= pid_m).to(tl.int32), 0)  # the group whose tiles hold this one
    if group >= E:
        return
    tiles_before = tl.load(tile_end_ptr + group - 1, mask=group > 0, other=0)
    row_start = tl.load(offs_ptr + group - 1, mask=group > 0, other=0)
    row_end = tl.load(offs_ptr + group)
    rows = row_start + (pid_m - tiles_before) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < row_end, cols < O
    o_block = tl.load(o_block_ptr + cols, mask=col_ok, other=0)
    w_group = w_ptr + group.to(tl.int64) * stride_we
    s_group = scale_ptr + group.to(tl.int64) * stride_se
    act = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        tile_ok = k_ok[:, None] & col_ok[None, :]
        bits = tl.load(w_group + ks[:, None] * stride_wk + cols[None, :] * stride_wo, mask=tile_ok, other=0)
        k_block = tl.load(k_block_ptr + ks, mask=k_ok, other=0)
        scale = tl.load(s_group + k_block[:, None] * stride_sk + o_block[None, :] * stride_so, mask=tile_ok,
                        other=0.0)  # fmt: skip
        w = _round_fp32(_e4m3_to_fp32(bits) * scale, act)  # the reference's rounding, exactly
        w = tl.where(tile_ok, w, 0.0)
        if act == tl.float32 or INTERPRETED:  # fp32 as fp32, not TF32 (the interpreter's dot takes no bf16)
            acc += tl.dot(a.to(tl.float32), w, input_precision="ieee")
        else:  # the same products (bf16 values multiply exactly in fp32), on the tensor cores
            acc += tl.dot(a.to(act), w.to(act))
    out = _round_fp32(acc, act).to(act)  # to nearest even in the interpreter too (it truncates a plain cast)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_oo, out,
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


def grouped_mm(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, row_block: torch.Tensor,
               col_block: torch.Tensor, offs: torch.Tensor, transpose: bool) -> torch.Tensor:  # fmt: skip
    """x [N, k] -> [N, out]: each group's rows times its dequantised weight (W^T when `transpose`); the weight as
    `block_fp8.BlockFp8Weight` holds it (data [E, rows, cols] FP8, scale [E, nR, nC], the two block tables)."""
    if data.dtype != torch.float8_e4m3fn:
        raise ValueError(f"the block-FP8 kernel reads float8_e4m3fn weights, got {data.dtype}")
    e = data.shape[0]
    # W^T [k, o] = W [o, k]: k runs along W's columns (the column blocks), o along its rows
    k_axis, o_axis = (2, 1) if transpose else (1, 2)
    k_block, o_block = (col_block, row_block) if transpose else (row_block, col_block)
    k_size, o_size = data.shape[k_axis], data.shape[o_axis]
    stride_wk, stride_wo, stride_sk, stride_so = (
        data.stride(k_axis), data.stride(o_axis), scale.stride(k_axis), scale.stride(o_axis)
    )  # fmt: skip
    if x.shape[1] != k_size:
        raise ValueError(f"block-FP8 GEMM: rows of {x.shape[1]} features for a weight of {k_size}")
    out = torch.empty(x.shape[0], o_size, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = TILES[x.element_size()]
    counts = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
    tile_end = torch.cumsum(torch.div(counts + block_m - 1, block_m, rounding_mode="floor"), 0).to(
        torch.int32
    )
    grid = (
        triton.cdiv(x.shape[0], block_m) + e,
        triton.cdiv(o_size, block_n),
    )  # at most one partial tile a group
    bits = data.view(torch.uint8)
    _block_fp8_gemm_kernel[grid](
        x, bits, scale, k_block, o_block, offs, tile_end, out, k_size, o_size, e,
        x.stride(0), x.stride(1), bits.stride(0), stride_wk, stride_wo, scale.stride(0), stride_sk, stride_so,
        out.stride(0), out.stride(1),
        E_POW2=triton.next_power_of_2(e), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1", num_warps=WARPS[x.element_size()],
    )  # fmt: skip
    return out
