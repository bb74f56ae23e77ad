"""Clean up DeepSpeed's CPU shared-memory allreduce buffers.

On CPU, DeepSpeed 0.19.8's communication backend maps a buffer per rank in /dev/shm
(`deepspeed_allreduce_buffer_<i>_<master addr>_<master port>_<rank>`, ~67 MB each) and never unlinks it, so
every CPU job leaves its buffers behind until /dev/shm (RAM) is full. `register_cleanup()` unlinks this
process's buffers at exit; `remove_buffers(port)` is for a launcher whose ranks may have been killed.
"""

from __future__ import annotations

import atexit
import glob
import os

SHM_DIR = "/dev/shm"


def _pattern(addr: str, port: str | int, rank: str | int) -> str:
    return os.path.join(SHM_DIR, f"deepspeed_allreduce_buffer_*_{addr}_{port}_{rank}")


def remove_buffers(port: str | int, addr: str = "*", rank: str | int = "*") -> int:
    removed = 0
    for path in glob.glob(_pattern(addr, port, rank)):
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def register_cleanup() -> None:
    """At exit, unlink the buffers of this rank (CPU jobs only; harmless elsewhere)."""
    port, rank = os.environ.get("MASTER_PORT"), os.environ.get("RANK")
    if port is None or rank is None:
        return
    addr = os.environ.get("MASTER_ADDR", "*")
    atexit.register(remove_buffers, port, addr, rank)
