"""The MoE dispatcher (parallel/moe_dispatch.py) under EP x ETP on CPU ranks: the grouped dispatch, with experts and
whole ranks that receive no token, against the single-process reference (loop experts) on the global batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist_harness import (
    compare_to_reference,
    global_batch,
    load_models,
    local_rows,
    run_world,
    setup_ranks,
)
from tests.model_fixtures import rel_err


def _reference_step(ref, model, world: int, etp: int, rank: int):  # type: ignore[no-untyped-def]
    """The global batch, the single-process reference's backward on it, and its loss on this rank's rows. Each
    rank's loss is its local mean, so an expert's gradient sums all ranks' local means (world x the global mean's),
    times the dispatcher's 1/ETP (moe_dispatch.py: DeepSpeed's expert averaging makes it whole)."""
    ids = global_batch(ref.glm.vocab_size, world, seed=11)[0]
    ref.train()
    model.train()
    (ref(ids, labels=ids) * (world / etp)).backward()
    with torch.no_grad():
        return ids, ref(local_rows(ids, rank), labels=local_rows(ids, rank))


def moe_dispatch(ckpt: str, ep: int, etp: int) -> dict[str, Any]:
    """The grouped dispatch under EP x ETP against the single-process reference (loop experts) on the global
    batch, with routing forced (router bias) onto experts 0 and 1 only: every other expert, and every EP rank but
    the first, gets no tokens. Also counts the host syncs of one forward + backward (tokens all real)."""
    from glm53_ds.host_syncs import HostSyncCounter
    from glm53_ds.layers.moe import Glm53MoE

    layout = setup_ranks(ep, etp)
    rank, world = layout.rank, layout.world_size
    ref, model = load_models(ckpt, layout, torch.float32)
    for m in (ref, model):
        for layer in m.modules():
            if isinstance(layer, Glm53MoE):
                layer.router.e_score_correction_bias[:2] = 10.0  # selection only: weights stay the scores
                layer.experts.moe_impl = "loop" if m is ref else "grouped"
    ids, ref_local = _reference_step(ref, model, world, etp, rank)
    with HostSyncCounter(model) as counter:
        loss = model(local_rows(ids, rank), labels=local_rows(ids, rank))
        loss.backward()
    out: dict[str, Any] = {"loss_rel_err": rel_err(loss.detach(), ref_local)}
    out["expert_grad_err"] = compare_to_reference(model, ref, layout, use_grad=True)["expert"]
    shard = layout.expert_shard(ref.glm)
    out["starved_rank"] = shard.first_expert >= 2
    out["expert_grads"] = {
        n: (None if p.grad is None else float(p.grad.abs().max()))
        for n, p in model.named_parameters()
        if n.endswith(("gate_up_proj", "down_proj"))
    }
    out["moe_layers"] = sum(isinstance(m, Glm53MoE) for m in model.modules())
    out["syncs"] = {k: v.syncs for k, v in counter.scopes.items()}
    out["sync_sites"] = counter.summary()["sync_sites"]
    return out


@pytest.mark.slow
def test_grouped_dispatch_with_starved_experts_and_ranks_ep2_etp2(tmp_path, checkpoints):
    """Grouped experts behind the EP x ETP dispatcher against the single-process loop reference, with routing forced
    onto experts 0 and 1: six experts and the whole second EP rank get no tokens. Their gradients are zeros, not
    missing (ZeRO reduces every expert gradient; a missing one hangs it). Host syncs: the forward's input read plus
    one copy of the split sizes per MoE layer, none in backward."""
    full, _ = checkpoints
    results = run_world(4, moe_dispatch, tmp_path, ckpt=full, ep=2, etp=2)
    for r in results:
        assert r["loss_rel_err"] <= 1e-5, r
        assert r["expert_grad_err"] <= 1e-5, r
        assert all(v is not None for v in r["expert_grads"].values()), r
        if r["starved_rank"]:
            assert max(r["expert_grads"].values()) == 0.0, r
        layer_syncs = {k: v for k, v in r["syncs"].items() if k.startswith("layer")}
        assert sum(layer_syncs.values()) == r["moe_layers"], r["sync_sites"]
        assert r["syncs"].get("backward", 0) == 0, r["sync_sites"]
        assert r["syncs"].get("outside", 0) == 1, r["sync_sites"]
    assert any(r["starved_rank"] for r in results)


def tiled_moe(ckpt: str, ep: int, etp: int) -> dict[str, Any]:
    """Full recompute with the MoE in tiles of a few tokens (`moe_tile_bytes`, layers/moe/moe_layer.py) behind the
    EP x ETP dispatcher, against the single-process untiled reference on the global batch: each tile's dispatch is
    a collective, in forward, in the layer's recompute and in the tile's own recompute. The mHC mixes, which the same
    budget tiles, are left whole here: they hold no collective (their tiles: tests/layers/test_token_tiles.py), and
    at this budget's 2-token tiles their backward rounds differently, by up to 6e-5 of a rank's largest expert
    gradient (measured; the loss stays bitwise), which would blur the 1e-5 this test holds the dispatch to."""
    from glm53_ds.layers.moe import Glm53MoE

    layout = setup_ranks(ep, etp)
    rank, world = layout.rank, layout.world_size
    ref, model = load_models(ckpt, layout, torch.float32, moe_tile_bytes=4096, recompute_granularity="full",
                             recompute_method="uniform", recompute_num_layers=1)  # fmt: skip
    for module in model.modules():
        if hasattr(module, "mhc_tile_tokens"):
            module.mhc_tile_tokens = 2**62
    calls: list[int] = []  # tokens per call of the routed experts
    route = Glm53MoE._route

    def counted(self, tokens):  # type: ignore[no-untyped-def]
        calls.append(tokens.shape[0])
        return route(self, tokens)

    Glm53MoE._route = counted  # type: ignore[method-assign]
    ids, ref_local = _reference_step(ref, model, world, etp, rank)
    calls.clear()
    loss = model(local_rows(ids, rank), labels=local_rows(ids, rank))
    loss.backward()
    moe = next(m for m in model.modules() if isinstance(m, Glm53MoE))
    tokens = local_rows(ids, rank).numel()
    return {
        "loss_rel_err": rel_err(loss.detach(), ref_local),
        "expert_grad_err": compare_to_reference(model, ref, layout, use_grad=True)["expert"],
        "tile": moe.tile_tokens(), "tokens": tokens,
        "route_calls": calls, "moe_layers": sum(isinstance(m, Glm53MoE) for m in model.modules()),
    }  # fmt: skip


@pytest.mark.slow
def test_tiled_moe_under_ep2_etp2_matches_one_process(tmp_path, checkpoints):
    full, _ = checkpoints
    for r in run_world(4, tiled_moe, tmp_path, ckpt=full, ep=2, etp=2):
        assert 1 < r["tile"] < r["tokens"], r
        # every call one tile (the last one shorter), each layer's forward and its recompute over all the tiles
        tiles = -(-r["tokens"] // r["tile"])
        calls = r["route_calls"]
        assert (
            max(calls) == r["tile"] and len(calls) % tiles == 0 and len(calls) >= 2 * tiles * r["moe_layers"]
        ), r
        assert r["loss_rel_err"] <= 1e-5, r
        assert r["expert_grad_err"] <= 1e-5, r
