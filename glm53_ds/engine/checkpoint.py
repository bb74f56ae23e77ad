"""Checkpoints of a running engine: what the engine adds to the format `glm53_ds/checkpoint/` owns.

DeepSpeed's engine checkpoint keeps what it manages well (ZeRO optimizer partitions, one file per rank; client
state); it is written into the staged tag beside glm53's own files. The model itself is written in glm53's tensor
sets, because DeepSpeed's native MoE path finds experts by module names GLM-5.3 does not use, and names its model
file by model-parallel (ETP) rank only: it is written by one EP rank, so the experts of the other EP ranks sharing
that ETP rank are not in it (the test shows it). Every tensor's set and every read derive from its placement
(`checkpoint/placement.py`): global rank 0 writes the replicated set, each expert shard's expert-data-parallel rank
0 writes that shard; the layout-free optimizer state is read from the engine's optimizers per parameter
(`ParamOptimizerState`) and written spread over the ranks holding it.

In bf16 runs the parameters HF keeps in fp32 are fp32 buffers the engine never casts (`fp32_params.py`), so
checkpoints and exports hold them at full precision, in the released dtypes. DeepSpeed's pickled files are read with
`weights_only` (a file holding anything but tensors and plain data is refused, nothing in it runs).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import (
    CLIENT_STATE,
    FP32_PARAMS_OPTIMIZER,
    OPTIMIZER,
    REPLICATED,
    CheckpointDir,
    CheckpointError,
    ShardWriter,
    StagedTag,
    TensorPlacement,
    expert_set_name,
    global_shape,
    latest_tag,
    layout_record,
    moved,
    optimizer_rank_file,
    placement,
    verify_checkpoint,
    write_index,
    write_layout,
)
from ..checkpoint.publish import from_rank0, gather
from ..config import Glm53Config
from ..convert.export_adapter import native_to_peft
from ..convert.export_hf import Fp8Requantiser, native_to_hf
from ..layers.block_fp8 import block_fp8_left_out, block_fp8_state_names, is_block_fp8
from ..layers.lora import is_lora_param, merged_state_dict
from ..safe_io import disk_full_said, new_temp_dir
from .deepspeed_internals import (
    ADAM_MOMENTS,
    ParamOptimizerState,
    moe_checkpoint_files_off,
    one_model_states_writer,
    weights_only_loads,
)
from .handle import Glm53Engine

__all__ = ["CheckpointError", "check_checkpoint_fits", "engine_layout_record", "export_engine_to_hf", "export_engine_to_peft",
           "layout_record", "load_checkpoint", "read_client_state", "save_checkpoint", "spread",
           "verify_checkpoint"]  # fmt: skip


def _atomic_save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def engine_layout_record(engine: Glm53Engine) -> dict[str, Any]:
    layout = engine.layout
    return layout_record(layout.world_size, layout.ep, layout.etp, layout.sp, engine.zero_optimization_stage(),
                         engine.bfloat16_enabled())  # fmt: skip


def _lora_meta(engine: Glm53Engine) -> dict[str, Any]:
    """layout.json's record of the model's LoRA adapters (`lora`: rank, alpha, dropout, targets), when it has some:
    what an adapter export (`convert/export_adapter.py`) reads."""
    spec = getattr(engine.module, "lora_spec", None)
    return {} if spec is None else {"lora": spec.record()}


def model_placements(engine: Glm53Engine) -> dict[str, TensorPlacement]:
    """Every tensor of the model's state dict (buffers too; not `_extra_state`) with this rank's placement."""
    shard = engine.layout.expert_shard(engine.module.glm)
    return {
        name: placement(name, global_shape(name, tuple(t.shape), shard), shard)
        for name, t in engine.module.state_dict().items()
        if not name.endswith("_extra_state") and t is not None
    }


def _write_model(
    engine: Glm53Engine, root: str, state: dict[str, torch.Tensor], places: dict[str, TensorPlacement],
    meta: dict[str, Any],
) -> None:  # fmt: skip
    """The model's sets from `state`: global rank 0 the replicated one (and layout.json, `meta` plus the config),
    each expert shard's expert-data-parallel rank 0 that shard, every tensor into the set its placement names."""
    layout = engine.layout
    own = expert_set_name(layout.ep_rank, layout.etp_rank)
    if layout.rank == 0:  # in the state dict's order
        _write_set(
            root, REPLICATED, state, [n for n in state if n in places and places[n].stored_set == REPLICATED]
        )
    if dist.get_rank(layout.expert_dp_group) == 0:  # an expert-less model writes an empty set
        _write_set(root, own, state, sorted(n for n in state if n in places and places[n].stored_set == own))
    if layout.rank == 0:
        write_layout(root, dict(meta, config=engine.module.glm.to_text_dict()))


def _write_set(root: str, set_name: str, state: dict[str, torch.Tensor], names: list[str]) -> None:
    writer = ShardWriter(root, set_name)
    for name in names:
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


def _write_portable_optimizer(engine: Glm53Engine, root: str, places: dict[str, TensorPlacement]) -> int:
    """The layout-free optimizer state: per trained tensor, keyed by its native name, `<name>:exp_avg`,
    `<name>:exp_avg_sq` and, where the model holds it in another dtype, `<name>:master` (fp32), in the set
    `optimizer_<the tensor's own set>`, shaped as the model's tensor. Every rank holding a tensor's state gets it
    whole (`ParamOptimizerState.get`), so the writing is spread: the replicated tensors over all ranks, a shard's
    over its expert-DP group (`spread`), each rank into files of its own (`<set>-rank<R>-NNNNN.safetensors`);
    global rank 0 writes each set's index from the parts. Collective; returns the step count."""
    layout, trained = engine.layout, _trained(engine)
    group = {False: (layout.world_size, layout.rank),
             True: (dist.get_world_size(layout.expert_dp_group), dist.get_rank(layout.expert_dp_group))}  # fmt: skip
    sets = [OPTIMIZER + (places[name].stored_set if name in places else REPLICATED) for name, _, _ in trained]
    expert = [s != OPTIMIZER + REPLICATED for s in sets]
    mine: set[int] = set()  # indices into `trained` this rank writes
    for kind in (False, True):
        members = [i for i in range(len(trained)) if expert[i] == kind]
        size, rank = group[kind]
        owners = spread([trained[i][1].numel() for i in members], size)
        mine |= {i for i, owner in zip(members, owners, strict=True) if owner == rank}
    writers: dict[str, ShardWriter] = {}
    for i, (name, tensor, access) in enumerate(trained):
        values = access.get(tensor)  # collective under ZeRO
        if i not in mine:
            continue
        if sets[i] not in writers:
            writers[sets[i]] = ShardWriter(root, sets[i], file_stem=f"{sets[i]}-rank{layout.rank:05d}")
        writer = writers[sets[i]]
        for key in ADAM_MOMENTS:
            writer.add(f"{name}:{key}", values[key])
        if tensor.dtype != torch.float32:
            writer.add(f"{name}:master", values["master"])
    parts = gather({set_name: w.finish() for set_name, w in writers.items()})
    if layout.rank == 0:
        names = [OPTIMIZER + REPLICATED] + [
            OPTIMIZER + expert_set_name(e, t) for e in range(layout.ep) for t in range(layout.etp)
        ]
        for name in names:  # every set indexed, an expert-less model's empty ones too
            write_index(root, f"{name}.index.json", [p[name] for p in parts if name in p])
    step = max((a.step() for a in _optimizers(trained)), default=0)
    return int(from_rank0(step))


def _first_non_finite(model: Any) -> str | None:
    """The first tensor of the model's state (parameters, buffers: the fp32-kept ones too) holding inf / NaN on any
    rank, as `name (rank R)`, or None. Collective: one host read per rank and one gather."""
    named = [(n, t) for n, t in model.state_dict().items()
             if t is not None and t.is_floating_point() and not is_block_fp8(t)]  # FP8: a frozen base as loaded  # fmt: skip
    bad = None
    if named:
        flags = torch.stack([~torch.isfinite(t).all() for _, t in named]).nonzero()  # the one host read
        bad = f"{named[int(flags[0])][0]} (rank {dist.get_rank()})" if flags.numel() else None
    return next((b for b in gather(bad) if b is not None), None)


def frozen_base(engine: Glm53Engine) -> set[str]:
    """The state-dict names of the frozen parameters (a LoRA run's base), HF's fp32-kept ones of a bf16 engine
    (buffers there) and a base kept in block-FP8 (buffers: the FP8 weights and their scales) included."""
    frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
    side = engine.fp32_params
    return frozen | set(side.frozen if side is not None else ()) | block_fp8_state_names(engine.module)


def save_checkpoint(
    engine: Glm53Engine,
    save_dir: str,
    tag: str,
    client_state: dict | None = None,
    adapters_only: bool = False,
) -> str:
    """Save as `<save_dir>/<tag>` (whole or not at all: `StagedTag`) and point `latest` at it; returns the tag
    directory. `adapters_only`: without the frozen base (`frozen_base`), which a resume loads from its own source
    first (layout.json records `adapters_only`); the trained tensors, the buffers (the router's correction bias) and
    the optimizer and run state as always. A model holding inf / NaN anywhere is refused before anything is written
    (`CheckpointError`; `latest` stays on the previous tag). Collective."""
    layout = engine.layout
    bad = _first_non_finite(engine.module)
    if bad is not None:
        raise CheckpointError(f"refusing to save {os.path.join(save_dir, tag)}: {bad} holds inf / NaN values "
                              "(nothing was written; 'latest' is unchanged)")  # fmt: skip
    staged = StagedTag.begin(save_dir, tag)
    with disk_full_said(save_dir, staged.staged, f"the save of {tag}"):
        # DeepSpeed's model file: a frozen base in FP8 is buffers; one writer per ETP rank
        with (
            block_fp8_left_out(engine.module),
            one_model_states_writer(engine.ds, layout, save_dir, staged.staging),
        ):
            engine.ds.save_checkpoint(save_dir, tag=staged.staging, client_state=client_state or {},
                                      save_latest=False, exclude_frozen_parameters=adapters_only)  # fmt: skip
        root = staged.model_dir
        os.makedirs(root, exist_ok=True)
        places = model_placements(engine)
        step = _write_portable_optimizer(engine, root, places)
        meta = dict(engine_layout_record(engine), optimizer_state=dict(step=step), model_only=False,
                    adapters_only=adapters_only, **_lora_meta(engine))  # fmt: skip
        state = engine.module.state_dict()
        if adapters_only:
            base = frozen_base(engine)
            state = {n: t for n, t in state.items() if n not in base}
        _write_model(engine, root, state, places, meta)
        if layout.rank == 0:  # step, data position, RNG: read back at any layout
            _atomic_save(client_state or {}, os.path.join(root, CLIENT_STATE))
        if engine.zero_optimization_stage() == 0:
            _atomic_save(engine.optimizer.state_dict(), os.path.join(root, optimizer_rank_file(layout.rank)))
        side = engine.fp32_params
        if side is not None and layout.rank == 0:  # replicated and identical on every rank
            _atomic_save(side.state_dict(), os.path.join(root, FP32_PARAMS_OPTIMIZER))
        return staged.publish()


def read_client_state(load_dir: str, tag: str) -> dict[str, Any]:
    """The trainer's state a checkpoint records (step, consumed samples, global batch, data identity, RNG), read
    safely; empty for a converted (model-only) checkpoint."""
    ckpt = CheckpointDir(load_dir, tag)
    path = ckpt.path(CLIENT_STATE)
    if not os.path.isfile(path):
        return {}
    ckpt.check(CLIENT_STATE)
    with weights_only_loads():
        return dict(torch.load(path, map_location="cpu", weights_only=True))


def check_checkpoint_fits(
    load_dir: str, tag: str, cfg: Glm53Config, here: dict[str, Any], model_only: bool = False
) -> dict[str, Any]:
    """`CheckpointDir.check_fits` of `<load_dir>/<tag>` (another model config; another layout without layout-free
    optimizer state: refused before any work); returns layout.json."""
    ckpt = CheckpointDir(load_dir, tag)
    ckpt.check_fits(cfg, here, model_only)
    return ckpt.meta


def _model_from_glm53_files(src: dict[str, Any], dst: nn.Module) -> None:
    """DeepSpeed's module load, skipped: the model comes from glm53_ds's files (checked against the model, read
    by name and placement), never from DeepSpeed's copy, whose tensors another model could take by name alone
    (a base kept in block-FP8 there, dense here: raw FP8 values copied into dense weights)."""


def load_checkpoint(
    engine: Glm53Engine, load_dir: str, tag: str | None = None, verify: bool = True, model_only: bool = False,
    keep: Callable[[str], bool] | None = None,
) -> dict:  # fmt: skip
    """Restore the model and, unless model-only, the optimizer and client state; returns the client state.

    At the layout that saved it (world size, EP, ETP, SP, ZeRO stage, dtype: `layout_record`) DeepSpeed restores its
    own partitions (bitwise). At another layout the layout-free state is used instead: each rank reads its
    placement of every model tensor (expert shards regathered for its EP x ETP shard), and of every trained tensor's
    fp32 master and Adam moments (under ZeRO only the rows of its fragment), and the step; the client state comes
    from glm53's own file. `model_only=True` loads the weights only (fresh optimizer state, step 0); `keep`: tensors
    of the model the checkpoint may lack, kept as they are (a LoRA run's fresh adapters over a base checkpoint).
    An adapter checkpoint (`save_checkpoint(adapters_only=True)`) holds no frozen base: the model must hold its base
    already; what it stores, the trained tensors among them, is loaded. `verify=False` only when `verify_checkpoint`
    already checked this tag."""
    tag = verify_checkpoint(load_dir, tag) if verify else (tag or latest_tag(load_dir))
    ckpt = CheckpointDir(load_dir, tag)
    here = engine_layout_record(engine)
    ckpt.check_fits(engine.module.glm, here, model_only)
    model_only = model_only or ckpt.model_only
    portable = not model_only and bool(moved(ckpt.meta, here))
    if portable and not ckpt.has_set(OPTIMIZER + REPLICATED):
        raise CheckpointError(
            f"{ckpt.root}: layout.json records optimizer state but its tensor sets are missing"
        )

    client_state: dict = {}
    if not model_only and not portable:
        with (
            moe_checkpoint_files_off(engine.ds),
            weights_only_loads(),
        ):  # the model comes from glm53's files below
            _, client_state = engine.ds.load_checkpoint(load_dir, tag=tag, load_module_strict=False,
                                                        load_optimizer_states=True, load_lr_scheduler_states=True,
                                                        custom_load_fn=_model_from_glm53_files)  # fmt: skip

    # the model: every tensor of the state dict (buffers too), this rank's placement
    places = model_placements(engine)
    current = engine.module.state_dict()
    stored = ckpt.keys()
    if keep is not None:
        places = {n: p for n, p in places.items() if n in stored or not keep(n)}
    if ckpt.adapters_only:  # the base is loaded already
        base = frozen_base(engine)
        places = {n: p for n, p in places.items() if n not in base or n in stored}
    missing, unexpected = sorted(set(places) - stored), sorted(stored - set(places))
    if missing or unexpected:
        raise CheckpointError(
            f"{ckpt.root}: checkpoint does not match the model: missing {missing[:10]}, unexpected {unexpected[:10]}"
        )
    saved_dtypes = {}  # what each tensor was saved in (the portable optimizer load below needs it)
    with torch.no_grad():
        for name, where in places.items():
            tensor = ckpt.read(where)
            current[name].copy_(tensor)
            saved_dtypes[name] = tensor.dtype

    if portable:
        _load_portable_optimizer(engine, ckpt, places, saved_dtypes)
        return read_client_state(load_dir, tag)
    if not model_only:
        side = engine.fp32_params
        with weights_only_loads():
            if side is not None:
                side.load_state_dict(torch.load(ckpt.path(FP32_PARAMS_OPTIMIZER), map_location="cpu",
                                                weights_only=True))  # fmt: skip
            if engine.zero_optimization_stage() == 0:
                state = torch.load(ckpt.path(optimizer_rank_file(engine.layout.rank)), map_location="cpu",
                                   weights_only=True)  # fmt: skip
                engine.optimizer.load_state_dict(state)
    return client_state or {}


def _load_portable_optimizer(
    engine: Glm53Engine, ckpt: CheckpointDir, places: dict[str, TensorPlacement],
    saved_dtypes: dict[str, torch.dtype],
) -> None:  # fmt: skip
    """Every trained tensor's fp32 master (stored, or else the stored model value) and Adam moments, this rank's
    placement (narrowed under ZeRO to the rows of its fragment), into whatever optimizer holds it now; the Adam
    step of every state set to the stored step. The model's tensors are loaded already (`saved_dtypes`: the dtype
    each was saved in)."""
    trained = _trained(engine)
    step = ckpt.optimizer_step
    assert step is not None
    for access in _optimizers(trained):
        access.prepare(step)
    keys = ckpt.keys(OPTIMIZER)
    for name, tensor, access in trained:
        whole = places[name]
        fragment = access.fragment(tensor)  # under ZeRO: this rank holds the state of a part only
        part = whole if fragment is None else whole.fragment_rows(*fragment)
        values = {}
        for key in ADAM_MOMENTS:
            if f"{name}:{key}" not in keys:
                raise CheckpointError(f"{ckpt.root}: no optimizer state {key} for {name}")
            values[key] = ckpt.read(part, f"{name}:{key}", prefix=OPTIMIZER)
        master = f"{name}:master"
        if master not in keys:  # saved in fp32: the model's value is the master
            values["master"] = ckpt.read(whole).float()
            access.set(tensor, values)
            continue
        # saved in bf16: where this rank holds only part of the master and the parameter is bf16 too, the parameter
        # keeps the saved weight it was loaded with (the master rounded); otherwise it is the master, read whole
        if fragment is not None and saved_dtypes.get(name) == tensor.dtype:
            values["master"] = ckpt.read(part, master, prefix=OPTIMIZER)
            values["weight"] = tensor
        else:
            values["master"] = ckpt.read(whole, master, prefix=OPTIMIZER)
        access.set(tensor, values)


def save_merged_model(engine: Glm53Engine, save_dir: str, tag: str) -> str:
    """A model-only checkpoint of the running model as `<save_dir>/<tag>` (the layout a conversion writes: model
    sets and layout.json, published whole), LoRA adapters merged into their weights (`merged_state_dict`), no
    optimizer state; what an export converts. Collective; returns the tag directory."""
    return _save_model_only(engine, save_dir, tag, merged_state_dict(engine.module), {})


def _save_model_only(
    engine: Glm53Engine, save_dir: str, tag: str, state: dict[str, torch.Tensor], meta: dict[str, Any]
) -> str:
    staged = StagedTag.begin(save_dir, tag)
    os.makedirs(staged.model_dir, exist_ok=True)
    meta = dict(engine_layout_record(engine), model_only=True, **meta)
    _write_model(engine, staged.model_dir, state, model_placements(engine), meta)
    return staged.publish()


def export_engine_to_peft(engine: Glm53Engine, out_dir: str, force: bool = False) -> list[str]:
    """From a running LoRA job: its adapters as a PEFT adapter at `out_dir` (`convert/export_adapter.py`), through
    a model-only adapter checkpoint in a fresh temporary directory beside it (removed after); returns the notices
    (what PEFT cannot express), on every rank; a failure is every rank's (`CheckpointError`). Collective."""
    adapters = {n: t for n, t in engine.module.state_dict().items() if is_lora_param(n)}
    work = from_rank0(new_temp_dir(f"{out_dir.rstrip('/')}.native") if dist.get_rank() == 0 else None)
    outcome: tuple[list[str], str | None] = ([], None)
    try:
        tag_dir = _save_model_only(
            engine, work, "adapters", adapters, dict(adapters_only=True, **_lora_meta(engine))
        )
        if dist.get_rank() == 0:
            try:
                outcome = (native_to_peft(tag_dir, out_dir, force=force), None)
            except (OSError, ValueError) as e:
                outcome = ([], f"--export-adapter {out_dir}: {e}")
        notices, error = from_rank0(outcome)
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(work, ignore_errors=True)  # created by this run
    if error is not None:
        raise CheckpointError(error)
    return list(notices)


def export_engine_to_hf(
    engine: Glm53Engine, cfg: Glm53Config, out_dir: str, template: str | None = None, force: bool = False,
    tokenizer: str | None = None, fp8_like: str | None = None,
) -> str | None:  # fmt: skip
    """From a running job: save the model (LoRA adapters merged: `save_merged_model`) into a fresh temporary
    directory beside `out_dir`, then rank 0
    converts it (`native_to_hf`: the output appears whole; with `force` into an existing directory, only the files
    the export writes are replaced) and removes the temporary directory it created. `tokenizer`: "bytes" or the
    tokenizer directory the export carries (`native_to_hf`). `fp8_like`: an FP8 checkpoint whose block-FP8 tensors
    are written requantised in its layout (`Fp8Requantiser`); returns its error summary (else None). Collective."""
    work = from_rank0(new_temp_dir(f"{out_dir.rstrip('/')}.native") if dist.get_rank() == 0 else None)
    summary = None
    try:
        tag_dir = save_merged_model(engine, work, "export")
        if dist.get_rank() == 0:
            config_json = os.path.join(template, "config.json") if template else None
            requantiser = Fp8Requantiser(fp8_like, cfg) if fp8_like else None
            native_to_hf(tag_dir, out_dir, hf_template=template, force=force, config_json=config_json,
                         tokenizer=tokenizer, requantiser=requantiser)  # fmt: skip
            summary = requantiser.summary() if requantiser is not None else None
        dist.barrier()
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(work, ignore_errors=True)  # created by this run
    return from_rank0(summary)
