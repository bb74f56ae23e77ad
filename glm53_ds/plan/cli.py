"""What the dry run (`python -m glm53_ds.plan.dry_run`) checks of its own arguments before any work: the refusal of
impossible numbers (`--rank -1`, `--layers -2`) in one `error:` line. The options it shares with the trainer are
checked by their declared least values (`training.options.check_bounds`), and the length past the model's positions
by the trainer's own rule (`training.config.check_seq_length`)."""

from __future__ import annotations

import argparse


def check_numbers(args: argparse.Namespace, at_least: dict[str, int]) -> None:
    """ValueError naming the first option below its least value; options not given (None) are left alone."""
    for name, least in at_least.items():
        value = getattr(args, name, None)
        if value is not None and value < least:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
