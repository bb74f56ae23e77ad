"""NoPE multi-head latent attention with DSA sparse selection (HF `Glm5NextTextAttention`).

q = q_b(RMSNorm(q_a x)) per head [qk_nope_head_dim]; the shared latent c = RMSNorm(kv_a x) [kv_lora_rank] expands
to per-head keys and values through kv_b. No rotary embedding (qk_rope_head_dim = 0). Each query attends only
to the token set its DSA indexer chose (or, for an `indexer_types == "shared"` layer, the set the previous full
layer chose, passed in through the transformer block's `context`). Attention is exact masked softmax attention
as HF's eager path; a query whose set is empty (padding rows) averages all values as HF does.

Packed documents (`Documents`) are tensor code over the whole row, one compiled graph for every packing: each
document's pools start at its first real token and are candidates only for its own queries
(`DsaIndexer.document_pools`); selections hold row positions, so the attention reads the row's latent; a blind query
averages its own document's values (`blind_rows_by_document`). Under
sequence parallelism (`SparseMLA.forward`, parallel/sequence.py) the indexer keys are gathered and each rank selects
for its own queries. The sparse forms then split the attention by query, not by head: a rank's queries, with all
heads, read their selected rows of the whole row's latent, which is gathered (R values per token; the latent's
gradient comes back by a reduce-scatter). So each rank gathers and buffers the latent rows of S/N queries for all H
heads, where a head split would have every rank gather all S queries' rows for H/N heads (the same bytes on every
rank whatever N: at 8 heads per rank the kernel would be bound by its gathers), and neither q_lat nor the output
moves. The dense path (parity only) trades tokens for heads: selections gathered, q, k, v and the output moved by
all-to-alls.

The config's `attention_impl` (`glm53_ds/backends.py`) picks how the attention is computed:
  - `sparse` / `triton` / `auto` (default): DSA sparse attention in the absorbed latent form
    (`sparse_attention.py`): each query reads only its W selected latent rows, O(L·W) time and memory;
    `triton` is the fused kernel, `sparse` the torch reference, `auto` the kernel on CUDA and the reference elsewhere.
  - `dense` / `eager`: the masked path over all L keys (O(L²) time), kept for parity: `dense` through torch's fused
    SDPA, which never holds the [b, H, s, s] scores; `eager` as HF's expression, scores rounded to the activation
    dtype before the fp32 softmax. In bf16 eager matches HF bf16 (logits cosine 0.99998 on the test config A),
    dense is nearer the fp32 result; docs/numerics.md has the sparse forms' numbers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import backends
from ..parallel.sequence import SequenceParallel
from ..transformer_config import Glm53TransformerConfig
from .blind_rows import blind_rows
from .documents import Documents
from .dsa_indexer import DsaIndexer, Pools, Selection, kl_loss
from .forward_record import current_record
from .linear import ColumnLinear, RowLinear
from .lora import merged_weight
from .norm import RMSNorm
from .sparse_attention import (
    absorb_query,
    expand_output,
    pooled_attention_mass,
    sparse_latent_attention,
)


def topk_to_mask(topk_tokens: torch.Tensor, kv_length: int) -> torch.Tensor:
    """int [b, s, W] token indices (-1 = none) -> bool [b, 1, s, kv_length] (True = may attend)."""
    valid = (topk_tokens >= 0) & (topk_tokens < kv_length)
    # invalid entries write into a spare last column, dropped after: one byte per (query, key), no counts
    index = torch.where(valid, topk_tokens, kv_length).long()
    allowed = torch.zeros(*topk_tokens.shape[:2], kv_length + 1, dtype=torch.bool, device=topk_tokens.device)
    allowed.scatter_(-1, index, True)
    return allowed[..., :kv_length].unsqueeze(1)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scaling: float,
    dropout: float = 0.0,
    backend: str = "dense",
    blind_possible: bool = True,
) -> torch.Tensor:
    """HF's eager attention, softmax(q k^T * scaling + mask) v with the mask finfo.min where not allowed.
    q, k [b, H, s, dq], v [b, H, s, dv], allowed bool [b, 1, s, s] -> [b, s, H, dv]. `backend`: dense | eager.

    SDPA's fused kernels (flash on CPU, memory-efficient on CUDA) never hold the [b, H, s, s] scores and
    probabilities that eager attention keeps for backward: 82 MiB instead of 1.6 GiB for a fwd+bwd at 4096 tokens
    and 8 heads on CPU. One case needs care. A query allowed nothing (a padding position) gets min + score == min
    everywhere in HF: the forward is a uniform average of all values, while the gradient still flows to q and k
    through the add, as the softmax Jacobian at the uniform point. The fused kernels' backward is wrong on such
    rows, so SDPA sees them unmasked and their outputs are recomputed as softmax(x - x.detach()) v, which has
    exactly that value and gradient (`blind_rows`: closed form, no host sync). `blind_possible=False`: the caller
    knows on the host that every row allows something, and the rule is skipped.
    """
    if backends.check(backends.ATTENTION, backend) == "eager":  # HF's expression, rounding included
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(
            ~allowed, torch.finfo(q.dtype).min
        )
        scores = torch.matmul(q, k.transpose(2, 3)) * scaling + bias
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        probs = F.dropout(probs, p=dropout, training=dropout > 0)
        return torch.matmul(probs, v).transpose(1, 2)
    sees_something = allowed.any(dim=-1, keepdim=True)  # [b, 1, s, 1]
    # a boolean mask (-inf where False) is HF's finfo.min mask exactly wherever a row allows something: the masked
    # terms underflow to 0 either way
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed | ~sees_something, dropout_p=dropout, scale=scaling
    )
    out = out.transpose(1, 2)  # [b, s, H, dv]
    if not blind_possible:
        return out
    blind = ~sees_something[:, 0, :, 0]  # [b, s]
    return blind_rows(out, blind, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scaling, dropout)


# Query rows per block of `dense_attention`: the block's [b, 1, rows, L] mask (and SDPA's float copy of it) stays
# under this many bytes.
DENSE_BLOCK_BYTES = 64 * 2**20


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk: torch.Tensor,
    scaling: float,
    dropout: float = 0.0,
    backend: str = "dense",
    block_bytes: int = DENSE_BLOCK_BYTES,
    blind_possible: bool = True,
) -> torch.Tensor:
    """`masked_attention` with the mask built from each query's selected tokens `topk` [b, L, W], over blocks of
    query rows: q, k [b, h, L, dq], v [b, h, L, dv] -> [b, L, h, dv]. Never holds the [L, L] mask: with gradients,
    each block is recomputed in backward from its top-k (torch checkpoint), so only q, k, v, topk are kept. One
    block (the plain call) when the whole mask fits in `block_bytes`."""
    b, _, length, _ = q.shape
    rows = max(1, block_bytes // max(1, 4 * b * length))

    def block(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, tb: torch.Tensor) -> torch.Tensor:
        return masked_attention(
            qb,
            kb,
            vb,
            topk_to_mask(tb, length),
            scaling,
            dropout,
            backend=backend,
            blind_possible=blind_possible,
        )

    if rows >= length:
        return block(q, k, v, topk)
    recompute = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    parts = []
    for i in range(0, length, rows):
        args = (q[:, :, i : i + rows], k, v, topk[:, i : i + rows])
        parts.append(checkpoint(block, *args, use_reentrant=False) if recompute else block(*args))
    return torch.cat(parts, dim=1)


class SparseMLA(nn.Module):
    def __init__(
        self,
        config: Glm53TransformerConfig,
        layer_number: int = 1,
        pg_collection: Any = None,
        layer_index: int | None = None,
        **unused: Any,
    ) -> None:
        super().__init__()
        cfg = config.glm
        self.layer_index = layer_number - 1 if layer_index is None else layer_index
        self.num_heads = cfg.num_attention_heads
        self.qk_head_dim = cfg.qk_nope_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scaling = self.qk_head_dim**-0.5
        self.attention_dropout = cfg.attention_dropout
        self.attention_impl = config.attention_impl
        self.kpool, self.selects_tail = cfg.index_kpool, cfg.index_kpool_always_select_tail
        hidden = cfg.hidden_size

        self.q_a_proj = ColumnLinear(config, hidden, cfg.q_lora_rank)
        self.q_a_layernorm = RMSNorm(config, cfg.q_lora_rank, eps=cfg.rms_norm_eps)
        self.q_b_proj = ColumnLinear(config, cfg.q_lora_rank, self.num_heads * self.qk_head_dim)
        self.kv_a_proj_with_mqa = ColumnLinear(config, hidden, cfg.kv_lora_rank)
        self.kv_a_layernorm = RMSNorm(config, cfg.kv_lora_rank, eps=cfg.rms_norm_eps)
        self.kv_b_proj = ColumnLinear(
            config, cfg.kv_lora_rank, self.num_heads * (self.qk_head_dim + self.v_head_dim)
        )
        self.o_proj = RowLinear(config, self.num_heads * self.v_head_dim, hidden)

        # Layers beyond the schedule (the MTP layer) run their own indexer.
        i = self.layer_index
        types = cfg.indexer_types
        self.reuses_selection = i < len(types) and types[i] == "shared"
        self.indexer = None if self.reuses_selection else DsaIndexer(config)
        self.indexer_loss_coef = config.indexer_loss_coef
        # HF hands a full layer's selection only to the very next layer, when that one is "shared".
        self.passes_selection = not self.reuses_selection and i + 1 < len(types) and types[i + 1] == "shared"
        self.sequence = SequenceParallel.of(pg_collection)  # None without sequence parallelism

    # packed documents: this module keeps each document to itself (its pools start at its first token, its queries
    # see only its keys), as tensor code over the documents' tensors
    accepts_documents = True

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        shared_topk: torch.Tensor | None = None,
        documents: Documents | None = None,
        trailing_padding: int | None = None,
        **unused: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states [s, b, D], attention_mask [b, s] bool, shared_topk [b, S, W] from the previous layer,
        documents: packed documents of a batch-1 row; `trailing_padding`: the caller knows on the host that the mask
        is exactly the last `trailing_padding` positions of every document (an MTP depth's), else None.

        Returns ([s, b, D], the selection [b, S, W] to hand to the next layer, or None). Selections hold row
        positions (in a packed row, of the query's own document).

        Under sequence parallelism (parallel/sequence.py) s is this rank's S/N tokens and `documents` are the whole
        row's: projections run on the local tokens; the indexer scores the local queries against the pools of
        all S tokens (its per-token keys are gathered, so the pools form in global token order and the top-k
        equals SP = 1's); the selection [b, s, W] stays this rank's (so does the one handed to the next layer).
        The sparse forms attend the local queries, all heads, over the gathered latent of the whole row; the
        dense path gathers the selections and trades tokens for heads by all-to-alls (`_dense`)."""
        x = hidden_states.transpose(0, 1)  # [b, s, D]
        b, s, _ = x.shape
        mask = (
            attention_mask
            if attention_mask is not None
            else torch.ones(b, s, dtype=torch.bool, device=x.device)
        )
        sp = self.sequence
        start = 0 if sp is None else sp.rank * s  # this rank's first token in the row
        length = s if sp is None else s * sp.size
        key_mask = mask if sp is None else sp.gather_tokens(mask)  # [b, S]
        # Known on the host: without padding (no mask), a query sees nothing only when the tail is not selected
        # (the first kpool - 1 tokens of a document precede its first complete pool).
        all_real = attention_mask is None
        blind_possible = not all_real or (not self.selects_tail and self.kpool > 1)
        pad_known = 0 if all_real else trailing_padding

        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(b, s, self.num_heads, self.qk_head_dim)  # [b, s, H, dq]
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))  # [b, s, R]

        train_indexer = (
            self.indexer is not None
            and self.indexer_loss_coef > 0
            and self.training
            and torch.is_grad_enabled()
        )
        indexed: tuple[Pools, Selection] | None = None  # for the indexer loss
        if self.indexer is not None:
            # detached inputs: the indexer loss trains only the indexer, and the LM loss never does
            with torch.set_grad_enabled(train_indexer):
                keys = self.indexer.keys(x.detach())
                if sp is not None:
                    keys = (sp.gather_tokens(keys[0]), sp.gather_tokens(keys[1]))  # [b, S, d] each
                if documents is None:
                    real = None if pad_known is None else max(0, length - pad_known)
                    pools = self.indexer.pools(keys, key_mask, real)
                else:  # tensor code over the row: one graph for every packing
                    pools = self.indexer.document_pools(keys, key_mask, documents)
            selection = self.indexer.select(x, q_resid, mask, pools, query_offset=start)
            topk = selection.tokens  # [b, s, W]: this rank's queries, row positions
            indexed = (pools, selection)
        elif shared_topk is None:
            raise ValueError(
                f"layer {self.layer_index}: a 'shared' DSA layer needs the top-k selection of the previous full layer"
            )
        else:
            topk = shared_topk

        impl = backends.resolve(backends.ATTENTION, self.attention_impl, x.device)
        dropout = self.attention_dropout if self.training else 0.0
        # the absorbed form reads kv_b_proj as a weight: with a LoRA adapter, W + s B A (differentiable)
        w_uk, w_uv = (
            merged_weight(self.kv_b_proj)
            .view(self.num_heads, self.qk_head_dim + self.v_head_dim, self.kv_lora_rank)
            .split([self.qk_head_dim, self.v_head_dim], dim=1)
        )  # [H, dq, R], [H, dv, R]
        q_lat = keys_lat = None
        if impl in ("dense", "eager"):
            out = self._dense(q, latent, topk, documents, dropout, impl, blind_possible)  # [b, s, H, dv]
        else:
            q_lat = absorb_query(q, w_uk)  # [b, s, H, R]
            # the keys: the whole row's latent (under SP gathered: every rank's queries may select any token)
            keys_lat = latent if sp is None else sp.gather_tokens(latent)  # [b, S, R]
            o_lat = sparse_latent_attention(  # [b, s, H, R]
                q_lat, keys_lat, topk, self.scaling, dropout, impl, blind_possible=blind_possible,
                document_ids=None if documents is None else documents.ids, query_offset=start,
            )  # fmt: skip
            out = expand_output(o_lat, w_uv)  # [b, s, H, dv]

        if train_indexer and indexed is not None and (record := current_record()) is not None:
            assert self.indexer is not None
            pools, selection = indexed
            # the target: the main attention of this rank's queries, all heads (the sparse forms' own q_lat; the
            # dense path absorbs it now), over the row's keys (under SP: the whole row's latent)
            q_lat_target = absorb_query(q.detach(), w_uk.detach()) if q_lat is None else q_lat.detach()
            if keys_lat is None:  # the dense path gathers no latent: once here
                keys_lat = latent if sp is None else sp.gather_tokens(latent.detach())
            # in blocks of the indexer's own budget (1 GiB on a GPU): the reference's 4 MiB hold one query's rows at
            # the released width, a loop of one iteration per query
            target = pooled_attention_mass(
                q_lat_target, keys_lat.detach(), selection.tokens, selection.pools.shape[-1], self.indexer.kpool,
                self.scaling, block_bytes=self.indexer.block_bytes(q_lat_target.device),
            )  # fmt: skip
            total, queries = self.indexer.kl_terms(x.detach(), q_resid.detach(), pools, selection, target)
            # a mean over the row's queries: under SP this rank's KL sum over all SP ranks' query count, so the
            # shards' losses (and gradients, summed over SP as every replicated one) add up to the row's
            record.indexer_losses.append(kl_loss(total, queries if sp is None else sp.sum_counts(queries)))
        out = self.o_proj(out.reshape(b, s, self.num_heads * self.v_head_dim))
        return out.transpose(0, 1), (topk if self.passes_selection else None)

    def _dense(
        self,
        q: torch.Tensor,
        latent: torch.Tensor,
        topk: torch.Tensor,
        documents: Documents | None,
        dropout: float,
        impl: str,
        blind_possible: bool = True,
    ) -> torch.Tensor:
        """Today's dense path (`attention_impl` dense / eager), kept for parity: per-head keys and values from
        kv_b, masked attention over all L keys of each document. q [b, s, H, dq], latent [b, s, R], topk [b, s, W]
        (row positions) -> [b, s, H, dv]. Under SP: the selections gathered, q, k, v moved to all S tokens of H/N
        heads and the output back by all-to-alls."""
        b, s = latent.shape[:2]
        kv = self.kv_b_proj(latent).view(b, s, self.num_heads, self.qk_head_dim + self.v_head_dim)
        k, v = kv.split([self.qk_head_dim, self.v_head_dim], dim=-1)  # [b, s, H, dq], [b, s, H, dv]
        sp = self.sequence
        if sp is not None:
            q, k, v = sp.seq_to_heads(q), sp.seq_to_heads(k), sp.seq_to_heads(v)  # [b, S, H/N, d]
            topk = sp.gather_tokens(topk)  # [b, S, W]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, h, S, d]
        args = (self.scaling, dropout, impl, blind_possible)
        if documents is None:
            out = dense_attention(q, k, v, topk, *args)
        else:
            out = _dense_over_documents(q, k, v, topk, documents.bounds, *args)
        return out if sp is None else sp.heads_to_seq(out)  # [b, s, H, dv]


@torch.compiler.disable
def _dense_over_documents(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topk: torch.Tensor, bounds: tuple[tuple[int, int], ...],
    scaling: float, dropout: float, impl: str, blind_possible: bool,
) -> torch.Tensor:  # fmt: skip
    """`dense_attention` once per document (the parity path; a compiled layer leaves this loop over host boundaries
    eager): q, k [b, h, S, dq], v [b, h, S, dv], topk [b, S, W] in row positions -> [b, S, h, dv]."""
    parts = []
    for a, e in bounds:
        local = torch.where(topk[:, a:e] >= 0, topk[:, a:e] - a, -1)  # the document's own positions
        parts.append(
            dense_attention(
                q[:, :, a:e],
                k[:, :, a:e],
                v[:, :, a:e],
                local,
                scaling,
                dropout,
                impl,
                blind_possible=blind_possible,
            )  # fmt: skip
        )
    return torch.cat(parts, dim=1)
