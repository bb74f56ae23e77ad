"""Preparing Hugging Face data for a run, in one run: tokenising throughput with 1 vs N workers against
`datasets.map(num_proc=N)` doing the same per-row work on the same rows, and peak RSS while preparing and while
reading a whole epoch on 20k vs 200k synthetic conversations.

Throughput: `--rows` synthetic chat conversations (2-4 turns, ~70 words each) in one parquet file, already
converted to Arrow by `datasets` (both sides start from the same memory-mapped Dataset); the tokenizer is a real
`transformers` fast tokenizer with a Jinja chat template (the byte vocabulary, convert/tokenizer_files.py), so each
row is `apply_chat_template` on growing prefixes, as training renders it. `glm53` = the whole cache build
(`training.data.open_stream`: rows read, rendered, chunk files written, packed rows written); `datasets.map` =
`Dataset.map(render, num_proc=N)` writing its Arrow cache (no packing: a lower bound of the same work). Wall time
(several processes), with the CPU time of this process and its children beside it; medians of `--repeats`.

Memory: a child process builds the packed cache of `--small` and then of `--large` conversations (the byte
tokenizer: the per-row cost is not the point) and reports its peak anonymous RSS (`RssAnon`, sampled every 50 ms:
what the process allocates; the memory-mapped cache's pages are file-backed and reclaimable, so not counted) and
its largest worker's; another child maps the cache and reads every sample of one epoch as training does
(`micro_batch`), reporting the same (and `ru_maxrss`, which counts the mapped pages it touched). Ratios
large / small of the peaks; goal ≤ 1.2 (flat: nothing grows with the data).

    python3 benchmarks/data_prepare.py [--rows 20000] [--workers 2] [--small 20000 --large 200000] [--repeats 3]

Last line: `data_prepare workers_speedup=… glm53_vs_datasets_map=… prepare_rss_ratio=… train_rss_ratio=…`
(`glm53_vs_datasets_map`: datasets.map's time / ours, goal ≥ 0.9). JSON: benchmarks/results/data_prepare_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.measure import print_table, write_results  # noqa: E402

WORDS = ("the model reads every token of the conversation and answers with care about weather cities numbers "
         "tools code data sets parquet arrow shards workers progress cache lock memory").split()  # fmt: skip


def write_conversations(path: str, rows: int, seed: int = 0) -> None:
    """`rows` synthetic conversations as one parquet file, written in batches (bounded memory)."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    writer = None
    for begin in range(0, rows, 5000):
        batch = []
        for _ in range(min(5000, rows - begin)):
            turns = [{"role": "system", "content": "be brief"}] if rng.random() < 0.3 else []
            for _turn in range(rng.randint(1, 2)):
                turns.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(8, 30)))})
                turns.append(
                    {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(10, 40)))}
                )
            batch.append({"messages": turns})
        table = pa.Table.from_pylist(batch)
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    assert writer is not None
    writer.close()


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def throughput(rows: int, workers: int, repeats: int, work: str) -> dict[str, Any]:
    import datasets

    from glm53_ds.convert.tokenizer_files import write_byte_tokenizer
    from glm53_ds.data.columns import record
    from glm53_ds.training.data import Building, HFTokenizer, open_stream
    from glm53_ds.training.packing import chat_messages, render_chat

    datasets.disable_progress_bars()
    data = os.path.join(work, "chat.parquet")
    write_conversations(data, rows)
    write_byte_tokenizer(os.path.join(work, "tok"))
    tokenizer = HFTokenizer(os.path.join(work, "tok"))
    ds = datasets.load_dataset(
        "parquet", data_files=[data], split="train", cache_dir=os.path.join(work, "hf")
    )
    cache_of_ours = os.path.join(work, "c")
    open_stream(
        data, tokenizer, cache_of_ours, 512, 1, 300, pack=False
    )  # warm: datasets' Arrow copy made once

    def ours(n: int) -> None:
        for entry in os.listdir(cache_of_ours):
            if entry.endswith(".packed"):
                shutil.rmtree(os.path.join(cache_of_ours, entry))
        open_stream(data, tokenizer, cache_of_ours, 512, 1, 300, pack=False, building=Building(n))

    def render(row: Any) -> dict:  # what a worker does per row (data/prepare.py), under datasets' own loop
        value = record(dict(row), "messages", {}, "row")
        ids, trained = render_chat(tokenizer, chat_messages(value, "row"), "row")
        return {"input_ids": ids, "trained": trained}

    def with_map(n: int) -> None:
        ds.map(render, num_proc=n if n > 1 else None, load_from_cache_file=False,
               cache_file_name=os.path.join(work, f"map-{time.time_ns()}.arrow"), remove_columns=ds.column_names)  # fmt: skip

    results = {}
    for name, fn in (("glm53 1 worker", lambda: ours(1)), (f"glm53 {workers} workers", lambda: ours(workers)),
                     (f"datasets.map num_proc={workers}", lambda: with_map(workers))):  # fmt: skip
        walls, cpus = [], []
        for _ in range(repeats):
            c0, w0 = _cpu(), time.perf_counter()
            fn()
            walls.append(time.perf_counter() - w0)
            cpus.append(_cpu() - c0)
        wall = statistics.median(walls)
        results[name] = dict(wall_s=wall, cpu_s=statistics.median(cpus), rows_per_s=rows / wall)
    return results


def _peak_child(args: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def _anon_mib(pid: int | str = "self") -> float:
    """Anonymous resident memory (RssAnon: what the process itself allocated; the memory-mapped cache's pages are
    file-backed, shared and reclaimable, so they are not counted)."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024
    except (OSError, StopIteration):
        return 0.0


class AnonPeak:
    """The peak RssAnon of this process and, separately, of the largest of its children (the workers), sampled
    every 50 ms by a thread."""

    def __init__(self) -> None:
        import threading

        import psutil

        self.own = self.workers = 0.0
        self._me, self._stop = psutil.Process(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.own = max(self.own, _anon_mib())
            for child in self._me.children(recursive=True):
                self.workers = max(self.workers, _anon_mib(child.pid))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.own = max(self.own, _anon_mib())


def child(mode: str, data: str, cache: str, workers: int) -> None:
    """One measured process: `prepare` builds the packed cache; `train` reads every sample of one epoch."""
    from glm53_ds.training.data import Building, ByteTokenizer, open_stream

    base = _anon_mib()
    peak = AnonPeak()
    building = Building(workers if mode == "prepare" else 1)
    stream = open_stream(data, ByteTokenizer(), cache, 512, 1, 300, pack=False, building=building)
    if mode == "train":
        for consumed in range(0, stream.num_samples, 8):
            stream.micro_batch(consumed, 0, 0, 1, 8)
    peak.stop()
    print(json.dumps(dict(peak_anon_mib=peak.own, after_imports_anon_mib=base, workers_peak_anon_mib=peak.workers,
                          peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                          samples=stream.num_samples)))  # fmt: skip


def memory(small: int, large: int, workers: int, work: str) -> dict[str, Any]:
    out = {}
    for rows in (small, large):
        data = os.path.join(work, f"chat{rows}.parquet")
        write_conversations(data, rows)
        cache = os.path.join(work, f"cache{rows}")
        out[rows] = dict(prepare=_peak_child(["--child", "prepare", data, cache, str(workers)]),
                         train=_peak_child(["--child", "train", data, cache, "1"]))  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--small", type=int, default=20000)
    parser.add_argument("--large", type=int, default=200000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, data, cache, workers = args.child
        child(mode, data, cache, int(workers))
        return
    work = tempfile.mkdtemp(prefix="data_prepare-")
    try:
        speed = throughput(args.rows, args.workers, args.repeats, work)
        rss = memory(args.small, args.large, args.workers, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [dict(run=name, **{k: round(v, 3) for k, v in r.items()}) for name, r in speed.items()]
    print_table(rows, ["run", "wall_s", "cpu_s", "rows_per_s"])
    one, many = speed["glm53 1 worker"]["wall_s"], speed[f"glm53 {args.workers} workers"]["wall_s"]
    mapped = speed[f"datasets.map num_proc={args.workers}"]["wall_s"]
    small, large = rss[args.small], rss[args.large]
    memory_rows = [dict(rows=n, **{f"{phase}_{k}": round(v, 1) for phase in ("prepare", "train")
                                   for k, v in r[phase].items() if k != "samples"}) for n, r in rss.items()]  # fmt: skip
    print_table(memory_rows, list(memory_rows[0]))
    ratios = dict(
        workers_speedup=one / many,
        glm53_vs_datasets_map=mapped / many,
        prepare_rss_ratio=max(large["prepare"]["peak_anon_mib"], large["prepare"]["workers_peak_anon_mib"])
        / max(small["prepare"]["peak_anon_mib"], small["prepare"]["workers_peak_anon_mib"]),
        train_rss_ratio=large["train"]["peak_anon_mib"] / small["train"]["peak_anon_mib"],
    )
    write_results("data_prepare_cpu", dict(args=vars(args), cores=os.cpu_count(), throughput=speed,
                                           memory={str(k): v for k, v in rss.items()}, ratios=ratios))  # fmt: skip
    print("data_prepare " + " ".join(f"{k}={v:.3f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
