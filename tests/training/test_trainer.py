"""The trainer (training/trainer.py) end to end, `deepspeed launch/train.py` on CPU ranks: training, resume
exactness (at the consumed samples, with another batch size, at another layout keeping the global batch), a save
killed halfway, a huge learning rate stopping at the last good checkpoint, a resume on another corpus refused, a
two-rank refusal reported once, HF export, what the run says (saves, resumes, names), and every set-up failure with
its message."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import glm53_ds
from tests.cli import (
    DIE_DURING_SAVE,
    HANG_TIMEOUT,
    QUICK,
    ROOT,
    deepspeed_run,
    metrics,
    one_error,
    python_run,
    run,
    tiny_hf_checkpoint,
)


@pytest.mark.slow
def test_two_ranks_train_export_and_plot(tmp_path):
    out, export = tmp_path / "run", tmp_path / "hf"
    proc = deepspeed_run(2, "--train-iters", "12", "--output-dir", str(out), "--export-hf", str(export),
                         "--tensorboard-dir", str(tmp_path / "tb"), "--check-replicas-interval", "4",
                         launcher=True)  # the real launcher, once: the other multi-rank runs are forked  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(1, 13))
    assert records[-1]["lm_loss"] < records[0]["lm_loss"] - 0.5  # visibly learning
    for key in ("mtp_loss", "lr", "grad_norm", "tokens_per_s", "step_time", "moe_imbalance"):
        assert key in records[-1]
    assert (out / "loss.png").stat().st_size > 1000
    assert any(p.name.startswith("events") for p in (tmp_path / "tb").iterdir())
    # the export is a transformers checkpoint with the trained weights
    from transformers import Glm5NextForConditionalGeneration

    hf = Glm5NextForConditionalGeneration.from_pretrained(export, attn_implementation="eager").eval()
    ours = glm53_ds.load_hf(str(export)).eval()
    ids = torch.randint(1, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(hf(input_ids=ids).logits, ours(ids), rtol=1e-5, atol=1e-5)
    assert ours.mtp is not None  # MTP weights exported under layers.<num_hidden_layers>


@pytest.mark.slow
def test_four_ranks_ep2_etp2(tmp_path):
    proc = deepspeed_run(4, "--ep", "2", "--etp", "2", "--train-iters", "3", "--global-batch-size", "16",
                         "--output-dir", str(tmp_path), "--check-replicas-interval", "1")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(metrics(tmp_path)) == 3


@pytest.mark.slow
def test_resume_is_bitwise_and_a_killed_save_keeps_the_previous(tmp_path):
    common = ["--train-iters", "6", "--save-interval", "3", "--save", str(tmp_path / "ckpt")]
    # The save at step 6 dies halfway: 'latest' must still point at step 3.
    proc = deepspeed_run(
        2, "--die-during-save", "step6", *common, "--output-dir", str(tmp_path / "a"), script=DIE_DURING_SAVE
    )
    assert proc.returncode != 0
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step3"
    uninterrupted = metrics(tmp_path / "a")
    assert len(uninterrupted) == 6
    # Resume from step 3 and run steps 4..6 again: losses bitwise equal to the run above.
    proc = deepspeed_run(2, *common, "--load", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "b"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    resumed = metrics(tmp_path / "b")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for a, b in zip(uninterrupted[3:], resumed, strict=True):
        assert a["loss"] == b["loss"] and a["lm_loss"] == b["lm_loss"] and a["grad_norm"] == b["grad_norm"]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step6"


@pytest.mark.slow
def test_an_offloaded_run_killed_in_its_host_update_or_a_save_keeps_latest_whole_and_resumes_bitwise(
    tmp_path,
):
    """#61: ZeRO-Offload (ZeRO 2, two ranks). kill -9 of every rank inside step 5's host update (DeepSpeedCPUAdam
    has updated the host's masters and moments, the device weights not yet): `latest` stays on step 4, whole. A
    run resumed from step 2 repeats steps 3-4 bitwise (loss and gradient norm: the host state came back exactly)
    and is killed -9 inside its save of step 6: its `latest` stays on its step 4, whole."""
    from glm53_ds import safe_io

    def whole(tag_dir) -> bool:  # type: ignore[no-untyped-def]
        files = safe_io.read_manifest(str(tag_dir))
        return not safe_io.unlisted_files(str(tag_dir), files) and not safe_io.verify_files(
            str(tag_dir), files, list(files)
        )

    config = tmp_path / "zero2.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    common = ["--offload-optimizer", "cpu", "--deepspeed_config", str(config), "--train-iters", "6",
              "--save-interval", "2"]  # fmt: skip
    a, b = tmp_path / "a", tmp_path / "b"
    proc = deepspeed_run(2, *common, "--die-in-host-update", "5", "--save", str(a / "ckpt"), "--output-dir", str(a),
                         script=DIE_DURING_SAVE)  # fmt: skip
    assert proc.returncode != 0, proc.stdout[-2000:]
    killed = metrics(a)
    assert [r["step"] for r in killed] == [1, 2, 3, 4], proc.stderr[-3000:]
    assert (a / "ckpt" / "latest").read_text().strip() == "step4"
    assert whole(a / "ckpt" / "step4")
    proc = deepspeed_run(2, *common, "--die-during-save", "step6", "--load", str(a / "ckpt"), "--load-tag", "step2",
                         "--save", str(b / "ckpt"), "--output-dir", str(b), script=DIE_DURING_SAVE,
                         env={"GLM53_TEST_DIE": "rank"})  # fmt: skip
    assert proc.returncode != 0, proc.stdout[-2000:]
    resumed = metrics(b)
    assert [r["step"] for r in resumed] == [3, 4, 5, 6], proc.stderr[-3000:]
    for x, y in zip(killed[2:], resumed[:2], strict=True):
        assert (x["lm_loss"], x["grad_norm"]) == (y["lm_loss"], y["grad_norm"]), (x, y)
    assert (b / "ckpt" / "latest").read_text().strip() == "step4"
    assert whole(b / "ckpt" / "step4")


@pytest.mark.slow
def test_nan_loss_stops_with_the_step(tmp_path):
    proc = python_run("--train-iters", "5", "--lr", "1e30", "--warmup", "0", "--clip-grad", "0",
                      "--output-dir", str(tmp_path))  # fmt: skip
    assert proc.returncode == 3, proc.stderr[-2000:]
    # AdamW's first update is lr-sized in every weight; the loss that follows overflows
    assert re.search(
        r"error: (loss is (nan|inf) at step [23] \(micro-batch 0\)|gradient norm is (nan|inf) at step [23]); training stopped",
        proc.stderr,
    ), proc.stderr[-1500:]


def _bad_dataset(tmp_path) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "bad")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=__import__("numpy").int32)
    ids = torch.tensor([1, 2, 300] * 100)
    builder.add_document(ids, [ids.numel()])
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "/nonexistent/corpus.jsonl"], "--data '/nonexistent/corpus.jsonl': neither a file"),
        (["--tokenizer", "/nonexistent/tok"], "--tokenizer '/nonexistent/tok'"),
        (["--load", "/nonexistent/ckpt"], "--load '/nonexistent/ckpt': no checkpoint there"),
        (["--hf-dir", "/nonexistent/hf"], "--hf-dir '/nonexistent/hf': no config.json"),
        (
            ["--ep", "4"],
            "--ep 4 --etp 1 --sp 1: world size 1 is not divisible by EP x ETP = 4 x 1 = 4",
        ),
        (
            ["--sp", "2"],
            "--ep 1 --etp 1 --sp 2: world size 1 is not divisible by SP x ETP = 2 x 1 = 2",
        ),
        (
            ["--global-batch-size", "3"],
            "--global-batch-size 3 is not a multiple of --micro-batch-size 2 x world size 1 = 2",
        ),
        (
            [
                "--deepspeed_config",
                "ds_configs/cpu.json",
                "--micro-batch-size",
                "4",
                "--global-batch-size",
                "8",
            ],
            None,
        ),
        (
            ["BATCH_CONTRADICTION"],
            "train_micro_batch_size_per_gpu=8 contradicts the command line, which gives "
            "train_micro_batch_size_per_gpu=2",
        ),  # fmt: skip
        (["BAD_TOKENS"], "contains token id 300, outside the model's vocab_size 258"),
    ],
)
@pytest.mark.slow
def test_setup_failures_name_the_problem(tmp_path, args, message):
    if args == ["BATCH_CONTRADICTION"]:
        config = tmp_path / "ds.json"
        config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8}))
        args = ["--deepspeed_config", str(config)]
    elif args == ["BAD_TOKENS"]:
        args = ["--data", _bad_dataset(tmp_path)]
    proc = python_run(*args, "--train-iters", "1", "--output-dir", str(tmp_path / "out"))
    if message is None:  # the shipped config agrees with the command line
        assert proc.returncode == 0, proc.stderr[-2000:]
        return
    assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr[-2000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and message in error[0], proc.stderr[-2000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists() or not metrics(tmp_path / "out")


@pytest.mark.slow
def test_main_destroys_the_process_group_on_every_exit(tmp_path):
    """Left to interpreter teardown, gloo's threads sometimes abort the process after main has returned (measured:
    1 of 8 refused two-rank runs exited 250 instead of 2, 0 of 16 with the groups destroyed). Whatever main
    returns, it leaves no process group behind: a refusal after torch.distributed is up, and a finished run."""
    probe = (
        "import sys, torch.distributed as dist; from glm53_ds.training.main import main; "
        "rc = main(sys.argv[1:]); print('exit', rc, 'initialized', dist.is_initialized())"
    )
    for args, rc in [(["--sp", "2"], 2), (["--train-iters", "1"], 0)]:
        proc = subprocess.run([sys.executable, "-c", probe, *args, "--output-dir", str(tmp_path / "out")],
                              capture_output=True, text=True, timeout=HANG_TIMEOUT, cwd=ROOT)  # fmt: skip
        assert f"exit {rc} initialized False" in proc.stdout, proc.stdout[-1000:] + proc.stderr[-2000:]


@pytest.mark.slow
def test_readme_main_job_command_lowers_loss(tmp_path):
    """README's main job as its first block gives it, after the install: `deepspeed launch/train.py` (tiny preset,
    shipped corpus)."""
    from tests.test_readme_commands import readme_commands

    assert readme_commands()[0].split(" && ")[-1] == "deepspeed launch/train.py"
    run_dir = os.path.join(ROOT, "runs", "tiny")  # the default output directory (git-ignored)
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        os.remove(os.path.join(run_dir, "metrics.jsonl"))
    proc = subprocess.run(["deepspeed", "launch/train.py"], capture_output=True, text=True, timeout=HANG_TIMEOUT, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = metrics(run_dir)
    assert len(records) == 60
    assert records[-1]["lm_loss"] < records[0]["lm_loss"] - 1.0
    # the experts stay in use: at the tiny preset's router-bias rate (1e-2) the max/mean expert load over the last
    # 20 steps averages 1.9; at DeepSeek-V3's 1e-3 routing collapses onto two experts (3.98 of a possible 4.0)
    late = [r["moe_imbalance"] for r in records[-20:]]
    assert sum(late) / len(late) < 3.0, late


def test_router_bias_rate_defaults_by_preset(tmp_path):
    from glm53_ds.training.args import build_parser
    from glm53_ds.training.option_checks import resolve_config
    from glm53_ds.training.presets import tiny

    (tmp_path / "config.json").write_text(json.dumps(tiny().to_text_dict()))
    (tmp_path / "wide.json").write_text(json.dumps(tiny().replace(hidden_size=48).to_text_dict()))

    def rate(*argv: str) -> float:
        return resolve_config(build_parser().parse_args(list(argv))).router_bias_update_rate

    # what a model of real width must be given (tests/training/test_config.py)
    REAL_WIDTH_RUN = ["--data", os.path.join(ROOT, "data", "tiny_corpus.txt"), "--seq-length", "4096",
                      "--micro-batch-size", "1", "--lr", "1e-5", "--train-iters", "10"]  # fmt: skip

    # the preset's rate follows the model, whichever route it came by (issue 25: tests/training/test_config.py)
    assert rate() == rate("--model-config", "tiny") == 1e-2
    assert (
        rate("--hf-dir", str(tmp_path), "--tokenizer", "bytes")
        == rate("--model-config", str(tmp_path / "config.json"))
        == 1e-2
    )
    assert (
        rate("--model-config", "glm-5.3-flash", *REAL_WIDTH_RUN)
        == rate("--model-config", str(tmp_path / "wide.json"))
        == 1e-3
    )
    assert rate("--router-bias-update-rate", "0") == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("source", ["hf-dir", "converted"])
def test_start_from_released_weights_under_ep2(tmp_path, source):
    """Each EP rank reads only its experts (from --hf-dir, or from `glm53-convert hf-to-native --ep 2` via
    --load); the first step's loss equals the single-process model's mean loss over the same global batch."""
    from glm53_ds.convert import hf_to_native
    from glm53_ds.training.data import ByteTokenizer, open_stream

    tiny_hf_checkpoint(tmp_path / "hf")
    if source == "hf-dir":
        start = ["--hf-dir", str(tmp_path / "hf"), "--tokenizer", "bytes"]
    else:
        start = ["--load", hf_to_native(str(tmp_path / "hf"), str(tmp_path / "native"), ep=2)]
    proc = deepspeed_run(2, *start, "--ep", "2", "--train-iters", "1", "--output-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logged = metrics(tmp_path / "run")[0]

    model = glm53_ds.load_hf(str(tmp_path / "hf")).eval()
    corpus = os.path.join(ROOT, "data", "tiny_corpus.txt")
    stream = open_stream(
        corpus, ByteTokenizer(), str(tmp_path / "c"), 64, 1234, model.glm.vocab_size, pack=False
    )
    losses = []
    with torch.no_grad():
        for rank in range(2):
            batch = stream.batch(0, 0, rank, 2, 2)
            parts = model(batch[:, :-1], labels=batch[:, :-1], next_tokens=batch[:, -1:], return_parts=True)
            losses.append(parts.lm.item())
    assert abs(logged["lm_loss"] - sum(losses) / 2) <= 1e-5 * logged["lm_loss"], (logged, losses)


@pytest.mark.slow
def test_jsonl_with_a_transformers_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted(set(open(os.path.join(ROOT, "data", "tiny_corpus.txt"), encoding="utf-8").read().split()))[
        :200
    ]
    vocab = {w: i for i, w in enumerate(["[UNK]", "[EOS]", "[PAD]", *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="[UNK]", eos_token="[EOS]", pad_token="[PAD]"
    ).save_pretrained(tmp_path / "tok")
    lines = [
        json.dumps({"text": line})
        for line in open(os.path.join(ROOT, "data", "tiny_corpus.txt")).read().split("\n\n")
    ]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines))
    proc = python_run("--data", str(tmp_path / "docs.jsonl"), "--tokenizer", str(tmp_path / "tok"), "--seq-length", "16",
                      "--train-iters", "2", "--output-dir", str(tmp_path / "run"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(metrics(tmp_path / "run")) == 2


@pytest.mark.slow
def test_resume_continues_at_the_consumed_samples_with_another_batch_size(tmp_path):
    """Before: the position was step x the current global batch: a run saved at step 3 with 4 samples per step and
    resumed with 2 re-read samples 6..11."""
    ck = tmp_path / "ck"
    common = [*QUICK[2:], "--save", str(ck), "--micro-batch-size", "2"]
    first = run(
        "--train-iters", "3", *common, "--global-batch-size", "4", "--output-dir", str(tmp_path / "a")
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert [r["consumed_samples"] for r in metrics(tmp_path / "a")] == [4, 8, 12]
    second = run("--train-iters", "5", *common, "--global-batch-size", "2", "--load", str(ck),
                 "--output-dir", str(tmp_path / "a"))  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    records = metrics(tmp_path / "a")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # a resumed run does not repeat rows
    assert [r["consumed_samples"] for r in records] == [4, 8, 12, 14, 16]
    # another seed changes the sample order: refused
    error = one_error(run("--train-iters", "6", *common, "--global-batch-size", "2", "--load", str(ck), "--seed", "9",
                          "--output-dir", str(tmp_path / "b")))  # fmt: skip
    assert "seed 9 here, 1234 in the checkpoint" in error


@pytest.mark.slow
def test_a_huge_learning_rate_stops_at_the_last_good_checkpoint(tmp_path):
    """The issue's run: --lr 1e9 --save-interval 1. Before: step 2's NaN update was applied, saved as step2 (83 NaN
    tensors), `latest` moved there and the stop named it. Now the step-2 update is refused, step1 stays latest, the
    stop names it, and step1 is whole and finite."""
    ck = tmp_path / "ck"
    proc = run(*QUICK[2:], "--train-iters", "4", "--lr", "1e9", "--save", str(ck), "--save-interval", "1",
               "--output-dir", str(tmp_path / "a"))  # fmt: skip
    assert proc.returncode == 3, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "gradient norm is nan at step 2" in errors[0], proc.stderr[-2000:]
    assert f"The last checkpoint this run saved is {ck / 'step1'}" in errors[0]
    assert (ck / "latest").read_text() == "step1" and not (ck / "step2").exists()
    from glm53_ds.convert.export_hf import load_native

    model = load_native(str(ck))  # step1: whole, verified, and finite
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.slow
def test_a_resume_on_another_corpus_is_refused(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("the quick brown fox jumps over the lazy dog " * 20)
    b.write_text("the lazy dog jumps over the quick brown fox " * 20)
    ck = tmp_path / "ck"
    proc = run(*QUICK, "--data", str(a), "--save", str(ck), "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    error = one_error(run(*QUICK[2:], "--train-iters", "3", "--data", str(b), "--load", str(ck), "--save", str(ck),
                          "--output-dir", str(tmp_path / "o")))  # fmt: skip
    assert "the data differs from the checkpoint's (fingerprint" in error, error


@pytest.mark.slow
@pytest.mark.parametrize("case", ["before the process group", "after it"])
def test_a_two_rank_refusal_is_reported_once(tmp_path, case):
    """Before: every rank printed the same refusal (two `error:` lines at two ranks)."""
    args = ["--seq-length", "0"] if case == "before the process group" else ["--ep", "3"]
    proc = deepspeed_run(2, *args, "--train-iters", "1", "--output-dir", str(tmp_path / "o"))
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error: " in line]
    assert len(errors) == 1, errors


@pytest.mark.slow
def test_a_resume_at_another_layout_keeps_the_global_batch(tmp_path):
    """Before: without --global-batch-size the batch came from the layout: an EP2 checkpoint (4 per step) resumed in
    one process trained with 2 (consumed 12 -> 14 -> 16; steps 4-5 off the uninterrupted curve). Now the
    checkpoint's batch is kept (16, 20; the uninterrupted losses within 1e-5); another one given on purpose is
    announced in one line."""
    ck = tmp_path / "ck"
    common = [*QUICK[2:], "--micro-batch-size", "2"]
    full = deepspeed_run(2, *common, "--ep", "2", "--train-iters", "5", "--save", str(ck), "--save-interval", "3",
                         "--output-dir", str(tmp_path / "full"))  # fmt: skip
    assert full.returncode == 0, full.stderr[-3000:]
    resumed = run(*common, "--train-iters", "5", "--load", str(ck), "--load-tag", "step3", "--output-dir",
                  str(tmp_path / "resumed"))  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ck / 'step3'}: step 3, 12 consumed samples, global batch 4" in resumed.stderr
    a, b = metrics(tmp_path / "full")[3:], metrics(tmp_path / "resumed")
    assert [r["consumed_samples"] for r in b] == [16, 20]
    for x, y in zip(a, b, strict=True):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]), (x, y)
    other = run(*common, "--train-iters", "4", "--load", str(ck), "--load-tag", "step3", "--global-batch-size", "2",
                "--output-dir", str(tmp_path / "other"))  # fmt: skip
    assert other.returncode == 0, other.stderr[-3000:]
    assert (
        "--global-batch-size 2: the checkpoint trained with 4 sequences per step; this run continues with 2"
        in (other.stderr)
    )
    assert [r["consumed_samples"] for r in metrics(tmp_path / "other")] == [14]


@pytest.mark.slow
def test_saves_resumes_and_names_are_said(tmp_path):
    """Before: no line for a save, a resume or an export; the console's `loss` was the LM loss while metrics.jsonl's
    `loss` is the total. Now each is one line with its path, and the log line uses metrics.jsonl's names."""
    ck = tmp_path / "ck"
    proc = run(*QUICK, "--save", str(ck), "--log-interval", "1", "--output-dir", str(tmp_path / "a"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"saved {ck / 'step2'} (step 2, 4 consumed samples)" in proc.stderr
    record = metrics(tmp_path / "a")[-1]
    final = next(line for line in proc.stdout.splitlines() if line.startswith("final: "))
    assert f"lm_loss {record['lm_loss']:.4f}" in final and f"loss {record['loss']:.4f}" in final
    assert f"mtp_loss {record['mtp_loss']:.4f}" in final


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_releases_the_lock_and_says_what_survived(tmp_path, sig):
    """Before: a scheduler's SIGTERM left the --save lock behind and said nothing; Ctrl-C printed two tracebacks
    and nothing about what survived. Now one `error:` line names the signal, the step and the last checkpoint, the
    lock is released, and the exit status is 128 + the signal."""
    import signal
    import subprocess
    import sys
    import time

    from glm53_ds.safe_io import LOCK_FILE
    from tests.cli import ROOT, TRAIN

    save = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, TRAIN, "--seq-length", "16", "--train-iters", "100000", "--save",
                             str(save), "--save-interval", "2", "--output-dir", str(tmp_path / "out")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.time() + 600
        while not (save / "latest").exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert (save / LOCK_FILE).exists()
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + getattr(signal, sig), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"stopped by {'SIGTERM' if sig == 'SIGTERM' else 'Ctrl-C'}" in errors[0], err[
        -2000:
    ]
    assert "The last checkpoint this run saved is" in errors[0] and str(save) in errors[0]
    assert not (save / LOCK_FILE).exists()


@pytest.mark.slow
def test_two_ranks_refuse_bad_input_once_before_deepspeed_starts(tmp_path):
    """Before: a missing --data was found after DeepSpeed's start and its op build (1-2.5 min on a fresh machine);
    a second job on the port of a first one hid the real error under a 30-line EADDRINUSE traceback; a rank
    waiting for rank 0 to print died of the launcher's SIGTERM with a traceback of its own. Now one `error:` line
    each, and the missing --data before DeepSpeed's op is even loaded."""
    import socket
    import subprocess

    from glm53_ds.parallel.state import free_port
    from tests.cli import ROOT, TRAIN, deepspeed_run

    missing = deepspeed_run(2, "--data", str(tmp_path / "nope.txt"), "--output-dir", str(tmp_path / "a"),
                            launcher=True)  # fmt: skip
    error = one_error(missing)
    assert "--data" in error and "nope.txt" in error and "Traceback" not in missing.stderr, missing.stderr[
        -3000:
    ]
    assert "deepspeed_shm_comm_op" not in missing.stdout + missing.stderr  # refused before DeepSpeed started

    port = free_port()
    with socket.socket() as taken:  # another job's rendezvous on that port
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", port))
        taken.listen()
        busy = subprocess.run(["deepspeed", "--num_gpus", "2", "--master_port", str(port), TRAIN, *QUICK,
                               "--output-dir", str(tmp_path / "b")], capture_output=True, text=True, cwd=ROOT,
                              timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    error = [line for line in busy.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and f"--master_port {port}: the port is in use" in error[0], busy.stderr[-3000:]
    assert "Traceback" not in busy.stderr, busy.stderr[-3000:]


def test_a_resume_with_another_schedule_says_so(tmp_path, capsys):
    """Before: a resume with another --train-iters bent the cosine schedule without a word (the learning rate at the
    resumed step jumps). Now one line names the changed options and the learning rate before and after; the
    same schedule says nothing (the control)."""
    from glm53_ds.engine import close_distributed
    from glm53_ds.training.trainer import Trainer
    from tests.cli import train_config

    common = [*QUICK[2:], "--micro-batch-size", "2", "--warmup", "1"]
    try:
        first = Trainer(train_config(*common, "--train-iters", "4", "--save", str(tmp_path / "ck"),
                                     "--save-interval", "2", "--output-dir", str(tmp_path / "a")))  # fmt: skip
        first.run()
        first.close()
        capsys.readouterr()
        for iters, said in (("4", False), ("10", True)):
            resumed = Trainer(train_config(*common, "--train-iters", iters, "--load", str(tmp_path / "ck"),
                                           "--load-tag", "step2", "--output-dir", str(tmp_path / f"b{iters}")))  # fmt: skip
            resumed.setup()
            resumed.close()
            err = capsys.readouterr().err
            line = [x for x in err.splitlines() if x.startswith("learning-rate schedule:")]
            assert bool(line) == said, err
        assert "--train-iters 4 -> 10" in line[0] and "at step 2 the learning rate is" in line[0]
    finally:
        close_distributed()


def test_a_global_batch_without_targets_skips_its_update(tmp_path, capsys):
    """Before: a global batch with zero target tokens still applied weight decay, Adam's moments and the router-bias
    update. Now the step is skipped (said once; its metrics record says `update_skipped`); the run goes on."""
    import dataclasses

    from glm53_ds.engine import close_distributed
    from glm53_ds.training.packing import IGNORE_INDEX
    from glm53_ds.training.trainer import Trainer
    from tests.cli import train_config

    trainer = Trainer(train_config(*QUICK[2:], "--train-iters", "3", "--micro-batch-size", "2",
                                   "--output-dir", str(tmp_path / "out")))  # fmt: skip
    try:
        trainer.setup()
        real = trainer.stream.micro_batch

        def no_targets_at_step_2(consumed, *args):  # the second global batch: every label ignored
            batch = real(consumed, *args)
            if consumed == 2:
                batch = dataclasses.replace(batch, labels=torch.full_like(batch.labels, IGNORE_INDEX),
                                            next_tokens=torch.full_like(batch.next_tokens, IGNORE_INDEX))  # fmt: skip
            return batch

        trainer.stream.micro_batch = no_targets_at_step_2
        weights = {}
        for step in range(3):
            record = trainer.train_step(step).as_record()
            weights[step] = {
                n: p.detach().clone() for n, p in trainer.engine.module.state_dict().items() if p is not None
            }
            assert record.get("update_skipped", False) == (step == 1), record
        assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])  # step 2 changed nothing
        assert not all(torch.equal(weights[1][n], weights[2][n]) for n in weights[1])  # step 3 did
        assert (
            "step 2: the global batch holds no target tokens; its update is skipped"
            in capsys.readouterr().err
        )
    finally:
        trainer.close()
        close_distributed()
