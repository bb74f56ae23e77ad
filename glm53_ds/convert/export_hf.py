"""Native training layout -> a directory `transformers` loads (the released naming), streaming.

Each released tensor is read as the slices it needs from the native files (an expert's rows from every ETP
shard of its EP rank), written through a size-bounded writer, and the directory is built under a temporary name
and renamed when complete (an existing output is refused without `force`). Tensors the training model does not
hold (the vision tower) are copied unchanged from `template`; `config.json` is the one the weights came from
(kept verbatim in the native checkpoint), else the template's, else generated.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import torch
from tqdm import tqdm

from ..config import Glm53Config
from ..model import Glm53Model, build_model
from ..parallel.expert_shard import DOWN, ExpertShard, expert_tensor_kind
from ..safe_io import check_output_dir, read_manifest, staged_dir, verify_files
from .import_hf import ConversionError, HFSource
from .names import Placement, released_layout
from .native_format import (
    DEFAULT_SHARD_BYTES,
    ShardReader,
    ShardWriter,
    expert_set_name,
    latest_tag,
    read_layout,
)
from .tokenizer_files import TOKENIZER_FILES, write_byte_tokenizer

SMALL_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32,
                    projection_intermediate_size=32)  # fmt: skip


def native_root(ckpt: str) -> str:
    """`ckpt` may be the checkpoint directory (with `latest`), a tag directory, or its `glm53/` directory."""
    for candidate in (ckpt, os.path.join(ckpt, "glm53")):
        if os.path.isfile(os.path.join(candidate, "layout.json")):
            return candidate
    if os.path.isfile(os.path.join(ckpt, "latest")):
        return os.path.join(ckpt, latest_tag(ckpt), "glm53")
    raise FileNotFoundError(f"{ckpt!r} is not a glm53_ds checkpoint (no layout.json, no 'latest')")


class NativeCheckpoint:
    """A native checkpoint's model, read as single tensors or released-layout slices. Every file it reads (layout,
    the kept config, the model sets' indexes and shards) is checked against the tag's manifest first: size and
    CRC-32, never a file the manifest does not list (a damaged export is refused, not written)."""

    def __init__(self, ckpt: str) -> None:
        self.root = native_root(ckpt)
        self._tag_dir = os.path.dirname(os.path.abspath(self.root))
        self._manifest = read_manifest(self._tag_dir)
        self._check("layout.json", *(["hf_config.json"] if os.path.isfile(os.path.join(self.root, "hf_config.json"))
                                     else []))  # fmt: skip
        self.meta = read_layout(self.root)
        self.cfg = Glm53Config.from_text_dict(self.meta["config"])
        self.ep, self.etp = self.meta["ep"], self.meta["etp"]
        self.shard = ExpertShard.for_config(self.cfg, ep=self.ep, etp=self.etp)  # the layout's rule
        self.replicated = self._open("replicated")
        self.experts = {
            (e, t): self._open(expert_set_name(e, t)) for e in range(self.ep) for t in range(self.etp)
        }
        self.mtp = any(k.startswith("mtp.") for k in self.replicated.keys())

    def _check(self, *names: str) -> None:
        """`names` (relative to the model directory) against the manifest; one error naming every problem."""
        prefix = os.path.relpath(os.path.abspath(self.root), self._tag_dir)
        paths = [os.path.normpath(os.path.join(prefix, n)) for n in names]
        problems = [f"{p} is not in the manifest" for p in paths if p not in self._manifest]
        problems += verify_files(self._tag_dir, self._manifest, [p for p in paths if p in self._manifest])
        if problems:
            raise ConversionError(
                f"checkpoint {self._tag_dir} is damaged or incomplete: " + "; ".join(problems[:10])
            )

    def _open(self, name: str) -> ShardReader:
        self._check(f"{name}.index.json")
        reader = ShardReader(self.root, name)
        self._check(*sorted(set(reader.weight_map.values())))
        return reader

    def read(self, p: Placement) -> torch.Tensor:
        """The part of the full native tensor `p` points at, assembled from the shards."""
        kind = expert_tensor_kind(p.native)
        if kind is None:
            return self.replicated.get_slice(p.native, p.index) if p.index else self.replicated.get(p.native)
        expert = p.index[0]
        assert isinstance(expert, int)
        owner = self.shard.owner(expert)
        e = self.shard.local_index(expert)
        shards = [self.experts[(owner, t)] for t in range(self.etp)]
        if kind == DOWN:  # [E_l, D, I_l] -> [D, I]
            return torch.cat([s.get_slice(p.native, (slice(e, e + 1),))[0] for s in shards], dim=1)
        rows = p.index[1]
        assert isinstance(rows, slice)
        inner = self.shard.local_intermediate
        half = 0 if rows.start == 0 else inner  # gate rows, then up rows, in each shard
        return torch.cat(
            [s.get_slice(p.native, (slice(e, e + 1), slice(half, half + inner)))[0] for s in shards]
        )

    def full_tensor(self, native: str) -> torch.Tensor:
        """A whole native tensor as a single-process (EP = ETP = 1) model holds it."""
        kind = expert_tensor_kind(native)
        if kind is None:
            return self.replicated.get(native)
        parts = [[self.experts[(e, t)].get(native) for t in range(self.etp)] for e in range(self.ep)]
        return self.shard.unshard(kind, parts)

    def released(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, placements in released_layout(self.cfg, mtp=self.mtp).items():
            pieces = [self.read(p) for p in placements]
            yield name, pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def write_hf_config(self, path: str, template: str | None, verbatim: str | None = None) -> None:
        """The config.json the weights came from, verbatim (`verbatim`, else the one kept in the checkpoint); else
        the template's with the text fields updated; else a generated one."""
        kept = verbatim or os.path.join(self.root, "hf_config.json")
        if os.path.isfile(kept):
            shutil.copyfile(kept, path)
            return
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self._hf_config(template), f, indent=2)

    def _hf_config(self, template: str | None) -> dict[str, Any]:
        if template:
            with open(os.path.join(template, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
            (config["text_config"] if "text_config" in config else config).update(self.cfg.to_text_dict())
            return config
        return dict(architectures=["Glm5NextForConditionalGeneration"], model_type="glm5_next",
                    text_config=self.cfg.to_text_dict(), vision_config=SMALL_VISION,
                    tie_word_embeddings=self.cfg.tie_word_embeddings, dtype="float32")  # fmt: skip


GENERATION_CONFIG = "generation_config.json"
# Config fields a training run may change on purpose (the export's config.json carries the run's values).
RUN_FIELDS = frozenset({"mtp_loss_weight", "num_nextn_predict_layers"})


def check_template(native: NativeCheckpoint, hf_template: str) -> None:
    """Refuse a template of another model: its text config must equal the checkpoint's (run fields aside)."""
    try:
        theirs = Glm53Config.from_hf(hf_template).to_text_dict()
    except (OSError, ValueError) as e:
        raise ConversionError(f"--hf-template {hf_template!r}: {e}") from e
    ours = native.cfg.to_text_dict()
    differ = sorted(
        k for k in set(ours) | set(theirs) if k not in RUN_FIELDS and ours.get(k) != theirs.get(k)
    )
    if differ:
        shown = ", ".join(f"{k}: checkpoint {ours.get(k)!r}, template {theirs.get(k)!r}" for k in differ[:8])
        raise ConversionError(f"--hf-template {hf_template!r} is another model than {native.root}: {shown}")


def native_to_hf(
    ckpt: str, out: str, hf_template: str | None = None, force: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = False, config_json: str | None = None,
    tokenizer: str | None = None,
) -> str:  # fmt: skip
    """Write `out` whole (built under a temporary name, removed on failure). An existing non-empty `out` is
    refused without `force`; with it only the files the export writes are replaced, nothing is deleted.
    `config_json`: the config.json to carry verbatim (a running job's --hf-dir's), before the checkpoint's own.
    `tokenizer`: "bytes" (written as a real tokenizer, `tokenizer_files`) or a directory whose tokenizer files are
    copied; default: the template's. `generation_config.json`: the template's, else the tokenizer directory's,
    else one with the model's eos / pad ids."""
    native = NativeCheckpoint(ckpt)
    check_output_dir(out, "--out", force=force, inputs={"--ckpt": ckpt, "--hf-template": hf_template})
    if hf_template:
        check_template(native, hf_template)
    with staged_dir(out) as tmp:
        writer = ShardWriter(tmp, "model", shard_bytes, index_file="model.safetensors.index.json")
        bar = tqdm(desc="export", unit="tensor") if progress else None
        for name, tensor in native.released():
            writer.add(name, tensor)
            if bar is not None:
                bar.update(1)
        if hf_template:
            source = HFSource(hf_template)
            for name in source.weight_map:
                if name.startswith(("model.visual.", "visual.")):
                    writer.add(name, source.raw(name))  # unchanged, bytes and dtype
        writer.close()
        native.write_hf_config(os.path.join(tmp, "config.json"), hf_template, verbatim=config_json)
        tokenizer_dir = tokenizer or hf_template
        if tokenizer_dir == "bytes":
            write_byte_tokenizer(tmp)
        elif tokenizer_dir:
            for name in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(tokenizer_dir, name)):
                    shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(tmp, name))
        kept = [os.path.join(d, GENERATION_CONFIG) for d in (hf_template, tokenizer) if d and d != "bytes"]
        kept = [p for p in kept if os.path.isfile(p)]
        if kept:
            shutil.copyfile(kept[0], os.path.join(tmp, GENERATION_CONFIG))
        else:
            with open(os.path.join(tmp, GENERATION_CONFIG), "w", encoding="utf-8") as f:
                json.dump(dict(eos_token_id=native.cfg.eos_token_id, pad_token_id=native.cfg.pad_token_id), f)
    return out


def load_native(ckpt: str, dtype: torch.dtype = torch.float32) -> Glm53Model:
    """A native checkpoint (any EP x ETP layout) as a single-process Glm53Model."""
    native = NativeCheckpoint(ckpt)
    model = build_model(native.cfg, dtype=dtype, mtp=native.mtp)
    state = model.state_dict()
    with torch.no_grad():
        for name, target in state.items():
            if name.endswith("_extra_state") or target is None:
                continue
            target.copy_(native.full_tensor(name).to(target.dtype))
    return model
