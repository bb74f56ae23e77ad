"""`check_replicas(model, layout)`: are replicated parameters and buffers still identical across replicas?

Replica groups: non-expert tensors -> the whole world; expert tensors (`allreduce == False`) -> the
expert-data-parallel group (ranks holding the same expert shard; routed experts kept in block-FP8 too); expert tensors whole on every ETP rank of their
shard (`etp_replicated`: LoRA's `gate_up_A` / `down_B`) -> the ETP group too. A float64 checksum per tensor (sum and sum
of squares) is all-gathered; on any mismatch the max elementwise difference of each offending tensor is
computed and a `ReplicaMismatch` names them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .layout import ParallelLayout
from .params import expert_buffer_names, is_expert_param


class ReplicaMismatch(RuntimeError):
    pass


def _tensors(model: nn.Module, experts: bool) -> list[tuple[str, torch.Tensor]]:
    out = []
    expert_buffers = expert_buffer_names(model)  # routed experts kept in block-FP8: buffers, sharded
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("expert_load"):  # per-rank token counts by design
            continue
        if (is_expert_param(t) or name in expert_buffers) == experts:
            out.append((name, t))
    return out


def _check(named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None) -> list[str]:
    if not named or dist.get_world_size(group) == 1:
        return []
    named = [(n, t.detach()) for n, t in named]
    local = torch.stack([torch.stack([t.double().sum(), t.double().square().sum()]) for _, t in named]).to(
        named[0][1].device
    )  # [P, 2]
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    stacked = torch.stack(gathered)  # [G, P, 2]
    bad = (stacked != stacked[:1]).any(-1).any(0).nonzero().flatten().tolist()
    problems = []
    for i in bad:
        name, t = named[i]
        hi, lo = t.double().clone(), t.double().clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        problems.append(f"{name} (max difference {(hi - lo).max().item():.3g})")
    return problems


def check_replicas(model: nn.Module, layout: ParallelLayout) -> None:
    experts = _tensors(model, experts=True)
    problems = _check(_tensors(model, experts=False), None) + _check(experts, layout.expert_dp_group)
    problems += _check([(n, t) for n, t in experts if getattr(t, "etp_replicated", False)], layout.etp_group)
    if problems:
        raise ReplicaMismatch(
            f"replicas differ on rank {layout.rank}: {len(problems)} tensor(s): " + ", ".join(problems)
        )
