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
import os
import tomllib
from typing import Any

from ..safe_io import atomic_write_text
from .config import SetupError, TrainConfig
from .options import tables, value_kind


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
    kind = value_kind(action)
    if isinstance(value, bool) or isinstance(value, dict | list):
        raise SetupError(f"{where} = {value!r}: expected a {getattr(kind, '__name__', 'str')}")
    if kind is int and not isinstance(value, int):
        raise SetupError(f"{where} = {value!r}: expected an integer")
    if kind is float and not isinstance(value, int | float):
        raise SetupError(f"{where} = {value!r}: expected a number")
    if kind in (None, str) and not isinstance(value, str):
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
    except IsADirectoryError:
        raise SetupError(
            f"--config {path!r} is a directory; give a run file (e.g. <output-dir>/run.toml)"
        ) from None
    except OSError as e:
        raise SetupError(f"--config {path!r}: cannot read it ({e.strerror})") from e
    except UnicodeDecodeError as e:
        raise SetupError(f"--config {path}: not UTF-8 text (byte {e.start}); a run file is UTF-8 TOML") from e
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
    """`--config X` / `--config=X` among the arguments; a SetupError for two of them (argparse would keep the last
    while the file read is the first)."""
    found = []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif arg.startswith("--config="):
            found.append(arg.split("=", 1)[1])
    if len(found) > 1:
        raise SetupError(f"--config given {len(found)} times ({', '.join(found)}): give one run file; flags beside it "
                         "override what it sets")  # fmt: skip
    return found[0] if found else None


# Options that exclude each other: a flag for one replaces what the file gives for the other (a recipe's train_iters
# under --train-epochs), said in the override lines.
EXCLUSIVE = (("train_epochs", "train_iters"), ("valid_split", "valid_data"))
# The options of validation: set by the file, dropped when the command line turns validation off (--valid-split 0
# with no --valid-data), said in one line.
VALIDATION = ("eval_interval", "eval_iters", "eval_at_start")


def _resolve_file_and_flags(
    args: argparse.Namespace, from_file: argparse.Namespace, given: set[str], flags: set[str], path: str
) -> list[str]:
    """Drop from `args` what the file gives that the command line replaced by an exclusive option or turned off;
    one line each."""
    lines = []
    for a, b in EXCLUSIVE:
        for mine, theirs in ((a, b), (b, a)):
            if (
                mine in flags
                and theirs in given
                and theirs not in flags
                and getattr(args, mine, None) is not None
            ):
                delattr(args, theirs)
                lines.append(f"--{mine.replace('_', '-')} {getattr(args, mine)!r} replaces --config {path}'s "
                             f"{theirs} {getattr(from_file, theirs)!r}")  # fmt: skip
    validation_off = (
        {"valid_split", "valid_data"} & flags
        and not getattr(args, "valid_split", 0)
        and not getattr(args, "valid_data", None)
    )
    dropped = [n for n in VALIDATION if n in given and n not in flags] if validation_off else []
    for name in dropped:
        delattr(args, name)
    if dropped:
        lines.append(f"validation is off: --config {path}'s {', '.join(dropped)} dropped")
    return lines


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
    flags = set(vars(parser.parse_args(argv)))  # the options the command line gives
    overrides = [f"--{key.replace('_', '-')} {getattr(args, key)!r} overrides --config {path}'s "
                 f"{getattr(from_file, key)!r}" for key in sorted(given)
                 if getattr(args, key, None) != getattr(from_file, key, None)]  # fmt: skip
    return args, overrides + _resolve_file_and_flags(args, from_file, given, flags, path)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return toml_string(str(value))


def toml_string(text: str) -> str:
    """`text` as a TOML basic string: any character as itself (a non-BMP one too: JSON's surrogate-pair escapes are
    not TOML), but the quote, the backslash and the control characters, which are escaped."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


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
