"""Tokenising a source into its cache: by N worker processes, once per file system, in bounded memory.

A row source is read in contiguous chunks of rows (a `datasets.Dataset`'s rows, memory-mapped Arrow; a `.jsonl`
file's byte ranges, cut at line starts; a text file is one row). Each worker tokenises its chunks (the chat template
for chat rows, `columns.record` for the columns) and writes each one's token ids, target mask and document lengths
to files; the parent then reads the chunks in order and writes the cache: packed rows (`packing.build_packed`) or a
megatron indexed dataset (windows). Chunk order is row order, so the cache is the same bytes at any worker count.
Memory holds a chunk's rows and one packed row, never the data.

The cache is built once per file system: the builder holds a kernel `flock` on `<cache>.lock` (dropped by the
kernel however the builder ends, so a killed one never leaves it held) and writes under a temporary name renamed
whole into place (a killed build leaves nothing that passes for a cache). Processes that find it building wait
on the lock and read what it built; a build that failed leaves `.locks/<cache>.failed` with its error, which the
processes that were waiting on it raise instead of building again.
"""

from __future__ import annotations

import fcntl
import json
import math
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..safe_io import atomic_write_text, new_temp_dir
from ..training.packing import build_packed, chat_messages, render_chat
from .columns import check_types, describe, detect_shape, is_chat, record
from .sources import Source

ROWS_PER_CHUNK = 2048  # rows a worker tokenises per task (its memory; the progress bar's step)
JSONL_CHUNK_BYTES = 4 << 20


def default_workers() -> int:
    """`--data-workers` by default: this rank's share of the CPU cores it may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks_here = (
        os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or "1"
    )  # DeepSpeed's, torchrun's
    return max(1, cores // max(1, int(ranks_here)))


# ----------------------------------------------------------------------------- what a source holds
@dataclass
class Inspected:
    """A source's shape, read from its first row / schema: the shape (`columns.SHAPES`), the column mapping that
    applies, and the line that says so."""

    shape: str
    mapping: dict[str, str]
    line: str

    @property
    def chat(self) -> bool:
        return is_chat(self.shape)


def _quiet_datasets() -> Any:
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def load_rows(source: Source, cache_dir: str, workers: int = 1, streaming: bool = False) -> Any:
    """The source's rows as a `datasets.Dataset` (memory-mapped Arrow: files `load_dataset` converts go to
    `<cache_dir>/hf_datasets`), or an `IterableDataset` when `streaming` (nothing converted: for a first look)."""
    datasets = _quiet_datasets()
    where = f"--data {source.named}"
    if source.loader == "load_from_disk" and _saved_without_rows(source):
        raise ValueError(f"{where}: holds no rows")
    try:
        if source.loader == "load_from_disk":
            ds = datasets.load_from_disk(source.path)
            return ds[source.split] if source.split else ds
        kwargs: dict[str, Any] = dict(split=source.split or "train", streaming=streaming)
        if not streaming:
            kwargs.update(cache_dir=os.path.join(cache_dir, "hf_datasets"))
            if workers > 1 and len(source.files) > 1:
                kwargs["num_proc"] = min(workers, len(source.files))
        if source.builder:
            return datasets.load_dataset(source.builder, data_files=list(source.files), **kwargs)
        return datasets.load_dataset(source.path, **kwargs)
    except Exception as e:  # noqa: BLE001 - datasets' and pyarrow's own error types (cast, parse, ...) too
        raise ValueError(f"{where}: datasets cannot read it ({type(e).__name__}: {_first_line(e)})") from e


def _saved_without_rows(source: Source) -> bool:
    """A save_to_disk split with no data file (datasets saves an empty one so, and cannot load it back)."""
    state = os.path.join(source.path, source.split or "", "state.json")
    try:
        with open(state, encoding="utf-8") as f:
            return not json.load(f).get("_data_files")
    except (OSError, ValueError, AttributeError):
        return False


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def inspect_source(source: Source, columns: Any, cache_dir: str) -> Inspected:
    """The shape of `source`'s rows (`columns`: the run's `ColumnMap`); ValueError naming source, split and column
    for missing or wrong-typed columns and an empty split."""
    where = f"--data {source.named}"
    if source.kind in ("text", "indexed"):
        return Inspected("text", {}, f"data: {source.path}: {source.form}")
    features = None
    if source.kind == "jsonl":
        first = next((r for _, r in _jsonl_records(source.path)), None)
        if first is None:
            raise ValueError(f"{where}: holds no rows")
        if not isinstance(first, dict):
            raise ValueError(f"{source.path}:1: a row must be a JSON object")
        names = list(first)
    else:
        ds = load_rows(source, cache_dir, streaming=source.loader != "load_from_disk")
        features = ds.features
        if source.loader == "load_from_disk":
            if ds.num_rows == 0:
                raise ValueError(f"{where}: holds no rows")
            names = list(ds.column_names)
        else:
            try:
                first = next(iter(ds), None)
            except Exception as e:  # noqa: BLE001 - datasets' and pyarrow's parse errors
                raise ValueError(
                    f"{where}: datasets cannot read it ({type(e).__name__}: {_first_line(e)})"
                ) from e
            if first is None:
                raise ValueError(f"{where}: holds no rows")
            names = list(features) if features else list(first)
    mapping = columns.for_source(source.entry, names)
    shape = detect_shape(names, mapping, where)
    if features:
        check_types(features, shape, mapping, where)
    return Inspected(shape, mapping, f"data: {source.named}: {source.form}; {describe(shape, mapping)}")


# ----------------------------------------------------------------------------- reading rows
def _jsonl_records(
    path: str, begin: int = 0, end: int | None = None, line: int = 1
) -> Iterator[tuple[str, Any]]:
    """(`file:line`, parsed record) for every non-blank line of a .jsonl file in bytes [begin, end) (a range that
    starts at a line start, its first line numbered `line`); a bad line names file and line."""
    with open(path, "rb") as f:
        f.seek(begin)
        position = begin
        for i, raw in enumerate(f, line):
            if end is not None and position >= end:
                break
            position += len(raw)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{i}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})"
                ) from e
            if text.strip():
                try:
                    yield f"{path}:{i}", json.loads(text)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not a JSON line ({e.msg} at column {e.colno})") from e
                except RecursionError as e:
                    raise ValueError(f"{path}:{i}: a JSON line nested too deeply to read") from e


def _jsonl_chunks(path: str, chunk_bytes: int) -> tuple[list[tuple[int, int, int]], int]:
    """Byte ranges of about `chunk_bytes` cut at line starts, each with its first line's number; and the lines."""
    size, chunks, begin, line = os.path.getsize(path), [], 0, 1
    with open(path, "rb") as f:
        while begin < size:
            f.seek(min(size, begin + chunk_bytes))
            f.readline()  # to the next line start
            end = min(size, f.tell()) if begin + chunk_bytes < size else size
            f.seek(begin)
            lines = f.read(end - begin).count(b"\n")
            chunks.append((begin, end, line))
            begin, line = end, line + lines
    return chunks, line - 1


@dataclass
class _Job:
    """What a worker reads (inherited at fork: the Dataset's memory map is shared, nothing is pickled)."""

    source: Source
    inspected: Inspected
    tokenizer: Any
    rows: Any  # a datasets.Dataset, or None (jsonl, text)
    chunks: list[tuple[int, int, int]]  # (begin, end, first line): rows, or jsonl bytes
    work: str  # the directory of the chunk files


_JOB: _Job | None = None


def _documents_of_chunk(job: _Job, c: int) -> Iterator[tuple[list[int], list[bool]]]:
    begin, end, line = job.chunks[c]
    source, inspected, tok = job.source, job.inspected, job.tokenizer
    if source.kind == "text":
        with open(source.path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{source.path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})"
            ) from e
        ids = tok.encode(text) + [tok.eod_id]
        yield ids, [True] * len(ids)
        return
    if source.kind == "jsonl":
        records: Iterator[tuple[str, Any]] = _jsonl_records(source.path, begin, end, line)
    else:
        records = _arrow_records(job, begin, end)
    texts: list[str] = []
    for where, row in records:
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be a JSON object")
        value = record(row, inspected.shape, inspected.mapping, where)
        if inspected.chat:
            yield render_chat(tok, chat_messages(value, where), where)
        else:
            texts.append(value)
            if len(texts) == 256:
                yield from _text_documents(tok, texts)
                texts = []
    yield from _text_documents(tok, texts)


def _text_documents(tok: Any, texts: list[str]) -> Iterator[tuple[list[int], list[bool]]]:
    for ids in tok.encode_batch(texts) if hasattr(tok, "encode_batch") else map(tok.encode, texts):
        ids = list(ids) + [tok.eod_id]
        yield ids, [True] * len(ids)


def _arrow_records(job: _Job, begin: int, end: int) -> Iterator[tuple[str, Any]]:
    split = f" split {job.source.split}," if job.source.split else ""
    for start in range(begin, end, 256):
        batch = job.rows[start : min(end, start + 256)]
        names = list(batch)
        for i, values in enumerate(zip(*(batch[n] for n in names), strict=True)):
            yield f"--data {job.source.path}{split} row {start + i}", dict(zip(names, values, strict=True))


def _tokenize_chunk(c: int) -> tuple[int, int, int]:
    """Worker: chunk `c`'s documents to `<work>/<c>.ids` (int32), `.mask` (uint8), `.len` (int64); (c, documents,
    tokens)."""
    job = _JOB
    assert job is not None
    base = os.path.join(job.work, str(c))
    lengths: list[int] = []
    with open(base + ".ids", "wb") as ids_file, open(base + ".mask", "wb") as mask_file:
        for ids, trained in _documents_of_chunk(job, c):
            ids_file.write(np.asarray(ids, dtype=np.int32).tobytes())
            mask_file.write(np.asarray(trained, dtype=np.uint8).tobytes())
            lengths.append(len(ids))
    np.asarray(lengths, dtype=np.int64).tofile(base + ".len")
    return c, len(lengths), int(sum(lengths))


def _chunk_documents(work: str, count: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Every document of chunks 0..count-1 in order, (ids int32, trained bool), one chunk in memory at a time."""
    for c in range(count):
        base = os.path.join(work, str(c))
        lengths = np.fromfile(base + ".len", dtype=np.int64)
        ids = np.fromfile(base + ".ids", dtype=np.int32)
        mask = np.fromfile(base + ".mask", dtype=np.uint8).astype(bool)
        cuts = np.concatenate([[0], np.cumsum(lengths)])
        for d in range(len(lengths)):
            yield ids[cuts[d] : cuts[d + 1]], mask[cuts[d] : cuts[d + 1]]
        for suffix in (".len", ".ids", ".mask"):
            os.unlink(base + suffix)  # read: its disk is given back as the cache grows


class Progress:
    """Rows/s, tokens/s and time left on stderr (tqdm), for the one process that builds."""

    def __init__(self, total: int, what: str, show: bool) -> None:
        self.bar = None
        if show:
            from tqdm import tqdm

            tty = sys.stderr.isatty()
            self.bar = tqdm(total=total, desc=what, unit="rows", file=sys.stderr, mininterval=0.5 if tty else 30,
                            dynamic_ncols=True, smoothing=0.1)  # fmt: skip
        self.tokens, self.begun = 0, time.perf_counter()

    def update(self, rows: int, tokens: int) -> None:
        self.tokens += tokens
        if self.bar is not None:
            rate = self.tokens / max(time.perf_counter() - self.begun, 1e-9)
            self.bar.set_postfix_str(f"{rate:,.0f} tokens/s", refresh=False)
            self.bar.update(rows)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def tokenize(
    source: Source, inspected: Inspected, tokenizer: Any, work: str, cache_dir: str, workers: int, show: bool
) -> int:
    """Tokenise the source's rows into chunk files under `work` with `workers` processes; returns the chunk
    count (module docstring)."""
    global _JOB
    rows = None
    if source.kind == "jsonl":
        chunks, total = _jsonl_chunks(source.path, JSONL_CHUNK_BYTES)
    elif source.kind == "text":
        chunks, total = [(0, 1, 1)], 1
    else:
        rows = load_rows(source, cache_dir, workers).with_format(None)
        total = rows.num_rows
        if total == 0:
            raise ValueError(f"--data {source.named}: holds no rows")
        per = max(1, min(ROWS_PER_CHUNK, math.ceil(total / (4 * workers))))
        chunks = [(b, min(total, b + per), 0) for b in range(0, total, per)]
    _JOB = _Job(source, inspected, tokenizer, rows, chunks, work)
    progress = Progress(total, f"tokenising {os.path.basename(source.path.rstrip('/'))}", show)
    try:
        if workers <= 1 or len(chunks) == 1:
            for c in range(len(chunks)):
                _, docs, tokens = _tokenize_chunk(c)
                progress.update(_chunk_rows(source, chunks[c], docs), tokens)
        else:
            os.environ.setdefault(
                "TOKENIZERS_PARALLELISM", "false"
            )  # a forked Rust tokenizer: no thread pool
            pool_size = min(workers, len(chunks))
            with multiprocessing.get_context("fork").Pool(pool_size, initializer=_worker_signals) as pool:
                for c, docs, tokens in pool.imap(_tokenize_chunk, range(len(chunks))):  # in order: the first
                    progress.update(
                        _chunk_rows(source, chunks[c], docs), tokens
                    )  # error is the first bad row
    finally:
        progress.close()
        _JOB = None
    return len(chunks)


def _worker_signals() -> None:
    """A worker ends quietly when the pool ends it (SIGTERM), and leaves Ctrl-C to the process it works for: the
    trainer's stop handlers, inherited at fork, are not its own."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _chunk_rows(source: Source, chunk: tuple[int, int, int], docs: int) -> int:
    return docs if source.kind == "jsonl" else chunk[1] - chunk[0]


# ----------------------------------------------------------------------------- building once
def build_once(final: str, complete: Callable[[], bool], build: Callable[[], None], what: str,
               builder: bool = True) -> None:  # fmt: skip
    """`build()` the cache at `final` unless `complete()`, in one process per file system (module docstring).
    Non-`builder`s never build: they wait until a builder has (the trainer's local rank 0 of each node builds, so
    node-local storage still works)."""
    if complete():
        return
    started, said = time.time(), [False]
    marks = os.path.join(os.path.dirname(final), ".locks", os.path.basename(final))

    def waiting(holder: str) -> None:
        if not said[0]:
            print(f"data: waiting for {holder} to finish building {what}", file=sys.stderr, flush=True)
            said[0] = True

    while True:
        with _flock(marks + ".lock", waiting):
            if complete():
                return
            failed = _failure(marks, started)
            if failed:
                raise ValueError(failed)
            if builder:
                _clear_failure(marks)
                _say_leftovers(final)
                try:
                    build()
                except (OSError, ValueError) as e:
                    atomic_write_text(marks + ".failed", json.dumps({"error": str(e), "time": time.time()}))
                    raise
                return
        time.sleep(0.5)  # not a builder: the builder has not taken the lock yet


def _say_leftovers(final: str) -> None:
    """Under the lock: the staging directories an earlier build of `final` left when it was killed (it held this
    lock, so none is live), said in one line with their size; not removed (this run did not make them)."""
    parent, name = os.path.dirname(final) or ".", os.path.basename(final)
    left = sorted(os.path.join(parent, e) for e in os.listdir(parent)
                  if e.startswith((f".{name}.tmp-", f".{name}.work.tmp-")))  # fmt: skip
    if left:
        size = sum(
            os.path.getsize(os.path.join(d, f)) for p in left for d, _, files in os.walk(p) for f in files
        )
        print(f"data: {len(left)} unfinished build(s) of {name} left by a killed build ({size / 2**20:.1f} MiB; "
              f"not whole, never read): {', '.join(left)}; remove them to free the space", file=sys.stderr)  # fmt: skip


@contextmanager
def _flock(path: str, waiting: Callable[[str], None]) -> Iterator[None]:
    """Hold the kernel flock on `path` (blocking); when another process holds it, `waiting(its record)` first.
    The record (host and pid) is written while held, for that line."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waiting(os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "another process")
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()}".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # drops the flock


def _failure(final: str, since: float) -> str | None:
    """The error of a build of `final` that failed after `since` (while this process waited on it)."""
    try:
        with open(final + ".failed", encoding="utf-8") as f:
            failed = json.load(f)
        return str(failed["error"]) if float(failed["time"]) >= since else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _clear_failure(final: str) -> None:
    try:
        os.unlink(final + ".failed")
    except FileNotFoundError:
        pass


# ----------------------------------------------------------------------------- the two caches
def build_packed_cache(source: Source, inspected: Inspected, tokenizer: Any, directory: str, cache_dir: str,
                       seq_length: int, long_documents: str, key: str, workers: int, show: bool) -> None:  # fmt: skip
    """Packed rows of the source at `directory` (`packing.build_packed`), tokenised by `workers` processes."""
    work = new_temp_dir(directory + ".work")
    try:
        count = tokenize(source, inspected, tokenizer, work, cache_dir, workers, show)
        build_packed(_chunk_documents(work, count), directory, seq_length, tokenizer.pad_id, fingerprint=key,
                     source=f"--data {source.named}", unit="conversations" if inspected.chat else "documents",
                     long_documents=long_documents, description=inspected.line)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)  # created by this build


def build_indexed_cache(source: Source, inspected: Inspected, tokenizer: Any, prefix: str, cache_dir: str,
                        workers: int, show: bool) -> None:  # fmt: skip
    """A megatron indexed dataset `<prefix>.bin/.idx` of the source's documents (one sequence each), written
    aside and renamed into place (.bin first: a prefix counts only with both)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    dtype = np.uint16 if tokenizer.vocab_size < 65500 else np.int32
    work = new_temp_dir(prefix + ".work")
    try:
        count = tokenize(source, inspected, tokenizer, work, cache_dir, workers, show)
        staged = os.path.join(work, "staged")
        builder = IndexedDatasetBuilder(staged + ".bin", dtype=dtype)
        documents = 0
        for ids, _ in _chunk_documents(work, count):
            builder.add_document(ids, [len(ids)])  # numpy is taken as it is
            documents += 1
        if documents == 0:
            raise ValueError(f"--data {source.named} holds no documents")
        builder.finalize(staged + ".idx")
        os.replace(staged + ".bin", prefix + ".bin")
        os.replace(staged + ".idx", prefix + ".idx")
    finally:
        shutil.rmtree(work, ignore_errors=True)  # created by this build
