"""Dropless expert-parallel (EP) x expert-tensor-parallel (ETP) dispatch for the GLM-5.3 MoE.

Rank layout (megatron `parallel_state`, TP = 1): an EP group holds `n_routed_experts / EP` experts per rank; an
ETP group holds the same experts, each rank a slice `moe_intermediate_size / ETP` of every expert's FFN.

For this rank's tokens x [T, D] with their T·k (token, expert) pairs sorted by expert (`RoutedTokens`):
  0. the pairs-per-expert counts [EP, E_local] go to the experts' ranks (an all-to-all of counts, on the device)
     and are gathered over the ETP group, giving every rank the counts matrix of the rows it will compute; then
     the layer's one host sync: a single copy of the split sizes (rows to each EP rank, rows from each source)
     that the variable-size collectives below need. The backward reuses them: no sync there;
  1. the sorted rows go to the EP rank owning their expert (all-to-all with variable counts, autograd-correct:
     the backward is the reverse all-to-all);
  2. the received rows are gathered over the ETP group, so every slice of an expert sees all its tokens;
  3. the rows, ordered by source then expert, are permuted to expert order on the device (from the counts
     matrix) and the local experts run as grouped GEMMs (`GroupedExperts.ffn`) -> partial outputs;
  4. partial outputs are summed over the ETP group, each rank keeping the rows it contributed (reduce-scatter);
  5. rows return to their source rank (reverse all-to-all), are weighted by the router and summed per token.
No token is dropped and no capacity padding is used; nothing loops over experts.

Gradient scale: DeepSpeed averages expert gradients over the expert-data-parallel group dividing by its
data-parallel size, which is WORLD / ETP when ETP is DeepSpeed's model-parallel group; each expert slice has
seen the tokens of all ETP peers, so its parameter gradient is scaled by 1/ETP (step 4's backward) and the
token gradients are scaled back by ETP (step 2's backward). With ETP = 1 both factors are 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .. import host_reads
from .comm import all_to_all, exchange_counts, gather_rows, reduce_rows
from .expert_shard import ExpertShard, balanced_split
from .row_permutation import inverse_permutation, permute_rows

if TYPE_CHECKING:  # the MoE layer imports this module
    from ..layers.moe.experts import GroupedExperts
    from ..layers.moe.token_permutation import RoutedTokens


def expert_major_order(counts: torch.Tensor, total: int) -> torch.Tensor:
    """Rows laid out in chunks (source s, expert e), s-major, with `counts` [S, E] rows per chunk ->
    `perm` [total] with rows[perm] ordered e-major (expert, then source). Device ops only (`total` from the
    host: the repeat_interleave needs no sync)."""
    n_src, n_exp = counts.shape
    flat = counts.reshape(-1)
    src_start = flat.cumsum(0) - flat  # [S*E]: first row of chunk (s, e) in the source order
    by_expert = counts.t().reshape(-1)  # [E*S]: chunk sizes in the expert order
    exp_start = by_expert.cumsum(0) - by_expert
    chunk = torch.repeat_interleave(
        torch.arange(n_exp * n_src, device=counts.device), by_expert, output_size=total
    )  # expert-order chunk (e, s) of every output row
    offset = torch.arange(total, device=counts.device) - exp_start[chunk]
    e, s = chunk // n_src, chunk % n_src
    return src_start[s * n_exp + e] + offset


class ExpertParallelDispatch:
    def __init__(self, shard: ExpertShard, ep_group: dist.ProcessGroup, etp_group: dist.ProcessGroup) -> None:
        self.ep_group, self.etp_group, self.shard = ep_group, etp_group, shard
        self.ep_size, self.etp_size = shard.ep, shard.etp
        if (dist.get_world_size(ep_group), dist.get_world_size(etp_group)) != (shard.ep, shard.etp):
            raise ValueError(
                f"the EP / ETP groups have {dist.get_world_size(ep_group)} / {dist.get_world_size(etp_group)} "
                f"ranks, the expert shard says EP={shard.ep}, ETP={shard.etp}"
            )

    def _counts(self, routed: RoutedTokens) -> tuple[torch.Tensor, list[int], list[int], list[int]]:
        """Step 0: (counts matrix [ETP * EP sources, E_local] of the rows this rank computes, rows sent to each EP
        rank, rows received from each, rows of each ETP peer) with one host read."""
        n_local = self.shard.num_local
        send_matrix = routed.counts.view(self.ep_size, n_local)  # [EP destination, E_local]
        recv_matrix = exchange_counts(send_matrix, self.ep_group) if self.ep_size > 1 else send_matrix
        if self.etp_size > 1:
            peers = [torch.empty_like(recv_matrix) for _ in range(self.etp_size)]
            dist.all_gather(peers, recv_matrix.contiguous(), group=self.etp_group)
            matrix = torch.cat(peers)  # [ETP * EP, E_local]: ETP peer, then EP source
        else:
            matrix = recv_matrix
        # the layer's one host sync; shape-only (the dry run): every rank routes its pairs evenly over the experts,
        # the load the router's bias steers towards
        sizes = host_reads.to_list(torch.cat([send_matrix.sum(1), matrix.sum(1)]),
                                   shape_only=lambda: self._balanced_sizes(routed.order.numel()))  # fmt: skip
        send, received = sizes[: self.ep_size], sizes[self.ep_size :]
        etp_rank = dist.get_rank(self.etp_group)
        recv = received[etp_rank * self.ep_size : (etp_rank + 1) * self.ep_size]
        peer_rows = [sum(received[r * self.ep_size : (r + 1) * self.ep_size]) for r in range(self.etp_size)]
        return matrix, send, recv, peer_rows

    def _balanced_sizes(self, pairs: int) -> list[int]:
        """The host read's values under balanced routing: rows sent to each EP rank, then received from each
        (ETP peer, EP source)."""
        send = balanced_split(pairs, self.ep_size)
        return send + [send[dist.get_rank(self.ep_group)]] * (self.etp_size * self.ep_size)

    def __call__(
        self, experts: GroupedExperts, x: torch.Tensor, routed: RoutedTokens, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, D], `routed` its (token, expert) pairs sorted by expert, weights [T, k] -> sum_k weight *
        expert(x) [T, D]."""
        matrix, send, recv, peer_rows = self._counts(routed)
        # 1. rows to the experts' EP ranks
        rows = all_to_all(routed.gather(x), send, recv, self.ep_group)  # [R, D]
        # 2. every ETP slice sees all rows of its ETP group
        all_rows = gather_rows(rows, peer_rows, self.etp_group, grad_scale=float(self.etp_size))
        # 3. local experts, rows in expert order
        perm = expert_major_order(matrix, sum(peer_rows))
        inverse = inverse_permutation(perm)
        grouped = experts.ffn(permute_rows(all_rows, perm, inverse), matrix.sum(0))
        partial = permute_rows(grouped, inverse, perm)  # back to the source order
        # 4. sum the FFN slices, keep this rank's rows
        summed = reduce_rows(partial, peer_rows, self.etp_group, grad_scale=1.0 / self.etp_size)
        # 5. back to the source ranks, weighted, summed per token
        back = all_to_all(summed, recv, send, self.ep_group)  # [T*k, D] in the sorted order
        return routed.combine(back, weights, x.dtype)
