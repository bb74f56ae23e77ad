"""DSA k-pool indexer (HF `Glm5NextTextIndexer`, training/prefill path without a cache).

For each query it picks which keys the sparse MLA may attend to:
  1. Keys `k = LayerNorm(wk x)` are grouped into pools of `index_kpool` consecutive tokens, starting at the
     sequence's first real (non-padding) token. A pool's key is a softmax-weighted mean of its tokens' keys
     (weights: `x @ index_kpool_compress_gate^T + index_kpool_compress_ape[position in pool]`).
     A pool is complete when all its tokens are real and inside the sequence.
  2. Score per query and pool: `sum_h w_h(x) * relu(q_h . pool_key / sqrt(d))`, with
     `q = wq_b(q_resid)` per indexer head and `w = weights_proj(x) / sqrt(H)`.
  3. Only complete pools whose last token is visible (causal, not padding) are candidates; the top
     `index_topk / index_kpool` are expanded back to token indices.
  4. With `index_kpool_always_select_tail`, the visible tokens after the last complete pool (the incomplete
     tail, at most `index_kpool - 1`) are always appended.
Output: int32 `[b, s, W]` token indices, -1 = empty slot, with W = index_topk (+ index_kpool - 1 with the tail);
rows of padding queries are all -1. Runs without gradient (HF's indexer is `no_grad`: its parameters are not
trained by the language-model loss). Its parameters are therefore frozen (`requires_grad=False`: out of the
optimizer, ZeRO's buffers and the gradient norm) unless `indexer_loss_coef > 0`, which trains them with their own
loss (`indexer_kl_loss` below, equations in docs/indexer_loss.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..transformer_config import Glm53TransformerConfig
from .linear import ColumnLinear


@dataclass
class IndexerScores:
    index_scores: torch.Tensor  # [b, s, P] fp32: every query's score of every pool
    candidates: torch.Tensor  # [b, s, P] bool: complete pools whose last token the query sees
    pool_tokens: torch.Tensor  # [b, P, kpool] token indices, -1 outside the sequence
    visible: torch.Tensor  # [b, s, S] bool: causal and real (queries x keys)
    first_real: torch.Tensor  # [b]


class DsaIndexer(nn.Module):
    def __init__(self, config: Glm53TransformerConfig) -> None:
        super().__init__()
        cfg = config.glm
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.index_topk = cfg.index_topk
        self.kpool = cfg.index_kpool
        self.always_select_tail = cfg.index_kpool_always_select_tail
        self.wq_b = ColumnLinear(config, cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = ColumnLinear(config, cfg.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6, dtype=config.params_dtype)
        self.weights_proj = ColumnLinear(config, cfg.hidden_size, self.n_heads)
        self.index_kpool_compress_ape = nn.Parameter(
            torch.zeros(self.kpool, self.head_dim, dtype=config.params_dtype)
        )
        self.index_kpool_compress_gate = nn.Parameter(
            torch.ones(self.head_dim, cfg.hidden_size, dtype=config.params_dtype)
        )
        # The LM loss gives the indexer no gradient: frozen unless its own loss trains it.
        self.requires_grad_(config.indexer_loss_coef > 0)

    @property
    def output_width(self) -> int:
        return self.index_topk + (self.kpool - 1 if self.always_select_tail else 0)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [b, s, D], q_resid [b, s, q_lora_rank], mask [b, s] bool -> token indices [b, s, W] int32."""
        return self.select(self.score(x, q_resid, mask), mask)[0]

    def keys(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token inputs of the k-pools: keys `LayerNorm(wk x)` and pool-gate scores, each [b, s, d]
        (sequence parallelism gathers these over the SP group: 2 x index_head_dim values per token)."""
        return self.k_norm(self.wk(x)), F.linear(x, self.index_kpool_compress_gate)

    def score(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        mask: torch.Tensor,
        keys: tuple[torch.Tensor, torch.Tensor] | None = None,
        query_offset: int = 0,
    ) -> IndexerScores:
        """Steps 1-2: the pools and every query's score of every candidate pool (differentiable in the indexer's
        parameters; the LM path calls it without gradient, the indexer loss on detached inputs).

        x [b, s, D], q_resid [b, s, q_lora_rank]: the queries. `keys` (from `keys()`, [b, S, d] each) and `mask`
        [b, S] describe the key sequence, whose token `query_offset + i` is query i; without `keys` the queries are
        the whole key sequence (S = s, offset 0)."""
        s = x.shape[1]
        device = x.device
        q = self.wq_b(q_resid).unflatten(-1, (self.n_heads, self.head_dim))  # [b, s, Hi, d]
        k, gate_scores = self.keys(x) if keys is None else keys  # [b, S, d]
        b, kv = mask.shape

        # visible[b, i, j]: key j is causal for query i and a real token
        query_positions = torch.arange(s, device=device) + query_offset
        key_positions = torch.arange(kv, device=device)
        visible = (key_positions[None, None, :] <= query_positions[None, :, None]) & mask[:, None, :]
        first_real = torch.where(mask.any(-1), mask.long().argmax(-1), torch.full((b,), kv, device=device))

        pool_keys, pool_tokens, pool_complete = self._pools(k, gate_scores, mask, first_real)

        # [b, s, Hi, d] @ [b, 1, d, P] -> [b, s, Hi, P]; weighted sum over heads -> [b, s, P]
        scores = torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1))
        scores = F.relu(scores * self.head_dim**-0.5)
        head_weights = self.weights_proj(x).float() * self.n_heads**-0.5
        index_scores = torch.matmul(head_weights.unsqueeze(-2), scores).squeeze(-2)

        pool_last = pool_tokens[..., -1].clamp(0, kv - 1)
        last_visible = visible.gather(-1, pool_last[:, None, :].expand(b, s, -1))
        candidates = last_visible & pool_complete[:, None]  # [b, s, P]
        return IndexerScores(index_scores, candidates, pool_tokens, visible, first_real)

    @torch.no_grad()
    def select(self, scored: IndexerScores, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 3-4: token indices [b, s, W] int32 (into the key sequence) and the selected pools [b, s, P]
        bool; `mask` [b, s]: the queries' padding mask."""
        b, s = mask.shape
        index_scores = scored.index_scores.detach()
        candidates, pool_tokens = scored.candidates, scored.pool_tokens
        index_scores = index_scores.masked_fill(~candidates, torch.finfo(index_scores.dtype).min)

        n_select = min(self.index_topk // self.kpool, index_scores.shape[-1])
        chosen = index_scores.topk(n_select, dim=-1).indices  # [b, s, K]
        chosen_ok = candidates.gather(-1, chosen)
        selected = torch.zeros_like(candidates).scatter_(-1, chosen, chosen_ok)
        tokens = pool_tokens[torch.arange(b, device=mask.device)[:, None, None], chosen]  # [b, s, K, kpool]
        tokens = tokens.masked_fill(~chosen_ok[..., None], -1).flatten(-2)  # [b, s, K * kpool]

        if self.always_select_tail and self.kpool > 1:
            tokens = torch.cat([tokens, self._tail(scored.visible, scored.first_real)], dim=-1)
        width = self.output_width
        tokens = F.pad(tokens, (0, max(width - tokens.shape[-1], 0)), value=-1)[..., :width]
        tokens = tokens.masked_fill(~mask[..., None], -1)
        return tokens.to(torch.int32), selected & mask[..., None]

    def _pools(
        self, k: torch.Tensor, gate_scores: torch.Tensor, mask: torch.Tensor, first_real: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pool keys [b, P, d], their token indices [b, P, kpool] (-1 outside) and completeness [b, P]."""
        b, s, _ = k.shape
        n_pools = (s + self.kpool - 1) // self.kpool
        offsets = torch.arange(n_pools * self.kpool, device=k.device).view(1, n_pools, self.kpool)
        tokens = first_real[:, None, None] + offsets  # [b, P, kpool]
        batch = torch.arange(b, device=k.device)[:, None, None]
        safe = tokens.clamp(0, s - 1)
        real = mask[batch, safe] & (tokens < s)
        complete = real.all(-1)
        tokens = tokens.masked_fill(~real, -1)

        logits = gate_scores[batch, safe].float() + self.index_kpool_compress_ape.float()[None, None]
        logits = logits.masked_fill(~real[..., None], float("-inf"))
        weights = torch.nan_to_num(logits.softmax(dim=2)).to(k.dtype)  # all-padding pools give 0, not NaN
        pool_keys = (weights * k[batch, safe]).sum(dim=2)
        # Pools incomplete in every row are dropped (the candidate set HF scores over).
        keep = complete.any(0)
        return pool_keys[:, keep], tokens[:, keep], complete[:, keep]

    def _tail(self, visible: torch.Tensor, first_real: torch.Tensor) -> torch.Tensor:
        """Token indices [b, s, kpool - 1] of each query's visible tokens after its last complete pool."""
        b, s, kv = visible.shape
        n_visible = visible.long().sum(-1)  # [b, s]
        n_tail = n_visible.remainder(self.kpool)
        offsets = torch.arange(self.kpool - 1, device=visible.device)
        start = first_real[:, None] + n_visible - n_tail
        tail = start[..., None] + offsets  # [b, s, kpool - 1]
        ok = (offsets[None, None, :] < n_tail[..., None]) & (tail < kv)
        ok &= visible.gather(-1, tail.clamp(0, kv - 1))
        return tail.masked_fill(~ok, -1)


def indexer_kl_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
    """The KL loss itself: `indexer_kl_terms` summed, divided by the number of queries with a target."""
    total, rows = indexer_kl_terms(*args, **kwargs)
    return total / rows.clamp_min(1)


def indexer_kl_terms(
    q: torch.Tensor,
    k: torch.Tensor,
    allowed: torch.Tensor,
    scaling: float,
    scored: IndexerScores,
    selected: torch.Tensor,
    chunk_bytes: int = 256 * 1024**2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(attention || indexer) over each query's selected pools, averaged over the queries that have any
    (docs/indexer_loss.md). q, k [b, H, s, d] and allowed [b, 1, s, s] as the main attention uses them (detached
    here); `scored` from `DsaIndexer.score` (the gradient flows into its index scores only); selected [b, s, P].

    Target p[i, P] = sum_{j in P} sum_h softmax_h(q k^T scaling | allowed)[i, j], normalised over the selected pools;
    model r[i, .] = softmax of the index scores over the selected pools; loss_i = sum_P p log(p / r).
    Computed over chunks of queries so that the [b, H, chunk, s] probabilities stay under `chunk_bytes`.
    Returns (sum of loss_i, number of queries with a target): packed documents add both up across documents."""
    q, k = q.detach().float(), k.detach().float()
    b, heads, s, _ = q.shape
    pools, kpool = scored.pool_tokens.shape[1:]
    token_index = scored.pool_tokens.clamp(min=0).reshape(b, 1, pools * kpool)
    token_valid = (scored.pool_tokens >= 0).reshape(b, 1, pools * kpool)
    chunk = max(1, chunk_bytes // max(1, b * heads * s * 4))
    total = scored.index_scores.new_zeros(())
    rows = scored.index_scores.new_zeros(())
    for start in range(0, s, chunk):
        end = min(start + chunk, s)
        logits = torch.matmul(q[:, :, start:end], k.transpose(-1, -2)) * scaling  # [b, H, c, s]
        logits = logits.masked_fill(~allowed[:, :, start:end], float("-inf"))
        probs = torch.nan_to_num(logits.softmax(-1)).sum(1)  # [b, c, s]: summed over heads
        per_token = probs.gather(-1, token_index.expand(b, end - start, -1)) * token_valid
        sel = selected[:, start:end]
        mass = per_token.view(b, end - start, pools, kpool).sum(-1) * sel  # [b, c, P]
        norm = mass.sum(-1, keepdim=True)
        ok = (norm.squeeze(-1) > 0) & sel.any(-1)  # queries with a target
        p = mass / norm.clamp_min(torch.finfo(mass.dtype).tiny)
        scores = scored.index_scores[:, start:end].masked_fill(~sel, float("-inf"))
        log_r = torch.log_softmax(torch.where(ok[..., None], scores, torch.zeros_like(scores)), -1)
        terms = torch.where(p > 0, p * (torch.log(p.clamp_min(torch.finfo(p.dtype).tiny)) - log_r), 0.0)
        total = total + (terms.sum(-1) * ok).sum()
        rows = rows + ok.sum()
    return total, rows
