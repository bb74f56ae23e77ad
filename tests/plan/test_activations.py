"""plan/activations.py: the activation model (per layer kind, measured on the reduced model, composed over the
whole model) against the measured peaks of whole models' training steps.

On CPU (fp32, the torch path): a 10-layer model of three layer kinds and MTP, tiny (hidden 32) and medium (hidden
512, 1,024 tokens: past DSA's top-k, the sparse path) widths, several lengths, each recompute mode, full training
and LoRA. The planner's answer (the reduced model's profile composed over the 10 layers) is within 15% of the
whole model's measured step peak (measured: within 1.7%). Controls, one per mode, each missing by more than 15%:
the reduced model's own peak (no composition over the depth), a profile traced without the run's recompute mode,
and the saved bytes alone (no backward transient) under full recompute.

At a folded layout (slow: 2 ranks, SP 2 x EP 2, the experts over the SP ranks): each rank's composition vs its own
measured step peak, within 1.1%.

At the released size on meta (slow: a subprocess with a fake world): the composition vs the whole 45-layer model's
measured peak at EP 32 x ETP 2, within 1% (measured 0.12% without recompute, 3e-6 with full recompute).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import glm53_ds
from glm53_ds.layers.lora import LoraSpec
from glm53_ds.layers.lora_targets import apply_lora
from glm53_ds.model import build_model
from glm53_ds.plan.activations import LiveBytes, layer_kinds, profile_step, reduced_config
from glm53_ds.training.config import recompute_overrides
from glm53_ds.training.trainable import select_trainable
from tests.model_fixtures import CONFIG_A

TOLERANCE = 0.15
KDA, DSA = "linear_attention", "indexed_attention"
TEN_LAYERS = dict(
    CONFIG_A, num_hidden_layers=10, layer_types=[KDA, KDA, DSA, KDA, KDA, KDA, DSA, KDA, KDA, DSA],
    indexer_types=["full"] * 10, mlp_layer_types=["dense", "dense"] + ["sparse"] * 8,
)  # fmt: skip
MEDIUM = dict(
    TEN_LAYERS, vocab_size=2048, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
    num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=128, q_lora_rank=192, qk_nope_head_dim=32,
    v_head_dim=32, index_head_dim=32, index_n_heads=4, linear_head_dim=32, linear_num_heads=8, index_topk=64,
)  # fmt: skip


def _profile(text: dict, length: int, recompute: str, reduced: bool, lora: int = 0, **overrides):  # type: ignore[no-untyped-def]
    cfg = glm53_ds.Glm53Config.from_text_dict(text)
    torch.manual_seed(0)
    model = build_model(
        reduced_config(cfg) if reduced else cfg,
        dtype=torch.float32,
        **recompute_overrides(recompute),
        **overrides,
    )
    if lora:
        apply_lora(model, LoraSpec(rank=lora, alpha=float(lora)))
    select_trainable(model, lora=bool(lora), trainable=None, freeze=None, train_indexer=False)
    ids = torch.randint(1, cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
    return cfg, profile_step(model, lambda: model(ids, labels=ids))


def _miss(predicted: int, measured: int) -> float:
    return abs(predicted / measured - 1)


TILES = {"moe_tile_bytes": 2**22}  # the MoE over tiles of 292 tokens, 4 of the 1,024 (--moe-tile-mib 4)
CASES = [(TEN_LAYERS, 64, mode, 0, {}) for mode in ("none", "selective", "full")] + [
    (TEN_LAYERS, 256, mode, 0, {}) for mode in ("none", "selective", "full")
] + [(TEN_LAYERS, 256, "none", 4, {}), (TEN_LAYERS, 256, "full", 4, {}), (MEDIUM, 1024, "none", 0, {}),
     (MEDIUM, 1024, "full", 0, {}), (MEDIUM, 1024, "full", 0, TILES)]  # fmt: skip


@pytest.mark.parametrize("text, length, recompute, lora, overrides", CASES)
def test_the_composed_profile_predicts_the_whole_models_peak(text, length, recompute, lora, overrides):
    cfg, reduced = _profile(text, length, recompute, reduced=True, lora=lora, **overrides)
    _, whole = _profile(text, length, recompute, reduced=False, lora=lora, **overrides)
    kinds = layer_kinds(cfg)
    assert len(set(kinds)) == 3 and reduced_config(cfg).num_hidden_layers == 3
    assert _miss(reduced.peak(kinds), whole.measured_peak) <= TOLERANCE
    # controls: the reduced model's own peak, or the saved bytes without the backward transient, miss
    if recompute == "full":
        assert _miss(reduced.saved(kinds), whole.measured_peak) > TOLERANCE
    else:
        assert _miss(reduced.measured_peak, whole.measured_peak) > TOLERANCE


@pytest.mark.parametrize(
    "recompute, other", [("none", "selective"), ("selective", "full"), ("full", "selective")]
)
def test_a_profile_without_the_runs_recompute_misses(recompute, other):
    cfg, wrong = _profile(TEN_LAYERS, 256, other, reduced=True)
    _, whole = _profile(TEN_LAYERS, 256, recompute, reduced=False)
    assert _miss(wrong.peak(layer_kinds(cfg)), whole.measured_peak) > TOLERANCE


def test_live_bytes_counts_live_storages_once():
    before = torch.ones(100)  # created outside: never counted, nor its views
    tracker = LiveBytes()
    with tracker:
        a = torch.empty(1000)  # 4,000 bytes
        view = a[:10]
        b = before + 1  # 400
        alias = before.view(10, 10)
        before.mul_(2)
        assert tracker.live == 4400 and tracker.peak == 4400
        del a
        assert tracker.live == 4400  # the view keeps the storage
        del view
        assert tracker.live == 400 and tracker.peak == 4400 and tracker.highest == 4400
        assert tracker.mark() == 400 and tracker.peak == 400
        c = torch.empty(10, dtype=torch.bfloat16)
        tracker.exclude(c)  # a gradient: leaves the count
        assert tracker.live == 400
        del b, c, alias
    assert tracker.live == 0 and tracker.highest == 4400


def test_the_reduced_config_keeps_one_layer_of_each_kind_in_order():
    cfg = glm53_ds.Glm53Config.from_text_dict(TEN_LAYERS)
    reduced = reduced_config(cfg)
    assert layer_kinds(reduced) == [layer_kinds(cfg)[i] for i in (0, 2, 3)]
    assert reduced.num_nextn_predict_layers == cfg.num_nextn_predict_layers


def folded_rank_profiles(text: dict, length: int, recompute: str, ep: int, sp: int) -> list[int]:
    """A `run_world` scenario: on this rank of a folded layout (EP over the SP ranks), the planner's composition of
    the reduced model's profile, the whole model's measured step peak, and the two controls' answers (the reduced
    model's own peak, the saved bytes alone), fp32 on CPU with gloo."""
    from glm53_ds.model import Glm53Model
    from glm53_ds.transformer_config import make_transformer_config
    from tests.dist_harness import setup_ranks

    layout = setup_ranks(ep, 1, sp=sp)
    cfg = glm53_ds.Glm53Config.from_text_dict(text)
    ids = torch.randint(1, cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
    profiles = []
    for config in (reduced_config(cfg), cfg):
        tconfig = make_transformer_config(config, torch.float32, expert_model_parallel_size=ep,
                                          expert_tensor_parallel_size=1, **recompute_overrides(recompute))  # fmt: skip
        torch.manual_seed(0)
        model = Glm53Model(tconfig, pg_collection=layout.pg_collection)
        profiles.append(profile_step(model, lambda model=model: model(ids, labels=ids)))
    reduced, whole = profiles
    kinds = layer_kinds(cfg)
    return [reduced.peak(kinds), whole.measured_peak, reduced.measured_peak, reduced.saved(kinds)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "text, length, recompute", [(TEN_LAYERS, 512, "none"), (TEN_LAYERS, 512, "full"), (MEDIUM, 2048, "full")]
)
def test_the_composition_predicts_a_folded_ranks_peak(tmp_path, text, length, recompute):
    """SP 2 x EP 2 on 2 ranks (the experts over the SP ranks, #42): each rank's planner answer within 15% of its
    measured step peak (measured: within 1.1% at tiny width, 512 tokens; within 0.3% at medium width, 2,048 tokens,
    1,024 per rank: DSA's sparse path); the control (the reduced model's own peak, or the saved bytes alone under
    full recompute) misses by 8-83%."""
    from tests.dist_harness import run_world

    ranks = run_world(2, folded_rank_profiles, str(tmp_path), text=text, length=length, recompute=recompute,
                      ep=2, sp=2)  # fmt: skip
    for predicted, measured, own_peak, saved in ranks:
        assert _miss(predicted, measured) <= TOLERANCE, (predicted, measured)
        control = saved if recompute == "full" else own_peak
        assert _miss(control, measured) > TOLERANCE, (own_peak, saved, measured)


RELEASED_CHECK = """
import json, sys, warnings
import torch
warnings.filterwarnings("ignore")
from glm53_ds.plan.activations import layer_kinds, plan_activations, profile_step
from glm53_ds.plan.dry_run import rank_model_on_meta
from glm53_ds.plan.run import PlannedRun
from glm53_ds.training.presets import preset
cfg, out = preset("glm-5.3-flash"), {}
for mode in ("none", "full"):
    run = PlannedRun.for_model(cfg, seq_length=8192, micro_batch_size=1, ep=32, etp=2, recompute=mode)
    reduced = plan_activations(run)
    model, _ = rank_model_on_meta(run)
    ids = torch.zeros(1, 8192, dtype=torch.long, device="meta")
    whole = profile_step(model, lambda: model(ids, labels=ids))
    out[mode] = [reduced.peak(layer_kinds(cfg)), whole.measured_peak]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_at_the_released_size_the_composition_is_the_whole_models_meta_peak():
    """45 layers, 288 experts at EP 32 x ETP 2, 8,192 tokens on meta: composed from the reduced model (3 decoder
    layers + MTP) vs the whole model's own trace, within 1%."""
    run = subprocess.run([sys.executable, "-c", RELEASED_CHECK], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for mode, (predicted, measured) in json.loads(run.stdout.strip().splitlines()[-1]).items():
        assert _miss(predicted, measured) <= 0.01, (mode, predicted, measured)
