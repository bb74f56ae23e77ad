"""Checkpoints of an EP x ETP DeepSpeed run whose files never collide.

DeepSpeed's engine checkpoint keeps what it manages well (ZeRO optimizer partitions, one file per rank;
scheduler; client state). The model itself is written by glm53_ds, because DeepSpeed's native MoE path finds
experts by module names GLM-5.3 does not use, and names its model file by model-parallel (ETP) rank only: it
is written by one EP rank, so the experts of the other EP ranks sharing that ETP rank are not in it (the test
shows it). Layout under `<dir>/<tag>/glm53/`:

    replicated.pt                         every non-expert tensor (written by global rank 0)
    experts_ep<EEE>_etp<TTT>.pt           one expert shard (written by expert-data-parallel rank 0 of it)
    optimizer_rank<RRRRR>.pt              stage 0 only: each rank's optimizer state (DeepSpeed saves one copy
                                          per ETP rank, which is wrong for expert moments under EP)
    layout.json                           EP, ETP, world size, checkpoint format

Every file is written to a temporary name and renamed; `latest` moves only after all ranks have finished
(barrier), so an interrupted save leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

from .grad_sync import is_expert_param
from .initialize import ParallelLayout

FORMAT = "glm53_ds-ep-etp-v1"
# Tests set this to a tag to kill the process in the middle of saving it.
FAIL_ENV = "GLM53_TEST_DIE_DURING_SAVE"


def _atomic_save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_write_text(text: str, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _split_state(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    expert_names = {n for n, p in model.named_parameters() if is_expert_param(p)}
    replicated: dict[str, torch.Tensor] = {}
    experts: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name.endswith("_extra_state") or t is None:
            continue
        (experts if name in expert_names else replicated)[name] = t.detach().cpu().clone()
    return replicated, experts


def _expert_file(layout: ParallelLayout) -> str:
    return f"experts_ep{layout.ep_rank:03d}_etp{layout.etp_rank:03d}.pt"


def save_checkpoint(
    engine: Any, layout: ParallelLayout, save_dir: str, tag: str, client_state: dict | None = None
) -> str:
    """Save; returns the checkpoint directory `<save_dir>/<tag>`."""
    engine.save_checkpoint(save_dir, tag=tag, client_state=client_state or {}, save_latest=False)
    root = os.path.join(save_dir, tag, "glm53")
    os.makedirs(root, exist_ok=True)
    replicated, experts = _split_state(engine.module)
    if layout.rank == 0:
        _atomic_save(replicated, os.path.join(root, "replicated.pt"))
        meta = dict(format=FORMAT, ep=layout.ep, etp=layout.etp, world_size=layout.world_size)
        _atomic_write_text(json.dumps(meta, indent=2), os.path.join(root, "layout.json"))
    if os.environ.get(FAIL_ENV) == tag:  # fault injection for tests: die mid-save, before `latest` moves
        os._exit(17)
    if dist.get_rank(layout.expert_dp_group) == 0:
        _atomic_save(experts, os.path.join(root, _expert_file(layout)))
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


def load_checkpoint(engine: Any, layout: ParallelLayout, load_dir: str, tag: str | None = None) -> dict:
    """Restore model, optimizer, scheduler; returns DeepSpeed's client state."""
    tag = tag or latest_tag(load_dir)
    root = os.path.join(load_dir, tag, "glm53")
    with open(os.path.join(root, "layout.json"), encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{root}: unknown checkpoint format {meta.get('format')!r}")
    if (meta["ep"], meta["etp"]) != (layout.ep, layout.etp):
        raise ValueError(
            f"{root} was saved with EP={meta['ep']}, ETP={meta['etp']}; this run has EP={layout.ep}, ETP={layout.etp} "
            "(convert it with `python -m glm53_ds.convert` to change the layout)"
        )
    # DeepSpeed would look for its own per-expert files; the model comes from glm53's files below.
    has_moe = engine.has_moe_layers
    engine.has_moe_layers = False
    try:
        _, client_state = engine.load_checkpoint(
            load_dir,
            tag=tag,
            load_module_strict=False,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
    finally:
        engine.has_moe_layers = has_moe
    state = torch.load(os.path.join(root, "replicated.pt"), map_location="cpu")
    state.update(torch.load(os.path.join(root, _expert_file(layout)), map_location="cpu"))
    own = {k for k in engine.module.state_dict() if not k.endswith("_extra_state")}
    missing, unexpected = sorted(own - set(state)), sorted(set(state) - own)
    if missing or unexpected:
        raise ValueError(
            f"{root}: checkpoint does not match the model: missing {missing[:10]}, unexpected {unexpected[:10]}"
        )
    with torch.no_grad():
        current = engine.module.state_dict()
        for name, tensor in state.items():
            current[name].copy_(tensor)
    if engine.zero_optimization_stage() == 0:
        engine.optimizer.load_state_dict(
            torch.load(os.path.join(root, f"optimizer_rank{layout.rank:05d}.pt"), map_location="cpu")
        )
    return client_state or {}
