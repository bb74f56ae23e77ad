"""Run a scenario function on N CPU ranks (gloo) with torch.multiprocessing and collect each rank's result.

The parent picks one free port and passes it to every child (a port derived per child would hang the
rendezvous). Each child writes its result as JSON; a child's exception is re-raised in the parent.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from typing import Any

import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, scenario: str, kwargs: dict[str, Any], out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_SIZE=str(world), OMP_NUM_THREADS="1",
    )  # fmt: skip
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    path = os.path.join(out_dir, f"rank{rank}.json")
    try:
        import torch

        torch.set_num_threads(1)
        from tests import dist_scenarios

        result = getattr(dist_scenarios, scenario)(**kwargs)
        payload = {"ok": True, "result": result}
    except BaseException:  # noqa: BLE001 - reported to the parent
        payload = {"ok": False, "error": traceback.format_exc()}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f)
    if not payload["ok"]:
        raise SystemExit(1)


def run_world(world: int, scenario: str, out_dir: str, timeout: float = 600, **kwargs: Any) -> list[Any]:
    """Run `tests.dist_scenarios.<scenario>(**kwargs)` on `world` ranks; every rank's result, in rank order."""
    os.makedirs(out_dir, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world, port, scenario, kwargs, str(out_dir)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results, errors = [], []
    for rank in range(world):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if not os.path.exists(path):
            errors.append(f"rank {rank}: no result (exit code {procs[rank].exitcode})")
            continue
        with open(path, encoding="utf-8") as f:
            payload = json.load(f)
        if payload["ok"]:
            results.append(payload["result"])
        else:
            errors.append(f"rank {rank}:\n{payload['error']}")
    if errors:
        raise RuntimeError(f"{scenario} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
    return results
