"""One checkpoint on disk, opened once: where its files are, what it records, and any tensor read at any layout.

`CheckpointDir(path, tag)` is the one reader training, conversion, `describe` and the HF export share. `path` may
be a checkpoint directory (its `latest` names the tag, read here and nowhere else), a tag directory, or a tag's
`glm53/` directory; a converted checkpoint (`hf-to-native`) has the same shape. Every reader checks what it reads:
the tag must have a manifest listing every file it holds, and each file is checked against it (size, CRC-32)
before it is read, unless `publish.verify_checkpoint` checked the whole tag in this process already (the trainer's
collective check before a resume: `mark_verified`). Only `describe`, which reports problems instead of reading
tensors, opens a tag with `check_files=False`. Reads go through placements
(`placement.py`): `read(target)` assembles a target placement's local tensor from the stored shards, whatever
EP x ETP wrote them.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from ..config import Glm53Config
from ..parallel.expert_shard import ExpertShard
from ..safe_io import MANIFEST, atomic_write_text, published_tags, read_manifest, unlisted_files, verify_files
from .placement import (
    REPLICATED,
    TensorPlacement,
    copies,
    expert_set_name,
    expert_split,
    global_shape,
    index_placement,
    placement,
    stored_placements,
)
from .safetensors_file import check_plain_file_name
from .tensor_sets import ShardReader

FORMAT = "glm53_ds-native-v2"
MODEL_DIR = "glm53"  # a tag's own files; DeepSpeed's sit beside it
LAYOUT = "layout.json"  # format, world size, EP, ETP, SP, ZeRO stage, dtype, the Glm53Config, model_only
HF_CONFIG = "hf_config.json"  # a converted checkpoint: the config.json the weights came from, verbatim
CLIENT_STATE = "client_state.pt"  # the trainer's step, data position and RNG, layout-free
FP32_PARAMS_OPTIMIZER = "fp32_params_optimizer.pt"  # bf16 runs: the fp32-kept parameters' optimizer state
OPTIMIZER = "optimizer_"  # prefix of the layout-free optimizer state's sets
WRITTEN_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
)  # every tensor a checkpoint holds is one of these


def optimizer_rank_file(rank: int) -> str:
    """Stage 0: each rank's optimizer state (DeepSpeed saves one copy per ETP rank, wrong for experts under EP)."""
    return f"optimizer_rank{rank:05d}.pt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the file."""


LATEST = (
    "latest"  # <checkpoint dir>/latest: the name of its newest tag (read and written only in checkpoint/)
)


def has_latest(load_dir: str) -> bool:
    return os.path.isfile(os.path.join(load_dir, LATEST))


def latest_tag(load_dir: str) -> str:
    """The tag `<load_dir>/latest` names (the one reading of that file)."""
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint in {load_dir!r}: the file 'latest' is missing")
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


TAG_PATTERN = re.compile(r"step\d+")  # the trainer's tags (`step<N>`), the names its saves replace whole


def tag_step(tag: str) -> int | None:
    """The step of a trainer's tag (`step300` -> 300), None for another name."""
    return int(tag[4:]) if TAG_PATTERN.fullmatch(tag) else None


def later_tags(directory: str, tag: str) -> list[str]:
    """The published trainer's tags of `directory` past `tag`'s step, in step order: what a run branching from `tag`
    would write over if it saved there."""
    step = tag_step(tag)
    if step is None:
        return []
    later = [(s, t) for t in published_tags(directory) if (s := tag_step(t)) is not None and s > step]
    return [t for _, t in sorted(later)]


def not_ours(save_dir: str) -> list[str]:
    """The entries of `save_dir` a run's saves would replace that no save wrote: one named like a tag (`step<N>`)
    that is not a published checkpoint (a re-save replaces a tag whole, removing the old one), and a `latest` that
    is not a file naming one of the directory's checkpoints (every save rewrites it; a save moves it only after
    publishing the tag it names)."""
    if not os.path.isdir(save_dir):
        return []
    tags = published_tags(save_dir)
    found = [n for n in sorted(os.listdir(save_dir)) if TAG_PATTERN.fullmatch(n) and n not in tags]
    if os.path.lexists(os.path.join(save_dir, LATEST)) and not _latest_names_one_of(save_dir, tags):
        found.append(LATEST)
    return found


def _latest_names_one_of(save_dir: str, tags: list[str]) -> bool:
    """`<save_dir>/latest` as `write_latest` writes it: a regular file (not a link) whose text is one of `tags`."""
    path = os.path.join(save_dir, LATEST)
    if os.path.islink(path) or not os.path.isfile(path):
        return False
    try:
        return latest_tag(save_dir) in tags
    except (OSError, UnicodeDecodeError):
        return False


def write_latest(save_dir: str, tag: str) -> None:
    """Point `<save_dir>/latest` at `tag` (atomically: the old name or the new one, never a part)."""
    atomic_write_text(os.path.join(save_dir, LATEST), tag)


def resolve(path: str, tag: str | None = None) -> tuple[str, str]:
    """(tag directory, model directory) of `path`: with `tag`, `<path>/<tag>`; else `path` itself when it is a tag
    (or its `glm53/`), else the tag `<path>/latest` names."""
    if tag is None:
        if os.path.isfile(os.path.join(path, MODEL_DIR, LAYOUT)):
            return path, os.path.join(path, MODEL_DIR)
        if os.path.isfile(os.path.join(path, LAYOUT)):  # a tag's glm53/ itself
            return os.path.dirname(os.path.normpath(path)) or ".", path
        if not has_latest(path):
            raise FileNotFoundError(f"{path!r} is not a glm53_ds checkpoint (no {LAYOUT}, no 'latest')")
        tag = latest_tag(path)
    tag_dir = os.path.join(path, tag)
    return tag_dir, os.path.join(tag_dir, MODEL_DIR)


def write_layout(model_dir: str, meta: dict[str, Any]) -> None:
    path = os.path.join(model_dir, LAYOUT)
    tmp = path + f".tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, **meta}, f, indent=2)
    os.replace(tmp, path)


def read_layout(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, LAYOUT)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_dir!r} is not a glm53_ds checkpoint (no {LAYOUT})")
    with open(path, encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {meta.get('format')!r} (expected {FORMAT})")
    return dict(meta)


def layout_record(world_size: int, ep: int, etp: int, sp: int, zero_stage: int, bf16: bool) -> dict[str, Any]:
    """What a checkpoint's layout is (layout.json): a resume whose record differs goes through the layout-free
    state instead of DeepSpeed's partitions. Known before an engine is built (the trainer checks it then)."""
    return dict(world_size=world_size, ep=ep, etp=etp, sp=sp, zero_stage=int(zero_stage),
                dtype="bf16" if bf16 else "fp32")  # fmt: skip


def moved(meta: dict[str, Any], here: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The layout keys that differ between a checkpoint and this run. Checkpoints written before SP, ZeRO stage and
    dtype were recorded hold world size, EP and ETP only; what they do not record counts as unchanged."""
    return {k: (meta[k], v) for k, v in here.items() if k in meta and meta[k] != v}


# Tags `publish.verify_checkpoint` checked whole in this process (every file against the manifest, collectively),
# keyed by their real path, with the manifest's identity then: their readers skip the per-file check.
_VERIFIED: dict[str, tuple[int, int, int]] = {}


def _manifest_identity(tag_dir: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(os.path.join(tag_dir, MANIFEST))
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def mark_verified(tag_dir: str) -> None:
    identity = _manifest_identity(tag_dir)
    if identity is not None:
        _VERIFIED[os.path.realpath(tag_dir)] = identity


def _is_verified(tag_dir: str) -> bool:
    identity = _VERIFIED.get(os.path.realpath(tag_dir))
    return identity is not None and identity == _manifest_identity(tag_dir)


class CheckpointDir:
    """A checkpoint tag: its layout record, model config, tensor sets (opened once each), and reads at any
    layout."""

    def __init__(self, path: str, tag: str | None = None, check_files: bool = True) -> None:
        self.tag_dir, self.root = resolve(path, tag)
        try:
            self._manifest = (
                read_manifest(self.tag_dir) if check_files and not _is_verified(self.tag_dir) else None
            )
        except ValueError as e:  # no manifest (a killed save's staging directory), or not one of ours
            raise CheckpointError(str(e)) from e
        if self._manifest is not None:
            unlisted = unlisted_files(self.tag_dir, self._manifest)
            if unlisted:
                raise CheckpointError(f"checkpoint {self.tag_dir} is damaged or incomplete: {unlisted[0]} is not "
                                      "in the manifest")  # fmt: skip
        if os.path.isfile(os.path.join(self.root, HF_CONFIG)):
            self.check(HF_CONFIG)
        self.check(LAYOUT)
        self.meta = read_layout(self.root)
        stored = self.meta.get("config")
        self.cfg = Glm53Config.from_text_dict(stored) if stored else None
        self.ep, self.etp = int(self.meta["ep"]), int(self.meta["etp"])
        self._sets: dict[str, ShardReader] = {}

    # ------------------------------------------------------------------ what it records
    @property
    def model_only(self) -> bool:
        return bool(self.meta.get("model_only", True))

    @property
    def adapters_only(self) -> bool:
        """A LoRA run's save without its frozen base (the base comes from where the run state records)."""
        return bool(self.meta.get("adapters_only", False))

    @property
    def optimizer_step(self) -> int | None:
        """The step of the layout-free optimizer state, None when the checkpoint holds none."""
        state = self.meta.get("optimizer_state")
        return int(state["step"]) if state else None

    @property
    def model_config(self) -> Glm53Config:
        """The model config it records (every checkpoint glm53_ds writes records one)."""
        if self.cfg is None:
            raise CheckpointError(f"{self.root}: {LAYOUT} does not record the model config")
        return self.cfg

    @property
    def saved_shard(self) -> ExpertShard:
        """Any shard of the layout that wrote it (its EP and ETP sizes)."""
        return ExpertShard.for_config(self.model_config, ep=self.ep, etp=self.etp)

    @property
    def has_mtp(self) -> bool:
        return any(k.startswith("mtp.") for k in self.tensor_set(REPLICATED).keys())

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def check_fits(self, cfg: Glm53Config, here: dict[str, Any], model_only: bool = False) -> None:
        """Refuse, before any work, a checkpoint this run cannot continue from, with one message naming why: another
        model config (every differing key, e.g. the expert count), or, at another layout (`here`: `layout_record`'s
        keys), no layout-free optimizer state (an older checkpoint). `model_only`: only the weights are needed."""
        if self.cfg is not None:
            stored, mine = self.meta["config"], cfg.to_text_dict()
            differ = sorted(k for k in set(stored) | set(mine) if stored.get(k) != mine.get(k))
            if differ:
                shown = ", ".join(
                    f"{k}: {stored.get(k)!r} in the checkpoint, {mine.get(k)!r} here" for k in differ[:8]
                )
                raise CheckpointError(
                    f"{self.root} holds another model config ({shown}); it cannot be resumed by this model"
                )
        if model_only or self.model_only:
            return
        changed = moved(self.meta, here)
        if changed and self.optimizer_step is None:
            shown = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
            raise CheckpointError(
                f"{self.root} has no layout-free optimizer state (saved before glm53_ds kept it); it resumes only at "
                f"its own layout ({shown}); --load-model-only starts fresh optimizer state from its weights"
            )

    # ------------------------------------------------------------------ tensor sets
    def check(self, *names: str) -> None:
        """`names` (relative to the model directory) against the manifest (unless the tag was verified whole or
        opened with `check_files=False`), one error naming every problem; every read of a file of the tag passes
        here first."""
        if self._manifest is None:
            return
        prefix = os.path.relpath(os.path.abspath(self.root), os.path.abspath(self.tag_dir))
        paths = [os.path.normpath(os.path.join(prefix, n)) for n in names]
        problems = [f"{p} is not in the manifest" for p in paths if p not in self._manifest]
        problems += verify_files(self.tag_dir, self._manifest, [p for p in paths if p in self._manifest])
        if problems:
            raise CheckpointError(
                f"checkpoint {self.tag_dir} is damaged or incomplete: " + "; ".join(problems[:10])
            )

    def has_set(self, name: str) -> bool:
        return os.path.isfile(self.path(f"{name}.index.json"))

    def tensor_set(self, name: str) -> ShardReader:
        if name not in self._sets:
            self.check(f"{name}.index.json")
            reader = ShardReader(self.root, name)
            self.check(*sorted(set(reader.weight_map.values())))
            self._sets[name] = reader
        return self._sets[name]

    def keys(self, prefix: str = "") -> set[str]:
        """Every stored key of the model sets (`prefix` "") or the optimizer state's (`OPTIMIZER`)."""
        return set(self.tensor_set(prefix + REPLICATED).keys()) | set(
            self.tensor_set(prefix + expert_set_name(0, 0)).keys()
        )

    # ------------------------------------------------------------------ reads through placements
    def stored_shape(self, name: str, key: str | None = None, prefix: str = "") -> tuple[int, ...]:
        """The global shape of stored tensor `key` of parameter `name` (from its first stored part)."""
        key = key or name
        if expert_split(name) is None:
            return tuple(self.tensor_set(prefix + REPLICATED).shape(key))
        local = tuple(self.tensor_set(prefix + expert_set_name(0, 0)).shape(key))
        return global_shape(name, local, self.saved_shard)

    def read(self, target: TensorPlacement, key: str | None = None, prefix: str = "") -> torch.Tensor:
        """The local tensor of `target` from stored tensor `key` (default: the parameter's own), assembled from the
        stored parts it overlaps; zeros where a narrowed placement has no block. A stored tensor of another global
        shape is refused, naming both."""
        key = key or target.name
        shape = self.stored_shape(target.name, key, prefix)
        if shape != target.global_shape:
            raise CheckpointError(f"{self.root}: {key} has shape {shape}, the model {target.global_shape}")
        out: torch.Tensor | None = None
        for source in self._stored_parts(target.name, shape):
            reader = self.tensor_set(prefix + source.stored_set)
            if source.blocks == target.blocks and source.local_shape == target.local_shape:
                # the stored part is the target (a replicated tensor, the same layout)
                return self._written_dtype(key, reader.get(key))
            for src, dst in copies(target, source):
                piece = self._written_dtype(key, reader.get_slice(key, src))
                if out is None:
                    out = (torch.empty if target.complete else torch.zeros)(
                        target.local_shape, dtype=piece.dtype
                    )
                out[dst] = piece
        return out if out is not None else torch.zeros(target.local_shape)

    def _written_dtype(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """A stored tensor in a dtype glm53_ds never writes (int32 bits read as values, say) is refused."""
        if tensor.dtype not in WRITTEN_DTYPES:
            raise CheckpointError(f"{self.root}: {key} is stored as {str(tensor.dtype).removeprefix('torch.')}; "
                                  "glm53_ds writes its tensors as float32, bfloat16 or float16 only")  # fmt: skip
        return tensor

    def _stored_parts(self, name: str, shape: tuple[int, ...]) -> list[TensorPlacement]:
        if expert_split(name) is None:
            return [placement(name, shape, _ANY_SHARD)]
        return stored_placements(name, shape, self.saved_shard)

    def read_index(self, name: str, index: tuple[int | slice, ...] = ()) -> torch.Tensor:
        """`tensor[index]` of the global tensor `name` (a released tensor's piece: `convert/names.py`)."""
        target = index_placement(name, self.stored_shape(name), index)
        out = self.read(target)
        return out[tuple(0 if isinstance(i, int) else slice(None) for i in index)]

    def full_tensor(self, name: str) -> torch.Tensor:
        """A whole tensor as a single-process (EP = ETP = 1) model holds it."""
        saved = self.saved_shard
        whole = ExpertShard(saved.n_experts, saved.intermediate)  # EP = ETP = 1
        return self.read(placement(name, self.stored_shape(name), whole))

    # ------------------------------------------------------------------ completeness (describe)
    def problems(self) -> list[str]:
        """What is missing or damaged: the model sets, every expert shard, the layout-free optimizer state it
        records, each index's file names, and the manifest (every file with its size and CRC-32, nothing
        unlisted). Reads metadata and checksums only."""
        problems: list[str] = []
        names = set(os.listdir(self.root))
        if not any(n.startswith(REPLICATED) for n in names):
            problems.append("the replicated model files are missing")
        missing = self.missing_expert_sets()
        if missing:
            problems.append(f"expert shards missing: {', '.join(missing)}")
        if self.optimizer_step is not None:
            sets = [REPLICATED] + [expert_set_name(e, t) for e in range(self.ep) for t in range(self.etp)]
            lost = [OPTIMIZER + s for s in sets if f"{OPTIMIZER}{s}.index.json" not in names]
            if lost:
                problems.append(f"layout-free optimizer state missing: {', '.join(lost)}")
        for index in sorted(n for n in names if n.endswith(".index.json")):
            try:
                with open(self.path(index), encoding="utf-8") as f:
                    for file_name in set(json.load(f)["weight_map"].values()):
                        check_plain_file_name(file_name, self.root)
            except (ValueError, KeyError, AttributeError) as e:
                problems.append(f"{index}: {e}")
        try:
            manifest = read_manifest(self.tag_dir)
        except ValueError as e:
            return problems + [str(e)]
        problems += [f"{n} is not in the manifest" for n in unlisted_files(self.tag_dir, manifest)]
        return problems + verify_files(self.tag_dir, manifest, sorted(manifest))

    def manifest_summary(self) -> tuple[int, int] | None:
        """(files, bytes) the manifest lists; None without a readable manifest."""
        try:
            manifest = read_manifest(self.tag_dir)
        except ValueError:
            return None
        return len(manifest), sum(int(str(e.get("size", 0))) for e in manifest.values())

    def missing_expert_sets(self) -> list[str]:
        names = os.listdir(self.root)
        shards = [expert_set_name(e, t) for e in range(self.ep) for t in range(self.etp)]
        return [s for s in shards if not any(n.startswith(s) for n in names)]


_ANY_SHARD = ExpertShard(1, 1)  # a replicated tensor's placement does not depend on the shard
