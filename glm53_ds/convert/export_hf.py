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

from ..checkpoint import (
    DEFAULT_SHARD_BYTES,
    REPLICATED,
    CheckpointDir,
    CheckpointError,
    ShardWriter,
    expert_set_name,
)
from ..config import Glm53Config
from ..layers.block_fp8 import FP8_DTYPES
from ..model import Glm53Model, build_model
from ..safe_io import check_output_dir, staged_dir
from .fp8 import Fp8Format, quantize_fp8, scale_name
from .import_hf import ConversionError, HFSource
from .names import Placement, released_layout
from .tokenizer_files import TOKENIZER_FILES, write_byte_tokenizer

SMALL_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32,
                    projection_intermediate_size=32)  # fmt: skip


class NativeCheckpoint(CheckpointDir):
    """A native checkpoint's model for the converters: the released tensors read as boxes of the native ones
    (`names.Placement` -> `CheckpointDir.read_index`). Every file it reads (layout, the kept config, the model sets'
    indexes and shards) is checked against the tag's manifest first: size and CRC-32, never a file the manifest
    does not list (a damaged export is refused, not written)."""

    def __init__(self, ckpt: str) -> None:
        try:
            super().__init__(ckpt, check_files=True)
        except CheckpointError as e:
            raise ConversionError(str(e)) from e
        if self.cfg is None:
            raise ConversionError(f"{self.root}: layout.json does not record the model config")
        for name in [REPLICATED] + [expert_set_name(e, t) for e in range(self.ep) for t in range(self.etp)]:
            self.tensor_set(name)  # every model file checked before anything is written
        self.mtp = self.has_mtp

    def read_released(self, p: Placement) -> torch.Tensor:
        """The part of the full native tensor `p` points at, assembled from the shards."""
        return self.read_index(p.native, p.index)

    def released(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, placements in released_layout(self.model_config, mtp=self.mtp).items():
            pieces = [self.read_released(p) for p in placements]
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
            (config["text_config"] if "text_config" in config else config).update(
                self.model_config.to_text_dict()
            )
            return config
        return dict(architectures=["Glm5NextForConditionalGeneration"], model_type="glm5_next",
                    text_config=self.model_config.to_text_dict(), vision_config=SMALL_VISION,
                    tie_word_embeddings=self.model_config.tie_word_embeddings, dtype="float32")  # fmt: skip


class Fp8Requantiser:
    """`--export-format fp8`: the tensors that FP8 checkpoint `like` stores in block-FP8 written back in its layout
    (its `quantization_config` block, `weight_scale_inv` beside each), requantised from the export's dense values;
    the relative error against those values (what the dense export would hold) is measured on the way."""

    def __init__(self, like: str, cfg: Glm53Config) -> None:
        source = HFSource(like)
        self.format: Fp8Format | None = source.fp8
        if self.format is None:
            raise ConversionError(f"{like}: not an FP8 checkpoint (config.json has no quantization_config): the "
                                  "FP8 export writes the layout of the FP8 checkpoint the run started from")  # fmt: skip
        stored_fp8 = {
            released: source.dtype(stored) for released, (stored, _) in source.released_names(cfg).items()
            if source.dtype(stored) in FP8_DTYPES
        }  # fmt: skip
        other = sorted(n for n, dtype in stored_fp8.items() if dtype != torch.float8_e4m3fn)
        if other:
            raise ConversionError(f"{like}: {other[0]} is stored {stored_fp8[other[0]]}: the FP8 export writes "
                                  "float8_e4m3fn only")  # fmt: skip
        self.names = frozenset(stored_fp8)
        with open(os.path.join(like, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
        self.quantization_config: dict[str, Any] = (
            raw.get("quantization_config") or text["quantization_config"]
        )
        self.tensors, self.error2, self.norm2, self.worst = 0, 0.0, 0.0, (0.0, "")

    def add(self, writer: ShardWriter, name: str, tensor: torch.Tensor) -> None:
        if name not in self.names:
            writer.add(name, tensor)
            return
        assert self.format is not None
        q, scale_inv = quantize_fp8(tensor, self.format.block)
        dense = tensor.float()
        error2 = (self.format.dequantize(name, q, scale_inv) - dense).square().sum().item()
        norm2 = dense.square().sum().item()
        self.tensors, self.error2, self.norm2 = self.tensors + 1, self.error2 + error2, self.norm2 + norm2
        self.worst = max(self.worst, ((error2 / norm2) ** 0.5 if norm2 else 0.0, name))
        writer.add(name, q)
        writer.add(scale_name(name), scale_inv)

    def summary(self) -> str:
        assert self.format is not None
        overall = (self.error2 / self.norm2) ** 0.5 if self.norm2 else 0.0
        return (f"{self.tensors} tensors requantised to block-FP8 {self.format.block[0]}x{self.format.block[1]}: "
                f"relative error vs the dense merge {overall:.2e} overall, {self.worst[0]:.2e} at worst "
                f"({self.worst[1]})")  # fmt: skip


def drop_quantization_config(path: str) -> None:
    """A dense export's config.json carried from an FP8 checkpoint: its `quantization_config` would make loaders
    read the dense weights as FP8."""
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    sections = [config] + ([config["text_config"]] if isinstance(config.get("text_config"), dict) else [])
    if not any("quantization_config" in d for d in sections):
        return
    for d in sections:
        d.pop("quantization_config", None)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def set_quantization_config(path: str, quantization_config: dict[str, Any]) -> None:
    """An FP8 export's config.json: the FP8 checkpoint's `quantization_config`, where the carried config has none
    (a resumed run's config comes from its checkpoint)."""
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    if config.get("quantization_config") or text.get("quantization_config"):
        return
    config["quantization_config"] = quantization_config
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def say_weights_dtype(path: str, dtype: torch.dtype) -> None:
    """config.json's `dtype` (and an older `torch_dtype`, top level and text config) set to the dtype the exported
    weights are in (the one most of their elements have): a config carried from a float32 base said float32 over
    bf16 weights. A config that already says it is left byte for byte."""
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    name = str(dtype).removeprefix("torch.")
    sections = [config] + ([config["text_config"]] if isinstance(config.get("text_config"), dict) else [])
    keys = [(d, k) for d in sections for k in ("dtype", "torch_dtype") if k in d] or [(config, "dtype")]
    if all(d.get(k) == name for d, k in keys):
        return
    for d, k in keys:
        d[k] = name
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


GENERATION_CONFIG = "generation_config.json"
# Config fields a training run may change on purpose (the export's config.json carries the run's values).
RUN_FIELDS = frozenset({"mtp_loss_weight", "num_nextn_predict_layers"})


def check_template(native: NativeCheckpoint, hf_template: str) -> None:
    """Refuse a template of another model: its text config must equal the checkpoint's (run fields aside)."""
    try:
        theirs = Glm53Config.from_hf(hf_template).to_text_dict()
    except (OSError, ValueError) as e:
        raise ConversionError(f"--hf-template {hf_template!r}: {e}") from e
    ours = native.model_config.to_text_dict()
    differ = sorted(
        k for k in set(ours) | set(theirs) if k not in RUN_FIELDS and ours.get(k) != theirs.get(k)
    )
    if differ:
        shown = ", ".join(f"{k}: checkpoint {ours.get(k)!r}, template {theirs.get(k)!r}" for k in differ[:8])
        raise ConversionError(f"--hf-template {hf_template!r} is another model than {native.root}: {shown}")


def native_to_hf(
    ckpt: str, out: str, hf_template: str | None = None, force: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = False, config_json: str | None = None,
    tokenizer: str | None = None, requantiser: Fp8Requantiser | None = None,
) -> str:  # fmt: skip
    """Write `out` whole (built under a temporary name, removed on failure). An existing non-empty `out` is
    refused without `force`; with it only the files the export writes are replaced, nothing is deleted.
    `config_json`: the config.json to carry verbatim (a running job's --hf-dir's), before the checkpoint's own.
    `tokenizer`: "bytes" (written as a real tokenizer, `tokenizer_files`) or a directory whose tokenizer files are
    copied; default: the template's. `generation_config.json`: the template's, else the tokenizer directory's,
    else one with the model's eos / pad ids. `requantiser`: the FP8 checkpoint's block-FP8 tensors written in its
    layout (config.json keeps its quantization_config); without one every weight is dense and config.json carries
    none."""
    native = NativeCheckpoint(ckpt)
    if native.adapters_only:
        raise ConversionError(f"{native.root}: a LoRA run's checkpoint holds its adapters without the base weights; "
                              "export it with native-to-peft (a PEFT adapter), or merged from a run over its base "
                              "(--load it with --export-hf)")  # fmt: skip
    check_output_dir(out, "--out", force=force, inputs={"--ckpt": ckpt, "--hf-template": hf_template})
    if hf_template:
        check_template(native, hf_template)
    with staged_dir(out) as tmp:
        writer = ShardWriter(tmp, "model", shard_bytes, index_file="model.safetensors.index.json")
        total = len(released_layout(native.model_config, mtp=native.mtp))  # the text model's released tensors
        bar = tqdm(desc="export", unit="tensor", total=total) if progress else None
        elements: dict[
            torch.dtype, int
        ] = {}  # the text model's elements by dtype: what config.json's dtype says
        for name, tensor in native.released():
            if requantiser is not None:
                requantiser.add(writer, name, tensor)
            else:
                writer.add(name, tensor)
            elements[tensor.dtype] = elements.get(tensor.dtype, 0) + tensor.numel()
            if bar is not None:
                bar.update(1)
        if hf_template:
            source = HFSource(hf_template)
            for name in source.weight_map:
                if name.startswith(("model.visual.", "visual.")):
                    writer.add(name, source.raw(name))  # unchanged, bytes and dtype
        writer.close()
        native.write_hf_config(os.path.join(tmp, "config.json"), hf_template, verbatim=config_json)
        if requantiser is None:
            drop_quantization_config(os.path.join(tmp, "config.json"))
        else:
            set_quantization_config(os.path.join(tmp, "config.json"), requantiser.quantization_config)
        if elements:
            say_weights_dtype(os.path.join(tmp, "config.json"), max(elements, key=lambda d: elements[d]))
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
                json.dump(
                    dict(
                        eos_token_id=native.model_config.eos_token_id,
                        pad_token_id=native.model_config.pad_token_id,
                    ),
                    f,
                )
    return out


def load_native(ckpt: str, dtype: torch.dtype = torch.float32) -> Glm53Model:
    """A native checkpoint (any EP x ETP layout) as a single-process Glm53Model."""
    native = NativeCheckpoint(ckpt)
    model = build_model(native.model_config, dtype=dtype, mtp=native.mtp)
    state = model.state_dict()
    with torch.no_grad():
        for name, target in state.items():
            if name.endswith("_extra_state") or target is None:
                continue
            target.copy_(native.full_tensor(name).to(target.dtype))
    return model
