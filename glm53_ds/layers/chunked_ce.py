"""Linear cross-entropy over chunks: the LM / MTP loss without ever holding [tokens, vocab] logits, nor an fp32
copy of the output layer's weight gradient.

    loss = sum_i [lse(h_i W^T) - (h_i W^T)[t_i]] / normalizer        over tokens i with t_i != -100

Forward: per chunk of rows, logits = h_c W^T in the activation dtype (as the output layer computes them), upcast to
fp32, logsumexp (max-subtracted) and the target logit; only the per-token logsumexp [N] fp32 is kept. Backward: the
logits are recomputed per tile of [rows, vocab slice], d logits = (softmax - onehot) * grad / normalizer (fp32),
d h = d_logits W and d W = d_logits^T h, each product accumulated in fp32 and rounded once.

The backward's tiles (`backward_tiles`), each within `chunk_bytes` of fp32 logits:
- without a weight gradient (LoRA: the output layer frozen), the forward's chunks of rows over the whole vocabulary:
  each chunk's d h is whole after one product, nothing is accumulated;
- with one, vocabulary slices as wide as the budget allows over all N rows (at least `MIN_VOCAB_SLICE` columns, then
  over chunks of rows): each slice of d W is whole when the slice is done, written once in the weight's dtype, and
  d h sums the slices in an fp32 [N, D]. A rank holds far fewer tokens than the vocabulary has entries (N << V), so
  this holds [N, D] fp32 where chunks of rows would hold the whole [V, D] fp32 accumulator (2.36 GiB at the released
  154,880 x 4096) beside the weight-dtype result: the loss head's backward was a full-SFT rank's activation peak.
With fp32 weights the numbers are those of `F.cross_entropy(h W^T)`; with bf16 the logsumexp, the loss and both
gradients accumulate in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
DEFAULT_CHUNK_BYTES = 256 * 1024**2
# the narrowest vocabulary slice of the weight-gradient backward: below it the slices' products would be thin
# matrices, and the slice loop long; more rows than the budget allows at this width are then taken in chunks
MIN_VOCAB_SLICE = 512


def chunk_rows(vocab: int, chunk_bytes: int) -> int:
    """Rows per chunk so that one chunk's fp32 logits over `vocab` columns stay within `chunk_bytes` (at least one)."""
    return max(1, chunk_bytes // (vocab * 4))


def backward_tiles(rows: int, vocab: int, chunk_bytes: int, weight_gradient: bool) -> tuple[int, int]:
    """(rows, columns) of the backward's tiles of logits (see the module docstring)."""
    if not weight_gradient:
        return chunk_rows(vocab, chunk_bytes), vocab
    columns = min(vocab, max(MIN_VOCAB_SLICE, chunk_bytes // (max(rows, 1) * 4)))
    return chunk_rows(columns, chunk_bytes), columns


def _product_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b accumulated and returned in fp32. CUDA (and meta, which stands for it in the planner) multiply bf16 /
    fp16 operands with an fp32 output directly; the CPU has no such kernel and multiplies fp32 copies."""
    if a.dtype in (torch.bfloat16, torch.float16) and a.device.type in ("cuda", "meta"):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        normalizer: torch.Tensor,
        chunk_bytes: int,
    ) -> torch.Tensor:
        n, rows = hidden.shape[0], chunk_rows(weight.shape[0], chunk_bytes)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        row_loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, rows):
            end = min(start + rows, n)
            logits = (hidden[start:end] @ weight.t()).float()  # [c, V]
            chunk_lse = torch.logsumexp(logits, dim=-1)  # max-subtracted inside
            lse[start:end] = chunk_lse
            t = target[start:end]
            picked = logits.gather(1, t.clamp_min(0)[:, None]).squeeze(1)
            row_loss[start:end] = torch.where(t != IGNORE_INDEX, chunk_lse - picked, 0.0)
        ctx.save_for_backward(hidden, weight, target, lse, normalizer)
        ctx.chunk_bytes = chunk_bytes
        return row_loss.view(normalizer.numel(), -1).sum(1) / normalizer  # [groups]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, target, lse, normalizer = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, vocab = hidden.shape[0], weight.shape[0]
        rows, columns = backward_tiles(n, vocab, ctx.chunk_bytes, need_w)
        whole_rows = columns == vocab  # one slice: a chunk's d h is whole after its product
        group_scale = (grad.float() / normalizer).repeat_interleave(n // normalizer.numel())
        # each row's share of its group's gradient: [N], 0 where the target is ignored
        row_scale = (target != IGNORE_INDEX) * group_scale
        d_hidden = None
        if need_h:  # fp32 sums over the slices when there are several
            d_hidden = (
                torch.empty_like(hidden)
                if whole_rows
                else hidden.new_zeros(hidden.shape, dtype=torch.float32)
            )
        d_weight = None
        if need_w:  # every slice is written below; without rows, nothing is
            d_weight = torch.empty_like(weight) if n else torch.zeros_like(weight)
        for first in range(0, vocab, columns):
            last = min(first + columns, vocab)
            w = weight[first:last]  # [v, D]
            slice_grad = None  # fp32 [v, D] over chunks of rows, when the slice's rows do not fit one tile
            for start in range(0, n, rows):
                end = min(start + rows, n)
                h = hidden[start:end]  # [c, D]
                # softmax's columns first:last, [c, v], in place: one fp32 tile and its product in the weight's dtype
                probs = (h @ w.t()).float().sub_(lse[start:end, None]).exp_()
                local = target[start:end] - first  # the target's column in this slice, if it lies in it
                in_slice = (local >= 0) & (local < last - first)
                probs.scatter_add_(1, local.clamp(0, last - first - 1)[:, None], -in_slice.float()[:, None])
                d_logits = probs.mul_(row_scale[start:end, None]).to(h.dtype)
                del probs
                if d_hidden is not None:
                    if whole_rows:
                        torch.mm(d_logits, w, out=d_hidden[start:end])
                    else:
                        d_hidden[start:end] += _product_fp32(d_logits, w)
                # the slice's gradient in one product (fp32 inside) rounded once into place, or summed over chunks
                if d_weight is not None:
                    if rows >= n:
                        torch.mm(d_logits.t(), h, out=d_weight[first:last])
                    elif slice_grad is None:
                        slice_grad = _product_fp32(d_logits.t(), h)
                    else:
                        slice_grad += _product_fp32(d_logits.t(), h)
            if d_weight is not None and slice_grad is not None:
                d_weight[first:last] = slice_grad
        if d_hidden is not None and not whole_rows:
            d_hidden = d_hidden.to(hidden.dtype)
        return d_hidden, d_weight, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    normalizer: float | torch.Tensor | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    groups: int = 1,
) -> torch.Tensor:
    """Cross entropy of `hidden [N, D] @ weight [V, D]^T` against `target [N]` (-100 ignored, any other label outside
    [0, V) refused as `F.cross_entropy` refuses it): the sum over targets divided by `normalizer` (default: the
    number of targets, i.e. the mean). `chunk_bytes <= 0`: the materialised reference (one [N, V] fp32 logits
    tensor).

    `groups` > 1: the rows are that many equal consecutive groups, each a loss of its own with its own normalizer
    (`normalizer` [groups]; default: each group's target count), returned as [groups]. Heads that share an output
    layer (the LM head and each MTP depth) go through one call so that the layer gets one weight gradient: separate
    calls would each produce a whole [V, D] gradient, the first held until the last is added to it."""
    shapes_agree = (
        hidden.dim() == 2 and target.shape == hidden.shape[:1] and weight.shape[1] == hidden.shape[1]
    )
    if not shapes_agree or hidden.shape[0] % groups:
        raise ValueError(
            f"linear_cross_entropy: hidden [N, D], weight [V, D], target [N], N a multiple of {groups} groups; "
            f"got {tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(target.shape)}"
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
        normalizer = (target != IGNORE_INDEX).view(groups, -1).sum(1)
    norm = (
        torch.as_tensor(normalizer, dtype=torch.float32, device=hidden.device).reshape(groups).clamp_min(1.0)
    )
    if chunk_bytes <= 0:
        logits = (hidden @ weight.t()).float()
        row_loss = F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="none")
        losses = row_loss.view(groups, -1).sum(1) / norm
    else:
        losses = _ChunkedLinearCrossEntropy.apply(hidden, weight, target, norm, chunk_bytes)
    assert isinstance(losses, torch.Tensor)
    return losses if groups > 1 else losses[0]
