"""Differentiable collectives for expert parallelism, on gloo (CPU) and NCCL.

- `all_to_all(x, send_counts, recv_counts, group)`: rows of x go to the group's ranks in order; backward sends
  the gradients back the same way (the reverse all-to-all).
- `gather_rows(x, group, grad_scale)`: every rank gets all ranks' rows (variable counts); backward sums the
  gradients of each rank's rows over the group (reduce-scatter) and multiplies by `grad_scale`.
- `reduce_rows(x, counts, group, grad_scale)`: the inverse: rows laid out as `gather_rows` produced them are
  summed over the group and each rank keeps its own; backward gathers the gradients, times `grad_scale`.
- `sum_grad_over(t, group)`: `t` itself; backward sums its gradient over the group (a tensor every rank of the
  group holds whole, whose gradient each rank sees only its share of).
gloo has no reduce-scatter, so there an all-reduce plus a slice stands in (same result, more traffic).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _is_gloo(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "gloo"


def exchange_counts(send_counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Each rank's counts for every other rank (`send_counts` [ranks, ...], row r for rank r) -> the counts each
    rank sent this one ([ranks, ...], row r from rank r); on the device."""
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=group)
    return recv


def _all_to_all_rows(
    x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all_rows(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _all_to_all_rows(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, send, recv, group)


def _gather_padded(x: torch.Tensor, counts: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Rows of every rank, concatenated in rank order ([sum(counts), ...])."""
    width = max(counts) if counts else 0
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[: x.shape[0]] = x
    chunks = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(chunks, padded.contiguous(), group=group)
    return torch.cat([c[:n] for c, n in zip(chunks, counts, strict=True)])


def _reduce_scatter_rows(x: torch.Tensor, counts: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over the group of rows laid out per rank; this rank's rows ([counts[rank], ...])."""
    rank = dist.get_rank(group)
    start = sum(counts[:rank])
    if _is_gloo(group):
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total[start : start + counts[rank]]
    width = max(counts)
    padded = x.new_zeros((len(counts) * width, *x.shape[1:]))
    offset = 0
    for r, n in enumerate(counts):
        padded[r * width : r * width + n] = x[offset : offset + n]
        offset += n
    out = x.new_empty((width, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, padded, group=group)
    return out[: counts[rank]]


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, counts: list[int], group: dist.ProcessGroup, grad_scale: float
    ) -> torch.Tensor:
        ctx.counts, ctx.group, ctx.grad_scale = counts, group, grad_scale
        return _gather_padded(x, counts, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = _reduce_scatter_rows(grad, ctx.counts, ctx.group)
        return (out * ctx.grad_scale if ctx.grad_scale != 1.0 else out), None, None, None


class _ReduceRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, counts: list[int], group: dist.ProcessGroup, grad_scale: float
    ) -> torch.Tensor:
        ctx.counts, ctx.group, ctx.grad_scale = counts, group, grad_scale
        return _reduce_scatter_rows(x, counts, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = _gather_padded(grad.contiguous(), ctx.counts, ctx.group)
        return (out * ctx.grad_scale if ctx.grad_scale != 1.0 else out), None, None, None


def gather_rows(
    x: torch.Tensor, counts: list[int], group: dist.ProcessGroup, grad_scale: float = 1.0
) -> torch.Tensor:
    if len(counts) == 1:
        return x
    return _GatherRows.apply(x, counts, group, grad_scale)


def reduce_rows(
    x: torch.Tensor, counts: list[int], group: dist.ProcessGroup, grad_scale: float = 1.0
) -> torch.Tensor:
    if len(counts) == 1:
        return x
    return _ReduceRows.apply(x, counts, group, grad_scale)


class _SumGradOver(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grad_over(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return t
    return _SumGradOver.apply(t, group)
