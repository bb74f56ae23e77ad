"""A run described in a file (training/run_file.py): `--config run.toml` is the command line's options by group,
the command line overrides it and says so, bad files are one error naming the file and the key, and the
`run.toml` a run writes replays it (the same resolved TrainConfig)."""

from __future__ import annotations

import dataclasses

import pytest

from glm53_ds.training.args import build_parser
from glm53_ds.training.config import SetupError, TrainConfig
from glm53_ds.training.run_file import parse_with_config, run_file_text, sections
from tests.cli import python_run


def _config(argv: list[str]) -> TrainConfig:
    args, _ = parse_with_config(build_parser(), argv)
    return TrainConfig.from_args(args)


def test_a_file_gives_the_options_and_the_command_line_overrides_it(tmp_path):
    run = tmp_path / "run.toml"
    run.write_text(
        "[optimization]\nlr = 2e-4\ntrain_iters = 7\n[data]\nseq_length = 96\n[fine_tuning]\nlora_rank = 8\n"
    )
    args, overrides = parse_with_config(build_parser(), ["--config", str(run), "--lr", "1e-4"])
    assert (args.lr, args.train_iters, args.seq_length, args.lora_rank) == (1e-4, 7, 96, 8)
    assert overrides == [f"--lr 0.0001 overrides --config {run}'s 0.0002"]
    _, none = parse_with_config(
        build_parser(), ["--config", str(run), "--lr", "2e-4"]
    )  # the same value: no line
    assert none == []


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--seq-length", "48", "--lr", "1e-3", "--valid-split", "0.1", "--eval-interval", "5"],
        ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "mla,experts", "--recompute", "full"],
        ["--model-config", "tiny", "--sp", "2", "--ep", "2", "--trainable", "router", "--no-mtp"],
    ],
)
def test_the_written_run_file_replays_the_run(tmp_path, argv):
    first = _config([*argv, "--output-dir", str(tmp_path / "out")])
    (tmp_path / "run.toml").write_text(run_file_text(first, build_parser()))
    again = _config(["--config", str(tmp_path / "run.toml")])
    assert dataclasses.asdict(again) == dataclasses.asdict(first)
    # control: a file that drops an option does not replay (the comparison sees a difference)
    text = run_file_text(first, build_parser()).replace("seq_length", "# seq_length")
    (tmp_path / "partial.toml").write_text(text)
    if first.seq_length != _config([]).seq_length:
        assert _config(["--config", str(tmp_path / "partial.toml")]) != first


def test_every_option_has_a_table():
    """Every flag of the trainer but --help / --config / the launcher's is in exactly one table of the file."""
    parser = build_parser()
    in_tables = [key for actions in sections(parser).values() for key in actions]
    flags = {a.dest for a in parser._actions if a.option_strings} - {
        "help",
        "local_rank",
        "deepspeed",
        "config",
    }
    assert sorted(in_tables) == sorted(flags)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[optimisation]\nlr = 1e-4\n", "unknown table [optimisation] (did you mean [optimization]?)"),
        ("[optimization]\nlearning_rate = 1e-4\n", "[optimization] has no key 'learning_rate'"),
        ("[optimization]\ntrain_iters = 2.5\n", "[optimization] train_iters = 2.5: expected an integer"),
        ('[model]\nrecompute = "some"\n', "[model] recompute = 'some': expected one of"),
        ("[data]\nseq_length = '64'\n", "[data] seq_length = '64': expected an integer"),
        ("lr = 1e-4\n", "lr belongs in a table: [optimization] then lr = ..."),
        ("[data\n", "not TOML"),
    ],
)
def test_a_bad_file_is_one_error_naming_the_file_and_key(tmp_path, text, message):
    run = tmp_path / "run.toml"
    run.write_text(text)
    with pytest.raises(SetupError) as caught:
        _config(["--config", str(run)])
    assert str(caught.value).startswith(f"--config {run}") and message in str(caught.value)


def test_the_trainer_reads_the_file_and_writes_its_run_file(tmp_path):
    """End to end: one error line for a missing file; a run writes run.toml, and --config of it runs the same."""
    missing = python_run("--config", str(tmp_path / "nope.toml"))
    errors = [line for line in missing.stderr.splitlines() if line.startswith("error: ")]
    assert missing.returncode == 2 and errors == [f"error: --config '{tmp_path / 'nope.toml'}': no such file"]
    run = tmp_path / "run.toml"
    run.write_text("[optimization]\ntrain_iters = 1\n[data]\nseq_length = 32\n")
    first = python_run("--config", str(run), "--output-dir", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr[-2000:]
    replay = python_run("--config", str(tmp_path / "a" / "run.toml"), "--output-dir", str(tmp_path / "b"))
    assert replay.returncode == 0, replay.stderr[-2000:]
    assert f"--output-dir '{tmp_path / 'b'}' overrides" in replay.stderr
    a, b = ((tmp_path / d / "run.toml").read_text() for d in "ab")
    assert a.replace(str(tmp_path / "a"), "X") == b.replace(str(tmp_path / "b"), "X")
