"""`python -m glm53_ds.convert describe DIR [--tag TAG]`: what a checkpoint holds and whether it is complete.

Reads only metadata and checksums (no pickle is opened): the layout the checkpoint was written at (world size, EP,
ETP, model-only or with optimizer state), the model config's sizes, the model files (replicated set, expert shards
for every EP x ETP rank), DeepSpeed's optimizer partitions, and the manifest check (every file present with its size
and CRC-32, nothing unlisted). Works on a training checkpoint directory (`<dir>/latest` -> `<dir>/<tag>/`) and on a
converted one (`hf-to-native`). Exit status 0 when complete, 1 when damaged or incomplete.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from ..config import Glm53Config
from ..safe_io import read_manifest, unlisted_files, verify_files
from .native_format import expert_set_name, latest_tag, read_layout
from .safetensors_file import check_plain_file_name


def _tag_dir(path: str, tag: str | None) -> str:
    """The directory holding `glm53/` (a training tag) or `layout.json` (a converted checkpoint)."""
    if tag is None and os.path.isfile(os.path.join(path, "latest")):
        tag = latest_tag(path)
    return os.path.join(path, tag) if tag else path


def describe_checkpoint(path: str, tag: str | None = None, out: Callable[..., object] = print) -> int:
    """Print the checkpoint's layout and contents; returns 0 when complete, 1 otherwise."""
    root = _tag_dir(path, tag)
    model_dir = os.path.join(root, "glm53") if os.path.isdir(os.path.join(root, "glm53")) else root
    meta = read_layout(model_dir)
    cfg = Glm53Config.from_text_dict(meta["config"]) if meta.get("config") else None
    ep, etp = int(meta["ep"]), int(meta["etp"])
    out(f"checkpoint {root}")
    world = meta.get("world_size")
    extra = "".join(f", {label} {meta[key]}" for key, label in (("sp", "SP"), ("zero_stage", "ZeRO stage"),
                                                                 ("dtype", "dtype")) if key in meta)  # fmt: skip
    out(f"  layout: world size {world if world is not None else '- (converted)'}, EP {ep}, ETP {etp}{extra}, "
        f"{'model only' if meta.get('model_only', True) else 'with optimizer state'}")  # fmt: skip
    portable = meta.get("optimizer_state")
    if not meta.get("model_only", True):
        out("  resumable at: " + (f"any layout (layout-free optimizer state, step {portable['step']})" if portable
                                  else "its own layout only (no layout-free optimizer state)"))  # fmt: skip
    if cfg is not None:
        out(f"  model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
            f"{cfg.n_routed_experts} experts (top-{cfg.num_experts_per_tok}), MTP {cfg.num_nextn_predict_layers}")  # fmt: skip
    problems: list[str] = []
    names = set(os.listdir(model_dir))
    missing_sets = [
        expert_set_name(e, t)
        for e in range(ep)
        for t in range(etp)
        if not any(n.startswith(expert_set_name(e, t)) for n in names)
    ]
    if not any(n.startswith("replicated") for n in names):
        problems.append("the replicated model files are missing")
    if missing_sets:
        problems.append(f"expert shards missing: {', '.join(missing_sets)}")
    if portable:
        missing_state = [f"optimizer_{s}" for s in ["replicated"] + [expert_set_name(e, t) for e in range(ep)
                         for t in range(etp)] if f"optimizer_{s}.index.json" not in names]  # fmt: skip
        if missing_state:
            problems.append(f"layout-free optimizer state missing: {', '.join(missing_state)}")
    for index in sorted(
        n for n in names if n.endswith(".index.json")
    ):  # every set's files inside the checkpoint
        try:
            with open(os.path.join(model_dir, index), encoding="utf-8") as f:
                for file_name in set(json.load(f)["weight_map"].values()):
                    check_plain_file_name(file_name, model_dir)
        except (ValueError, KeyError, AttributeError) as e:
            problems.append(f"{index}: {e}")
    out(f"  model files: replicated set + {ep * etp - len(missing_sets)}/{ep * etp} expert shards")
    partitions = (
        sorted(n for n in os.listdir(root) if n.endswith("optim_states.pt")) if root != model_dir else []
    )
    if root != model_dir:
        out(f"  DeepSpeed optimizer partitions: {len(partitions)}")
    try:
        manifest = read_manifest(root)
    except ValueError as e:
        problems.append(str(e))
    else:
        problems += [f"{n} is not in the manifest" for n in unlisted_files(root, manifest)]
        problems += verify_files(root, manifest, sorted(manifest))
        size = sum(int(str(e.get("size", 0))) for e in manifest.values())
        out(f"  manifest: {len(manifest)} files, {size / 2**20:.1f} MiB")
    if problems:
        out("  INCOMPLETE: " + "; ".join(problems))
        return 1
    out("  complete: every file present with its size and CRC-32")
    return 0
