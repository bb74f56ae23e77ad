"""The chunked linear cross-entropy head (layers/chunked_ce.py) against the materialised [tokens, vocab] path.

Tolerances: fp32 loss rel <= 1e-6, gradients (hidden, output weight, embedding) <= 1e-5 relative to their max
magnitude; bf16: loss rel <= 1e-3 and gradients <= 2e-2 against the materialised bf16 path (which rounds the weight
gradient of one [N, V] matmul to bf16, where the chunked path accumulates it in fp32)."""

from __future__ import annotations

import pytest
import torch

import glm53_ds
from glm53_ds.layers.chunked_ce import IGNORE_INDEX, linear_cross_entropy
from tests.model_fixtures import CONFIG_A, perturb_, rel_err

N, D, V = 37, 16, 50


def _inputs(dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (scale * torch.randn(N, D, generator=g)).to(dtype)
    weight = torch.randn(V, D, generator=g).to(dtype) / D**0.5
    target = torch.randint(0, V, (N,), generator=g)
    target[3] = IGNORE_INDEX
    target[8:16] = IGNORE_INDEX  # a whole chunk of 8 rows without targets
    return hidden, weight, target


def _run(hidden, weight, target, chunk_bytes, normalizer=None):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss = linear_cross_entropy(h, w, target, normalizer, chunk_bytes=chunk_bytes)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("rows", [8, 5, N, 64])  # divides nothing / not divisible / exactly N / more than N
def test_fp32_equals_materialised(rows):
    hidden, weight, target = _inputs()
    ref = _run(hidden, weight, target, 0)
    got = _run(hidden, weight, target, rows * V * 4)
    assert rel_err(got[0], ref[0]) <= 1e-6
    assert rel_err(got[1], ref[1]) <= 1e-5 and rel_err(got[2], ref[2]) <= 1e-5
    assert not got[1][8:16].any()  # no target, no gradient


def test_given_normalizer_and_a_control():
    hidden, weight, target = _inputs(seed=1)
    ref = _run(hidden, weight, target, 0, normalizer=100.0)
    got = _run(hidden, weight, target, 8 * V * 4, normalizer=100.0)
    assert rel_err(got[0], ref[0]) <= 1e-6 and rel_err(got[2], ref[2]) <= 1e-5
    wrong = _run(hidden, weight, target, 8 * V * 4, normalizer=101.0)  # control: a wrong normalizer is caught
    assert rel_err(wrong[0], ref[0]) > 1e-6 and rel_err(wrong[2], ref[2]) > 1e-5


def test_large_logits_need_the_max_subtraction():
    """Control: logits around 1e3 overflow exp() unless the max is subtracted; the chunked path still matches."""
    hidden, weight, target = _inputs(scale=3e3, seed=2)
    ref = _run(hidden, weight, target, 0)
    got = _run(hidden, weight, target, 8 * V * 4)
    assert torch.isfinite(got[0]) and rel_err(got[0], ref[0]) <= 1e-6
    naive = torch.log(torch.exp((hidden @ weight.t()).float()).sum(-1))  # no max subtraction
    assert not torch.isfinite(naive).all()


def test_bf16_close_to_materialised():
    hidden, weight, target = _inputs(torch.bfloat16, seed=3)
    ref = _run(hidden, weight, target, 0)
    got = _run(hidden, weight, target, 8 * V * 4)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    assert rel_err(got[0], ref[0]) <= 1e-3
    assert rel_err(got[1], ref[1]) <= 2e-2 and rel_err(got[2], ref[2]) <= 2e-2


def test_shapes_are_checked():
    hidden, weight, target = _inputs()
    with pytest.raises(ValueError, match="hidden \\[N, D\\], weight \\[V, D\\], target \\[N\\]"):
        linear_cross_entropy(hidden, weight, target[:-1])


@pytest.mark.parametrize("tied, mtp", [(False, True), (True, False)])
def test_model_loss_and_gradients_equal_the_materialised_head(tied, mtp):
    """Whole Glm53Model (LM + MTP, or tied embeddings): chunks of 7 tokens vs the materialised logits."""
    cfg = glm53_ds.Glm53Config.from_text_dict(dict(CONFIG_A, tie_word_embeddings=tied))
    torch.manual_seed(0)
    model = glm53_ds.build_model(cfg, mtp=mtp)
    perturb_(model)  # realistic scales (megatron's init leaves the mHC gradients near 1e-7)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, cfg.vocab_size, (2, 20), generator=g)
    labels = ids.masked_fill(torch.rand(2, 20, generator=g) < 0.3, IGNORE_INDEX)
    results = []
    for chunk_bytes in (0, 7 * cfg.vocab_size * 4):
        model.config.loss_chunk_bytes = chunk_bytes
        model.zero_grad()
        loss = model(ids, labels=labels)
        loss.backward()
        results.append(
            (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        )
    (ref_loss, ref_grads), (loss, grads) = results
    assert rel_err(loss, ref_loss) <= 1e-6
    assert grads.keys() == ref_grads.keys() and "embedding.weight" in grads
    for name in ref_grads:  # the project's gradient bound; measured 1.1e-5 (attn_hc.scale, sparse attention)
        assert rel_err(grads[name], ref_grads[name]) <= 1e-4, name


@pytest.mark.parametrize("label", [-1, 96, -7])
def test_the_chunked_head_refuses_labels_outside_the_vocabulary(label):
    """Before: label -1 was trained as class 0 by the chunked head, where the materialised head and transformers
    raise. Now both heads refuse every label outside [0, V) except the ignore index."""
    from glm53_ds.layers.chunked_ce import linear_cross_entropy

    hidden, weight = torch.randn(6, 8), torch.randn(96, 8)
    target = torch.tensor([1, 2, -100, label, 5, 6])
    with pytest.raises((RuntimeError, IndexError)):  # the control: cross_entropy's contract
        torch.nn.functional.cross_entropy(hidden @ weight.t(), target)
    for chunk_bytes in (4 * 96 * 2, 0):
        with pytest.raises(RuntimeError, match=r"a target is outside \[0, 96\)"):
            linear_cross_entropy(hidden, weight, target, chunk_bytes=chunk_bytes)
    target[3] = 7
    assert torch.isfinite(linear_cross_entropy(hidden, weight, target, chunk_bytes=4 * 96 * 2))
