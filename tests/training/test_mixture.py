"""`--data a:3 b:1`: several sources mixed by weight (training/mixture.py). The schedule gives each source its
exact share and reads each source's own order without a skip or a repeat, the same at any world size; a mixture
is said at start-up; bad entries are one error naming the entry; the run file replays a mixture; --valid-split
holds out of each source; a resume keeps the mixture and refuses another one."""

from __future__ import annotations

import os
from fractions import Fraction

import pytest
import torch

from glm53_ds.training.data import ByteTokenizer, open_stream
from glm53_ds.training.errors import SetupError
from glm53_ds.training.mixture import MixedStream, block_schedule, parse_sources, split_validation
from tests.cli import ROOT, metrics, one_error, run, train_config

CHAT = os.path.join(ROOT, "data", "tiny_chat.jsonl")
TEXT = os.path.join(ROOT, "data", "tiny_corpus.txt")


def test_entries_are_paths_with_optional_weights():
    a, b, c = parse_sources(["x.jsonl:3", "dir:v2/y.txt:0.5", "z.bin:1e-1"])
    assert (a.path, a.weight, a.share) == ("x.jsonl", "3", Fraction(3))
    assert (b.path, b.share) == ("dir:v2/y.txt", Fraction(1, 2))  # a ':' in the path is the path's
    assert c.share == Fraction(1, 10)  # the weight as written, exactly
    (plain,) = parse_sources(["data:v2/y.txt"])
    assert (plain.path, plain.weight) == ("data:v2/y.txt", None)


@pytest.mark.parametrize(
    "entries, message",
    [
        (["a.txt:0"], "--data 'a.txt:0': the weight after ':' must be a finite number > 0"),
        (["a.txt:-1", "b.txt:1"], "--data 'a.txt:-1': the weight after ':' must be a finite number > 0"),
        (["a.txt:inf"], "--data 'a.txt:inf': the weight after ':' must be a finite number > 0"),
        (["a.txt:1", "./a.txt:2"], "--data './a.txt:2': this source is given twice"),
        (["a.txt:1", "b.txt"], "--data 'b.txt': give every source a weight"),
    ],
)
def test_bad_entries_are_one_error_naming_the_entry(entries, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_sources(entries)


def test_bad_entries_are_refused_before_any_work(tmp_path):
    with pytest.raises(
        SetupError, match=r"--data 'missing.txt:2': neither a file, a folder, an indexed dataset prefix"
    ):
        train_config("--data", TEXT + ":1", "missing.txt:2")
    with pytest.raises(SetupError, match=r"the weight after ':' must be a finite number > 0"):
        train_config("--data", TEXT + ":0", CHAT + ":1")


def test_the_schedule_gives_each_source_its_exact_share_spread_evenly():
    source, index, counts = block_schedule([Fraction(3), Fraction(1)])
    # b's one position in the middle of the block, not at its end
    assert counts == [3, 1] and source.tolist() == [0, 0, 1, 0]
    assert index.tolist() == [0, 1, 0, 2]
    source, _, counts = block_schedule([Fraction(1, 3), Fraction(1, 2), Fraction(1, 6)])
    assert counts == [2, 3, 1] and len(source) == 6
    # shares whose common denominator is past the block limit: rounded to 1/B, every source kept
    source, _, counts = block_schedule(
        [Fraction(1, 7), Fraction(1, 11), Fraction(1, 1_000_003)], max_block=64
    )
    assert sum(counts) == len(source) <= 64 and min(counts) >= 1 and counts[0] > counts[1]


def test_rounded_shares_keep_equal_weights_equal_and_the_block_bounded():
    """Before: `--data a:1e-7 b:1e-7 c:1` gave a and b unequal shares (largest remainders broke their tie by order)
    and a block above MAX_BLOCK (a negative number of remainders to hand out took almost all of them)."""
    from glm53_ds.training.mixture import MAX_BLOCK

    shares = [Fraction("1e-7"), Fraction("1e-7"), Fraction(1)]
    source, _, counts = block_schedule(shares)
    assert counts[0] == counts[1] >= 1 and len(source) == sum(counts) <= MAX_BLOCK
    for shares in (
        [Fraction(1, 3)] * 5 + [Fraction(1, 1_000_003)],
        [Fraction(1, p) for p in (7, 11, 13, 999_983)],
    ):
        _, _, counts = block_schedule(shares, max_block=1000)
        assert sum(counts) <= 1000 and min(counts) >= 1
        equal = [c for s, c in zip(shares, counts, strict=True) if s == shares[0]]
        assert len(set(equal)) == 1


def test_a_file_whose_name_ends_in_a_number_is_a_path(tmp_path):
    """Before: `corpus-2024-01-01T10:30` (a file) was read as the path `corpus-2024-01-01T10` with weight 30 and
    refused as missing. Now the whole entry is the path when it names data and its head does not; a weight follows
    as one more ':W'; where both exist the entry is refused as ambiguous (control: a missing head with a number is
    still a weight)."""
    named = tmp_path / "corpus-2024-01-01T10:30"
    named.write_text("text")
    (plain,) = parse_sources([str(named)])
    assert (plain.path, plain.weight) == (str(named), None)
    a, b = parse_sources([f"{named}:2", f"{TEXT}:1"])
    assert (a.path, a.weight) == (str(named), "2")
    (weighed,) = parse_sources([str(tmp_path / "other:30")])
    assert (weighed.path, weighed.weight) == (str(tmp_path / "other"), "30")  # the control
    (tmp_path / "corpus-2024-01-01T10").write_text("text")
    with pytest.raises(ValueError, match="may be a weight or part of the name"):
        parse_sources([str(named)])


class _Numbered:
    """A stand-in source: the window at its run position p is (source id, p, 0): its input (source id, p)."""

    def __init__(self, ident: int, num_samples: int) -> None:
        self.ident, self.num_samples, self.seq_length, self.notices = ident, num_samples, 2, []
        self.packed = False  # windows

    def sample(self, position: int) -> torch.Tensor:
        return torch.tensor([self.ident, position, 0])

    identity: dict = {}


def _mixture(*weights: str, sizes=(40, 10)) -> MixedStream:
    sources = parse_sources([f"s{k}.txt:{w}" for k, w in enumerate(weights)])
    return MixedStream(sources, [_Numbered(k, n) for k, n in enumerate(sizes)])


def test_each_source_is_read_in_its_own_order_without_a_skip_or_a_repeat():
    mix = _mixture("3", "1")
    read = [mix.locate(p) for p in range(400)]
    for k, share in ((0, 300), (1, 100)):
        positions = [i for source, i in read if source == k]
        assert positions == list(range(share))  # exactly its share, each of its positions once, in order
    assert mix.num_samples == 50 and mix.passes_per_epoch() == [pytest.approx(0.9375), pytest.approx(1.25)]


def test_a_global_batch_is_the_same_samples_at_any_world_size():
    mix = _mixture("3", "2")

    def global_batch(world: int, micro_batch: int, gas: int) -> list[list[int]]:
        rows = [
            mix.micro_batch(20, m, r, world, micro_batch).input_ids for m in range(gas) for r in range(world)
        ]
        return sorted(torch.cat(rows).tolist())

    assert global_batch(world=4, micro_batch=1, gas=2) == global_batch(world=1, micro_batch=2, gas=4)
    assert global_batch(1, 8, 1) != sorted(torch.cat([mix.micro_batch(0, 0, 0, 1, 8).input_ids]).tolist())


def test_chat_and_text_mix_as_packed_rows_and_the_split_holds_out_of_each(tmp_path):
    sources = parse_sources([CHAT + ":3", TEXT + ":1"])
    opened = [open_stream(sources, ByteTokenizer(), str(tmp_path), 64, 5, 300, pack=False) for _ in range(2)]
    train, valid = opened
    assert isinstance(train, MixedStream) and train.packed  # the text source packed too: one shape per batch
    sizes = [s.num_samples for s in train.streams]
    held = split_validation(train, valid, 0.1)
    assert held == sum(max(1, round(0.1 * n)) for n in sizes)
    assert valid.num_samples == held and train.num_samples == sum(sizes) - held
    for t, v in zip(train.streams, valid.streams, strict=True):  # disjoint: each source's last rows held out
        assert t.order.first == 0 and v.order.first == t.num_samples
    # validation reads every held-out row once per pass, whatever the training weights
    rows = [valid.locate(p) for p in range(valid.num_samples)]
    assert sorted(rows) == sorted((k, i) for k, s in enumerate(valid.streams) for i in range(s.num_samples))
    batch = train.micro_batch(0, 0, 0, 1, 4)
    assert batch.cu_seqlens is not None and batch.input_ids.shape == (1, 4 * 64)


def test_text_sources_alone_mix_as_windows(tmp_path):
    other = tmp_path / "other.txt"
    other.write_text("a different corpus, read a quarter of the time. " * 40)
    mix = open_stream(
        parse_sources([TEXT + ":3", f"{other}:1"]), ByteTokenizer(), str(tmp_path), 32, 5, 300, False
    )
    assert isinstance(mix, MixedStream) and not mix.packed
    batch = mix.micro_batch(0, 0, 0, 1, 4)
    assert batch.next_tokens is not None and batch.input_ids.shape == (4, 32)
    from_other = [
        bytes(row.tolist()) in other.read_bytes() for row in mix.micro_batch(0, 0, 0, 1, 4).input_ids
    ]
    assert from_other == [False, False, True, False]  # position 2 of each block of 4 is the weight-1 source


def test_the_run_file_replays_a_mixture(tmp_path):
    from glm53_ds.training.args import build_parser
    from glm53_ds.training.run_file import run_file_text

    config = train_config("--data", CHAT + ":3", TEXT + ":1")
    assert config.data == (CHAT + ":3", TEXT + ":1")
    text = run_file_text(config, build_parser())
    assert f'data = ["{CHAT}:3", "{TEXT}:1"]' in text
    (tmp_path / "run.toml").write_text(text)
    assert train_config("--config", str(tmp_path / "run.toml")).data == config.data
    (tmp_path / "one.toml").write_text(f'[data]\ndata = "{TEXT}"\n')  # one source as a plain string
    assert train_config("--config", str(tmp_path / "one.toml")).data == (TEXT,)
    (tmp_path / "bad.toml").write_text("[data]\ndata = [1, 2]\n")
    with pytest.raises(SetupError, match=r"\[data\] data = \[1, 2\]: expected a string or a non-empty array"):
        train_config("--config", str(tmp_path / "bad.toml"))


@pytest.mark.slow
def test_a_mixture_resumes_as_uninterrupted_and_another_mixture_is_refused(tmp_path):
    # a constant learning rate: the 2-step run and the 4-step run take the same steps
    mixture = ["--data", CHAT + ":3", TEXT + ":1", "--seq-length", "32", "--lr", "1e-3", "--min-lr", "1e-3",
               "--warmup", "0"]  # fmt: skip
    whole = run(*mixture, "--train-iters", "4", "--output-dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "data: a mixture of 2 sources; per epoch: " in whole.stderr and "75% (" in whole.stderr
    ck = tmp_path / "ck"
    first = run(*mixture, "--train-iters", "2", "--save", str(ck),
                "--output-dir", str(tmp_path / "first"))  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    second = run(*mixture, "--train-iters", "4", "--load", str(ck), "--output-dir", str(tmp_path / "second"))
    assert second.returncode == 0, second.stderr[-3000:]
    losses = {r["step"]: r["lm_loss"] for r in metrics(tmp_path / "whole") if "lm_loss" in r}
    resumed = {r["step"]: r["lm_loss"] for r in metrics(tmp_path / "second") if "lm_loss" in r}
    assert list(resumed) == [3, 4] and all(resumed[s] == pytest.approx(losses[s], rel=1e-6) for s in resumed)
    other_weights = one_error(run("--data", CHAT + ":1", TEXT + ":1", "--seq-length", "32", "--train-iters", "4",
                                  "--load", str(ck), "--output-dir", str(tmp_path / "x")))  # fmt: skip
    assert "--data source 1" in other_weights and "weight 1/2 here, 3/4 in the checkpoint" in other_weights
    one_source = one_error(run("--data", CHAT, "--seq-length", "32", "--train-iters", "4", "--load", str(ck),
                               "--output-dir", str(tmp_path / "y")))  # fmt: skip
    assert "this run reads 1 --data source(s), the checkpoint trained on 2" in one_source
