"""The run's options, declared once: each `TrainConfig` field with its section, help, choices and flag.

The command line (`deepspeed launch/train.py`, training/args.py), the run file's tables (`--config run.toml`,
training/run_file.py) and the planner's shared flags (`python -m glm53_ds.plan`) are generated from these
declarations, so an option is added, renamed or documented in one place. A section is the command line's argument
group (Megatron's groups) and the run file's table (`section_table`).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}


@dataclass(frozen=True)
class Option:
    section: str  # the command line's group title; the run file's table is `section_table(section)`
    help: str | None = None
    choices: tuple[Any, ...] | None = None
    flag: str | None = None  # default: --<name with dashes>


def option(
    default: Any, section: str, help: str | None = None, *, choices: tuple[Any, ...] | None = None,
    flag: str | None = None,
) -> Any:  # fmt: skip
    """A `TrainConfig` field that is an option of the run."""
    return dataclasses.field(default=default, metadata={"option": Option(section, help, choices, flag)})


def section_table(section: str) -> str:
    """A section's table in the run file: 'checkpoints and output' -> checkpoints_output."""
    return section.lower().replace(" and ", "_").replace("-", "_").replace(" ", "_")


def declared(config_type: type) -> list[tuple[dataclasses.Field, Option]]:
    """The options of a config type, in declaration order (the order of --help and of the run file)."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(config_type) if "option" in f.metadata]


def flag(field: dataclasses.Field, declared_option: Option) -> str:
    return declared_option.flag or "--" + field.name.replace("_", "-")


def _annotation(field: dataclasses.Field) -> str:
    return field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))


def takes_several(field: dataclasses.Field) -> bool:
    """Whether the option takes one or more values (a `tuple[str, ...]` field: `--data a.jsonl:3 b.txt:1`)."""
    return _annotation(field).startswith("tuple[")


def value_type(field: dataclasses.Field) -> type:
    """The type of the field's value, or of each of its values ('int', 'float | None', 'bool', 'str | None',
    'tuple[str, ...]')."""
    annotation = _annotation(field)
    if takes_several(field):
        return _TYPES[annotation[len("tuple[") :].split(",")[0].strip()]
    return _TYPES[annotation.split("|")[0].strip()]


def tables(config_type: type) -> dict[str, list[str]]:
    """The run file's tables: each section's option names, in declaration order."""
    out: dict[str, list[str]] = {}
    for field, declared_option in declared(config_type):
        out.setdefault(section_table(declared_option.section), []).append(field.name)
    return out


def add_options(
    parser: argparse.ArgumentParser, config_type: type, names: tuple[str, ...] | None = None,
    defaults: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    """Add the declared options (all, or `names`) to `parser`, one argument group per section. `defaults`: the
    values this parser gives an option not given (another tool's, the planner's); without them the parser leaves
    it out, or applies its `argument_default`."""
    groups: dict[str, Any] = {}
    for field, declared_option in declared(config_type):
        if names is not None and field.name not in names:
            continue
        section = declared_option.section
        if section not in groups:
            groups[section] = parser.add_argument_group(section)
        kind = value_type(field)
        kwargs: dict[str, Any] = {"help": declared_option.help}
        if defaults is not None and field.name in defaults:
            kwargs["default"] = defaults[field.name]
        if kind is bool:
            groups[section].add_argument(flag(field, declared_option), action="store_true", **kwargs)
            continue
        if kind is not str:
            kwargs["type"] = kind
        if declared_option.choices is not None:
            kwargs["choices"] = list(declared_option.choices)
        if takes_several(field):
            kwargs["nargs"] = "+"
        groups[section].add_argument(flag(field, declared_option), **kwargs)


def say_defaults(parser: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    """Append '(default: X)' to each option's help that does not already say its default."""
    for action in parser._actions:  # argparse keeps the actions here and nowhere public
        documented = action.help == argparse.SUPPRESS or "default" in (action.help or "")
        if defaults.get(action.dest) not in (None, dataclasses.MISSING, False) and not documented:
            action.help = f"{action.help or ''} (default: {defaults[action.dest]})".strip()
