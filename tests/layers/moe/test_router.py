"""The router's sequence-wise auxiliary balance loss (layers/moe/router.py) against an independent formula."""

from __future__ import annotations

import pytest
import torch

import glm53_ds
from glm53_ds.config import Glm53Config
from tests.model_fixtures import CONFIG_A


def test_sequence_aux_loss_matches_independent_formula():
    cfg = Glm53Config.from_text_dict(CONFIG_A)
    model = glm53_ds.build_model(cfg, mtp=False, moe_seq_aux_loss_coef=0.01).train()
    captured = []
    for layer in model.decoder.layers:
        if hasattr(layer.mlp, "router"):
            layer.mlp.router.register_forward_hook(lambda _m, _i, out: captured.append(out))
    ids = torch.randint(1, cfg.vocab_size, (3, 10), generator=torch.Generator().manual_seed(2))
    parts = model(ids, labels=ids, return_parts=True)
    loss = parts.total
    e, k, s, b = cfg.n_routed_experts, cfg.num_experts_per_tok, 10, 3
    expected = 0.0
    for scores, _, expert_ids in captured:  # tokens in [s, b] order
        scores, expert_ids = scores.view(s, b, e), expert_ids.view(s, b, k)
        for j in range(b):
            p = (scores[:, j] / scores[:, j].sum(-1, keepdim=True)).mean(0)
            f = torch.bincount(expert_ids[:, j].flatten(), minlength=e).float() * e / (k * s)
            expected += 0.01 * (f * p).sum().item() / b
    assert parts.aux.item() == pytest.approx(expected, rel=1e-5)
    assert loss.item() == pytest.approx(parts.lm.item() + expected, rel=1e-5)
    loss.backward()
    router = model.decoder.layers[2].mlp.router.weight
    assert router.grad is not None and router.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        assert model(ids, labels=ids, return_parts=True).aux is None  # training only
