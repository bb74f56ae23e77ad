"""A running engine's checkpoints (engine/checkpoint.py) over the format checkpoint/ owns.

Resume at another cluster layout (#19): a training checkpoint saved at world 4, EP2 x ETP2, ZeRO-2 (fp32) at step 3
of 6 continues at world 2 EP2, world 4 EP4, world 4 EP1 under ZeRO-1 and world 4 SP2 x EP2, through the layout-free
optimizer state; the same global batch (8 rows) at every layout. Also: the save/load round trip at EP2 x ETP2 (each
EP rank's experts in their own files), bf16 masters and moments bitwise across a layout change, a model holding NaN
never saved, pickles in DeepSpeed's files refused and never run, the user's no-weights-only switch.

Tolerance: steps 4..6's LM loss within 1e-6 relative of the uninterrupted run. The resumed state is exact (the bf16
test below checks the masters and moments bitwise); what differs is the reduction order of the new layout, which
moves fp32 losses by ~1e-7 per step. Control: the same resume with fresh optimizer state (step, data and weights
kept) is off by far more (measured in the assertion message).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
import torch

import glm53_ds
from glm53_ds import safe_io
from glm53_ds.checkpoint import CheckpointError
from glm53_ds.config import Glm53Config
from glm53_ds.engine.checkpoint import check_checkpoint_fits, spread
from glm53_ds.training.presets import preset
from tests.cli import QUICK, ROOT, deepspeed_run, metrics, one_error, run
from tests.dist_harness import (
    LR_CKPT,
    full_state,
    global_batch,
    load_models,
    local_rows,
    make_engine,
    run_world,
    setup_ranks,
)
from tests.model_fixtures import CONFIG_A, engine_config, read_manifest_json, restamp, save_tiny_hf

FRESH_OPTIMIZER = os.path.join(ROOT, "tests", "resume_fresh_optimizer.py")


def _ds_config_file(tmp_path, stage: int, bf16: bool = False) -> str:
    path = tmp_path / f"zero{stage}_{'bf16' if bf16 else 'fp32'}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}}))
    return str(path)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_one_rank_per_etp_rank_writes_deepspeeds_model_states_file(tmp_path):
    """World 2 at SP 2 (one replica of two SP ranks): DeepSpeed's MoE save lets both write mp_rank_00_model_states.pt,
    each being rank 0 of the mpu's data-parallel group, which leaves SP ranks out (the control: two writers of one
    file, seen as an unreadable archive); under `one_model_states_writer` the first rank of the DP group alone
    writes it, through DeepSpeed's own file name and checkpoint engine, and every other file is written by both."""
    from types import SimpleNamespace

    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.engine import DeepSpeedEngine

    from glm53_ds.engine.deepspeed_internals import one_model_states_writer
    from glm53_ds.engine.mpu import DeepSpeedMpu

    layouts = [SimpleNamespace(rank=r, etp=1, etp_rank=0, sp=2, sp_rank=r, dp_ranks=[0, 1], pure_dp_ranks=[r],
                               pure_dp_group=f"pure DP group {r}") for r in range(2)]  # fmt: skip
    assert [DeepSpeedMpu(x).get_data_parallel_rank() for x in layouts] == [0, 0]  # DeepSpeed's writers: both
    wrote = []
    for layout in layouts:
        engine = SimpleNamespace(checkpoint_mp_rank=0, checkpoint_engine=TorchCheckpointEngine(),
                                 zero_optimization_partition_weights=lambda: False)  # fmt: skip
        model_states = DeepSpeedEngine._get_ckpt_name(engine, str(tmp_path), f"rank{layout.rank}")
        engine._get_ckpt_name = lambda d, t, _e=engine: DeepSpeedEngine._get_ckpt_name(_e, d, t)
        other = os.path.join(os.path.dirname(model_states), "expp_rank_0_mp_rank_00_optim_states.pt")
        os.makedirs(os.path.dirname(model_states))
        with one_model_states_writer(engine, layout, str(tmp_path), f"rank{layout.rank}"):
            for path in (model_states, other):
                engine.checkpoint_engine.save({"x": torch.ones(1)}, path)
        wrote.append(sorted(os.listdir(os.path.dirname(model_states))))
        assert "save" not in vars(engine.checkpoint_engine)  # the engine's own save again
    assert wrote == [["expp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"],
                     ["expp_rank_0_mp_rank_00_optim_states.pt"]]  # fmt: skip


def test_optimizer_state_writing_is_spread_evenly_and_alike_on_every_rank():
    sizes = [1000, 700, 400, 300, 300, 200, 100] + [10] * 30
    owners = spread(sizes, 4)
    load = [sum(s for s, o in zip(sizes, owners, strict=True) if o == w) for w in range(4)]
    assert load[0] == 1000 and max(load[1:]) - min(load[1:]) <= 10, load  # the largest alone, the rest level
    assert spread(sizes, 4) == owners and spread(sizes, 1) == [0] * len(sizes)
    assert sorted(set(spread([5, 5], 8))) == [0, 1]  # more writers than tensors: the others write nothing


@pytest.mark.slow
def test_resume_at_other_world_sizes_ep_etp_and_zero_stages(tmp_path):
    common = ["--train-iters", "6", "--global-batch-size", "8", "--micro-batch-size", "2", "--seed", "5"]
    ckpt = tmp_path / "ckpt"
    # saved at a folded layout (EP spans the SP ranks: SP2 x EP2 x ETP2 on four ranks), resumed at unfolded ones and
    # at another folded one
    full = deepspeed_run(4, *common, "--ep", "2", "--etp", "2", "--sp", "2", "--deepspeed_config", _ds_config_file(tmp_path, 2),
                         "--save", str(ckpt), "--save-interval", "3", "--output-dir", str(tmp_path / "full"))  # fmt: skip
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]
    reference = {r["step"]: r["lm_loss"] for r in metrics(tmp_path / "full")}
    # the replicated optimizer state was written by all four ranks, in shares of the bytes
    written: dict[str, int] = {}
    for f in (ckpt / "step3" / "glm53").glob("optimizer_replicated-rank*.safetensors"):
        rank = f.name.split("-")[1]
        written[rank] = written.get(rank, 0) + f.stat().st_size
    assert len(written) == 4 and max(written.values()) < 0.5 * sum(written.values()), written
    load = ["--load", str(ckpt), "--load-tag", "step3"]
    for name, ranks, args in [
        ("world2_ep2", 2, ["--ep", "2", "--deepspeed_config", _ds_config_file(tmp_path, 2)]),
        ("world4_ep4", 4, ["--ep", "4", "--deepspeed_config", _ds_config_file(tmp_path, 2)]),
        ("world4_ep1_zero1", 4, ["--ep", "1", "--deepspeed_config", _ds_config_file(tmp_path, 1)]),
        ("world4_sp2_ep4", 4, ["--sp", "2", "--ep", "4", "--deepspeed_config", _ds_config_file(tmp_path, 2)]),
    ]:
        proc = deepspeed_run(ranks, *common, *args, *load, "--output-dir", str(tmp_path / name))
        assert proc.returncode == 0, (name, proc.stdout[-3000:] + proc.stderr[-3000:])
        resumed = metrics(tmp_path / name)
        assert [r["step"] for r in resumed] == [4, 5, 6], name
        errors = [_rel(r["lm_loss"], reference[r["step"]]) for r in resumed]
        assert max(errors) <= 1e-6, (name, errors)
    # the fp32 checkpoint continues in bf16 (ZeRO-2, world 2 EP2): masters from the fp32 weights, the fp32-kept
    # parameters under their own optimizer; bf16 tracks fp32 here (measured 1.4e-4)
    proc = deepspeed_run(2, *common, "--ep", "2", "--deepspeed_config", _ds_config_file(tmp_path, 2, bf16=True), *load,
                         "--output-dir", str(tmp_path / "bf16"))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    in_bf16 = [_rel(r["lm_loss"], reference[r["step"]]) for r in metrics(tmp_path / "bf16")]
    assert len(in_bf16) == 3 and max(in_bf16) <= 5e-3, in_bf16
    # control: fresh optimizer state at the same layout change
    proc = deepspeed_run(2, *common, "--ep", "2", "--deepspeed_config", _ds_config_file(tmp_path, 2), *load,
                         "--output-dir", str(tmp_path / "fresh"), script=FRESH_OPTIMIZER)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fresh = [_rel(r["lm_loss"], reference[r["step"]]) for r in metrics(tmp_path / "fresh")]
    assert max(fresh) > 1e-3, fresh

    # --load-model-only: the weights at step 3, fresh optimizer, step 1 on the first batch again
    proc = deepspeed_run(2, *common[:1], "1", *common[2:], "--ep", "2", "--deepspeed_config", _ds_config_file(tmp_path, 2),
                         *load, "--load-model-only", "--output-dir", str(tmp_path / "weights"))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (first,) = metrics(tmp_path / "weights")
    assert first["step"] == 1 and first["lm_loss"] < reference[1] - 0.05, (first, reference)

    # bad input, refused before any work with one message, nothing written
    before = sorted(p.relative_to(ckpt) for p in ckpt.rglob("*"))
    other = deepspeed_run(2, *common, "--ep", "2", "--no-mtp", *load, "--output-dir", str(tmp_path / "other"))
    assert other.returncode == 2, other.stderr[-3000:]
    assert "num_nextn_predict_layers: 1 in the checkpoint, 0 here" in other.stderr, other.stderr[-3000:]
    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt, damaged)
    shard = sorted((damaged / "step3" / "glm53").glob("optimizer_experts_ep001_etp000-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    proc = deepspeed_run(2, *common, "--ep", "2", "--load", str(damaged), "--load-tag", "step3",
                         "--output-dir", str(tmp_path / "damaged_run"))  # fmt: skip
    assert proc.returncode == 2 and shard.name in proc.stderr and "damaged or incomplete" in proc.stderr, (
        proc.stderr[-3000:]
    )
    for out in ("other", "damaged_run"):
        assert not (tmp_path / out / "metrics.jsonl").exists()
    assert sorted(p.relative_to(ckpt) for p in ckpt.rglob("*")) == before

    # in process: another expert count; an older checkpoint without layout-free state moves only with its layout
    cfg = preset("tiny")
    here = dict(world_size=2, ep=2, etp=1, sp=1, zero_stage=2, dtype="fp32")
    with pytest.raises(CheckpointError, match=r"n_routed_experts: \d+ in the checkpoint, 64 here"):
        check_checkpoint_fits(str(ckpt), "step3", cfg.replace(n_routed_experts=64), here)
    layout_json = damaged / "step3" / "glm53" / "layout.json"
    meta = json.loads(layout_json.read_text())
    del meta["optimizer_state"]
    layout_json.write_text(json.dumps(meta))
    restamp(damaged / "step3", "glm53/layout.json")  # an older checkpoint: whole, without that record
    with pytest.raises(
        CheckpointError, match=r"no layout-free optimizer state.*\(world_size 4 -> 2, etp 2 -> 1, sp 2 -> 1\)"
    ):
        check_checkpoint_fits(str(damaged), "step3", cfg, here)
    check_checkpoint_fits(str(damaged), "step3", cfg, here, model_only=True)  # weights only: fine
    same = dict(world_size=4, ep=2, etp=2, sp=2, zero_stage=2, dtype="fp32")
    check_checkpoint_fits(str(damaged), "step3", cfg, same)  # its own layout: DeepSpeed's partitions
    for key in ("sp", "zero_stage", "dtype"):  # older checkpoints recorded world size, EP and ETP only
        del meta[key]
    layout_json.write_text(json.dumps(meta))
    restamp(damaged / "step3", "glm53/layout.json")
    check_checkpoint_fits(str(damaged), "step3", cfg, dict(same, zero_stage=1, sp=1))  # unrecorded: unchanged
    with pytest.raises(CheckpointError, match=r"\(ep 2 -> 4\)"):
        check_checkpoint_fits(str(damaged), "step3", cfg, dict(same, ep=4))


@pytest.mark.slow
def test_bf16_masters_and_moments_survive_a_layout_change_exactly(tmp_path):
    """Saved by a bf16 ZeRO-2 engine at world 4 EP2 x ETP2 after two AdamW steps; loaded by bf16 engines at world 2
    EP2 under ZeRO-1 and under the stage-0 bf16 optimizer, which save again: every fp32 master, Adam moment, model
    tensor (bf16) and fp32-kept parameter comes out bitwise as it went in (the masters read back through
    DeepSpeed's own partitions). Under ZeRO each rank reads only its part of the replicated optimizer state."""
    from tests.dist_harness import run_world
    from tests.model_fixtures import CONFIG_A

    hf = tmp_path / "hf"
    save_tiny_hf(hf, CONFIG_A, matrix_scale=0.3)
    save_dir = str(tmp_path / "ckpt")
    run_world(4, portable_checkpoint, tmp_path / "a", ckpt=str(hf), ep=2, etp=2, phase="save", save_dir=save_dir,
              stages=[])  # fmt: skip
    loaded = run_world(2, portable_checkpoint, tmp_path / "b", ckpt=str(hf), ep=2, etp=1, phase="load",
                       save_dir=save_dir, stages=[1, 0])  # fmt: skip
    assert (
        loaded[0]["optimizer_1"] == "DeepSpeedZeroOptimizer"
        and loaded[0]["optimizer_0"] == "FP16_UnfusedOptimizer"
    )
    assert all(r["client_step_1"] == r["client_step_0"] == 2 for r in loaded)
    # ZeRO-1 over two data-parallel ranks: each reads only the rows of its half of the replicated optimizer state
    # (plus the rows a fragment boundary cuts); stage 0 holds it whole, so reads it whole (the control)
    for r in loaded:
        assert r["replicated_state_read_1"] <= 0.6 and r["replicated_state_read_0"] == 1.0, r

    before = _checkpoint_contents(os.path.join(save_dir, "a"))
    assert sum(1 for kind, k in before if k.endswith(":master")) >= 20  # bf16: masters stored
    for stage in (1, 0):
        after = _checkpoint_contents(os.path.join(f"{save_dir}_stage{stage}", "b"))
        assert after.keys() == before.keys()
        differ = [k for k in before if not torch.equal(before[k], after[k])]
        assert differ == [], (stage, differ[:5])


def checkpoint_roundtrip(
    ckpt: str, ep: int, etp: int, save_dir: str, stages: list[int]
) -> list[dict[str, Any]]:
    return [_checkpoint_roundtrip(ckpt, ep, etp, f"{save_dir}/stage{s}", s) for s in stages]


def _checkpoint_roundtrip(ckpt: str, ep: int, etp: int, save_dir: str, stage: int) -> dict[str, Any]:
    """Train one step, save, train one more; a fresh engine loads the save and repeats that step: parameters
    must match bitwise on every rank, and the expert shards must be in distinct files."""
    import os

    from glm53_ds.engine import load_checkpoint, save_checkpoint

    layout = setup_ranks(ep, etp)
    rank, world = layout.rank, layout.world_size

    def fresh_engine():  # type: ignore[no-untyped-def]
        _, model = load_models(ckpt, layout, torch.float32)
        return make_engine(model, layout, stage, torch.float32, "adamw", LR_CKPT, patch=True)

    def step(engine, seed):  # type: ignore[no-untyped-def]
        x = local_rows(global_batch(engine.module.glm.vocab_size, world, seed=seed)[0], rank)
        engine.backward(engine(x, labels=x))
        engine.step()

    engine = fresh_engine()
    step(engine, 1)
    saved = full_state(engine.module)
    save_checkpoint(engine, save_dir, "step1", client_state={"step": 1})
    step(engine, 2)
    continued = full_state(engine.module)

    resumed = fresh_engine()
    client = load_checkpoint(resumed, save_dir)
    restored_equal = all(torch.equal(v, saved[k]) for k, v in full_state(resumed.module).items())
    step(resumed, 2)
    after = full_state(resumed.module)
    files = sorted(os.listdir(os.path.join(save_dir, "step1", "glm53")))
    # Control: DeepSpeed's own model file is one per ETP rank, written by one EP rank: it cannot hold the
    # experts of the other EP ranks sharing that ETP rank.
    ds_file = os.path.join(save_dir, "step1", f"mp_rank_{layout.etp_rank:02d}_model_states.pt")
    ds_state = torch.load(ds_file, map_location="cpu", weights_only=False)["module"]
    ds_complete = all(k in ds_state and torch.equal(ds_state[k].float(), v.float()) for k, v in saved.items())
    return dict(
        ep_rank=layout.ep_rank,
        deepspeed_model_file_complete=ds_complete,
        restored_equal=restored_equal,
        resumed_equal=all(torch.equal(v, continued[k]) for k, v in after.items()),
        client_step=client.get("step"),
        expert_files=[f for f in files if f.startswith("experts_") and f.endswith(".index.json")],
    )


def portable_checkpoint(ckpt: str, ep: int, etp: int, phase: str, save_dir: str, stages: list[int]) -> dict:
    """bf16 engines. phase "save": two AdamW steps, then a checkpoint (tag "a"). phase "load": for each ZeRO stage
    in `stages`, a fresh engine at this layout loads tag "a" (another layout: the layout-free path) and saves it
    again as tag "b_stage<S>" in its own directory, so the test can compare what went in with what came out.
    Loading counts the bytes of replicated optimizer state this rank reads (`replicated_state_read_<S>`, a
    fraction of the stored whole)."""
    import math
    import os

    from glm53_ds.checkpoint import ShardReader
    from glm53_ds.checkpoint.safetensors_file import SafetensorsSet
    from glm53_ds.engine import load_checkpoint, save_checkpoint
    from glm53_ds.parallel.expert_shard import expert_tensor_kind

    layout = setup_ranks(ep, etp)
    out: dict[str, Any] = {}
    read_bytes = [0]
    real_read = SafetensorsSet.read

    def counting_read(self, name, index=()):  # type: ignore[no-untyped-def]
        t = real_read(self, name, index)
        if ":" in name and expert_tensor_kind(name.split(":")[0]) is None:  # replicated optimizer state
            read_bytes[0] += t.numel() * t.element_size()
        return t

    SafetensorsSet.read = counting_read  # type: ignore[method-assign]
    for stage in stages if phase == "load" else [2]:
        _, model = load_models(
            ckpt, layout, torch.float32
        )  # fp32 weights in; the engine keeps bf16 + fp32 masters
        engine = make_engine(
            model.to(torch.bfloat16), layout, stage, torch.bfloat16, "adamw", LR_CKPT, True, clip=1.0
        )
        out[f"optimizer_{stage}"] = type(engine.optimizer).__name__
        if phase == "save":
            for seed in range(2):
                x = local_rows(global_batch(96, layout.world_size, seed=seed)[0], layout.rank)
                engine.backward(engine(x, labels=x))
                engine.step()
            save_checkpoint(engine, save_dir, "a", client_state={"step": 2})
        else:
            read_bytes[0] = 0
            client = load_checkpoint(engine, save_dir, "a")
            stored = ShardReader(os.path.join(save_dir, "a", "glm53"), "optimizer_replicated")
            whole = sum(4 * math.prod(stored.shape(k)) for k in stored.keys())  # fp32 masters and moments
            out[f"replicated_state_read_{stage}"] = read_bytes[0] / whole
            out[f"client_step_{stage}"] = client.get("step")
            save_checkpoint(engine, f"{save_dir}_stage{stage}", "b", client_state=client)
    return out


@pytest.mark.slow
def test_checkpoint_save_load_ep2_etp2(tmp_path, checkpoints):
    """Save after one AdamW step, resume in a fresh engine: bitwise the same parameters, and the next step
    bitwise the same as the uninterrupted run, on every rank (stage 0 and ZeRO-2). Expert shards never share a
    file; DeepSpeed's own model file alone would not restore them (control)."""
    _, calm = checkpoints
    results = run_world(4, checkpoint_roundtrip, tmp_path / "out", ckpt=calm, ep=2, etp=2,
                        save_dir=str(tmp_path / "ckpt"), stages=[0, 2])  # fmt: skip
    for rank_results in results:
        for r in rank_results:
            assert r["restored_equal"] and r["resumed_equal"], r
            assert r["client_step"] == 1
            assert r["expert_files"] == [
                f"experts_ep{e:03d}_etp{t:03d}.index.json" for e in range(2) for t in range(2)
            ]
            # DeepSpeed's model file of this ETP rank was written by EP rank 0: complete only there
            assert r["deepspeed_model_file_complete"] == (r["ep_rank"] == 0), r


class _Marker:
    """Unpickling this runs `open(path, 'w')`: what a malicious checkpoint would do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.path, "w"))


@pytest.mark.slow
def test_a_pickle_in_a_checkpoint_is_refused_and_never_runs(tmp_path):
    """Before: DeepSpeed read mp_rank_00_model_states.pt with weights_only=False and ran the object (rc 0)."""
    ck = tmp_path / "ck"
    assert run(*QUICK, "--save", str(ck), "--output-dir", str(tmp_path / "a")).returncode == 0
    tag = ck / "step2"
    marker = tmp_path / "marker"
    state = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=True)
    state["payload"] = _Marker(str(marker))
    torch.save(
        state, tag / "mp_rank_00_model_states.pt"
    )  # the object's __reduce__ runs open() when unpickled
    # 1. the manifest no longer matches: refused before anything is read
    error = one_error(
        run(*QUICK, "--train-iters", "3", "--load", str(ck), "--output-dir", str(tmp_path / "b"))
    )
    assert "is damaged or incomplete: mp_rank_00_model_states.pt has" in error  # its size differs
    # 2. the manifest rewritten too (an attacker who knows the format): weights_only refuses the object
    safe_io.write_manifest(
        str(tag),
        read_manifest_json(tag)["files"] | safe_io.describe_files(str(tag), ["mp_rank_00_model_states.pt"]),
    )
    error = one_error(
        run(*QUICK, "--train-iters", "3", "--load", str(ck), "--output-dir", str(tmp_path / "c"))
    )
    assert "refused to load a checkpoint file holding pickled objects" in error
    assert not marker.exists()
    torch.load(
        tag / "mp_rank_00_model_states.pt", weights_only=False
    )  # control: what DeepSpeed's own load did
    assert marker.exists()


def test_a_model_holding_nan_is_never_saved(tmp_path):
    """Before: save_checkpoint wrote NaN weights and moved `latest` to them; now it refuses before writing."""
    from glm53_ds.checkpoint import CheckpointError
    from glm53_ds.engine import save_checkpoint

    model = glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A), mtp=False)
    engine = glm53_ds.build_engine(model, engine_config(0, False, 1.0))
    save_checkpoint(engine, str(tmp_path), "step1")
    with torch.no_grad():
        engine.module.embedding.weight[3, 1] = float("inf")
    with pytest.raises(CheckpointError, match=r"refusing to save .*step2: embedding.weight \(rank 0\)"):
        save_checkpoint(engine, str(tmp_path), "step2")
    assert sorted(os.listdir(tmp_path)) == ["latest", "step1"]
    assert (tmp_path / "latest").read_text() == "step1"


def test_the_users_no_weights_only_switch_does_not_break_checkpoint_loads(tmp_path, monkeypatch):
    """Before: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 in the environment made every same-layout resume crash (torch
    refuses both switches at once). Now checkpoint loads lift it meanwhile, still refuse pickled objects, and put
    it back."""
    from glm53_ds.engine.deepspeed_internals import weights_only_loads

    path = tmp_path / "state.pt"
    torch.save({"step": 3, "t": torch.ones(2)}, path)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(RuntimeError, match="Only one of"):  # the control: what DeepSpeed's load met
        torch.load(path, weights_only=False)
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    with weights_only_loads():
        assert torch.load(path, weights_only=False)["step"] == 3
    torch.save({"bad": _Opens(str(tmp_path / "marker"))}, tmp_path / "bad.pt")
    with (
        pytest.raises(ValueError, match="refused to load a checkpoint file holding pickled objects"),
        weights_only_loads(),
    ):
        torch.load(tmp_path / "bad.pt", weights_only=False)
    assert not (tmp_path / "marker").exists()
    assert (
        os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1"
        and "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ
    )


class _Opens:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.path, "w"))


def _checkpoint_contents(tag_dir: str) -> dict:
    """Every stored tensor of a checkpoint as a single-process model holds it (read through placements at
    EP = ETP = 1): the model's and the layout-free optimizer state's, keyed by (kind, name)."""
    from glm53_ds.checkpoint import OPTIMIZER, CheckpointDir, placement
    from glm53_ds.parallel.expert_shard import ExpertShard

    ckpt = CheckpointDir(tag_dir)
    whole = ExpertShard.for_config(ckpt.model_config)
    out = {}
    for prefix, kind in (("", "model"), (OPTIMIZER, "optimizer")):
        for key in ckpt.keys(prefix):
            name = key.split(":")[0]
            target = placement(name, ckpt.stored_shape(name, key, prefix), whole)
            out[(kind, key)] = ckpt.read(target, key, prefix=prefix)
    return out


def offload_checkpoints(ckpt: str, ep: int, phase: str, save_dir: str) -> dict:
    """bf16 ZeRO-1 engines at EP `ep`. phase "same": an offloaded engine (O) takes two AdamW steps and saves tag
    "o"; a device engine (D) loads it and saves it again as "d"; an offloaded engine (O2) loads "d". Every rank
    reports whether D's and O2's optimizer state (fp32 masters, moments, through `ParamOptimizerState`) and weights
    equal O's bitwise, then O, D and O2 take step 3: O2 against O bitwise, D against O as the largest difference.
    phase "other" (another layout): an offloaded engine loads "o" (the layout-free path) and saves it as "p"."""
    from glm53_ds.engine import load_checkpoint, save_checkpoint
    from glm53_ds.engine.checkpoint import _trained

    layout = setup_ranks(ep, 1)

    def engine(offload: bool):  # type: ignore[no-untyped-def]
        _, model = load_models(ckpt, layout, torch.float32)
        return make_engine(model.to(torch.bfloat16), layout, 1, torch.bfloat16, "adamw", LR_CKPT, True, clip=1.0,
                           offload=offload)  # fmt: skip

    def step(e, seed: int) -> None:  # type: ignore[no-untyped-def]
        x = local_rows(global_batch(96, layout.world_size, seed=seed)[0], layout.rank)
        e.backward(e(x, labels=x))
        e.step()

    def state(e) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
        out = {}
        for name, tensor, access in _trained(e):  # collective under ZeRO: every rank, same order
            for key, value in access.get(tensor).items():
                out[f"{name}:{key}"] = value.clone()
        return out | full_state(e.module)

    def equal(a: dict, b: dict) -> list[str]:
        return [k for k in a if not torch.equal(a[k], b[k])]

    if phase == "other":
        e = engine(True)
        client = load_checkpoint(e, save_dir, "o")
        save_checkpoint(e, save_dir + "_other", "p", client_state=client)
        step(e, 2)  # DeepSpeedCPUAdam steps on from the state the layout-free load gave it (a tensor step)
        steps = {float(st["step"]) for st in e.optimizer.optimizer.state.values()}
        return {"optimizer": type(e.optimizer.optimizer).__name__, "steps": sorted(steps)}
    o = engine(True)
    for seed in range(2):
        step(o, seed)
    save_checkpoint(o, save_dir, "o", client_state={"step": 2})
    saved = state(o)
    d = engine(False)
    load_checkpoint(d, save_dir, "o")
    out: dict[str, Any] = {"device_differs": equal(saved, state(d)), "host": type(o.optimizer.optimizer).__name__,
                           "device": type(d.optimizer.optimizer).__name__}  # fmt: skip
    save_checkpoint(d, save_dir, "d", client_state={"step": 2})
    o2 = engine(True)
    load_checkpoint(o2, save_dir, "d")
    out["host_again_differs"] = equal(saved, state(o2))
    for e in (o, d, o2):
        step(e, 2)
    after_o, after_d, after_o2 = full_state(o.module), full_state(d.module), full_state(o2.module)
    out["step3_host_again_differs"] = equal(after_o, after_o2)
    out["step3_device_vs_host"] = max(
        (after_o[k].float() - after_d[k].float()).abs().max().item() for k in after_o
    )
    out["steps"] = [
        sorted({float(st["step"]) for st in e.optimizer.optimizer.state.values()}) for e in (o, d, o2)
    ]
    out["step3_moved"] = max((after_o[k].float() - saved[k].float()).abs().max().item() for k in after_o)
    return out


@pytest.mark.slow
def test_an_offloaded_runs_checkpoint_resumes_with_offload_on_or_off_and_at_another_layout(
    tmp_path, checkpoints
):
    """#61: ZeRO-Offload keeps the checkpoint format. bf16 ZeRO-1 at world 2 EP2: a checkpoint saved with the
    optimizer on the host loads on the device and back, the masters, moments and weights bitwise each way (read
    through `ParamOptimizerState`), and the stored tensors of a resave bitwise the saved ones; the step after it
    bitwise the uninterrupted offloaded run's (host again), within lr/20 per element of it on the device (torch's
    AdamW against DeepSpeedCPUAdam: the rounding of one update; measured 0 and 1.9e-6 on the two ranks, where a
    bf16 weight moves by 3.9e-3). The Adam step count comes through each way (3 after step 3). At another layout (world 2 EP1, the layout-free
    path) the offloaded engine takes the same state in and writes it out bitwise."""
    _, calm = checkpoints
    save_dir = str(tmp_path / "ckpt")
    same = run_world(2, offload_checkpoints, tmp_path / "a", ckpt=calm, ep=2, phase="same", save_dir=save_dir)
    for r in same:
        assert (r["host"], r["device"]) == ("DeepSpeedCPUAdam", "AdamW"), r
        assert r["device_differs"] == [] and r["host_again_differs"] == [], r
        assert r["step3_host_again_differs"] == [] and r["steps"] == [[3.0]] * 3, r
        assert r["step3_device_vs_host"] <= LR_CKPT / 20 and r["step3_moved"] > LR_CKPT / 2, r
    other = run_world(
        2, offload_checkpoints, tmp_path / "b", ckpt=calm, ep=1, phase="other", save_dir=save_dir
    )
    assert all(r["optimizer"] == "DeepSpeedCPUAdam" and r["steps"] == [3.0] for r in other), other
    before = _checkpoint_contents(os.path.join(save_dir, "o"))
    assert sum(1 for kind, k in before if k.endswith(":master")) >= 20  # bf16: masters stored
    for tag_dir in (os.path.join(save_dir, "d"), os.path.join(save_dir + "_other", "p")):
        after = _checkpoint_contents(tag_dir)
        assert after.keys() == before.keys()
        assert [k for k in before if not torch.equal(before[k], after[k])] == [], tag_dir
