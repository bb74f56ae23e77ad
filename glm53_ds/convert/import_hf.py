"""Released HF checkpoint -> native training layout for a given EP x ETP (model-only, loadable by `--load`).

Streaming: tensors are read one at a time with positioned reads (`safetensors_file.py`: no file mapping, each
header parsed once), and the output goes through size-bounded writers; the largest thing held is one native
tensor (a fused dense `linear_fc1`, or one shard's stacked experts of one layer) plus the current output file.
FP8 input: tensors stored as float8 with a `<name>_scale_inv` companion are dequantised (see `fp8.py`).
The output directory is built under a temporary name and renamed when complete.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable, Iterator

import torch
from tqdm import tqdm

from ..checkpoint import DEFAULT_SHARD_BYTES, ShardWriter, expert_set_name, placement, write_layout
from ..checkpoint.directory import write_latest
from ..checkpoint.placement import copies, index_placement
from ..checkpoint.safetensors_file import SafetensorsSet, check_plain_file_name
from ..config import Glm53Config
from ..layers.block_fp8 import FP8_DTYPES
from ..model import build_model
from ..parallel.expert_shard import ExpertShard, expert_tensor_kind
from ..safe_io import (
    check_output_dir,
    describe_files,
    list_files,
    staged_dir,
    write_manifest,
)
from .fp8 import Fp8Format, check_scale_spellings, is_fp8_scale_name, scale_name
from .names import (
    Placement,
    canonical_text_name,
    is_mtp_name,
    is_mtp_shared_duplicate,
    released_layout,
    split_to_released,
)

NATIVE_TAG = "hf"


class ConversionError(ValueError):
    pass


class HFSource:
    """A released checkpoint directory, read one tensor at a time (FP8 dequantised, spellings normalised)."""

    def __init__(self, directory: str, fp8_dtype: torch.dtype = torch.bfloat16) -> None:
        self.directory, self.fp8_dtype = directory, fp8_dtype
        self.files = SafetensorsSet(directory)
        self.weight_map = self.files.weight_map
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                self.weight_map.update(json.load(f)["weight_map"])
        else:
            for name in sorted(n for n in os.listdir(directory) if n.endswith(".safetensors")):
                self.weight_map.update({k: name for k in self.files.file(name).keys()})
        if not self.weight_map:
            raise FileNotFoundError(f"{directory!r}: no safetensors weights")
        for file_name in set(self.weight_map.values()):
            check_plain_file_name(file_name, directory)
        missing_files = sorted(
            {f for f in self.weight_map.values() if not os.path.isfile(os.path.join(directory, f))}
        )
        if missing_files:
            raise FileNotFoundError(f"{directory}: index names shard(s) that do not exist: {missing_files}")
        check_scale_spellings(list(self.weight_map), directory)
        self.fp8 = _fp8_format(directory)

    def fp8_format(self, name: str) -> Fp8Format:
        """The block format of FP8 tensor `name` (refused when config.json does not state one: never assumed)."""
        if self.fp8 is None:
            raise ConversionError(f"{self.directory}: {name} is stored as FP8 but config.json has no "
                                  "quantization_config.weight_block_size (the scale block is never assumed)")  # fmt: skip
        return self.fp8

    def dtype(self, name: str) -> torch.dtype | None:
        return self.files.dtype(name)

    def fp8_scale(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """The fp32 block scales of stored FP8 weight `name` (read as stored), checked against the block format."""
        scale = self.raw(self.scale_of(name))
        self.fp8_format(name).check_scale(name, tuple(weight.shape), tuple(scale.shape))
        return scale.float()

    def scale_of(self, name: str) -> str:
        scale = scale_name(name)
        if scale not in self.weight_map:
            raise ConversionError(f"{name} is stored as FP8 but has no {scale} to dequantise it")
        return scale

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def tensors(self, names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(stored name, tensor as stored) one at a time."""
        for name in self.keys() if names is None else names:
            yield name, self.raw(name)

    def raw(self, name: str) -> torch.Tensor:
        return self.files.read(name)

    def read(self, name: str) -> torch.Tensor:
        tensor = self.raw(name)
        if tensor.dtype in FP8_DTYPES:
            tensor = (
                self.fp8_format(name)
                .dequantize(name, tensor, self.raw(self.scale_of(name)))
                .to(self.fp8_dtype)
            )
        if tensor.dtype not in (
            torch.float32,
            torch.bfloat16,
            torch.float16,
        ):  # int bits would convert as values
            raise ConversionError(f"{self.directory}: {name} is stored as {str(tensor.dtype).removeprefix('torch.')}; "
                                  "released weights are float32, bfloat16, float16 or FP8 with scales")  # fmt: skip
        return tensor

    def released_names(self, cfg: Glm53Config) -> dict[str, tuple[str, int | None]]:
        """released name -> (stored name, piece index within the stored tensor or None)."""
        out: dict[str, tuple[str, int | None]] = {}
        for stored in self.weight_map:
            if is_fp8_scale_name(stored):
                continue
            name = canonical_text_name(stored)
            if name is None or is_mtp_shared_duplicate(name, cfg):
                continue
            if any(
                name.endswith(s)
                for s in (".self_attn.conv1d.weight", ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
            ):
                shape = self._shape(stored)
                pieces = split_to_released(name, torch.empty(shape, device="meta"), cfg)
                for i, (released, _) in enumerate(pieces):
                    out[released] = (stored, i)
            else:
                out[split_to_released(name, torch.empty(0, device="meta"), cfg)[0][0]] = (stored, None)
        return out

    @staticmethod
    def _piece(stored: str, piece: int | None, tensor: torch.Tensor, cfg: Glm53Config) -> torch.Tensor:
        """The released tensor `piece` of a stored one (stored tensors in fused spellings hold several)."""
        return split_to_released(canonical_text_name(stored) or stored, tensor, cfg)[piece or 0][1]

    def released_shape(
        self, released: str, where: tuple[str, int | None], cfg: Glm53Config
    ) -> tuple[int, ...]:
        stored, piece = where
        return tuple(self._piece(stored, piece, torch.empty(self._shape(stored), device="meta"), cfg).shape)

    def _shape(self, name: str) -> list[int]:
        return self.files.shape(name)

    def read_released(self, released: str, where: tuple[str, int | None], cfg: Glm53Config) -> torch.Tensor:
        stored, piece = where
        tensor = self._piece(stored, piece, self.read(stored), cfg)
        return (
            tensor if piece is None else tensor.clone()
        )  # a piece of a fused tensor: do not keep the rest alive


def _fp8_format(directory: str) -> Fp8Format | None:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return Fp8Format.of_config(json.load(f), path)


@functools.lru_cache(maxsize=4)
def _shapes_cached(config_json: str, mtp: bool) -> tuple[tuple[str, tuple[int, ...]], ...]:
    cfg = Glm53Config.from_text_dict(json.loads(config_json))
    with torch.device("meta"):
        model = build_model(cfg, mtp=mtp)
    return tuple((k, tuple(v.shape)) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor))


def expected_native_shapes(cfg: Glm53Config, mtp: bool) -> dict[str, tuple[int, ...]]:
    """Shapes of the full (EP = ETP = 1) native state dict, from the model definition built on the meta device
    (no weights; its size depends on the layer count, not on the tensors)."""
    return dict(_shapes_cached(json.dumps(cfg.to_text_dict(), sort_keys=True), mtp))


def _check(
    cfg: Glm53Config,
    available: dict[str, tuple[str, int | None]],
    layout: dict[str, list[Placement]],
    source: HFSource,
) -> None:
    missing = [n for n in layout if n not in available]
    extra = [n for n in available if n not in layout and not is_mtp_name(n, cfg)]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:20])}")
    if extra:
        problems.append(f"unexpected {len(extra)} tensor(s): {', '.join(extra[:20])}")
    if problems:
        raise ConversionError(f"{source.directory}: " + "; ".join(problems))


def hf_to_native(
    hf_dir: str, out: str, ep: int = 1, etp: int = 1, dtype: torch.dtype | None = None, force: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = False,
) -> str:  # fmt: skip
    """Write the native layout for EP x ETP; returns `out`."""
    cfg = Glm53Config.from_hf(hf_dir)
    try:
        layout_shard = ExpertShard.for_config(cfg, ep=ep, etp=etp)
    except ValueError as error:  # name the option at fault
        option = (
            f"--ep {ep}" if not isinstance(ep, int) or ep < 1 or cfg.n_routed_experts % ep else f"--etp {etp}"
        )
        raise ConversionError(f"{option}: {error}") from error
    check_output_dir(out, "--out", force=force, inputs={"--hf-dir": hf_dir})
    source = HFSource(hf_dir, fp8_dtype=dtype or torch.bfloat16)
    available = source.released_names(cfg)
    mtp = cfg.num_nextn_predict_layers > 0 and any(is_mtp_name(n, cfg) for n in available)
    layout = released_layout(cfg, mtp=mtp)
    _check(cfg, available, layout, source)
    shapes = expected_native_shapes(cfg, mtp)
    mismatched = []
    for released, placements in layout.items():
        stored_shape = source.released_shape(released, available[released], cfg)
        for p in placements:
            want = (
                tuple(torch.empty(shapes[p.native], device="meta")[p.index].shape)
                if p.index
                else shapes[p.native]
            )
            if stored_shape != want:
                mismatched.append(f"{released}: checkpoint shape {stored_shape}, expected {want}")
    if mismatched:
        raise ConversionError(
            f"{hf_dir}: shape mismatch for {len(mismatched)} tensor(s): " + "; ".join(mismatched[:20])
        )

    with staged_dir(out) as tmp:  # built under a temporary name, removed on failure
        root = os.path.join(tmp, NATIVE_TAG, "glm53")
        bar = _progress(len(layout), progress)

        def convert(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype) if dtype is not None and t.is_floating_point() else t

        # replicated tensors: group released pieces by native key (fused dense fc1 = gate + up)
        by_native: dict[str, list[tuple[str, Placement]]] = {}
        for released, placements in layout.items():
            for p in placements:
                by_native.setdefault(p.native, []).append((released, p))
        writer = ShardWriter(root, "replicated", shard_bytes)
        for native, pieces in by_native.items():
            if expert_tensor_kind(native):
                continue
            if len(pieces) == 1 and not pieces[0][1].index:
                tensor = source.read_released(pieces[0][0], available[pieces[0][0]], cfg)
            else:
                tensor = torch.cat([source.read_released(r, available[r], cfg) for r, _ in pieces])
            writer.add(native, convert(tensor))
            bar(len(pieces))
        writer.close()

        # expert shards: each released expert tensor is a box of its native grouped tensor (`placement.py`); a
        # shard's tensor is filled from the released tensors overlapping its placement, one at a time
        expert_natives = [n for n in by_native if expert_tensor_kind(n)]
        for shard in layout_shard.all_shards():
            writer = ShardWriter(root, expert_set_name(shard.ep_rank, shard.etp_rank), shard_bytes)
            for native in expert_natives:
                target = placement(native, shapes[native], shard)
                stacked: torch.Tensor | None = None  # this shard's stacked experts, filled in place
                for released, p in by_native[native]:
                    box = index_placement(native, shapes[native], p.index)
                    overlaps = list(copies(target, box))
                    if not overlaps:
                        continue
                    piece = source.read_released(released, available[released], cfg).reshape(box.local_shape)
                    if stacked is None:
                        stacked = piece.new_empty(target.local_shape)
                    for src, dst in overlaps:
                        stacked[dst] = piece[src]
                    del piece
                    if shard.etp_rank == 0:
                        bar(1)
                assert stacked is not None
                writer.add(native, convert(stacked))
                del stacked
            writer.close()

        write_layout(root, dict(ep=ep, etp=etp, world_size=None, model_only=True, config=cfg.to_text_dict()))
        shutil.copyfile(os.path.join(hf_dir, "config.json"), os.path.join(root, "hf_config.json"))
        tag_dir = os.path.join(tmp, NATIVE_TAG)
        write_manifest(tag_dir, describe_files(tag_dir, list_files(tag_dir)))  # what --load verifies first
        write_latest(tmp, NATIVE_TAG)
    return out


def _progress(total: int, enabled: bool) -> Callable[..., object]:
    if not enabled:
        return lambda n=1: None
    bar = tqdm(total=total, desc="convert", unit="tensor")
    return lambda n=1: bar.update(n)
