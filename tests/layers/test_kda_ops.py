"""`layers/kda_ops.py`'s call into fla-core: packed documents pass their boundaries from the host as well
(`cu_seqlens_cpu`, where this fla-core takes it), so fla builds its chunk indices without reading `cu_seqlens` back
from the GPU (a host sync per KDA layer). Checked with a stand-in `fla.ops.kda` recording its call; before, only
`cu_seqlens` (a device tensor) was passed."""

from __future__ import annotations

import sys
import types

import torch

from glm53_ds.layers import kda_ops
from glm53_ds.layers.documents import Documents


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
