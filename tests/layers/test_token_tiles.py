"""The dense MLPs, the shared expert and the mHC mixes (hc_pre, hc_post) over tiles of tokens under
`moe_tile_bytes` (layers/token_tiles.py; the routed experts' tiles: tests/layers/moe/test_tiled_moe.py): each row
computed as untiled, so the loss is bitwise the same and every gradient within 1e-6 of the largest (the weight
gradients sum the tiles' rows in another order), with and without full recompute. Controls, one per kind of work: a
tiling that drops a tile's rows changes the loss."""

from __future__ import annotations

import pytest
import torch

from glm53_ds.config import Glm53Config
from glm53_ds.layers import token_tiles
from glm53_ds.layers.token_tiles import mhc_tile_rows, over_token_tiles, tile_rows
from tests.model_fixtures import CONFIG_A, tiled_step

CFG = Glm53Config.from_text_dict(CONFIG_A)  # layers 0 and 1 dense, the others MoE with a shared expert
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _step(tile_bytes: int, **overrides):  # type: ignore[no-untyped-def]
    return tiled_step(CFG, tile_bytes, **overrides)


def test_tile_rows_follow_the_budget():
    assert tile_rows(0, 64, 48, 4) == 2**62
    assert tile_rows((2 * 64 + 3 * 48) * 4 * 7, 64, 48, 4) == 7 and tile_rows(1, 64, 48, 4) == 1
    assert mhc_tile_rows(0, 4, 64) == 2**62
    assert mhc_tile_rows(4 * 4 * 4 * 64 * 5, 4, 64) == 5 and mhc_tile_rows(1, 4, 64) == 1


def _kind(fn, more) -> str:  # type: ignore[no-untyped-def]
    """Which token-wise work a tiled call is: an MLP (one input), hc_post (four inputs) or hc_pre (streams in,
    (collapsed, post, comb) out)."""
    if more:
        return "hc_post"
    return "hc_pre" if isinstance(fn, torch.nn.Module) else "mlp"


@pytest.mark.parametrize("recompute", [{}, FULL], ids=["plain", "full_recompute"])
def test_tiled_mlps_shared_experts_and_mhc_mixes_match_the_untiled_layers(recompute, monkeypatch):
    _, ref_loss, ref_grads = _step(0, **recompute)
    calls: list[tuple[str, int]] = []
    tiled = token_tiles.over_token_tiles

    def counting(fn, x, tokens, *more):  # type: ignore[no-untyped-def]
        calls.append((_kind(fn, more), tokens))
        return tiled(fn, x, tokens, *more)

    for module in ("glm53_ds.transformer_layer", "glm53_ds.layers.moe.moe_layer"):
        monkeypatch.setattr(f"{module}.over_token_tiles", counting)
    budget = (
        (2 * CFG.hidden_size + 3 * CFG.intermediate_size) * 4 * 6
    )  # 6 dense-MLP tokens: 3 positions x b 2; the mHC mixes: 2 tokens
    model, loss, grads = _step(budget, **recompute)
    assert {kind for kind, tokens in calls if tokens < 40} == {"mlp", "hc_pre", "hc_post"}  # of 40 tokens
    assert torch.equal(loss, ref_loss)
    scale = max(g.abs().max().item() for g in ref_grads.values())
    assert grads.keys() == ref_grads.keys()
    assert max((grads[k] - ref_grads[k]).abs().max().item() for k in grads) <= 1e-6 * scale

    # controls, one per kind of work: tiles that lose their second tile's rows
    for lost in ("mlp", "hc_pre", "hc_post"):

        def lossy(fn, x, tokens, *more, lost=lost):  # type: ignore[no-untyped-def]
            out = tiled(fn, x, tokens, *more)
            rows = max(1, tokens // x.shape[1])
            if rows >= x.shape[0] or _kind(fn, more) != lost:
                return out
            first = out[0] if isinstance(out, tuple) else out
            first = torch.cat([first[:rows], torch.zeros_like(first[rows : 2 * rows]), first[2 * rows :]])
            return (first, *out[1:]) if isinstance(out, tuple) else first

        for module in ("glm53_ds.transformer_layer", "glm53_ds.layers.moe.moe_layer"):
            monkeypatch.setattr(f"{module}.over_token_tiles", lossy)
        assert not torch.equal(_step(budget, **recompute)[1], ref_loss), lost


def test_untiled_and_no_grad_paths():
    x = torch.randn(5, 2, 3)
    assert over_token_tiles(torch.tanh, x, 2**62) is not None
    with torch.no_grad():
        assert torch.equal(over_token_tiles(torch.tanh, x, 4), torch.tanh(x))
