"""`ParallelLayout` (parallel/layout.py): invalid layouts refused with the option at fault, the data rank without the
SP coordinate."""

from __future__ import annotations

import pytest

from glm53_ds.config import Glm53Config
from glm53_ds.parallel import validate_layout
from glm53_ds.parallel.layout import data_rank
from tests.model_fixtures import CONFIG_A


@pytest.mark.parametrize(
    "world, ep, etp, experts, inner, message",
    [
        (6, 4, 1, None, None, r"world size 6 is not divisible by SP x EP x ETP = 1 x 4 x 1 = 4"),
        (8, 2, 3, None, None, r"world size 8 is not divisible by SP x EP x ETP = 1 x 2 x 3 = 6"),
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
        (8, 2, 2, 4, None, r"world size 8 is not divisible by SP x EP x ETP = 4 x 2 x 2 = 16"),
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
    # world 8, ETP2 x EP2 x SP2: ranks r and r + 4 share a sample stream; SP = 1 keeps the rank
    assert [data_rank(r, 4, 2) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [data_rank(r, 2, 2) for r in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    assert [data_rank(r, 4, 1) for r in range(8)] == list(range(8))
