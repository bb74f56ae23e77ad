"""The parallel layout of a run: process groups for ETP x EP x SP (x DP), built once, passed to whoever needs them.

Two decompositions of the same ranks (megatron-core's "MoE parallel folding"), TP = PP = 1 (attention replicated):
    attention (and everything token-local):  rank = etp_rank + ETP * (sp_rank + SP * dp_rank)
    routed experts (megatron's expert order): rank = etp_rank + ETP * (ep_rank + EP * expert_dp_rank)
The world must be divisible by ETP x SP and by ETP x EP, not by their product: EP may span the SP ranks (EP 8 x SP 8
on 8 ranks), since tokens leave Ulysses attention sharded by sequence and the MoE's all-to-all takes any rank's
tokens. The ETP coordinate is the same in both (the fastest), so the ranks sharing an ETP rank are DeepSpeed's
sequence-data-parallel group in either view, and the SP coordinate is independent of it.
`init_layout(ep, etp, sp=1)` (after `torch.distributed` is initialised) builds megatron `parallel_state` with
EP = `ep`, ETP = `etp` (its expert groups are the second decomposition; megatron sees TP = CP = 1, so SP is
invisible to it), and returns a `ParallelLayout` holding
  - megatron's groups (EP, ETP, expert-data-parallel) and a `pg_collection` that model modules receive, with the
    sequence-parallel group added as `pg_collection.sp` (`SequenceParallel.of(pg_collection)`);
  - `sp_group`: the SP ranks that share one sample, each holding a contiguous 1/SP of its tokens
    (parallel/sequence.py);
  - `dp_group`: the ranks sharing this rank's ETP rank (WORLD / ETP ranks, SP ranks included). An engine that
    treats ETP as its model-parallel group (DeepSpeed, `glm53_ds/engine/`) shards and reduces over this group
    (DeepSpeed's sequence-data-parallel group);
  - `pure_dp_group`: `dp_group` without the SP ranks (DeepSpeed's data-parallel group when SP > 1);
  - `data_rank` / `data_world`: which samples this rank reads (every rank of an SP group reads the same ones;
    ranks of different SP groups read different ones). At SP = 1, data_rank = rank.
The replica group of a non-expert parameter is the whole world; an engine reducing over `dp_group` misses the
ETP peers, which the engine's gradient-sync patch closes. The gradient rules need no particular placement of the
groups (docs/parallelism.md): a replicated gradient is the sum over the world / (WORLD / SP), an expert shard's the
sum over its expert-DP group of what its EP group's tokens gave it, divided the same way. Nothing here imports
DeepSpeed.

World 8, EP2 x ETP2: ETP [0,1],[2,3],...; EP [0,2],[1,3],[4,6],[5,7]; expert-DP [0,4],[1,5],...;
dp_group [0,2,4,6],[1,3,5,7]. World 8, SP2 x EP2 x ETP2: the same, with SP [0,2],[1,3],[4,6],[5,7] (= EP).
World 4, SP2 x EP4 (folded): SP [0,1],[2,3]; EP [0,1,2,3]; expert-DP [0],[1],[2],[3].
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from .. import compat
from ..config import Glm53Config
from .expert_shard import ExpertShard


@dataclass
class ParallelLayout:
    world_size: int
    rank: int
    ep: int
    etp: int
    ep_rank: int
    etp_rank: int
    ep_group: dist.ProcessGroup
    etp_group: dist.ProcessGroup
    expert_dp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup  # ranks with this rank's ETP rank (the engine's data-parallel group)
    dp_ranks: list[int]
    pg_collection: ProcessGroupCollection  # what model modules receive (megatron's convention; `.sp` added)
    sp: int = 1
    sp_rank: int = 0
    sp_group: dist.ProcessGroup | None = None  # None at SP = 1
    pure_dp_group: dist.ProcessGroup | None = None  # dp_group without SP ranks (dp_group itself at SP = 1)
    pure_dp_ranks: list[int] | None = None

    @property
    def data_world(self) -> int:
        """How many different sample streams the world reads: WORLD / SP."""
        return self.world_size // self.sp

    @property
    def data_rank(self) -> int:
        """This rank's sample stream (shared by its SP group): the rank with the SP coordinate removed."""
        return data_rank(self.rank, self.etp, self.sp)

    @property
    def expert_group_name(self) -> str:
        return f"ep_size_{self.ep}"

    def expert_shard(self, cfg: Glm53Config) -> ExpertShard:
        """This rank's part of the routed experts."""
        return ExpertShard.for_config(cfg, self.ep, self.ep_rank, self.etp, self.etp_rank)

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size}: EP={self.ep} (rank {self.ep_rank}), ETP={self.etp} "
            f"(rank {self.etp_rank}), SP={self.sp} (rank {self.sp_rank}), "
            f"expert-DP={dist.get_world_size(self.expert_dp_group)}, DP={len(self.dp_ranks)}"
        )


def data_rank(rank: int, etp: int, sp: int) -> int:
    """`rank` with its SP coordinate removed (rank = etp_rank + ETP * (sp_rank + SP * dp_rank)): its sample
    stream."""
    return rank % etp + etp * (rank // (etp * sp))


def group_keys(ep: int, etp: int, sp: int) -> dict[str, Callable[[int], tuple[int, ...]]]:
    """Which ranks share each group of the layout: ranks r, q with key(r) == key(q). The attention view's
    (rank = etp_rank + ETP * (sp_rank + SP * dp_rank)) and megatron's expert order's
    (rank = etp_rank + ETP * (ep_rank + EP * expert_dp_rank)); megatron makes the expert groups itself
    (init_layout checks its ETP group), the others are made from these keys. The replica group of a non-expert
    parameter is the whole world."""
    return {
        "ETP": lambda r: (r // etp,),
        "SP": lambda r: (r % etp, r // (etp * sp)),  # same ETP and DP coordinates
        "EP": lambda r: (r % etp, r // (etp * ep)),  # same ETP and expert-DP coordinates
        "expert DP": lambda r: (r % etp, (r // etp) % ep),  # same ETP and EP coordinates
        "DP": lambda r: (r % etp,),  # the engine's data-parallel group: every rank of this ETP rank
        "pure DP": lambda r: (r % etp, (r // etp) % sp),  # DP without the SP ranks
    }


def smallest_world(ep: int, etp: int, sp: int) -> int:
    """The fewest ranks that hold a layout: a multiple of ETP x SP and of ETP x EP."""
    return etp * math.lcm(ep, sp)


def validate_layout(
    world_size: int,
    ep: int,
    etp: int,
    cfg: Glm53Config | None = None,
    sp: int = 1,
    seq_length: int | None = None,
) -> None:
    """Refuse an impossible layout before any work, naming the numbers."""
    for name, value in (("ep", ep), ("etp", etp), ("sp", sp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    for label, size in (("EP x ETP", (ep, etp)), ("SP x ETP", (sp, etp))):
        if world_size % (size[0] * size[1]):
            raise ValueError(f"world size {world_size} is not divisible by {label} = {size[0]} x {size[1]} = "
                             f"{size[0] * size[1]}")  # fmt: skip
    if seq_length is not None and seq_length % sp:
        raise ValueError(f"seq_length {seq_length} is not divisible by SP = {sp} (each SP rank holds an equal "
                         "contiguous part of every sequence)")  # fmt: skip
    if cfg is not None:
        ExpertShard.for_config(cfg, ep=ep, etp=etp)  # divisibility of experts and intermediate size
        if sp > 1:
            check_sequence_parallel_config(cfg, sp)


def check_sequence_parallel_config(cfg: Glm53Config, sp: int) -> None:
    """SP shards attention heads after the all-to-all: both head counts must divide."""
    for name in ("linear_num_heads", "num_attention_heads"):
        heads = getattr(cfg, name)
        if heads % sp:
            raise ValueError(f"SP = {sp} does not divide {name} = {heads} (sequence parallelism shards the "
                             "attention heads after its all-to-all)")  # fmt: skip


def _new_groups(
    world: int, key: Callable[[int], tuple[int, ...]], timeout: timedelta | None = None
) -> tuple[dist.ProcessGroup, list[int]]:
    """One group per value of key(rank), created on every rank in the same order (new_group is collective);
    returns this rank's group and its ranks."""
    buckets: dict[tuple[int, ...], list[int]] = {}
    for r in range(world):
        buckets.setdefault(key(r), []).append(r)
    mine: tuple[dist.ProcessGroup, list[int]] | None = None
    for _, ranks in sorted(buckets.items()):
        group = dist.new_group(ranks, timeout=timeout)
        if dist.get_rank() in ranks:
            mine = (group, ranks)
    assert mine is not None
    return mine


def init_layout(
    ep: int = 1, etp: int = 1, cfg: Glm53Config | None = None, sp: int = 1, timeout: timedelta | None = None
) -> ParallelLayout:
    """Process groups for ETP x EP x SP over the current world (collective: every rank calls it). `timeout`: how
    long each group's collectives wait for a rank (`--dist-timeout`; None: megatron's and torch's 30 minutes)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "init_layout(): initialise torch.distributed first (glm53_ds.engine.init_distributed)"
        )
    world = dist.get_world_size()
    validate_layout(world, ep, etp, cfg, sp=sp)
    compat.apply()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        # nothing here uses megatron's gloo copies of its groups (and a shape-only dry run's fake backend,
        # plan/dry_run.py, cannot build them)
        create_gloo_process_groups=False,
        distributed_timeout_minutes=timeout.total_seconds() / 60 if timeout else 30,  # a float works
    )
    etp_group = parallel_state.get_expert_tensor_parallel_group()
    etp_ranks = dist.get_process_group_ranks(etp_group)
    first = dist.get_rank() - dist.get_rank() % etp
    if etp_ranks != list(range(first, first + etp)):  # the rank order above is megatron's expert order
        raise RuntimeError(f"megatron's expert-tensor-parallel group of rank {dist.get_rank()} is {etp_ranks}, "
                           f"expected ranks {first}..{first + etp - 1} (ETP fastest)")  # fmt: skip
    # The data-parallel groups: the ranks sharing an ETP rank (the "columns" of the ETP groups), created on every
    # rank in the same order (new_group is collective).
    keys = group_keys(ep, etp, sp)
    dp_group, dp_ranks = _new_groups(world, keys["DP"], timeout)
    sp_group, sp_ranks, pure_dp_group, pure_dp_ranks = None, [dist.get_rank()], dp_group, dp_ranks
    if sp > 1:
        sp_group, sp_ranks = _new_groups(world, keys["SP"], timeout)
        pure_dp_group, pure_dp_ranks = _new_groups(world, keys["pure DP"], timeout)
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    pg_collection.sp = sp_group
    return ParallelLayout(
        world_size=world,
        rank=dist.get_rank(),
        ep=ep,
        etp=etp,
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        ep_group=parallel_state.get_expert_model_parallel_group(),
        etp_group=etp_group,
        expert_dp_group=parallel_state.get_expert_data_parallel_group(),
        dp_group=dp_group,
        dp_ranks=dp_ranks,
        pg_collection=pg_collection,
        sp=sp,
        sp_rank=sp_ranks.index(dist.get_rank()),
        sp_group=sp_group,
        pure_dp_group=pure_dp_group,
        pure_dp_ranks=pure_dp_ranks,
    )
