"""Command line of `deepspeed launch/train.py`, generated from `TrainConfig`'s declared options (training/options.py);
`TrainConfig.from_args` turns it into the typed config."""

from __future__ import annotations

import argparse
import dataclasses

from .config import TrainConfig
from .options import add_options, say_defaults


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepspeed launch/train.py",
        argument_default=argparse.SUPPRESS,  # the defaults live in TrainConfig (appended to each help below)
        description="Train or fine-tune GLM-5.3-Flash with DeepSpeed ZeRO + expert parallelism. With no arguments: "
        "the `tiny` preset on the shipped text sample.",
    )
    p.add_argument("--config", help="a run described in a TOML file (tables named after the option groups below, "
                   "keys after the options; docs/usage.md); flags given beside it override it, each said in one line. "
                   "Every run writes its resolved options as <output-dir>/run.toml, which replays it")  # fmt: skip
    add_options(p, TrainConfig)
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument("--deepspeed", action="store_true", help=argparse.SUPPRESS)  # accepted for compatibility
    say_defaults(p, {f.name: f.default for f in dataclasses.fields(TrainConfig)})
    return p
