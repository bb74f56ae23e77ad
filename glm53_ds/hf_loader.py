"""`load_hf(hf_dir)`: a released GLM-5.3 checkpoint (config.json + sharded safetensors) -> a ready Glm53Model.

Tensors are read one at a time (safetensors mmap) and copied into the model's parameters through the name
table in `convert/names.py`. Every problem is collected and reported together, naming tensors: missing ones
(by their released names), unexpected ones, and shape mismatches (key, checkpoint shape, expected shape).
Vision tensors (`model.visual.*`) are not part of the text model and are skipped.
MTP: loaded when the checkpoint has the MTP layer (`layers.<num_hidden_layers>.*`); a checkpoint without it
(e.g. a `save_pretrained` of the transformers model, which has no MTP) gives a model without MTP, unless
`mtp=True` is asked for, which then reports the missing tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .config import Glm53Config
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
from .layers.moe import GroupedExperts
from .model import Glm53Model, build_model
from .parallel.expert_shard import ExpertShard


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


def load_hf_state_into(model: Glm53Model, checkpoint: SafetensorsCheckpoint, mtp: bool) -> None:
    """Fill `model` from a released checkpoint; each rank reads only the expert tensors of its own shard."""
    cfg = model.glm
    shard = model_expert_shard(model, cfg)
    layout = released_layout(cfg, mtp=mtp)
    state = model.state_dict()
    filled: dict[str, int] = {}
    seen: set[str] = set()
    unexpected: list[str] = []
    mismatched: list[str] = []

    names = [n for n in checkpoint.keys() if (c := canonical_text_name(n)) is None or _wanted(c, shard)]
    for raw_name, tensor in checkpoint.tensors(names):
        name = canonical_text_name(raw_name)
        if name is None or is_mtp_shared_duplicate(name, cfg):
            continue
        if not mtp and is_mtp_name(name, cfg):
            continue  # MTP weights present but MTP not wanted
        for released, piece in split_to_released(name, tensor, cfg):
            placements = layout.get(released)
            if placements is None:
                unexpected.append(raw_name if released == name else f"{raw_name} (as {released})")
                continue
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
                    target.copy_(part.to(target.dtype))
                filled[p.native] = filled.get(p.native, 0) + target.numel()

    missing = [n for n in layout if n not in seen and _wanted(n, shard)]
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
    incomplete = [
        k
        for k in state
        if k in {p.native for ps in layout.values() for p in ps} and filled.get(k, 0) != state[k].numel()
    ]
    if incomplete:
        raise CheckpointError(f"parameters not fully covered by the checkpoint: {_listing(incomplete)}")


def load_hf(
    hf_dir: str, dtype: torch.dtype = torch.float32, mtp: bool | None = None, **overrides: Any
) -> Glm53Model:
    """Build the model from `hf_dir/config.json` and load its safetensors. See the module docstring for MTP.
    `overrides`: transformer-config fields (e.g. `attention_impl="eager"`)."""
    cfg = Glm53Config.from_hf(hf_dir)
    checkpoint = SafetensorsCheckpoint(hf_dir)
    has_mtp = cfg.num_nextn_predict_layers > 0 and checkpoint_has_mtp(checkpoint.keys(), cfg)
    use_mtp = has_mtp if mtp is None else mtp
    model = build_model(cfg, dtype=dtype, mtp=use_mtp, **overrides)
    load_hf_state_into(model, checkpoint, mtp=use_mtp)
    return model


def _listing(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
