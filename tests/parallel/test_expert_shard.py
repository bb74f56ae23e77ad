"""`ExpertShard`, the one statement of which rank holds which expert rows, and the loader's use of it under ETP."""

from __future__ import annotations

import pytest
import torch

import glm53_ds
from glm53_ds.config import Glm53Config
from glm53_ds.hf_loader import SafetensorsCheckpoint, load_hf_state_into
from glm53_ds.layers.moe import GroupedExperts
from glm53_ds.parallel.expert_shard import DOWN, GATE_UP, ExpertShard, expert_tensor_kind
from tests.model_fixtures import CONFIG_A, save_tiny_hf

E, INNER, D = 8, 6, 5


def test_owner_local_index_and_rows():
    shard = ExpertShard(E, INNER, ep=4, ep_rank=2, etp=3, etp_rank=1)
    assert (shard.num_local, shard.first_expert, list(shard.local_experts)) == (2, 4, [4, 5])
    assert [shard.owner(e) for e in range(E)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [shard.owns(e) for e in range(E)] == [False] * 4 + [True] * 2 + [False] * 2
    assert shard.local_index(5) == 1 and torch.equal(
        shard.local_index(torch.tensor([4, 7])), torch.tensor([0, 1])
    )
    assert (shard.local_intermediate, shard.rows) == (2, slice(2, 4))
    assert (shard.gate_up_rows("gate_proj"), shard.gate_up_rows("up_proj")) == (slice(0, 2), slice(2, 4))
    assert len(list(shard.all_shards())) == 12


def test_a_shard_slices_the_grouped_tensors():
    """(Reading shards back at any layout: tests/checkpoint/test_placement.py.)"""
    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(E, 2 * INNER, D, generator=g), torch.randn(E, D, INNER, generator=g)
    layout = ExpertShard(E, INNER, ep=2, etp=3)
    # a shard's gate_up rows are its gate slice, then its up slice, of each of its experts
    shard = layout.at(1, 2)
    part = shard.shard(GATE_UP, gate_up)
    assert part.shape == (4, 4, D)
    assert torch.equal(part[1, :2], gate_up[5, :INNER][4:6]) and torch.equal(
        part[1, 2:], gate_up[5, INNER:][4:6]
    )
    assert torch.equal(shard.shard(DOWN, down)[0], down[4][:, 4:6])
    assert expert_tensor_kind("decoder.layers.2.mlp.experts.gate_up_proj") == GATE_UP
    assert expert_tensor_kind("decoder.layers.2.mlp.router.weight") is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(ep=3), r"n_routed_experts \(8\) is not divisible by EP=3"),
        (dict(etp=4), r"moe_intermediate_size \(6\) is not divisible by ETP=4"),
        (dict(ep=0), r"ep must be a positive integer, got 0"),
        (dict(ep=2, ep_rank=2), r"shard rank \(EP 2, ETP 0\) outside EP=2 x ETP=1"),
    ],
)
def test_bad_shards_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExpertShard(E, INNER, **kwargs)


def test_loader_fills_an_etp_shard(tmp_path):
    """A model holding EP rank 1 / ETP rank 1 of 2 x 2 reads exactly its slices from a released checkpoint. Before
    ExpertShard the loader compared the whole released expert tensor with the shard's slot and refused every
    expert tensor under ETP > 1 (a shape mismatch per expert): this test failed then."""
    save_tiny_hf(tmp_path, CONFIG_A)
    full = glm53_ds.load_hf(str(tmp_path), mtp=False)
    cfg = Glm53Config.from_text_dict(CONFIG_A)
    model = glm53_ds.build_model(cfg, mtp=False)
    shard = ExpertShard.for_config(cfg, ep=2, ep_rank=1, etp=2, etp_rank=1)
    for layer in model.decoder.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts = GroupedExperts(model.config, shard)
    load_hf_state_into(model, SafetensorsCheckpoint(str(tmp_path)), mtp=False)
    expected = full.state_dict()
    checked = 0
    for name, tensor in model.state_dict().items():
        if (kind := expert_tensor_kind(name)) is not None:
            assert torch.equal(tensor, shard.shard(kind, expected[name])), name
            checked += 1
        elif not name.endswith("_extra_state"):
            assert torch.equal(tensor, expected[name]), name
    assert checked == 8  # 4 MoE layers x (gate_up, down)
