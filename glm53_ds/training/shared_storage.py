"""Storage every node must share, proved at start-up: a run across nodes writes its checkpoints, outputs and data
cache once, from one rank, and reads its weights on every node, so a path that is node-local on one node (a local
disk mounted at the same path, a missing NFS mount) would leave that node's ranks writing into a directory no other
node sees, or reading other weights. Before any work, rank 0 writes a token of this run into each directory
(`.glm53-shared-<token>`, removed right after) and the first rank of every node reads it; `--hf-dir` is read-only,
so every node's fingerprint of its index and config is compared instead. A node that does not see the same is one
`error:` line naming the node and the path."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from ..parallel.rank_order import rank_hosts
from .errors import SetupError


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def _weights_fingerprint(directory: str) -> str:
    """What identifies a released checkpoint cheaply: its config and index files' bytes."""
    digest = hashlib.blake2b(digest_size=12)
    for name in sorted(os.listdir(directory)):
        if name.endswith((".json", ".index.json")):
            with open(os.path.join(directory, name), "rb") as f:
                digest.update(name.encode() + b"|" + f.read())
    return digest.hexdigest()


def check_shared_storage(writable: Sequence[tuple[str, str]], readable: Sequence[tuple[str, str]]) -> None:
    """`writable`: (option, directory) that rank 0 writes for every node; `readable`: (option, directory) every node
    reads. SetupError naming the first node and path that differs from node 0's. Collective; a no-op on one node."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts = rank_hosts()
    host = hosts[rank]
    if len(set(hosts)) == 1:
        return
    token = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    names = [os.path.join(d, f".glm53-shared-{token[0]}") for _, d in writable]
    if rank == 0:
        for name in names:
            os.makedirs(os.path.dirname(name), exist_ok=True)
            with open(name, "w", encoding="utf-8") as f:
                f.write(str(token[0]))
    dist.barrier()
    first_of_node = hosts.index(host) == rank
    seen: list[str | None] = []
    if first_of_node:
        seen = [("ok" if _read(n) == token[0] else "missing") for n in names]
        seen += [_weights_fingerprint(d) if os.path.isdir(d) else "missing" for _, d in readable]
    views: list[Any] = [None] * world
    dist.all_gather_object(views, seen)
    dist.barrier()
    if rank == 0:
        for name in names:
            os.unlink(name)  # written by this run
    reference = views[0]
    for r, view in enumerate(views):
        if not view or view == reference:
            continue
        k = next(i for i, (a, b) in enumerate(zip(view, reference, strict=True)) if a != b)
        option, directory = (list(writable) + list(readable))[k]
        what = ("sees no file node 0 wrote there" if k < len(writable) else
                "holds other weights there" if view[k] != "missing" else "has no such directory")  # fmt: skip
        raise SetupError(f"{option} {directory!r}: node {hosts[r]} (rank {r}) {what}: a path that is local to "
                         f"a node; every node must see the same storage there (a shared file system mounted at "
                         f"the same path)")  # fmt: skip
