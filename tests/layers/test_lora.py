"""LoRA adapters (layers/lora.py, layers/lora_targets.py) against an independent reference: the base model whose
weights are replaced by W' = W + (alpha / r) B A, computed here.

Tolerances (fp32, CONFIG_A: KDA, MLA with both indexer kinds, dense MLP, MoE with a shared expert, MTP): logits
max relative error <= 1e-5; adapter gradients, from the reference's dW' (dA = s B^T dW', dB = s dW' A^T), max
relative error per tensor <= 1e-4. A fresh adapter (B = 0) gives the base model's logits bitwise. Controls: the
same model with the experts left out of the targets misses the reference (the comparison bites), and a second
apply_lora is refused.
"""

from __future__ import annotations

import re

import pytest
import torch

import glm53_ds
from glm53_ds.config import Glm53Config
from glm53_ds.layers.lora import GroupedLora, LoraAdapter, LoraSpec, merged_weight
from glm53_ds.layers.lora_targets import apply_lora
from glm53_ds.parallel.expert_shard import DOWN, ExpertShard
from tests.model_fixtures import CONFIG_A, perturb_, rel_err

CFG = Glm53Config.from_text_dict(CONFIG_A)
SCALE = 2.0  # alpha / r
IDS = torch.randint(1, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))


def _base(moe_impl: str = "auto") -> torch.nn.Module:
    torch.manual_seed(0)
    model = glm53_ds.build_model(CFG, moe_impl=moe_impl)
    perturb_(model, seed=1)
    return model


def _with_adapters(rank: int, moe_impl: str = "auto", targets=None) -> torch.nn.Module:
    model = _base(moe_impl)
    spec = LoraSpec(rank=rank, alpha=SCALE * rank, **({"targets": targets} if targets else {}))
    apply_lora(model, spec)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # B away from zero, so that the adapters matter
        for name, p in model.named_parameters():
            if ".lora." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora." in name)  # the base frozen, as a LoRA run has it
    return model


def _reference(lora_model: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The base model with W' = W + s B A in every adapted tensor (as leaves needing gradients): (model, W')."""
    ref = _base()
    merged: dict[str, torch.Tensor] = {}
    params = dict(ref.named_parameters())
    lora_params = dict(lora_model.named_parameters())
    for name in [n for n in lora_params if n.endswith(".lora.A")]:
        owner = name.removesuffix(".lora.A")
        a, b = lora_params[name].detach(), lora_params[f"{owner}.lora.B"].detach()
        merged[f"{owner}.weight"] = params[f"{owner}.weight"].detach() + SCALE * b @ a
    for name in [n for n in lora_params if n.endswith(".lora.gate_up_A")]:
        owner = name.removesuffix(".lora.gate_up_A")
        for kind, a_name, b_name in (
            ("gate_up_proj", "gate_up_A", "gate_up_B"),
            ("down_proj", "down_A", "down_B"),
        ):
            a, b = (
                lora_params[f"{owner}.lora.{a_name}"].detach(),
                lora_params[f"{owner}.lora.{b_name}"].detach(),
            )
            merged[f"{owner}.{kind}"] = params[f"{owner}.{kind}"].detach() + SCALE * torch.bmm(b, a)
    for name, value in merged.items():
        module_name, attr = name.rsplit(".", 1)
        module = ref.get_submodule(module_name)
        delattr(module, attr)
        setattr(module, attr, torch.nn.Parameter(value.clone()))
    return ref, {n: ref.get_parameter(n) for n in merged}


def _loss(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, loss: LM + MTP) of the same tokens."""
    return model(IDS), model(IDS, labels=IDS)


@pytest.mark.parametrize("rank, moe_impl", [(4, "grouped"), (3, "loop")])
def test_forward_and_adapter_gradients_match_the_merged_weights(rank, moe_impl):
    model = _with_adapters(rank, moe_impl)
    ref, merged = _reference(model)
    logits, loss = _loss(model)
    ref_logits, ref_loss = _loss(ref)
    assert rel_err(logits, ref_logits) <= 1e-5 and rel_err(loss, ref_loss) <= 1e-5
    loss.backward()
    ref_loss.backward()
    checked = 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, name  # the frozen base gets no gradient
            continue
        owner, tensor = name.split(".lora.")
        if tensor in ("A", "B"):
            dw = merged[f"{owner}.weight"].grad
            a, b = model.get_parameter(f"{owner}.lora.A"), model.get_parameter(f"{owner}.lora.B")
            want = SCALE * b.detach().t() @ dw if tensor == "A" else SCALE * dw @ a.detach().t()
        else:
            kind = "gate_up_proj" if tensor.startswith("gate_up") else "down_proj"
            dw = merged[f"{owner}.{kind}"].grad
            prefix = tensor.split("_")[0] if kind == "down_proj" else "gate_up"
            a, b = (
                model.get_parameter(f"{owner}.lora.{prefix}_A"),
                model.get_parameter(f"{owner}.lora.{prefix}_B"),
            )
            if tensor.endswith("A"):
                want = SCALE * torch.bmm(b.detach().transpose(1, 2), dw)
            else:
                want = SCALE * torch.bmm(dw, a.detach().transpose(1, 2))
        assert rel_err(p.grad, want) <= 1e-4, (name, rel_err(p.grad, want))
        checked += 1
    # MLA (4 main + 1 MTP layers) x 5, KDA (2) x 9, dense MLP (2) x 2, shared expert (4 + 1) x 2, each A and B;
    # routed experts (4 + 1) x 4
    assert checked == 2 * (5 * 5 + 2 * 9 + 2 * 2 + 5 * 2) + 5 * 4


def test_control_experts_left_out_miss_the_reference():
    model = _with_adapters(4, targets=("mla", "kda", "mlp", "shared_expert"))
    full = _with_adapters(4)
    ref, _ = _reference(full)
    assert rel_err(_loss(model)[0], _loss(ref)[0]) > 1e-3


def test_fresh_adapters_give_the_base_model_bitwise():
    base = _base()
    model = _base()
    names = apply_lora(model, LoraSpec(rank=4, alpha=8))
    assert torch.equal(_loss(model)[0], _loss(base)[0])
    # no adapter on the router, the DSA indexer, the MTP projection or the output layer
    assert not [n for n in names if re.search(r"indexer|router|eh_proj|output_layer", n)]
    assert any(n.startswith("mtp.") for n in names)
    with pytest.raises(ValueError, match="already holds LoRA adapters"):
        apply_lora(model, LoraSpec(rank=4, alpha=8))


def test_expert_adapters_start_alike_at_every_layout():
    """The adapters of one expert start from the same values whatever EP x ETP shards them (the shard rule applied
    to the single-process adapters)."""
    like = torch.empty(0)
    spec = LoraSpec(rank=4, alpha=8, seed=3)
    whole = GroupedLora("decoder.layers.2.mlp.experts.lora", ExpertShard(8, 12), 16, spec, like)
    for shard in ExpertShard(8, 12, ep=2, etp=3).all_shards():
        part = GroupedLora("decoder.layers.2.mlp.experts.lora", shard, 16, spec, like)
        experts = slice(shard.first_expert, shard.first_expert + shard.num_local)
        assert torch.equal(part.gate_up_A, whole.gate_up_A[experts])
        assert torch.equal(part.down_A, shard.shard(DOWN, whole.down_A))
        assert part.gate_up_B.abs().sum() == 0 and part.down_B.abs().sum() == 0
        assert part.gate_up_B.shape == (shard.num_local, 2 * shard.local_intermediate, 4)
    other = GroupedLora("decoder.layers.3.mlp.experts.lora", ExpertShard(8, 12), 16, spec, like)
    assert not torch.equal(other.gate_up_A, whole.gate_up_A)  # another layer, other values


def test_merged_weight_is_rounded_once():
    """bf16: W + s B A in fp32, one rounding (not W + round(s B A))."""
    linear = torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    linear.lora = LoraAdapter("x.lora", 64, 32, LoraSpec(rank=8, alpha=16), linear.weight)
    with torch.no_grad():
        linear.lora.B.normal_(0, 1e-2)
    exact = linear.weight.float() + 2.0 * linear.lora.B.float() @ linear.lora.A.float()
    assert torch.equal(merged_weight(linear), exact.to(torch.bfloat16))
    assert merged_weight(torch.nn.Linear(4, 4)) is not None  # no adapter: the weight itself


@pytest.mark.parametrize("kwargs, message", [(dict(rank=0, alpha=1), "rank must be a positive integer"),
                                             (dict(rank=2, alpha=1, dropout=1.0), r"dropout must be in \[0, 1\)"),
                                             (dict(rank=2, alpha=1, targets=("router",)), "targets")])  # fmt: skip
def test_bad_specs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoraSpec(**kwargs)
