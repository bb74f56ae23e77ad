"""Packed rows for fine-tuning: documents (or chat conversations) packed into rows of `seq_length` tokens with
their boundaries kept, so that each document is computed as if alone (`cu_seqlens`, layers/documents.py).

Sources:
  - `--pack` with text / jsonl `{"text": ...}` / an indexed dataset: each document (with its end-of-document
    token) is one packed document; every token is a target;
  - chat data, always packed: a `.jsonl` whose lines have `"messages": [{"role": "system"|"user"|"assistant",
    "content": ...}, ...]` (content a string or OpenAI-style parts `[{"type": "text", "text": ...}]`, joined) or
    `"prompt"` + `"completion"`. A conversation is rendered with the tokenizer's chat
    template; only assistant (completion) tokens are targets. The template is applied to growing prefixes of the
    conversation: an assistant turn's tokens are those its message adds after the generation prompt, so the role
    header is context and the turn's text and end-of-turn tokens are targets. The byte tokenizer has a built-in
    template, `<|role|>\\n{content}\\n` per message, the generation prompt `<|assistant|>\\n`, and the
    end-of-document token after the conversation (a target when the conversation ends with an assistant turn).
    An empty assistant turn trains only its end-of-turn tokens.

Packing is greedy in file order: a document that does not fit in the current row's free tail starts a new row; a
document longer than a row is cut into row-sized pieces (each piece is its own document; a piece sees nothing of
the previous one). A row's unused tail is padding: its own document, never a target. Labels are aligned with the
tokens (transformers' convention; -100 = no target): the model's target at position t is the label at t + 1 of
the same document.

The packed rows are built once into a cache directory (`tokens.npy`, `labels.npy` [rows, seq_length] int32, the
document starts of every row, `meta.json`), staged under a temporary name and renamed, read memory-mapped with
`allow_pickle=False`. Rows are visited in a seeded order (`SeededOrder`) by consumed-sample position, so a resumed
run reads exactly what the uninterrupted one would, and a global batch is the same rows at any world size, EP, ETP.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..layers.chunked_ce import IGNORE_INDEX
from ..safe_io import staged_dir

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's speakers as roles
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "tool": "tool", "observation": "tool", "function_response": "tool"}  # fmt: skip


@dataclass
class Batch:
    """One micro-batch as the model takes it. Packed: input_ids / labels [1, rows * seq_length] with cu_seqlens;
    windows: [micro_batch, seq_length] with next_tokens."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    next_tokens: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    real_tokens: int = 0  # tokens that are not row padding

    def to(self, device: torch.device | str) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return Batch(self.input_ids.to(device), self.labels.to(device), move(self.next_tokens),
                     move(self.cu_seqlens), self.real_tokens)  # fmt: skip

    def model_kwargs(self) -> dict[str, Any]:
        return dict(labels=self.labels, next_tokens=self.next_tokens, cu_seqlens=self.cu_seqlens)


class SeededOrder:
    """Samples first .. first + num_samples - 1 in a permutation fixed by the seed, re-shuffled every epoch
    (seed + epoch); `first` > 0 for the part of a corpus a stream is restricted to (`restrict_stream`)."""

    def __init__(self, num_samples: int, seed: int, first: int = 0, restricted: bool = False) -> None:
        self.num_samples, self.seed, self.first, self.restricted = num_samples, seed, first, restricted
        self._epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def __call__(self, index: int) -> int:
        """The sample read at run position `index` (cycling epochs)."""
        epoch, pos = divmod(index, self.num_samples)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._order, self._epoch = torch.randperm(self.num_samples, generator=g).numpy(), epoch
        return self.first + int(self._order[pos])

    @staticmethod
    def positions(consumed: int, micro: int, rank: int, world: int, micro_batch: int) -> range:
        """Run positions of this rank's micro-batch in the global batch after `consumed` samples: micro-step,
        then rank, then row, so a global batch is the same samples at any world size."""
        base = consumed + (micro * world + rank) * micro_batch
        return range(base, base + micro_batch)


def subset_identity(order: SeededOrder) -> dict[str, object]:
    """The part of the corpus a stream reads ([first, stop) of its samples; all of them without --valid-split),
    for its identity: recorded always, so that a resume that drops, adds or changes --valid-split is refused
    (checkpoints written before it was recorded always read the whole corpus when they record no range)."""
    return {"samples": [order.first, order.first + order.num_samples]}


def restrict_stream(stream: Any, start: int, stop: int) -> None:
    """Read only samples [start, stop) of the stream's corpus (in its own seeded order)."""
    stream.order = SeededOrder(stop - start, stream.seed, first=start, restricted=True)
    stream.num_samples = stop - start


def hold_out(train: Any, valid: Any, fraction: float) -> int:
    """`--valid-split`: the last `fraction` of the corpus's samples (at least one) to `valid`, the rest to `train`
    (two streams over the same corpus); returns how many were held out."""
    n = train.num_samples
    held = max(1, round(fraction * n))
    if held >= n:
        raise ValueError(f"--valid-split {fraction:g}: holds out {held} of the {n} samples of --data, leaving none "
                         "to train on")  # fmt: skip
    restrict_stream(train, 0, n - held)
    restrict_stream(valid, n - held, n)
    return held


# ----------------------------------------------------------------------------- chat rendering
def chat_messages(record: Any, where: str) -> list[dict[str, Any]]:
    """The conversation of one jsonl record as messages, checked; `where` is `file:line` for errors. Shapes:
    `messages` (OpenAI style: system / user / assistant / tool, an assistant turn's `tool_calls` kept for the chat
    template), ShareGPT `conversations` of `from` / `value`, Alpaca `instruction` (+ `input`) / `output`, and
    `prompt` / `completion`."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a chat line must be a JSON object")
    if "messages" in record:
        return _checked_messages(record["messages"], where, "messages")
    if "conversations" in record:
        turns = record["conversations"]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: 'conversations' must be a non-empty list")
        messages = []
        for i, turn in enumerate(turns):
            who = turn.get("from") if isinstance(turn, dict) else None
            if who not in SHAREGPT_ROLES:
                raise ValueError(
                    f"{where}: conversations[{i}].from must be one of {sorted(SHAREGPT_ROLES)}, got {who!r}"
                )
            messages.append({"role": SHAREGPT_ROLES[who], "content": turn.get("value")})
        return _checked_messages(messages, where, "conversations", field="value")
    if "instruction" in record and "output" in record:
        for key in ("instruction", "input", "output", "system"):
            if key in record and not isinstance(record[key], str):
                raise ValueError(f"{where}: '{key}' must be a string")
        prompt = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
        system = [{"role": "system", "content": record["system"]}] if record.get("system") else []
        return [
            *system,
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": record["output"]},
        ]
    if "prompt" in record and "completion" in record:
        if not isinstance(record["prompt"], str) or not isinstance(record["completion"], str):
            raise ValueError(f"{where}: 'prompt' and 'completion' must be strings")
        return [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["completion"]},
        ]
    raise ValueError(
        f"{where}: a chat line needs 'messages' (a list of role/content), 'conversations' (ShareGPT from/value), "
        "'instruction' + 'output' (Alpaca) or 'prompt' + 'completion'"
    )


def _checked_messages(messages: Any, where: str, column: str, field: str = "content") -> list[dict[str, Any]]:
    """Messages with a known role and string content (an assistant turn with `tool_calls` may have none); errors
    name the column (`messages[2].content`)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: '{column}' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            got = m.get("role") if isinstance(m, dict) else m
            raise ValueError(f"{where}: {column}[{i}] must be {{'role': one of {ROLES}, 'content': a string}}: its "
                             f"role is {got!r}")  # fmt: skip
        calls = m.get("tool_calls")
        content = m.get("content")
        if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list)):
            raise ValueError(f"{where}: {column}[{i}].tool_calls must be a list, on an assistant turn")
        if content is None and calls:
            content = ""
        if isinstance(
            content, list
        ):  # OpenAI-style content parts: the text parts joined, as GLM's template does
            content = _text_of_parts(content, where, f"{column}[{i}].{field}")
        if not isinstance(content, str):
            raise ValueError(f"{where}: {column}[{i}].{field} must be a string, got {type(content).__name__}")
        message: dict[str, Any] = {"role": m["role"], "content": content}
        for key in ("tool_calls", "name", "tool_call_id"):
            if m.get(key) is not None:
                message[key] = m[key]
        out.append(message)
    return out


def _text_of_parts(parts: list[Any], where: str, column: str) -> str:
    """`[{"type": "text", "text": ...}, ...]` (or plain strings) -> the texts joined without a separator (the
    released chat template's `visible_text`); a part of another type is refused: the model reads text only."""
    texts = []
    for j, part in enumerate(parts):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}: {column}[{j}] must be {{'type': 'text', 'text': a string}} (GLM-5.3 reads "
                             f"text only), got type {kind!r}")  # fmt: skip
        texts.append(part["text"])
    return "".join(texts)


def byte_chat_template(messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False) -> list[int]:
    """The byte tokenizer's built-in chat template (module docstring); an assistant turn's tool calls follow its
    content, each as `<tool_call>{json}</tool_call>` (convert/tokenizer_files.py renders the same)."""
    text = "".join(
        f"<|{m['role']}|>\n{m['content']}"
        + "".join(
            f"<tool_call>{json.dumps(c, ensure_ascii=False)}</tool_call>" for c in m.get("tool_calls") or []
        )
        + "\n"
        for m in messages
    )
    if add_generation_prompt:
        text += "<|assistant|>\n"
    return list(text.encode("utf-8"))


def render_chat(
    tokenizer: Any, messages: Sequence[dict[str, Any]], where: str
) -> tuple[list[int], list[bool]]:
    """Token ids of a conversation and which of them are targets (assistant tokens)."""
    template = getattr(tokenizer, "chat_template_ids", None)
    if template is None:
        raise ValueError(f"{where}: the tokenizer has no chat template")

    def apply(upto: int, add_generation_prompt: bool) -> list[int]:
        try:
            return list(template(messages[:upto], add_generation_prompt=add_generation_prompt))
        except Exception as e:  # the template is the tokenizer's own code (jinja): any failure names the line
            raise ValueError(f"{where}: the tokenizer's chat template failed on messages[{upto - 1}] "
                             f"({type(e).__name__}: {e})") from e  # fmt: skip

    ids: list[int] = []
    trained: list[bool] = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            head = apply(i, add_generation_prompt=True)
            if head[: len(ids)] != ids:
                raise ValueError(f"{where}: the chat template is not prefix-stable at message {i}")
            trained += [False] * (len(head) - len(ids))
            ids = head
        full = apply(i + 1, add_generation_prompt=False)
        if full[: len(ids)] != ids:
            raise ValueError(f"{where}: the chat template is not prefix-stable at message {i}")
        trained += [message["role"] == "assistant"] * (len(full) - len(ids))
        ids = full
    end = getattr(tokenizer, "chat_end_ids", [])
    ids, trained = ids + end, trained + [messages[-1]["role"] == "assistant"] * len(end)
    return ids, trained


# ----------------------------------------------------------------------------- packing
LONG_DOCUMENTS = ("split", "truncate", "drop")  # --long-documents: a document longer than a row


class Packer:
    """Greedy packing (module docstring), one document at a time: each finished row goes to `emit(tokens, labels,
    document starts, real tokens)` at once, so memory holds one row, not the data. A document longer than a row
    is cut into row-sized pieces (`split`), cut to its first row (`truncate`) or left out (`drop`); `counts` say
    how many were."""

    def __init__(self, seq_length: int, pad_id: int, long_documents: str, emit: Any) -> None:
        if long_documents not in LONG_DOCUMENTS:
            raise ValueError(f"--long-documents must be one of {LONG_DOCUMENTS}, got {long_documents!r}")
        self.seq_length, self.pad_id, self.long_documents, self.emit = (
            seq_length,
            pad_id,
            long_documents,
            emit,
        )
        self.counts = dict(documents=0, pieces=0, real_tokens=0, targets=0, no_target_documents=0,
                           long_documents=0, rows=0, max_token_id=-1)  # fmt: skip
        self._tokens = np.empty(seq_length, dtype=np.int32)
        self._labels = np.empty(seq_length, dtype=np.int32)
        self._fill, self._starts = 0, []  # type: ignore[var-annotated]

    def add(self, ids: Sequence[int] | np.ndarray, trained: Sequence[bool] | np.ndarray) -> None:
        ids, trained = np.asarray(ids, dtype=np.int32), np.asarray(trained, dtype=bool)
        counts, seq = self.counts, self.seq_length
        counts["documents"] += 1
        targets_before = counts["targets"]
        if len(ids) > seq:
            counts["long_documents"] += 1
            if self.long_documents == "drop":
                return
            if self.long_documents == "truncate":
                ids, trained = ids[:seq], trained[:seq]
        if len(ids):
            counts["max_token_id"] = max(counts["max_token_id"], int(ids.max()))
        for begin in range(0, len(ids), seq):
            piece, mask = ids[begin : begin + seq], trained[begin : begin + seq]
            if self._fill + len(piece) > seq:
                self._close()
            self._starts.append(self._fill)
            end = self._fill + len(piece)
            self._tokens[self._fill : end] = piece
            self._labels[self._fill : end] = np.where(mask, piece, IGNORE_INDEX)
            self._fill = end
            counts["pieces"] += 1
            counts["real_tokens"] += len(piece)
            counts["targets"] += int(mask[1:].sum())  # a piece's first token is no target
        counts["no_target_documents"] += counts["targets"] == targets_before

    def _close(self) -> None:
        if not self._fill and not self._starts:
            return
        real, starts = self._fill, self._starts
        if real < self.seq_length:  # padding: its own document, no targets
            starts.append(real)
            self._tokens[real:] = self.pad_id
            self._labels[real:] = IGNORE_INDEX
            self.counts["max_token_id"] = max(self.counts["max_token_id"], self.pad_id)
        self.emit(self._tokens, self._labels, starts, real)
        self.counts["rows"] += 1
        self._fill, self._starts = 0, []

    def finish(self) -> dict[str, int]:
        self._close()
        if not self.counts["rows"]:
            raise ValueError(f"no documents to pack ({self.counts['long_documents']} longer than a row of "
                             f"{self.seq_length} tokens, --long-documents {self.long_documents})")  # fmt: skip
        return self.counts


def pack(
    documents: Iterator[tuple[list[int], list[bool]]],
    seq_length: int,
    pad_id: int,
    long_documents: str = "split",
) -> tuple[np.ndarray, np.ndarray, list[list[int]], list[int], dict[str, int]]:
    """`Packer` over `documents`, its rows gathered in memory: (tokens, labels [rows, seq_length] int32, document
    starts per row, real (non-padding) tokens per row, counts); for small data and tests."""
    rows_tokens, rows_labels, starts, real = [], [], [], []

    def keep(tokens: np.ndarray, labels: np.ndarray, row_starts: list[int], row_real: int) -> None:
        rows_tokens.append(tokens.copy())
        rows_labels.append(labels.copy())
        starts.append(list(row_starts))
        real.append(row_real)

    packer = Packer(seq_length, pad_id, long_documents, keep)
    for ids, trained in documents:
        packer.add(ids, trained)
    counts = {k: v for k, v in packer.finish().items() if k not in ("rows", "max_token_id")}
    return np.stack(rows_tokens), np.stack(rows_labels), starts, real, counts


class _NpyAppender:
    """A `.npy` file written row by row, its length unknown until `close` (a fixed-size header rewritten then)."""

    HEADER = 128

    def __init__(self, path: str, dtype: type, row_shape: tuple[int, ...] = ()) -> None:
        self.file, self.dtype, self.row_shape, self.rows = open(path, "wb"), np.dtype(dtype), row_shape, 0
        self.file.write(self._header())

    def _header(self) -> bytes:
        shape = (self.rows, *self.row_shape)
        text = repr(
            {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": shape}
        )
        body = text + " " * (self.HEADER - 10 - len(text) - 1) + "\n"
        return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body.encode("latin1")

    def append(self, values: np.ndarray | Sequence[int]) -> None:
        array = np.asarray(values, dtype=self.dtype)
        self.file.write(array.tobytes())
        self.rows += 1 if self.row_shape else array.size

    def close(self) -> None:
        self.file.seek(0)
        self.file.write(self._header())
        self.file.close()


def build_packed(
    documents: Iterator[tuple[Sequence[int] | np.ndarray, Sequence[bool] | np.ndarray]], directory: str,
    seq_length: int, pad_id: int, fingerprint: str = "", source: str = "the data", unit: str = "documents",
    long_documents: str = "split", description: str = "",
) -> str:  # fmt: skip
    """Pack `documents` into `directory` (staged, then renamed into place), streaming: rows are written as they
    are packed, so memory does not grow with the data. Data with no target token at all is refused (nothing would
    be trained: a loss of 0 while weight decay still moves the weights). `fingerprint`: what the rows were built
    from (the cache key: data and tokenizer contents), recorded for resumes; `description`: the source's shape,
    said again when the cache is opened."""
    with staged_dir(directory) as tmp:
        out = {name: _NpyAppender(os.path.join(tmp, f"{name}.npy"), dtype, shape) for name, dtype, shape in (
            ("tokens", np.int32, (seq_length,)), ("labels", np.int32, (seq_length,)),
            ("doc_starts", np.int32, ()), ("row_offsets", np.int64, ()), ("real_tokens", np.int32, ()))}  # fmt: skip
        offset = [0]
        out["row_offsets"].append([0])

        def emit(tokens: np.ndarray, labels: np.ndarray, starts: list[int], real: int) -> None:
            out["tokens"].append(tokens)
            out["labels"].append(labels)
            out["doc_starts"].append(starts)
            offset[0] += len(starts)
            out["row_offsets"].append([offset[0]])
            out["real_tokens"].append([real])

        packer = Packer(seq_length, pad_id, long_documents, emit)
        try:
            for ids, trained in documents:
                packer.add(ids, trained)
            counts = packer.finish()
        finally:
            for f in out.values():
                f.close()
        if counts["targets"] == 0:
            raise ValueError(f"{source}: none of its {counts['documents']} {unit} has a token to train on (no "
                             "assistant turn, or only empty ones); nothing would be learned")  # fmt: skip
        meta = dict(seq_length=seq_length, fingerprint=fingerprint, source=source, unit=unit,
                    long_policy=long_documents, description=description, **counts)  # fmt: skip
        with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as meta_file:
            json.dump(meta, meta_file)
    return directory


class PackedRowStream:
    """Packed rows in seeded order; a micro-batch of several rows is one row of `micro_batch * seq_length` tokens
    (the model takes packed documents at batch 1)."""

    packed = True  # its rows are packed documents (their real-token share is logged)

    def __init__(self, directory: str, seed: int, vocab_size: int) -> None:
        load = lambda name: np.load(os.path.join(directory, name), mmap_mode="r", allow_pickle=False)  # noqa: E731
        try:
            self.tokens, self.labels = load("tokens.npy"), load("labels.npy")
            self.doc_starts, self.row_offsets = load("doc_starts.npy"), load("row_offsets.npy")
            self.real_tokens = load("real_tokens.npy")
            with open(os.path.join(directory, "meta.json"), encoding="utf-8") as f:
                self.meta = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"the packed data cache {directory} is damaged ({type(e).__name__}: {e}); remove it "
                             "to rebuild") from e  # fmt: skip
        self.notices: list[str] = []
        long, policy = int(self.meta.get("long_documents", 0)), self.meta.get("long_policy", "split")
        if long:
            done = {
                "split": "split into row-sized pieces",
                "truncate": "cut to their first row",
                "drop": "left out",
            }
            self.notices.append(f"{self.meta.get('source', 'the data')}: {long} of {self.meta['documents']} "
                                f"{self.meta.get('unit', 'documents')} are longer than --seq-length "
                                f"{self.meta['seq_length']} and were {done[policy]} (--long-documents {policy}; "
                                f"{self.meta['pieces']} pieces in {self.meta['rows']} rows)")  # fmt: skip
        unused = int(self.meta.get("no_target_documents", 0))
        if unused:
            self.notices.append(f"{self.meta.get('source', 'the data')}: {unused} of {self.meta['documents']} "
                                f"{self.meta.get('unit', 'documents')} have no token to train on (context only)")  # fmt: skip
        self.seq_length = int(self.tokens.shape[1])
        self.num_samples = int(self.tokens.shape[0])
        top = int(self.meta["max_token_id"])  # recorded at build time: no scan of the rows at start-up
        if top >= vocab_size:
            raise ValueError(
                f"--data {directory!r} contains token id {top}, outside the model's vocab_size {vocab_size}"
            )
        self.order = SeededOrder(self.num_samples, seed)
        self.directory, self.seed = directory, seed

    @property
    def identity(self) -> dict[str, object]:
        return {"rows": int(self.tokens.shape[0]), "seq_length": self.seq_length, "seed": self.seed,
                "targets": int(self.meta["targets"]), "fingerprint": self.meta.get("fingerprint", ""),
                **subset_identity(self.order)}  # fmt: skip

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(tokens, labels, document starts, real tokens) of the row read at run position `index`."""
        r = self.order(index)
        starts = np.asarray(self.doc_starts[self.row_offsets[r] : self.row_offsets[r + 1]], dtype=np.int64)
        tokens, labels = (
            np.asarray(self.tokens[r], dtype=np.int64),
            np.asarray(self.labels[r], dtype=np.int64),
        )
        return tokens, labels, starts, int(self.real_tokens[r])

    def micro_batch(self, consumed: int, micro: int, rank: int, world: int, micro_batch: int) -> Batch:
        positions = SeededOrder.positions(consumed, micro, rank, world, micro_batch)
        return packed_batch([self.row(p) for p in positions], self.seq_length)


def packed_batch(rows: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, int]], seq_length: int) -> Batch:
    """Packed rows ((tokens, labels, document starts, real tokens) each) as one micro-batch: one row of
    `len(rows) * seq_length` tokens, every document its own segment (cu_seqlens)."""
    ids, labels, cuts, real = [], [], [], 0
    for n, (t, lab, starts, row_real) in enumerate(rows):
        ids.append(t)
        labels.append(lab)
        cuts.extend((starts + n * seq_length).tolist())
        real += row_real
    cuts.append(len(rows) * seq_length)
    return Batch(
        torch.from_numpy(np.concatenate(ids))[None],
        torch.from_numpy(np.concatenate(labels))[None],
        cu_seqlens=torch.tensor(cuts, dtype=torch.int32),
        real_tokens=real,
    )


def window_batch(windows: Sequence[torch.Tensor] | torch.Tensor) -> Batch:
    """Windows of `seq_length + 1` tokens ([n, seq_length + 1] or n of them) as one micro-batch: each window minus
    its last token as input and labels, that token as `next_tokens`."""
    window = windows if isinstance(windows, torch.Tensor) else torch.stack(list(windows))
    return Batch(
        window[:, :-1], window[:, :-1], next_tokens=window[:, -1:], real_tokens=window[:, :-1].numel()
    )
