"""Routed experts as grouped GEMMs (layers/moe/experts.py, layers/moe/token_permutation.py) against the per-expert
reference loop, and the dispatcher's device-side permutation (parallel/moe_dispatch.py).

Tolerances: fp32 relative to each tensor's largest entry <= 1e-6 (measured <= 3.4e-7: the grouped GEMM is
bit-identical to a loop of mm on CPU; the rest is summation order); bf16 <= 2^-6 (measured <= 7e-3, bf16's
rounding of the products).
"""

from __future__ import annotations

import pytest
import torch

from glm53_ds import backends
from glm53_ds.config import Glm53Config
from glm53_ds.layers.moe import GroupedExperts
from glm53_ds.layers.moe.token_permutation import RoutedTokens
from glm53_ds.parallel.expert_shard import ExpertShard
from glm53_ds.parallel.moe_dispatch import expert_major_order
from glm53_ds.transformer_config import make_transformer_config
from tests.model_fixtures import CONFIG_A

E, K, T = 8, 3, 64


def _experts(dtype: torch.dtype, shard: ExpertShard | None = None, **fields) -> GroupedExperts:
    cfg = Glm53Config.from_text_dict(dict(CONFIG_A, n_routed_experts=E, num_experts_per_tok=K, **fields))
    experts = GroupedExperts(make_transformer_config(cfg, dtype), shard)
    with torch.no_grad():  # realistic scale: the clamp (swiglu_limit 0.5) is active on some rows
        experts.gate_up_proj.normal_(0, 0.3)
        experts.down_proj.normal_(0, 0.3)
    return experts


def _routing(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])  # expert E-1 gets nothing


def _run(
    experts: GroupedExperts, impl: str, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, g: torch.Tensor
):
    experts.moe_impl = impl
    for t in (x, w, experts.gate_up_proj, experts.down_proj):
        t.grad = None
    y = experts(x, ids, w)
    (y.float() * g).sum().backward()
    return [y.detach().float()] + [
        t.grad.float().clone() for t in (x, w, experts.gate_up_proj, experts.down_proj)
    ]


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-6), (torch.bfloat16, 2**-6)])
def test_grouped_equals_loop_forward_and_gradients(dtype, bound):
    experts = _experts(dtype)
    x = torch.randn(T, experts.gate_up_proj.shape[-1], dtype=dtype, requires_grad=True)
    w = torch.rand(T, K, requires_grad=True)
    ids = _routing()
    g = torch.randn(T, x.shape[1])
    loop, grouped = _run(experts, "loop", x, ids, w, g), _run(experts, "grouped", x, ids, w, g)
    for name, a, b in zip(["out", "d_x", "d_weights", "d_gate_up", "d_down"], loop, grouped, strict=True):
        err = ((a - b).abs().max() / a.abs().max()).item()
        assert err <= bound, (name, err)
    # the expert with no tokens: a zero gradient (ZeRO waits on every expert gradient), not a missing one
    assert grouped[3][E - 1].abs().max() == 0 and grouped[4][E - 1].abs().max() == 0
    assert grouped[3][0].abs().max() > 0


def test_etp_slices_add_up_to_the_whole_expert():
    """Under ETP each rank computes its slice of every expert's FFN; the slices' grouped outputs sum to the whole
    expert's (the dispatcher's reduce-scatter), for shards cut by the one ExpertShard rule."""
    whole = _experts(torch.float32)
    x = torch.randn(T, whole.gate_up_proj.shape[-1])
    routed = RoutedTokens.sort(_routing(), E)
    rows = routed.gather(x)
    expected = whole.ffn(rows, routed.counts)
    total = torch.zeros_like(expected)
    for shard in ExpertShard(E, whole.shard.intermediate, etp=2).all_shards():
        part = _experts(torch.float32, shard)
        with torch.no_grad():
            part.gate_up_proj.copy_(shard.shard("gate_up_proj", whole.gate_up_proj))
            part.down_proj.copy_(shard.shard("down_proj", whole.down_proj))
        total += part.ffn(rows, routed.counts)
    assert ((total - expected).abs().max() / expected.abs().max()).item() <= 1e-6


def test_routed_tokens_permutation():
    """Counts equal bincount's; gather's rows are the sorted pairs' tokens; its backward sums each token's k row
    gradients (equal to index_add's); combine inverts the sort."""
    ids = _routing(3)
    routed = RoutedTokens.sort(ids, E)
    assert torch.equal(routed.counts, torch.bincount(ids.flatten(), minlength=E))
    assert torch.equal(routed.experts, ids.flatten()[routed.order])
    x = torch.randn(T, 8, dtype=torch.float64, requires_grad=True)
    rows = routed.gather(x)
    assert torch.equal(rows, x[routed.order // K])
    g = torch.randn_like(rows)
    rows.backward(g)
    assert torch.allclose(x.grad, torch.zeros_like(x).index_add(0, routed.order // K, g), rtol=0, atol=1e-12)
    w = torch.rand(T, K, dtype=torch.float64)
    back = routed.combine(rows.detach(), w, torch.float64)
    assert torch.allclose(back, x.detach() * w.sum(1, keepdim=True), rtol=1e-12, atol=0)


def test_expert_major_order_matches_a_sort():
    """The dispatcher's device-side permutation: rows in (source, expert) chunks reordered to (expert, source),
    as a stable sort by expert would, including empty chunks."""
    g = torch.Generator().manual_seed(1)
    for sources, experts in [(1, 4), (4, 3), (6, 5)]:
        counts = torch.randint(0, 4, (sources, experts), generator=g)
        counts[0, 0] = 0
        expert_of_row = torch.cat(
            [torch.full((int(counts[s, e]),), e) for s in range(sources) for e in range(experts)]
        )
        perm = expert_major_order(counts, int(counts.sum()))
        assert torch.equal(perm, torch.sort(expert_of_row, stable=True).indices)


def test_moe_impl_choice_and_alignment():
    """`auto` takes the grouped GEMM when rows are 16-byte aligned, else the loop; an explicit `grouped` on
    misaligned sizes is refused naming the option and sizes; a bad value names the field and its source."""
    aligned = _experts(torch.float32)
    assert aligned.impl(torch.float32) == "grouped" and aligned.impl(torch.bfloat16) == "grouped"
    odd = _experts(torch.float32, moe_intermediate_size=6)
    assert odd.impl(torch.float32) == "loop"
    odd.moe_impl = "grouped"
    with pytest.raises(ValueError, match=r"moe_impl='grouped'.*moe_intermediate_size \(6\)"):
        odd.impl(torch.float32)
    with pytest.raises(ValueError, match="moe_impl='fast': expected one of auto, grouped, loop"):
        backends.check(backends.MOE, "fast")


def test_grouped_experts_refuse_an_ep_shard_without_the_dispatcher():
    experts = _experts(torch.float32, ExpertShard(E, 16, ep=2, ep_rank=1))
    x = torch.randn(4, experts.gate_up_proj.shape[-1])
    with pytest.raises(ValueError, match="EP rank 1 of 2"):
        experts(x, torch.zeros(4, K, dtype=torch.long), torch.ones(4, K))
