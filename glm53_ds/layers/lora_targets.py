"""Where LoRA adapters go (`apply_lora`): the projections of each layer kind, found by type.

Targets (`LORA_TARGETS`; default all):
    mla            q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj of every MLA layer (the MTP layer's too)
    kda            q_proj, k_proj, v_proj, b_proj (beta), g_a_proj / g_b_proj (output gate), forget_gate's f_a_proj /
                   f_b_proj, o_proj
    mlp            the dense MLP's linear_fc1 (gate and up rows, one adapter) and linear_fc2
    shared_expert  the MoE layer's shared expert, as the dense MLP
    experts        every routed expert (`GroupedLora`, sharded as the expert weights)
The router, the DSA indexer, norms, mHC, the MTP projection, embeddings and the output layer have none.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core.transformer.mlp import MLP
from torch import nn

from .block_fp8 import compute_like
from .kda import KimiDeltaAttention
from .lora import GroupedLora, LoraAdapter, LoraSpec, add_adapter
from .mla import SparseMLA
from .moe.experts import GroupedExperts
from .moe.moe_layer import Glm53MoE

_MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
_KDA = ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj")
_FORGET_GATE = ("f_a_proj", "f_b_proj")
_MLP = ("linear_fc1", "linear_fc2")


def lora_targets(model: nn.Module, targets: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """(name, projection) of every targeted linear, in the model's module order (layer kinds by type: the DSA
    indexer's projections share names with the attention's)."""
    out: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, SparseMLA) and "mla" in targets:
            out += [(f"{name}.{c}", getattr(module, c)) for c in _MLA]
        elif isinstance(module, KimiDeltaAttention) and "kda" in targets:
            out += [(f"{name}.{c}", getattr(module, c)) for c in _KDA]
            out += [(f"{name}.forget_gate.{c}", getattr(module.forget_gate, c)) for c in _FORGET_GATE]
        elif (
            isinstance(module, Glm53MoE) and "shared_expert" in targets and module.shared_experts is not None
        ):
            out += [(f"{name}.shared_experts.{c}", getattr(module.shared_experts, c)) for c in _MLP]
        elif (
            isinstance(module, MLP) and name.endswith(".mlp") and "mlp" in targets
        ):  # dense (not shared_experts)
            out += [(f"{name}.{c}", getattr(module, c)) for c in _MLP]
    return out


def apply_lora(model: nn.Module, spec: LoraSpec, etp_group: dist.ProcessGroup | None = None) -> list[str]:
    """Attach adapters to `spec.targets`; returns the names of the adapted modules. A model holds one set of
    adapters (a second call is refused). `etp_group`: the expert-tensor-parallel group when ETP > 1."""
    if any(isinstance(m, LoraAdapter | GroupedLora) for m in model.modules()):
        raise ValueError("apply_lora: the model already holds LoRA adapters")
    names = []
    for name, linear in lora_targets(model, spec.targets):
        weight = linear.weight
        assert isinstance(weight, torch.Tensor)
        linear.lora = LoraAdapter(
            f"{name}.lora", weight.shape[1], weight.shape[0], spec, compute_like(linear, weight)
        )
        linear.register_forward_hook(add_adapter)
        names.append(name)
    model.lora_spec = spec  # type: ignore[assignment]  # what checkpoints record (engine/checkpoint.py)
    if "experts" in spec.targets:
        for name, experts in model.named_modules():
            if isinstance(experts, GroupedExperts):
                experts.lora = GroupedLora(f"{name}.lora", experts.shard, experts.gate_up_proj.shape[-1], spec,
                                           compute_like(experts, experts.gate_up_proj))  # fmt: skip
                if etp_group is not None and experts.shard.etp > 1:
                    experts.lora.etp_group = etp_group
                names.append(name)
    return names
