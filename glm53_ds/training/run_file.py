"""A run described in a file: `--config run.toml`, read by the trainer and by the planner alike.

TOML (the standard library's `tomllib`), one table per group of the command line (`deepspeed launch/train.py
--help`), its keys the options' names with underscores:

    [model]
    hf_dir = "/ckpt/GLM-5.3-Flash"
    recompute = "full"
    [fine_tuning]
    lora_rank = 16
    [parallelism]
    ep = 8
    [data]
    seq_length = 8192
    [optimization]
    lr = 1e-4
    [planning]
    gpus = 8                     # what the planner checks it against (and the trainer compares with its world)

The file's values go in front of the command line's, so a flag given beside `--config` overrides the file, and the
run says so in one line per option. Unknown tables or keys, values of the wrong type or outside an option's choices
are refused naming the file and the key. Every run writes its resolved options as `<output dir>/run.toml`
(`write_run_file`): `--config` of that file replays the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import tomllib
from typing import Any

from ..safe_io import atomic_write_text
from .config import SetupError, TrainConfig
from .options import tables


def sections(parser: argparse.ArgumentParser) -> dict[str, dict[str, argparse.Action]]:
    """The file's tables: `TrainConfig`'s sections (training/options.py), each option by its name with the
    parser's action for it (its type and choices)."""
    actions = {a.dest: a for a in parser._actions}  # argparse keeps the actions here and nowhere public
    return {table: {name: actions[name] for name in names} for table, names in tables(TrainConfig).items()}


def _flag(action: argparse.Action) -> str:
    return next(s for s in action.option_strings if s.startswith("--"))


def _as_argv(path: str, key: str, value: Any, action: argparse.Action) -> list[str]:
    """One file entry as command-line arguments; a SetupError naming the file and key for a wrong value."""
    where = f"--config {path}: {key}"
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise SetupError(f"{where} = {value!r}: expected true or false")
        return [_flag(action)] if value else []
    if action.nargs == "+" and isinstance(value, list):  # an option of several values: a TOML array of them
        if not value or not all(isinstance(v, str) for v in value):
            raise SetupError(f"{where} = {value!r}: expected a string or a non-empty array of strings")
        return [_flag(action), *value]
    if isinstance(value, bool) or isinstance(value, dict | list):
        raise SetupError(f"{where} = {value!r}: expected a {getattr(action.type, '__name__', 'str')}")
    if action.type is int and not isinstance(value, int):
        raise SetupError(f"{where} = {value!r}: expected an integer")
    if action.type is float and not isinstance(value, int | float):
        raise SetupError(f"{where} = {value!r}: expected a number")
    if action.type in (None, str) and not isinstance(value, str):
        raise SetupError(f"{where} = {value!r}: expected a string")
    if action.choices is not None and value not in action.choices:
        raise SetupError(f"{where} = {value!r}: expected one of {list(action.choices)}")
    return [_flag(action), str(value)]


def read_config(path: str, parser: argparse.ArgumentParser) -> tuple[list[str], set[str]]:
    """(the file as command-line arguments, the options it gives); every problem one SetupError."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise SetupError(f"--config {path!r}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise SetupError(f"--config {path}: not TOML ({e})") from e
    tables = sections(parser)
    argv: list[str] = []
    given: set[str] = set()
    for table, entries in data.items():
        home = [name for name, actions in tables.items() if table in actions]
        if not isinstance(entries, dict) and home:
            raise SetupError(f"--config {path}: {table} belongs in a table: [{home[0]}] then {table} = ...")
        if table not in tables:
            close = difflib.get_close_matches(table, tables, n=1)
            hint = f" (did you mean [{close[0]}]?)" if close else f"; tables: {', '.join(sorted(tables))}"
            raise SetupError(f"--config {path}: unknown table [{table}]{hint}")
        if not isinstance(entries, dict):
            raise SetupError(f"--config {path}: {table} must be a table ([{table}] followed by keys)")
        for key, value in entries.items():
            if key not in tables[table]:
                close = difflib.get_close_matches(key, tables[table], n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise SetupError(f"--config {path}: [{table}] has no key {key!r}{hint}")
            argv += _as_argv(path, f"[{table}] {key}", value, tables[table][key])
            given.add(key)
    return argv, given


def config_path(argv: list[str]) -> str | None:
    """`--config X` / `--config=X` among the arguments."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def parse_with_config(
    parser: argparse.ArgumentParser, argv: list[str]
) -> tuple[argparse.Namespace, list[str]]:
    """The arguments with `--config`'s file in front of them; returns (namespace, one line per option the command
    line overrides)."""
    path = config_path(argv)
    if path is None:
        return parser.parse_args(argv), []
    file_argv, given = read_config(path, parser)
    from_file = parser.parse_args(file_argv)
    args = parser.parse_args(file_argv + argv)
    overrides = [f"--{key.replace('_', '-')} {getattr(args, key)!r} overrides --config {path}'s "
                 f"{getattr(from_file, key)!r}" for key in sorted(given)
                 if getattr(args, key, None) != getattr(from_file, key, None)]  # fmt: skip
    return args, overrides


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string (JSON's escapes are TOML's)


def run_file_text(config: TrainConfig, parser: argparse.ArgumentParser) -> str:
    """The resolved options as a `--config` file: every option with a value, by table."""
    values = dataclasses.asdict(config)
    if values.get("train_epochs") is not None:  # the steps follow from the epochs again when replayed
        values["train_iters"] = None
    lines = ["# the resolved options of this run: `deepspeed launch/train.py --config run.toml` replays it"]
    for table, actions in sections(parser).items():
        entries = [f"{key} = {_toml_value(values[key])}" for key in actions if values.get(key) is not None
                   and not (isinstance(actions[key], argparse._StoreTrueAction) and not values[key])]  # fmt: skip
        if entries:
            lines += ["", f"[{table}]", *entries]
    return "\n".join(lines) + "\n"


def write_run_file(config: TrainConfig, parser: argparse.ArgumentParser, directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "run.toml")
    atomic_write_text(path, run_file_text(config, parser))
    return path
