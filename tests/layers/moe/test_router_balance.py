"""The aux-loss-free balance rule (layers/moe/router_balance.py): the router bias moves toward underloaded experts."""

from __future__ import annotations

import pytest
import torch

import glm53_ds
from glm53_ds.config import Glm53Config
from glm53_ds.layers.moe import update_router_bias
from tests.model_fixtures import CONFIG_A


def test_router_bias_moves_toward_underloaded_experts():
    model = glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A)).train()
    ids = torch.randint(1, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids)
    moe = model.decoder.layers[2].mlp
    load = moe.expert_load.clone()
    assert load.sum() == 2 * 16 * CONFIG_A["num_experts_per_tok"]
    stats = update_router_bias(model, rate=0.1, reduce=False)
    bias = moe.router.e_score_correction_bias
    mean = load.mean()
    assert torch.equal(bias, 0.1 * torch.sign(mean - load))  # starts at 0
    assert moe.expert_load.sum() == 0  # consumed
    assert stats["decoder.layers.2.mlp"] == pytest.approx((load.max() / mean).item())
    model(ids)
    before = bias.clone()
    update_router_bias(model, rate=0.0, reduce=False)  # off
    assert torch.equal(bias, before)
