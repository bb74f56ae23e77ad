"""Exact parameter counts of one rank at a layout, from the model itself built on the meta device.

`count_parameters(run)` builds the run's `Glm53Model` (plan/run.py's `PlannedRun`: its model and options) on the
meta device (no memory, under a second at the released size) with every expert whole, applies the LoRA adapters
and trainable set the run would (`apply_lora`, `select_trainable`), and restates each tensor at one rank of the layout through the shard rule the model and the
checkpoints use (`checkpoint/placement.py`, from `ExpertShard`): a replicated tensor whole, a grouped expert tensor
(and its adapters) as that rank's slice. Every rank of a layout holds the same counts (experts divide evenly over EP,
their FFN over ETP). Kinds: `replicated` (attention, dense MLP, shared expert, router, norms, mHC `fn`, embeddings),
`expert` (the routed experts), `fp32_kept` (the tensors transformers keeps in fp32 in a bf16 model), each split
into trained and frozen; buffers apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..checkpoint.placement import expert_split, placement
from ..layers.lora_targets import apply_lora
from ..model import Glm53Model, build_model, fp32_kept_names
from ..parallel.expert_shard import ExpertShard
from ..training.trainable import select_trainable
from .run import PlannedRun

KINDS = ("replicated", "expert", "fp32_kept")


@dataclass
class ParameterCounts:
    """Elements one rank holds, by kind and whether they train; the model's totals (one replica of everything)."""

    trained: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    frozen: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    buffers: int = 0  # elements of the model's buffers (the router's correction bias, ...): fp32
    block_fp8: int = 0  # elements of the frozen weights kept in block-FP8 (--base-quant fp8): 1 byte each
    block_fp8_scales: int = 0  # their fp32 block scales
    total: int = 0  # every parameter of the whole model (all experts)
    active: int = 0  # parameters one token computes with: all but the routed experts it is not sent to
    tensors: int = 0  # parameter tensors on the rank

    def held(self, kind: str) -> int:
        return self.trained[kind] + self.frozen[kind]


def whole_model_on_meta(run: PlannedRun) -> Glm53Model:
    """The run's whole model (every expert) on the meta device, bf16, with its LoRA adapters."""
    spec = run.config.lora_spec()
    with torch.device("meta"):
        model = build_model(run.model, dtype=torch.bfloat16, mtp=run.model.num_nextn_predict_layers > 0,
                            perform_initialization=False, **run.base_fields)  # fmt: skip
        if spec is not None:
            apply_lora(model, spec)
    return model


def count_parameters(run: PlannedRun) -> ParameterCounts:
    """One rank's counts at the run's EP x ETP, with its adapters and trainable set."""
    cfg, c = run.model, run.config
    shard = ExpertShard.for_config(cfg, c.ep, 0, c.etp, 0)
    model = whole_model_on_meta(run)
    select_trainable(model, lora=c.lora_rank > 0, trainable=run.trainable, freeze=c.freeze,
                     train_indexer=run.trains_indexer)  # fmt: skip
    kept = set(fp32_kept_names(model))
    out = ParameterCounts()
    experts_per_token = cfg.num_experts_per_tok
    for name, p in model.named_parameters():
        out.total += p.numel()
        split = expert_split(name)
        local = placement(name, tuple(p.shape), shard).local_shape
        numel = int(torch.Size(local).numel())
        kind = "expert" if split is not None else ("fp32_kept" if name in kept else "replicated")
        (out.trained if p.requires_grad else out.frozen)[kind] += numel
        out.tensors += 1
        # a token uses top-k of the routed experts (their adapters too), everything else whole
        out.active += p.numel() if split is None else p.numel() // cfg.n_routed_experts * experts_per_token
    fp8: set[str] = set()
    for module_name, module in model.named_modules():
        for kind in getattr(module, "block_fp8_layouts", {}):
            name = f"{module_name}.{kind}"
            data, scale = getattr(module, kind), getattr(module, f"{kind}_scale_inv")
            parts = (
                c.ep * c.etp if expert_split(name) is not None else 1
            )  # experts and their FFN divide evenly
            out.block_fp8 += data.numel() // parts
            out.block_fp8_scales += -(
                -scale.numel() // parts
            )  # a slice inside a block keeps that block's scale
            out.total += data.numel()
            out.active += (
                data.numel() if parts == 1 else data.numel() // cfg.n_routed_experts * experts_per_token
            )
            fp8 |= {name, f"{name}_scale_inv"}
    out.buffers = sum(b.numel() for n, b in model.named_buffers() if n not in fp8)
    return out
