"""`DeepSpeedMpu`: the `mpu` object DeepSpeed reads, built from a `ParallelLayout`.

Model parallel = ETP (DeepSpeed then names checkpoint files per ETP shard and counts sharded expert weights
once per shard in norms); data parallel = the ranks sharing this rank's ETP rank (`layout.dp_group`); no PP.
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

    # data parallel
    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.layout.dp_group

    def get_data_parallel_world_size(self) -> int:
        return len(self.layout.dp_ranks)

    def get_data_parallel_rank(self) -> int:
        return self.layout.dp_ranks.index(self.layout.rank)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.layout.dp_ranks)

    # no pipeline parallelism
    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def get_pipeline_model_parallel_group(self) -> dist.ProcessGroup | None:
        return None
