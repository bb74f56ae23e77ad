"""`layers/kda_ops.py`'s call into fla-core: packed documents pass their boundaries from the host as well
(`cu_seqlens_cpu`, where this fla-core takes it), so fla builds its chunk indices without reading `cu_seqlens` back
from the GPU (a host sync per KDA layer). Checked with a stand-in `fla.ops.kda` recording its call; before, only
`cu_seqlens` (a device tensor) was passed.

The torch path over packed documents is tensor code over the row's own chunks (`chunk_kda_torch(document_ids=)`):
equal to each document run alone (fp32, forward and every input's gradient within 1e-5 of the largest magnitude),
with documents across and on the 64-token chunk edges and a 1-token document; control: the same row without its
documents differs by far more.

The short conv over packed documents (`layers/kda.py` `DocumentShortConv`) equals each document's conv1d alone,
forward and gradients, and its step holds at most 1.5x the whole row's conv1d (4x x's size against 3x); control:
autograd of the tap loop it replaced held 9x."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from glm53_ds.layers import kda_ops
from glm53_ds.layers.documents import Documents
from glm53_ds.layers.kda import DocumentShortConv


def _stand_in(monkeypatch, with_cpu_argument: bool) -> list[dict]:
    calls: list[dict] = []
    if with_cpu_argument:

        def chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel, cu_seqlens=None, cu_seqlens_cpu=None):
            calls.append(dict(cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu))
            return torch.zeros_like(v), None
    else:

        def chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel, cu_seqlens=None):  # an fla before PR #775
            calls.append(dict(cu_seqlens=cu_seqlens))
            return torch.zeros_like(v), None

    module = types.ModuleType("fla.ops.kda")
    module.chunk_kda = chunk_kda  # type: ignore[attr-defined]
    for name, mod in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")),
                      ("fla.ops.kda", module)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # fla's kernel on CPU tensors: what `resolve` allows
    return calls


def _call(documents: Documents | None) -> None:
    q = k = torch.zeros(1, 10, 2, 8)
    kda_ops.kda_attention(q, k, torch.zeros(1, 10, 2, 8), torch.zeros(1, 10, 2, 8), torch.zeros(1, 10, 2),
                          backend="fla", documents=documents)  # fmt: skip


def test_packed_documents_reach_fla_with_host_boundaries(monkeypatch):
    kda_ops._takes_cu_seqlens_cpu.cache_clear()
    calls = _stand_in(monkeypatch, with_cpu_argument=True)
    _call(Documents.from_cu_seqlens(torch.tensor([0, 3, 10], dtype=torch.int32), 10))
    _call(None)
    assert (
        calls[0]["cu_seqlens_cpu"].tolist() == [0, 3, 10] and calls[0]["cu_seqlens_cpu"].device.type == "cpu"
    )
    assert calls[0]["cu_seqlens"].tolist() == [0, 3, 10]
    assert calls[1] == dict(cu_seqlens=None, cu_seqlens_cpu=None)


def test_an_fla_without_the_argument_gets_cu_seqlens_alone(monkeypatch):
    kda_ops._takes_cu_seqlens_cpu.cache_clear()
    calls = _stand_in(monkeypatch, with_cpu_argument=False)
    _call(Documents.from_cu_seqlens(torch.tensor([0, 3, 10], dtype=torch.int32), 10))
    assert list(calls[0]) == ["cu_seqlens"]
    kda_ops._takes_cu_seqlens_cpu.cache_clear()


@pytest.mark.parametrize("cuts", [[0, 37, 38, 64, 101, 128, 150], [0, 150], [0, 1, 2, 150]])
def test_packed_documents_in_tensor_code_equal_each_document_alone(cuts):
    g = torch.Generator().manual_seed(5)
    b, s, h, dk, dv = 1, cuts[-1], 2, 16, 8
    leaves = [torch.randn(b, s, h, dk, generator=g), torch.randn(b, s, h, dk, generator=g),
              torch.randn(b, s, h, dv, generator=g), -torch.rand(b, s, h, dk, generator=g) * 0.3,
              torch.rand(b, s, h, generator=g)]  # fmt: skip
    leaves = [t.requires_grad_() for t in leaves]
    documents = Documents.from_cu_seqlens(torch.tensor(cuts), s)
    grad_out = torch.randn(b, s, h, dv, generator=g)

    def run(whole: bool, with_documents: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if whole:
            out = kda_ops.kda_attention(
                *leaves, backend="torch", documents=documents if with_documents else None
            )
        else:
            out = torch.cat(
                [kda_ops.chunk_kda_torch(*(t[:, a:e] for t in leaves)) for a, e in documents.bounds], 1
            )
        grads = torch.autograd.grad(out, leaves, grad_out)
        return out.detach(), list(grads)

    def err(x: torch.Tensor, y: torch.Tensor) -> float:
        return float((x - y).abs().max() / y.abs().max())

    (out, grads), (ref, ref_grads) = run(True), run(False)
    assert err(out, ref) <= 1e-5 and all(err(a, r) <= 1e-5 for a, r in zip(grads, ref_grads, strict=True))
    if len(cuts) > 2:  # the control: the row's documents see each other without them
        assert err(run(True, with_documents=False)[0], ref) > 1e-2


def test_the_packed_short_conv_is_each_documents_conv1d_in_conv1ds_memory():
    from benchmarks.measure import peak_extra_bytes

    g = torch.Generator().manual_seed(3)
    s, channels, kernel = 150, 16, 4
    x = torch.randn(1, s, channels, generator=g, requires_grad=True)
    weight = torch.randn(channels, 1, kernel, generator=g, requires_grad=True)
    grad_out = torch.randn(1, s, channels, generator=g)
    documents = Documents.from_cu_seqlens(torch.tensor([0, 1, 2, 3, 40, 64, 150]), s)

    def conv1d(t: torch.Tensor) -> torch.Tensor:  # [1, n, C] -> its causal conv + SiLU
        out = F.conv1d(t.transpose(1, 2), weight, padding=kernel - 1, groups=channels)[..., : t.shape[1]]
        return F.silu(out).transpose(1, 2)

    def packed() -> tuple[torch.Tensor, ...]:
        y = F.silu(DocumentShortConv.apply(x, weight[:, 0], documents.positions))
        return (y, *torch.autograd.grad(y, (x, weight), grad_out))

    def alone() -> tuple[torch.Tensor, ...]:
        y = torch.cat([conv1d(x[:, a:e]) for a, e in documents.bounds], 1)
        return (y, *torch.autograd.grad(y, (x, weight), grad_out))

    def whole_row() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(conv1d(x), (x, weight), grad_out)

    def tap_loop() -> tuple[torch.Tensor, ...]:  # the form DocumentShortConv replaced: autograd over the taps
        last = kernel - 1
        padded = F.pad(x, (0, 0, last, 0))
        y = padded[:, last:] * weight[:, 0, last]
        for j in range(1, kernel):
            back = padded[:, last - j : last - j + s] * weight[:, 0, last - j]
            y = y.add_(back.masked_fill_((documents.positions < j)[None, :, None], 0.0))
        return torch.autograd.grad(F.silu(y), (x, weight), grad_out)

    for ours, ref in zip(packed(), alone(), strict=True):
        assert float((ours - ref).abs().max() / ref.abs().max()) <= 1e-6
    inputs = [x, weight, grad_out, documents.positions]
    row = peak_extra_bytes(whole_row, inputs)
    assert peak_extra_bytes(packed, inputs) <= 1.5 * row
    assert peak_extra_bytes(tap_loop, inputs) > 2 * row  # the control
