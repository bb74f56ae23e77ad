"""`torch.library.opcheck` over every custom op of the project (#62): its schema, its fake (meta) implementation
against the real one (shapes, dtypes and strides: what `torch.compile` and the planner's meta runs rely on), its
autograd registration and AOT dispatch. The ops are found in the dispatcher (every `glm53::` op once the model's
modules are imported), so a new op without samples here fails the test. Inputs are small and include
non-contiguous operands (a transposed q_lat: before, the reference's fake returned q_lat's strides where the op
returns a contiguous tensor, and inductor failed with "stride 64==16"). The Triton kernels run in Triton's
interpreter on CPU. Control: an op whose fake returns the wrong strides is caught."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.library import opcheck

from glm53_ds.layers import (  # noqa: F401  (their ops)
    blind_rows,
    block_fp8,
    indexer_topk,
    indexer_topk_triton,
    kda_ops,
    sparse_attention,
    sparse_attention_triton,
)  # fmt: skip
from glm53_ds.layers.moe import grouped_mm  # noqa: F401
from glm53_ds.mhc import hc_post_op, sinkhorn_op  # noqa: F401


def _sparse(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_lat [1, 8, 4, 16] as a transposed view, latent [1, 8, 16], tokens [1, 8, 6] (causal, -1 = empty)."""
    g = torch.Generator().manual_seed(0)
    b, length, heads, rank, width = 1, 8, 4, 16, 6
    q = torch.randn(b, length, rank, heads, generator=g, dtype=dtype).transpose(-1, -2).requires_grad_()
    latent = torch.randn(b, length, rank, generator=g, dtype=dtype, requires_grad=True)
    tokens = torch.stack([torch.randperm(length, generator=g)[:width] for _ in range(length)]).unsqueeze(0)
    tokens = torch.where(tokens <= torch.arange(length)[None, :, None], tokens, -1).to(torch.int32)
    return q, latent, tokens


def _sparse_reference() -> list[tuple]:
    q, latent, tokens = _sparse()
    return [(q, latent, tokens.long(), 0.25, 4), (q.detach().contiguous(), latent, tokens.long(), 0.25, 3)]


def _sparse_reference_backward() -> list[tuple]:
    q, latent, tokens = _sparse()
    grad = torch.randn(q.shape)
    return [(grad, q.detach(), latent.detach(), tokens.long(), 0.25, 4)]


def _sparse_triton() -> list[tuple]:
    q, latent, tokens = _sparse()
    return [(q, latent, tokens, 0.25)]


def _sparse_triton_backward() -> list[tuple]:
    q, latent, tokens = _sparse()
    out, lse = torch.ops.glm53.sparse_attention_triton(q.detach(), latent.detach(), tokens, 0.25)
    return [(torch.randn(q.shape), q.detach(), latent.detach(), tokens, out, lse, 0.25)]


def _hc_post_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    residual = torch.randn(2, 5, 4, 8, generator=g, requires_grad=True)
    post = torch.rand(2, 5, 4, generator=g, requires_grad=True)
    comb = torch.rand(2, 5, 4, 4, generator=g, requires_grad=True)
    return x, residual, post, comb


def _hc_post() -> list[tuple]:
    return [(*_hc_post_inputs(), backend) for backend in ("eager", "triton")]


def _hc_post_backward() -> list[tuple]:
    inputs = [t.detach() for t in _hc_post_inputs()]
    return [(torch.randn(inputs[1].shape), *inputs, backend) for backend in ("eager", "triton")]


def _sinkhorn_comb() -> torch.Tensor:
    """[2, 5, 4, 4] rows normalised by softmax, as a non-contiguous view (the op returns a contiguous tensor)."""
    g = torch.Generator().manual_seed(7)
    comb = torch.softmax(torch.randn(5, 2, 4, 4, generator=g), -1).transpose(0, 1)
    return comb.requires_grad_()


def _sinkhorn() -> list[tuple]:
    comb = _sinkhorn_comb()
    return [(comb, 3, 1e-6), (comb.detach().contiguous().requires_grad_(), 1, 1e-3)]


def _sinkhorn_backward() -> list[tuple]:
    comb = _sinkhorn_comb().detach()
    return [(torch.randn(comb.shape), comb, 3, 1e-6)]


def _kda_reference() -> list[tuple]:
    g = torch.Generator().manual_seed(2)
    b, s, h, d = 1, 8, 2, 8
    q, k = (torch.randn(b, s, h, d, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(b, h, s, d, generator=g).transpose(1, 2).requires_grad_()  # non-contiguous
    decay = (-torch.rand(b, s, h, d, generator=g)).requires_grad_()
    beta = torch.rand(b, s, h, generator=g, requires_grad=True)
    documents = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2])  # packed: each token's document
    return [(q, k, v, decay, beta), (q, k, v, decay, beta, documents)]


def _block_fp8_grouped_mm() -> list[tuple]:
    g = torch.Generator().manual_seed(3)
    experts, rows, cols = 2, 8, 8
    data = torch.randn(experts, rows, cols, generator=g).to(torch.float8_e4m3fn)
    scale = torch.rand(experts, 2, 2, generator=g) + 0.5
    blocks = torch.tensor([0] * 4 + [1] * 4, dtype=torch.int32)
    offs = torch.tensor([3, 6], dtype=torch.int32)
    x = torch.randn(
        6, cols, generator=g
    )  # the op has no autograd: `_BlockFp8Linear` differentiates around it
    return [(x, data, scale, blocks, blocks, offs, True), (x, data, scale, blocks, blocks, offs, False)]


def _grouped_mm() -> list[tuple]:
    """Both forms the experts use, fp32 (bf16 goes to torch's own op): rows through their group's matrix, and the
    per-group products over the rows (weight gradients). Offsets leave the last group empty."""
    g = torch.Generator().manual_seed(4)
    rows, weights = torch.randn(12, 16, generator=g), torch.randn(3, 16, 8, generator=g)
    offs = torch.tensor([5, 12, 12], dtype=torch.int32)
    return [(rows, weights, offs), (rows.t(), torch.randn(12, 8, generator=g), offs)]


def _indexer_topk() -> list[tuple]:
    """q [1, 12, 3, 16] as a transposed view (fp32 and bf16), 10 pools of 4 tokens (the last never visible), the
    queries at key positions 20..31 (a later part of the sequence), 4 pools each. No autograd: the indexer runs
    without gradient."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 3, 12, 16, generator=g).transpose(1, 2)
    weights, keys = torch.randn(1, 12, 3, generator=g), torch.randn(1, 10, 16, generator=g)
    visible_from = (torch.arange(10) * 4 + 3).masked_fill(torch.arange(10) == 9, indexer_topk.NOT_VISIBLE)[
        None
    ]
    # a packed row: pools 0-3 in the first document (ends at 24), the rest in the second
    visible_to = torch.where(torch.arange(10) < 4, 24, 60).masked_fill(
        torch.arange(10) == 9, indexer_topk.NOT_VISIBLE
    )
    return [(q, weights, keys, visible_from, 20, 4, 0.25),
            (q.bfloat16(), weights, keys.bfloat16(), visible_from, 0, 4, 0.25),
            (q, weights, keys, visible_from, 20, 4, 0.25, visible_to[None])]  # fmt: skip


def _blind_rows_inputs() -> tuple[torch.Tensor, ...]:
    """A packed row of 3 documents (5, 4, 3 tokens), q [1, 12, 2, 8] as a transposed view, every third query
    blind."""
    g = torch.Generator().manual_seed(6)
    out = torch.randn(1, 12, 2, 8, generator=g, requires_grad=True)
    q = torch.randn(1, 12, 8, 2, generator=g).transpose(-1, -2).requires_grad_()
    latent = torch.randn(1, 12, 8, generator=g, requires_grad=True)
    blind = (torch.arange(12) % 3 == 0)[None]
    documents = torch.tensor([0] * 5 + [1] * 4 + [2] * 3)
    return out, blind, q, latent, documents


def _blind_rows_by_document() -> list[tuple]:
    out, blind, q, latent, documents = _blind_rows_inputs()
    # the whole row, and the queries 4..11 of it (a later sequence-parallel rank's)
    return [
        (out, blind, q, latent, documents, 0, 0.5),
        (out[:, 4:], blind[:, 4:], q[:, 4:], latent, documents, 4, 0.5),
    ]


def _blind_rows_by_document_backward() -> list[tuple]:
    out, blind, q, latent, documents = _blind_rows_inputs()
    return [(torch.randn(out.shape), blind, q.detach(), latent.detach(), documents, 0, 0.5)]


SAMPLES: dict[str, Callable[[], list[tuple]]] = {
    "glm53::blind_rows_by_document": _blind_rows_by_document,
    "glm53::blind_rows_by_document_backward": _blind_rows_by_document_backward,
    "glm53::indexer_topk_triton": _indexer_topk,
    "glm53::grouped_mm": _grouped_mm,
    "glm53::sparse_attention_reference": _sparse_reference,
    "glm53::sparse_attention_reference_backward": _sparse_reference_backward,
    "glm53::sparse_attention_triton": _sparse_triton,
    "glm53::sparse_attention_triton_backward": _sparse_triton_backward,
    "glm53::hc_post": _hc_post,
    "glm53::hc_post_backward": _hc_post_backward,
    "glm53::sinkhorn_triton": _sinkhorn,
    "glm53::sinkhorn_triton_backward": _sinkhorn_backward,
    "glm53::kda_reference": _kda_reference,
    "glm53::block_fp8_grouped_mm": _block_fp8_grouped_mm,
}


def _project_ops() -> set[str]:
    return {name for name in torch._C._dispatch_get_all_op_names() if name.startswith("glm53::")}


def test_every_custom_op_of_the_project_has_samples():
    assert _project_ops() == set(SAMPLES)


# torch's schema check compares an op's inputs before and after with a multiplication, which float8 tensors lack; the
# block-FP8 op's other checks run (its float8 inputs are buffers it only reads; `mutates_args=()` says so)
NO_SCHEMA_CHECK = {"glm53::block_fp8_grouped_mm"}
ALL_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_opcheck(name: str):
    namespace, op_name = name.split("::")
    op = getattr(getattr(torch.ops, namespace), op_name).default
    checks = tuple(c for c in ALL_CHECKS if not (c == "test_schema" and name in NO_SCHEMA_CHECK))
    for args in SAMPLES[name]():
        opcheck(op, args, test_utils=checks)


@torch.library.custom_op("glm53_test::contiguous_scale", mutates_args=())
def _contiguous_scale(x: torch.Tensor) -> torch.Tensor:
    return (2 * x).contiguous()


@_contiguous_scale.register_fake
def _(x: torch.Tensor) -> Any:
    return torch.empty_like(x)  # the defect fixed above: the input's strides, where the op returns contiguous


def test_a_wrong_fake_stride_is_caught():
    opcheck(_contiguous_scale, (torch.randn(4, 3),))  # a contiguous input: the strides agree
    with pytest.raises(torch.testing._internal.optests.OpCheckError, match="Stride mismatch"):
        opcheck(_contiguous_scale, (torch.randn(3, 4).t(),))
