"""Training data (training/data.py): a memory-mapped corpus, the same global batch at any world size, caches and
resume identity that follow content, errors that name the file, the long-conversation policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.cli import HANG_TIMEOUT, QUICK, ROOT


def _indexed(prefix: str, tokens: int, vocab: int = 250) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    per_doc = min(tokens, 1 << 20)
    for start in range(0, tokens, per_doc):
        ids = torch.from_numpy(rng.integers(1, vocab, min(per_doc, tokens - start), dtype=np.int64))
        builder.add_document(ids, [ids.numel()])
    builder.finalize(prefix + ".idx")
    return prefix


def _peak_rss_mb(*args: str) -> float:
    code = ("import resource, sys; sys.path.insert(0, 'launch'); from glm53_ds.training.main import main; "
            f"rc = main({list(args)!r}); assert rc == 0, rc; "
            "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=HANG_TIMEOUT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return float(proc.stdout.split("PEAK")[-1])


@pytest.mark.slow
def test_rank_memory_does_not_grow_with_the_corpus(tmp_path):
    """Before: SampleStream concatenated every document into one int64 array (+574 MB RSS for 50M tokens)."""
    small = _indexed(str(tmp_path / "small"), 20_000)
    large = _indexed(str(tmp_path / "large"), 50_000_000)
    common = [*QUICK, "--output-dir", str(tmp_path / "out")]
    peak_small = _peak_rss_mb(*common, "--data", small)
    peak_large = _peak_rss_mb(*common, "--data", large)
    assert peak_large - peak_small < 100, (peak_small, peak_large)


def test_a_global_batch_is_the_same_samples_at_any_world_size(tmp_path):
    from glm53_ds.training.data import SampleStream

    stream = SampleStream(_indexed(str(tmp_path / "d"), 5_000), 16, 7, 258)

    def global_batch(consumed: int, world: int, micro_batch: int, gas: int) -> list[list[int]]:
        rows = [stream.batch(consumed, m, r, world, micro_batch) for m in range(gas) for r in range(world)]
        return sorted(torch.cat(rows).tolist())

    assert global_batch(12, world=2, micro_batch=2, gas=1) == global_batch(12, world=1, micro_batch=2, gas=2)
    assert global_batch(12, 1, 4, 1) != global_batch(8, 1, 4, 1)


def test_caches_follow_the_tokenizer_and_data_contents(tmp_path):
    """Before: the cache key was the tokenizer's path and the data's size + mtime: after the chat template was edited
    in place (or the data edited keeping size and mtime) the old rows were reused. Now both are content-keyed."""
    from glm53_ds.training.data import HFTokenizer, open_stream
    from tests.training.test_packing import _word_tokenizer

    _word_tokenizer(tmp_path / "tok")
    data = tmp_path / "chat.jsonl"
    line = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
    data.write_text(json.dumps(line) + "\n")
    cache = tmp_path / "cache"

    def rows() -> tuple[list[str], list[int]]:
        stream = open_stream(
            str(data), HFTokenizer(str(tmp_path / "tok")), str(cache), 32, 1, 300, pack=False
        )
        return sorted(os.listdir(cache)), stream.tokens[0].tolist()

    names, before = rows()
    template = tmp_path / "tok" / "chat_template.jinja"  # where transformers saves the chat template
    template.write_text(template.read_text().replace("[end]", "[end] [end]"))
    names2, after = rows()
    assert len(names2) == len(names) + 1 and after != before  # rebuilt
    stat = os.stat(data)
    data.write_text(json.dumps(line).replace("hello there", "there hello") + "\n")  # same size
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the same mtime
    names3, edited = rows()
    assert len(names3) == len(names2) + 1 and edited != after


def test_chat_data_without_targets_is_refused_and_counted(tmp_path):
    """Before: conversations with no assistant turn trained three steps of loss 0 (rc 0) while weight decay still
    moved the checkpoint. Now data with no target at all is refused, naming the file; a part without is reported."""
    from glm53_ds.training.data import ByteTokenizer, open_stream

    user_only = {"messages": [{"role": "user", "content": "hi"}]}
    data = tmp_path / "chat.jsonl"
    data.write_text((json.dumps(user_only) + "\n") * 3)
    with pytest.raises(
        ValueError, match=rf"--data {data}: none of its 3 conversations has a token to train on"
    ):
        open_stream(str(data), ByteTokenizer(), str(tmp_path / "c"), 64, 1, 300, pack=False)
    data.write_text(json.dumps(user_only) + "\n" + json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    stream = open_stream(str(data), ByteTokenizer(), str(tmp_path / "c"), 64, 1, 300, pack=False)
    assert stream.notices == [f"data: {data}: a .jsonl file; chat rows, 'messages' (role/content turns)",
                              f"--data {data}: 1 of 2 conversations have no token to train on (context only)"]  # fmt: skip


def test_data_errors_name_the_file(tmp_path):
    """Before: non-UTF-8 data and a damaged cache raised messages naming no file."""
    from glm53_ds.training.data import ByteTokenizer, open_stream

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n{"text": "\xff"}\n')
    with pytest.raises(ValueError, match=rf"{bad}:2: not UTF-8 text \(byte 0xff"):
        open_stream(str(bad), ByteTokenizer(), str(tmp_path / "c"), 8, 1, 300, pack=False)
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    open_stream(str(chat), ByteTokenizer(), str(tmp_path / "c"), 64, 1, 300, pack=False)
    packed = next(p for p in (tmp_path / "c").iterdir() if p.name.endswith(".packed"))
    (packed / "labels.npy").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=rf"the packed data cache {packed} is damaged"):
        open_stream(str(chat), ByteTokenizer(), str(tmp_path / "c"), 64, 1, 300, pack=False)


def test_another_corpus_of_the_same_size_has_another_identity(tmp_path):
    """Before: the data identity was (tokens, seq_length, seed): a corpus of the same size resumed."""
    from glm53_ds.training.data import ByteTokenizer, open_stream

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("the quick brown fox jumps over the lazy dog " * 20)
    b.write_text("the lazy dog jumps over the quick brown fox " * 20)
    ia = open_stream(str(a), ByteTokenizer(), str(tmp_path / "c"), 16, 1, 300, pack=False).identity
    ib = open_stream(str(b), ByteTokenizer(), str(tmp_path / "c"), 16, 1, 300, pack=False).identity
    assert {k: v for k, v in ia.items() if k != "fingerprint"} == {
        k: v for k, v in ib.items() if k != "fingerprint"
    }
    assert ia["fingerprint"] != ib["fingerprint"]


@pytest.mark.parametrize("policy, rows, said", [("split", 5, "split into row-sized pieces"),
                                                ("truncate", 3, "cut to their first row"), ("drop", 1, "left out")])  # fmt: skip
def test_long_conversations_follow_the_policy_and_are_reported(tmp_path, policy, rows, said):
    """Before: 24 conversations were cut into 54 pieces at the default --seq-length without a word."""
    from glm53_ds.training.data import ByteTokenizer, open_stream

    data = tmp_path / "chat.jsonl"
    lines = [{"prompt": "q", "completion": "a"}] + [{"prompt": "q" * 10, "completion": "a" * 90}] * 2
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    stream = open_stream(str(data), ByteTokenizer(), str(tmp_path / "c"), 64, 1, 300, False, policy)
    assert stream.num_samples == rows
    assert any(
        f"2 of 3 conversations are longer than --seq-length 64 and were {said}" in n for n in stream.notices
    )
