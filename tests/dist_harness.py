"""Run a scenario function on N CPU ranks (gloo) with torch.multiprocessing and collect each rank's result.

The parent picks one free port and passes it to every child (a port derived per child would hang the
rendezvous). Each child writes its result as JSON; a child's exception is re-raised in the parent.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

import torch.multiprocessing as mp

from glm53_ds.compat.deepspeed_shm import remove_buffers
from glm53_ds.parallel.state import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    if payload[
        "ok"
    ]:  # a finished rank's groups, destroyed before teardown (see engine.build.close_distributed)
        from glm53_ds.engine import close_distributed

        close_distributed()
    if not payload["ok"]:
        raise SystemExit(1)


def _launch(world: int, scenario: str, out_dir: str, timeout: float, kwargs: dict[str, Any]) -> list[dict]:
    """One attempt: start every rank, stop all of them as soon as one fails (the others would wait forever in a
    collective), return each rank's payload (or a placeholder for a rank that wrote none)."""
    import time

    ctx = mp.get_context("spawn")
    port = free_port()
    for rank in range(world):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if os.path.exists(path):
            os.remove(path)
    procs = [
        ctx.Process(target=_child, args=(r, world, port, scenario, kwargs, str(out_dir)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs):
        if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    remove_buffers(port)  # DeepSpeed's /dev/shm buffers of ranks that did not exit cleanly
    payloads = []
    for rank in range(world):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                payloads.append(json.load(f))
        else:
            payloads.append({"ok": False, "error": f"no result (exit code {procs[rank].exitcode})"})
    return payloads


def run_world(world: int, scenario: str, out_dir: str, timeout: float = 1800, **kwargs: Any) -> list[Any]:
    """Run `tests.dist_scenarios.<scenario>(**kwargs)` on `world` ranks; every rank's result, in rank order.

    A rendezvous port taken between choosing and binding it (EADDRINUSE) is retried with a new port."""
    os.makedirs(out_dir, exist_ok=True)
    for _attempt in range(3):
        payloads = _launch(world, scenario, str(out_dir), timeout, kwargs)
        if not any(
            "EADDRINUSE" in p.get("error", "") or "address already in use" in p.get("error", "")
            for p in payloads
        ):
            break
    errors = [f"rank {r}:\n{p['error']}" for r, p in enumerate(payloads) if not p["ok"]]
    if errors:
        raise RuntimeError(f"{scenario} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
    return [p["result"] for p in payloads]
