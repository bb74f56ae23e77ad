"""Samples while training (training/samples.py): `--sample-prompts` completions at `--sample-interval` steps and at
the end, in samples.jsonl, through the chat template for chat data; the training records bitwise those of the run
without samples (greedy, eval mode, RNG restored); bad input one error before any work."""

from __future__ import annotations

import json
import os

import pytest

from glm53_ds.training.data import ByteTokenizer
from glm53_ds.training.errors import SetupError
from glm53_ds.training.samples import read_prompts
from tests.cli import ROOT, metrics, run, train_config

CHAT = os.path.join(ROOT, "data", "tiny_chat.jsonl")
TIMING = ("tok", "tflop", "mfu", "seconds", "time")  # wall-clock fields differ between any two runs


def test_prompts_are_read_with_the_chat_template_and_bad_lines_are_named(tmp_path):
    tok = ByteTokenizer()
    text = tmp_path / "p.txt"
    text.write_text("Hi\n\nthere\n")
    plain = read_prompts(str(text), tok, chat=False)
    assert [p.ids for p in plain] == [list(b"Hi"), list(b"there")]
    chat = read_prompts(str(text), tok, chat=True)  # chat data: the template with the generation prompt
    assert chat[0].ids == tok.chat_template_ids(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True
    )
    lines = tmp_path / "p.jsonl"
    lines.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"messages": [{"role": "user",
                     "content": [{"type": "text", "text": "b"}]}]}) + "\n")  # fmt: skip
    got = read_prompts(str(lines), tok, chat=False)
    assert [p.text for p in got] == ["a", "b"] and got[1].ids[-len(b"<|assistant|>\n") :] == list(
        b"<|assistant|>\n"
    )
    lines.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"question": "?"}) + "\n")
    with pytest.raises(ValueError, match=rf"--sample-prompts {lines}:2: a prompt line needs 'prompt'"):
        read_prompts(str(lines), tok, chat=False)
    with pytest.raises(ValueError, match="no such file"):
        read_prompts(str(tmp_path / "missing.txt"), tok, chat=False)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sample-interval", "2"], "--sample-interval 2 needs --sample-prompts FILE"),
        (["--sample-prompts", "p.txt", "--sample-tokens", "0"], "--sample-tokens must be >= 1, got 0"),
        (
            ["--sample-prompts", "p.txt", "--sp", "2"],
            "--sample-prompts with --sp 2: samples are not generated",
        ),
    ],
)
def test_bad_sample_options_are_refused(argv, message):
    with pytest.raises(SetupError, match=message):
        train_config(*argv)


@pytest.mark.slow
def test_samples_leave_the_training_bitwise_unchanged(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\nThe cat\n")
    common = ["--data", CHAT, "--train-iters", "4", "--log-interval", "1"]
    with_samples = run(*common, "--sample-prompts", str(prompts), "--sample-interval", "2", "--sample-tokens", "6",
                       "--output-dir", str(tmp_path / "a"))  # fmt: skip
    without = run(*common, "--output-dir", str(tmp_path / "b"))
    assert with_samples.returncode == 0 and without.returncode == 0, with_samples.stderr[-3000:]

    def kept(records: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in records]

    assert kept(metrics(tmp_path / "a")) == kept(metrics(tmp_path / "b"))  # bitwise: floats compared exactly
    samples = [json.loads(line) for line in (tmp_path / "a" / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["prompt"]) for s in samples] == [
        (2, "Hello"),
        (2, "The cat"),
        (4, "Hello"),
        (4, "The cat"),
    ]
    assert all(isinstance(s["completion"], str) for s in samples)
    assert "samples at step 4 (2," in with_samples.stderr
    assert not (tmp_path / "b" / "samples.jsonl").exists()


@pytest.mark.slow
def test_samples_never_cost_the_run(tmp_path, capsys, monkeypatch):
    """Before: the final samples ran before the final save, and a prompt longer than the model's positions (or any
    failure while sampling) ended the run with a traceback and no checkpoint. Now a long prompt keeps its last
    tokens (one line at start-up) and a failure while sampling is one line; the save happens either way."""
    from glm53_ds.engine import close_distributed
    from glm53_ds.safe_io import published_tags
    from glm53_ds.training import trainer as trainer_module
    from glm53_ds.training.trainer import Trainer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("x" * 5000 + "\nshort\n")  # 5,000 byte tokens: past the tiny model's 4,096 positions
    common = [
        "--train-iters",
        "1",
        "--seq-length",
        "16",
        "--sample-prompts",
        str(prompts),
        "--sample-tokens",
        "2",
    ]
    try:
        trainer = Trainer(
            train_config(*common, "--save", str(tmp_path / "ck"), "--output-dir", str(tmp_path / "a"))
        )
        trainer.run()
        trainer.close()
        err = capsys.readouterr().err
        assert (
            "--sample-prompts: 1 prompt(s) longer than the model's 4096 positions less --sample-tokens 2"
            in err
        )
        assert published_tags(str(tmp_path / "ck")) == ["step1"]
        assert len((tmp_path / "a" / "samples.jsonl").read_text().splitlines()) == 2

        def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise RuntimeError("CUDA out of memory (simulated)")

        monkeypatch.setattr(trainer_module, "generate_samples", broken)
        trainer = Trainer(
            train_config(*common, "--save", str(tmp_path / "ck2"), "--output-dir", str(tmp_path / "b"))
        )
        trainer.run()
        trainer.close()
        err = capsys.readouterr().err
        assert (
            "samples at step 1 failed (RuntimeError: CUDA out of memory (simulated)); the run goes on" in err
        )
        assert published_tags(str(tmp_path / "ck2")) == ["step1"]  # saved although the samples failed
    finally:
        close_distributed()
