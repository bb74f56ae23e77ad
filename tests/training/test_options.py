"""The run's options are declared once (training/options.py): the trainer's command line, the run file's tables and
the planner's shared flags are generated from `TrainConfig`'s fields, so none of them can drift from the others."""

from __future__ import annotations

import argparse
import dataclasses
import re

from glm53_ds.plan.run import PLANNER_DEFAULTS
from glm53_ds.training.args import build_parser
from glm53_ds.training.config import TrainConfig
from glm53_ds.training.options import declared, planned, section_table, tables, value_kind, value_type

LAUNCHER_AND_FILE = {"help", "config", "local_rank", "deepspeed"}


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings}


def _planner_parser() -> argparse.ArgumentParser:
    """The planner's parser as its main() builds it (argparse exits on --help: caught here)."""
    from glm53_ds.plan import __main__ as plan_main

    built: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        built.append(self)
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign]
    try:
        plan_main.main(["--world", "8"])
    except SystemExit:
        pass
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    return built[0]


def _without_default(help_text: str | None) -> str:
    """The help without the '(default: X)' each tool appends with its own default."""
    return re.sub(r"\s*\(default: [^)]*\)$", "", help_text or "")


def differences(trainer: argparse.ArgumentParser, other: argparse.ArgumentParser) -> list[str]:
    """The options `other` shares with the trainer whose flag, type, choices, kind or help differ."""
    mine, theirs = _actions(trainer), _actions(other)
    out = []
    for dest in sorted(set(mine) & set(theirs) - LAUNCHER_AND_FILE):
        a, b = mine[dest], theirs[dest]
        for what in ("option_strings", "choices", "nargs", "const"):
            if getattr(a, what) != getattr(b, what):
                out.append(f"{dest}: {what} {getattr(a, what)!r} vs {getattr(b, what)!r}")
        if value_kind(a) is not value_kind(b) or hasattr(a.type, "kind") != hasattr(b.type, "kind"):
            out.append(f"{dest}: type {a.type!r} vs {b.type!r}")
        if type(a) is not type(b) or _without_default(a.help) != _without_default(b.help):
            out.append(f"{dest}: kind or help differ")
    return out


def test_the_command_line_is_the_declared_options():
    parser = build_parser()
    actions = _actions(parser)
    fields = {f.name: (f, o) for f, o in declared(TrainConfig)}
    assert (
        set(actions) - LAUNCHER_AND_FILE == set(fields) == {f.name for f in dataclasses.fields(TrainConfig)}
    )
    for name, (field, option) in fields.items():
        action = actions[name]
        kind = value_type(field)
        assert isinstance(action, argparse._StoreTrueAction) == (kind is bool), name
        if kind in (int, float):
            assert value_kind(action) is kind, name
        assert (action.choices is None) == (option.choices is None), name
        # the option's group is its section, and the section is the run file's table
        group = next(g for g in parser._action_groups if action in g._group_actions)
        assert group.title == option.section and name in tables(TrainConfig)[section_table(option.section)]


def test_the_planner_takes_the_trainers_options_as_declared():
    """The planner's flags are the options declared to change memory (plan=MEMORY / SEARCHED), generated from the
    declarations (--world: its spelling of --gpus), and its defaults differ from the trainer's only where it says
    (the released model's usual run)."""
    trainer, planner = build_parser(), _planner_parser()
    planner._actions = [a for a in planner._actions if "--world" not in a.option_strings]  # the --gpus alias
    shared = set(_actions(trainer)) & set(_actions(planner)) - LAUNCHER_AND_FILE
    assert (
        shared == set(planned(TrainConfig)) and {"model_config", "ep", "gpus", "deepspeed_config"} <= shared
    )
    assert differences(trainer, planner) == []
    assert set(PLANNER_DEFAULTS) <= shared
    assert all(
        PLANNER_DEFAULTS[n] != getattr(TrainConfig, n) for n in PLANNER_DEFAULTS
    )  # only where they differ
    # control: an option re-declared by hand with its own choices is found
    drifted = argparse.ArgumentParser()
    drifted.add_argument("--recompute", choices=["none", "full"], help="activation recompute")
    assert any(d.startswith("recompute: choices") for d in differences(trainer, drifted))
