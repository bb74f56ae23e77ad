"""Manifold-constrained hyper-connections (mHC): the `hc_pre` half and the stream helpers.

Each decoder layer keeps `n = hc_mult` residual streams `[..., n, D]`. Before a sub-block (attention or FFN),
`HyperConnection` reads all streams and produces
  - `collapsed [..., D]`: the sub-block input, a `pre`-weighted sum of the streams,
  - `post [..., n]`: how the sub-block output is written back to each stream,
  - `comb [..., n, n]`: a doubly-stochastic mixing of the old streams (Sinkhorn-normalised).
`hc_post` (in `hc_post_op.py`) then forms `out[h] = post[h] * y + sum_h' comb[h', h] * streams[h']`.

The numerics follow `transformers==5.23.0` `Glm5NextTextHyperConnection` operation by operation:
the flattened streams are RMS-normalised without a weight **in fp32 with the text config's `rms_norm_eps`**
(not `hc_eps`), projected by `fn` in fp32 (a bf16 `fn` is upcast), and the first Sinkhorn step is
`torch.softmax` (a hand-written softmax differs by ~6e-8 and flips bf16 roundings downstream).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import backends
from .sinkhorn_op import sinkhorn_fused


def sinkhorn(comb: torch.Tensor, iters: int, eps: float, impl: str = "torch") -> torch.Tensor:
    """Make `comb [..., n, n]` (positive, rows already softmax-normalised) approximately doubly stochastic.

    HF's schedule: one column normalisation, then `iters - 1` rounds of row and column normalisation,
    each with `eps` added to the denominator.

    The normalisations run with the tokens last (`_TokensLastSinkhorn`): a sum over a 4-wide dim that is innermost
    is torch's slow case, over an outer one it is vector adds. With its backward written out, fwd + bwd of 1,024
    tokens at the released n = 4 and 20 iterations takes 2.3 ms instead of autograd's 8.4 over the plain loop (1 CPU
    thread; 8,192 tokens: 17 vs 62 ms), with the same forward values and gradients within fp32 rounding; compiled
    (inductor traces the Function), 3.05 ms instead of the plain loop's 4.35.

    `impl` (a resolved `sinkhorn_impl`, glm53_ds/backends.py): `torch` = that Function; `triton` = the fused kernels
    (`sinkhorn_op.py`: one kernel forward, one backward, which keeps only comb), for a GPU, where the Function is
    about 240 small kernel launches per call.
    """
    if impl == "triton":
        return sinkhorn_fused(comb, iters, eps)
    return _TokensLastSinkhorn.apply(comb, iters, eps)


def _schedule(iters: int) -> list[int]:
    """The dim of `[n, n, ...]` each normalisation sums over: columns (0), then rows (1) and columns."""
    return [0] + [1, 0] * (iters - 1)


class _TokensLastSinkhorn(torch.autograd.Function):
    """`sinkhorn` on `[n, n, ...]` (the tokens last); it keeps every iterate and denominator, as autograd would,
    and each step's backward is one line: y = x / d, d = sum(x) + eps  =>  dx = (dy - sum(dy * y)) / d."""

    @staticmethod
    def forward(ctx: Any, comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        x = comb.movedim((-2, -1), (0, 1)).contiguous()  # [n, n, ...]
        schedule = _schedule(iters)
        iterates, denominators = [], []
        for dim in schedule:
            denominators.append(x.sum(dim=dim, keepdim=True) + eps)
            x = x / denominators[-1]
            iterates.append(x)
        ctx.save_for_backward(*iterates, *denominators)
        ctx.schedule = schedule
        return x.movedim((0, 1), (-2, -1)).contiguous()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        steps = len(ctx.schedule)
        iterates, denominators = saved[:steps], saved[steps:]
        g = grad.movedim((-2, -1), (0, 1)).contiguous()
        for dim, y, d in zip(reversed(ctx.schedule), reversed(iterates), reversed(denominators), strict=True):
            g = (g - (g * y).sum(dim=dim, keepdim=True)) / d
        return g.movedim((0, 1), (-2, -1)), None, None


class HyperConnection(nn.Module):
    """`hc_pre` of one sub-block: streams `[..., n, D]` -> `(collapsed [..., D], post [..., n], comb [..., n, n])`.

    Parameters (HF names and init): `fn [(2+n)*n, n*D]` ~ N(0, 0.02), `base [(2+n)*n]` = 0, `scale [3]` = 1.
    `base` and `scale` are fp32 (HF's `_keep_in_fp32_modules_strict`); `fn` is fp32 by default and may be kept
    in bf16 (`fn_dtype`), as a model loaded in bf16 has it: it is upcast for the fp32 projection either way.
    `collapsed` has the streams' dtype; `post` and `comb` are fp32. `sinkhorn_impl` (`auto`, `torch`, `triton`;
    glm53_ds/backends.py) picks Sinkhorn's kernels, resolved per call from the streams' device.
    """

    def __init__(
        self,
        hidden_size: int,
        hc_mult: int,
        hc_eps: float,
        sinkhorn_iters: int,
        norm_eps: float,
        *,
        fn_dtype: torch.dtype = torch.float32,
        sinkhorn_impl: str = "auto",
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if hc_mult < 1:
            raise ValueError(f"hc_mult must be >= 1, got {hc_mult}")
        if sinkhorn_iters < 1:
            raise ValueError(f"sinkhorn_iters must be >= 1, got {sinkhorn_iters}")
        self.hidden_size = hidden_size
        self.hc_mult = hc_mult
        self.hc_eps = float(hc_eps)
        self.sinkhorn_iters = sinkhorn_iters
        self.norm_eps = float(norm_eps)
        self.sinkhorn_impl = backends.check(backends.SINKHORN, sinkhorn_impl)
        n = hc_mult
        mix_size = (2 + n) * n  # pre (n) + post (n) + comb (n*n)
        self.fn = nn.Parameter(torch.empty(mix_size, n * hidden_size, dtype=fn_dtype, device=device))
        self.base = nn.Parameter(torch.empty(mix_size, dtype=torch.float32, device=device))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            nn.init.normal_(self.fn, mean=0.0, std=0.02)
            nn.init.zeros_(self.base)
            nn.init.ones_(self.scale)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, hc_mult={self.hc_mult}, hc_eps={self.hc_eps}, "
            f"sinkhorn_iters={self.sinkhorn_iters}, norm_eps={self.norm_eps}"
        )

    def mixing_weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(pre [..., n], post [..., n], comb [..., n, n])`, all fp32."""
        n = self.hc_mult
        if streams.dim() < 2 or streams.shape[-2:] != (n, self.hidden_size):
            raise ValueError(
                f"HyperConnection expects streams [..., hc_mult={n}, hidden={self.hidden_size}], "
                f"got shape {tuple(streams.shape)}"
            )
        # [..., n, D] -> [..., n*D], unweighted RMS norm in fp32 with the text rms_norm_eps
        flat = streams.flatten(-2).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        # [..., n*D] -> [..., (2+n)*n], fp32 projection even when fn is stored in bf16
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)

        comb_w = comb_w.unflatten(-1, (n, n))  # [..., n, n]
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = torch.softmax(comb_w * comb_scale + comb_b.view(n, n), dim=-1) + self.hc_eps
        impl = backends.resolve(backends.SINKHORN, self.sinkhorn_impl, comb.device)
        comb = sinkhorn(comb, self.sinkhorn_iters, self.hc_eps, impl)
        return pre, post, comb

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pre, post, comb = self.mixing_weights(streams)
        # [..., n, D] -> [..., D]: fp32 weighted sum (bf16 streams promote), returned in the streams' dtype
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
        return collapsed, post, comb


def hc_head(streams: torch.Tensor) -> torch.Tensor:
    """Final collapse of the streams `[..., n, D] -> [..., D]`: an unweighted mean (GLM-5.3, unlike DeepSeek-V4)."""
    return streams.mean(dim=-2)


def expand_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """Copy the embedding into `n` identical streams: `[..., D] -> [..., n, D]` (contiguous)."""
    if n < 1:
        raise ValueError(f"hc_mult must be >= 1, got {n}")
    return x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1]).contiguous()


def pack_streams(streams: torch.Tensor) -> torch.Tensor:
    """`[s, b, n, D] -> [s*n, b, D]`: the stream set as the 3-D tensor megatron hands between layers and pipeline
    stages (its p2p buffers are `[seq, micro_batch, hidden]`). A row-major re-view of the same memory, not a
    sequence of s*n tokens: only `unpack_streams` reads it."""
    s, b, n, d = streams.shape
    return streams.reshape(s * n, b, d)


def unpack_streams(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_streams`: `[s*n, b, D] -> [s, b, n, D]` (a 4-D input is returned as it is)."""
    if packed.dim() == 4:
        return packed
    if packed.dim() != 3 or packed.shape[0] % n:
        raise ValueError(
            f"expected packed mHC streams [seq*hc_mult, batch, hidden] with hc_mult={n}, got shape "
            f"{tuple(packed.shape)}"
        )
    sn, b, d = packed.shape
    return packed.reshape(sn // n, b, n, d)
