"""Training-state memory of LoRA against full fine-tuning, measured from the engine, and the released model's
arithmetic.

Measured (one process, CPU, fp32, stage 0, AdamW; the tiny preset with MTP): after one optimizer step, the bytes
the engine holds for parameters (the module's parameters and buffers), gradients (every `.grad`, after the
backward) and optimizer state (every tensor of the optimizer's state: Adam's moments and step), for full fine-tuning and for LoRA rank
`--rank` on every target (the base frozen). Arithmetic (the released GLM-5.3-Flash config, built on the meta
device; the adapters counted from the same target rule `apply_lora` uses): parameters, LoRA's trainable parameters,
and per-GPU bytes on one node of 8 with EP 8 under bf16 ZeRO-1 over 8 ranks: full fine-tuning 2 (bf16 weight) +
2 (gradient) + 12 / 8 (fp32 master and two moments, partitioned) bytes per parameter held, LoRA 2 per base
parameter held + the same 16-per-parameter rule for the adapters.

    python3 benchmarks/lora_memory.py [--rank 8]

Last line: `lora_memory optimizer_bytes_ratio=<LoRA / full> trainable_ratio=<LoRA / full trainable parameters>`;
JSON in benchmarks/results/lora_memory_cpu.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import glm53_ds  # noqa: E402
from benchmarks.measure import device_description, print_table, write_results  # noqa: E402
from glm53_ds.layers.lora import LORA_TARGETS, LoraSpec  # noqa: E402
from glm53_ds.layers.lora_targets import apply_lora, lora_targets  # noqa: E402
from glm53_ds.layers.moe.experts import GroupedExperts  # noqa: E402
from glm53_ds.training.presets import glm53_flash, tiny  # noqa: E402
from glm53_ds.training.trainable import select_trainable  # noqa: E402

DS_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
             "zero_optimization": {"stage": 0}, "bf16": {"enabled": False}, "zero_allow_untested_optimizer": True,
             "steps_per_print": 10**9}  # fmt: skip


def _nbytes(tensors) -> int:  # type: ignore[no-untyped-def]
    return sum(t.numel() * t.element_size() for t in tensors)


def measured(rank: int | None) -> dict[str, int]:
    """One engine step of the tiny model, full fine-tuning (`rank` None) or LoRA: the bytes it holds."""
    cfg = tiny()
    torch.manual_seed(0)
    model = glm53_ds.build_model(cfg)
    if rank is not None:
        apply_lora(model, LoraSpec(rank=rank, alpha=2 * rank))
        select_trainable(model, lora=True, trainable=None, freeze=None, train_indexer=False)
    engine = glm53_ds.build_engine(model, dict(DS_CONFIG))
    ids = torch.randint(1, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(ids, labels=ids))
    module = engine.module
    gradient_bytes = _nbytes(
        [p.grad for p in module.parameters() if p.grad is not None]
    )  # before the step frees them
    engine.step()
    state = [t for s in engine.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return dict(
        trainable=sum(p.numel() for p in module.parameters() if p.requires_grad),
        parameter_bytes=_nbytes(list(module.parameters()) + list(module.buffers())),
        gradient_bytes=gradient_bytes,
        optimizer_bytes=_nbytes(state),
    )


def released(rank: int, ep: int = 8, dp: int = 8) -> dict[str, float]:
    """The released model's parameter counts and per-GPU training-state bytes (EP `ep`, ZeRO-1 over `dp`)."""
    cfg = glm53_flash()
    with torch.device("meta"):
        model = glm53_ds.build_model(cfg)
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(rank * (m.weight.shape[0] + m.weight.shape[1]) for _, m in lora_targets(model, LORA_TARGETS))
    hidden, routed = cfg.hidden_size, 0
    for m in model.modules():
        if isinstance(m, GroupedExperts):  # gate_up: r (D + 2I) per expert, down: r (I + D)
            inner = m.intermediate
            routed += m.num_local_experts * rank * ((hidden + 2 * inner) + (inner + hidden))
    held = (total - expert) + expert / ep  # parameters one rank holds: the experts split over EP
    held_adapters = dense + routed / ep
    full = held * (2 + 2 + 12 / dp)
    lora = held * 2 + held_adapters * (2 + 2 + 12 / dp)
    return dict(parameters=total, lora_trainable=dense + routed, full_gib_per_gpu=full / 2**30,
                lora_gib_per_gpu=lora / 2**30)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    full, lora = measured(None), measured(args.rank)
    rows = [dict(run="full", **full), dict(run=f"lora r={args.rank}", **lora)]
    print_table(rows, ["run", "trainable", "parameter_bytes", "gradient_bytes", "optimizer_bytes"])
    real = released(16)
    print(f"GLM-5.3-Flash: {real['parameters'] / 1e9:.1f}B parameters; LoRA r=16 on every target trains "
          f"{real['lora_trainable'] / 1e6:.0f}M; per GPU at EP 8 / ZeRO-1 x 8: full fine-tuning "
          f"{real['full_gib_per_gpu']:.0f} GiB, LoRA {real['lora_gib_per_gpu']:.0f} GiB (before activations)")  # fmt: skip
    optimizer_ratio = lora["optimizer_bytes"] / full["optimizer_bytes"]
    trainable_ratio = lora["trainable"] / full["trainable"]
    path = write_results("lora_memory_cpu", dict(device=device_description(torch.device("cpu")), rank=args.rank,
                                                 full=full, lora=lora, released_r16=real))  # fmt: skip
    print(f"results: {path}")
    print(f"lora_memory optimizer_bytes_ratio={optimizer_ratio:.4f} trainable_ratio={trainable_ratio:.4f}")


if __name__ == "__main__":
    main()
