"""`--offload-activations` (layers/activation_offload.py): full recompute's kept layer inputs go to host memory and
come back in backward; the losses and gradients are bitwise those without it, LoRA included; the planner sees the
device memory it frees (tests/plan/test_activations.py)."""

from __future__ import annotations

import pytest
import torch

import glm53_ds
from glm53_ds.config import Glm53Config
from glm53_ds.layers.activation_offload import ActivationOffload
from glm53_ds.layers.lora import LoraSpec
from glm53_ds.layers.lora_targets import apply_lora
from tests.model_fixtures import CONFIG_A, training_step

CFG = Glm53Config.from_text_dict(CONFIG_A)
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _step(offload: bool, lora: bool = False, broken: bool = False, monkeypatch=None):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = glm53_ds.build_model(CFG, mtp=True, offload_activations=offload, **FULL)
    if lora:
        apply_lora(
            model, LoraSpec(rank=4, alpha=8.0, targets=("mla", "kda", "mlp", "shared_expert", "experts"))
        )
        for name, p in model.named_parameters():
            p.requires_grad_("lora" in name)
    if offload:
        model.activation_offload.min_bytes = 1  # the tiny model's layer inputs are a few KiB
    if broken:  # the control: a restore that does not bring the values back
        monkeypatch.setattr(
            ActivationOffload,
            "_to_device",
            staticmethod(lambda entry: torch.zeros(entry.shape, dtype=entry.dtype)),
        )
    return training_step(model)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_offloaded_run_is_bitwise_the_same(lora, monkeypatch):
    _, ref_loss, ref_grads = _step(False, lora)
    model, loss, grads = _step(True, lora)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[k], ref_grads[k]) for k in grads)
    # every decoder layer's inputs went through the host: the first layer's the embedding [s, b, D], the others'
    # the packed streams [s * n, b, D] (fp32)
    offload = model.activation_offload
    embedding, streams = 20 * 2 * CFG.hidden_size * 4, 20 * CFG.hc_mult * 2 * CFG.hidden_size * 4
    assert len(offload.entries) >= CFG.num_hidden_layers
    assert offload.offloaded_bytes >= embedding + (CFG.num_hidden_layers - 1) * streams
    assert all(entry is None for entry in offload.entries)  # each came back once and was released
    # the next step's host copies reuse this step's buffers (pinned memory is slow to allocate on CUDA)
    first = {id(e.host) for e in offload._returning}
    ids = torch.randint(1, CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    model(ids, labels=ids)
    second = {id(e.host) for e in offload.entries if e is not None}
    assert second and second <= first
    # control: a restore that loses the values changes the gradients
    _, _, broken = _step(True, lora, broken=True, monkeypatch=monkeypatch)
    assert any(not torch.equal(broken[k], ref_grads[k]) for k in ref_grads)


def test_offload_needs_full_recompute():
    with pytest.raises(ValueError, match="offload_activations with recompute_granularity=None"):
        glm53_ds.build_model(CFG, offload_activations=True)
    from glm53_ds.training.config import SetupError
    from tests.cli import train_config

    with pytest.raises(
        SetupError, match="--offload-activations with --recompute selective: .* add --recompute full"
    ):
        train_config("--recompute", "selective", "--offload-activations")
    assert train_config("--recompute", "full", "--offload-activations").offload_activations
