"""`checkpoint/placement.py`: every read of a checkpoint is an overlap of placements. Checked against the shard rule
itself (`ExpertShard.shard`, which slices the whole tensor) for every pair of stored and wanted layouts, the ZeRO
fragment narrowing, and the released-tensor boxes the converters read and write."""

from __future__ import annotations

import pytest
import torch

from glm53_ds.checkpoint.placement import (
    REPLICATED,
    Block,
    TensorPlacement,
    copies,
    expert_set_name,
    global_shape,
    index_placement,
    local_part,
    placement,
    stored_placements,
)
from glm53_ds.parallel.expert_shard import DOWN, GATE_UP, ExpertShard

E, INNER, D = 8, 12, 5
NAMES = {GATE_UP: "decoder.layers.1.mlp.experts.gate_up_proj", DOWN: "decoder.layers.1.mlp.experts.down_proj"}


def _whole() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {GATE_UP: torch.randn(E, 2 * INNER, D, generator=g), DOWN: torch.randn(E, D, INNER, generator=g)}


def assemble(target: TensorPlacement, sources: list[tuple[TensorPlacement, torch.Tensor]]) -> torch.Tensor:
    """What `CheckpointDir.read` does, on in-memory stored parts."""
    out = torch.zeros(target.local_shape)
    for source, stored in sources:
        for src, dst in copies(target, source):
            out[dst] = stored[src]
    return out


@pytest.mark.parametrize("stored_ep, stored_etp", [(1, 1), (2, 2), (4, 1), (2, 3), (8, 6)])
def test_any_stored_layout_read_by_any_shard_equals_slicing_the_whole_tensor(stored_ep, stored_etp):
    """ETP 3 / 4 / 6 do not divide into each other: a target row range straddles stored shards."""
    whole = _whole()
    stored = ExpertShard(E, INNER, stored_ep, 0, stored_etp, 0)
    for kind, full in whole.items():
        name = NAMES[kind]
        parts = [(p, s.shard(kind, full)) for p, s in zip(stored_placements(name, tuple(full.shape), stored),
                                                          stored.all_shards(), strict=True)]  # fmt: skip
        assert [p.stored_set for p, _ in parts] == [
            expert_set_name(s.ep_rank, s.etp_rank) for s in stored.all_shards()
        ]
        for ep, etp in [(1, 1), (2, 2), (4, 1), (2, 3), (8, 4), (1, 6)]:
            for shard in ExpertShard(E, INNER, ep, 0, etp, 0).all_shards():
                target = placement(name, tuple(full.shape), shard)
                assert target.complete and target.is_expert
                got = assemble(target, parts)
                assert torch.equal(got, shard.shard(kind, full)), (stored_ep, stored_etp, ep, etp, kind)
                assert global_shape(name, target.local_shape, shard) == tuple(full.shape)


def test_control_a_wrong_rule_is_caught():
    """The up rows placed as if they followed the gate rows globally (the mistake a [E, 2I/ETP, D] shard invites):
    the comparison above fails for it."""
    full, shard = _whole()[GATE_UP], ExpertShard(E, INNER, 2, 1, 3, 1)
    right = placement(NAMES[GATE_UP], tuple(full.shape), shard)
    gate, up = right.blocks
    (e0, e1), (r0, r1), dims = up.box
    inner = shard.local_intermediate
    wrong = TensorPlacement(right.name, right.global_shape, right.local_shape,
                            (gate, Block(((e0, e1), (r0 - INNER + inner, r1 - INNER + inner), dims), up.at)),
                            right.stored_set)  # fmt: skip
    source = placement(NAMES[GATE_UP], tuple(full.shape), ExpertShard(E, INNER))  # the whole tensor
    assert torch.equal(assemble(right, [(source, full)]), shard.shard(GATE_UP, full))
    assert not torch.equal(assemble(wrong, [(source, full)]), shard.shard(GATE_UP, full))


def test_a_zero_fragment_reads_only_the_rows_holding_it():
    """ZeRO: a rank's fragment (start, numel) of a flattened tensor; only the rows covering it are filled."""
    name, shape = "decoder.layers.0.self_attention.q_b_proj.weight", (10, 4)
    full = torch.arange(40.0).reshape(shape)
    whole = placement(name, shape, ExpertShard(E, INNER))
    assert whole.stored_set == REPLICATED and not whole.is_expert
    part = whole.fragment_rows(start=9, numel=14)  # elements 9..22: rows 2..5
    assert not part.complete
    got = assemble(part, [(whole, full)])
    assert torch.equal(got[2:6], full[2:6]) and got[:2].abs().sum() == 0 and got[6:].abs().sum() == 0
    assert whole.fragment_rows(5, 0).blocks == ()  # this rank holds none of it
    # an expert tensor's fragment is rows of its local experts, wherever they sit globally
    shard = ExpertShard(E, INNER, 2, 1, 1, 0)
    full_down = _whole()[DOWN]
    target = placement(NAMES[DOWN], tuple(full_down.shape), shard).narrowed_to_rows(1, 3)
    got = assemble(
        target, [(placement(NAMES[DOWN], tuple(full_down.shape), ExpertShard(E, INNER)), full_down)]
    )
    assert torch.equal(got[1:3], full_down[5:7]) and got[0].abs().sum() == 0 and got[3].abs().sum() == 0


def test_released_tensor_boxes():
    """The converters' boxes: expert 5's up projection, a dense fc1's gate rows."""
    full = _whole()[GATE_UP]
    box = index_placement(NAMES[GATE_UP], tuple(full.shape), (5, slice(INNER, 2 * INNER)))
    source = placement(NAMES[GATE_UP], tuple(full.shape), ExpertShard(E, INNER))
    assert torch.equal(assemble(box, [(source, full)])[0], full[5, INNER:])
    dense = torch.randn(6, 3)
    box = index_placement("decoder.layers.0.mlp.linear_fc1.weight", (6, 3), (slice(0, 3),))
    assert torch.equal(assemble(box, [(placement("x", (6, 3), ExpertShard(E, INNER)), dense)]), dense[:3])
    with pytest.raises(ValueError, match="has a step"):
        index_placement("x", (6, 3), (slice(0, 6, 2),))


def _lora_part(kind: str, whole: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """A shard's part of a grouped LoRA tensor by the adapters' rule (layers/lora.py)."""
    experts = slice(shard.first_expert, shard.first_expert + shard.num_local)
    if kind == "gate_up_B":
        return shard.shard(GATE_UP, whole)
    if kind == "down_A":
        return shard.shard(DOWN, whole)
    return whole[experts]  # gate_up_A, down_B: whole on every ETP rank


@pytest.mark.parametrize("stored_ep, stored_etp", [(1, 1), (2, 3), (4, 2)])
def test_expert_adapters_read_at_any_layout(stored_ep, stored_etp):
    r = 4
    g = torch.Generator().manual_seed(1)
    shapes = {
        "gate_up_A": (E, r, D),
        "gate_up_B": (E, 2 * INNER, r),
        "down_A": (E, r, INNER),
        "down_B": (E, D, r),
    }
    stored = ExpertShard(E, INNER, stored_ep, 0, stored_etp, 0)
    for kind, shape in shapes.items():
        name, whole = f"decoder.layers.1.mlp.experts.lora.{kind}", torch.randn(shape, generator=g)
        sources = stored_placements(name, shape, stored)
        # an ETP-whole tensor is read from ETP rank 0's copy only
        assert len(sources) == stored_ep * (1 if kind in ("gate_up_A", "down_B") else stored_etp)
        parts = [(p, _lora_part(kind, whole, stored.at(int(p.stored_set[10:13]), int(p.stored_set[17:20]))))
                 for p in sources]  # fmt: skip
        for shard in ExpertShard(E, INNER, 2, 0, 2, 0).all_shards():
            target = placement(name, shape, shard)
            assert target.local_shape == tuple(_lora_part(kind, whole, shard).shape)
            assert torch.equal(assemble(target, parts), _lora_part(kind, whole, shard)), (kind, shard)
            assert global_shape(name, target.local_shape, shard) == shape


def test_local_part_is_the_shard_rule():
    """`local_part` (what the multi-rank tests compare a rank's tensors with) agrees with `ExpertShard.shard` and
    with the adapters' rule above, at layouts whose ETP does not divide evenly into the stored one."""
    whole, r = _whole(), 4
    g = torch.Generator().manual_seed(2)
    adapters = {"gate_up_A": torch.randn(E, r, D, generator=g), "down_B": torch.randn(E, D, r, generator=g),
                "gate_up_B": torch.randn(E, 2 * INNER, r, generator=g), "down_A": torch.randn(E, r, INNER, generator=g)}  # fmt: skip
    for shard in [*ExpertShard(E, INNER, 2, 0, 3, 0).all_shards(), ExpertShard(E, INNER)]:
        for kind, full in whole.items():
            assert torch.equal(local_part(NAMES[kind], full, shard), shard.shard(kind, full))
        for kind, full in adapters.items():
            got = local_part(f"decoder.layers.1.mlp.experts.lora.{kind}", full, shard)
            assert torch.equal(got, _lora_part(kind, full, shard)), (kind, shard)
        w = torch.randn(3, 5, generator=g)
        assert torch.equal(local_part("decoder.layers.0.self_attention.o_proj.weight", w, shard), w)
