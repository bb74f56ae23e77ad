"""Hugging Face datasets in `--data`: every form a user holds gives the token stream of the same rows in .jsonl
(each built with `datasets` here, in a temporary directory); columns detected or mapped; bad input named by
source, split, row and column; the cache the same at any worker count and built once per file system."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")

from glm53_ds.data.columns import ColumnMap, parse_column_map  # noqa: E402
from glm53_ds.data.prepare import _flock, build_once  # noqa: E402
from glm53_ds.data.sources import resolve_source  # noqa: E402
from glm53_ds.training.data import Building, ByteTokenizer, open_stream  # noqa: E402
from glm53_ds.training.mixture import parse_sources  # noqa: E402

datasets.disable_progress_bars()


def _rows(n: int = 24) -> list[dict]:
    """Chat rows with what Arrow unifies across rows: a tool call (its arguments with other keys in each row) on
    some assistant turns only, a `name` on some messages."""
    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": f"question {i}: " + "why " * (i % 5)}]
        if i % 3 == 0:
            args = {"city": f"c{i}"} if i % 2 else {"day": i, "unit": "C"}
            messages.append({"role": "assistant", "content": "",
                             "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": args}}]})  # fmt: skip
            messages.append({"role": "tool", "content": f"sunny {i}", "name": "weather"})
        messages.append({"role": "assistant", "content": f"answer {i} " + "because " * (i % 4)})
        rows.append({"messages": messages})
    return rows


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _packed(data: str, cache, columns: ColumnMap | None = None, workers: int = 1, pack: bool = False):
    stream = open_stream(data, ByteTokenizer(), str(cache), 96, 3, 300, pack=pack, columns=columns or ColumnMap(),
                         building=Building(workers))  # fmt: skip
    return stream


def _same_stream(a, b) -> bool:
    if a.packed != b.packed:
        return False
    if a.packed:
        return all(np.array_equal(getattr(a, n), getattr(b, n)) for n in ("tokens", "labels", "doc_starts", "row_offsets"))  # fmt: skip
    return np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))


def _forms(tmp_path, rows) -> dict[str, str]:
    """Every form, holding `rows` (a DatasetDict's `test` split holds them; its `train` split other rows)."""
    tmp_path.mkdir(exist_ok=True)
    ds = datasets.Dataset.from_list(rows)
    forms = {}
    ds.to_parquet(str(tmp_path / "one.parquet"))
    forms["parquet file"] = str(tmp_path / "one.parquet")
    ds.to_json(str(tmp_path / "train.json"))  # JSON Lines under .json, as Dataset.to_json names it
    forms["json lines file"] = str(tmp_path / "train.json")
    (tmp_path / "array.json").write_text(json.dumps(rows))
    forms["json array file"] = str(tmp_path / "array.json")
    half = len(rows) // 2
    (tmp_path / "shards").mkdir()
    ds.select(range(half)).to_json(str(tmp_path / "shards" / "train-00000-of-00002.jsonl"))
    ds.select(range(half, len(rows))).to_json(str(tmp_path / "shards" / "train-00001-of-00002.jsonl"))
    forms["folder of jsonl shards"] = str(tmp_path / "shards")
    (tmp_path / "pq").mkdir()
    ds.select(range(half)).to_parquet(str(tmp_path / "pq" / "part-0.parquet"))
    ds.select(range(half, len(rows))).to_parquet(str(tmp_path / "pq" / "part-1.parquet"))
    forms["glob of parquet shards"] = str(tmp_path / "pq" / "part-*.parquet")
    ds.save_to_disk(str(tmp_path / "saved"))
    forms["save_to_disk Dataset"] = str(tmp_path / "saved")
    other = datasets.Dataset.from_list(_rows(5)[::-1])
    datasets.DatasetDict(train=other, test=ds).save_to_disk(str(tmp_path / "dict"))
    forms["save_to_disk DatasetDict :test"] = str(tmp_path / "dict") + ":test"
    return forms


def _fake_hub_cache(root, repo: str, parquet: str) -> None:
    """A hub dataset as `hf download --repo-type dataset` leaves it: refs/main, a snapshot of symlinks to blobs."""
    owner, name = repo.split("/")
    base = root / f"datasets--{owner}--{name}"
    sha = "0123456789abcdef0123456789abcdef01234567"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(sha)
    (base / "blobs").mkdir()
    blob = base / "blobs" / "5f1e0c7d"
    blob.write_bytes(open(parquet, "rb").read())
    snapshot = base / "snapshots" / sha / "data"
    snapshot.mkdir(parents=True)
    os.symlink(os.path.relpath(blob, snapshot), snapshot / "train-00000-of-00001.parquet")


def test_every_form_gives_the_jsonl_token_stream(tmp_path, monkeypatch):
    """Each form's packed chat rows (tokens, labels, document starts) equal those of the same rows in .jsonl;
    a fake local hub cache entry is read by its id. Control: the same forms without one row differ."""
    rows = _rows()
    reference = _packed(_jsonl(tmp_path / "rows.jsonl", rows), tmp_path / "c")
    forms = _forms(tmp_path / "all", rows)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    _fake_hub_cache(tmp_path / "hub", "someone/chat-rows", forms["parquet file"])
    forms["hub id (local cache)"] = "someone/chat-rows"
    for form, data in forms.items():
        stream = _packed(data, tmp_path / "c")
        assert _same_stream(stream, reference), form
        assert stream.notices[0].startswith("data: ") and "chat rows, 'messages'" in stream.notices[0], form
    # control: a dropped row is caught (another stream, another fingerprint)
    fewer = _forms(tmp_path / "less", rows[:7] + rows[8:])
    for form, data in fewer.items():
        stream = _packed(data, tmp_path / "c")
        assert not _same_stream(stream, reference), form
        assert stream.identity["fingerprint"] != reference.identity["fingerprint"], form


def test_text_rows_give_the_jsonl_windows_and_packing(tmp_path):
    """`text` rows: windows (pretraining) and --pack from parquet equal those from .jsonl; `.json` is rows."""
    rows = [{"text": f"document {i} " + "words " * (i % 7)} for i in range(40)]
    jsonl = _jsonl(tmp_path / "docs.jsonl", rows)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "docs.parquet"))
    for pack in (False, True):
        a = _packed(jsonl, tmp_path / "c", pack=pack)
        b = _packed(str(tmp_path / "docs.parquet"), tmp_path / "c", pack=pack)
        assert a.packed == pack and _same_stream(a, b)
    assert "text rows, 'text'" in b.notices[0]


def test_workers_build_the_same_cache(tmp_path):
    """1 and 3 tokenising workers write the same bytes (chunks are read back in row order)."""
    rows = _rows(200)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    one = _packed(str(tmp_path / "rows.parquet"), tmp_path / "one", workers=1)
    three = _packed(str(tmp_path / "rows.parquet"), tmp_path / "three", workers=3)
    assert _same_stream(one, three) and one.identity == three.identity
    jsonl = _jsonl(tmp_path / "rows.jsonl", rows)
    assert _same_stream(
        _packed(jsonl, tmp_path / "j1", workers=1), _packed(jsonl, tmp_path / "j3", workers=3)
    )


def test_columns_are_detected_or_mapped(tmp_path):
    """Other column names: refused naming the columns and --data-columns; mapped, the jsonl stream; ShareGPT and
    Alpaca rows detected and said."""
    rows = _rows(6)
    reference = _packed(_jsonl(tmp_path / "rows.jsonl", rows), tmp_path / "c")
    datasets.Dataset.from_list([{"dialog": r["messages"], "id": i} for i, r in enumerate(rows)]).to_parquet(
        str(tmp_path / "d.parquet")
    )
    data = str(tmp_path / "d.parquet")
    with pytest.raises(
        ValueError, match=r"columns \('dialog', 'id'\) hold none of the shapes.*--data-columns"
    ):
        _packed(data, tmp_path / "c")
    for columns in (["messages=dialog"], [f"{data}:messages=dialog"]):
        stream = _packed(data, tmp_path / "c", parse_column_map(columns, [data]))
        assert _same_stream(stream, reference)
        assert "from column 'dialog' as 'messages'" in stream.notices[0]
    with pytest.raises(
        ValueError, match=r"--data-columns 'other.parquet:messages=dialog': 'other.parquet' is not"
    ):
        parse_column_map(["other.parquet:messages=dialog"], [data])
    with pytest.raises(ValueError, match=r"'dialogue' is not a role"):
        parse_column_map(["dialogue=dialog"], [data])
    share = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}] * 3
    datasets.Dataset.from_list(share).to_parquet(str(tmp_path / "s.parquet"))
    assert "ShareGPT 'conversations'" in _packed(str(tmp_path / "s.parquet"), tmp_path / "c").notices[0]
    alpaca = [{"instruction": "add", "input": "1 2", "output": "3"}] * 3
    datasets.Dataset.from_list(alpaca).to_parquet(str(tmp_path / "a.parquet"))
    assert "Alpaca" in _packed(str(tmp_path / "a.parquet"), tmp_path / "c").notices[0]


def test_bad_sources_are_one_line_naming_source_split_row_and_column(tmp_path, monkeypatch):
    ds = datasets.Dataset.from_list
    ds([{"text": 5}] * 3).save_to_disk(str(tmp_path / "ints"))
    with pytest.raises(ValueError, match=r"--data .*ints: column 'text' \(text\) is int64, not text"):
        _packed(str(tmp_path / "ints"), tmp_path / "c")
    empty = ds([{"text": "a"}]).select([])
    datasets.DatasetDict(train=ds([{"text": "a b"}]), validation=empty).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"dd \(split validation\): holds no rows"):
        _packed(str(tmp_path / "dd") + ":validation", tmp_path / "c")
    with pytest.raises(ValueError, match=r"dd:test': no split 'test'; it has 'train', 'validation'"):
        resolve_source(str(tmp_path / "dd") + ":test")
    rows = _rows(5)
    rows[3] = {"messages": None}
    ds(rows).to_parquet(str(tmp_path / "null.parquet"))
    with pytest.raises(ValueError, match=r"null.parquet row 3: column 'messages' is null"):
        _packed(str(tmp_path / "null.parquet"), tmp_path / "c", workers=2)
    rows[3] = {"messages": [{"role": "narrator", "content": "x"}]}
    datasets.DatasetDict(train=ds(rows)).save_to_disk(str(tmp_path / "bad_role"))
    with pytest.raises(
        ValueError, match=r"bad_role split train, row 3: messages\[0\] must be .* role is 'narrator'"
    ):
        _packed(str(tmp_path / "bad_role"), tmp_path / "c")
    (tmp_path / "sheet.xlsx").write_bytes(b"PK\x03\x04")
    with pytest.raises(
        ValueError, match=r"--data '.*sheet.xlsx': not a form --data reads; it takes .*parquet"
    ):
        resolve_source(str(tmp_path / "sheet.xlsx"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_hub"))
    with pytest.raises(FileNotFoundError, match=r"hf download --repo-type dataset nobody/nothing"):
        resolve_source("nobody/nothing")


def test_split_and_weight_in_one_entry(tmp_path):
    datasets.DatasetDict(train=datasets.Dataset.from_list(_rows(4))).save_to_disk(str(tmp_path / "dd"))
    a, b = parse_sources([f"{tmp_path / 'dd'}:train:3", f"{tmp_path / 'dd'}:1"])
    assert (a.path, a.weight, b.path, b.weight) == (
        f"{tmp_path / 'dd'}:train",
        "3",
        str(tmp_path / "dd"),
        "1",
    )
    assert resolve_source(a.path).split == "train" and resolve_source(b.path).split == "train"


def test_the_cache_is_built_once_and_a_failed_build_is_said_to_its_waiters(tmp_path, capsys):
    """A build waits on the lock another process holds, then reads what that one built; a waiter (not a builder)
    raises the builder's error instead of building again. A killed holder's lock is free (kernel flock)."""
    final, built = str(tmp_path / "cache"), []

    def build() -> None:
        os.makedirs(final)
        built.append(1)

    marks = os.path.join(str(tmp_path), ".locks", "cache")
    os.makedirs(os.path.dirname(marks))
    holder = _flock(marks + ".lock", lambda _: None)
    holder.__enter__()
    waiter = threading.Thread(
        target=build_once, args=(final, lambda: os.path.isdir(final), build, "the cache")
    )
    waiter.start()
    waiter.join(1.0)
    assert waiter.is_alive() and "data: waiting for host" in capsys.readouterr().err
    os.makedirs(final)  # what the holder built
    holder.__exit__(None, None, None)
    waiter.join(10)
    assert not waiter.is_alive() and built == []

    failed = str(tmp_path / "bad")

    def fail() -> None:
        raise ValueError("--data x row 3: column 'text' is null")

    errors = []

    def wait() -> None:
        try:
            build_once(failed, lambda: False, fail, "bad", builder=False)
        except ValueError as e:
            errors.append(str(e))

    waiter = threading.Thread(target=wait)
    waiter.start()
    with pytest.raises(ValueError, match="row 3"):
        build_once(failed, lambda: False, fail, "bad")
    waiter.join(10)
    assert errors == ["--data x row 3: column 'text' is null"]
    pid = os.fork()
    if pid == 0:  # a builder killed while holding the lock
        _flock(os.path.join(str(tmp_path), ".locks", "after.lock"), lambda _: None).__enter__()
        os._exit(0)
    os.waitpid(pid, 0)
    build_once(str(tmp_path / "after"), lambda: os.path.isdir(str(tmp_path / "after")),
               lambda: os.makedirs(str(tmp_path / "after")), "after")  # fmt: skip
    assert os.path.isdir(str(tmp_path / "after"))


def test_a_build_killed_midway_leaves_nothing_that_passes_for_a_cache(tmp_path, capsys):
    """SIGKILL inside a real build (the chunk files written, the packed rows half-written): nothing is taken for the
    cache; the next build makes it whole and names what the killed one left."""
    import signal

    from glm53_ds.training import packing

    rows = _rows(40)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    pid = os.fork()
    if pid == 0:

        def killed(*args, **kwargs):  # the packer's first row: the staging directory exists, the cache not
            os.kill(os.getpid(), signal.SIGKILL)

        packing._NpyAppender.append = killed
        _packed(str(tmp_path / "rows.parquet"), tmp_path / "c", workers=2)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status)
    assert not [e for e in os.listdir(tmp_path / "c") if e.endswith(".packed")]  # no cache
    stream = _packed(str(tmp_path / "rows.parquet"), tmp_path / "c")
    assert _same_stream(stream, _packed(_jsonl(tmp_path / "rows.jsonl", rows), tmp_path / "j"))
    assert "unfinished build(s) of rows.parquet" in capsys.readouterr().err


def test_default_workers_are_one_ranks_share_of_the_node(monkeypatch):
    from glm53_ds.data.prepare import default_workers

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "2")  # DeepSpeed's launcher: ranks on this node
    assert default_workers() == max(1, cores // 2)
    monkeypatch.delenv("LOCAL_SIZE")
    assert default_workers() == cores
