"""Process groups for EP x ETP training under DeepSpeed.

`initialize(ep, etp)` (after `torch.distributed` / `deepspeed.init_distributed`):
  - megatron `parallel_state` with TP = PP = 1 (attention replicated), EP = `ep`, ETP = `etp`;
  - DeepSpeed's view: ETP is DeepSpeed's model-parallel group (distinct checkpoint file names per ETP shard,
    gradient norms that count sharded experts on every shard), so DeepSpeed's data-parallel group is the set
    of ranks with the same ETP rank (WORLD / ETP ranks) -- `DeepSpeedMpu` below;
  - megatron's EP and expert-data-parallel groups registered in `deepspeed.utils.groups` under
    `ep_size_<EP>` before any model is built, so ZeRO partitions expert parameters over exactly the ranks that
    hold the same expert shard.
The replica group of a non-expert parameter is the whole world; DeepSpeed reduces over its data-parallel group
only, which misses the ETP peers: `grad_sync.install_gradient_sync` closes that gap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from .. import compat


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
    ds_dp_group: dist.ProcessGroup  # DeepSpeed's data-parallel group: ranks with this rank's ETP rank
    ds_dp_ranks: list[int]

    @property
    def expert_group_name(self) -> str:
        return f"ep_size_{self.ep}"

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size}: EP={self.ep} (rank {self.ep_rank}), ETP={self.etp} "
            f"(rank {self.etp_rank}), expert-DP={dist.get_world_size(self.expert_dp_group)}, "
            f"DeepSpeed DP={len(self.ds_dp_ranks)}"
        )


def validate_layout(world_size: int, ep: int, etp: int, n_routed_experts: int | None = None,
                    moe_intermediate_size: int | None = None) -> None:  # fmt: skip
    """Refuse an impossible layout before any work, naming the numbers."""
    for name, value in (("ep", ep), ("etp", etp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size % (ep * etp):
        raise ValueError(f"world size {world_size} is not divisible by EP x ETP = {ep} x {etp} = {ep * etp}")
    if n_routed_experts is not None and n_routed_experts % ep:
        raise ValueError(f"n_routed_experts ({n_routed_experts}) is not divisible by EP={ep}")
    if moe_intermediate_size is not None and moe_intermediate_size % etp:
        raise ValueError(f"moe_intermediate_size ({moe_intermediate_size}) is not divisible by ETP={etp}")


def initialize(ep: int = 1, etp: int = 1, n_routed_experts: int | None = None,
               moe_intermediate_size: int | None = None) -> ParallelLayout:  # fmt: skip
    if not dist.is_initialized():
        raise RuntimeError("initialize(): call deepspeed.init_distributed() (or torch.distributed) first")
    world = dist.get_world_size()
    validate_layout(world, ep, etp, n_routed_experts, moe_intermediate_size)
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
    # DeepSpeed's data-parallel groups: the "columns" of the ETP groups. Every rank learns every ETP group,
    # then all ranks create the same groups in the same order (new_group is collective).
    everyone: list[list[int] | None] = [None] * world
    dist.all_gather_object(everyone, dist.get_process_group_ranks(etp_group))
    etp_groups = sorted({tuple(g) for g in everyone if g is not None})
    ds_dp_group, ds_dp_ranks = None, []
    for j in range(etp):
        ranks = sorted(g[j] for g in etp_groups)
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            ds_dp_group, ds_dp_ranks = group, ranks
    assert ds_dp_group is not None
    layout = ParallelLayout(
        world_size=world,
        rank=dist.get_rank(),
        ep=ep,
        etp=etp,
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        ep_group=parallel_state.get_expert_model_parallel_group(),
        etp_group=etp_group,
        expert_dp_group=parallel_state.get_expert_data_parallel_group(),
        ds_dp_group=ds_dp_group,
        ds_dp_ranks=ds_dp_ranks,
    )
    _register_deepspeed_groups(layout)
    return layout


def _register_deepspeed_groups(layout: ParallelLayout) -> None:
    from deepspeed.utils import groups

    name = layout.expert_group_name
    groups._EXPERT_PARALLEL_GROUP[name] = layout.ep_group
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = dist.get_process_group_ranks(layout.ep_group)
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = layout.expert_dp_group
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = dist.get_process_group_ranks(layout.expert_dp_group)


class DeepSpeedMpu:
    """The `mpu` DeepSpeed reads: model parallel = ETP, data parallel = ranks sharing this ETP rank, no PP."""

    def __init__(self, layout: ParallelLayout) -> None:
        self.layout = layout

    # model / tensor parallel = ETP
    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.layout.etp_group

    def get_model_parallel_world_size(self) -> int:
        return self.layout.etp

    def get_model_parallel_rank(self) -> int:
        return self.layout.etp_rank

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_process_group_ranks(self.layout.etp_group)[0]

    # data parallel
    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.layout.ds_dp_group

    def get_data_parallel_world_size(self) -> int:
        return len(self.layout.ds_dp_ranks)

    def get_data_parallel_rank(self) -> int:
        return self.layout.ds_dp_ranks.index(self.layout.rank)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.layout.ds_dp_ranks)

    # no pipeline parallelism
    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def get_pipeline_model_parallel_group(self) -> dist.ProcessGroup | None:
        return None


def free_port() -> int:
    """A TCP port free on this host right now (for a single-node rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"
