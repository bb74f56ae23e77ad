"""Validation loss during training (`--valid-data`, `Trainer.evaluate`): the LM and MTP loss of the same
`--eval-iters` global batches at the start (when asked), every `--eval-interval` steps and at the end.

- A run with evaluation trains exactly as one without: every training record bitwise the same (the data position,
  the RNG and the router's load counts untouched). Control: evaluating with the model left in training mode (the
  router counts the validation tokens, so the next correction-bias update moves) changes the training losses.
- The same at every layout: an EP2 run's validation losses vs one process, within 1e-5 relative (the training
  curve's own bound, tests/training/test_trainer.py); the step-0 evaluations (same weights) within 1e-6.
- Deterministic: two evaluations of the same weights (the start of two runs) are bitwise equal.
- `--valid-split`: the held-out samples are never trained on and are in the stream's identity.
- metrics.jsonl, the loss plot, bad options refused before any work.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest

from glm53_ds.training.config import SetupError
from glm53_ds.training.data import ByteTokenizer, open_stream
from glm53_ds.training.metrics import StepMetrics, is_validation
from glm53_ds.training.packing import hold_out
from tests.cli import QUICK, ROOT, deepspeed_run, metrics, run, tiny_hf_checkpoint, train_config

CORPUS = os.path.join(ROOT, "data", "tiny_corpus.txt")


def _valid_file(tmp_path) -> str:
    path = tmp_path / "valid.txt"
    with open(CORPUS, encoding="utf-8") as f:
        path.write_text(
            f.read()[-900:], encoding="utf-8"
        )  # text the training stream also holds: the loss falls
    return str(path)


def _split(records):
    """(training records without their timings, validation records)."""
    train = [{k: v for k, v in r.items() if k not in StepMetrics.TIMING} for r in records
             if not is_validation(r)]  # fmt: skip
    return train, [r for r in records if is_validation(r)]


@pytest.mark.slow
def test_validation_loss_leaves_training_alone_and_is_the_same_at_every_layout(tmp_path):
    valid, hf = _valid_file(tmp_path), tmp_path / "hf"
    hf.mkdir()
    tiny_hf_checkpoint(hf)  # the same weights at every layout (a random start depends on the layout)
    common = [*QUICK[2:], "--hf-dir", str(hf), "--tokenizer", "bytes", "--train-iters", "4", "--micro-batch-size",
              "2", "--global-batch-size", "4"]  # fmt: skip
    evaluate = ["--valid-data", valid, "--eval-interval", "2", "--eval-iters", "2", "--eval-at-start"]
    plain = run(*common, "--output-dir", str(tmp_path / "plain"))
    assert plain.returncode == 0, plain.stderr[-3000:]
    one = run(*common, *evaluate, "--output-dir", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-3000:]
    assert "validation: --valid-data " in one.stderr and "validation at step 2: lm_loss " in one.stderr
    train, evals = _split(metrics(tmp_path / "one"))
    assert train == _split(metrics(tmp_path / "plain"))[0]  # bitwise: evaluation changed nothing in training
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert all(r["valid_target_tokens"] == 2 * 4 * 16 and "valid_mtp_loss" in r for r in evals)
    assert evals[-1]["valid_lm_loss"] < evals[0]["valid_lm_loss"]  # learning shows on held-out text
    assert os.path.getsize(tmp_path / "one" / "loss.png") > 0

    again = run(*common, *evaluate, "--train-iters", "1", "--output-dir", str(tmp_path / "again"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert _split(metrics(tmp_path / "again"))[1][0] == evals[0]  # deterministic

    ep2 = deepspeed_run(2, *common, *evaluate, "--ep", "2", "--output-dir", str(tmp_path / "ep2"))
    assert ep2.returncode == 0, ep2.stderr[-3000:]
    ep2_evals = _split(metrics(tmp_path / "ep2"))[1]
    assert [r["step"] for r in ep2_evals] == [0, 2, 4]
    for a, b in zip(evals, ep2_evals, strict=True):
        tol = 1e-6 if a["step"] == 0 else 1e-5
        for key in ("valid_lm_loss", "valid_mtp_loss"):
            assert abs(a[key] - b[key]) <= tol * abs(a[key]), (a, b)
        assert a["valid_target_tokens"] == b["valid_target_tokens"]


def test_evaluation_in_training_mode_would_change_the_training(tmp_path):
    """The control for the test above, in process: the same run with `evaluate` leaving the model in training mode
    (its router then counts the validation tokens) trains differently."""
    from glm53_ds.engine import close_distributed
    from glm53_ds.training.trainer import Trainer

    valid = _valid_file(tmp_path)
    argv = [*QUICK[2:], "--train-iters", "3", "--micro-batch-size", "2", "--valid-data", valid, "--eval-interval", "1",
            "--eval-iters", "1"]  # fmt: skip

    def losses(name: str, train_mode: bool) -> list[float]:
        trainer = Trainer(train_config(*argv, "--output-dir", str(tmp_path / name)))
        if train_mode:
            with mock.patch("torch.nn.Module.eval", lambda self: self):
                trainer.run()
        else:
            trainer.run()
        trainer.close()
        return [r["lm_loss"] for r in _split(metrics(tmp_path / name))[0]]

    try:
        right = losses("right", train_mode=False)
        wrong = losses("wrong", train_mode=True)
    finally:
        close_distributed()  # the trainer's world-1 group: not left to the tests after this one
    assert right[0] == wrong[0] and right[1:] != wrong[1:]


@pytest.mark.parametrize("chat", [False, True], ids=["windows", "packed_chat"])
def test_valid_split_holds_out_the_last_samples(tmp_path, chat):
    """`--valid-split`: the held-out samples are never read by training (over several epochs), the two parts make
    the corpus, and the split is in the stream's identity (a resume with another split is refused)."""
    data = os.path.join(ROOT, "data", "tiny_chat.jsonl") if chat else CORPUS
    train, valid = (
        open_stream(data, ByteTokenizer(), str(tmp_path), 32, 3, 300, pack=False) for _ in range(2)
    )
    whole = train.num_samples
    held = hold_out(train, valid, 0.2)
    assert held == round(0.2 * whole) and train.num_samples + valid.num_samples == whole
    trained = {train.order(i) for i in range(3 * train.num_samples)}
    validated = {valid.order(i) for i in range(valid.num_samples)}
    assert trained == set(range(whole - held)) and validated == set(range(whole - held, whole))
    assert train.identity["samples"] == [0, whole - held] and valid.identity["samples"] == [
        whole - held,
        whole,
    ]
    plain = open_stream(data, ByteTokenizer(), str(tmp_path), 32, 3, 300, pack=False)
    assert plain.identity["samples"] == [
        0,
        whole,
    ]  # recorded always: a resume that drops the split is refused
    with pytest.raises(ValueError, match=r"--valid-split 1: holds out .* leaving none to train on"):
        hold_out(plain, open_stream(data, ByteTokenizer(), str(tmp_path), 32, 3, 300, pack=False), 1.0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--eval-interval", "5"], r"--eval-interval without --valid-data or --valid-split"),
        (["--eval-at-start"], r"--eval-at-start without --valid-data"),
        (
            ["--valid-data", "/nonexistent/valid.txt"],
            r"--valid-data '/nonexistent/valid.txt': neither a file, a folder, an indexed dataset",
        ),
        (["--valid-data", CORPUS, "--eval-iters", "0"], r"--eval-iters must be >= 1"),
        (["--valid-split", "0.7"], r"--valid-split must be in \[0, 0.5\]"),
        (["--valid-split", "0.1", "--valid-data", CORPUS], r"--valid-split with --valid-data: give one"),
    ],
)
def test_bad_validation_options_are_one_error(argv, message):
    with pytest.raises(SetupError, match=message):
        train_config(*argv)


def test_a_resume_keeps_the_valid_split(tmp_path):
    """Before: a resume that dropped --valid-split was accepted (training then read the held-out samples), and
    adding a split to an unsplit checkpoint passed with the notice meant for old checkpoints. Now the sample range
    is recorded always and a resume with another one, or none, is refused naming --valid-split; a checkpoint
    written before the range was recorded counts as the whole corpus (the control: it resumes unsplit)."""
    import torch

    from glm53_ds.checkpoint import CLIENT_STATE, CheckpointDir
    from glm53_ds.engine import close_distributed
    from glm53_ds.safe_io import describe_files, list_files, write_manifest
    from glm53_ds.training.trainer import Trainer

    base = [*QUICK[2:], "--train-iters", "2", "--micro-batch-size", "2"]

    def setup(*argv: str) -> Trainer:
        trainer = Trainer(train_config(*base, *argv))
        try:
            trainer.setup()
        finally:
            trainer.close()
        return trainer

    try:
        for name, split in (("split", ["--valid-split", "0.2"]), ("whole", [])):
            trainer = Trainer(train_config(*base, *split, "--save", str(tmp_path / name), "--output-dir",
                                           str(tmp_path / f"out_{name}")))  # fmt: skip
            trainer.run()
            trainer.close()
        resume = ["--train-iters", "3", "--output-dir", str(tmp_path / "resume")]
        with pytest.raises(
            SetupError, match=r"--valid-split 0: this run trains on samples \[0, \d+\) .* trained on"
        ):
            setup("--load", str(tmp_path / "split"), *resume)
        with pytest.raises(SetupError, match=r"--valid-split 0.2: .*another --valid-split"):
            setup("--load", str(tmp_path / "whole"), "--valid-split", "0.2", *resume)
        setup("--load", str(tmp_path / "split"), "--valid-split", "0.2", *resume)  # the same split resumes

        # a checkpoint from before the range was recorded: its client state without "samples" = the whole corpus
        tag = CheckpointDir(str(tmp_path / "whole")).tag_dir
        path = os.path.join(tag, "glm53", CLIENT_STATE)
        client = torch.load(path, weights_only=True)
        client["data"].pop("samples")
        torch.save(client, path)
        write_manifest(tag, describe_files(tag, list_files(tag)))
        assert setup("--load", str(tmp_path / "whole"), *resume).start_step == 2
        with pytest.raises(SetupError, match=r"--valid-split 0.2"):
            setup("--load", str(tmp_path / "whole"), "--valid-split", "0.2", *resume)
    finally:
        close_distributed()
