"""The patches of DeepSpeed internals (engine/deepspeed_internals.py): a non-finite gradient changes no weight at any
ZeRO stage, dtype and clipping (with the control: the same step without the guards)."""

from __future__ import annotations

import pytest
import torch

import glm53_ds
from glm53_ds.config import Glm53Config
from glm53_ds.engine import NonFiniteGradientError
from tests.model_fixtures import CONFIG_A, engine_config

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
    engine = glm53_ds.build_engine(model, engine_config(stage, bf16, clip))
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
    engine = glm53_ds.build_engine(model, engine_config(stage, bf16, clip))
    _poisoned_step(engine, POISON)  # no error
    finite = torch.isfinite(dict(engine.module.named_parameters())[POISON]).all()
    assert (not finite) if stage == 0 else (finite and not engine.was_step_applied())


# ----------------------------------------------------------------------------- a skipped update
def _step(engine, seed: int, targets: bool = True, skip: bool = False) -> None:
    ids = torch.randint(1, 96, (2, 12), generator=torch.Generator().manual_seed(seed))
    loss = engine(ids, labels=ids if targets else torch.full_like(ids, -100))
    engine.backward(loss)
    if skip:
        engine.skip_next_update()
    engine.step()


def _trained(stage, bf16, clip, zero_target_step: str | None) -> dict[str, torch.Tensor]:
    """Two real steps, with a step over a batch without targets between them (skipped, applied) or without it."""
    torch.manual_seed(0)
    model = glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A), mtp=False)
    engine = glm53_ds.build_engine(model, engine_config(stage, bf16, clip))
    _step(engine, 1)
    if zero_target_step is not None:
        _step(engine, 2, targets=False, skip=zero_target_step == "skipped")
    _step(engine, 3)
    weights = _weights(engine.module)
    if engine.fp32_params is not None:
        weights.update({f"fp32:{n}": t.detach().clone() for n, t in engine.fp32_params.named})
    return weights


@pytest.mark.parametrize(
    "stage, bf16, clip",
    [(0, False, 1.0), (0, False, 0.0), (0, True, 1.0), (1, True, 1.0), (2, True, 1.0), (2, False, 1.0)],
)  # fmt: skip
def test_a_skipped_update_is_as_if_the_step_never_happened(stage, bf16, clip):
    """Before: a global batch without target tokens still applied weight decay and moved Adam's moments (75 of 132
    tensors changed). `skip_next_update` takes each optimizer's own skip path: two steps around a skipped one equal
    the two steps alone, bitwise (weights, fp32-kept parameters; the next update shows Adam's state untouched).
    Control: the same step applied moves them."""
    alone = _trained(stage, bf16, clip, None)
    skipped = _trained(stage, bf16, clip, "skipped")
    assert [n for n in alone if not torch.equal(alone[n], skipped[n])] == []
    applied = _trained(stage, bf16, clip, "applied")
    assert sum(not torch.equal(alone[n], applied[n]) for n in alone) > len(alone) // 3
