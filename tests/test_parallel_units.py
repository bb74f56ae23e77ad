"""Single-process checks of the parallel helpers: layout validation, the DeepSpeed mpu view, the router-bias
rule, replica checks and patch installation. Multi-rank behaviour is in test_expert_parallel.py."""

from __future__ import annotations

import pytest
import torch

import glm53_ds
from glm53_ds.config import Glm53Config
from glm53_ds.engine.deepspeed_internals import install_gradient_sync
from glm53_ds.engine.mpu import DeepSpeedMpu
from glm53_ds.layers.moe import update_router_bias
from glm53_ds.parallel import init_layout, validate_layout
from glm53_ds.parallel.layout import data_rank
from glm53_ds.parallel.replicas import check_replicas
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


def test_single_rank_layout_and_mpu():
    glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A))  # a world-1 process group
    layout = init_layout(1, 1)
    mpu = DeepSpeedMpu(layout)
    assert (layout.ep, layout.etp, layout.world_size) == (1, 1, 1)
    assert mpu.get_model_parallel_world_size() == 1 and mpu.get_data_parallel_world_size() == 1
    assert mpu.get_data_parallel_group_ranks() == [0] and mpu.get_pipeline_model_parallel_world_size() == 1
    model = glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A))
    check_replicas(model, layout)  # one replica: nothing to compare, no error

    class FakeEngine:
        optimizer = object()

        def fp16_enabled(self):
            return False

        def bfloat16_enabled(self):
            return False

    engine = FakeEngine()
    assert install_gradient_sync(engine, layout) is False  # DeepSpeed's group is already complete
    with pytest.raises(RuntimeError, match="already installed"):
        install_gradient_sync(engine, layout)


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
