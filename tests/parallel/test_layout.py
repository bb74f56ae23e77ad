"""`ParallelLayout` (parallel/layout.py): invalid layouts refused with the option at fault, the data rank without the
SP coordinate, the folded groups (EP spanning the SP ranks) as every rank of a fake world builds them."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from glm53_ds.config import Glm53Config
from glm53_ds.parallel import init_layout, validate_layout
from glm53_ds.parallel.layout import data_rank, group_keys, smallest_world
from glm53_ds.plan.dry_run import fake_world
from tests.model_fixtures import CONFIG_A


@pytest.mark.parametrize(
    "world, ep, etp, experts, inner, message",
    [
        (6, 4, 1, None, None, r"world size 6 is not divisible by EP x ETP = 4 x 1 = 4"),
        (8, 2, 3, None, None, r"world size 8 is not divisible by EP x ETP = 2 x 3 = 6"),
        (8, 0, 1, None, None, r"ep must be a positive integer, got 0"),
        (8, 8, 1, 12, None, r"n_routed_experts \(12\) is not divisible by EP=8"),
        (8, 2, 4, 8, 6, r"moe_intermediate_size \(6\) is not divisible by ETP=4"),
    ],
)
def test_invalid_layouts_are_refused(world, ep, etp, experts, inner, message):
    cfg = None
    if experts is not None:
        fields = dict(n_routed_experts=experts) | ({"moe_intermediate_size": inner} if inner else {})
        cfg = Glm53Config.from_text_dict({**CONFIG_A, **fields})
    with pytest.raises(ValueError, match=message):
        validate_layout(world, ep, etp, cfg)


@pytest.mark.parametrize(
    "world, ep, etp, sp, seq, message",
    [
        (8, 2, 2, 8, None, r"world size 8 is not divisible by SP x ETP = 8 x 2 = 16"),
        (4, 1, 1, 4, 64, r"SP = 4 does not divide linear_num_heads = 2"),
        (4, 1, 1, 2, 63, r"seq_length 63 is not divisible by SP = 2"),
        (4, 1, 1, 0, None, r"sp must be a positive integer, got 0"),
    ],
)
def test_invalid_sequence_parallel_layouts_are_refused(world, ep, etp, sp, seq, message):
    cfg = Glm53Config.from_text_dict(CONFIG_A)  # two heads of each attention kind
    with pytest.raises(ValueError, match=message):
        validate_layout(world, ep, etp, cfg, sp=sp, seq_length=seq)
    four_linear = Glm53Config.from_text_dict({**CONFIG_A, "linear_num_heads": 4})
    with pytest.raises(ValueError, match=r"SP = 4 does not divide num_attention_heads = 2"):
        validate_layout(4, 1, 1, four_linear, sp=4)


def test_data_rank_removes_the_sp_coordinate():
    # rank = etp + ETP * (sp + SP * dp): world 8, ETP 2 x SP 2: ranks r and r + 2 share a sample stream
    assert [data_rank(r, 2, 2) for r in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    assert [data_rank(r, 1, 2) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [data_rank(r, 1, 4) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [data_rank(r, 4, 1) for r in range(8)] == list(range(8))


def _groups_of_every_rank(world: int, ep: int, etp: int, sp: int) -> list[dict]:
    """Each rank's groups as `init_layout` builds them in a fake world of `world` ranks (no processes)."""
    seen = []
    for rank in range(world):
        fake_world(world, rank)
        layout = init_layout(ep, etp, sp=sp)
        ranks = dist.get_process_group_ranks
        seen.append(dict(
            sp=ranks(layout.sp_group) if layout.sp_group is not None else [rank], ep=ranks(layout.ep_group),
            etp=ranks(layout.etp_group), edp=ranks(layout.expert_dp_group), dp=layout.dp_ranks,
            pure_dp=layout.pure_dp_ranks, data_rank=layout.data_rank, sp_rank=layout.sp_rank,
        ))  # fmt: skip
    dist.destroy_process_group()
    return seen


@pytest.mark.parametrize(
    "world, ep, etp, sp, sp_groups, ep_groups",
    [
        (2, 2, 1, 2, [[0, 1]], [[0, 1]]),  # folded: EP spans the SP pair
        (4, 4, 1, 2, [[0, 1], [2, 3]], [[0, 1, 2, 3]]),
        (4, 2, 2, 2, [[0, 2], [1, 3]], [[0, 2], [1, 3]]),
        (4, 4, 1, 4, [[0, 1, 2, 3]], [[0, 1, 2, 3]]),
        (8, 8, 1, 8, [list(range(8))], [list(range(8))]),
        (8, 2, 2, 2, [[0, 2], [1, 3], [4, 6], [5, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]]),
        (8, 2, 1, 4, [[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]]),  # SP wider than EP
    ],
)
def test_folded_layouts_build_consistent_groups(world, ep, etp, sp, sp_groups, ep_groups):
    seen = _groups_of_every_rank(world, ep, etp, sp)
    assert sorted({tuple(g["sp"]) for g in seen}) == [tuple(g) for g in sp_groups]
    assert sorted({tuple(g["ep"]) for g in seen}) == [tuple(g) for g in ep_groups]
    for rank, g in enumerate(seen):
        assert g["sp"][g["sp_rank"]] == rank
        assert all(r % etp == rank % etp for r in g["sp"])  # an SP group shares its ETP rank: inside `dp`
        assert set(g["sp"]) <= set(g["dp"]) and len(g["dp"]) == world // etp
        assert len(g["pure_dp"]) == world // (etp * sp) and not set(g["pure_dp"]) & (set(g["sp"]) - {rank})
        assert len(g["edp"]) == world // (ep * etp)
        assert {seen[r]["data_rank"] for r in g["sp"]} == {g["data_rank"]}  # an SP group reads one stream
    streams = sorted(g["data_rank"] for g in seen)
    assert streams == sorted(list(range(world // sp)) * sp)  # each stream read by exactly one SP group
    keys = group_keys(
        ep, etp, sp
    )  # what the placement line (parallel/rank_order.py) reads: megatron's groups too
    for rank, g in enumerate(seen):
        for name, built in (("ETP", "etp"), ("SP", "sp"), ("EP", "ep"), ("expert DP", "edp"), ("DP", "dp"),
                            ("pure DP", "pure_dp")):  # fmt: skip
            assert [r for r in range(world) if keys[name](r) == keys[name](rank)] == sorted(g[built]), (
                name,
                rank,
            )


def test_the_smallest_world_of_a_folded_layout():
    assert [smallest_world(ep, etp, sp) for ep, etp, sp in [(8, 1, 8), (4, 1, 2), (2, 2, 2), (2, 1, 4), (1, 2, 1)]] == [
        8, 4, 4, 4, 2]  # fmt: skip
    validate_layout(8, 8, 1, sp=8)  # EP 8 x SP 8 on 8 ranks
    with pytest.raises(ValueError, match="not divisible by SP x ETP"):
        validate_layout(4, 2, 2, sp=4)
