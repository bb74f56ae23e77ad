"""DSA sparse attention in the absorbed (latent) form: each query attends to its W selected tokens only.

MLA's keys and values are one latent per token expanded per head, k_h = W_UK,h c and v_h = W_UV,h c, with c the
normalised latent [kv_lora_rank] and W_UK,h [dq, R], W_UV,h [dv, R] the slices of `kv_b_proj`. So

    q_h . k_h,j = (W_UK,h^T q_h) . c_j = q_lat,h . c_j          scores against the latent itself
    sum_j p_hj v_h,j = W_UV,h (sum_j p_hj c_j) = W_UV,h o_lat,h     values averaged in latent space, expanded once

and the attention reads one latent row per selected token for all heads (K = V = c): a [heads x R] x [R x W] GEMM
per query, O(L·W·H·R) FLOPs and O(L·W) gathered rows, never [L, L]. Per-head k and v are never formed (at the
released size that saves 2 x 64 x 256 values per token and layer). docs/numerics.md compares its rounding with HF's.

Contract of the core (`sparse_latent_attention`), shared by the torch reference and the Triton kernel:
    q_lat [b, L, h, R], latent [b, Lk, R], tokens [b, L, W] int32 (indices into the Lk keys, -1 = empty slot; the
    indices of a row are distinct, as every DSA selection is) -> o_lat [b, L, h, R]
The queries may be a part of the keys' sequence (Lk >= L: under sequence parallelism a rank's own queries against
the whole row's latent, mla.py); the latent gradient covers all Lk keys. A query whose slots are all empty (padding
rows, or the first kpool-1 tokens without a tail) averages all Lk values, with HF's gradient at that point
(`blind_rows`), as the dense path does.

Implementations (`attention_impl`, glm53_ds/backends.py): `sparse` = the torch reference below (gather per block
of query rows, recomputed per block in backward: only q_lat, latent and tokens are kept); `triton` = the fused
kernels of `sparse_attention_triton.py` (forward, and backward with deterministic latent gradients); `auto` = the
kernel on CUDA, the reference elsewhere. `dense` / `eager` stay in mla.py (today's masked attention over all L keys,
kept for parity).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from . import sparse_attention_op
from .blind_rows import blind_rows, blind_rows_by_document
from .sparse_attention_op import sparse_attention_reference

# The torch reference's block of query rows keeps its gathered latents [b, rows, W, R] and its [b, rows, h, W] fp32
# scores and probabilities under this many bytes: small enough to stay in cache between the block's GEMMs (on this
# CPU 4 MiB blocks run fwd+bwd 2.5x faster than 64 MiB ones at 8k tokens).
ATTENTION_BLOCK_BYTES = 4 * 2**20


def absorb_query(q: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q [b, s, h, dq], W_UK [h, dq, R] -> q_lat [b, s, h, R] = W_UK,h^T q_h."""
    return torch.matmul(q.transpose(1, 2), w_uk).transpose(1, 2)


def expand_output(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_lat [b, s, h, R], W_UV [h, dv, R] -> [b, s, h, dv] = W_UV,h o_lat,h."""
    return torch.matmul(o_lat.transpose(1, 2), w_uv.transpose(1, 2)).transpose(1, 2)


def gather_latent(latent: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """latent [b, L, R], tokens [b, r, W] (-1 = empty) -> [b, r, W, R]; empty slots read row 0 (masked later)."""
    b, length, rank = latent.shape
    flat = tokens.clamp(min=0).long() + (torch.arange(b, device=tokens.device) * length)[:, None, None]
    return latent.reshape(b * length, rank).index_select(0, flat.flatten()).view(*tokens.shape, rank)


def _softmax_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[n, r, x, y] @ [n, r, y, z] -> [n, r, x, z] as one bmm over n * r (transposed operands are not copied, which
    4-D `matmul` would do)."""
    return torch.bmm(a.flatten(0, 1), b.flatten(0, 1)).unflatten(0, a.shape[:2])


def slot_probabilities(
    q_lat: torch.Tensor, latent: torch.Tensor, tokens: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over each query's valid slots of q_lat . c * scaling, as HF's eager expression rounds it (scores in
    the activation dtype, softmax in fp32): ([b, r, h, W] fp32, all-zero rows for queries with no valid slot;
    the gathered latents [b, r, W, R])."""
    gathered = gather_latent(latent, tokens)
    scores = _bmm(q_lat, gathered.transpose(-1, -2)) * scaling  # [b, r, h, W]
    scores = scores.masked_fill((tokens < 0)[:, :, None, :], float("-inf"))
    # fp32 at least (float64 stays float64: the SP tests' rounding-free comparison)
    probs = torch.nan_to_num(F.softmax(scores, dim=-1, dtype=_softmax_dtype(scores)), nan=0.0)
    return probs, gathered


def _reference_block(
    q_lat: torch.Tensor, latent: torch.Tensor, tokens: torch.Tensor, scaling: float, dropout: float
) -> torch.Tensor:
    """One block with attention dropout, through autograd (recomputed in backward by torch checkpoint)."""
    probs, gathered = slot_probabilities(q_lat, latent, tokens, scaling)
    probs = F.dropout(probs.to(q_lat.dtype), p=dropout, training=dropout > 0)
    return torch.matmul(probs, gathered)  # [b, r, h, R]


def _block_backward(
    q_lat: torch.Tensor,
    latent: torch.Tensor,
    tokens: torch.Tensor,
    grad_out: torch.Tensor,
    scaling: float,
    grad_latent: torch.Tensor,
) -> torch.Tensor:
    """One block's backward: regathers its latent rows once, returns dq_lat [b, r, h, R] and adds each slot's latent
    gradient ds^T q_lat + p^T dO (one fused `baddbmm`) into grad_latent [b * L, R] by `index_add_`."""
    probs, gathered = slot_probabilities(q_lat, latent, tokens, scaling)  # [b, r, h, W] fp32+, [b, r, W, R]
    grad_out = grad_out.to(q_lat.dtype).contiguous()  # (a broadcast gradient, e.g. of a sum, has stride 0)
    grad_probs = _bmm(grad_out, gathered.transpose(-1, -2)).to(probs.dtype)  # [b, r, h, W]
    grad_scores = probs * (grad_probs - (probs * grad_probs).sum(-1, keepdim=True))
    grad_scores = (grad_scores * scaling).to(q_lat.dtype)
    grad_q = _bmm(grad_scores, gathered)  # [b, r, h, R]
    b, r, heads, rank = q_lat.shape
    width = tokens.shape[-1]
    # every slot's latent gradient, [b * r, W, R] (empty slots: p = ds = 0, so 0). baddbmm into a buffer: with its
    # transposed [W, h] operand, 3x faster than bmm on CPU (MKL)
    grad_slots = torch.empty(b * r, width, rank, dtype=q_lat.dtype, device=q_lat.device)
    probs_t = probs.to(q_lat.dtype).reshape(b * r, heads, width).transpose(1, 2)
    grad_slots.baddbmm_(probs_t, grad_out.reshape(b * r, heads, rank), beta=0.0)
    grad_slots.baddbmm_(
        grad_scores.reshape(b * r, heads, width).transpose(1, 2), q_lat.reshape(b * r, heads, rank)
    )
    length = latent.shape[1]
    flat = tokens.clamp(min=0).long() + (torch.arange(b, device=tokens.device) * length)[:, None, None]
    grad_latent.index_add_(0, flat.flatten(), grad_slots.reshape(-1, rank).to(grad_latent.dtype))
    return grad_q


def reference_forward(
    q_lat: torch.Tensor, latent: torch.Tensor, tokens: torch.Tensor, scaling: float, rows: int
) -> torch.Tensor:
    """All blocks of `rows` query rows, without autograd (the op `glm53::sparse_attention_reference` keeps only
    q_lat, latent and tokens, sparse_attention_op.py)."""
    with torch.no_grad():
        parts = []
        for i in range(0, q_lat.shape[1], rows):
            probs, gathered = slot_probabilities(
                q_lat[:, i : i + rows], latent, tokens[:, i : i + rows], scaling
            )
            parts.append(_bmm(probs.to(q_lat.dtype), gathered))  # [b, r, h, R]
        return torch.cat(parts, dim=1)


def reference_backward(
    grad_out: torch.Tensor, q_lat: torch.Tensor, latent: torch.Tensor, tokens: torch.Tensor, scaling: float,
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq_lat, d_latent), block by block; the latent gradient accumulates in one buffer across blocks (per-block
    autograd nodes would each add a full [L, R] gradient: O(L x blocks) = O(L^2) traffic)."""
    b, length, _, rank = q_lat.shape
    grad_latent = torch.zeros(b * latent.shape[1], rank, dtype=torch.promote_types(latent.dtype, torch.float32),
                              device=latent.device)  # fmt: skip
    grad_q = torch.empty_like(q_lat, memory_format=torch.contiguous_format)
    with torch.no_grad():
        for i in range(0, length, rows):
            sl = slice(i, i + rows)
            grad_q[:, sl] = _block_backward(
                q_lat[:, sl], latent, tokens[:, sl], grad_out[:, sl], scaling, grad_latent
            )
    return grad_q, grad_latent.view(latent.shape).to(latent.dtype)


sparse_attention_op.IMPLEMENTATIONS["reference"] = (reference_forward, reference_backward)


def reference_rows(
    batch: int, heads: int, width: int, rank: int, block_bytes: int = ATTENTION_BLOCK_BYTES
) -> int:
    """Query rows per block of the torch reference."""
    per_row = batch * width * (4 * rank + 12 * heads)
    return max(1, block_bytes // max(1, per_row))


def sparse_reference(
    q_lat: torch.Tensor,
    latent: torch.Tensor,
    tokens: torch.Tensor,
    scaling: float,
    dropout: float = 0.0,
    block_bytes: int = ATTENTION_BLOCK_BYTES,
) -> torch.Tensor:
    """The torch reference of the contract, without the blind-row rule (such rows give 0)."""
    b, length, heads, rank = q_lat.shape
    rows = reference_rows(b, heads, tokens.shape[-1], rank, block_bytes)
    if dropout == 0.0:
        return sparse_attention_reference(q_lat, latent, tokens, scaling, rows)
    # attention dropout: its mask is drawn once per block, so autograd runs through checkpointed blocks
    grad = torch.is_grad_enabled() and (q_lat.requires_grad or latent.requires_grad)
    parts = []
    for i in range(0, length, rows):
        args = (q_lat[:, i : i + rows], latent, tokens[:, i : i + rows], scaling, dropout)
        parts.append(
            checkpoint(_reference_block, *args, use_reentrant=False) if grad else _reference_block(*args)
        )
    return torch.cat(parts, dim=1)


def sparse_latent_attention(
    q_lat: torch.Tensor,
    latent: torch.Tensor,
    tokens: torch.Tensor,
    scaling: float,
    dropout: float = 0.0,
    impl: str = "sparse",
    block_bytes: int = ATTENTION_BLOCK_BYTES,
    blind_possible: bool = True,
    document_ids: torch.Tensor | None = None,
    query_offset: int = 0,
) -> torch.Tensor:
    """The contract above: q_lat [b, L, h, R], latent [b, Lk, R], tokens [b, L, W] -> o_lat [b, L, h, R].
    `impl`: sparse (torch reference) | triton (fused kernels; attention dropout needs the reference).
    `document_ids` [Lk]: the keys of a packed row (b = 1) belong to documents (`Documents.ids`), and the queries
    are keys `query_offset ...` of it; tokens select within a query's document, and a blind query averages its
    document's values (`blind_rows_by_document`)."""
    if impl == "triton" and dropout == 0.0:
        from .sparse_attention_triton import sparse_attention_triton  # lazy: Triton reads TRITON_INTERPRET

        out = sparse_attention_triton(q_lat, latent, tokens, scaling)
    else:
        out = sparse_reference(q_lat, latent, tokens, scaling, dropout, block_bytes)
    if not blind_possible:  # the caller knows on the host that every query row selects a token
        return out
    blind = (tokens < 0).all(-1)
    if document_ids is not None:  # a blind query averages its own document's values
        return blind_rows_by_document(out, blind, q_lat, latent, document_ids, query_offset, scaling, dropout)
    keys = latent.unsqueeze(2)  # [b, L, 1, R]: K = V = the latent, shared by the heads
    return blind_rows(out, blind, q_lat, keys, keys, scaling, dropout)


@torch.no_grad()
def pooled_attention_mass(
    q_lat: torch.Tensor,
    latent: torch.Tensor,
    tokens: torch.Tensor,
    n_pools: int,
    kpool: int,
    scaling: float,
    block_bytes: int = ATTENTION_BLOCK_BYTES,
) -> torch.Tensor:
    """The indexer loss's target input: the main attention's probabilities (fp32, summed over heads) on the tokens of
    each chosen pool, [b, L, n_pools] (slots [k * kpool, (k + 1) * kpool) hold the k-th chosen pool)."""
    dtype = torch.promote_types(q_lat.dtype, torch.float32)
    q_lat, latent = q_lat.to(dtype), latent.to(dtype)
    b, length, heads, rank = q_lat.shape
    rows = reference_rows(b, heads, tokens.shape[-1], rank, block_bytes)
    parts = []
    for i in range(0, length, rows):
        probs, _ = slot_probabilities(q_lat[:, i : i + rows], latent, tokens[:, i : i + rows], scaling)
        pooled = probs.sum(2)[..., : n_pools * kpool]  # [b, r, K * kpool]
        parts.append(pooled.unflatten(-1, (n_pools, kpool)).sum(-1))
    return torch.cat(parts, dim=1)
