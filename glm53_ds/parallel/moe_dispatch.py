"""Dropless expert-parallel (EP) x expert-tensor-parallel (ETP) dispatch for the GLM-5.3 MoE.

Rank layout (megatron `parallel_state`, TP = 1): an EP group holds `n_routed_experts / EP` experts per rank; an
ETP group holds the same experts, each rank a slice `moe_intermediate_size / ETP` of every expert's FFN.

For this rank's tokens x [T, D] with routing (expert ids, weights) [T, k]:
  1. the T·k (token, expert) pairs are sorted by expert and sent to the EP rank owning the expert
     (all-to-all with variable counts, autograd-correct: the backward is the reverse all-to-all);
  2. the received rows are gathered over the ETP group, so every slice of an expert sees all its tokens;
  3. each local expert runs its FFN slice on its rows -> partial outputs;
  4. partial outputs are summed over the ETP group, each rank keeping the rows it contributed (reduce-scatter);
  5. rows return to their source rank (reverse all-to-all), are weighted by the router and summed per token.
No token is dropped and no capacity padding is used.

Gradient scale: DeepSpeed averages expert gradients over the expert-data-parallel group dividing by its
data-parallel size, which is WORLD / ETP when ETP is DeepSpeed's model-parallel group; each expert slice has
seen the tokens of all ETP peers, so its parameter gradient is scaled by 1/ETP (step 4's backward) and the
token gradients are scaled back by ETP (step 2's backward). With ETP = 1 both factors are 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .comm import (
    _all_to_all_rows,
    _gather_padded,
    all_to_all,
    exchange_counts,
    gather_counts,
    gather_rows,
    reduce_rows,
)
from .expert_shard import ExpertShard

# One local expert's FFN (or its ETP slice) applied to its rows: (local expert index, x [n, D]) -> [n, D].
ExpertFFN = Callable[[int, torch.Tensor], torch.Tensor]


class ExpertParallelDispatch:
    def __init__(self, shard: ExpertShard, ep_group: dist.ProcessGroup, etp_group: dist.ProcessGroup) -> None:
        self.ep_group, self.etp_group, self.shard = ep_group, etp_group, shard
        self.ep_size, self.etp_size = shard.ep, shard.etp
        if (dist.get_world_size(ep_group), dist.get_world_size(etp_group)) != (shard.ep, shard.etp):
            raise ValueError(
                f"the EP / ETP groups have {dist.get_world_size(ep_group)} / {dist.get_world_size(etp_group)} "
                f"ranks, the expert shard says EP={shard.ep}, ETP={shard.etp}"
            )

    def __call__(
        self, expert_ffn: ExpertFFN, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, D], expert_ids / weights [T, k] -> sum_k weight * expert(x) [T, D]."""
        k = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs sorted by expert
        token = order // k
        sorted_ids = flat[order]
        dest = self.shard.owner(sorted_ids)
        send_counts = torch.bincount(dest, minlength=self.ep_size)
        send = send_counts.tolist()
        recv = exchange_counts(send_counts, self.ep_group).tolist()

        # 1. rows to the experts' EP ranks
        rows = all_to_all(x[token], send, recv, self.ep_group)  # [R, D]
        local_ids = self.shard.local_index(sorted_ids).contiguous()
        if self.ep_size > 1:
            local_ids = _all_to_all_rows(local_ids, send, recv, self.ep_group)
        # 2. every ETP slice sees all rows of its ETP group
        counts = gather_counts(rows.shape[0], self.etp_group, x.device)
        all_rows = gather_rows(rows, counts, self.etp_group, grad_scale=float(self.etp_size))
        all_ids = _gather_padded(local_ids, counts, self.etp_group) if self.etp_size > 1 else local_ids
        # 3. local experts, rows grouped by expert
        perm = torch.argsort(all_ids, stable=True)
        sizes = torch.bincount(all_ids, minlength=self.shard.num_local).tolist()
        outputs = [
            expert_ffn(e, chunk)
            for e, chunk in enumerate(torch.split(all_rows[perm], sizes))
            if chunk.shape[0] > 0
        ]
        grouped = torch.cat(outputs) if outputs else all_rows.new_zeros((0, all_rows.shape[1]))
        partial = torch.empty_like(grouped).index_copy(0, perm, grouped)
        # 4. sum the FFN slices, keep this rank's rows
        summed = reduce_rows(partial, counts, self.etp_group, grad_scale=1.0 / self.etp_size)
        # 5. back to the source ranks, weighted, summed per token
        back = all_to_all(summed, recv, send, self.ep_group)  # [T*k, D] in `order`
        back = back * weights.reshape(-1)[order, None]
        out = torch.zeros_like(x)
        return out.index_add(0, token, back.to(x.dtype))
