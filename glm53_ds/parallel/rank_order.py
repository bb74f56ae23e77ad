"""Where a run's ranks sit on its nodes, and which of its groups cross between nodes.

The layout (layout.py) numbers ranks ETP fastest, then SP (the attention view) or EP (the expert view), then the
data-parallel coordinate. So an ETP group is ETP consecutive ranks, an SP group spans ETP x SP consecutive ranks and
an EP group ETP x EP, and on ranks numbered node by node each stays inside a node whenever its span divides the
ranks per node: ETP first, then SP and EP (folded: each is the second coordinate of its own view, so neither pushes
the other out of a node), then the data-parallel groups, which cross nodes in any order once the world does. That
is the order of their traffic per step (ETP: every expert matmul's partial sums; SP: four all-to-alls per attention
layer; EP: the dispatch and combine of each MoE layer; DP: one gradient reduction per step), so the one thing the
order needs from the hardware is ranks numbered node by node.

DeepSpeed's launcher, torchrun and launch/slurm_node.sh number them so. A launcher that does not (one process per
GPU started by `srun --distribution=cyclic`, or any wrapper that sets RANK round-robin over hosts) would put every
SP and EP pair on two nodes; such a world is renumbered once at start (`renumber_by_node`, before DeepSpeed and
megatron see it): nodes in the order of their lowest launcher rank, a node's ranks in launcher order, said in one
line. Everything after (groups, data streams, checkpoint shards, which are named by layout coordinates, never by a
launcher's rank) sees that order, so a resume across a renumbering is a resume at the same layout.

`group_spans` says, for a map of ranks to nodes, how many nodes each group of a layout reaches: the trainer prints
it at start and the planner for `--gpus-per-node` (plan/__main__.py).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .layout import group_keys

_HOSTS: list[str] | None = None  # every rank's host by (renumbered) rank, set by renumber_by_node


def node_of_ranks(hosts: Sequence[str]) -> list[int]:
    """Each rank's node index, nodes numbered in the order of their lowest rank."""
    order: dict[str, int] = {}
    return [order.setdefault(h, len(order)) for h in hosts]


def node_by_node(hosts: Sequence[str]) -> list[int]:
    """The rank each launcher rank gets when ranks are numbered node by node (nodes in the order of their lowest
    launcher rank, a node's ranks in launcher order); the identity when the launcher did so already."""
    node = node_of_ranks(hosts)
    ordered = sorted(range(len(hosts)), key=lambda r: (node[r], r))
    new = [0] * len(hosts)
    for position, launcher_rank in enumerate(ordered):
        new[launcher_rank] = position
    return new


@dataclass(frozen=True)
class GroupSpan:
    name: str  # "ETP", "SP", "EP", "expert DP", "DP" (at ETP > 1), "replicas"
    size: int  # ranks per group
    nodes: int  # the most nodes one group of this kind reaches

    def __str__(self) -> str:
        return f"{self.name} {self.size}" + ("" if self.nodes == 1 else f" ({self.nodes} nodes)")


# the groups that move data in a step, most traffic first (module docstring)
TRAFFIC_ORDER = ("ETP", "SP", "EP", "expert DP")


def group_spans(node: Sequence[int], ep: int, etp: int, sp: int) -> list[GroupSpan]:
    """For each group of the layout with more than one rank (and the replicas of a non-expert parameter: the
    world), its size and the most nodes one of its groups reaches; `node[r]` is rank r's node."""
    world = len(node)
    keys = group_keys(ep, etp, sp)
    spans = []
    for name in TRAFFIC_ORDER:
        groups: dict[tuple[int, ...], set[int]] = {}
        sizes: dict[tuple[int, ...], int] = {}
        for r in range(world):
            k = keys[name](r)
            groups.setdefault(k, set()).add(node[r])
            sizes[k] = sizes.get(k, 0) + 1
        size = max(sizes.values())
        if size > 1:
            spans.append(GroupSpan(name, size, max(len(g) for g in groups.values())))
    if etp > 1 and world > etp:  # the engine's data-parallel group (the replicas of one ETP rank)
        dp: dict[tuple[int, ...], set[int]] = {}
        for r in range(world):
            dp.setdefault(keys["DP"](r), set()).add(node[r])
        spans.append(GroupSpan("DP", world // etp, max(len(g) for g in dp.values())))
    if world > 1:
        spans.append(GroupSpan("replicas", world, len(set(node))))
    return spans


def placement_line(node: Sequence[int], ep: int, etp: int, sp: int) -> str:
    """One line: the nodes, and which groups stay inside one and which cross."""
    spans = group_spans(node, ep, etp, sp)
    counts = [list(node).count(n) for n in sorted(set(node))]
    shape = (f"{len(counts)} node{'s' * (len(counts) > 1)} x {counts[0]} ranks" if len(set(counts)) == 1 else
             f"{len(counts)} nodes of {'/'.join(map(str, counts))} ranks")  # fmt: skip
    inside = ", ".join(str(s) for s in spans if s.nodes == 1) or "none"
    across = ", ".join(str(s) for s in spans if s.nodes > 1) or "none"
    return f"placement: {shape}; inside a node: {inside}; across nodes: {across}"


def exchange_hosts(store: Any, rank: int, world: int, host: str | None = None) -> list[str]:
    """Every rank's host name through the rendezvous store (before any collective: no device needed)."""
    store.set(f"glm53/host/{rank}", host or socket.gethostname())
    return [store.get(f"glm53/host/{r}").decode() for r in range(world)]


def renumber_by_node(**init_kwargs: Any) -> str | None:
    """On a world whose launcher did not number ranks node by node, the default process group made again on the
        same rendezvous store with the node-by-node ranks (RANK too); returns the line that says so (None: the
        launcher's order kept). Every rank's host is kept for `rank_hosts`. `init_kwargs`: the world's own
    (`timeout`, `device_id`). Collective, before any other group."""
    global _HOSTS
    store = dist.distributed_c10d._get_default_store()  # the rendezvous store; no public accessor
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts = exchange_hosts(store, rank, world)
    new = node_by_node(hosts)
    by_new = [""] * world
    for old, position in enumerate(new):
        by_new[position] = hosts[old]
    _HOSTS = by_new
    if new == list(range(world)):
        return None
    backend = dist.get_backend()
    dist.destroy_process_group()  # no collective has run on it
    dist.init_process_group(backend, store=dist.PrefixStore("glm53/node-by-node/", store), rank=new[rank],
                            world_size=world, **init_kwargs)  # fmt: skip
    os.environ["RANK"] = str(new[rank])
    moved = [f"{old}->{position}" for old, position in enumerate(new) if old != position]
    return (f"rank order: the launcher numbered ranks across nodes ({', '.join(moved[:8])}"
            f"{', ...' if len(moved) > 8 else ''}); renumbered node by node so that ETP, SP and EP groups stay "
            "inside a node (parallel/rank_order.py)")  # fmt: skip


def rank_hosts() -> list[str]:
    """Every rank's host name by rank (the one gathered at start, else gathered now). Collective when gathered."""
    if _HOSTS is not None and len(_HOSTS) == dist.get_world_size():
        return list(_HOSTS)
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts
