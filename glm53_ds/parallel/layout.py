"""The parallel layout of a run: process groups for EP x ETP (x DP), built once, passed to whoever needs them.

`init_layout(ep, etp)` (after `torch.distributed` is initialised) builds megatron `parallel_state` with
TP = PP = 1 (attention replicated), EP = `ep`, ETP = `etp`, and returns a `ParallelLayout` holding
  - megatron's groups (EP, ETP, expert-data-parallel) and a `pg_collection` that model modules receive;
  - `dp_group`: the ranks sharing this rank's ETP rank (WORLD / ETP ranks). An engine that treats ETP as its
    model-parallel group (DeepSpeed, `glm53_ds/engine/`) shards and reduces over this group.
The replica group of a non-expert parameter is the whole world; an engine reducing over `dp_group` misses the
ETP peers, which the engine's gradient-sync patch closes. Nothing here imports DeepSpeed.

World 8, EP2 x ETP2: ETP [0,1],[2,3],...; EP [0,2],[1,3],[4,6],[5,7]; expert-DP [0,4],[1,5],...;
dp_group [0,2,4,6],[1,3,5,7].
"""

from __future__ import annotations

from dataclasses import dataclass

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
    pg_collection: ProcessGroupCollection  # what model modules receive (megatron's convention)

    @property
    def expert_group_name(self) -> str:
        return f"ep_size_{self.ep}"

    def expert_shard(self, cfg: Glm53Config) -> ExpertShard:
        """This rank's part of the routed experts."""
        return ExpertShard.for_config(cfg, self.ep, self.ep_rank, self.etp, self.etp_rank)

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size}: EP={self.ep} (rank {self.ep_rank}), ETP={self.etp} "
            f"(rank {self.etp_rank}), expert-DP={dist.get_world_size(self.expert_dp_group)}, "
            f"DP={len(self.dp_ranks)}"
        )


def validate_layout(world_size: int, ep: int, etp: int, cfg: Glm53Config | None = None) -> None:
    """Refuse an impossible layout before any work, naming the numbers."""
    for name, value in (("ep", ep), ("etp", etp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size % (ep * etp):
        raise ValueError(f"world size {world_size} is not divisible by EP x ETP = {ep} x {etp} = {ep * etp}")
    if cfg is not None:
        ExpertShard.for_config(cfg, ep=ep, etp=etp)  # divisibility of experts and intermediate size


def init_layout(ep: int = 1, etp: int = 1, cfg: Glm53Config | None = None) -> ParallelLayout:
    """Process groups for EP x ETP over the current world (collective: every rank calls it)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "init_layout(): initialise torch.distributed first (glm53_ds.engine.init_distributed)"
        )
    world = dist.get_world_size()
    validate_layout(world, ep, etp, cfg)
    compat.apply()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    etp_group = parallel_state.get_expert_tensor_parallel_group()
    # The data-parallel groups: the "columns" of the ETP groups. Every rank learns every ETP group, then all
    # ranks create the same groups in the same order (new_group is collective).
    everyone: list[list[int] | None] = [None] * world
    dist.all_gather_object(everyone, dist.get_process_group_ranks(etp_group))
    etp_groups = sorted({tuple(g) for g in everyone if g is not None})
    dp_group, dp_ranks = None, []
    for j in range(etp):
        ranks = sorted(g[j] for g in etp_groups)
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            dp_group, dp_ranks = group, ranks
    assert dp_group is not None
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
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
