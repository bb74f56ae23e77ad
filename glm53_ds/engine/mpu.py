"""`DeepSpeedMpu`: the `mpu` object DeepSpeed reads, built from a `ParallelLayout`.

Model parallel = ETP (DeepSpeed then names checkpoint files per ETP shard and counts sharded expert weights
once per shard in norms); no PP. Without SP, data parallel = the ranks sharing this rank's ETP rank
(`layout.dp_group`). With SP (DeepSpeed 0.19 reads `get_sequence_parallel_*` and `get_sequence_data_parallel_*`):
  - sequence-data parallel = `layout.dp_group` (SP ranks included): ZeRO partitions, and non-expert gradients are
    all-reduced, over it, divided by its size / SP: summed over SP, averaged over the rest;
  - data parallel = `layout.pure_dp_group` (without SP ranks): the divisor of the expert gradients that stage 0
    all-reduces over the expert-data-parallel group (SP ranks included), so they too are summed over SP, and the
    data-parallel size of DeepSpeed's batch arithmetic (train_batch_size = micro x GAS x its size).
tests/parallel/test_sequence.py measures each path against the single-process global batch.
"""

from __future__ import annotations

import torch.distributed as dist

from ..parallel.layout import ParallelLayout


class DeepSpeedMpu:
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

    # data parallel (without SP ranks)
    def _pure_dp(self) -> tuple[dist.ProcessGroup, list[int]]:
        layout = self.layout
        if layout.pure_dp_group is None or layout.pure_dp_ranks is None:
            return layout.dp_group, layout.dp_ranks
        return layout.pure_dp_group, layout.pure_dp_ranks

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self._pure_dp()[0]

    def get_data_parallel_world_size(self) -> int:
        return len(self._pure_dp()[1])

    def get_data_parallel_rank(self) -> int:
        return self._pure_dp()[1].index(self.layout.rank)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._pure_dp()[1])

    # sequence parallel, and sequence + data parallel (DeepSpeed's ZeRO / reduction group)
    def get_sequence_parallel_group(self) -> dist.ProcessGroup | None:
        return self.layout.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.layout.sp

    def get_sequence_parallel_rank(self) -> int:
        return self.layout.sp_rank

    def get_sequence_data_parallel_group(self) -> dist.ProcessGroup:
        return self.layout.dp_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return len(self.layout.dp_ranks)

    def get_sequence_data_parallel_rank(self) -> int:
        return self.layout.dp_ranks.index(self.layout.rank)

    # no pipeline parallelism
    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def get_pipeline_model_parallel_group(self) -> dist.ProcessGroup | None:
        return None
