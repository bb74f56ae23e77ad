"""The run's options, declared once: each `TrainConfig` field with its section, help, choices and flag.

The command line (`deepspeed launch/train.py`, training/args.py), the run file's tables (`--config run.toml`,
training/run_file.py) and the planner's flags (`python -m glm53_ds.plan`) are generated from these declarations,
so an option is added, renamed or documented in one place. A section is the command line's argument group
(Megatron's groups) and the run file's table (`section_table`).

An option's declaration also says what the planner does with it (`plan`): `MEMORY` where its value changes one
rank's memory, so the planner takes the flag and reads the value (a test fails where a field so marked is not read,
tests/plan/test_planned_run.py), `SEARCHED` where `--search` also varies it; and the least value it admits
(`least`), which the trainer and the planner check alike (`check_bounds`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}


# what the planner does with an option (`Option.plan`)
MEMORY = "memory"  # its value changes one rank's memory: the planner takes it and reads it
SEARCHED = "searched"  # ... and `python -m glm53_ds.plan --search` varies it


@dataclass(frozen=True)
class Option:
    section: str  # the command line's group title; the run file's table is `section_table(section)`
    help: str | None = None
    choices: tuple[Any, ...] | None = None
    flag: str | None = None  # default: --<name with dashes>
    plan: str | None = None  # MEMORY, SEARCHED, or None: the planner neither takes nor reads it
    least: int | float | None = None  # the least value admitted (a float also finite), None: no bound


def option(
    default: Any, section: str, help: str | None = None, *, choices: tuple[Any, ...] | None = None,
    flag: str | None = None, plan: str | None = None, least: int | float | None = None,
) -> Any:  # fmt: skip
    """A `TrainConfig` field that is an option of the run."""
    if plan not in (None, MEMORY, SEARCHED):
        raise ValueError(f"plan={plan!r}: expected None, {MEMORY!r} or {SEARCHED!r}")
    declared_option = Option(section, help, choices, flag, plan, least)
    return dataclasses.field(default=default, metadata={"option": declared_option})


def section_table(section: str) -> str:
    """A section's table in the run file: 'checkpoints and output' -> checkpoints_output."""
    return section.lower().replace(" and ", "_").replace("-", "_").replace(" ", "_")


def declared(config_type: type) -> list[tuple[dataclasses.Field, Option]]:
    """The options of a config type, in declaration order (the order of --help and of the run file)."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(config_type) if "option" in f.metadata]


def flag(field: dataclasses.Field, declared_option: Option) -> str:
    return declared_option.flag or "--" + field.name.replace("_", "-")


def planned(config_type: type) -> tuple[str, ...]:
    """The options whose values change one rank's memory (`plan` MEMORY or SEARCHED): the planner's flags."""
    return tuple(f.name for f, o in declared(config_type) if o.plan in (MEMORY, SEARCHED))


def searched(config_type: type) -> tuple[str, ...]:
    """The options `--search` varies (`plan` SEARCHED)."""
    return tuple(f.name for f, o in declared(config_type) if o.plan == SEARCHED)


def check_bounds(config: Any, spelled: dict[str, str] | None = None) -> None:
    """ValueError naming the first option below its declared least value (`--ep 0`, `--lr nan`): an int
    'must be >= N', a float 'must be a finite number >= N'; None (an option not given) is left alone. `spelled`:
    another tool's flag for an option (the planner's --world for gpus)."""
    for field, declared_option in declared(type(config)):
        least, value = declared_option.least, getattr(config, field.name)
        if least is None or value is None:
            continue
        name = (spelled or {}).get(field.name) or flag(field, declared_option)
        if value_type(field) is float:
            if not (math.isfinite(value) and value >= least):
                raise ValueError(f"{name} must be a finite number >= {least:g}, got {value}")
        elif value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")


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
        if field.default is None and not takes_several(field):  # an option a run file set, unset by a flag
            kwargs["type"] = _or_none(kind)
            kwargs["help"] = (
                f"{declared_option.help or ''} ('none': unset, e.g. what a --config file set)".strip()
            )
        elif kind is not str:
            kwargs["type"] = kind
        if declared_option.choices is not None:
            kwargs["choices"] = list(declared_option.choices)
        if takes_several(field):
            kwargs["nargs"] = "+"
        groups[section].add_argument(flag(field, declared_option), **kwargs)


def _or_none(kind: type) -> Any:
    """argparse's type for an option whose default is None: the word `none` gives None (unset), else `kind`."""

    def parse(text: str) -> Any:
        return None if text.strip().lower() == "none" else kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its errors ("invalid int value")
    parse.kind = kind  # type: ignore[attr-defined]  # what a run file's value must be (run_file.py)
    return parse


def value_kind(action: argparse.Action) -> Any:
    """The type of an action's value: its `type`, or the kind an unsettable option's type parses."""
    return getattr(action.type, "kind", action.type)


def say_defaults(parser: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    """Append '(default: X)' to each option's help that does not already say its default."""
    for action in parser._actions:  # argparse keeps the actions here and nowhere public
        documented = action.help == argparse.SUPPRESS or "default" in (action.help or "")
        if defaults.get(action.dest) not in (None, dataclasses.MISSING, False) and not documented:
            action.help = f"{action.help or ''} (default: {defaults[action.dest]})".strip()
