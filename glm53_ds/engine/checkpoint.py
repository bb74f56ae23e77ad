"""Checkpoints of an EP x ETP DeepSpeed run whose files never collide.

DeepSpeed's engine checkpoint keeps what it manages well (ZeRO optimizer partitions, one file per rank;
client state). The model itself is written by glm53_ds in the native format (`convert/native_format.py`),
because DeepSpeed's native MoE path finds experts by module names GLM-5.3 does not use, and names its model
file by model-parallel (ETP) rank only: it is written by one EP rank, so the experts of the other EP ranks
sharing that ETP rank are not in it (the test shows it). Under `<dir>/<tag>/glm53/`:

    replicated.*                          every non-expert tensor (written by global rank 0)
    experts_ep<EEE>_etp<TTT>.*            one expert shard (written by expert-data-parallel rank 0 of it)
    optimizer_rank<RRRRR>.pt              stage 0 only: each rank's optimizer state (DeepSpeed saves one copy
                                          per ETP rank, which is wrong for expert moments under EP)
    layout.json                           format, EP, ETP, config

In bf16/fp16 runs the parameters HF keeps in fp32 are written from their fp32 optimizer masters
(`fp32_masters.py`), so checkpoints and exports keep them at full precision and in the released dtypes.

Every file is written to a temporary name and renamed; `latest` moves only after all ranks have finished
(barrier), so an interrupted save leaves the previous checkpoint loadable. A model-only checkpoint
(`python -m glm53_ds.convert hf-to-native`) loads the same way, without optimizer state.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from ..config import Glm53Config
from ..convert.export_hf import native_to_hf
from ..convert.native_format import ShardReader, ShardWriter, expert_set_name, read_layout, write_layout
from ..parallel.layout import ParallelLayout
from ..parallel.params import is_expert_param
from . import fp32_masters
from .deepspeed_internals import moe_checkpoint_files_off


def _atomic_save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_write_text(text: str, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _write_replicated(model: Any, layout: ParallelLayout, root: str, state: dict[str, torch.Tensor],
                      expert_names: set[str]) -> None:  # fmt: skip
    """Every non-expert tensor and layout.json (global rank 0)."""
    if layout.rank != 0:
        return
    writer = ShardWriter(root, "replicated")
    for name, t in state.items():
        if name not in expert_names:
            writer.add(name, t)
    writer.close()
    cfg = getattr(model, "glm", None)
    write_layout(root, dict(ep=layout.ep, etp=layout.etp, world_size=layout.world_size, model_only=False,
                            config=cfg.to_text_dict() if cfg is not None else None))  # fmt: skip


def _write_experts(
    layout: ParallelLayout, root: str, state: dict[str, torch.Tensor], expert_names: set[str]
) -> None:
    """This rank's expert shard (its expert-data-parallel rank 0)."""
    if dist.get_rank(layout.expert_dp_group) != 0:
        return
    writer = ShardWriter(root, expert_set_name(layout.ep_rank, layout.etp_rank))
    for name in sorted(expert_names):
        writer.add(name, state[name])
    writer.close()


def save_checkpoint(engine: Any, save_dir: str, tag: str, client_state: dict | None = None) -> str:
    """Save; returns the checkpoint directory `<save_dir>/<tag>`. Collective."""
    layout: ParallelLayout = engine.glm53_layout
    engine.save_checkpoint(save_dir, tag=tag, client_state=client_state or {}, save_latest=False)
    root = os.path.join(save_dir, tag, "glm53")
    os.makedirs(root, exist_ok=True)
    model = engine.module
    expert_names = {n for n, p in model.named_parameters() if is_expert_param(p)}
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state") and v is not None}
    state.update(fp32_masters.gather(engine))  # HF's fp32-kept parameters at full precision (collective)
    _write_replicated(model, layout, root, state, expert_names)
    _write_experts(layout, root, state, expert_names)
    if engine.zero_optimization_stage() == 0:
        _atomic_save(engine.optimizer.state_dict(), os.path.join(root, f"optimizer_rank{layout.rank:05d}.pt"))
    dist.barrier()
    if layout.rank == 0:
        _atomic_write_text(tag, os.path.join(save_dir, "latest"))
    dist.barrier()
    return os.path.join(save_dir, tag)


def latest_tag(load_dir: str) -> str:
    path = os.path.join(load_dir, "latest")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint in {load_dir!r}: the file 'latest' is missing")
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


def load_checkpoint(engine: Any, load_dir: str, tag: str | None = None) -> dict:
    """Restore model (and, unless model-only, optimizer and client state); returns the client state."""
    layout: ParallelLayout = engine.glm53_layout
    tag = tag or latest_tag(load_dir)
    root = os.path.join(load_dir, tag, "glm53")
    meta = read_layout(root)
    if (meta["ep"], meta["etp"]) != (layout.ep, layout.etp):
        raise ValueError(
            f"{root} was saved with EP={meta['ep']}, ETP={meta['etp']}; this run has EP={layout.ep}, ETP={layout.etp} "
            "(convert it with `python -m glm53_ds.convert` to change the layout)"
        )
    client_state: dict = {}
    if not meta.get("model_only"):
        with moe_checkpoint_files_off(engine):  # the model comes from glm53's files below
            _, client_state = engine.load_checkpoint(
                load_dir,
                tag=tag,
                load_module_strict=False,
                load_optimizer_states=True,
                load_lr_scheduler_states=True,
            )
    readers = [
        ShardReader(root, "replicated"),
        ShardReader(root, expert_set_name(layout.ep_rank, layout.etp_rank)),
    ]
    current = {k: v for k, v in engine.module.state_dict().items() if not k.endswith("_extra_state")}
    stored = {k for r in readers for k in r.keys()}
    missing, unexpected = sorted(set(current) - stored), sorted(stored - set(current))
    if missing or unexpected:
        raise ValueError(
            f"{root}: checkpoint does not match the model: missing {missing[:10]}, unexpected {unexpected[:10]}"
        )
    kept = {n for n, _ in fp32_masters.fp32_kept_parameters(engine.module)}
    kept_values = {}
    with torch.no_grad():
        for reader in readers:
            for name, tensor in reader.items():
                if tuple(tensor.shape) != tuple(current[name].shape):
                    raise ValueError(
                        f"{root}: {name} has shape {tuple(tensor.shape)}, the model {tuple(current[name].shape)}"
                    )
                current[name].copy_(tensor)
                if name in kept:
                    kept_values[name] = tensor
    if meta.get("model_only"):  # no optimizer state: the masters come from the stored (fp32) values
        fp32_masters.restore(engine, kept_values)
    if engine.zero_optimization_stage() == 0 and not meta.get("model_only"):
        engine.optimizer.load_state_dict(
            torch.load(os.path.join(root, f"optimizer_rank{layout.rank:05d}.pt"), map_location="cpu")
        )
    return client_state or {}


def export_engine_to_hf(engine: Any, cfg: Glm53Config, out_dir: str, template: str | None = None) -> None:
    """From a running job: write a checkpoint next to the output, then rank 0 converts it. Collective."""
    work = f"{out_dir.rstrip('/')}.native"
    tag_dir = save_checkpoint(engine, work, "export")
    if dist.get_rank() == 0:
        if template:
            shutil.copyfile(
                os.path.join(template, "config.json"), os.path.join(tag_dir, "glm53", "hf_config.json")
            )
        native_to_hf(tag_dir, out_dir, hf_template=template, force=True)
        shutil.rmtree(work, ignore_errors=True)
    dist.barrier()
