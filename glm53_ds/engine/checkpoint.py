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
    fp32_params_optimizer.pt              bf16 runs: the optimizer state of HF's fp32-kept parameters (rank 0)

In bf16 runs the parameters HF keeps in fp32 are fp32 buffers the engine never casts (`fp32_params.py`), so
checkpoints and exports hold them at full precision, in the released dtypes.

A save builds the whole tag under a fresh temporary name (`<dir>/.<tag>.tmp-<nonce>/`, DeepSpeed's files too),
checksums every file in parallel over the ranks (each rank a share), writes `manifest.json` last, and only then,
after a barrier, renames it into place (a re-save of an existing tag replaces it whole) and moves `latest` (temp
file, fsync, rename, fsync of the directory). `verify_checkpoint` checks the manifest (every file present, with its
size and CRC-32, and nothing unlisted) before anything is read; every load goes through it, and DeepSpeed's pickled
files are read with `weights_only` (a file holding anything but tensors and plain data is refused, nothing in it
runs). A model-only checkpoint (`python -m glm53_ds.convert hf-to-native`) loads the same way, without optimizer
state.
"""

from __future__ import annotations

import glob
import os
import shutil
import uuid
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..config import Glm53Config
from ..convert.export_hf import native_to_hf
from ..convert.native_format import ShardReader, ShardWriter, expert_set_name, read_layout, write_layout
from ..parallel.layout import ParallelLayout
from ..parallel.params import is_expert_param
from ..safe_io import (
    atomic_write_text,
    describe_files,
    fsync_path,
    list_files,
    new_temp_dir,
    read_manifest,
    unlisted_files,
    verify_files,
    write_manifest,
)
from .deepspeed_internals import moe_checkpoint_files_off, weights_only_loads

FP32_PARAMS_OPTIMIZER = "fp32_params_optimizer.pt"  # bf16 runs: the fp32-kept parameters' optimizer state


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the file."""


def _from_rank0(value: Any) -> Any:
    box = [value if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _share(names: Sequence[str]) -> list[str]:
    """This rank's round-robin share of `names` (reads spread over the ranks)."""
    return list(names[dist.get_rank() :: dist.get_world_size()])


def _gather(part: Any) -> list[Any]:
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    return parts


def _atomic_save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    torch.save(obj, tmp)
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
    """Save as `<save_dir>/<tag>` (whole or not at all) and point `latest` at it; returns the tag directory.
    Collective."""
    layout: ParallelLayout = engine.glm53_layout
    if not tag or tag.startswith(".") or os.sep in tag:
        raise ValueError(f"checkpoint tag {tag!r}: expected a plain name such as step300")
    staging = f".{tag}.tmp-{_from_rank0(uuid.uuid4().hex[:8])}"
    staged, final = os.path.join(save_dir, staging), os.path.join(save_dir, tag)
    engine.save_checkpoint(save_dir, tag=staging, client_state=client_state or {}, save_latest=False)
    root = os.path.join(staged, "glm53")
    os.makedirs(root, exist_ok=True)
    model = engine.module
    expert_names = {n for n, p in model.named_parameters() if is_expert_param(p)}
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state") and v is not None}
    _write_replicated(model, layout, root, state, expert_names)
    _write_experts(layout, root, state, expert_names)
    if engine.zero_optimization_stage() == 0:
        _atomic_save(engine.optimizer.state_dict(), os.path.join(root, f"optimizer_rank{layout.rank:05d}.pt"))
    side = getattr(engine, "glm53_fp32_params", None)
    if side is not None and layout.rank == 0:  # replicated and identical on every rank
        _atomic_save(side.state_dict(), os.path.join(root, FP32_PARAMS_OPTIMIZER))
    dist.barrier()
    names = _from_rank0(list_files(staged) if layout.rank == 0 else None)
    mine = _share(names)
    for name in mine:
        fsync_path(os.path.join(staged, name))
    entries = {k: v for part in _gather(describe_files(staged, mine)) for k, v in part.items()}
    if layout.rank == 0:
        write_manifest(staged, entries)
        for directory in {os.path.dirname(os.path.join(staged, n)) for n in names} | {staged}:
            fsync_path(directory)
        old = None
        if os.path.exists(final):  # a re-save of this tag: the new one replaces it whole
            old = os.path.join(save_dir, f".{tag}.old-{staging.rsplit('-', 1)[1]}")
            os.replace(final, old)
        os.replace(staged, final)
        fsync_path(save_dir)
        if old is not None:
            shutil.rmtree(old)
        atomic_write_text(os.path.join(save_dir, "latest"), tag)
    dist.barrier()
    return final


def latest_tag(load_dir: str) -> str:
    path = os.path.join(load_dir, "latest")
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint in {load_dir!r}: the file 'latest' is missing")
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


def verify_checkpoint(load_dir: str, tag: str | None = None) -> str:
    """Check `<load_dir>/<tag or latest>` against its manifest before anything is read (collective: each rank
    checksums a share); returns the tag. A `CheckpointError` names every problem."""
    tag = tag or latest_tag(load_dir)
    tag_dir = os.path.join(load_dir, tag)
    problems: list[str] = []
    manifest: dict = {}
    if dist.get_rank() == 0:
        if not os.path.isdir(tag_dir):
            left = glob.glob(os.path.join(load_dir, f".{tag}.old-*"))
            hint = (
                f" (a save was interrupted while replacing it; the previous version is {left[0]})"
                if left
                else ""
            )
            problems.append(f"{tag_dir} does not exist{hint}")
        else:
            try:
                manifest = read_manifest(tag_dir)
                problems += [f"{n} is not in the manifest" for n in unlisted_files(tag_dir, manifest)]
            except ValueError as e:
                problems.append(str(e))
    manifest = _from_rank0(manifest if not problems else None) or {}
    if manifest:
        problems += [
            p for part in _gather(verify_files(tag_dir, manifest, _share(sorted(manifest)))) for p in part
        ]
    problems = _from_rank0(problems)  # rank 0's list holds every rank's findings
    if problems:
        shown = "; ".join(problems[:10]) + (
            f"; ... ({len(problems) - 10} more)" if len(problems) > 10 else ""
        )
        raise CheckpointError(f"checkpoint {tag_dir} is damaged or incomplete: {shown}")
    return tag


def load_checkpoint(engine: Any, load_dir: str, tag: str | None = None, verify: bool = True) -> dict:
    """Restore model (and, unless model-only, optimizer and client state); returns the client state.
    `verify=False` only when `verify_checkpoint` already checked this tag."""
    layout: ParallelLayout = engine.glm53_layout
    tag = verify_checkpoint(load_dir, tag) if verify else (tag or latest_tag(load_dir))
    root = os.path.join(load_dir, tag, "glm53")
    meta = read_layout(root)
    if (meta["ep"], meta["etp"]) != (layout.ep, layout.etp):
        raise CheckpointError(
            f"{root} was saved with EP={meta['ep']}, ETP={meta['etp']}; this run has EP={layout.ep}, ETP={layout.etp} "
            "(convert it with `python -m glm53_ds.convert` to change the layout)"
        )
    client_state: dict = {}
    if not meta.get("model_only"):
        with (
            moe_checkpoint_files_off(engine),
            weights_only_loads(),
        ):  # the model comes from glm53's files below
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
        raise CheckpointError(
            f"{root}: checkpoint does not match the model: missing {missing[:10]}, unexpected {unexpected[:10]}"
        )
    with torch.no_grad():
        for reader in readers:
            for name, tensor in reader.items():
                if tuple(tensor.shape) != tuple(current[name].shape):
                    raise CheckpointError(
                        f"{root}: {name} has shape {tuple(tensor.shape)}, the model {tuple(current[name].shape)}"
                    )
                current[name].copy_(tensor)
    side = getattr(engine, "glm53_fp32_params", None)
    if side is not None and not meta.get("model_only"):
        with weights_only_loads():
            side.load_state_dict(torch.load(os.path.join(root, FP32_PARAMS_OPTIMIZER), map_location="cpu",
                                            weights_only=True))  # fmt: skip
    if engine.zero_optimization_stage() == 0 and not meta.get("model_only"):
        with weights_only_loads():
            state = torch.load(
                os.path.join(root, f"optimizer_rank{layout.rank:05d}.pt"),
                map_location="cpu",
                weights_only=True,
            )
        engine.optimizer.load_state_dict(state)
    return client_state or {}


def export_engine_to_hf(
    engine: Any, cfg: Glm53Config, out_dir: str, template: str | None = None, force: bool = False
) -> None:
    """From a running job: save a checkpoint into a fresh temporary directory beside `out_dir`, then rank 0
    converts it (`native_to_hf`: the output appears whole; with `force` into an existing directory, only the files
    the export writes are replaced) and removes the temporary directory it created. Collective."""
    work = _from_rank0(new_temp_dir(f"{out_dir.rstrip('/')}.native") if dist.get_rank() == 0 else None)
    try:
        tag_dir = save_checkpoint(engine, work, "export")
        if dist.get_rank() == 0:
            if template:
                shutil.copyfile(
                    os.path.join(template, "config.json"), os.path.join(tag_dir, "glm53", "hf_config.json")
                )
            native_to_hf(tag_dir, out_dir, hf_template=template, force=force)
        dist.barrier()
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(work, ignore_errors=True)  # created by this run
