"""The DSA indexer's streaming Triton kernel (`glm53::indexer_topk_triton`, TRITON_INTERPRET=1 here) against the
torch path (`indexer_impl=torch`: HF's expression and `topk`, equal to transformers' selections bitwise,
tests/test_module_parity.py).

- Without exact ties (asserted: every row's candidate scores distinct), the kernel's chosen pools equal the torch
  path's, in its order, in fp32 and bf16, at shapes that take each of the kernel's branches: heads and head dim not
  powers of 2, K not a power of 2 and above one product's pools (two sub-blocks per step), pools never visible,
  queries that are a later part of the sequence (sequence parallelism), padded rows.
- With exact ties (duplicated pools, rows whose every head the ReLU zeroes, negative head weights), the
  kernel ranks equal scores by ascending pool: the order of torch's stable sort, an independent oracle. The
  control: `topk` (HF's) orders the same ties otherwise, so the test tells the two rules apart.
- Through the layer (`DsaIndexer.select` on a tiny model, left padding, an SP-style query offset): the kernel's
  selection equals the stable oracle of the layer's own scores, and the torch path's where its rows have no tie.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glm53_ds.layers import indexer_topk, indexer_topk_triton  # noqa: F401  (the kernel: registers it)
from glm53_ds.layers.indexer_topk import NOT_VISIBLE, top_pools_fused


def _scores(q, head_weights, keys, scale):
    """HF's expression ([b, r, P] fp32), as `DsaIndexer.scores` computes it."""
    s = F.relu(torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1)) * scale)
    return torch.matmul(head_weights.unsqueeze(-2), s).squeeze(-2)


def _candidates(visible_from, rows, offset):
    return visible_from[:, None, :] <= (torch.arange(rows) + offset)[None, :, None]


def _topk_choice(scores, candidates, k):
    """The torch path's (HF's) choice: [b, r, k] pools, -1 where no candidate."""
    masked = scores.masked_fill(~candidates, torch.finfo(torch.float32).min)
    chosen = masked.topk(k, dim=-1).indices
    return torch.where(candidates.gather(-1, chosen), chosen, -1).to(torch.int32)


def _stable_choice(scores, candidates, k):
    """The kernel's order from torch's stable sort: score descending, equal scores by ascending pool."""
    masked = scores.masked_fill(~candidates, float("-inf")) + 0.0  # + 0.0: -0.0 becomes +0.0
    chosen = masked.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.where(candidates.gather(-1, chosen), chosen, -1).to(torch.int32)


def _tie_free(scores, candidates):
    """[b, r] bool: the queries no two of whose candidates' scores are equal."""
    return torch.tensor([[len(set(r[c].tolist())) == int(c.sum()) for r, c in zip(rows, cands, strict=True)]
                         for rows, cands in zip(scores, candidates, strict=True)])  # fmt: skip


def _inputs(b, rows, heads, dim, n_pools, dtype, seed, kpool=4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, rows, dim, generator=g)
    q[:, 0] = q[:, 0].abs()  # head 0's dots positive: no pool's score is 0 by every head's ReLU (no ties)
    q = q.to(dtype).transpose(1, 2)  # [b, rows, heads, dim] as a view
    head_weights = torch.randn(b, rows, heads, generator=g)
    keys = torch.randn(b, n_pools, dim, generator=g).abs().to(dtype)
    visible_from = (torch.arange(n_pools) * kpool + kpool - 1).repeat(b, 1)
    visible_from[:, -1] = NOT_VISIBLE  # an incomplete last pool
    visible_from[-1, :2] = NOT_VISIBLE  # the last row: its first pools hold padding
    return q, head_weights, keys, visible_from


CASES = [  # b, rows, heads, dim, pools, K, query offset
    (1, 16, 2, 16, 8, 4, 0),  # the tiny model's indexer: 2 heads
    (2, 40, 3, 24, 20, 6, 30),  # heads, dim, K not powers of 2; a later part of the sequence
    (1, 48, 4, 16, 150, 100, 400),  # K2 = 128: two 64-pool products per step
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_the_torch_path_without_ties(case, dtype):
    b, rows, heads, dim, n_pools, k, offset = case
    q, head_weights, keys, visible_from = _inputs(b, rows, heads, dim, n_pools, dtype, seed=sum(case))
    scale = dim**-0.5
    scores = _scores(q, head_weights, keys, scale)
    candidates = _candidates(visible_from, rows, offset)
    masked = scores.masked_fill(~candidates, float("nan"))
    distinct = [len(set(r[~r.isnan()].tolist())) == int((~r.isnan()).sum()) for r in masked.flatten(0, 1)]
    assert all(distinct)  # no exact ties: the two orders cannot differ
    expected = _topk_choice(scores, candidates, k)
    assert bool((expected == -1).any()) and bool((expected >= 0).any())  # rows with fewer candidates than K
    got = top_pools_fused(q, head_weights, keys, visible_from, offset, k, scale)
    assert got.dtype == torch.int32 and torch.equal(got, expected)
    if (
        dtype == torch.bfloat16
    ):  # fp32 pool keys beside bf16 queries: both multiplied in fp32, as the torch path does
        wide = keys.float() + 1e-3  # not a bf16 value: rounding it to bf16 would change the scores
        expected = _topk_choice(_scores(q, head_weights, wide, scale), candidates, k)
        assert torch.equal(top_pools_fused(q, head_weights, wide, visible_from, offset, k, scale), expected)


def test_exact_ties_rank_by_ascending_pool():
    g = torch.Generator().manual_seed(3)
    b, rows, heads, dim, n_pools, k = 1, 32, 2, 16, 24, 8
    q = torch.randn(b, rows, heads, dim, generator=g)
    head_weights = torch.randn(b, rows, heads, generator=g)
    head_weights[:, ::2] = -head_weights[:, ::2].abs()  # negative weights times relu zeros
    keys = torch.randn(b, n_pools, dim, generator=g).abs()
    keys[:, 10:20] = keys[:, 3:4]  # ten copies of pool 3: equal scores
    q[:, 5] = -q[:, 5].abs()  # query 5: every dot negative, every score 0
    visible_from = torch.arange(n_pools).repeat(b, 1)
    scores = _scores(q, head_weights, keys, dim**-0.5)
    candidates = _candidates(visible_from, rows, 0)
    expected = _stable_choice(scores, candidates, k)
    got = top_pools_fused(q, head_weights, keys, visible_from, 0, k, dim**-0.5)
    assert torch.equal(got, expected)
    assert got[0, 5].tolist() == [0, 1, 2, 3, 4, 5, -1, -1]  # all zero: ascending, then no candidates
    # the control: HF's topk orders these ties otherwise, so the rule above is a choice the test sees
    assert not torch.equal(_topk_choice(scores, candidates, k), expected)


@pytest.fixture(scope="module")
def indexer():
    import glm53_ds
    from glm53_ds.config import Glm53Config
    from tests.model_fixtures import CONFIG_A

    torch.manual_seed(0)
    model = glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A)).eval()
    layer = next(m for m in model.modules() if getattr(m, "indexer", None) is not None)
    return layer.indexer


@pytest.mark.parametrize("offset", [0, 6])
def test_the_layer_selects_through_the_kernel(indexer, offset, monkeypatch):
    """Left padding in one row, queries that are the second half of the key sequence under `offset`."""
    g = torch.Generator().manual_seed(offset)
    b, s, hidden = 2, 40, indexer.wk.weight.shape[1]
    x = torch.randn(b, s, hidden, generator=g)
    q_resid = torch.randn(b, s, indexer.wq_b.weight.shape[1], generator=g)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[1, :7] = False
    with torch.no_grad():
        pools = indexer.pools(indexer.keys(x), mask)
        queries = slice(offset, s)
        args = (x[:, queries], q_resid[:, queries], mask[:, queries], pools, offset)
        monkeypatch.setattr(indexer, "indexer_impl", "torch")
        torch_path = indexer.select(*args)
        monkeypatch.setattr(indexer, "indexer_impl", "triton")
        kernel = indexer.select(*args)
        scores = indexer.scores(x[:, queries], q_resid[:, queries], pools.keys)
    k = kernel.pools.shape[-1]
    candidates = _candidates(pools.visible_from, s - offset, offset)
    oracle = _stable_choice(scores, candidates, k)
    chosen = torch.where(kernel.pools_ok, kernel.pools, -1)
    assert torch.equal(chosen[mask[:, queries]], oracle[mask[:, queries]])
    # rows whose candidates tie nowhere: the torch path's selection, token for token
    no_tie = _tie_free(scores, candidates)
    assert bool(no_tie.any()) and bool((~no_tie).any())  # both kinds of rows are here
    assert torch.equal(kernel.tokens[no_tie], torch_path.tokens[no_tie])
    assert torch.equal(kernel.pools_ok, torch_path.pools_ok)


def test_the_fake_gives_the_contract_shape_on_meta():
    q = torch.empty(2, 5, 3, 16, device="meta")
    out = top_pools_fused(q, torch.empty(2, 5, 3, device="meta"), torch.empty(2, 9, 16, device="meta"),
                          torch.empty(2, 9, dtype=torch.int64, device="meta"), 0, 4, 0.25)  # fmt: skip
    assert out.shape == (2, 5, 4) and out.dtype == torch.int32
    with pytest.raises(ValueError, match="indexer visible_from"):
        indexer_topk.check_contract(
            q, torch.empty(2, 5, 3), torch.empty(2, 9, 16), torch.empty(2, 8, dtype=torch.int64)
        )


def _selected_sets(tokens: torch.Tensor) -> list[list[frozenset[int]]]:
    return [[frozenset(t for t in row.tolist() if t >= 0) for row in seq] for seq in tokens]


@pytest.mark.parametrize("offset, padded", [(0, False), (17, True)])
def test_packed_documents_select_as_each_document_alone(indexer, offset, padded, monkeypatch):
    """A packed row's pools (`document_pools`: tensor code over the row) select, for every query, the tokens its
    document alone selects (HF's per-document arrays), through the torch path and the kernel (which agree slot for
    slot: both rank exact ties by ascending pool), also for queries that are a later part of the row (`offset`, as
    under sequence parallelism) and with each document's last position padding (an MTP depth). Compared on the
    queries whose candidates tie nowhere; control: the whole row's pools let queries select across documents."""
    from glm53_ds.layers.documents import Documents

    lengths = [13, 3, 1, 22, 9, 2, 30]
    s, hidden = sum(lengths), indexer.wk.weight.shape[1]
    g = torch.Generator().manual_seed(3 + offset)
    x = torch.randn(1, s, hidden, generator=g)
    q_resid = torch.randn(1, s, indexer.wq_b.weight.shape[1], generator=g)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    documents = Documents.from_cu_seqlens(cu, s)
    mask = torch.ones(1, s, dtype=torch.bool)
    if padded:
        mask[0, cu[1:] - 1] = False
    queries = slice(offset, s)
    with torch.no_grad():
        keys = indexer.keys(x)
        pools = indexer.document_pools(keys, mask, documents)
        args = (x[:, queries], q_resid[:, queries], mask[:, queries], pools, offset)
        monkeypatch.setattr(indexer, "indexer_impl", "torch")
        torch_path = indexer.select(*args)
        whole_row = indexer.select(*args[:3], indexer.pools(keys, mask), offset)
        monkeypatch.setattr(indexer, "indexer_impl", "triton")
        kernel = indexer.select(*args)
        monkeypatch.setattr(indexer, "indexer_impl", "torch")
        alone, tie_free = [], []
        for a, e in documents.bounds:
            doc_pools = indexer.pools((keys[0][:, a:e], keys[1][:, a:e]), mask[:, a:e])
            selection = indexer.select(x[:, a:e], q_resid[:, a:e], mask[:, a:e], doc_pools)
            alone.append(torch.where(selection.tokens >= 0, selection.tokens + a, -1))
            scores = indexer.scores(x[:, a:e], q_resid[:, a:e], doc_pools.keys)
            candidates = indexer.candidates(doc_pools, torch.arange(e - a))
            tie_free += _tie_free(scores, candidates)[0].tolist()
    alone_tokens = torch.cat(alone, dim=1)[:, queries]
    tie_free = tie_free[offset:]
    assert sum(tie_free) > 20 and not all(tie_free)  # both kinds of queries are here
    assert torch.equal(kernel.tokens, torch_path.tokens) and torch.equal(kernel.pools_ok, torch_path.pools_ok)
    got, expected = _selected_sets(torch_path.tokens)[0], _selected_sets(alone_tokens)[0]
    assert [g for g, ok in zip(got, tie_free, strict=True) if ok] == [
        e for e, ok in zip(expected, tie_free, strict=True) if ok
    ]
    crossing = _selected_sets(whole_row.tokens)[0]
    assert [c for c, ok in zip(crossing, tie_free, strict=True) if ok] != [
        e for e, ok in zip(expected, tie_free, strict=True) if ok
    ]
