"""A run described in a file (training/run_file.py): `--config run.toml` is the command line's options by group,
the command line overrides it and says so, bad files are one error naming the file and the key, and the
`run.toml` a run writes replays it (the same resolved TrainConfig)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from glm53_ds.training.args import build_parser
from glm53_ds.training.config import SetupError, TrainConfig
from glm53_ds.training.option_checks import resolve_config
from glm53_ds.training.run_file import parse_with_config, run_file_text, sections
from tests.cli import module_run, python_run


def _config(argv: list[str]) -> TrainConfig:
    args, _ = parse_with_config(build_parser(), argv)
    return resolve_config(args)


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
    # the run file records the world the run ran at, so that the planner plans that very run (its exit code 0:
    # it fits); control: without it the planner cannot (before: "error: --world is required")
    assert "\n[planning]\ngpus = 1\n" in a
    planned = module_run("glm53_ds.plan", "--config", str(tmp_path / "a" / "run.toml"), "--json")
    assert planned.returncode == 0, planned.stderr[-2000:]
    result = json.loads(planned.stdout)
    assert (result["world"], result["model"], result["seq_length"]) == (1, "tiny", 32) and result["memory"][
        "fits"
    ]
    (tmp_path / "no_world.toml").write_text(a.replace("gpus = 1\n", ""))
    refused = module_run("glm53_ds.plan", "--config", str(tmp_path / "no_world.toml"))
    assert refused.returncode == 2 and refused.stderr.strip().endswith("error: --world is required (or --search for "
                                                                      "the smallest layouts that fit)")  # fmt: skip


def test_unreadable_run_files_are_one_error(tmp_path):
    """Before: a non-UTF-8 file or a directory given as --config, or a non-UTF-8 config.json, ended in a
    traceback; two --config flags applied the first while argparse kept the second. Now each is one error."""
    bad = tmp_path / "latin1.toml"
    bad.write_bytes("[optimization]\nlr = 1e-4  # caf\xe9\n".encode("latin-1"))
    cases = [
        (["--config", str(bad)], "not UTF-8 text (byte"),
        (["--config", str(tmp_path)], "is a directory; give a run file"),
        (["--config", str(bad), "--config", str(tmp_path / "b.toml")], "--config given 2 times"),
    ]
    hf = tmp_path / "config.json"
    hf.write_bytes(b'{"model_type": "glm5_next", "name": "\xff"}')
    cases.append((["--model-config", str(hf)], "not UTF-8 text (byte"))
    for argv, message in cases:
        with pytest.raises(SetupError, match=re.escape(message)):
            _config(argv)
    good = tmp_path / "good.toml"
    good.write_text("[optimization]\nlr = 1e-4  # café\n", encoding="utf-8")
    assert _config(["--config", str(good)]).lr == 1e-4  # control: UTF-8 with the same character reads


def test_a_run_file_with_any_character_replays(tmp_path):
    """Before: `--output-dir runs/exp-🚀` was written as a JSON surrogate pair, which TOML (and its own --config)
    refused. Now any character is written as itself, control characters escaped."""
    first = _config(["--output-dir", str(tmp_path / "exp-🚀"), "--trainable", 'a"b\\\\c\x7f'])
    (tmp_path / "run.toml").write_text(run_file_text(first, build_parser()), encoding="utf-8")
    again = _config(["--config", str(tmp_path / "run.toml")])
    assert again.output_dir == first.output_dir and again.trainable == first.trainable


def test_every_value_a_file_sets_can_be_reset_by_a_flag(tmp_path):
    """Before: `--config recipe.toml --train-epochs 1` was refused (the file's train_iters could not be unset), and
    validation could not be turned off (`--valid-split 0 --eval-interval 0` -> "--eval-iters without
    --valid-data"). Now a flag replaces what the file gives for an option it excludes, turning validation off
    drops the file's evaluation settings, and `none` unsets an option whose default is unset; each said in one
    line. Control: the same conflict given on the command line alone is still refused."""
    run = tmp_path / "recipe.toml"
    run.write_text('[optimization]\ntrain_iters = 1000\n[data]\nvalid_split = 0.01\neval_interval = 100\n'
                   'eval_iters = 4\n[checkpoints_output]\nexport_adapter = "out/adapter"\noutput_dir = "out"\n'
                   '[fine_tuning]\nlora_rank = 4\n')  # fmt: skip
    args, lines = parse_with_config(build_parser(), ["--config", str(run), "--train-epochs", "1"])
    assert resolve_config(args).train_epochs == 1.0
    assert f"--train-epochs 1.0 replaces --config {run}'s train_iters 1000" in lines
    args, lines = parse_with_config(build_parser(), ["--config", str(run), "--valid-split", "0"])
    config = resolve_config(args)
    assert (config.valid_split, config.eval_iters, config.eval_interval) == (0.0, 10, 0)
    assert f"validation is off: --config {run}'s eval_interval, eval_iters dropped" in lines
    args, lines = parse_with_config(build_parser(), ["--config", str(run), "--export-adapter", "none"])
    assert resolve_config(args).export_adapter is None
    assert f"--export-adapter None overrides --config {run}'s 'out/adapter'" in lines
    with pytest.raises(SetupError, match="give one"):  # the control
        _config(["--train-epochs", "1", "--train-iters", "5"])
    with pytest.raises(SetupError, match="--eval-iters without --valid-data"):
        _config(["--eval-iters", "4"])
