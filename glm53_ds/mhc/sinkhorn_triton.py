"""Fused Triton kernels for mHC's Sinkhorn normalisation (see `hyper_connection.sinkhorn` for the math).

In torch every one of the 2 * iters - 1 normalisations is a sum and a division over `[n, n, tokens]`, forward and
backward: at the released 20 iterations about 240 kernel launches per `hc_pre` call on a GPU, each on a few
kilobytes. Here each program holds a block of tokens' `[n, n]` matrices in registers:

- forward: one kernel; column normalisation, then `iters - 1` rounds of rows and columns, `d = sum + eps`,
  `y = x / d` (correctly rounded divisions, as torch's);
- backward: one kernel that keeps only the input. Step s's backward, dx = (dy - sum(dy * y)) / d, needs the input
  of step s, which it recomputes from the saved input in registers (steps 0 .. s-1): O(steps^2) normalisations of
  a 4 x 4 matrix per token (741 at 20 iterations), no memory traffic beyond the input and the gradients, where
  the torch Function keeps all 39 iterates and denominators.

Sums over the 4-wide dims are Triton's reduction trees, so values differ from torch's sequential sums by rounding
(fp32, ~1e-7 relative; the tests bound it). This module is imported lazily: `triton.jit` decides at decoration time
whether to use Triton's interpreter (`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_TOKENS = 64


@triton.jit
def _denominator(x, eps, AXIS: tl.constexpr):
    """sum over AXIS + eps for x [tokens, n, n] (AXIS 1: columns, 2: rows), broadcastable against x."""
    return tl.expand_dims(tl.sum(x, axis=AXIS) + eps, AXIS)


@triton.jit
def _normalise(x, eps, AXIS: tl.constexpr):
    return tl.math.div_rn(x, _denominator(x, eps, AXIS))


@triton.jit
def _tile(tokens, N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr):
    """This program's offsets into a contiguous [tokens, N, N] tensor and their mask ([BLOCK_T, NP, NP])."""
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_i = tl.arange(0, NP)
    offs_j = tl.arange(0, NP)
    offs = offs_t[:, None, None] * (N * N) + offs_i[None, :, None] * N + offs_j[None, None, :]
    mask = (offs_t < tokens)[:, None, None] & (offs_i < N)[None, :, None] & (offs_j < N)[None, None, :]
    return offs, mask


@triton.jit
def _sinkhorn_fwd_kernel(
    x_ptr, out_ptr, tokens, iters, eps, N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr
):
    offs, mask = _tile(tokens, N, NP, BLOCK_T)
    # padding entries are 0 and stay 0 (0 / (sum + eps)); they add nothing to a sum
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    x = _normalise(x, eps, 1)
    for _round in range(iters - 1):
        x = _normalise(x, eps, 2)
        x = _normalise(x, eps, 1)
    tl.store(out_ptr + offs, x, mask=mask)


@triton.jit
def _sinkhorn_bwd_kernel(
    x_ptr, grad_ptr, dx_ptr, tokens, iters, eps, N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr
):
    offs, mask = _tile(tokens, N, NP, BLOCK_T)
    x0 = tl.load(x_ptr + offs, mask=mask, other=0.0)
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0)
    steps = 2 * iters - 1  # columns on even steps, rows on odd ones
    for back in range(steps):
        step = steps - 1 - back
        x = x0  # the input of `step`, recomputed
        for _round in range(step // 2):
            x = _normalise(x, eps, 1)
            x = _normalise(x, eps, 2)
        if step % 2 == 1:
            x = _normalise(x, eps, 1)
            row_sums = _denominator(x, eps, 2)
            y = tl.math.div_rn(x, row_sums)
            g = tl.math.div_rn(g - tl.expand_dims(tl.sum(g * y, axis=2), 2), row_sums)
        else:
            column_sums = _denominator(x, eps, 1)
            y = tl.math.div_rn(x, column_sums)
            g = tl.math.div_rn(g - tl.expand_dims(tl.sum(g * y, axis=1), 1), column_sums)
    tl.store(dx_ptr + offs, g, mask=mask)


def _launch_shape(comb: torch.Tensor) -> tuple[int, int, int]:
    """(tokens, n, n padded to a power of two) of comb [..., n, n] (its contract: sinkhorn_op.check_contract)."""
    n = comb.shape[-1]
    return comb.numel() // (n * n), n, triton.next_power_of_2(n)


def sinkhorn_forward(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [..., n, n] fp32 -> the Sinkhorn-normalised [..., n, n] (contiguous)."""
    tokens, n, padded = _launch_shape(comb)
    x = comb.contiguous()
    out = torch.empty_like(x)
    if tokens:
        grid = (triton.cdiv(tokens, BLOCK_TOKENS),)
        _sinkhorn_fwd_kernel[grid](x, out, tokens, iters, eps, N=n, NP=padded, BLOCK_T=BLOCK_TOKENS)
    return out


def sinkhorn_backward(grad: torch.Tensor, comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The gradient of `sinkhorn_forward` at comb, from the output's gradient (both [..., n, n])."""
    tokens, n, padded = _launch_shape(comb)
    x, g = comb.contiguous(), grad.to(torch.float32).contiguous()
    dx = torch.empty_like(x)
    if tokens:
        grid = (triton.cdiv(tokens, BLOCK_TOKENS),)
        _sinkhorn_bwd_kernel[grid](x, g, dx, tokens, iters, eps, N=n, NP=padded, BLOCK_T=BLOCK_TOKENS)
    return dx
