"""glm53_ds training checkpoint -> a directory `transformers` loads (released GLM-5.3 layout).

`native_checkpoint_to_hf(tag_dir, out_dir, template=None)` reads `<tag_dir>/glm53/` (replicated tensors and
every EP x ETP expert shard), reassembles full expert tensors, maps names through `convert/names.py`, and
writes size-bounded safetensors shards + `model.safetensors.index.json` + `config.json` into a temporary
directory renamed into place at the end (the output is complete or absent; an existing output is refused).
With `template` (the released checkpoint training started from), its config is kept (text fields updated) and
its vision tensors are copied unchanged; without one, a small vision config is written and transformers
initialises the (unused) vision tower itself.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
from typing import Any

import torch

from ..config import Glm53Config
from .names import released_tensors

SHARD_BYTES = 2 * 1024**3
SMALL_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32,
                    projection_intermediate_size=32)  # fmt: skip


def load_native_checkpoint(tag_dir: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The full native state dict (experts reassembled over EP and ETP) and the layout metadata."""
    root = os.path.join(tag_dir, "glm53")
    if not os.path.isfile(os.path.join(root, "layout.json")):
        raise FileNotFoundError(f"{tag_dir!r} is not a glm53_ds checkpoint (no glm53/layout.json)")
    with open(os.path.join(root, "layout.json"), encoding="utf-8") as f:
        meta = json.load(f)
    state: dict[str, torch.Tensor] = torch.load(os.path.join(root, "replicated.pt"), map_location="cpu")
    ep, etp = meta["ep"], meta["etp"]
    shards: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for path in glob.glob(os.path.join(root, "experts_ep*_etp*.pt")):
        m = re.search(r"experts_ep(\d+)_etp(\d+)\.pt$", path)
        assert m is not None
        shards[(int(m.group(1)), int(m.group(2)))] = torch.load(path, map_location="cpu")
    missing = [(e, t) for e in range(ep) for t in range(etp) if (e, t) not in shards]
    if missing:
        raise FileNotFoundError(f"{root}: expert shard file(s) missing for (EP rank, ETP rank) {missing}")
    for name in shards[(0, 0)]:
        per_ep = []
        for e in range(ep):
            parts = [shards[(e, t)][name] for t in range(etp)]
            if name.endswith("gate_up_proj"):
                half = parts[0].shape[1] // 2
                gate = torch.cat([p[:, :half] for p in parts], dim=1)
                up = torch.cat([p[:, half:] for p in parts], dim=1)
                per_ep.append(torch.cat([gate, up], dim=1))
            else:  # down_proj [E_local, D, I_local]
                per_ep.append(torch.cat(parts, dim=2))
        state[name] = torch.cat(per_ep, dim=0)
    return state, meta


def _hf_config(cfg: Glm53Config, template: str | None) -> dict[str, Any]:
    text = cfg.to_text_dict()
    if template:
        with open(os.path.join(template, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        if "text_config" in config:
            config["text_config"].update(text)
        else:
            config.update(text)
            config["model_type"] = "glm5_next"
        return config
    return dict(
        architectures=["Glm5NextForConditionalGeneration"],
        model_type="glm5_next",
        text_config=text,
        vision_config=SMALL_VISION,
        tie_word_embeddings=cfg.tie_word_embeddings,
        dtype="float32",
    )


def write_hf_directory(
    tensors: dict[str, torch.Tensor], config: dict[str, Any], out_dir: str, force: bool = False,
    shard_bytes: int = SHARD_BYTES,
) -> None:  # fmt: skip
    from safetensors.torch import save_file

    if os.path.exists(out_dir) and not force:
        raise FileExistsError(f"{out_dir!r} exists; refusing to overwrite (use --force)")
    tmp = f"{out_dir.rstrip('/')}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(tmp, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def native_checkpoint_to_hf(
    tag_dir: str, cfg: Glm53Config, out_dir: str, template: str | None = None, force: bool = False
) -> None:
    state, _ = load_native_checkpoint(tag_dir)
    mtp = any(k.startswith("mtp.") for k in state)
    tensors = dict(released_tensors(state, cfg, mtp=mtp))
    if template:
        from ..hf_loader import SafetensorsCheckpoint

        source = SafetensorsCheckpoint(template)
        vision = [n for n in source.keys() if n.startswith(("model.visual.", "visual."))]
        tensors.update(dict(source.tensors(vision)))  # copied unchanged
    write_hf_directory(tensors, _hf_config(cfg, template), out_dir, force=force)


def export_engine_to_hf(
    engine: Any, layout: Any, cfg: Glm53Config, out_dir: str, template: str | None = None
) -> None:
    """From a running job: write a checkpoint next to the output, then rank 0 converts it."""
    import torch.distributed as dist

    from ..parallel.checkpoint import save_checkpoint

    work = f"{out_dir.rstrip('/')}.native"
    tag_dir = save_checkpoint(engine, layout, work, "export")
    if dist.get_rank() == 0:
        native_checkpoint_to_hf(tag_dir, cfg, out_dir, template=template, force=True)
        shutil.rmtree(work, ignore_errors=True)
    dist.barrier()
