"""DSA k-pool indexer (HF `Glm5NextTextIndexer`, training/prefill path without a cache), streamed over query blocks.

For each query it picks which keys the sparse MLA may attend to:
  1. Keys `k = LayerNorm(wk x)` are grouped into pools of `index_kpool` consecutive tokens, starting at the
     sequence's first real (non-padding) token. A pool's key is a softmax-weighted mean of its tokens' keys
     (weights: `x @ index_kpool_compress_gate^T + index_kpool_compress_ape[position in pool]`).
     A pool is complete when all its tokens are real and inside the sequence.
  2. Score per query and pool: `sum_h w_h(x) * relu(q_h . pool_key / sqrt(d))`, with
     `q = wq_b(q_resid)` per indexer head and `w = weights_proj(x) / sqrt(H)`.
  3. Only complete pools whose last token is visible (causal, not padding) are candidates; the top
     `index_topk / index_kpool` are expanded back to token indices, highest score first.
  4. With `index_kpool_always_select_tail`, the visible tokens after the last complete pool (the incomplete
     tail, at most `index_kpool - 1`) are always appended.
Output: int32 `[b, s, W]` token indices, -1 = empty slot, with W = index_topk (+ index_kpool - 1 with the tail);
rows of padding queries are all -1. Slots `[k * kpool, (k + 1) * kpool)` hold the k-th chosen pool, then the tail.

Memory is O(L): the pools ([b, P, d], P = L / kpool) are built once, then steps 2-4 run per block of query rows.
`indexer_impl` (glm53_ds/backends.py) picks how steps 2-3 run:
  - `torch` (default off CUDA): HF's expression, one block's `[rows, heads, P]` scores at a time (`block_rows`, under
    `SCORE_BLOCK_BYTES`) and `topk`. Its selections equal HF's exactly (tests/test_module_parity.py). In a packed row
    (`document_pools`) `topk` sees the row's pools, not one document's, so its order of exactly tied scores would
    be neither HF's per document nor defined: there ties rank by ascending pool (`top_pools_stable`), the kernel's
    order.
  - `triton` (default on CUDA): one streaming kernel that keeps a running top-k in registers (`indexer_topk.py`),
    holding only the block's queries. Its selections equal the torch path's, except that exactly equal scores are
    ranked by ascending pool, where `topk`'s order is its device's (`indexer_topk.py`).
Visibility is derived from positions (a key j is visible to query i iff j <= i and j is real; the count of visible
keys is a cumulative sum of the mask), never stored as `[s, S]`.

Runs without gradient (HF's indexer is `no_grad`: its parameters are not trained by the language-model loss). Its
parameters are therefore frozen (`requires_grad=False`: out of the optimizer, ZeRO's buffers and the gradient
norm) unless `indexer_loss_coef > 0`, which trains them with their own loss (`kl_terms` below, equations in
docs/indexer_loss.md), streamed the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import backends, host_reads
from ..transformer_config import Glm53TransformerConfig
from .documents import Documents
from .indexer_topk import NOT_VISIBLE, top_pools_fused, top_pools_stable
from .linear import ColumnLinear

# One block of query rows holds its [b, rows, heads, P] fp32 scores (and their weighted sum) under this many bytes:
# small on CPU (cache), larger on CUDA (fewer, fuller launches: 128k tokens at kpool 4 are ~550 blocks). Meta tensors
# stand for the GPU's (the planner measures their bytes), so they take CUDA's blocks: with its own 16 GiB blocks on
# meta the planner saw indexer blocks a GPU never holds (a DSA layer's forward peak 24.5 GiB at 128k, SP 16).
SCORE_BLOCK_BYTES = {"cpu": 64 * 2**20, "cuda": 2**30}
SCORE_BLOCK_BYTES["meta"] = SCORE_BLOCK_BYTES["cuda"]


@dataclass
class Pools:
    """The k-pools of one key sequence [b, S]: a whole row (`DsaIndexer.pools`: pools start at its first real token)
    or a packed row of documents (`DsaIndexer.document_pools`: each document's pools start at its first real token,
    and only its own queries see them)."""

    keys: torch.Tensor  # [b, P, d] pool keys (differentiable in the indexer's parameters when it trains)
    tokens: torch.Tensor  # [b, P, kpool] token indices, -1 outside the sequence
    # [b, P] int64: a complete pool's last token (a candidate from there), else NOT_VISIBLE
    visible_from: torch.Tensor
    # [b, P] int64: a candidate only for queries before this position (its document's end); None: to the row's end
    visible_to: torch.Tensor | None
    first_real: (
        torch.Tensor
    )  # [b, S]: the first real token of the document holding each position (row: the row's)
    n_real_before: torch.Tensor  # [b, S]: real keys before the document holding each position (row: 0)
    mask: torch.Tensor  # [b, S] bool: real keys
    n_real_upto: torch.Tensor  # [b, S] number of real keys at positions <= j


@dataclass
class Selection:
    tokens: torch.Tensor  # [b, s, W] int32 token indices, -1 = empty
    pools: torch.Tensor  # [b, s, K] int64: the chosen pools (into `Pools`), K = index_topk / index_kpool
    pools_ok: torch.Tensor  # [b, s, K] bool: a chosen pool that is a candidate (the "selected pools")


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
        self.indexer_impl = config.indexer_impl
        self.score_block_bytes: int | None = None  # None: SCORE_BLOCK_BYTES of the device
        # The LM loss gives the indexer no gradient: frozen unless its own loss trains it.
        self.requires_grad_(config.indexer_loss_coef > 0)

    @property
    def output_width(self) -> int:
        return self.index_topk + (self.kpool - 1 if self.always_select_tail else 0)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [b, s, D], q_resid [b, s, q_lora_rank], mask [b, s] bool -> token indices [b, s, W] int32."""
        return self.select(x, q_resid, mask, self.pools(self.keys(x), mask)).tokens

    def keys(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token inputs of the k-pools: keys `LayerNorm(wk x)` and pool-gate scores, each [b, s, d]
        (sequence parallelism gathers these over the SP group: 2 x index_head_dim values per token)."""
        return self.k_norm(self.wk(x)), F.linear(x, self.index_kpool_compress_gate)

    def pools(
        self, keys: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor, real_length: int | None = None
    ) -> Pools:
        """Step 1 for a key sequence: `keys` from `keys()` ([b, S, d] each), `mask` [b, S] its real tokens;
        `real_length`: the caller knows on the host that exactly the first `real_length` tokens of every row are
        real (no padding: S), else None."""
        k, gate_scores = keys
        b, s, _ = k.shape
        device = k.device
        first_real = torch.where(mask.any(-1), mask.long().argmax(-1), torch.full((b,), s, device=device))
        n_pools = (s + self.kpool - 1) // self.kpool
        offsets = torch.arange(n_pools * self.kpool, device=device).view(1, n_pools, self.kpool)
        tokens = first_real[:, None, None] + offsets  # [b, P, kpool]
        batch = torch.arange(b, device=device)[:, None, None]
        safe = tokens.clamp(0, s - 1)
        real = mask[batch, safe] & (tokens < s)
        complete = real.all(-1)
        tokens = tokens.masked_fill(~real, -1)

        logits = gate_scores[batch, safe].float() + self.index_kpool_compress_ape.float()[None, None]
        logits = logits.masked_fill(~real[..., None], float("-inf"))
        weights = torch.nan_to_num(logits.softmax(dim=2)).to(k.dtype)  # all-padding pools give 0, not NaN
        pool_keys = (weights * k[batch, safe]).sum(dim=2)
        # HF scores over the pools complete in some row (and top-k's order of exactly tied scores depends on how
        # many there are). With a known real prefix those are its first real_length // kpool pools, a slice;
        # otherwise which they are is on the device: their indices (`nonzero`), the one host sync of a padded batch's layer.
        if real_length is not None:
            keep: torch.Tensor | slice = slice(0, real_length // self.kpool)
        else:  # shape-only (the dry run) cannot know which pools are complete: all of them
            keep = host_reads.true_indices(complete.any(0), shape_only=lambda: slice(0, n_pools))
        tokens, complete = tokens[:, keep], complete[:, keep]
        last = tokens[..., -1].clamp(0, s - 1)
        return Pools(
            keys=pool_keys[:, keep], tokens=tokens, visible_from=last.masked_fill(~complete, NOT_VISIBLE),
            visible_to=None, first_real=first_real[:, None].expand(b, s),
            n_real_before=mask.new_zeros(b, s, dtype=torch.long), mask=mask, n_real_upto=mask.long().cumsum(-1),
        )  # fmt: skip

    def document_pools(
        self, keys: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor, documents: Documents
    ) -> Pools:
        """Step 1 for a packed row (`documents`: its boundaries, layers/documents.py), as tensor code whose shapes do
        not depend on the packing (a compiled layer traces it once): `keys` from `keys()` ([b, S, d] each), `mask`
        [b, S] its real tokens. Each document's pools start at its first real token, as if it were alone. The row's
        complete pools fill the first of S // kpool slots in row order (a document's are consecutive); a slot's
        pool is a candidate only for the queries of its document that see its last token (`visible_from`,
        `visible_to`). Incomplete pools are no query's candidates and take no slot (the whole-row `pools` keeps
        HF's array, whose length decides `topk`'s order of exact ties; `select` ranks ties by ascending slot here)."""
        k, gate_scores = keys
        b, s, _ = k.shape
        device, kpool = k.device, self.kpool
        rows = torch.arange(s, device=device)
        starts = rows - documents.positions.to(device)  # [S]: each position's document's first token
        ids = documents.ids.to(device)
        ends = torch.searchsorted(ids, ids, right=True)  # [S]: ... and its end (ids ascend along the row)
        # the first real token at or after each position (s: none), then at each document's start
        next_real = torch.where(mask, rows, s).flip(-1).cummin(-1).values.flip(-1)  # [b, S]
        first_real = next_real[:, starts].minimum(ends)  # [b, S]: a document without real tokens: its end
        n_real_upto = mask.long().cumsum(-1)  # [b, S]

        def real_upto(position: torch.Tensor) -> torch.Tensor:
            """[b, S]: real keys at positions <= `position` ([S] or [b, S]; -1: none)."""
            position = position.expand(b, s)
            return torch.where(position >= 0, n_real_upto.gather(-1, position.clamp(min=0)), 0)

        # a position's pool in its document, and whether that pool is complete (inside the document, all real)
        offset = rows - first_real  # [b, S]: negative before the document's first real token
        pool_last = rows + (kpool - 1) - offset.remainder(kpool)
        inside = pool_last < ends
        filled = real_upto(pool_last.clamp(max=s - 1)) - real_upto(pool_last - kpool) == kpool
        # [b, S]: the last token of a complete pool
        closes_pool = (offset >= 0) & (pool_last == rows) & inside & filled
        n_pools = s // kpool  # complete pools are disjoint runs of kpool tokens
        slot = torch.where(closes_pool, closes_pool.long().cumsum(-1) - 1, n_pools)
        last = torch.full((b, n_pools + 1), -1, dtype=torch.long, device=device)
        # [b, P]: each slot's last token, -1: an empty slot (the spare slot n_pools takes the other positions)
        last = last.scatter_reduce(1, slot, rows.expand(b, s), reduce="amax")[:, :n_pools]
        complete = last >= 0
        tokens = (last[..., None] - (kpool - 1) + torch.arange(kpool, device=device)).masked_fill(
            ~complete[..., None], -1
        )
        batch = torch.arange(b, device=device)[:, None, None]
        safe = tokens.clamp(min=0)
        # the whole-row expression on complete pools (every token real: no mask, no NaN)
        logits = gate_scores[batch, safe].float() + self.index_kpool_compress_ape.float()[None, None]
        weights = logits.softmax(dim=2).to(k.dtype)
        return Pools(
            keys=(weights * k[batch, safe]).sum(dim=2), tokens=tokens,
            visible_from=last.masked_fill(~complete, NOT_VISIBLE),
            visible_to=ends[last.clamp(min=0)].masked_fill(~complete, NOT_VISIBLE),
            first_real=first_real, n_real_before=real_upto(starts - 1), mask=mask, n_real_upto=n_real_upto,
        )  # fmt: skip

    def block_bytes(self, device: torch.device) -> int:
        if self.score_block_bytes is not None:
            return self.score_block_bytes
        return SCORE_BLOCK_BYTES.get(device.type, SCORE_BLOCK_BYTES["cpu"])

    def block_rows(self, batch: int, n_pools: int, device: torch.device) -> int:
        """Query rows per block: the block's [b, rows, heads, P] fp32 scores stay under `block_bytes`."""
        return max(1, self.block_bytes(device) // max(1, 4 * batch * (self.n_heads + 2) * max(n_pools, 1)))

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's queries q [b, r, Hi, d] and their head weights [b, r, Hi] fp32 (`weights_proj(x) /
        sqrt(Hi)`) for x [b, r, D], q_resid [b, r, q_lora_rank]."""
        q = self.wq_b(q_resid).unflatten(-1, (self.n_heads, self.head_dim))
        return q, self.weights_proj(x).float() * self.n_heads**-0.5

    def scores(self, x: torch.Tensor, q_resid: torch.Tensor, pool_keys: torch.Tensor) -> torch.Tensor:
        """Step 2 for a block of queries: x [b, r, D], q_resid [b, r, q_lora_rank], pool keys [b, P, d] or, per
        query, [b, r, P, d] -> index scores [b, r, P] fp32."""
        q, head_weights = self.queries(x, q_resid)  # [b, r, Hi, d], [b, r, Hi]
        keys = pool_keys.unsqueeze(1) if pool_keys.dim() == 3 else pool_keys  # [b, 1 or r, P, d]
        # [b, r, Hi, d] @ [b, 1 or r, d, P] -> [b, r, Hi, P]; weighted sum over heads -> [b, r, P]
        scores = torch.matmul(q.float(), keys.transpose(-1, -2).float())
        scores = F.relu(scores * self.head_dim**-0.5)
        return torch.matmul(head_weights.unsqueeze(-2), scores).squeeze(-2)

    def candidates(self, pools: Pools, positions: torch.Tensor) -> torch.Tensor:
        """[b, r, P] bool: complete pools whose last token the queries at key positions `positions` [r] see (in
        their document)."""
        seen = pools.visible_from[:, None, :] <= positions[None, :, None]
        return (
            seen
            if pools.visible_to is None
            else seen & (positions[None, :, None] < pools.visible_to[:, None, :])
        )

    @torch.no_grad()
    def select(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        query_mask: torch.Tensor,
        pools: Pools,
        query_offset: int = 0,
    ) -> Selection:
        """Steps 2-4, block by block: x [b, s, D], q_resid [b, s, q_lora_rank] the queries, query i being key
        `query_offset + i` of the pools' sequence; query_mask [b, s] their padding mask."""
        b, s = query_mask.shape
        n_pools = pools.keys.shape[1]
        fused = backends.resolve(backends.INDEXER, self.indexer_impl, x.device) == "triton"
        # a block of the kernel's path holds its queries [b, rows, Hi, d] (and their head weights), not P scores
        per_row = 4 * b * self.n_heads * (self.head_dim + 1) if fused else None
        rows = (
            max(1, self.block_bytes(x.device) // per_row)
            if per_row
            else self.block_rows(b, n_pools, x.device)
        )
        n_select = min(self.index_topk // self.kpool, n_pools)
        batch = torch.arange(b, device=x.device)[:, None, None]
        parts = []
        for start in range(0, s, rows):
            end = min(start + rows, s)
            positions = torch.arange(start, end, device=x.device) + query_offset
            if fused:
                from . import indexer_topk_triton  # noqa: F401  (lazy: registers the kernel)

                q, head_weights = self.queries(x[:, start:end], q_resid[:, start:end])
                chosen = top_pools_fused(
                    q, head_weights, pools.keys, pools.visible_from, query_offset + start, n_select,
                    self.head_dim**-0.5, pools.visible_to,
                )  # fmt: skip
                chosen_ok = chosen >= 0  # [b, r, K]
            elif pools.visible_to is None:  # HF's expression
                index_scores = self.scores(x[:, start:end], q_resid[:, start:end], pools.keys)
                candidates = self.candidates(pools, positions)  # [b, r, P]
                index_scores = index_scores.masked_fill(~candidates, torch.finfo(index_scores.dtype).min)
                chosen = index_scores.topk(n_select, dim=-1).indices  # [b, r, K]
                chosen_ok = candidates.gather(-1, chosen)
            else:  # documents: HF's scores, exact ties ranked by ascending pool (the kernel's order)
                index_scores = self.scores(x[:, start:end], q_resid[:, start:end], pools.keys)
                chosen, chosen_ok = top_pools_stable(
                    index_scores, self.candidates(pools, positions), n_select
                )
            chosen = chosen.long().masked_fill(
                ~chosen_ok, 0
            )  # a slot without a candidate: pool 0, not selected
            tokens = pools.tokens[batch, chosen]  # [b, r, K, kpool]
            tokens = tokens.masked_fill(~chosen_ok[..., None], -1).flatten(-2)  # [b, r, K * kpool]
            if self.always_select_tail and self.kpool > 1:
                tokens = torch.cat([tokens, self._tail(pools, positions)], dim=-1)
            parts.append((tokens, chosen, chosen_ok))
        width = self.output_width
        tokens = torch.cat([p[0] for p in parts], dim=1)
        tokens = F.pad(tokens, (0, max(width - tokens.shape[-1], 0)), value=-1)[..., :width]
        tokens = tokens.masked_fill(~query_mask[..., None], -1)
        chosen_ok = torch.cat([p[2] for p in parts], dim=1) & query_mask[..., None]
        return Selection(tokens.to(torch.int32), torch.cat([p[1] for p in parts], dim=1), chosen_ok)

    def _tail(self, pools: Pools, positions: torch.Tensor) -> torch.Tensor:
        """Token indices [b, r, kpool - 1] of each query's visible tokens after its last complete pool."""
        kv = pools.mask.shape[1]
        # [b, r]: real keys of the query's document at positions <= the query's
        n_visible = pools.n_real_upto[:, positions] - pools.n_real_before[:, positions]
        n_tail = n_visible.remainder(self.kpool)
        offsets = torch.arange(self.kpool - 1, device=positions.device)
        start = pools.first_real[:, positions] + n_visible - n_tail
        tail = start[..., None] + offsets  # [b, r, kpool - 1]
        ok = (offsets[None, None, :] < n_tail[..., None]) & (tail < kv)
        safe = tail.clamp(0, kv - 1)
        ok &= (tail <= positions[None, :, None]) & pools.mask.gather(-1, safe.flatten(1)).view_as(safe)
        return tail.masked_fill(~ok, -1)

    def kl_terms(
        self, x: torch.Tensor, q_resid: torch.Tensor, pools: Pools, selection: Selection, target: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer loss's (sum over queries, number of queries with a target), block by block (docs/indexer_loss.md):
        x, q_resid [b, s, .] the queries (detached), `selection` theirs, `target` [b, s, K] the main attention's
        mass on each chosen pool (no gradient, `pooled_attention_mass`). The gradient reaches the indexer's
        parameters through the index scores of the chosen pools, recomputed per block in backward."""
        b, s = x.shape[:2]
        n_chosen = selection.pools.shape[-1]
        # a block holds its [b, rows, K, d] gathered pool keys and [b, rows, heads, K] scores
        per_row = 4 * b * n_chosen * (self.head_dim + self.n_heads + 2)
        rows = max(1, self.block_bytes(x.device) // max(1, per_row))
        batch = torch.arange(b, device=x.device)[:, None, None]
        total, count = x.new_zeros((), dtype=torch.float32), x.new_zeros((), dtype=torch.float32)

        def block(
            xb: torch.Tensor, qb: torch.Tensor, pool_keys: torch.Tensor, chosen: torch.Tensor
        ) -> torch.Tensor:
            return self.scores(xb, qb, pool_keys[batch, chosen])  # [b, r, K]: the chosen pools' index scores

        grad = torch.is_grad_enabled()
        for start in range(0, s, rows):
            sl = slice(start, min(start + rows, s))
            args = (x[:, sl], q_resid[:, sl], pools.keys, selection.pools[:, sl])
            scores = checkpoint(block, *args, use_reentrant=False) if grad else block(*args)
            t, n = kl_from_scores(scores, selection.pools_ok[:, sl], target[:, sl])
            total, count = total + t, count + n
        return total, count


def kl_from_scores(
    scores: torch.Tensor, pools_ok: torch.Tensor, mass: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(p || r) summed over queries, and their count: scores [b, s, K] the index scores of the chosen pools,
    pools_ok [b, s, K] which of them are selected, mass [b, s, K] the attention mass on each (no gradient).
    p = mass normalised over the selected pools, r = softmax of the scores over the same pools; a query counts when
    it has a selected pool with positive mass."""
    mass = mass * pools_ok
    norm = mass.sum(-1, keepdim=True)
    ok = (norm.squeeze(-1) > 0) & pools_ok.any(-1)  # queries with a target
    p = mass / norm.clamp_min(torch.finfo(mass.dtype).tiny)
    masked = scores.masked_fill(~pools_ok, float("-inf"))
    log_r = torch.log_softmax(torch.where(ok[..., None], masked, torch.zeros_like(masked)), -1)
    terms = torch.where(p > 0, p * (torch.log(p.clamp_min(torch.finfo(p.dtype).tiny)) - log_r), 0.0)
    return (terms.sum(-1) * ok).sum(), ok.sum().to(torch.float32)


def kl_loss(total: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """A layer's indexer loss from its terms: the KL sum over its queries, divided by their number."""
    return total / queries.clamp_min(1)
