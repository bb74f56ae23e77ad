"""What the planner's two commands (`python -m glm53_ds.plan`, `python -m glm53_ds.plan.dry_run`) share: the refusal
of impossible numbers before any work (one `error:` line each; the length past the model's positions is the
trainer's own rule, `training.config.check_seq_length`). The model a `--model-config` names is the trainer's
`training.presets.named_config`."""

from __future__ import annotations

import argparse


def check_numbers(args: argparse.Namespace, at_least: dict[str, int]) -> None:
    """ValueError naming the first option below its least value (`--world 0`, `--seq-length -1`, ...); options
    not given (None) are left alone."""
    for name, least in at_least.items():
        value = getattr(args, name, None)
        if value is not None and value < least:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
