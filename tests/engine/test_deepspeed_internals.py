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
