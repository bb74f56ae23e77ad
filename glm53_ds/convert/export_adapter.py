"""A LoRA checkpoint's adapters as a PEFT adapter of transformers' `glm5_next` model.

    <out>/adapter_config.json        peft_type LORA, r, lora_alpha, lora_dropout, target_modules (every adapted
                                     module's full transformers name), target_parameters (the fused expert
                                     tensors, when the experts are adapted)
    <out>/adapter_model.safetensors  base_model.model.<transformers module>.lora_A.weight [r, in] and
                                     .lora_B.weight [out, r], in the checkpoint's dtype

`peft.PeftModel.from_pretrained(Glm5NextForConditionalGeneration, out)` then computes this project's model:
  - a projection's adapter (`<module>.lora.A` / `.B`) goes to the transformers module its weight is released as
    (`convert/names.py`); megatron's fused `linear_fc1` (gate rows, then up rows) is transformers' `gate_proj`
    and `up_proj`: each gets the same A and its rows of B (so B_gate A and B_up A are exactly fc1's two halves);
  - the routed experts (`experts.lora.*`) target transformers' fused 3-D `mlp.experts.gate_up_proj` [E, 2I, D] and
    `down_proj` [E, D, I] through PEFT's `target_parameters` (PEFT >= 0.17): lora_A [E·r, in] holds expert e's A
    in rows e·r .. e·r + r; lora_B [out, r·E] holds its B in columns j·E + e (PEFT's layout); the two wrappers nest
    in `target_parameters`' order, the later (`down_proj`) outermost, so gate_up's keys carry `base_layer.`.
What PEFT cannot express is said, not dropped silently: the MTP layer's adapters are left out (transformers' model
has no MTP layer; the merged export `--export-hf` has them), and a dropout is written as 0 when the experts are
adapted (PEFT refuses dropout on parameter targets; it changes nothing at inference). A checkpoint whose run also
trained tensors besides the adapters, or moved the router's correction bias, cannot be a PEFT adapter: the run
refuses `--export-adapter` before any work (training/config.py).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ..checkpoint import CheckpointDir
from ..config import Glm53Config
from ..layers.lora import LoraSpec, is_lora_param
from ..layers.lora_targets import apply_lora
from ..model import build_model
from ..safe_io import check_output_dir, save_safetensors, staged_dir
from .import_hf import ConversionError
from .names import Placement, in_memory_module, released_layout

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# in `target_parameters` order: PEFT nests the wrappers so that the later one is outermost
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


def _released_of(cfg: Glm53Config) -> dict[str, list[tuple[str, Placement]]]:
    """Native tensor name -> the released tensors (MTP aside) it is written as, with each one's piece."""
    out: dict[str, list[tuple[str, Placement]]] = {}
    for released, placements in released_layout(cfg, mtp=False).items():
        for p in placements:
            out.setdefault(p.native, []).append((released, p))
    return out


def peft_adapter(
    adapters: dict[str, torch.Tensor], cfg: Glm53Config, lora: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[str]]:
    """(adapter_model tensors, adapter_config, notices) of the full (single-process) adapter tensors `adapters`
    (native names), made with the LoRA record `lora` (rank, alpha, dropout, targets)."""
    released_of = _released_of(cfg)
    tensors: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    expert_modules: set[str] = set()
    left_out = 0
    for name in sorted(adapters):
        if name.startswith("mtp."):  # the MTP layer (native names)
            left_out += 1
            continue
        if name.endswith(".lora.A"):
            owner = name.removesuffix(".lora.A")
            a, b = adapters[name], adapters[f"{owner}.lora.B"]
            for released, piece in released_of.get(f"{owner}.weight", []):
                module = in_memory_module(released)
                tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.clone()  # gate and up: a copy each
                tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b[piece.index].contiguous()
                modules.add(module)
            if f"{owner}.weight" not in released_of:
                raise ConversionError(f"{owner}: an adapted projection with no released tensor")
        elif name.endswith(".lora.gate_up_A"):
            owner = name.removesuffix(".lora.gate_up_A")  # <layer>.mlp.experts
            first = released_of[f"{owner}.gate_up_proj"][0][0]  # ...mlp.experts.0.gate_proj.weight
            module = in_memory_module(first).rsplit(".", 2)[0]  # ...mlp.experts
            for kind, inner in (("gate_up", "base_layer."), ("down", "")):
                a, b = (
                    adapters[f"{owner}.lora.{kind}_A"],
                    adapters[f"{owner}.lora.{kind}_B"],
                )  # [E, r, in], [E, out, r]
                experts, rank = a.shape[0], a.shape[1]
                tensors[f"{PEFT_PREFIX}{module}.{inner}lora_A.weight"] = a.reshape(
                    experts * rank, -1
                ).contiguous()
                tensors[f"{PEFT_PREFIX}{module}.{inner}lora_B.weight"] = (
                    b.permute(1, 2, 0).reshape(b.shape[1], rank * experts).contiguous()
                )
            expert_modules.add(module)
    notices = []
    if left_out:
        notices.append(f"the MTP layer's {left_out} adapter tensors are left out (transformers' glm5_next has no "
                       "MTP layer; the merged export --export-hf has them)")  # fmt: skip
    dropout = float(lora["dropout"])
    if expert_modules and dropout:
        notices.append(f"lora_dropout {dropout:g} written as 0: PEFT refuses dropout on the experts' parameter "
                       "targets (dropout changes nothing at inference)")  # fmt: skip
        dropout = 0.0
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(lora["rank"]),
        "lora_alpha": float(lora["alpha"]),
        "lora_dropout": dropout,
        "target_modules": sorted(modules),
        "target_parameters": [f"mlp.experts.{p}" for p in EXPERT_PARAMETERS] if expert_modules else None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    return tensors, config, notices


def write_peft_adapter(out: str, tensors: dict[str, torch.Tensor], config: dict[str, Any], force: bool = False,
                       inputs: dict[str, str | None] | None = None) -> str:  # fmt: skip
    """`out` whole (built under a temporary name); an existing non-empty `out` only with `force` (only these two
    files replaced)."""
    check_output_dir(out, "--out", force=force, inputs=inputs or {})
    with staged_dir(out) as tmp:
        save_safetensors(tensors, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
    return out


def adapter_shapes(cfg: Glm53Config, lora: dict[str, Any], mtp: bool) -> dict[str, tuple[int, ...]]:
    """Every adapter tensor a LoRA record gives this model, with its whole (single-process) shape: the model with
    those adapters, built on the meta device (no memory, under a second at the released size)."""
    spec = LoraSpec(rank=int(lora["rank"]), alpha=float(lora["alpha"]), dropout=float(lora["dropout"]),
                    targets=tuple(lora["targets"]))  # fmt: skip
    with torch.device("meta"):
        model = build_model(cfg, mtp=mtp, perform_initialization=False)
        apply_lora(model, spec)
    return {n: tuple(p.shape) for n, p in model.named_parameters() if is_lora_param(n)}


def _describe(lora: dict[str, Any]) -> str:
    return f"rank {lora['rank']}, targets {','.join(lora['targets'])}"


def native_to_peft(ckpt: str, out: str, force: bool = False) -> list[str]:
    """Convert the adapters of LoRA checkpoint `ckpt` (a tag, or a directory's `latest`) into a PEFT adapter at
    `out`; returns the notices (what PEFT could not express)."""
    native = CheckpointDir(ckpt)
    lora = native.meta.get("lora")
    names = sorted(k for k in native.keys() if is_lora_param(k))
    if lora is None or not names:
        raise ConversionError(f"{native.root}: not a LoRA checkpoint (layout.json records no LoRA adapters)")
    expected = adapter_shapes(native.model_config, lora, mtp=native.has_mtp)
    differ = [f"{k} is missing" for k in sorted(set(expected) - set(names))]
    differ += [f"{k} is not an adapter of this model" for k in names if k not in expected]
    differ += [f"{k} has shape {list(native.stored_shape(k))}, the model's adapter {list(expected[k])}"
               for k in names if k in expected and native.stored_shape(k) != expected[k]]  # fmt: skip
    if differ:
        raise ConversionError(f"{native.root}: the adapters do not match the LoRA record ({_describe(lora)}) of this "
                              f"model: {'; '.join(differ[:3])}")  # fmt: skip
    adapters = {k: native.full_tensor(k) for k in names}
    bad = [k for k, t in adapters.items() if not torch.isfinite(t).all()]
    if bad:
        raise ConversionError(f"{native.root}: adapter {bad[0]} holds non-finite values"
                              + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "") + "; nothing exported")  # fmt: skip
    tensors, config, notices = peft_adapter(adapters, native.model_config, lora)
    write_peft_adapter(out, tensors, config, force=force, inputs={"--ckpt": ckpt})
    return notices
