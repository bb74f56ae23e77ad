"""Resume at another cluster layout (#19): a training checkpoint saved at world 4, EP2 x ETP2, ZeRO-2 (fp32) at
step 3 of 6 continues at world 2 EP2, world 4 EP4, world 4 EP1 under ZeRO-1 and world 4 SP2 x EP2, through the
layout-free optimizer state (engine/checkpoint.py); the same global batch (8 rows) at every layout.

Tolerance: steps 4..6's LM loss within 1e-6 relative of the uninterrupted run. The resumed state is exact (the bf16
test below checks the masters and moments bitwise); what differs is the reduction order of the new layout, which
moves fp32 losses by ~1e-7 per step. Control: the same resume with fresh optimizer state (step, data and weights
kept) is off by far more (measured in the assertion message).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from glm53_ds.checkpoint import CheckpointError
from glm53_ds.engine.checkpoint import check_checkpoint_fits, spread
from glm53_ds.training.presets import preset
from tests.test_train import ROOT, deepspeed_run, metrics

FRESH_OPTIMIZER = os.path.join(ROOT, "tests", "resume_fresh_optimizer.py")


def _ds_config(tmp_path, stage: int, bf16: bool = False) -> str:
    path = tmp_path / f"zero{stage}_{'bf16' if bf16 else 'fp32'}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}}))
    return str(path)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


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
    full = deepspeed_run(4, *common, "--ep", "2", "--etp", "2", "--deepspeed_config", _ds_config(tmp_path, 2),
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
        ("world2_ep2", 2, ["--ep", "2", "--deepspeed_config", _ds_config(tmp_path, 2)]),
        ("world4_ep4", 4, ["--ep", "4", "--deepspeed_config", _ds_config(tmp_path, 2)]),
        ("world4_ep1_zero1", 4, ["--ep", "1", "--deepspeed_config", _ds_config(tmp_path, 1)]),
        ("world4_sp2_ep2", 4, ["--sp", "2", "--ep", "2", "--deepspeed_config", _ds_config(tmp_path, 2)]),
    ]:
        proc = deepspeed_run(ranks, *common, *args, *load, "--output-dir", str(tmp_path / name))
        assert proc.returncode == 0, (name, proc.stdout[-3000:] + proc.stderr[-3000:])
        resumed = metrics(tmp_path / name)
        assert [r["step"] for r in resumed] == [4, 5, 6], name
        errors = [_rel(r["lm_loss"], reference[r["step"]]) for r in resumed]
        assert max(errors) <= 1e-6, (name, errors)
    # the fp32 checkpoint continues in bf16 (ZeRO-2, world 2 EP2): masters from the fp32 weights, the fp32-kept
    # parameters under their own optimizer; bf16 tracks fp32 here (measured 1.4e-4)
    proc = deepspeed_run(2, *common, "--ep", "2", "--deepspeed_config", _ds_config(tmp_path, 2, bf16=True), *load,
                         "--output-dir", str(tmp_path / "bf16"))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    in_bf16 = [_rel(r["lm_loss"], reference[r["step"]]) for r in metrics(tmp_path / "bf16")]
    assert len(in_bf16) == 3 and max(in_bf16) <= 5e-3, in_bf16
    # control: fresh optimizer state at the same layout change
    proc = deepspeed_run(2, *common, "--ep", "2", "--deepspeed_config", _ds_config(tmp_path, 2), *load,
                         "--output-dir", str(tmp_path / "fresh"), script=FRESH_OPTIMIZER)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fresh = [_rel(r["lm_loss"], reference[r["step"]]) for r in metrics(tmp_path / "fresh")]
    assert max(fresh) > 1e-3, fresh

    # --load-model-only: the weights at step 3, fresh optimizer, step 1 on the first batch again
    proc = deepspeed_run(2, *common[:1], "1", *common[2:], "--ep", "2", "--deepspeed_config", _ds_config(tmp_path, 2),
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
    with pytest.raises(
        CheckpointError, match=r"no layout-free optimizer state.*\(world_size 4 -> 2, etp 2 -> 1\)"
    ):
        check_checkpoint_fits(str(damaged), "step3", cfg, here)
    check_checkpoint_fits(str(damaged), "step3", cfg, here, model_only=True)  # weights only: fine
    same = dict(world_size=4, ep=2, etp=2, sp=1, zero_stage=2, dtype="fp32")
    check_checkpoint_fits(str(damaged), "step3", cfg, same)  # its own layout: DeepSpeed's partitions
    for key in ("sp", "zero_stage", "dtype"):  # older checkpoints recorded world size, EP and ETP only
        del meta[key]
    layout_json.write_text(json.dumps(meta))
    check_checkpoint_fits(str(damaged), "step3", cfg, dict(same, zero_stage=1, sp=2))  # unrecorded: unchanged
    with pytest.raises(CheckpointError, match=r"\(ep 2 -> 4\)"):
        check_checkpoint_fits(str(damaged), "step3", cfg, dict(same, ep=4))


@pytest.mark.slow
def test_bf16_masters_and_moments_survive_a_layout_change_exactly(tmp_path):
    """Saved by a bf16 ZeRO-2 engine at world 4 EP2 x ETP2 after two AdamW steps; loaded by bf16 engines at world 2
    EP2 under ZeRO-1 and under the stage-0 bf16 optimizer, which save again: every fp32 master, Adam moment, model
    tensor (bf16) and fp32-kept parameter comes out bitwise as it went in (the masters read back through
    DeepSpeed's own partitions). Under ZeRO each rank reads only its part of the replicated optimizer state."""
    from glm53_ds.checkpoint import OPTIMIZER, CheckpointDir, placement
    from glm53_ds.parallel.expert_shard import ExpertShard
    from tests.dist_harness import run_world
    from tests.model_fixtures import CONFIG_A, save_tiny_hf

    hf = tmp_path / "hf"
    save_tiny_hf(hf, CONFIG_A, matrix_scale=0.3)
    save_dir = str(tmp_path / "ckpt")
    run_world(4, "portable_checkpoint", tmp_path / "a", ckpt=str(hf), ep=2, etp=2, phase="save", save_dir=save_dir,
              stages=[])  # fmt: skip
    loaded = run_world(2, "portable_checkpoint", tmp_path / "b", ckpt=str(hf), ep=2, etp=1, phase="load",
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

    def contents(tag_dir: str) -> dict:
        """Every stored tensor as a single-process model holds it (read through placements at EP = ETP = 1)."""
        ckpt = CheckpointDir(tag_dir)
        whole = ExpertShard.for_config(ckpt.model_config)
        out = {}
        for prefix, kind in (("", "model"), (OPTIMIZER, "optimizer")):
            for key in ckpt.keys(prefix):
                name = key.split(":")[0]
                target = placement(name, ckpt.stored_shape(name, key, prefix), whole)
                out[(kind, key)] = ckpt.read(target, key, prefix=prefix)
        return out

    before = contents(os.path.join(save_dir, "a"))
    assert sum(1 for kind, k in before if k.endswith(":master")) >= 20  # bf16: masters stored
    for stage in (1, 0):
        after = contents(os.path.join(f"{save_dir}_stage{stage}", "b"))
        assert after.keys() == before.keys()
        differ = [k for k in before if not torch.equal(before[k], after[k])]
        assert differ == [], (stage, differ[:5])
