"""Measurement helpers shared by the benchmarks: timing, peak extra memory, copy bandwidth, result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# GLM53_BENCH_RESULTS redirects the JSON files (the GPU check's dry run uses it so as not to overwrite results).
RESULTS_DIR = os.environ.get("GLM53_BENCH_RESULTS") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results"
)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: torch.device, warmup: int = 2, repeats: int = 5) -> float:
    """Median wall time of `fn()` in seconds (device-synchronised)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def cpu_and_wall(fn: Callable[[], Any], device: torch.device, repeats: int) -> tuple[float, float]:
    """Medians of process CPU time and wall time over `repeats` calls, after one warm-up."""
    fn()
    synchronize(device)
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        synchronize(device)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall)


class _LiveTensorBytes(TorchDispatchMode):
    """Counts bytes of tensor storages allocated by ops run under it, while they are alive.

    Works on any device (CPU has no allocator statistics). Storages that existed before (inputs, parameters)
    are not counted. Allocations made inside an opaque custom op are invisible except its outputs, so measure
    an implementation function, not the op wrapping it, to see its temporaries.
    """

    def __init__(self, preexisting: list[torch.Tensor]) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: set[int] = {t.untyped_storage().data_ptr() for t in preexisting}

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._tracked.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in self._tracked:
                continue
            self._tracked.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, key, nbytes)
        return out


def peak_extra_bytes(fn: Callable[[], Any], inputs: list[torch.Tensor]) -> int:
    """Peak bytes of tensors allocated while `fn()` runs, beyond `inputs` (the result counts while alive)."""
    device = inputs[0].device
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        result = fn()
        synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del result
        return int(peak)
    mode = _LiveTensorBytes(inputs)
    with mode:
        result = fn()
    del result
    return mode.peak


def allocator_peak_bytes(fn: Callable[[], Any]) -> int:
    """The most bytes of what `fn()` allocated through torch's CPU allocator that were held at once: the
    allocations and frees the profiler records (`profile_memory=True`), summed in time order (a block allocated
    before `fn` and freed in it is not in the record: for a function that frees such blocks this is an upper bound of
    the extra held). It sees the buffers inductor's generated code allocates (below the dispatcher, where the tensor
    count cannot see them), and unlike the RSS it does not depend on what glibc caches or on its mmap threshold: on
    the CPU it is what CUDA's `max_memory_allocated` is on a GPU. Checked: a compiled sin -> matmul -> cos over [4096, 1024] holds 32 MiB (its
    two buffers); the tiny model's eager step 127.6 MiB where the tensor count says 119.1 (the allocator also sees
    ops' scratch)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = prof.profiler.kineto_results.events() if prof.profiler is not None else []
    changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    held = peak = 0
    for _, nbytes in changes:
        held += nbytes
        peak = max(peak, held)
    return peak


class PeakRss:
    """Peak resident set size of this process while the block runs, sampled every 2 ms on a thread:
    `with PeakRss() as rss: ...` then `rss.extra` is the peak over the RSS at entry, in bytes.

    Allocator caveat: glibc raises its mmap threshold after freeing large blocks and then keeps freed heap memory
    mapped; run the process with MALLOC_MMAP_THRESHOLD_=65536 so RSS follows what the code holds (and time nothing
    in that process: it slowed transformers' tiny fp32 step 1.7-2.3x, ours 1.4x). For what torch itself holds, see
    `allocator_peak_bytes`.
    """

    def __enter__(self) -> PeakRss:
        import psutil

        self._process = psutil.Process()
        self._done = threading.Event()
        self.base = self.peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)
        self.extra = self.peak - self.base


def selective_init(module: torch.nn.Module) -> None:
    """Realistic scales for a DSA layer or indexer of random weights: unit-variance projections (each matrix's
    entries of variance 1 / fan-in) and unit pool-position embeddings, so the indexer's scores spread and it selects
    (the default init's small weights make its scores nearly equal)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
            elif "compress_ape" in name:
                p.normal_()


def copy_bandwidth(nbytes: int, device: torch.device) -> float:
    """Measured device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(max(nbytes // 4, 1), dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device)
    return 2 * src.numel() * 4 / seconds


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def join_rank(rank: int, world: int, port: int, device_type: str) -> torch.device:
    """A spawned benchmark rank's set-up before its process group: the launcher's variables (one host), one
    thread, its device (CUDA: GPU `rank`, made current)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")  # fmt: skip
    torch.set_num_threads(1)
    device = torch.device(device_type, rank if device_type == "cuda" else 0)
    if device_type == "cuda":
        torch.cuda.set_device(device)
    return device


def write_results(name: str, payload: dict[str, Any]) -> str:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return path


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
