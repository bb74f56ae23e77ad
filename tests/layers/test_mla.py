"""`masked_attention` (the MLA core): the SDPA backend against HF's eager expression, including queries allowed
nothing (padding rows), where HF's finfo.min mask gives a uniform average whose gradient still reaches q and k.

Tolerances (fp32): output and the gradients of q, k, v <= 1e-5 relative to the largest reference magnitude.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import glm53_ds
from glm53_ds.config import Glm53Config
from glm53_ds.layers.mla import masked_attention
from tests.model_fixtures import CONFIG_A, rel_err

B, H, S, D = 2, 3, 40, 16


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    allowed = torch.rand(B, 1, S, S, generator=g) < 0.3
    allowed[0, 0, :5] = False  # blind queries, as left padding gives
    allowed[1, 0, 17] = False
    return q, k, v, allowed


def _run(fn):
    q, k, v, allowed = _inputs()
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves, allowed)
    out.square().sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def _with_backend(monkeypatch, backend):
    return _run(lambda q, k, v, allowed: masked_attention(q, k, v, allowed, D**-0.5, backend=backend))


def test_sdpa_matches_eager_with_blind_queries(monkeypatch):
    eager = _with_backend(monkeypatch, "eager")
    sdpa = _with_backend(monkeypatch, "sdpa")
    for name, a, b in zip(["out", "dq", "dk", "dv"], sdpa, eager, strict=True):
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))


def test_control_plain_sdpa_gets_blind_query_gradients_wrong(monkeypatch):
    """Handing HF's finfo.min mask straight to SDPA: right forward, wrong q/k gradients on the blind rows."""
    eager = _with_backend(monkeypatch, "eager")

    def plain(q, k, v, allowed):
        bias = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=D**-0.5).transpose(1, 2)

    out, dq, dk, _ = _run(plain)
    assert rel_err(out, eager[0]) <= 1e-5
    assert max(rel_err(dq, eager[1]), rel_err(dk, eager[2])) > 1e-2


def test_unknown_backend_is_named(monkeypatch):
    q, k, v, allowed = _inputs()
    with pytest.raises(ValueError, match="attention_impl='flash'"):
        masked_attention(q, k, v, allowed, D**-0.5, backend="flash")
    monkeypatch.setenv("GLM53_ATTENTION", "flash")  # a bad default is named with its variable
    with pytest.raises(ValueError, match="attention_impl='flash' \\(from GLM53_ATTENTION='flash'\\)"):
        glm53_ds.make_transformer_config(Glm53Config.from_text_dict(CONFIG_A))
