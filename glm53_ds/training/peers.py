"""Which ranks a run lost, when a collective fails: a heartbeat in the rendezvous store.

A node that dies is seen at once by its peers' sockets (gloo: `Connection closed by peer`, a 20-line traceback per
rank); a frozen one (SIGSTOP, a hung GPU, a cut network) only when a collective's `--dist-timeout` passes. Either
way the collective's error says nothing of who is gone. So every rank writes the time to the rendezvous store
(the c10d store on MASTER_ADDR) every `PERIOD` seconds from a daemon thread; a rank whose collective failed waits
until every rank has either written after the failure (alive) or stayed silent for `2 * PERIOD` past it
(vanished), and names the silent ranks with their hosts. When the store itself is gone, the node that held it
(node 0, MASTER_ADDR) is the one that vanished.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from ..checkpoint.directory import has_latest, latest_tag
from ..parallel.rank_order import rank_hosts

PERIOD = 2.0  # seconds between heartbeats
KEY = "glm53/heartbeat/{}"

# What a collective raises when a peer is gone: torch's distributed errors, and gloo's RuntimeErrors
PEER_LOSS_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out",
                   "connectFullMesh", "Broken pipe", "Socket Timeout", "NCCL communicator was aborted",
                   "ProcessGroupGloo", "Connection refused")  # fmt: skip


def is_peer_loss(error: BaseException) -> bool:
    """Whether `error` is a collective that failed for want of a peer."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    return isinstance(error, RuntimeError) and any(sign in str(error) for sign in PEER_LOSS_SIGNS)


def ranges(ranks: Sequence[int]) -> str:
    """`[0, 1, 2, 5]` -> '0-2, 5'."""
    out: list[str] = []
    for r in sorted(ranks):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


class Heartbeat:
    """The rank's heartbeat (module docstring); `hosts[r]` is rank r's host name, gathered at start-up."""

    def __init__(self, store: Any, rank: int, hosts: Sequence[str], period: float = PERIOD) -> None:
        self.store, self.rank, self.hosts, self.period = store, rank, list(hosts), period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="glm53-heartbeat", daemon=True)

    @classmethod
    def start_default(cls) -> Heartbeat | None:
        """On the default process group's store, every rank's host gathered (None for a world of one or without a
        store). Collective."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        hosts = rank_hosts()
        try:
            store = dist.distributed_c10d._get_default_store()  # the rendezvous store; no public accessor
        except (RuntimeError, AttributeError, ValueError):
            return None
        beat = cls(store, dist.get_rank(), hosts)
        beat._thread.start()
        return beat

    def _beat(self) -> None:
        while True:
            try:
                self.store.set(KEY.format(self.rank), repr(time.time()))
            except Exception:  # noqa: BLE001 - the store is gone: nothing more to say from here
                return
            if self._stop.wait(self.period):
                return

    def stop(self) -> None:
        self._stop.set()

    def _last_beats(self) -> list[float | None]:
        keys = [KEY.format(r) for r in range(len(self.hosts))]
        beats: list[float | None] = []
        for key in keys:
            if not self.store.check([key]):
                beats.append(None)
                continue
            beats.append(float(self.store.get(key).decode()))
        return beats

    def vanished(self, since: float | None = None) -> str:
        """The ranks silent since the failure at `since` (now if None), with their hosts, in words."""
        since = time.time() if since is None else since
        deadline = since + 2 * self.period + 1.0
        try:
            while True:
                beats = self._last_beats()
                silent = [r for r, t in enumerate(beats) if t is None or t < since]
                if not silent or time.time() >= deadline:
                    break
                time.sleep(self.period / 4)
        except Exception:  # noqa: BLE001 - the store (on node 0) is unreachable
            node0 = [r for r, h in enumerate(self.hosts) if h == self.hosts[0]]
            return (f"the rendezvous store on MASTER_ADDR {os.environ.get('MASTER_ADDR', '?')} is unreachable: "
                    f"node {self.hosts[0]} (ranks {ranges(node0)}) vanished")  # fmt: skip
        if not silent:
            return "no rank is silent (a collective failed while every rank still runs)"
        by_host: dict[str, list[int]] = {}
        for r in silent:
            by_host.setdefault(self.hosts[r], []).append(r)
        whole = [h for h, rs in by_host.items() if rs == [r for r, x in enumerate(self.hosts) if x == h]]
        parts = [f"{'node' if h in whole else 'on'} {h} (ranks {ranges(rs)})" for h, rs in by_host.items()]
        quiet = time.time() - min(beats[r] or since for r in silent)
        return f"{'; '.join(parts)} vanished (no heartbeat for {quiet:.0f} s)"


def lost_peers_line(
    heartbeat: Heartbeat | None, error: BaseException, step: int | None, save: str | None
) -> str | None:
    """The one line a rank whose collective failed for want of a peer exits with: who vanished, the last whole
    checkpoint (`latest` of --save) and how to go on; None when `error` is not that."""
    if heartbeat is None or not is_peer_loss(error):
        return None
    failed_at = time.time()
    who = heartbeat.vanished(failed_at)
    where = f" in step {step + 1}" if step is not None else ""
    last = "no checkpoint was saved (no --save)" if not save else "no whole checkpoint yet in --save"
    if save and has_latest(save):
        tag = latest_tag(save)
        last = f"the last whole checkpoint is {os.path.join(save, tag)} ('latest'); restart every node with --load {save} to resume from it"  # fmt: skip
    cause = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
    return f"rank {heartbeat.rank} ({heartbeat.hosts[heartbeat.rank]}): a collective failed{where}: {who}; {last} [{cause}]"
