"""Linear cross-entropy over chunks of tokens: the LM / MTP loss without ever holding [tokens, vocab] logits.

    loss = sum_i [lse(h_i W^T) - (h_i W^T)[t_i]] / normalizer        over tokens i with t_i != -100

Forward: per chunk of rows, logits = h_c W^T in the activation dtype (as the output layer computes them), upcast to
fp32, logsumexp (max-subtracted) and the target logit; only the per-token logsumexp [N] fp32 is kept. Backward:
each chunk's logits are recomputed, d logits = (softmax - onehot) * grad / normalizer (fp32), and
d h_c = d_logits W, d W += d_logits^T h_c (accumulated in fp32). Peak extra memory is one chunk's logits: the chunk
is `chunk_bytes // (V * 4)` rows (fp32 logits of V columns). With fp32 weights the numbers are those of
`F.cross_entropy(h W^T)`; with bf16 the logsumexp, the loss and the weight gradient accumulate in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
DEFAULT_CHUNK_BYTES = 256 * 1024**2


def chunk_rows(vocab: int, chunk_bytes: int) -> int:
    """Rows per chunk so that one chunk's fp32 logits stay within `chunk_bytes` (at least one row)."""
    return max(1, chunk_bytes // (vocab * 4))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        normalizer: torch.Tensor,
        rows: int,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, rows):
            end = min(start + rows, n)
            logits = (hidden[start:end] @ weight.t()).float()  # [c, V]
            chunk_lse = torch.logsumexp(logits, dim=-1)  # max-subtracted inside
            lse[start:end] = chunk_lse
            t = target[start:end]
            valid = t != IGNORE_INDEX
            picked = logits.gather(1, t.clamp_min(0)[:, None]).squeeze(1)
            total = total + torch.where(valid, chunk_lse - picked, 0.0).sum()
        ctx.save_for_backward(hidden, weight, target, lse, normalizer)
        ctx.rows = rows
        return total / normalizer

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, target, lse, normalizer = ctx.saved_tensors
        rows = ctx.rows
        scale = (grad.float() / normalizer).reshape(())
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        d_hidden = torch.empty_like(hidden) if need_h else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for start in range(0, hidden.shape[0], rows):
            end = min(start + rows, hidden.shape[0])
            h = hidden[start:end]
            t = target[start:end]
            valid = t != IGNORE_INDEX
            probs = torch.exp((h @ weight.t()).float() - lse[start:end, None])  # softmax, [c, V]
            probs[torch.arange(end - start, device=h.device), t.clamp_min(0)] -= 1.0
            d_logits = (probs * (valid[:, None] * scale)).to(h.dtype)
            if d_hidden is not None:
                d_hidden[start:end] = d_logits @ weight
            if d_weight is not None:
                d_weight.addmm_(d_logits.t().float(), h.float())  # fp32 accumulation across chunks
        return d_hidden, None if d_weight is None else d_weight.to(weight.dtype), None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    normalizer: float | torch.Tensor | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> torch.Tensor:
    """Cross entropy of `hidden [N, D] @ weight [V, D]^T` against `target [N]` (-100 ignored, any other label outside
    [0, V) refused as `F.cross_entropy` refuses it): the sum over targets
    divided by `normalizer` (default: the number of targets, i.e. the mean). `chunk_bytes <= 0`: the materialised
    reference (one [N, V] fp32 logits tensor)."""
    if hidden.dim() != 2 or target.shape != hidden.shape[:1] or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: hidden [N, D], weight [V, D], target [N]; got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(target.shape)}"
        )
    vocab = weight.shape[0]
    # cross_entropy's contract: only the ignore index is skipped, any other label outside [0, V) is an error (an
    # asynchronous device assert on CUDA, as cross_entropy's own: no host sync)
    outside = (target != IGNORE_INDEX) & ((target < 0) | (target >= vocab))
    torch._assert_async(
        ~outside.any(),
        f"linear_cross_entropy: a target is outside [0, {vocab}) and is not the ignore index {IGNORE_INDEX}",
    )
    if normalizer is None:
        normalizer = (target != IGNORE_INDEX).sum()
    norm = torch.as_tensor(normalizer, dtype=torch.float32, device=hidden.device).clamp_min(1.0)
    if chunk_bytes <= 0:
        logits = (hidden @ weight.t()).float()
        return F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum") / norm
    rows = chunk_rows(weight.shape[0], chunk_bytes)
    out = _ChunkedLinearCrossEntropy.apply(hidden, weight, target, norm, rows)
    assert isinstance(out, torch.Tensor)
    return out
