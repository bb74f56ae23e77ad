"""Ulysses-style sequence parallelism (SP): one sample's tokens split contiguously over the SP group.

SP rank r of N holds tokens [r * S/N, (r + 1) * S/N) of every sequence of length S. Token-local work (embedding,
mHC, norms, MLP / MoE, the head and loss) runs on that shard as it is. KDA (and MLA's dense parity path) trades the
token split for a head split and back with one all-to-all each way:
    seq_to_heads  [b, S/N, H, d] -> [b, S, H/N, d]   (rank r gets heads r*H/N ... of every token)
    heads_to_seq  [b, S, H/N, d] -> [b, S/N, H, d]   (the inverse)
and `gather_tokens` gives every rank all S tokens of a small per-token tensor (the DSA indexer's keys, the MLA
latent that the sparse attention of a rank's own queries reads, the key-padding mask). All three are differentiable (comm.py: the backward of an all-to-all is the reverse
all-to-all, of a gather a reduce-scatter). `sum_counts` adds up per-sequence counts over the shards, without
gradient (the MoE balance loss's routing counts).

`SequenceParallel.of(pg_collection)` is None without SP (the layout's `pg_collection.sp` is None or absent, as in
a stock megatron `ProcessGroupCollection`), so every caller keeps its plain path at SP = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .comm import all_to_all, gather_rows


@dataclass(frozen=True)
class SequenceParallel:
    group: dist.ProcessGroup
    size: int
    rank: int

    @classmethod
    def of(cls, pg_collection: Any) -> SequenceParallel | None:
        group = getattr(pg_collection, "sp", None)
        if group is None or dist.get_world_size(group) == 1:
            return None
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    def bounds(self, local_length: int) -> tuple[int, int]:
        """This rank's token range [start, end) of a sequence whose shards hold `local_length` tokens each."""
        return self.rank * local_length, (self.rank + 1) * local_length

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous part of the whole-sequence tensor x along `dim` (its length divisible by SP)."""
        length = x.shape[dim]
        if length % self.size:
            raise ValueError(f"sequence length {length} is not divisible by SP = {self.size}")
        return x.narrow(dim, self.rank * (length // self.size), length // self.size)

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s, H, d] (this rank's tokens, all heads) -> [b, S, H/N, d] (all tokens, this rank's heads)."""
        b, s, h, d = x.shape
        n = self.size
        if h % n:
            raise ValueError(
                f"SP = {n} does not divide the {h} heads of a [b, s, H, d] = {tuple(x.shape)} tensor"
            )
        # rows for rank j: my tokens of head group j, token-major: [n, s, b, h/n, d]
        send = x.reshape(b, s, n, h // n, d).permute(2, 1, 0, 3, 4).reshape(n * s, b, h // n, d)
        received = all_to_all(
            send, [s] * n, [s] * n, self.group
        )  # rank i's tokens of my heads, in rank order
        return received.transpose(0, 1)  # [b, n*s, h/n, d]

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of `seq_to_heads`: [b, S, H/N, d] -> [b, S/N, H, d]."""
        b, length, hn, d = x.shape
        n = self.size
        s = length // n
        send = x.transpose(0, 1).reshape(n * s, b, hn, d)  # rows for rank j: its tokens of my heads
        received = all_to_all(send, [s] * n, [s] * n, self.group)  # [n (head group), s, b, h/n, d]
        return received.reshape(n, s, b, hn, d).permute(2, 1, 0, 3, 4).reshape(b, s, n * hn, d)

    def sum_counts(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the SP group (no gradient: for counts, such as the tokens routed to each expert)."""
        total = x.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total

    def gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s, ...] of every rank -> [b, S, ...] in token order (backward: each rank's part of the summed
        gradient). Integer and boolean tensors pass through without gradient."""
        s = x.shape[1]
        rows = x.transpose(0, 1)
        if x.dtype == torch.bool:
            rows = rows.to(torch.uint8)
        gathered = gather_rows(rows.contiguous(), [s] * self.size, self.group).transpose(0, 1)
        return gathered.bool() if x.dtype == torch.bool else gathered
