"""Training data: megatron indexed datasets, built from text / jsonl, sampled deterministically.

Sources (`--data`):
  - a megatron indexed dataset prefix (`<prefix>.bin` + `<prefix>.idx`, from megatron-core's tools or
    `python -m glm53_ds.training.data --input ... --output-prefix ...`);
  - a `.jsonl` file (one document per line, text under "text") or a plain `.txt` file (one document), tokenized at
    start-up into an indexed dataset next to a cache key.
Tokenizers (`--tokenizer`): `bytes` (UTF-8 bytes, the `tiny` preset's vocabulary) or a directory that
`transformers.AutoTokenizer` loads (the checkpoint's own).

Document boundaries: documents are concatenated into one token stream with an end-of-document token after each;
a training sample is any window of `seq_length + 1` consecutive tokens of that stream, so a sample may span a
boundary, and attention is not reset there (as in megatron's GPT dataset). Samples are non-overlapping windows,
visited in a permutation fixed by the seed (re-shuffled every epoch with seed + epoch); the position in that
order is the number of samples consumed (stored in checkpoints), so a resumed run reads exactly the samples the
uninterrupted run would have, at any world size, EP or ETP.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from ..convert.tokenizer_files import TOKENIZER_FILES
from ..safe_io import atomic_write_text
from .mixture import DataSource, MixedStream
from .packing import (
    Batch,
    PackedRowStream,
    SeededOrder,
    build_packed,
    byte_chat_template,
    chat_messages,
    render_chat,
    subset_identity,
    window_batch,
)

BYTE_EOD, BYTE_PAD = 256, 257
CHAT_KEYS = frozenset({"messages", "conversations", "instruction", "prompt"})


WHOLE_HASH_BYTES = 1 << 30  # files up to this size are hashed whole; larger indexed datasets are sampled


def content_hash(paths: Sequence[str], whole_bytes: int = WHOLE_HASH_BYTES) -> str:
    """A fingerprint of the files' contents (names aside): each file's size and its bytes, read whole up to
    `whole_bytes`; of a larger file 256 blocks of 64 KiB spread evenly over it, the first and last included (an
    indexed dataset of hundreds of GB is not read at every start; a different corpus still differs)."""
    digest = hashlib.blake2b(digest_size=16)
    for path in paths:
        size = os.path.getsize(path)
        digest.update(f"{size}|".encode())
        with open(path, "rb") as f:
            if size <= whole_bytes:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
                continue
            block, count = 1 << 16, 256
            for i in range(count):
                f.seek((size - block) * i // (count - 1))
                digest.update(f.read(block))
    return digest.hexdigest()


class ByteTokenizer:
    vocab_size = 258
    eod_id = BYTE_EOD
    pad_id = BYTE_PAD
    chat_end_ids = [BYTE_EOD]  # after a conversation (training/packing.py)
    fingerprint = "bytes-v1"  # the byte ids and the built-in chat template (bump if either changes)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

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


def _jsonl_records(path: str) -> Iterator[tuple[str, Any]]:
    """(`file:line`, parsed record) for every non-blank line of a .jsonl file; a bad line names file and line."""
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            line = _utf8(raw, f"{path}:{i}")
            if line.strip():
                try:
                    yield f"{path}:{i}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not a JSON line ({e.msg} at column {e.colno})") from e
                except RecursionError as e:
                    raise ValueError(f"{path}:{i}: a JSON line nested too deeply to read") from e


def _utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from e


def _documents(path: str) -> Iterator[str]:
    if path.endswith(".jsonl"):
        for where, doc in _jsonl_records(path):
            if not isinstance(doc, dict) or "text" not in doc:
                raise ValueError(f"{where}: a jsonl document needs a 'text' field")
            yield doc["text"]
    else:
        with open(path, "rb") as f:
            yield _utf8(f.read(), path)


def build_indexed_dataset(input_path: str, output_prefix: str, tokenizer: ByteTokenizer | HFTokenizer) -> str:
    """Tokenize text/jsonl into `<output_prefix>.bin/.idx` (written to temporary names, then renamed)."""
    dtype = np.uint16 if tokenizer.vocab_size < 65500 else np.int32
    tmp = f"{output_prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
    count = 0
    for text in _documents(input_path):
        ids = torch.tensor(tokenizer.encode(text) + [tokenizer.eod_id], dtype=torch.int64)
        builder.add_document(ids, [ids.numel()])  # one sequence per document
        count += 1
    if count == 0:
        raise ValueError(f"--data {input_path!r} holds no documents")
    builder.finalize(tmp + ".idx")
    os.replace(tmp + ".bin", output_prefix + ".bin")
    os.replace(tmp + ".idx", output_prefix + ".idx")
    return output_prefix


def _cache_key(paths: Sequence[str], *options: object) -> str:
    """A cache name for what is built from the files `paths` (their contents: `content_hash`) with `options` (the
    tokenizer's fingerprint, ...): an edit of the data or of the tokenizer in place builds anew."""
    fields = [content_hash(paths), *options]
    return hashlib.sha1("|".join(str(f) for f in fields).encode()).hexdigest()[:16]


def _dataset_files(prefix: str) -> list[str]:
    return [prefix + ".idx", prefix + ".bin"]


def check_data_path(data: str, option: str = "--data", named: str | None = None) -> None:
    """FileNotFoundError naming `option` (and the entry as given, `named`) unless `data` is a file or an indexed
    dataset prefix (.bin + .idx)."""
    if not (os.path.isfile(data) or (os.path.isfile(data + ".bin") and os.path.isfile(data + ".idx"))):
        raise FileNotFoundError(
            f"{option} {named or data!r}: neither a file nor an indexed dataset prefix (.bin/.idx)"
        )


def resolve_dataset(data: str, tokenizer: ByteTokenizer | HFTokenizer, cache_dir: str) -> str:
    """The indexed-dataset prefix for `--data` (tokenizing text/jsonl into `cache_dir` once)."""
    check_data_path(data)
    if os.path.isfile(data + ".bin") and os.path.isfile(data + ".idx"):
        return data
    prefix = os.path.join(cache_dir, f"{os.path.basename(data)}.{_cache_key([data], tokenizer.fingerprint)}")
    if not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
        os.makedirs(cache_dir, exist_ok=True)
        build_indexed_dataset(data, prefix, tokenizer)
    return prefix


def is_chat_jsonl(path: str) -> bool:
    """Whether a .jsonl holds chat data: its first record has one of the chat shapes' keys (`chat_messages`)."""
    if not path.endswith(".jsonl"):
        return False
    for _, record in _jsonl_records(path):
        return isinstance(record, dict) and bool(CHAT_KEYS & set(record))
    return False


def _chat_documents(path: str, tokenizer: Any) -> Iterator[tuple[list[int], list[bool]]]:
    for where, record in _jsonl_records(path):
        yield render_chat(tokenizer, chat_messages(record, where), where)


def _text_documents(prefix: str) -> Iterator[tuple[list[int], list[bool]]]:
    """The documents of an indexed dataset, every token a target."""
    dataset = IndexedDataset(prefix)
    for d in range(len(dataset)):
        ids = [int(t) for t in dataset[d]]
        yield ids, [True] * len(ids)


def open_stream(
    data: str | Sequence[DataSource],
    tokenizer: ByteTokenizer | HFTokenizer,
    cache_dir: str,
    seq_length: int,
    seed: int,
    vocab_size: int,
    pack: bool,
    long_documents: str = "split",
) -> DataStream:
    """The training data for `--data`: packed rows for chat data or `--pack`, else pretraining windows; tokenized
    and packed into `cache_dir` once (the first caller builds, later ones open the cache). Caches are keyed on the
    data's and the tokenizer's contents. `long_documents`: what packing does with a document longer than a row
    (`packing.LONG_DOCUMENTS`). Several sources (`DataSource`s) are mixed by weight (training/mixture.py), every
    one packed when any is chat data or `--pack` is given (a micro-batch is one shape)."""
    if not isinstance(data, str):
        if len(data) > 1:
            packed = pack or any(is_chat_source(s.path) for s in data)
            streams = [open_stream(s.path, tokenizer, cache_dir, seq_length, seed, vocab_size, packed, long_documents)
                       for s in data]  # fmt: skip
            return MixedStream(data, streams)
        data = data[0].path
    chat = is_chat_source(data)
    if not (chat or pack):
        return SampleStream(resolve_dataset(data, tokenizer, cache_dir), seq_length, seed, vocab_size)
    source = data if chat else resolve_dataset(data, tokenizer, cache_dir)
    key = _cache_key(
        [source] if chat else _dataset_files(source),
        tokenizer.fingerprint,
        seq_length,
        "chat" if chat else "pack",
        long_documents,
    )
    directory = os.path.join(cache_dir, f"{os.path.basename(data)}.{key}.packed")
    if not os.path.isfile(os.path.join(directory, "meta.json")):
        os.makedirs(cache_dir, exist_ok=True)
        documents = _chat_documents(data, tokenizer) if chat else _text_documents(source)
        build_packed(documents, directory, seq_length, tokenizer.pad_id, fingerprint=key, source=f"--data {data}",
                     unit="conversations" if chat else "documents", long_documents=long_documents)  # fmt: skip
    return PackedRowStream(directory, seed, vocab_size)


def is_chat_source(data: str) -> bool:
    return os.path.isfile(data) and is_chat_jsonl(data)


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
    parser = argparse.ArgumentParser(description="Tokenize text/jsonl into a megatron indexed dataset.")
    parser.add_argument("--input", required=True)
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--tokenizer", default="bytes")
    args = parser.parse_args()
    prefix = build_indexed_dataset(args.input, args.output_prefix, load_tokenizer(args.tokenizer))
    print(f"wrote {prefix}.bin / {prefix}.idx")


if __name__ == "__main__":
    main()
