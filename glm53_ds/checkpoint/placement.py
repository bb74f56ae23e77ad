"""Where one rank's tensor sits in the global tensor: the per-tensor placement every checkpoint read derives from.

In the spirit of megatron's `ShardedTensor`: a `TensorPlacement` names a tensor, its global shape (the tensor a
single-process model holds), the local tensor's shape, and the blocks that make it up, each a box of the global
tensor (start, stop per dimension) and where that box sits in the local tensor. The shard rule itself is
`ExpertShard`'s; this module only restates it as boxes:

    replicated tensor                    one block: the whole tensor, at 0
    experts.down_proj    [E, D, I]       one block: experts [e0, e1) x all D x this ETP rank's columns
    experts.gate_up_proj [E, 2I, D]      two blocks: its gate rows at local rows [0, I/ETP), its up rows (global
                                         rows I + the same range) at [I/ETP, 2I/ETP)
    experts.lora.gate_up_B [E, 2I, r]    LoRA adapters (layers/lora.py): as gate_up_proj
    experts.lora.down_A    [E, r, I]     as down_proj
    experts.lora.gate_up_A [E, r, D],    experts [e0, e1), the rest whole: every ETP rank of a shard holds them
    experts.lora.down_B    [E, D, r]     (a stored copy per ETP rank; reads take the first)

Every read is an overlap of two placements (`copies`): a rank loading a checkpoint written at another EP x ETP
intersects its placement with each stored shard's; a ZeRO rank reading only its fragment of the optimizer state
first narrows its placement to the rows holding that fragment (`narrowed_to_rows`); the HF export reads the box
of one released tensor (`index_placement`, e.g. expert 5's up rows) and the HF import writes one into a shard the
same way. Saving derives from it too: `stored_set` is the tensor set a tensor's shard is written to.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..parallel.expert_shard import ExpertShard

REPLICATED = "replicated"
# grouped expert tensors by name ending, and how their intermediate dimension is split over ETP
ROWS, COLUMNS, WHOLE = "gate and up rows", "columns", "whole"
EXPERT_TENSORS = {"experts.gate_up_proj": ROWS, "experts.down_proj": COLUMNS, "experts.lora.gate_up_B": ROWS,
                  "experts.lora.down_A": COLUMNS, "experts.lora.gate_up_A": WHOLE, "experts.lora.down_B": WHOLE}  # fmt: skip


def expert_split(name: str) -> str | None:
    """How grouped expert tensor `name` is split over ETP (`ROWS`: dim 1, gate then up; `COLUMNS`: dim 2;
    `WHOLE`: not at all), or None for a replicated tensor."""
    return next((split for end, split in EXPERT_TENSORS.items() if name.endswith(end)), None)


Box = tuple[tuple[int, int], ...]  # [start, stop) per dimension, in global coordinates
Index = tuple[slice, ...]


def expert_set_name(ep_rank: int, etp_rank: int) -> str:
    """The tensor set holding one EP x ETP expert shard."""
    return f"experts_ep{ep_rank:03d}_etp{etp_rank:03d}"


@dataclass(frozen=True)
class Block:
    box: Box  # a box of the global tensor
    at: tuple[int, ...]  # where its first element sits in the local tensor

    def local(self, part: Box) -> Index:
        """The local index of `part` (a box inside this block's)."""
        return tuple(
            slice(a + lo - b0, a + hi - b0)
            for a, (lo, hi), (b0, _) in zip(self.at, part, self.box, strict=True)
        )


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) or not out else None


@dataclass(frozen=True)
class TensorPlacement:
    name: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    blocks: tuple[Block, ...]
    stored_set: str  # the tensor set this placement's tensor is saved in (`REPLICATED`, an expert shard's)

    @property
    def is_expert(self) -> bool:
        return self.stored_set != REPLICATED

    @property
    def complete(self) -> bool:
        """Whether the blocks fill the whole local tensor (not a narrowed placement)."""
        volume = sum(math.prod(hi - lo for lo, hi in b.box) for b in self.blocks)
        return volume == math.prod(self.local_shape)

    def narrowed_to_rows(self, start: int, stop: int) -> TensorPlacement:
        """Only the local tensor's leading-dimension rows [start, stop) (a ZeRO rank's fragment of the optimizer
        state lies in them); a scalar stays whole."""
        if not self.local_shape:
            return self
        blocks = []
        for b in self.blocks:
            (lo, hi), at = b.box[0], b.at[0]
            first, last = max(start, at), min(stop, at + hi - lo)
            if first < last:
                box = ((lo + first - at, lo + last - at), *b.box[1:])
                blocks.append(Block(box, (first, *b.at[1:])))
        return TensorPlacement(self.name, self.global_shape, self.local_shape, tuple(blocks), self.stored_set)

    def fragment_rows(self, start: int, numel: int) -> TensorPlacement:
        """`narrowed_to_rows` for the flattened element range [start, start + numel) of the local tensor."""
        if not self.local_shape:
            return self
        row = math.prod(self.local_shape[1:])
        return self.narrowed_to_rows(start // row, -(-(start + numel) // row) if numel else start // row)


def copies(target: TensorPlacement, source: TensorPlacement) -> Iterator[tuple[Index, Index]]:
    """(index into the source's local tensor, index into the target's) for every part they share."""
    for t in target.blocks:
        for s in source.blocks:
            part = _intersect(t.box, s.box)
            if part is not None:
                yield s.local(part), t.local(part)


# ----------------------------------------------------------------------------- the shard rule as boxes
def global_shape(name: str, local_shape: tuple[int, ...], shard: ExpertShard) -> tuple[int, ...]:
    """The global shape of a tensor `shard` holds with `local_shape`."""
    split = expert_split(name)
    if split is None:
        return tuple(local_shape)
    out = [local_shape[0] * shard.ep, *local_shape[1:]]
    if split != WHOLE:
        out[1 if split == ROWS else 2] *= shard.etp
    return tuple(out)


def placement(name: str, shape: tuple[int, ...], shard: ExpertShard) -> TensorPlacement:
    """Where `shard`'s part of tensor `name` (global `shape`) sits: the whole tensor unless it is a grouped expert
    tensor (`ExpertShard`'s rule)."""
    shape = tuple(shape)
    split = expert_split(name)
    if split is None:
        whole = Block(tuple((0, n) for n in shape), (0,) * len(shape))
        return TensorPlacement(name, shape, shape, (whole,), REPLICATED)
    experts = (shard.first_expert, shard.first_expert + shard.num_local)
    rows, inner = (shard.rows.start, shard.rows.stop), shard.local_intermediate
    stored = expert_set_name(shard.ep_rank, shard.etp_rank)
    if split == WHOLE:
        box = (experts, *((0, n) for n in shape[1:]))
        return TensorPlacement(name, shape, (shard.num_local, *shape[1:]), (Block(box, (0, 0, 0)),), stored)
    if split == COLUMNS:
        box = (experts, (0, shape[1]), rows)
        return TensorPlacement(
            name, shape, (shard.num_local, shape[1], inner), (Block(box, (0, 0, 0)),), stored
        )
    half = shape[1] // 2
    gate = Block((experts, rows, (0, shape[2])), (0, 0, 0))
    up = Block((experts, (half + rows[0], half + rows[1]), (0, shape[2])), (0, inner, 0))
    return TensorPlacement(name, shape, (shard.num_local, 2 * inner, shape[2]), (gate, up), stored)


def stored_placements(name: str, shape: tuple[int, ...], saved: ExpertShard) -> list[TensorPlacement]:
    """The placements of every stored part of tensor `name` in a checkpoint written at `saved`'s layout: one for
    a replicated tensor, one per EP x ETP shard for a grouped expert tensor (of an ETP-whole one, ETP rank 0's)."""
    split = expert_split(name)
    if split is None:
        return [placement(name, shape, saved)]
    return [placement(name, shape, s) for s in saved.all_shards() if split != WHOLE or s.etp_rank == 0]


def index_placement(name: str, shape: tuple[int, ...], index: tuple[int | slice, ...]) -> TensorPlacement:
    """The placement of `tensor[index]` (ints and unit-step slices of the leading dimensions): one block whose
    local tensor keeps an int's dimension with size 1 (the caller squeezes it)."""
    box = []
    for i, n in enumerate(shape):
        at = index[i] if i < len(index) else slice(None)
        if isinstance(at, int):
            box.append((at, at + 1))
        else:
            lo, hi, step = at.indices(n)
            if step != 1:
                raise ValueError(f"{name}: index {index} has a step; placements are boxes")
            box.append((lo, hi))
    local = tuple(hi - lo for lo, hi in box)
    return TensorPlacement(name, tuple(shape), local, (Block(tuple(box), (0,) * len(box)),), REPLICATED)


def local_part(name: str, full: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """`shard`'s local tensor of the global tensor `full` (what a model at `shard`'s layout holds of it)."""
    target = placement(name, tuple(full.shape), shard)
    whole = index_placement(name, tuple(full.shape), ())
    out = full.new_empty(target.local_shape)
    for src, dst in copies(target, whole):
        out[dst] = full[src]
    return out
