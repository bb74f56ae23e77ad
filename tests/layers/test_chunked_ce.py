"""The chunked linear cross-entropy head (layers/chunked_ce.py) against the materialised [tokens, vocab] path.

Tolerances: fp32 loss rel <= 1e-6, gradients (hidden, output weight, embedding) <= 1e-5 relative to their max
magnitude; bf16: loss rel <= 1e-3 and gradients <= 2e-2 against the materialised bf16 path (which rounds the weight
gradient of one [N, V] matmul to bf16, where the chunked path accumulates it in fp32)."""

from __future__ import annotations

import pytest
import torch

import glm53_ds
from glm53_ds.layers.chunked_ce import IGNORE_INDEX, MIN_VOCAB_SLICE, backward_tiles, linear_cross_entropy
from tests.model_fixtures import CONFIG_A, perturb_, rel_err

N, D, V = 37, 16, 50


def _inputs(dtype=torch.float32, scale=1.0, seed=0, vocab=V):
    g = torch.Generator().manual_seed(seed)
    hidden = (scale * torch.randn(N, D, generator=g)).to(dtype)
    weight = torch.randn(vocab, D, generator=g).to(dtype) / D**0.5
    target = torch.randint(0, vocab, (N,), generator=g)
    target[3] = IGNORE_INDEX
    target[8:16] = IGNORE_INDEX  # a whole chunk of 8 rows without targets
    return hidden, weight, target


def _run(hidden, weight, target, chunk_bytes, normalizer=None, need_h=True, need_w=True):
    h, w = hidden.clone().requires_grad_(need_h), weight.clone().requires_grad_(need_w)
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


# The weight-gradient backward over vocabulary slices (chunked_ce.backward_tiles) needs a vocabulary wider than the
# narrowest slice: V = 1,700 is 3 of the narrowest slices and a part
WIDE_V = 3 * MIN_VOCAB_SLICE + 164
# 600-column slices, every row in one tile (each slice of d W in one product); the narrowest slices over chunks of
# 10 rows (fp32 slice sums)
SLICES_OVER_ALL_ROWS = N * 4 * 600
SLICES_OVER_ROW_CHUNKS = MIN_VOCAB_SLICE * 4 * 10


@pytest.mark.parametrize("chunk_bytes, rows, columns", [
    (SLICES_OVER_ALL_ROWS, N, 600), (SLICES_OVER_ROW_CHUNKS, 10, MIN_VOCAB_SLICE),
])  # fmt: skip
def test_vocabulary_slices_equal_materialised(chunk_bytes, rows, columns):
    assert backward_tiles(N, WIDE_V, chunk_bytes, weight_gradient=True) == (rows, columns)  # the case it says
    hidden, weight, target = _inputs(seed=5, vocab=WIDE_V)
    slices = -(-WIDE_V // columns)
    assert len(set((target[target >= 0] // columns).tolist())) == slices  # a target in every slice
    ref = _run(hidden, weight, target, 0)
    got = _run(hidden, weight, target, chunk_bytes)
    assert rel_err(got[0], ref[0]) <= 1e-6
    assert rel_err(got[1], ref[1]) <= 1e-5 and rel_err(got[2], ref[2]) <= 1e-5
    assert not got[1][8:16].any() and not got[1][3].any()
    only_w = _run(hidden, weight, target, chunk_bytes, need_h=False)  # a frozen input
    only_h = _run(hidden, weight, target, chunk_bytes, need_w=False)  # LoRA: a frozen output layer
    assert only_w[1] is None and torch.equal(only_w[2], got[2])
    assert only_h[2] is None and rel_err(only_h[1], ref[1]) <= 1e-5


def test_vocabulary_slices_control():
    """Control: a slice that loses its one-hot term (its targets' -1) or is skipped is caught by the bound above."""
    hidden, weight, target = _inputs(seed=5, vocab=WIDE_V)
    ref = _run(hidden, weight, target, 0)
    moved = target.clone()
    moved[moved >= MIN_VOCAB_SLICE] -= MIN_VOCAB_SLICE  # a target credited to another slice's column
    wrong = _run(hidden, weight, moved, SLICES_OVER_ROW_CHUNKS)
    assert rel_err(wrong[1], ref[1]) > 1e-5 and rel_err(wrong[2], ref[2]) > 1e-5


def test_bf16_vocabulary_slices_accumulate_in_fp32():
    """bf16 through vocabulary slices equals the materialised bf16 head (one [N, V] product per gradient, fp32
    inside): measured bitwise on CPU for both gradients, the loss within 1.2e-7; both are 2.7e-3 / 3.4e-3 from the
    fp32 head. Control: d h summed over the slices in bf16 (one rounding per slice) is 1e-3 further away."""
    hidden, weight, target = _inputs(torch.bfloat16, seed=6, vocab=WIDE_V)
    ref = _run(hidden, weight, target, 0)
    exact = _run(hidden.float(), weight.float(), target, 0)
    for chunk_bytes in (SLICES_OVER_ALL_ROWS, SLICES_OVER_ROW_CHUNKS):
        got = _run(hidden, weight, target, chunk_bytes)
        assert got[1].dtype == got[2].dtype == torch.bfloat16
        assert rel_err(got[0], ref[0]) <= 1e-6
        assert rel_err(got[1].float(), ref[1].float()) <= 1e-6
        assert rel_err(got[2].float(), ref[2].float()) <= 1e-6
        assert rel_err(got[1].float(), exact[1]) <= 5e-3 and rel_err(got[2].float(), exact[2]) <= 5e-3
    probs = torch.softmax((hidden @ weight.t()).float(), -1)
    valid = target != IGNORE_INDEX
    probs[valid.nonzero().squeeze(1), target[valid]] -= 1.0
    d_logits = (probs * (valid[:, None] / valid.sum())).to(torch.bfloat16)
    columns = backward_tiles(N, WIDE_V, SLICES_OVER_ALL_ROWS, weight_gradient=True)[1]
    starts = range(0, WIDE_V, columns)
    rounded_per_slice = sum(d_logits[:, a : a + columns] @ weight[a : a + columns] for a in starts)
    assert rel_err(rounded_per_slice.float(), ref[1].float()) > 1e-4


class _TokenChunkedHead(torch.autograd.Function):
    """The control: the backward before vocabulary slices (chunks of rows over the whole vocabulary, the weight
    gradient summed in an fp32 [V, D] and converted at the end), its allocations only."""

    @staticmethod
    def forward(ctx, hidden, weight):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(hidden, weight)
        return hidden.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        hidden, weight = ctx.saved_tensors
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        rows = (256 * 2**20) // (weight.shape[0] * 4)
        for start in range(0, hidden.shape[0], rows):
            d_logits = (hidden[start : start + rows] @ weight.t()).float().exp().to(hidden.dtype)
            d_weight += torch.mm(d_logits.t(), hidden[start : start + rows], out_dtype=torch.float32)
        return torch.empty_like(hidden), d_weight.to(weight.dtype)


def _head_backward_peak(head) -> int:  # type: ignore[no-untyped-def]
    """Peak bytes allocated by the loss head's backward at the released vocabulary and width, 2,048 bf16 tokens (one
    rank's share of 32k at SP 16), on meta (the planner's measure)."""
    from glm53_ds.plan.activations import LiveBytes

    n, d, vocab = 2048, 4096, 154880
    hidden = torch.empty(n, d, device="meta", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.empty(vocab, d, device="meta", dtype=torch.bfloat16, requires_grad=True)
    target = torch.zeros(n, dtype=torch.long, device="meta")
    with LiveBytes() as meter:
        loss = head(hidden, weight, target)
        before = meter.mark()
        loss.backward()
    return meter.peak - before


def test_the_weight_gradient_backward_holds_no_fp32_copy_of_the_weight():
    """Full SFT at 32k on 64 H200 fitted by 0.16 GiB because this backward held the weight gradient twice: fp32
    [V, D] (2.36 GiB) and its bf16 result (1.18). Now: the bf16 gradient, an fp32 [N, D] (32 MiB) and one tile.
    Measured 1.71 GiB (before: 3.83)."""
    n, d, vocab, chunk = 2048, 4096, 154880, 256 * 2**20
    # the gradients, d h's fp32 sums, a tile's logits twice
    bound = vocab * d * 2 + n * d * (4 + 2) + 2 * chunk
    peak = _head_backward_peak(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_bytes=chunk))
    assert peak <= bound, (peak / 2**30, bound / 2**30)
    control = _head_backward_peak(lambda h, w, t: _TokenChunkedHead.apply(h, w))
    assert control > bound + vocab * d * 2, (control / 2**30, bound / 2**30)


class _VocabularyGradients(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operations that produce a new tensor of a vocabulary matrix's shape [V, D] (a whole gradient)."""

    def __init__(self, shape):  # type: ignore[no-untyped-def]
        super().__init__()
        self.shape, self.made = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        given = torch.utils._pytree.tree_leaves((args, kwargs))  # `out=` included
        inputs = {a.untyped_storage()._cdata for a in given if isinstance(a, torch.Tensor)}
        if isinstance(out, torch.Tensor) and out.shape == self.shape:
            self.made += out.untyped_storage()._cdata not in inputs
        return out


def _vocabulary_gradients_in_backward(loss, shape) -> int:  # type: ignore[no-untyped-def]
    with _VocabularyGradients(shape) as counter:
        loss.backward()
    return counter.made


def test_the_model_makes_one_gradient_per_vocabulary_matrix():
    """The embedding and the output layer are each used by the LM and by MTP: one lookup of all the tokens and one
    head call make one [V, D] gradient each, and the padding row is zeroed in place. Before, a full-SFT rank held the
    MTP's embedding gradient through the whole decoder's backward, both heads' output-layer gradients and their
    sum, and a copy for the padding row (at the released size 1.18 GiB each). Control: a use per call makes three."""
    cfg = glm53_ds.Glm53Config.from_text_dict(dict(CONFIG_A, vocab_size=512, pad_token_id=3))
    torch.manual_seed(0)
    model = glm53_ds.build_model(cfg, mtp=True, loss_chunk_bytes=128 * 512 * 4)  # 80 rows in one tile of 128
    ids = torch.randint(1, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(4))
    shape = model.output_layer.weight.shape
    assert _vocabulary_gradients_in_backward(model(ids, labels=ids), shape) == 2
    assert model.embedding.weight.grad[3].abs().sum() == 0 and model.embedding.weight.grad.abs().sum() > 0
    w = torch.randn(shape, requires_grad=True)
    h = torch.randn(2, 20, shape[1])
    t = torch.randint(0, shape[0], (20,))
    separate = linear_cross_entropy(h[0], w, t) + linear_cross_entropy(h[1], w, t)
    grouped = linear_cross_entropy(h.reshape(40, -1), w, torch.cat([t, t]), groups=2).sum()
    assert _vocabulary_gradients_in_backward(separate, shape) == 3
    assert _vocabulary_gradients_in_backward(grouped, shape) == 1
    looked_up = torch.nn.functional.embedding(ids, w)
    twice = looked_up.sum() + torch.nn.functional.embedding(ids.flip(1), w).sum()
    assert _vocabulary_gradients_in_backward(twice, shape) == 3
