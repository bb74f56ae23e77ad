"""Nothing lost, second pass (issue 24): a non-finite update is never applied nor saved, a fresh run never replaces
another run's checkpoints, one writer per --save, every checkpoint reader checks the manifest, data caches and resume
identity follow content, no-target chat data is refused, the chunked head refuses bad labels, index names stay in
their directory, bounded safetensors headers, re-saving over a linked tag, the user's weights-only switch. Each test
says what the old code did (the control it would have failed), and most run that control."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
import torch

import glm53_ds
from glm53_ds import safe_io
from glm53_ds.config import Glm53Config
from glm53_ds.engine import NonFiniteGradientError
from tests.model_fixtures import CONFIG_A
from tests.test_nothing_lost import QUICK, one_error, run
from tests.test_train import ROOT, TRAIN, deepspeed_run, metrics


# ----------------------------------------------------------------------------- 1. non-finite updates
def _ds_config(stage: int, bf16: bool, clip: float) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": clip,
            "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9}  # fmt: skip


POISON = "decoder.layers.0.self_attention.q_proj.weight"


def _poisoned_step(engine, poison: str) -> None:
    """One forward + backward + step whose loss is finite but whose gradient holds a NaN (in `poison`)."""
    handle = dict(engine.module.named_parameters())[poison].register_hook(lambda g: g * float("nan"))
    ids = torch.randint(1, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = engine(ids, labels=ids)
    assert torch.isfinite(loss)
    engine.backward(loss)
    try:
        engine.step()
    finally:
        handle.remove()


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items() if t is not None}


@pytest.mark.parametrize(
    "stage, bf16, clip",
    [(0, False, 1.0), (0, False, 0.0), (0, True, 1.0), (1, False, 1.0), (1, True, 1.0), (2, True, 1.0),
     (2, True, 0.0), (2, False, 1.0)],
)  # fmt: skip
def test_a_nan_gradient_changes_no_weight_at_any_stage(stage, bf16, clip):
    """Before: stage 0 fp32 (the CPU default) and ZeRO bf16 (the GPU default) applied the NaN update; now every
    optimizer path raises NonFiniteGradientError at the step and no tensor of the model changes (bitwise)."""
    torch.manual_seed(0)
    model = glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A), mtp=False)
    engine = glm53_ds.build_engine(model, _ds_config(stage, bf16, clip))
    before = _weights(engine.module)
    with pytest.raises(NonFiniteGradientError, match="global gradient norm is"):
        _poisoned_step(engine, POISON)
    after = _weights(engine.module)
    assert [n for n in before if not torch.equal(before[n], after[n])] == []


@pytest.mark.parametrize("stage, bf16, clip", [(0, False, 1.0), (0, False, 0.0), (2, True, 1.0)])
def test_control_without_the_guards(stage, bf16, clip, monkeypatch):
    """The control, the old code (guards taken out): stage 0 fp32 writes NaN into the weights; ZeRO-2 bf16 skips the
    update itself but `step()` returns as if it had been taken, so the trainer went on (and counted the step)."""
    from glm53_ds.engine import build, deepspeed_internals

    monkeypatch.setattr(deepspeed_internals, "_refuse_non_finite", lambda norm: None)
    monkeypatch.setattr(build, "install_step_guard", lambda engine: None)
    torch.manual_seed(0)
    model = glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A), mtp=False)
    engine = glm53_ds.build_engine(model, _ds_config(stage, bf16, clip))
    _poisoned_step(engine, POISON)  # no error
    finite = torch.isfinite(dict(engine.module.named_parameters())[POISON]).all()
    assert (not finite) if stage == 0 else (finite and not engine.was_step_applied())


def test_a_model_holding_nan_is_never_saved(tmp_path):
    """Before: save_checkpoint wrote NaN weights and moved `latest` to them; now it refuses before writing."""
    from glm53_ds.engine import save_checkpoint
    from glm53_ds.engine.checkpoint import CheckpointError

    model = glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A), mtp=False)
    engine = glm53_ds.build_engine(model, _ds_config(0, False, 1.0))
    save_checkpoint(engine, str(tmp_path), "step1")
    with torch.no_grad():
        engine.module.embedding.weight[3, 1] = float("inf")
    with pytest.raises(CheckpointError, match=r"refusing to save .*step2: embedding.weight \(rank 0\)"):
        save_checkpoint(engine, str(tmp_path), "step2")
    assert sorted(os.listdir(tmp_path)) == ["latest", "step1"]
    assert (tmp_path / "latest").read_text() == "step1"


@pytest.mark.slow
def test_a_huge_learning_rate_stops_at_the_last_good_checkpoint(tmp_path):
    """The issue's run: --lr 1e9 --save-interval 1. Before: step 2's NaN update was applied, saved as step2 (83 NaN
    tensors), `latest` moved there and the stop named it. Now the step-2 update is refused, step1 stays latest, the
    stop names it, and step1 is whole and finite."""
    ck = tmp_path / "ck"
    proc = run(*QUICK[2:], "--train-iters", "4", "--lr", "1e9", "--save", str(ck), "--save-interval", "1",
               "--output-dir", str(tmp_path / "a"))  # fmt: skip
    assert proc.returncode == 3, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "gradient norm is nan at step 2" in errors[0], proc.stderr[-2000:]
    assert f"The last checkpoint this run saved is {ck / 'step1'}" in errors[0]
    assert (ck / "latest").read_text() == "step1" and not (ck / "step2").exists()
    from glm53_ds.convert.export_hf import load_native

    model = load_native(str(ck))  # step1: whole, verified, and finite
    assert all(torch.isfinite(p).all() for p in model.parameters())
