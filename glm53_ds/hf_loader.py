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

import re
from dataclasses import dataclass

import torch

from .config import Glm53Config
from .convert.import_hf import HFSource
from .convert.names import (
    Placement,
    canonical_text_name,
    is_mtp_name,
    is_mtp_shared_duplicate,
    released_layout,
    split_to_released,
)
from .model import Glm53Model, build_model


class CheckpointError(ValueError):
    """A checkpoint that does not match the model; the message lists every offending tensor."""


# The released-layout reader lives with the converter (one implementation, read one tensor at a time).
SafetensorsCheckpoint = HFSource


def checkpoint_has_mtp(names: list[str], cfg: Glm53Config) -> bool:
    return any(is_mtp_name(n, cfg) for n in names)


@dataclass(frozen=True)
class ExpertShard:
    """This rank's part of the routed experts: EP rank `ep_rank` of `ep`, ETP rank `etp_rank` of `etp`."""

    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0


_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _localize(
    released: str, piece: torch.Tensor, placement: Placement, cfg: Glm53Config, shard: ExpertShard
) -> tuple[Placement, torch.Tensor] | None:
    """Map a full-model placement of an expert tensor to this rank's shard; None if another rank holds it."""
    m = _EXPERT.search(released)
    if m is None or (shard.ep == 1 and shard.etp == 1):
        return placement, piece
    local = cfg.n_routed_experts // shard.ep
    expert, kind = int(m.group(1)), m.group(2)
    if expert // local != shard.ep_rank:
        return None
    inner = cfg.moe_intermediate_size // shard.etp
    part = slice(shard.etp_rank * inner, (shard.etp_rank + 1) * inner)
    e = expert % local
    if kind == "down_proj":
        return Placement(placement.native, (e,)), piece[:, part]
    row0 = 0 if kind == "gate_proj" else inner
    return Placement(placement.native, (e, slice(row0, row0 + inner))), piece[part]


def wanted_by_shard(name: str, cfg: Glm53Config, shard: ExpertShard) -> bool:
    """Whether this rank needs the released tensor `name` at all (experts of other EP ranks are never read)."""
    m = _EXPERT.search(name)
    if m is None or shard.ep == 1:
        return True
    return int(m.group(1)) // (cfg.n_routed_experts // shard.ep) == shard.ep_rank


def load_hf_state_into(
    model: Glm53Model, checkpoint: SafetensorsCheckpoint, mtp: bool, shard: ExpertShard | None = None
) -> None:
    cfg = model.glm
    shard = shard or ExpertShard()
    layout = released_layout(cfg, mtp=mtp)
    state = model.state_dict()
    filled: dict[str, int] = {}
    seen: set[str] = set()
    unexpected: list[str] = []
    mismatched: list[str] = []

    names = [
        n
        for n in checkpoint.keys()
        if (c := canonical_text_name(n)) is None or wanted_by_shard(c, cfg, shard)
    ]
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
                local = _localize(released, piece, full, cfg, shard)
                if local is None:
                    continue
                p, part = local
                target = state[p.native][p.index] if p.index else state[p.native]
                if tuple(piece.shape) != tuple(target.shape):
                    mismatched.append(
                        f"{released}: checkpoint shape {tuple(piece.shape)}, expected {tuple(target.shape)}"
                    )
                    continue
                with torch.no_grad():
                    target.copy_(piece.to(target.dtype))
                filled[p.native] = filled.get(p.native, 0) + target.numel()

    missing = [n for n in layout if n not in seen and wanted_by_shard(n, cfg, shard)]
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


def load_hf(hf_dir: str, dtype: torch.dtype = torch.float32, mtp: bool | None = None) -> Glm53Model:
    """Build the model from `hf_dir/config.json` and load its safetensors. See the module docstring for MTP."""
    cfg = Glm53Config.from_hf(hf_dir)
    checkpoint = SafetensorsCheckpoint(hf_dir)
    has_mtp = cfg.num_nextn_predict_layers > 0 and checkpoint_has_mtp(checkpoint.keys(), cfg)
    use_mtp = has_mtp if mtp is None else mtp
    model = build_model(cfg, dtype=dtype, mtp=use_mtp)
    load_hf_state_into(model, checkpoint, mtp=use_mtp)
    return model


def _listing(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
