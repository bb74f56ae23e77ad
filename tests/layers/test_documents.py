"""Packed documents (`cu_seqlens`): every document of a packed row is computed exactly as if it were alone.

Against transformers run on each document alone: fp32 logits max relative error <= 1e-5 per document, and the
gradient of every parameter of the packed loss equals the gradient of the token-weighted mean of the
per-document HF losses (<= 1e-4 relative to its max magnitude). The row mixes documents longer than index_topk
(sparse DSA selection active), 1- and 2-token documents, a `shared` indexer layer, KDA and MoE (CONFIG_A).
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.gpt import GPTModel

import glm53_ds
from glm53_ds import get_glm53_block_spec, load_hf_into, make_transformer_config
from glm53_ds.config import Glm53Config
from glm53_ds.layers.documents import Documents
from tests.layers.test_mtp import reference_mtp
from tests.model_fixtures import (
    CONFIG_A,
    add_mtp_tensors,
    hf_grads_by_native,
    load_hf_reference,
    rel_err,
    save_tiny_hf,
)

LENGTHS = [13, 1, 2, 11, 9]  # index_topk = 8: the long documents select sparsely


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_packed")
    save_tiny_hf(path, CONFIG_A)
    mtp_tensors = add_mtp_tensors(path, seed=7)
    cfg = Glm53Config.from_hf(str(path))
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, cfg.vocab_size, (1, sum(LENGTHS)), generator=g)
    cu = torch.tensor([0] + LENGTHS).cumsum(0)
    return path, cfg, mtp_tensors, load_hf_reference(path), glm53_ds.load_hf(str(path)).eval(), ids, cu


def _documents(cu):
    return [(int(a), int(b)) for a, b in zip(cu[:-1], cu[1:], strict=True)]


def test_logits_equal_each_document_alone(packed):
    _, _, _, hf, ours, ids, cu = packed
    with torch.no_grad():
        logits = ours(ids, cu_seqlens=cu)
        unpacked = ours(ids)
        crossed = 0.0
        for a, b in _documents(cu):
            ref = hf(input_ids=ids[:, a:b]).logits
            assert rel_err(logits[:, a:b], ref) <= 1e-5, (a, b)
            crossed = max(crossed, rel_err(unpacked[:, a:b], ref))
    assert crossed > 1e-3  # control: without cu_seqlens the documents see each other


@pytest.mark.slow
def test_gradients_equal_token_weighted_per_document_losses(packed):
    path, cfg, _, hf, _, ids, cu = packed
    ours = glm53_ds.load_hf(str(path), mtp=False)  # HF has no MTP: compare the LM loss
    hf.zero_grad()
    targets = sum(b - a - 1 for a, b in _documents(cu))
    for a, b in _documents(cu):
        if b - a > 1:  # a 1-token document has no target
            loss = hf(input_ids=ids[:, a:b], labels=ids[:, a:b]).loss
            (loss * (b - a - 1) / targets).backward()
    ours(ids, labels=ids, cu_seqlens=cu).backward()
    ref = hf_grads_by_native(hf, cfg)
    checked = 0
    for name, p in ours.named_parameters():
        if name not in ref:
            assert ".indexer." in name and p.grad is None, name  # frozen, as HF's no_grad indexer
            continue
        for index, expected in ref[name]:
            got = p.grad[index] if index else p.grad
            assert rel_err(got, expected) <= 1e-4, f"{name}{index}: {rel_err(got, expected)}"
            checked += 1
    assert checked > 50


def test_mtp_packed_equals_reference_per_document(packed):
    _, cfg, mtp_tensors, hf, ours, ids, cu = packed
    with torch.no_grad():
        logits = ours.mtp_logits(ids, cu_seqlens=cu)[0]
        for a, b in _documents(cu):
            doc = ids[:, a:b]
            mask = torch.ones_like(doc, dtype=torch.bool)
            ref, _, _, valid = reference_mtp(hf, cfg, mtp_tensors, doc, mask, doc)
            if valid.any():
                assert rel_err(logits[:, a:b][valid], ref[valid]) <= 1e-5, (a, b)


def test_packed_rows_in_a_stock_gpt_model(packed):
    """megatron's PackedSeqParams reach the GLM layers through GPTModel: same logits as Glm53Model's cu_seqlens."""
    path, cfg, _, _, ours, ids, cu = packed
    gpt = GPTModel(
        make_transformer_config(cfg), get_glm53_block_spec(cfg), vocab_size=cfg.vocab_size,
        max_sequence_length=ids.shape[1], position_embedding_type="none",
    )  # fmt: skip
    load_hf_into(gpt.eval(), str(path))
    params = Documents.from_cu_seqlens(cu, ids.shape[1]).packed_seq_params()
    with torch.no_grad():
        got = gpt(ids, torch.arange(ids.shape[1])[None], attention_mask=None, packed_seq_params=params)
        assert torch.equal(got, ours(ids, cu_seqlens=cu))


@pytest.mark.parametrize(
    "cu, length, batch, message",
    [
        ([1, 5, 10], 10, 1, "start at 0"),
        ([0, 5, 9], 10, 1, "end at the row length 10"),
        ([0, 5, 5, 10], 10, 1, "strictly increasing"),
        ([0, 10], 10, 2, "batch must be 1"),
    ],
)
def test_bad_cu_seqlens_is_named(packed, cu, length, batch, message):
    _, cfg, _, _, ours, _, _ = packed
    ids = torch.ones(batch, length, dtype=torch.long)
    with pytest.raises(ValueError, match=f"cu_seqlens.*{message}|{message}.*cu_seqlens|cu_seqlens"):
        ours(ids, cu_seqlens=torch.tensor(cu))
    with pytest.raises(ValueError, match=message):
        Documents.from_cu_seqlens(torch.tensor(cu), length, batch)


@pytest.mark.parametrize("cu", [[0, 5, 10], torch.tensor([0.0, 10.0]), torch.tensor([[0, 10]])])
def test_cu_seqlens_of_the_wrong_type_is_named_before_the_input_read(packed, cu):
    """The model reads cu_seqlens together with its input check (one host read); a list, a float or a 2-D tensor is
    refused by the one type check before that read, with the message Documents gives."""
    _, _, _, _, ours, _, _ = packed
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D integer tensor"):
        ours(torch.ones(1, 10, dtype=torch.long), cu_seqlens=cu)
