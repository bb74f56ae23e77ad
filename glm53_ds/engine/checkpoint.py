"""Checkpoints of an EP x ETP DeepSpeed run whose files never collide.

DeepSpeed's engine checkpoint keeps what it manages well (ZeRO optimizer partitions, one file per rank;
client state). The model itself is written by glm53_ds in the native format (`convert/native_format.py`),
because DeepSpeed's native MoE path finds experts by module names GLM-5.3 does not use, and names its model
file by model-parallel (ETP) rank only: it is written by one EP rank, so the experts of the other EP ranks
sharing that ETP rank are not in it (the test shows it). Under `<dir>/<tag>/glm53/`:

    replicated.*                          every non-expert tensor (written by global rank 0)
    experts_ep<EEE>_etp<TTT>.*            one expert shard (written by expert-data-parallel rank 0 of it)
    optimizer_replicated.*                the layout-free optimizer state (fp32 masters, Adam moments) of every
    optimizer_experts_ep<EEE>_etp<TTT>.*  non-expert tensor / of one expert shard, keyed by native name; the files
                                          written by many ranks (`<set>-rank<R>-NNNNN`), one index per set
    optimizer_rank<RRRRR>.pt              stage 0 only: each rank's optimizer state (DeepSpeed saves one copy
                                          per ETP rank, which is wrong for expert moments under EP)
    client_state.pt                       the trainer's step, data position and RNG (rank 0)
    layout.json                           format, world size, EP, ETP, SP, ZeRO stage, dtype, config
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
import math
import os
import shutil
import uuid
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..config import Glm53Config
from ..convert.export_hf import native_to_hf
from ..convert.native_format import (
    ShardReader,
    ShardWriter,
    expert_set_name,
    latest_tag,
    read_layout,
    write_index,
    write_layout,
)
from ..parallel.expert_shard import ExpertShard, expert_tensor_kind
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
from .deepspeed_internals import (
    ADAM_MOMENTS,
    ParamOptimizerState,
    moe_checkpoint_files_off,
    weights_only_loads,
)
from .handle import Glm53Engine

FP32_PARAMS_OPTIMIZER = "fp32_params_optimizer.pt"  # bf16 runs: the fp32-kept parameters' optimizer state
CLIENT_STATE = "client_state.pt"  # the trainer's step, data position and RNG, layout-free
REPLICATED = "replicated"


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


def layout_record(world_size: int, ep: int, etp: int, sp: int, zero_stage: int, bf16: bool) -> dict[str, Any]:
    """What a checkpoint's layout is (layout.json): a resume whose record differs goes through the layout-free
    state instead of DeepSpeed's partitions. Known before an engine is built (the trainer checks it then)."""
    return dict(world_size=world_size, ep=ep, etp=etp, sp=sp, zero_stage=int(zero_stage),
                dtype="bf16" if bf16 else "fp32")  # fmt: skip


def engine_layout_record(engine: Glm53Engine) -> dict[str, Any]:
    layout = engine.layout
    return layout_record(layout.world_size, layout.ep, layout.etp, layout.sp, engine.zero_optimization_stage(),
                         engine.bfloat16_enabled())  # fmt: skip


def _write_replicated(model: Any, layout: ParallelLayout, root: str, state: dict[str, torch.Tensor],
                      expert_names: set[str], meta: dict[str, Any]) -> None:  # fmt: skip
    """Every non-expert tensor and layout.json (global rank 0)."""
    if layout.rank != 0:
        return
    writer = ShardWriter(root, "replicated")
    for name, t in state.items():
        if name not in expert_names:
            writer.add(name, t)
    writer.close()
    cfg = getattr(model, "glm", None)
    write_layout(root, dict(meta, model_only=False, config=cfg.to_text_dict() if cfg is not None else None))


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


def _trained(engine: Glm53Engine) -> list[tuple[str, torch.Tensor, ParamOptimizerState]]:
    """Every trained tensor with what holds its optimizer state, in the same order on every rank: the model's
    trainable parameters, then (bf16) HF's fp32-kept parameters, which have their own fp32 optimizer."""
    access = ParamOptimizerState(engine.optimizer)
    out: list[tuple[str, torch.Tensor, ParamOptimizerState]] = [
        (n, p, access) for n, p in engine.module.named_parameters() if p.requires_grad
    ]
    side = engine.fp32_params
    if side is not None:
        side_access = ParamOptimizerState(side.optimizer)
        out += [(n, t, side_access) for n, t in side.named]
    return out


def _optimizers(trained: list[tuple[str, torch.Tensor, ParamOptimizerState]]) -> list[ParamOptimizerState]:
    """The distinct optimizers behind `_trained`'s tensors (the engine's, and the fp32-kept parameters')."""
    return list({id(a): a for _, _, a in trained}.values())


def spread(sizes: Sequence[int], writers: int) -> list[int]:
    """Which of `writers` writes each tensor: the largest first, each to the writer with the fewest bytes so far
    (ties: the lower index), so that each writes about 1/writers of the bytes. The same answer on every rank."""
    load, owner = [0] * writers, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner[i] = min(range(writers), key=lambda w: (load[w], w))
        load[owner[i]] += sizes[i]
    return owner


def _write_portable_optimizer(engine: Glm53Engine, layout: ParallelLayout, root: str) -> int:
    """The layout-free optimizer state: per trained tensor, keyed by its native name, `<name>:exp_avg`,
    `<name>:exp_avg_sq` and, where the model holds it in another dtype, `<name>:master` (fp32), in the model's
    sets: `optimizer_replicated`, and `optimizer_experts_ep<E>_etp<T>` holding the shard's local experts as the
    model's tensors do. Every rank holding a tensor's state gets it whole (`ParamOptimizerState.get`), so the
    writing is spread: the replicated tensors over all ranks, a shard's over its expert-DP group (`spread`), each
    rank into files of its own (`<set>-rank<R>-NNNNN.safetensors`); global rank 0 writes each set's index from
    the parts. Collective; returns the step count."""
    trained = _trained(engine)
    group = {False: (layout.world_size, layout.rank),
             True: (dist.get_world_size(layout.expert_dp_group), dist.get_rank(layout.expert_dp_group))}  # fmt: skip
    set_name = {False: f"optimizer_{REPLICATED}",
                True: f"optimizer_{expert_set_name(layout.ep_rank, layout.etp_rank)}"}  # fmt: skip
    mine: set[int] = set()  # indices into `trained` this rank writes
    for expert in (False, True):
        members = [i for i, (_, t, _) in enumerate(trained) if is_expert_param(t) == expert]
        size, rank = group[expert]
        owners = spread([trained[i][1].numel() for i in members], size)
        mine |= {i for i, owner in zip(members, owners, strict=True) if owner == rank}
    writers: dict[bool, ShardWriter] = {}
    for i, (name, tensor, access) in enumerate(trained):
        values = access.get(tensor)  # collective under ZeRO
        if i not in mine:
            continue
        expert = is_expert_param(tensor)
        if expert not in writers:
            writers[expert] = ShardWriter(
                root, set_name[expert], file_stem=f"{set_name[expert]}-rank{layout.rank:05d}"
            )
        writer = writers[expert]
        for key in ADAM_MOMENTS:
            writer.add(f"{name}:{key}", values[key])
        if tensor.dtype != torch.float32:
            writer.add(f"{name}:master", values["master"])
    parts = _gather({set_name[expert]: w.finish() for expert, w in writers.items()})
    if layout.rank == 0:
        names = [f"optimizer_{REPLICATED}"] + [
            f"optimizer_{expert_set_name(e, t)}" for e in range(layout.ep) for t in range(layout.etp)
        ]
        for name in names:  # every set indexed, an expert-less model's empty ones too
            write_index(root, f"{name}.index.json", [p[name] for p in parts if name in p])
    step = max((a.step() for a in _optimizers(trained)), default=0)
    return int(_from_rank0(step))


def _first_non_finite(model: Any) -> str | None:
    """The first tensor of the model's state (parameters, buffers: the fp32-kept ones too) holding inf / NaN on any
    rank, as `name (rank R)`, or None. Collective: one host read per rank and one gather."""
    named = [(n, t) for n, t in model.state_dict().items() if t is not None and t.is_floating_point()]
    bad = None
    if named:
        flags = torch.stack([~torch.isfinite(t).all() for _, t in named]).nonzero()  # the one host read
        bad = f"{named[int(flags[0])][0]} (rank {dist.get_rank()})" if flags.numel() else None
    return next((b for b in _gather(bad) if b is not None), None)


def save_checkpoint(engine: Glm53Engine, save_dir: str, tag: str, client_state: dict | None = None) -> str:
    """Save as `<save_dir>/<tag>` (whole or not at all) and point `latest` at it; returns the tag directory.
    A model holding inf / NaN anywhere is refused before anything is written (`CheckpointError`; `latest` stays on
    the previous tag). Collective."""
    layout = engine.layout
    if not tag or tag.startswith(".") or os.sep in tag:
        raise ValueError(f"checkpoint tag {tag!r}: expected a plain name such as step300")
    bad = _first_non_finite(engine.module)
    if bad is not None:
        raise CheckpointError(f"refusing to save {os.path.join(save_dir, tag)}: {bad} holds inf / NaN values "
                              "(nothing was written; 'latest' is unchanged)")  # fmt: skip
    staging = f".{tag}.tmp-{_from_rank0(uuid.uuid4().hex[:8])}"
    staged, final = os.path.join(save_dir, staging), os.path.join(save_dir, tag)
    engine.ds.save_checkpoint(save_dir, tag=staging, client_state=client_state or {}, save_latest=False)
    root = os.path.join(staged, "glm53")
    os.makedirs(root, exist_ok=True)
    model = engine.module
    expert_names = {n for n, p in model.named_parameters() if is_expert_param(p)}
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state") and v is not None}
    step = _write_portable_optimizer(engine, layout, root)
    meta = dict(engine_layout_record(engine), optimizer_state=dict(step=step))
    _write_replicated(model, layout, root, state, expert_names, meta)
    _write_experts(layout, root, state, expert_names)
    if layout.rank == 0:  # step, data position, RNG: read back at any layout
        _atomic_save(client_state or {}, os.path.join(root, CLIENT_STATE))
    if engine.zero_optimization_stage() == 0:
        _atomic_save(engine.optimizer.state_dict(), os.path.join(root, f"optimizer_rank{layout.rank:05d}.pt"))
    side = engine.fp32_params
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
        if os.path.lexists(final):  # a re-save of this tag: the new one replaces it whole
            old = os.path.join(save_dir, f".{tag}.old-{staging.rsplit('-', 1)[1]}")
            os.replace(final, old)
        os.replace(staged, final)
        fsync_path(save_dir)
        if old is not None and os.path.islink(old):
            os.unlink(old)  # a tag that was a link: the link goes, what it pointed at stays
        elif old is not None:
            shutil.rmtree(old)
        atomic_write_text(os.path.join(save_dir, "latest"), tag)
    dist.barrier()
    return final


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


def read_client_state(load_dir: str, tag: str) -> dict[str, Any]:
    """The trainer's state a checkpoint records (step, consumed samples, global batch, data identity, RNG), read
    safely; empty for a converted (model-only) checkpoint."""
    path = os.path.join(load_dir, tag, "glm53", CLIENT_STATE)
    if not os.path.isfile(path):
        return {}
    with weights_only_loads():
        return dict(torch.load(path, map_location="cpu", weights_only=True))


def check_checkpoint_fits(
    load_dir: str, tag: str, cfg: Glm53Config, here: dict[str, Any], model_only: bool = False
) -> dict[str, Any]:
    """Refuse, before any work, a checkpoint this run cannot continue from, with one message naming why: another
    model config (every differing key, e.g. the expert count), or, at another layout (`here`:
    `layout_record`'s keys, known before the engine is built), no layout-free optimizer state (an older
    checkpoint). `model_only` (or a model-only checkpoint): only the weights are needed. Returns layout.json."""
    root = os.path.join(load_dir, tag, "glm53")
    meta = read_layout(root)
    stored = meta.get("config")
    if stored is not None:
        mine = cfg.to_text_dict()
        differ = sorted(k for k in set(stored) | set(mine) if stored.get(k) != mine.get(k))
        if differ:
            shown = ", ".join(
                f"{k}: {stored.get(k)!r} in the checkpoint, {mine.get(k)!r} here" for k in differ[:8]
            )
            raise CheckpointError(
                f"{root} holds another model config ({shown}); it cannot be resumed by this model"
            )
    if model_only or meta.get("model_only"):
        return meta
    moved = _moved(meta, here)
    if moved and "optimizer_state" not in meta:
        shown = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in moved.items())
        raise CheckpointError(
            f"{root} has no layout-free optimizer state (saved before glm53_ds kept it); it resumes only at its own "
            f"layout ({shown}); --load-model-only starts fresh optimizer state from its weights"
        )
    return meta


def _moved(meta: dict[str, Any], here: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The layout keys that differ between a checkpoint and this run. Checkpoints written before SP, ZeRO stage and
    dtype were recorded hold world size, EP and ETP only; what they do not record counts as unchanged."""
    return {k: (meta[k], v) for k, v in here.items() if k in meta and meta[k] != v}


class _StoredSets:
    """A checkpoint's tensor sets by name (opened once), and this rank's part of any stored tensor at any layout."""

    def __init__(self, root: str, meta: dict[str, Any], cfg: Glm53Config, target: ExpertShard) -> None:
        self.root, self.target = root, target
        self.saved = ExpertShard.for_config(cfg, ep=int(meta["ep"]), etp=int(meta["etp"]))
        self._open: dict[str, ShardReader] = {}

    def _reader(self, name: str) -> ShardReader:
        if name not in self._open:
            self._open[name] = ShardReader(self.root, name)
        return self._open[name]

    def has(self, prefix: str) -> bool:
        return os.path.isfile(os.path.join(self.root, f"{prefix}{REPLICATED}.index.json"))

    def keys(self, prefix: str = "") -> set[str]:
        keys = set(self._reader(f"{prefix}{REPLICATED}").keys())
        return keys | set(self._reader(f"{prefix}{expert_set_name(0, 0)}").keys())

    def read(self, name: str, key: str, prefix: str = "") -> torch.Tensor:
        """Stored tensor `key` of parameter `name`: replicated as is, a grouped expert tensor as this rank's shard
        gathered from the stored shards (any EP / ETP)."""
        kind = expert_tensor_kind(name)
        if kind is None:
            return self._reader(f"{prefix}{REPLICATED}").get(key)
        return self.target.gather_from(
            self.saved,
            kind,
            lambda e, t, index: self._reader(f"{prefix}{expert_set_name(e, t)}").get_slice(key, index),
        )

    def read_part(self, name: str, key: str, part: tuple[int, int] | None, prefix: str = "") -> torch.Tensor:
        """`read`, but of a replicated tensor only the rows that hold the flattened range `part` = (start, numel),
        in a tensor of the whole shape (zeros elsewhere). Whole when `part` is None and for scalars."""
        if part is None:
            return self.read(name, key, prefix)
        if expert_tensor_kind(name) is not None:
            raise ValueError(f"{name}: an expert tensor is read as this rank's shard (read), not by range")
        reader = self._reader(f"{prefix}{REPLICATED}")
        shape, (start, numel) = reader.shape(key), part
        if not shape:
            return self.read(name, key, prefix)
        row = math.prod(shape[1:])  # elements per leading-dimension row
        first, end = start // row, -(-(start + numel) // row)
        rows = reader.get_slice(key, (slice(first, end),)) if numel else torch.zeros(0)
        out = torch.zeros(shape, dtype=rows.dtype if numel else torch.float32)
        out.view(-1)[first * row : first * row + rows.numel()] = rows.reshape(-1)
        return out


def load_checkpoint(
    engine: Glm53Engine, load_dir: str, tag: str | None = None, verify: bool = True, model_only: bool = False
) -> dict:
    """Restore the model and, unless model-only, the optimizer and client state; returns the client state.

    At the layout that saved it (world size, EP, ETP, SP, ZeRO stage, dtype: `layout_record`) DeepSpeed restores its
    own partitions (bitwise). At another layout the layout-free state is used instead: each rank reads its part of
    every model tensor (expert shards regathered for its EP x ETP shard), and of every trained tensor's fp32 master
    and Adam moments, and the step; the client state comes from glm53's own file. `model_only=True` loads the
    weights only (fresh optimizer state, step 0). `verify=False` only when `verify_checkpoint` already checked
    this tag."""
    layout = engine.layout
    tag = verify_checkpoint(load_dir, tag) if verify else (tag or latest_tag(load_dir))
    root = os.path.join(load_dir, tag, "glm53")
    model = engine.module
    cfg: Glm53Config = model.glm
    here = engine_layout_record(engine)
    meta = check_checkpoint_fits(load_dir, tag, cfg, here, model_only)
    model_only = model_only or bool(meta.get("model_only"))
    same_layout = not _moved(meta, here)
    sets = _StoredSets(root, meta, cfg, layout.expert_shard(cfg))
    portable = not model_only and not same_layout
    if portable and not sets.has("optimizer_"):
        raise CheckpointError(f"{root}: layout.json records optimizer state but its tensor sets are missing")

    client_state: dict = {}
    if not model_only and same_layout:
        with (
            moe_checkpoint_files_off(engine.ds),
            weights_only_loads(),
        ):  # the model comes from glm53's files below
            _, client_state = engine.ds.load_checkpoint(
                load_dir,
                tag=tag,
                load_module_strict=False,
                load_optimizer_states=True,
                load_lr_scheduler_states=True,
            )

    # the model: every tensor of the state dict (buffers too), this rank's part
    current = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    stored = sets.keys()
    missing, unexpected = sorted(set(current) - stored), sorted(stored - set(current))
    if missing or unexpected:
        raise CheckpointError(
            f"{root}: checkpoint does not match the model: missing {missing[:10]}, unexpected {unexpected[:10]}"
        )
    saved_dtypes = {}  # what each tensor was saved in (the portable optimizer load below needs it)
    with torch.no_grad():
        for name, target in current.items():
            tensor = sets.read(name, name)
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"{root}: {name} has shape {tuple(tensor.shape)}, the model {tuple(target.shape)}"
                )
            target.copy_(tensor)
            saved_dtypes[name] = tensor.dtype

    side = engine.fp32_params
    if portable:
        _load_portable_optimizer(engine, sets, int(meta["optimizer_state"]["step"]), saved_dtypes)
        client_state = read_client_state(load_dir, tag)
    elif not model_only:
        if side is not None:
            with weights_only_loads():
                side.load_state_dict(torch.load(os.path.join(root, FP32_PARAMS_OPTIMIZER), map_location="cpu",
                                                weights_only=True))  # fmt: skip
        if engine.zero_optimization_stage() == 0:
            with weights_only_loads():
                state = torch.load(
                    os.path.join(root, f"optimizer_rank{layout.rank:05d}.pt"),
                    map_location="cpu",
                    weights_only=True,
                )
            engine.optimizer.load_state_dict(state)
    return client_state or {}


def _load_portable_optimizer(
    engine: Glm53Engine, sets: _StoredSets, step: int, saved_dtypes: dict[str, torch.dtype]
) -> None:
    """Every trained tensor's fp32 master (stored, or else the stored model value) and Adam moments, this rank's
    part, into whatever optimizer holds it now; the Adam step of every state set to `step`. The model's tensors
    are loaded already (`saved_dtypes`: the dtype each was saved in)."""
    trained = _trained(engine)
    for access in _optimizers(trained):
        access.prepare(step)
    keys = sets.keys("optimizer_")
    for name, tensor, access in trained:
        # under ZeRO, of a replicated tensor: only the rows of this rank's part of the state
        part = access.fragment(tensor) if expert_tensor_kind(name) is None else None
        values = {}
        for key in ADAM_MOMENTS:
            if f"{name}:{key}" not in keys:
                raise CheckpointError(f"{sets.root}: no optimizer state {key} for {name}")
            values[key] = sets.read_part(name, f"{name}:{key}", part, prefix="optimizer_")
        master = f"{name}:master"
        if master not in keys:  # saved in fp32: the model's value is the master
            values["master"] = sets.read(name, name).float()
            access.set(tensor, values)
            continue
        # saved in bf16: where this rank holds only part of the master and the parameter is bf16 too, the parameter
        # keeps the saved weight it was loaded with (the master rounded); otherwise it is the master, read whole
        if part is not None and saved_dtypes.get(name) == tensor.dtype:
            values["master"] = sets.read_part(name, master, part, prefix="optimizer_")
            values["weight"] = tensor
        else:
            values["master"] = sets.read(name, master, prefix="optimizer_")
        access.set(tensor, values)


def export_engine_to_hf(
    engine: Glm53Engine, cfg: Glm53Config, out_dir: str, template: str | None = None, force: bool = False,
    tokenizer: str | None = None,
) -> None:  # fmt: skip
    """From a running job: save a checkpoint into a fresh temporary directory beside `out_dir`, then rank 0
    converts it (`native_to_hf`: the output appears whole; with `force` into an existing directory, only the files
    the export writes are replaced) and removes the temporary directory it created. `tokenizer`: "bytes" or the
    tokenizer directory the export carries (`native_to_hf`). Collective."""
    work = _from_rank0(new_temp_dir(f"{out_dir.rstrip('/')}.native") if dist.get_rank() == 0 else None)
    try:
        tag_dir = save_checkpoint(engine, work, "export")
        if dist.get_rank() == 0:
            config_json = os.path.join(template, "config.json") if template else None
            native_to_hf(tag_dir, out_dir, hf_template=template, force=force, config_json=config_json,
                         tokenizer=tokenizer)  # fmt: skip
        dist.barrier()
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(work, ignore_errors=True)  # created by this run
