"""The trainer's configuration (training/config.py, args.py): bad input is one error line before any work, the model
and its defaults follow what the run loads, a --save holding another run's checkpoints is refused."""

from __future__ import annotations

import json
import os

import pytest

from tests.cli import QUICK, ROOT, metrics, one_error, run, train_config, write_hf_checkpoint


@pytest.mark.slow
def test_model_config_as_absolute_path_trains(tmp_path):
    """Before: the output dir became runs/<the config path> and the run died on 'Not a directory'."""
    from glm53_ds.training.presets import tiny

    config = tmp_path / "glm53_test_absolute_config.json"
    # another model than the tiny preset: its output directory is named after the file (the tiny preset's own
    # config would train into runs/tiny, since defaults follow the model)
    config.write_text(json.dumps(tiny().replace(hidden_size=48).to_text_dict()))
    out = os.path.join(ROOT, "runs", "glm53_test_absolute_config")
    assert not os.path.exists(out)
    try:
        proc = run(*QUICK, "--model-config", str(config))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert len(metrics(out)) == 2
    finally:
        import shutil

        shutil.rmtree(out, ignore_errors=True)  # created by this test's run


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seq-length", "0"], "--seq-length must be >= 1, got 0"),
        (["--global-batch-size", "0"], "--global-batch-size must be >= 1, got 0"),
        (["--lr", "-1"], "--lr must be a finite number >= 0, got -1.0"),
        (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
        (["BAD_JSONL"], "bad.jsonl:2: not a JSON line"),
        (["NO_HIDDEN_SIZE"], "does not give hidden_size"),
        (["DS_OPTIMIZER"], "has a section 'optimizer'; the trainer builds it from --lr / --weight-decay"),
        (["MISSING_TAG"], "no checkpoint there (tag 'step9' is missing)"),
    ],
)
@pytest.mark.slow
def test_bad_input_is_one_error_line_before_any_work(tmp_path, args, message):
    if args == ["BAD_JSONL"]:
        (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
        args = ["--data", str(tmp_path / "bad.jsonl")]
    elif args == ["NO_HIDDEN_SIZE"]:
        from glm53_ds.training.presets import tiny

        text = tiny().to_text_dict()
        del text["hidden_size"]
        (tmp_path / "c.json").write_text(json.dumps(text))
        args = ["--model-config", str(tmp_path / "c.json")]
    elif args == ["DS_OPTIMIZER"]:
        (tmp_path / "ds.json").write_text(json.dumps({"optimizer": {"type": "Adam", "params": {"lr": 1}}}))
        args = ["--deepspeed_config", str(tmp_path / "ds.json")]
    elif args == ["MISSING_TAG"]:
        (tmp_path / "ck").mkdir()
        (tmp_path / "ck" / "latest").write_text("step1")
        args = ["--load", str(tmp_path / "ck"), "--load-tag", "step9"]
    error = one_error(run(*QUICK, *args, "--output-dir", str(tmp_path / "out")))
    assert message in error, error


@pytest.mark.slow
def test_a_fresh_run_never_replaces_another_runs_checkpoints(tmp_path):
    """Before: a run without --load pointed at an existing --save replaced that run's step2 (rc 0, no word). Now it
    is refused before any work, naming the tags and the three ways on; resuming there, or --save-into-existing,
    still writes there. A fresh run into another run's --output-dir keeps that run's outputs whole."""
    ck = tmp_path / "ck"
    first = run(*QUICK, "--save", str(ck), "--output-dir", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr[-3000:]
    saved = (ck / "step2" / "manifest.json").read_text()
    first_metrics = (tmp_path / "a" / "metrics.jsonl").read_text()
    error = one_error(run(*QUICK, "--lr", "1e-2", "--save", str(ck), "--output-dir", str(tmp_path / "b")))
    assert f"--save '{ck}' already holds checkpoints (step2; latest: step2)" in error, error
    assert f"--load {ck}" in error and "--save-into-existing" in error
    assert (ck / "step2" / "manifest.json").read_text() == saved  # untouched
    assert not (tmp_path / "b" / "metrics.jsonl").exists()  # refused before any work
    # told to: it writes there (its own step2 replaces the other's); into the first run's --output-dir, whose
    # outputs it moves aside whole and says so (before: it emptied metrics.jsonl and replaced run.toml and loss.png)
    proc = run(
        *QUICK, "--lr", "1e-2", "--save", str(ck), "--save-into-existing", "--output-dir", str(tmp_path / "a")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (ck / "step2" / "manifest.json").read_text() != saved
    (kept,) = os.listdir(tmp_path / "a" / "previous-runs")
    assert (tmp_path / "a" / "previous-runs" / kept / "metrics.jsonl").read_text() == first_metrics
    assert "held an earlier run's outputs (run.toml, metrics.jsonl, loss.png): moved to" in proc.stderr
    assert (tmp_path / "a" / "metrics.jsonl").read_text() != first_metrics


@pytest.mark.parametrize(
    "entry",
    ["a directory step300", "a file step300", "a directory latest", "a file latest", "a pointer latest"],
)
def test_a_save_directory_holding_what_no_save_wrote_is_refused(tmp_path, entry):
    """Within --save a run writes `step<N>` tags (a re-save replaces one whole) and `latest` (rewritten by every
    save). Before: `--save /etc` trained, and an entry of those names that no save wrote (a user's step300, a
    `latest` that names no checkpoint of the directory) would be replaced. Now refused before any work, naming it; control: a --save
    holding a published tag, a pointer naming it and unrelated files passes the check (--save-into-existing: the
    tags may be replaced; the foreign entry is refused even so)."""
    from glm53_ds.training.errors import SetupError
    from glm53_ds.training.option_checks import check_save_is_this_runs

    ck = tmp_path / "ck"
    (ck / "step2").mkdir(parents=True)
    (ck / "step2" / "manifest.json").write_text("{}")
    (ck / "latest").write_text("step2")
    (ck / "README.md").write_text("my notes")
    check_save_is_this_runs(
        train_config("--save", str(ck), "--save-into-existing")
    )  # control: all of it a save's
    kind, name = entry.split()[1:]
    if name == "latest":
        (ck / "latest").unlink()
    if kind == "directory":
        (ck / name).mkdir()
    elif kind == "pointer":  # a plain name, but of no checkpoint here
        (ck / name).write_text("step9")
    else:
        (ck / name).write_text("the run on the other cluster\n")
    with pytest.raises(SetupError) as refused:
        check_save_is_this_runs(train_config("--save", str(ck), "--save-into-existing"))
    assert f"--save '{ck}' holds {name}, which no save wrote" in str(refused.value), refused.value
    assert "Move it, or give another --save" in str(refused.value)


def test_defaults_follow_the_model_not_the_route(tmp_path):
    """Before: the same tiny weights trained at router-bias rate 1e-2 into runs/tiny as a converted checkpoint and
    at 1e-3 into runs/hf by --hf-dir. Now both are the tiny preset's, and another model gets the general ones."""
    from glm53_ds.convert import hf_to_native
    from glm53_ds.training.presets import tiny

    _hf_dir_path = tmp_path / "hf"
    _hf_dir_path.mkdir()
    write_hf_checkpoint(_hf_dir_path, tiny())
    native = hf_to_native(str(_hf_dir_path), str(tmp_path / "native"))
    by_hf = train_config("--hf-dir", str(_hf_dir_path), "--tokenizer", "bytes")
    by_load = train_config("--load", native)
    for config in (by_hf, by_load):
        assert config.router_bias_update_rate == 1e-2 and config.output_dir == os.path.join("runs", "tiny")
    other = tmp_path / "wide"
    other.mkdir()
    write_hf_checkpoint(other, tiny().replace(hidden_size=48))
    wide = train_config("--hf-dir", str(other), "--tokenizer", "bytes")
    assert wide.router_bias_update_rate == 1e-3 and wide.output_dir == os.path.join("runs", "wide")


@pytest.mark.slow
def test_a_converted_checkpoint_trains_as_the_model_it_holds(tmp_path):
    """Before: `--load <converted>` built the tiny preset and refused any other model ("hidden_size: 48 in the
    checkpoint, 64 here"); with --model-config it then failed on missing mtp.0.* until --no-mtp. Now it builds the
    checkpoint's own model, with MTP only where the checkpoint holds its tensors, and says what it loaded."""
    from glm53_ds.convert import hf_to_native
    from glm53_ds.training.presets import tiny

    hf = tmp_path / "hf"
    hf.mkdir()
    write_hf_checkpoint(
        hf, tiny().replace(hidden_size=48), mtp=False
    )  # the config says 1 MTP layer, the weights have none
    native = hf_to_native(str(hf), str(tmp_path / "native"), ep=1)
    proc = run(*QUICK, "--load", native, "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded the weights of" in proc.stderr and "(fresh optimizer state, step 0" in proc.stderr
    assert all("mtp_loss" not in r for r in metrics(tmp_path / "o"))


@pytest.mark.slow
def test_a_missing_tokenizer_is_one_error_naming_the_option(tmp_path):
    """Before: a --hf-dir without tokenizer files failed inside transformers ("install sentencepiece")."""
    from glm53_ds.training.presets import tiny

    hf = tmp_path / "hf"
    hf.mkdir()
    write_hf_checkpoint(hf, tiny())
    error = one_error(run(*QUICK, "--hf-dir", str(hf), "--output-dir", str(tmp_path / "o")))
    assert f"--tokenizer '{hf}': no tokenizer there" in error and "--tokenizer bytes" in error, error


def test_a_real_width_model_never_takes_the_tiny_jobs_defaults(tmp_path):
    """Before: `--hf-dir <the released model>` without --seq-length / --lr / --train-iters / --data ran the tiny CPU
    job's 64-token rows at lr 3e-3 for 60 steps on the shipped 40 KB corpus, without a word. A model of real width
    now needs them given (one error naming each, and the recipes); a given --lr sets the decay's floor (it decayed
    upwards to the tiny job's 3e-4 before). Control: a toy model keeps the tiny defaults."""
    from glm53_ds.training.config import SetupError
    from glm53_ds.training.presets import preset

    released = tmp_path / "GLM-5.3-Flash"
    released.mkdir()
    (released / "config.json").write_text(json.dumps(preset("glm-5.3-flash").to_text_dict()))
    base = ["--hf-dir", str(released), "--tokenizer", "bytes", "--output-dir", str(tmp_path / "o")]
    with pytest.raises(SetupError) as caught:
        train_config(*base, "--lr", "1e-5")
    message = str(caught.value)
    assert message.startswith(f"--hf-dir {released} is a model of real width (glm-5.3-flash, hidden 4096): give "
                              "--data, --seq-length, --micro-batch-size, --train-iters (the defaults are the tiny "
                              "CPU job's: ")  # fmt: skip
    assert "--config recipes/" in message and "--lr," not in message
    given = ["--data", os.path.join(ROOT, "data", "tiny_corpus.txt"), "--seq-length", "8192", "--micro-batch-size",
             "1", "--train-iters", "100", "--lr", "1e-5"]  # fmt: skip
    config = train_config(*base, *given)
    assert config.lr == 1e-5 and config.min_lr == pytest.approx(1e-6)
    with pytest.raises(SetupError, match="--min-lr 0.001 is above --lr 1e-05"):
        train_config(*base, *given, "--min-lr", "1e-3")
    # the recipe's --model-config beside the weights: the same model, or one error naming the difference
    assert train_config(*base, *given, "--model-config", "glm-5.3-flash").hf_dir == str(released)
    with pytest.raises(SetupError, match=r"is not --model-config tiny: they differ in "):
        train_config(*base, *given, "--model-config", "tiny")
    # control: the tiny preset (and any toy) keeps the tiny job's defaults
    tiny = train_config("--output-dir", str(tmp_path / "t"))
    assert (tiny.seq_length, tiny.lr, tiny.min_lr, tiny.train_iters) == (64, 3e-3, 3e-4, 60)
