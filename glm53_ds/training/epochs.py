"""How many steps the data makes: the start-up lines of the training data (an epoch in steps, the steps of
`--train-epochs`) and of the validation data (what each evaluation reads)."""

from __future__ import annotations

import math

from .config import TrainConfig


def epoch_steps(
    config: TrainConfig, samples: int, batch: int, step: int = 0, consumed: int = 0
) -> tuple[int, str]:
    """(the run's steps, the data's start-up line) for `samples` training samples at global batch `batch`. Under
    --train-epochs the steps reach that many passes counted in samples consumed: a resume at `step` with `consumed`
    samples read (at whatever batch it had) trains what is left at this batch; else --train-iters."""
    epoch = samples / batch
    line = f"data: {samples} training samples; one epoch = {epoch:.4g} steps of {batch} samples"
    if config.train_epochs is None:
        return (
            config.train_iters,
            line + f"; --train-iters {config.train_iters} = {config.train_iters / epoch:.3g} epochs",
        )
    left = max(config.train_epochs * samples - consumed, 0.0)
    steps = step + max(0 if step else 1, math.ceil(left / batch - 1e-9))
    so_far = f" (resumed at step {step}, {consumed / samples:.3g} epochs consumed)" if step else ""
    return steps, line + f"; --train-epochs {config.train_epochs:g}: {steps} steps{so_far}"


def validation_line(config: TrainConfig, samples: int, batch: int) -> str:
    """What each evaluation reads of the `samples` validation samples at global batch `batch`."""
    c, wanted = config, config.eval_iters * batch
    when = f"every {c.eval_interval} steps and at the end" if c.eval_interval else "at the end"
    source = f"--valid-data {c.valid_data}" if c.valid_data else f"--valid-split {c.valid_split:g} of --data"
    line = (f"validation: {source}: {samples} samples; each evaluation "
            f"({when}{', and at the start' if c.eval_at_start else ''}) reads the same {c.eval_iters} x "
            f"{batch} = {wanted}")  # fmt: skip
    if wanted > samples:
        line += " (more than it holds: some samples are read twice; lower --eval-iters to avoid it)"
    return line
