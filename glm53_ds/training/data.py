"""Training data: the streams a run reads, over the caches glm53_ds/data builds, sampled deterministically.

Sources (`--data`, every form in glm53_ds/data/sources.py): a megatron indexed dataset prefix is read as it is;
rows (`.jsonl`, `.json`, parquet, Arrow, shard folders, save_to_disk folders, the local hub cache) and text files
are tokenised into a cache (glm53_ds/data/prepare.py) keyed by content, tokenizer and columns. Tokenizers
(`--tokenizer`): `bytes` (UTF-8 bytes, the `tiny` preset's vocabulary) or a directory that
`transformers.AutoTokenizer` loads (the checkpoint's own).

Document boundaries: documents are concatenated into one token stream with an end-of-document token after each;
a training sample is any window of `seq_length + 1` consecutive tokens of that stream, so a sample may span a
boundary, and attention is not reset there (as in megatron's GPT dataset). Chat rows, and any data under `--pack`,
are packed rows instead (training/packing.py). Samples are visited in a permutation fixed by the seed
(re-shuffled every epoch with seed + epoch); the position in that order is the number of samples consumed (stored
in checkpoints), so a resumed run reads exactly the samples the uninterrupted run would have, at any world size,
EP or ETP.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from ..convert.tokenizer_files import TOKENIZER_FILES
from ..data.columns import ColumnMap
from ..data.prepare import build_indexed_cache, build_once, build_packed_cache, inspect_source
from ..data.sources import Source, content_hash, fingerprint, resolve_source
from ..safe_io import atomic_write_text
from .mixture import DataSource, MixedStream
from .packing import (
    Batch,
    PackedRowStream,
    SeededOrder,
    build_packed,
    byte_chat_template,
    subset_identity,
    window_batch,
)

BYTE_EOD, BYTE_PAD = 256, 257


class ByteTokenizer:
    vocab_size = 258
    eod_id = BYTE_EOD
    pad_id = BYTE_PAD
    chat_end_ids = [BYTE_EOD]  # after a conversation (training/packing.py)
    fingerprint = "bytes-v1"  # the byte ids and the built-in chat template (bump if either changes)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """The bytes among `ids` as text (the end-of-document and padding ids are not bytes)."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def chat_template_ids(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False
    ) -> list[int]:
        return byte_chat_template(messages, add_generation_prompt)


class HFTokenizer:
    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"--tokenizer {path!r}: no such directory (expected a tokenizer or checkpoint dir)"
            )
        files = [os.path.join(path, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(path, n))]
        if not any(os.path.basename(f).startswith(("tokenizer.", "vocab.")) for f in files):
            raise FileNotFoundError(f"--tokenizer {path!r}: no tokenizer there (no tokenizer.json / tokenizer.model / "
                                    "vocab file); give --tokenizer DIR (a tokenizer directory) or --tokenizer bytes")  # fmt: skip
        try:
            self.tok = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, ImportError) as e:
            raise ValueError(
                f"--tokenizer {path!r}: transformers cannot load it ({str(e).splitlines()[0]})"
            ) from e
        files += sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".tiktoken"))
        self.fingerprint = "hf-" + content_hash(files)  # its contents, not its path: an edit in place counts
        self.vocab_size = len(self.tok)
        eod = self.tok.eos_token_id
        if eod is None:
            raise ValueError(f"--tokenizer {path!r} defines no eos token to separate documents")
        self.eod_id = int(eod)
        pad = self.tok.pad_token_id
        self.pad_id = int(pad) if isinstance(pad, int) else self.eod_id

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text, in one call (a fast tokenizer's batch path)."""
        if not texts:
            return []
        return [list(ids) for ids in self.tok(list(texts), add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=True))

    @property
    def chat_template_ids(self) -> Any:
        """The tokenizer's own chat template (`apply_chat_template`), or None when it has none."""
        if not getattr(self.tok, "chat_template", None):
            return None

        def render(messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False) -> list[int]:
            out = self.tok.apply_chat_template(
                list(messages), tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
            )
            return [int(i) for i in out]  # type: ignore[arg-type]

        return render

    chat_end_ids: list[int] = []  # a chat template ends its turns itself


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    return ByteTokenizer() if spec == "bytes" else HFTokenizer(spec)


def _cache_key(paths_or_fingerprint: Sequence[str] | str, *options: object) -> str:
    """A cache name for what is built from the data (its content fingerprint, or the files' `content_hash`) with
    `options` (the tokenizer's fingerprint, ...): an edit of the data or of the tokenizer in place builds anew."""
    data = (
        paths_or_fingerprint if isinstance(paths_or_fingerprint, str) else content_hash(paths_or_fingerprint)
    )
    return hashlib.sha1("|".join(str(f) for f in [data, *options]).encode()).hexdigest()[:16]


def _dataset_files(prefix: str) -> list[str]:
    return [prefix + ".idx", prefix + ".bin"]


def _complete_prefix(prefix: str) -> bool:
    return os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")


def _complete_packed(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "meta.json"))


@dataclass(frozen=True)
class Building:
    """How this process takes part in building caches: `workers` tokenising processes; `builder`: whether it
    builds (else it waits for one that does); `progress`: whether it shows the progress bar."""

    workers: int = 1
    builder: bool = True
    progress: bool = False


NO_COLUMNS, ONE_BUILDER = ColumnMap(), Building()  # no --data-columns; this process builds, one worker


def _cache_name(source: Source) -> str:
    """A readable name for the source's caches: the file's or folder's name (the hub id for a hub dataset)."""
    name = source.entry.removesuffix(f":{source.split}") if source.split else source.entry
    name = name.replace("/", "--") if source.hub else os.path.basename(name.rstrip("/")) or "data"
    return re.sub(r"[^\w.+-]", "_", name)[:80] + (f".{source.split}" if source.split else "")


class OpenedSource:
    """One `--data` entry resolved and inspected (its shape said in `inspected.line`), its fingerprint taken."""

    def __init__(self, path: str, columns: ColumnMap, cache_dir: str, option: str = "--data") -> None:
        self.source = resolve_source(path, option)
        self.inspected = inspect_source(self.source, columns, cache_dir)
        self.fingerprint = fingerprint(self.source)
        mapped = ",".join(f"{role}={column}" for role, column in sorted(self.inspected.mapping.items()))
        # none for a .jsonl read under its own names: the keys of earlier runs' caches
        self.extras = [x for x in (self.source.split and f"split={self.source.split}", mapped and f"columns={mapped}") if x]  # fmt: skip

    @property
    def chat(self) -> bool:
        return self.inspected.chat


def _indexed_prefix(opened: OpenedSource, tokenizer: Any, cache_dir: str, building: Building) -> str:
    """The indexed dataset of a source's documents: the prefix itself, or a cache built once."""
    source = opened.source
    if source.kind == "indexed":
        return source.path
    key = _cache_key(opened.fingerprint, tokenizer.fingerprint, *opened.extras)
    prefix = os.path.join(cache_dir, f"{_cache_name(source)}.{key}")
    build_once(prefix, lambda: _complete_prefix(prefix),
               lambda: build_indexed_cache(source, opened.inspected, tokenizer, prefix, cache_dir, building.workers,
                                           building.progress),
               f"the token cache of --data {source.named}", building.builder)  # fmt: skip
    return prefix


def _open_one(
    opened: OpenedSource, tokenizer: Any, cache_dir: str, seq_length: int, seed: int, vocab_size: int, pack: bool,
    long_documents: str, building: Building,
) -> DataStream:  # fmt: skip
    source, chat = opened.source, opened.chat
    os.makedirs(cache_dir, exist_ok=True)
    if not (chat or pack):
        stream: DataStream = SampleStream(_indexed_prefix(opened, tokenizer, cache_dir, building), seq_length, seed,
                                          vocab_size)  # fmt: skip
    else:
        if chat:
            key = _cache_key(opened.fingerprint, tokenizer.fingerprint, seq_length, "chat", long_documents,
                             *opened.extras)  # fmt: skip
        else:  # --pack: packed from the documents' indexed dataset (built first)
            prefix = _indexed_prefix(opened, tokenizer, cache_dir, building)
            key = _cache_key(
                _dataset_files(prefix), tokenizer.fingerprint, seq_length, "pack", long_documents
            )
        directory = os.path.join(cache_dir, f"{_cache_name(source)}.{key}.packed")

        def build() -> None:
            if chat:
                build_packed_cache(source, opened.inspected, tokenizer, directory, cache_dir, seq_length,
                                   long_documents, key, building.workers, building.progress)  # fmt: skip
            else:
                build_packed(_text_documents(prefix), directory, seq_length, tokenizer.pad_id, fingerprint=key,
                             source=f"--data {source.named}", unit="documents", long_documents=long_documents)  # fmt: skip

        build_once(directory, lambda: _complete_packed(directory), build,
                   f"the packed rows of --data {source.named}", building.builder)  # fmt: skip
        stream = PackedRowStream(directory, seed, vocab_size)
    if source.kind not in ("indexed", "text"):
        stream.notices.insert(0, opened.inspected.line)
    return stream


def _text_documents(prefix: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The documents of an indexed dataset, every token a target."""
    dataset = IndexedDataset(prefix)
    for d in range(len(dataset)):
        ids = np.asarray(dataset[d], dtype=np.int32)
        yield ids, np.ones(len(ids), dtype=bool)


def open_stream(
    data: str | Sequence[DataSource],
    tokenizer: ByteTokenizer | HFTokenizer,
    cache_dir: str,
    seq_length: int,
    seed: int,
    vocab_size: int,
    pack: bool,
    long_documents: str = "split",
    columns: ColumnMap = NO_COLUMNS,
    building: Building = ONE_BUILDER,
    option: str = "--data",
) -> DataStream:
    """The training data for `--data`: packed rows for chat data or `--pack`, else pretraining windows; tokenized
    and packed into `cache_dir` once per file system (`building`: who builds, with how many workers). Caches are
    keyed on the data's and the tokenizer's contents and the columns. `long_documents`: what packing does with a
    document longer than a row (`packing.LONG_DOCUMENTS`). Several sources (`DataSource`s) are mixed by weight
    (training/mixture.py), every one packed when any is chat data or `--pack` is given (a micro-batch is one
    shape)."""
    entries = [data] if isinstance(data, str) else [s.path for s in data]
    opened = [OpenedSource(path, columns, cache_dir, option) for path in entries]
    packed = pack or any(o.chat for o in opened)
    streams = [_open_one(o, tokenizer, cache_dir, seq_length, seed, vocab_size, packed, long_documents, building)
               for o in opened]  # fmt: skip
    if isinstance(data, str) or len(data) == 1:
        return streams[0]
    return MixedStream(data, streams)


def is_chat_source(data: str, columns: ColumnMap = NO_COLUMNS, cache_dir: str = "") -> bool:
    """Whether `data` holds chat rows (its first row's shape)."""
    return OpenedSource(data, columns, cache_dir).chat


class SampleStream:
    """Non-overlapping windows of `seq_length + 1` tokens over the concatenated documents, in seeded order.

    The indexed dataset's `.bin` is the documents' tokens back to back, so the stream is that file mapped
    read-only: no copy, and a rank's memory does not grow with the corpus. Token ids are checked against the
    vocabulary once per dataset file (chunked reads, the result cached beside it) and again per sample."""

    packed = False  # windows over the document stream, not packed rows

    def __init__(self, prefix: str, seq_length: int, seed: int, vocab_size: int) -> None:
        try:
            index = IndexedDataset(prefix).index
        except (OSError, ValueError, AssertionError) as e:  # megatron asserts on a damaged .idx
            raise ValueError(f"--data {prefix!r}: the indexed dataset cannot be read ({type(e).__name__}: {e}); if it "
                             "is a cache under data_cache/, remove it to rebuild") from e  # fmt: skip
        self.fingerprint = content_hash(_dataset_files(prefix))
        self.notices: list[str] = []
        self.dtype = np.dtype(index.dtype)
        self.tokens = np.memmap(prefix + ".bin", dtype=self.dtype, mode="r")
        self.seq_length, self.seed, self.vocab_size, self.prefix = seq_length, seed, vocab_size, prefix
        self.num_samples = (len(self.tokens) - 1) // seq_length
        if self.num_samples < 1:
            raise ValueError(
                f"--data {prefix!r} has {len(self.tokens)} tokens, fewer than one sample of --seq-length {seq_length} + 1"
            )
        top = max_token_id(prefix + ".bin", self.dtype)
        if top >= vocab_size:
            raise ValueError(
                f"--data {prefix!r} contains token id {top}, outside the model's vocab_size {vocab_size}"
            )
        self.order = SeededOrder(self.num_samples, seed)

    @property
    def identity(self) -> dict[str, object]:
        """What fixes the sample order (a resume with other values would re-read or skip samples): the corpus
        (its size and content fingerprint), the sample length and the seed."""
        return {"tokens": int(len(self.tokens)), "seq_length": self.seq_length, "seed": self.seed,
                "fingerprint": self.fingerprint, **subset_identity(self.order)}  # fmt: skip

    def sample(self, index: int) -> torch.Tensor:
        """The `index`-th sample of the run ([seq_length + 1] int64), cycling epochs."""
        start = self.order(index) * self.seq_length
        return torch.from_numpy(np.array(self.tokens[start : start + self.seq_length + 1], dtype=np.int64))

    def batch(self, consumed: int, micro: int, rank: int, world: int, micro_batch: int) -> torch.Tensor:
        """This rank's micro-batch [micro_batch, seq_length + 1] of the global batch that starts after `consumed`
        samples (`SeededOrder.positions`: the same samples at any world size)."""
        positions = SeededOrder.positions(consumed, micro, rank, world, micro_batch)
        return torch.stack([self.sample(i) for i in positions])

    def micro_batch(self, consumed: int, micro: int, rank: int, world: int, micro_batch: int) -> Batch:
        """The same as a model batch (`window_batch`)."""
        return window_batch(self.batch(consumed, micro, rank, world, micro_batch))


DataStream = SampleStream | PackedRowStream | MixedStream  # what a run reads its batches from


def max_token_id(bin_path: str, dtype: np.dtype, chunk_tokens: int = 1 << 24) -> int:
    """The largest token id in a `.bin` file, read in chunks (no mapping kept), cached beside it by size/mtime."""
    stat = os.stat(bin_path)
    key = f"{stat.st_size}:{stat.st_mtime_ns}:{dtype.str}"
    cache = bin_path + ".max_token_id.json"
    try:
        with open(cache, encoding="utf-8") as f:
            cached = json.load(f)
        if cached.get("key") == key:
            return int(cached["max"])
    except (OSError, ValueError):
        pass
    top = -1
    with open(bin_path, "rb") as f:
        while True:
            chunk = np.fromfile(f, dtype=dtype, count=chunk_tokens)
            if chunk.size == 0:
                break
            top = max(top, int(chunk.max()))
    try:
        atomic_write_text(cache, json.dumps({"key": key, "max": top}))
    except OSError:
        pass  # a read-only dataset directory: scan again next time
    return top


def main() -> None:
    parser = argparse.ArgumentParser(description="Tokenize text / rows into a megatron indexed dataset (the "
                                     "documents of --input, one sequence each).")  # fmt: skip
    parser.add_argument("--input", required=True)
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--tokenizer", default="bytes")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    opened = OpenedSource(
        args.input, ColumnMap(), os.path.dirname(os.path.abspath(args.output_prefix)), "--input"
    )
    build_indexed_cache(opened.source, opened.inspected, tokenizer, args.output_prefix,
                        os.path.dirname(os.path.abspath(args.output_prefix)), args.workers, show=True)  # fmt: skip
    print(f"wrote {args.output_prefix}.bin / {args.output_prefix}.idx")


if __name__ == "__main__":
    main()
