"""`python -m glm53_ds.convert describe DIR [--tag TAG]`: what a checkpoint holds and whether it is complete.

Reads only metadata and checksums (no pickle is opened): the layout the checkpoint was written at (world size, EP,
ETP, model-only or with optimizer state), the model config's sizes, the model files (replicated set, expert shards
for every EP x ETP rank), DeepSpeed's optimizer partitions, and the manifest check (every file present with its size
and CRC-32, nothing unlisted). Works on a training checkpoint directory (`<dir>/latest` -> `<dir>/<tag>/`) and on a
converted one (`hf-to-native`). Exit status 0 when complete, 1 when damaged or incomplete.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..checkpoint import CheckpointDir


def describe_checkpoint(path: str, tag: str | None = None, out: Callable[..., object] = print) -> int:
    """Print the checkpoint's layout and contents; returns 0 when complete, 1 otherwise."""
    ckpt = CheckpointDir(
        path, tag, check_files=False
    )  # it reports problems (below) instead of failing on one
    meta, cfg, ep, etp = ckpt.meta, ckpt.cfg, ckpt.ep, ckpt.etp
    out(f"checkpoint {ckpt.tag_dir}")
    world = meta.get("world_size")
    extra = "".join(f", {label} {meta[key]}" for key, label in (("sp", "SP"), ("zero_stage", "ZeRO stage"),
                                                                 ("dtype", "dtype")) if key in meta)  # fmt: skip
    out(f"  layout: world size {world if world is not None else '- (converted)'}, EP {ep}, ETP {etp}{extra}, "
        f"{'model only' if ckpt.model_only else 'with optimizer state'}")  # fmt: skip
    step = ckpt.optimizer_step
    if not ckpt.model_only:
        out("  resumable at: " + (f"any layout (layout-free optimizer state, step {step})" if step is not None
                                  else "its own layout only (no layout-free optimizer state)"))  # fmt: skip
    if cfg is not None:
        out(f"  model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
            f"{cfg.n_routed_experts} experts (top-{cfg.num_experts_per_tok}), {_mtp(cfg.num_nextn_predict_layers, ckpt)}")  # fmt: skip
    lora = meta.get("lora")
    if lora is not None:
        what = "the adapters without their base (resumed over the base the run state records)" if (
            ckpt.adapters_only) else "the adapters and the base"  # fmt: skip
        out(f"  LoRA: rank {lora['rank']}, alpha {lora['alpha']:g}, dropout {lora['dropout']:g}, targets "
            f"{','.join(lora['targets'])}; holds {what}")  # fmt: skip
    problems = ckpt.problems()
    out(
        f"  model files: replicated set + {ep * etp - len(ckpt.missing_expert_sets())}/{ep * etp} expert shards"
    )
    partitions = sorted(n for n in os.listdir(ckpt.tag_dir) if n.endswith("optim_states.pt"))
    out(f"  DeepSpeed optimizer partitions: {len(partitions)}")
    manifest = ckpt.manifest_summary()
    if manifest is not None:
        out(f"  manifest: {manifest[0]} files, {manifest[1] / 2**20:.1f} MiB")
    if problems:
        out("  INCOMPLETE: " + "; ".join(problems))
        return 1
    out("  complete: every file present with its size and CRC-32")
    return 0


def _mtp(layers: int, ckpt: CheckpointDir) -> str:
    """The MTP layers the checkpoint holds: the config's count only when its tensors are there."""
    if not layers:
        return "no MTP"
    if ckpt.adapters_only:  # its base holds the model's tensors, MTP included
        return f"MTP {layers}"
    try:
        held = ckpt.has_mtp
    except (OSError, ValueError):  # a damaged index: named below among the problems
        return f"MTP {layers} (by the config)"
    if held:
        return f"MTP {layers}"
    return f"no MTP tensors (the config names {layers} MTP layer{'s' if layers > 1 else ''})"
