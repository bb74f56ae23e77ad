"""The MoE in tiles of tokens (`moe_tile_bytes`, layers/moe/moe_layer.py; ALST's tiled MLP): each token routed and
computed as untiled, so the loss is bitwise the same and the gradients within 1e-6 of the largest (the weight
gradients sum the tiles' rows in another order), with and without full recompute. Under EP x ETP:
tests/parallel/test_moe_dispatch.py."""

from __future__ import annotations

import pytest
import torch

import glm53_ds
from glm53_ds.config import Glm53Config
from glm53_ds.layers.moe import Glm53MoE
from tests.model_fixtures import CONFIG_A, tiled_step

CFG = Glm53Config.from_text_dict(CONFIG_A)
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _step(tile_bytes: int, **overrides):  # type: ignore[no-untyped-def]
    return tiled_step(CFG, tile_bytes, **overrides)


@pytest.mark.parametrize("recompute", [{}, FULL], ids=["plain", "full_recompute"])
@pytest.mark.parametrize("tile_tokens", [1, 7])  # 7 does not divide the 40 tokens: a shorter last tile
def test_tiled_moe_matches_the_untiled_layer(recompute, tile_tokens, monkeypatch):
    _, ref_loss, ref_grads = _step(0, **recompute)
    probe = next(m for m in _step(0)[0].modules() if isinstance(m, Glm53MoE))
    d, i = probe.experts.gate_up_proj.shape[-1], probe.experts.intermediate
    per_token = probe.router.top_k * (2 * d + 3 * i) * 4
    model, loss, grads = _step(tile_tokens * per_token, **recompute)
    moe = next(m for m in model.modules() if isinstance(m, Glm53MoE))
    assert moe.tile_tokens() == tile_tokens and probe.tile_tokens() > 40
    assert torch.equal(loss, ref_loss)
    scale = max(g.abs().max().item() for g in ref_grads.values())
    assert grads.keys() == ref_grads.keys()
    assert max((grads[k] - ref_grads[k]).abs().max().item() for k in grads) <= 1e-6 * scale
    # control: a tiling that loses one tile's output (its tokens get no expert) changes the loss
    tiled = Glm53MoE._tiled

    def lossy(self, tokens, tile):  # type: ignore[no-untyped-def]
        out, counts = tiled(self, tokens, tile)
        return torch.cat([out[:tile], torch.zeros_like(out[tile : 2 * tile]), out[2 * tile :]]), counts

    monkeypatch.setattr(Glm53MoE, "_tiled", lossy)
    assert not torch.equal(_step(tile_tokens * per_token, **recompute)[1], ref_loss)


def test_tiles_are_refused_with_the_sequence_balance_loss():
    with pytest.raises(ValueError, match="moe_tile_bytes=1024: .* moe_seq_aux_loss_coef > 0"):
        glm53_ds.build_model(CFG, moe_tile_bytes=1024, moe_seq_aux_loss_coef=0.1)
