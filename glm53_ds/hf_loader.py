"""`load_hf(hf_dir)`: a released GLM-5.3 checkpoint (config.json + sharded safetensors) -> a ready Glm53Model;
`load_hf_into(model, hf_dir)`: the same checkpoint into a model the caller built, a `Glm53Model` or a stock
megatron `GPTModel` from the GLM-5.3 specs (any pipeline stage; each rank reads only what it holds).

Tensors are read one at a time (safetensors mmap) and copied into the model's parameters through the name
table in `convert/names.py`. Every problem is collected and reported together, naming tensors: missing ones
(by their released names), unexpected ones, and shape mismatches (key, checkpoint shape, expected shape).
Vision tensors (`model.visual.*`) are not part of the text model and are skipped.
MTP: loaded when the checkpoint has the MTP layer (`layers.<num_hidden_layers>.*`); a checkpoint without it
(e.g. a `save_pretrained` of the transformers model, which has no MTP) gives a model without MTP, unless
`mtp=True` is asked for, which then reports the missing tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from torch import nn

from .config import Glm53Config
from .convert.fp8 import is_fp8_scale_name
from .convert.import_hf import HFSource
from .convert.names import (
    Placement,
    canonical_text_name,
    is_mtp_name,
    is_mtp_shared_duplicate,
    released_expert,
    released_layout,
    split_to_released,
)
from .layers.block_fp8 import DENSE, FP8_DTYPES, KINDS, ROUTED, SHARED, block_fp8_layout
from .layers.moe import GroupedExperts
from .model import Glm53Model, build_model, freeze_padding_row
from .parallel.expert_shard import ExpertShard
from .transformer_config import Glm53TransformerConfig
from .transformer_layer import Glm53TransformerLayer

# Native (Glm53Model) parameter name -> the names that hold it in the model being filled; [] = not on this rank.
NameMap = Callable[[str], list[str]]


class CheckpointError(ValueError):
    """A checkpoint that does not match the model; the message lists every offending tensor."""


# The released-layout reader lives with the converter (one implementation, read one tensor at a time).
SafetensorsCheckpoint = HFSource


def checkpoint_has_mtp(names: list[str], cfg: Glm53Config) -> bool:
    return any(is_mtp_name(n, cfg) for n in names)


def model_expert_shard(model: nn.Module, cfg: Glm53Config) -> ExpertShard:
    """The expert shard a model was built with (every MoE layer holds the same one)."""
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            return module.shard
    return ExpertShard.for_config(cfg)


def _localize(
    released: str, piece: torch.Tensor, placement: Placement, shard: ExpertShard
) -> tuple[Placement, torch.Tensor] | None:
    """Map a full-model placement of a released tensor to this rank's shard; None if another rank holds it."""
    expert = released_expert(released)
    if expert is None or (shard.ep == 1 and shard.etp == 1):
        return placement, piece
    e, kind = expert
    if not shard.owns(e):
        return None
    local = shard.local_index(e)
    # a piece whose intermediate size is wrong stays whole, so the shape check reports it as stored
    if kind == "down_proj":
        fits = piece.dim() == 2 and piece.shape[1] == shard.intermediate
        return Placement(placement.native, (local,)), shard.slice_down(piece) if fits else piece
    fits = piece.dim() == 2 and piece.shape[0] == shard.intermediate
    return Placement(placement.native, (local, shard.gate_up_rows(kind))), shard.slice_gate(
        piece
    ) if fits else piece


def _wanted(name: str, shard: ExpertShard) -> bool:
    """Whether this rank needs the released tensor `name` at all (experts of other EP ranks are never read)."""
    expert = released_expert(name)
    return expert is None or shard.owns(expert[0])


def load_hf_state_into(
    model: nn.Module,
    checkpoint: SafetensorsCheckpoint,
    mtp: bool,
    cfg: Glm53Config | None = None,
    name_map: NameMap | None = None,
) -> None:
    """Fill `model` from a released checkpoint; each rank reads only the tensors it holds (its expert shard, its
    pipeline stage). `cfg` defaults to `model.glm`; `name_map` (default: the identity, a `Glm53Model`) places
    native names into another model's state dict."""
    if cfg is None:
        assert isinstance(model, Glm53Model), "pass cfg for a model other than Glm53Model"
        cfg = model.glm
    shard = model_expert_shard(model, cfg)
    full_layout = released_layout(cfg, mtp=mtp)
    rename = name_map or (lambda native: [native])
    layout = {
        released: [Placement(name, p.index) for p in placements for name in rename(p.native)]
        for released, placements in full_layout.items()
    }
    held = {released for released, placements in layout.items() if placements}
    state = model.state_dict()
    filled: dict[str, int] = {}
    seen: set[str] = set()
    unexpected: list[str] = []
    mismatched: list[str] = []

    def wanted(raw: str) -> bool:
        name = canonical_text_name(raw)
        if name is None or name not in full_layout or name in held:
            return name is None or _wanted(name, shard)
        return False  # a tensor of another pipeline stage

    names = [
        n for n in checkpoint.keys() if wanted(n) and not is_fp8_scale_name(n)
    ]  # scales: with their weight
    wrong_dtype: list[str] = []
    for raw_name, tensor in checkpoint.tensors(names):
        name = canonical_text_name(raw_name)
        if name is None or is_mtp_shared_duplicate(name, cfg):
            continue
        if not mtp and is_mtp_name(name, cfg):
            continue  # MTP weights present but MTP not wanted
        scale = None
        if tensor.dtype in FP8_DTYPES:
            scale = checkpoint.fp8_scale(raw_name, tensor)
            if not _block_fp8_target(state, layout.get(name, [])):  # this model holds it dense
                tensor, scale = checkpoint.fp8_format(raw_name).dequantize(raw_name, tensor, scale), None
        elif tensor.dtype not in (
            torch.float32,
            torch.bfloat16,
            torch.float16,
        ):  # int bits would load as values
            wrong_dtype.append(f"{raw_name} is stored as {str(tensor.dtype).removeprefix('torch.')}")
            continue
        elif _block_fp8_target(state, layout.get(name, [])):
            wrong_dtype.append(f"{raw_name} is stored as {str(tensor.dtype).removeprefix('torch.')}, but this model "
                               "keeps it in block-FP8 (no silent quantisation)")  # fmt: skip
            continue
        for released, piece in split_to_released(name, tensor, cfg):
            placements = layout.get(released)
            if placements is None:
                unexpected.append(raw_name if released == name else f"{raw_name} (as {released})")
                continue
            if not placements:
                continue  # this part of a fused tensor lives on another pipeline stage
            if released in seen:
                unexpected.append(f"{raw_name} (duplicate of {released})")
                continue
            seen.add(released)
            for full in placements:
                local = _localize(released, piece, full, shard)
                if local is None:
                    continue
                p, part = local
                target = state[p.native][p.index] if p.index else state[p.native]
                if tuple(part.shape) != tuple(target.shape):
                    mismatched.append(
                        f"{released}: checkpoint shape {tuple(piece.shape)}, expected {tuple(target.shape)}"
                        + (f" (this rank's part of {released})" if part is not piece else "")
                    )
                    continue
                with torch.no_grad():
                    if scale is not None:
                        _place_block_fp8(model, state, p, part, scale, shard, released)
                    else:
                        target.copy_(part.to(target.dtype))
                filled[p.native] = filled.get(p.native, 0) + target.numel()

    if wrong_dtype:
        raise CheckpointError(f"checkpoint {checkpoint.directory}: {len(wrong_dtype)} tensor(s) the model cannot "
                              f"take as stored: {_listing(wrong_dtype)}")  # fmt: skip
    missing = [n for n in layout if n in held and n not in seen and _wanted(n, shard)]  # checkpoint order
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensor(s): {_listing(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatch for {len(mismatched)} tensor(s): {_listing(mismatched)}")

    if problems:
        raise CheckpointError(
            f"checkpoint {checkpoint.directory} does not match the model: " + "; ".join(problems)
        )
    targets = {p.native for ps in layout.values() for p in ps}
    incomplete = [k for k in state if k in targets and filled.get(k, 0) != state[k].numel()]
    if incomplete:
        raise CheckpointError(f"parameters not fully covered by the checkpoint: {_listing(incomplete)}")
    uncovered = [k for k, _ in model.named_parameters() if k not in targets]
    if uncovered:
        raise CheckpointError(f"model parameters the checkpoint does not provide: {_listing(uncovered)}")


def _block_fp8_target(state: dict[str, torch.Tensor], placements: list[Placement]) -> bool:
    return any(state[p.native].dtype in FP8_DTYPES for p in placements)


def _place_block_fp8(model: nn.Module, state: dict[str, torch.Tensor], p: Placement, part: torch.Tensor,
                     scale: torch.Tensor, shard: ExpertShard, released: str) -> None:  # fmt: skip
    """Copy this rank's piece of a stored FP8 weight into its block-FP8 buffer, and the scale blocks that cover the
    piece into the buffer's scales (`layers/block_fp8.BlockLayout`: which stored blocks, in which module rows)."""
    owner_name, _, attr = p.native.rpartition(".")
    layout = block_fp8_layout(model.get_submodule(owner_name), attr)
    if part.dtype != state[p.native].dtype:
        raise CheckpointError(f"{released} is stored as {str(part.dtype).removeprefix('torch.')}; block-FP8 residence "
                              f"takes {str(state[p.native].dtype).removeprefix('torch.')} (use --base-quant none)")  # fmt: skip
    rows = next((i for i in p.index if isinstance(i, slice)), slice(0, None))
    starts = [sum(piece.length for piece in layout.rows[:k]) for k in range(len(layout.rows))]
    stored_rows, stored_cols, module_rows = layout.scale_piece(starts.index(rows.start or 0))
    experts = tuple(i for i in p.index if isinstance(i, int))
    state[p.native][p.index].copy_(part)
    state[p.native + "_scale_inv"][experts][module_rows].copy_(scale[stored_rows, stored_cols])


def block_fp8_kinds(checkpoint: SafetensorsCheckpoint, cfg: Glm53Config) -> tuple[str, ...]:
    """The module kinds (layers/block_fp8.KINDS) the checkpoint stores in block-FP8, every tensor of each. A kind
    stored partly FP8 and partly dense is refused, naming one of each (no module holds both)."""
    stored: dict[str, dict[bool, str]] = {}
    for raw in checkpoint.keys():
        name = canonical_text_name(raw)
        kind = None if name is None or is_fp8_scale_name(raw) else tensor_kind(name, cfg)
        if kind is not None:
            stored.setdefault(kind, {}).setdefault(checkpoint.dtype(raw) in FP8_DTYPES, raw)
    mixed = {k: v for k, v in stored.items() if len(v) == 2}
    if mixed:
        kind, names = next(iter(mixed.items()))
        raise CheckpointError(f"checkpoint {checkpoint.directory}: the {kind.replace('_', ' ')} are stored partly in "
                              f"FP8 ({names[True]}) and partly not ({names[False]}); block-FP8 residence needs all or "
                              "none of a kind: use --base-quant none")  # fmt: skip
    return tuple(k for k in KINDS if stored.get(k, {}).keys() == {True})


def tensor_kind(name: str, cfg: Glm53Config) -> str | None:
    if released_expert(name) is not None:
        return ROUTED
    if ".mlp.shared_experts." in name:
        return SHARED
    m = re.search(r"\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight$", name)
    return DENSE if m and int(m.group(1)) < cfg.num_hidden_layers else None


def load_hf(
    hf_dir: str, dtype: torch.dtype = torch.float32, mtp: bool | None = None, base_quant: str = "none",
    **overrides: Any,
) -> Glm53Model:  # fmt: skip
    """Build the model from `hf_dir/config.json` and load its safetensors. See the module docstring for MTP.
    `base_quant="fp8"`: the module kinds the checkpoint stores in block-FP8 stay so (frozen; layers/block_fp8.py),
    "none": dequantised to `dtype`. `overrides`: transformer-config fields (e.g. `attention_impl="eager"`)."""
    if base_quant not in ("none", "fp8"):
        raise ValueError(f"base_quant={base_quant!r}: expected 'none' or 'fp8'")
    cfg = Glm53Config.from_hf(hf_dir)
    checkpoint = SafetensorsCheckpoint(hf_dir)
    has_mtp = cfg.num_nextn_predict_layers > 0 and checkpoint_has_mtp(checkpoint.keys(), cfg)
    use_mtp = has_mtp if mtp is None else mtp
    if base_quant == "fp8":
        kinds = block_fp8_kinds(checkpoint, cfg)
        if not kinds:
            raise CheckpointError(
                f"base_quant='fp8': {hf_dir} stores no weights in block-FP8 (nothing is quantised)"
            )
        overrides = dict(
            overrides, block_fp8_modules=kinds, block_fp8_block=checkpoint.fp8_format(hf_dir).block
        )
    model = build_model(cfg, dtype=dtype, mtp=use_mtp, **overrides)
    load_hf_state_into(model, checkpoint, mtp=use_mtp)
    return model


def load_hf_into(model: nn.Module, hf_dir: str) -> nn.Module:
    """Fill a model the caller built, a `Glm53Model` or a stock megatron `GPTModel` from `get_glm53_block_spec`
    (any pipeline stage; MTP when it was built with `mtp_block_spec`), from the released checkpoint in `hf_dir`.

    Each rank reads only what it holds. The model's GLM config must equal the checkpoint's; a `GPTModel` must use
    `position_embedding_type="none"`, the checkpoint's vocabulary and its tie_word_embeddings. Errors name the
    offending option, or every missing / unexpected / wrong-shape tensor. A GPTModel's embedding also gets
    transformers' padding_idx rule (the pad token's row receives no gradient). Returns the model."""
    cfg = Glm53Config.from_hf(hf_dir)
    if isinstance(model, Glm53Model):
        _check_same_config(model.glm, cfg)
        mtp, name_map = model.mtp is not None, None
    elif isinstance(model, GPTModel):
        _check_gpt_model(model, cfg)
        mtp, name_map = model.mtp_process, gpt_model_names(model)
    else:
        raise TypeError(f"load_hf_into fills a Glm53Model or a megatron GPTModel, got {type(model).__name__}")
    load_hf_state_into(model, SafetensorsCheckpoint(hf_dir), mtp=mtp, cfg=cfg, name_map=name_map)
    if isinstance(model, GPTModel) and hasattr(model, "embedding"):
        freeze_padding_row(model.embedding.word_embeddings.weight, cfg)  # as transformers' padding_idx
    return model


def _check_same_config(model_cfg: Glm53Config, cfg: Glm53Config) -> None:
    differ = [
        f"{k}: model {v!r}, checkpoint {getattr(cfg, k)!r}"
        for k, v in vars(model_cfg).items()
        if v != getattr(cfg, k)
    ]
    if differ:
        raise CheckpointError(
            f"the model was built from another GLM config than the checkpoint's: {_listing(differ)}"
        )


def _check_gpt_model(model: GPTModel, cfg: Glm53Config) -> None:
    """Refuse a GPTModel that cannot compute GLM-5.3, naming the option, before reading anything."""
    config = model.config
    if not isinstance(config, Glm53TransformerConfig):
        raise CheckpointError(
            f"GPTModel config is a {type(config).__name__}; build it with glm53_ds.make_transformer_config(cfg)"
        )
    if model.position_embedding_type != "none":
        raise CheckpointError(
            f"GPTModel was built with position_embedding_type={model.position_embedding_type!r}; GLM-5.3 has no "
            f"position embedding (NoPE MLA, KDA): use position_embedding_type='none'"
        )
    if model.vocab_size != cfg.vocab_size:
        raise CheckpointError(
            f"GPTModel vocab_size={model.vocab_size} does not match the checkpoint's vocab_size={cfg.vocab_size}"
        )
    if model.share_embeddings_and_output_weights != cfg.tie_word_embeddings:
        raise CheckpointError(
            f"GPTModel share_embeddings_and_output_weights={model.share_embeddings_and_output_weights} but the "
            f"checkpoint's tie_word_embeddings={cfg.tie_word_embeddings}"
        )
    layers = list(model.decoder.layers)
    if not all(isinstance(layer, Glm53TransformerLayer) for layer in layers):
        raise CheckpointError("GPTModel decoder was not built from glm53_ds.specs.get_glm53_block_spec")
    _check_same_config(config.glm, cfg)


def gpt_model_names(model: GPTModel) -> NameMap:
    """Native names -> the names a `GPTModel` stage holds them under ([] when another stage holds them)."""
    state = set(model.state_dict())
    local = {layer.layer_number - 1: i for i, layer in enumerate(model.decoder.layers)}  # global -> local
    tied = model.share_embeddings_and_output_weights
    layer_name = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
    mtp_name = re.compile(r"mtp\.(\d+)\.(.+)")

    def names(native: str) -> list[str]:
        if native == "embedding.weight":
            out = ["embedding.word_embeddings.weight"]
            out += ["output_layer.weight"] if tied else []  # a last stage without the embedding keeps a copy
        elif native == "final_norm.weight":
            out = ["decoder.final_layernorm.weight"]
        elif m := layer_name.fullmatch(native):
            g = int(m.group(1))
            out = [f"decoder.layers.{local[g]}.{m.group(2)}"] if g in local else []
        elif m := mtp_name.fullmatch(native):
            out = [f"mtp.layers.{m.group(1)}.{m.group(2)}"]
        else:
            out = [native]
        return [n for n in out if n in state]

    return names


def _listing(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
