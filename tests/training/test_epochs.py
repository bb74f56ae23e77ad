"""`--train-epochs`: the run's steps from passes over the training samples (held-out ones excluded), said at
start-up with the size of an epoch; bad values and the conflict with `--train-iters` are one error before any work;
the run file it writes replays the epochs, not the steps they gave."""

from __future__ import annotations

import math
import os

import pytest

from glm53_ds.training.errors import SetupError
from tests.cli import ROOT, metrics, run, train_config

CHAT = os.path.join(ROOT, "data", "tiny_chat.jsonl")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--train-epochs", "0"], "--train-epochs must be a finite number > 0, got 0.0"),
        (["--train-epochs", "inf"], "--train-epochs must be a finite number > 0, got inf"),
        (["--train-epochs", "1", "--train-iters", "5"], "--train-epochs 1 and --train-iters 5: give one"),
    ],
)
def test_bad_epochs_are_refused(argv, message):
    with pytest.raises(SetupError, match=message):
        train_config(*argv)


def test_the_run_file_replays_the_epochs_not_the_steps():
    from glm53_ds.training.args import build_parser
    from glm53_ds.training.run_file import run_file_text

    text = run_file_text(train_config("--train-epochs", "2"), build_parser())
    assert "train_epochs = 2.0" in text and "train_iters" not in text
    assert "train_iters = 60" in run_file_text(
        train_config(), build_parser()
    )  # control: without epochs, the steps


@pytest.mark.slow
def test_epochs_set_the_steps_and_the_schedule(tmp_path):
    """tiny_chat.jsonl packs into 104 rows of 64 tokens, 10% held out: 94 training rows, an epoch 47 steps of 2;
    0.05 epochs = 2.35 -> 3 steps, the cosine schedule ending at the last of them."""
    proc = run("--data", CHAT, "--valid-split", "0.1", "--train-epochs", "0.05", "--warmup", "0",
               "--output-dir", str(tmp_path / "out"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data: 94 training samples; one epoch = 47 steps of 2 samples; --train-epochs 0.05: 3 steps" in (
        proc.stderr
    ), proc.stderr[-3000:]
    records = [r for r in metrics(tmp_path / "out") if "lm_loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    # lr_at(2) of a 3-step cosine from 3e-3 to 3e-4 (the control: at 60 steps, the default, it would be near 3e-3)
    assert records[-1]["lr"] == pytest.approx(3e-4 + 0.5 * 2.7e-3 * (1 + math.cos(2 / 3 * math.pi)), rel=1e-6)


@pytest.mark.slow
def test_epochs_count_samples_consumed_across_a_resume_at_another_batch(tmp_path):
    """tiny_chat.jsonl: 104 rows of 64 tokens. 0.1 epochs at batch 2 = 6 steps (12 samples); resumed with
    --train-epochs 0.4 at --global-batch-size 4, the 41.6 samples are reached by 8 more steps of 4 (44 read: 0.42
    epochs). Control: before, the steps were counted from zero at the new batch, ceil(41.6 / 4) = 11 in all, so the
    run stopped at 12 + 5 x 4 = 32 samples, 0.31 epochs."""
    common = [
        "--data",
        CHAT,
        "--warmup",
        "0",
        "--save",
        str(tmp_path / "ck"),
        "--output-dir",
        str(tmp_path / "out"),
    ]
    first = run(*common, "--train-epochs", "0.1")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run(
        *common, "--load", str(tmp_path / "ck"), "--train-epochs", "0.4", "--global-batch-size", "4"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "--train-epochs 0.4: 14 steps (resumed at step 6, 0.115 epochs consumed)" in resumed.stderr, (
        resumed.stderr[-3000:]
    )
    records = [r for r in metrics(tmp_path / "out") if "lm_loss" in r]
    assert records[-1]["step"] == 14 and records[-1]["consumed_samples"] == 44
