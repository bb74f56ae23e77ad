"""Nothing lost, nothing executed (issue 12): output paths checked before any work, checkpoints replaced whole and
verified against their manifest, pickles never run, a memory-mapped dataset, the data position as consumed samples,
converter refusals. Each test says what the old behaviour did (the control it would have failed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from glm53_ds import safe_io
from tests.test_train import DIE_DURING_SAVE, HANG_TIMEOUT, ROOT, TRAIN, _tiny_hf_checkpoint, metrics

QUICK = ["--train-iters", "2", "--seq-length", "16"]


def run(*args: str, script: str = TRAIN, timeout: int = HANG_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip


def one_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout[-1500:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


# ----------------------------------------------------------------------------- output paths
@pytest.mark.slow
def test_export_target_with_files_is_refused_and_nothing_deleted(tmp_path):
    """Before: `--export-hf keep` trained, then `rmtree(keep)` (notes.txt gone, rc 0)."""
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "notes.txt").write_text("x")
    error = one_error(run(*QUICK, "--output-dir", str(tmp_path / "out"), "--export-hf", str(keep)))
    assert "--export-hf" in error and "exists and is not empty" in error
    assert (keep / "notes.txt").read_text() == "x"
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # refused before any work


@pytest.mark.parametrize(
    "target, message",
    [
        (".", "is the current directory"),
        ("HF", "is equal to --hf-dir"),
        ("HF/sub", "is inside --hf-dir"),
        ("CK", "is equal to --save"),
        ("REPO", "is a git checkout"),
    ],
)
@pytest.mark.slow
def test_export_targets_that_would_overwrite_inputs_are_refused(tmp_path, target, message):
    _tiny_hf_checkpoint_dir = tmp_path / "hf"
    _tiny_hf_checkpoint_dir.mkdir()
    _tiny_hf_checkpoint(_tiny_hf_checkpoint_dir)
    before = sorted(os.listdir(_tiny_hf_checkpoint_dir))
    (tmp_path / "repo" / ".git").mkdir(parents=True)
    paths = {"HF": str(tmp_path / "hf"), "HF/sub": str(tmp_path / "hf" / "sub"), "CK": str(tmp_path / "ck"),
             "REPO": str(tmp_path / "repo")}  # fmt: skip
    error = one_error(run(*QUICK, "--hf-dir", str(tmp_path / "hf"), "--tokenizer", "bytes", "--save",
                          str(tmp_path / "ck"), "--output-dir", str(tmp_path / "out"),
                          "--export-hf", paths.get(target, target), "--force"))  # fmt: skip
    assert message in error, error
    assert sorted(os.listdir(_tiny_hf_checkpoint_dir)) == before


@pytest.mark.slow
@pytest.mark.parametrize("option", ["--save", "--export-hf"])
def test_unwritable_outputs_are_refused_before_training(tmp_path, option):
    """Before: an unwritable --save failed at the first save, an unwritable --export-hf after the last step."""
    (tmp_path / "a_file").write_text("")
    error = one_error(
        run(*QUICK, "--output-dir", str(tmp_path / "out"), option, str(tmp_path / "a_file" / "sub"))
    )
    assert option in error and "cannot write there" in error and "is a file" in error
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_output_paths_probe_and_never_delete(tmp_path):
    """safe_io directly: the probe leaves nothing, a forced publish replaces only its own files."""
    target = tmp_path / "t"
    target.mkdir()
    (target / "mine.txt").write_text("old")
    (target / "other.txt").write_text("keep")
    with pytest.raises(safe_io.OutputPathError, match="exists and is not empty"):
        safe_io.check_output_dir(str(target), "--out")
    safe_io.check_output_dir(str(target), "--out", force=True)
    assert sorted(os.listdir(target)) == ["mine.txt", "other.txt"]  # the probe left nothing
    with safe_io.staged_dir(str(target)) as tmp:
        open(os.path.join(tmp, "mine.txt"), "w").write("new")
    assert (target / "mine.txt").read_text() == "new" and (target / "other.txt").read_text() == "keep"
    with pytest.raises(RuntimeError), safe_io.staged_dir(str(tmp_path / "fresh")) as tmp:
        open(os.path.join(tmp, "half.txt"), "w").write("half")
        raise RuntimeError("failed halfway")
    assert sorted(os.listdir(tmp_path)) == ["t"]  # the failed output and its temporary directory are gone


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


# ----------------------------------------------------------------------------- checkpoints
def _manifest(tag_dir) -> dict:
    return json.loads((tag_dir / "manifest.json").read_text())


@pytest.mark.slow
def test_a_resave_killed_midway_keeps_the_old_tag_whole(tmp_path):
    """Before: a re-save wrote into <tag>/ in place; killed midway it left run 2's replicated tensors beside run 1's
    experts, and --load accepted the mix (rc 0). Now the old tag stays byte for byte, verified, and loads."""
    ck, common = tmp_path / "ck", [*QUICK[2:], "--save", str(tmp_path / "ck"), "--save-interval", "2"]
    assert run("--train-iters", "4", *common, "--output-dir", str(tmp_path / "a")).returncode == 0
    saved = _manifest(ck / "step4")
    # run 2: resume from step 2 with another learning rate; killed while re-saving step4
    proc = run("--die-during-save", "step4", "--train-iters", "4", *common, "--load", str(ck), "--load-tag", "step2",
               "--lr", "1e-2", "--output-dir", str(tmp_path / "b"), script=DIE_DURING_SAVE)  # fmt: skip
    assert proc.returncode == 17, proc.stderr[-3000:]
    assert _manifest(ck / "step4") == saved
    assert safe_io.verify_files(str(ck / "step4"), saved["files"], sorted(saved["files"])) == []
    assert (ck / "latest").read_text() == "step4"  # run 1's, untouched
    assert any(
        n.startswith(".step4.tmp-") for n in os.listdir(ck)
    )  # the killed save's staging, never published
    proc = run("--train-iters", "5", *common, "--load", str(ck), "--output-dir", str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in metrics(tmp_path / "c")] == [5]


class _Marker:
    """Unpickling this runs `open(path, 'w')`: what a malicious checkpoint would do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.path, "w"))


@pytest.mark.slow
def test_a_pickle_in_a_checkpoint_is_refused_and_never_runs(tmp_path):
    """Before: DeepSpeed read mp_rank_00_model_states.pt with weights_only=False and ran the object (rc 0)."""
    ck = tmp_path / "ck"
    assert run(*QUICK, "--save", str(ck), "--output-dir", str(tmp_path / "a")).returncode == 0
    tag = ck / "step2"
    marker = tmp_path / "marker"
    state = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=True)
    state["payload"] = _Marker(str(marker))
    torch.save(
        state, tag / "mp_rank_00_model_states.pt"
    )  # the object's __reduce__ runs open() when unpickled
    # 1. the manifest no longer matches: refused before anything is read
    error = one_error(
        run(*QUICK, "--train-iters", "3", "--load", str(ck), "--output-dir", str(tmp_path / "b"))
    )
    assert "is damaged or incomplete: mp_rank_00_model_states.pt has" in error  # its size differs
    # 2. the manifest rewritten too (an attacker who knows the format): weights_only refuses the object
    safe_io.write_manifest(
        str(tag), _manifest(tag)["files"] | safe_io.describe_files(str(tag), ["mp_rank_00_model_states.pt"])
    )
    error = one_error(
        run(*QUICK, "--train-iters", "3", "--load", str(ck), "--output-dir", str(tmp_path / "c"))
    )
    assert "refused to load a checkpoint file holding pickled objects" in error
    assert not marker.exists()
    torch.load(
        tag / "mp_rank_00_model_states.pt", weights_only=False
    )  # control: what DeepSpeed's own load did
    assert marker.exists()


# ----------------------------------------------------------------------------- data
def _indexed(prefix: str, tokens: int, vocab: int = 250) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    per_doc = min(tokens, 1 << 20)
    for start in range(0, tokens, per_doc):
        ids = torch.from_numpy(rng.integers(1, vocab, min(per_doc, tokens - start), dtype=np.int64))
        builder.add_document(ids, [ids.numel()])
    builder.finalize(prefix + ".idx")
    return prefix


def _peak_rss_mb(*args: str) -> float:
    code = ("import resource, sys; sys.path.insert(0, 'launch'); from glm53_ds.training.trainer import main; "
            f"rc = main({list(args)!r}); assert rc == 0, rc; "
            "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=HANG_TIMEOUT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return float(proc.stdout.split("PEAK")[-1])


@pytest.mark.slow
def test_rank_memory_does_not_grow_with_the_corpus(tmp_path):
    """Before: SampleStream concatenated every document into one int64 array (+574 MB RSS for 50M tokens)."""
    small = _indexed(str(tmp_path / "small"), 20_000)
    large = _indexed(str(tmp_path / "large"), 50_000_000)
    common = [*QUICK, "--output-dir", str(tmp_path / "out")]
    peak_small = _peak_rss_mb(*common, "--data", small)
    peak_large = _peak_rss_mb(*common, "--data", large)
    assert peak_large - peak_small < 100, (peak_small, peak_large)


def test_a_global_batch_is_the_same_samples_at_any_world_size(tmp_path):
    from glm53_ds.training.data import SampleStream

    stream = SampleStream(_indexed(str(tmp_path / "d"), 5_000), 16, 7, 258)

    def global_batch(consumed: int, world: int, micro_batch: int, gas: int) -> list[list[int]]:
        rows = [stream.batch(consumed, m, r, world, micro_batch) for m in range(gas) for r in range(world)]
        return sorted(torch.cat(rows).tolist())

    assert global_batch(12, world=2, micro_batch=2, gas=1) == global_batch(12, world=1, micro_batch=2, gas=2)
    assert global_batch(12, 1, 4, 1) != global_batch(8, 1, 4, 1)


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


# ----------------------------------------------------------------------------- refusals
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


# ----------------------------------------------------------------------------- converter
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    _tiny_hf_checkpoint(path)
    return path


def test_verify_compares_both_tensor_sets(hf_dir, tmp_path):
    """Before: verify walked the native tensors only: an extra HF tensor or a native copy without MTP passed."""
    import shutil

    from safetensors.torch import load_file, save_file

    from glm53_ds.convert import hf_to_native, verify

    native = hf_to_native(str(hf_dir), str(tmp_path / "native"))
    assert verify(str(hf_dir), native, out=lambda *a: None) == 0.0
    # an extra text tensor in the HF directory
    extra = tmp_path / "extra"
    shutil.copytree(hf_dir, extra)
    shard = sorted(extra.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    tensors["model.language_model.layers.1.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, shard, metadata={"format": "pt"})
    index = json.loads((extra / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.language_model.layers.1.self_attn.extra.weight"] = shard.name
    (extra / "model.safetensors.index.json").write_text(json.dumps(index))
    rows: list[str] = []
    assert verify(str(extra), native, out=rows.append) == float("inf")
    assert any("extra.weight" in r and "only in HF" in r for r in rows)
    # a native checkpoint without its MTP layer
    stripped = tmp_path / "stripped"
    shutil.copytree(hf_dir, stripped)
    for shard in stripped.glob("*.safetensors"):
        tensors = {k: v for k, v in load_file(shard).items() if ".layers.4." not in k}  # tiny: 4 layers + MTP
        save_file(tensors, shard, metadata={"format": "pt"})
    index = json.loads((stripped / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if ".layers.4." not in k}
    (stripped / "model.safetensors.index.json").write_text(json.dumps(index))
    no_mtp = hf_to_native(str(stripped), str(tmp_path / "no_mtp"))
    rows = []
    assert verify(str(hf_dir), no_mtp, out=rows.append) == float("inf")
    assert any(".layers.4." in r and "only in HF" in r for r in rows)


def test_a_template_of_another_model_is_refused(hf_dir, tmp_path):
    """Before: any --hf-template was taken (rc 0, an export transformers could not load)."""
    from glm53_ds.convert import hf_to_native, native_to_hf
    from glm53_ds.convert.import_hf import ConversionError

    native = hf_to_native(str(hf_dir), str(tmp_path / "native"))
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((hf_dir / "config.json").read_text())
    config["text_config"]["intermediate_size"] = 256
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConversionError, match=r"another model .* intermediate_size: checkpoint 128, template 256"
    ):
        native_to_hf(native, str(tmp_path / "out"), hf_template=str(other))
    assert not (tmp_path / "out").exists()


def test_a_failed_conversion_leaves_no_temporary_directory(hf_dir, tmp_path, monkeypatch):
    """Before: each failure left `<out>.tmp<pid>/` with the shards written so far."""
    from glm53_ds.checkpoint import ShardWriter
    from glm53_ds.convert import hf_to_native

    calls = {"n": 0}
    real_add = ShardWriter.add

    def failing_add(self, key, tensor):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk full")
        return real_add(self, key, tensor)

    monkeypatch.setattr(ShardWriter, "add", failing_add)
    (tmp_path / "unrelated").mkdir()
    with pytest.raises(OSError, match="disk full"):
        hf_to_native(str(hf_dir), str(tmp_path / "native"))
    assert sorted(os.listdir(tmp_path)) == ["unrelated"]


@pytest.mark.slow
def test_export_carries_the_tokenizer_files(hf_dir, tmp_path):
    source = tmp_path / "hf"
    import shutil

    shutil.copytree(hf_dir, source)
    (source / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (source / "generation_config.json").write_text('{"do_sample": false}')
    proc = run(*QUICK[:2], "--hf-dir", str(source), "--tokenizer", "bytes", "--output-dir", str(tmp_path / "out"),
               "--export-hf", str(tmp_path / "export"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # --hf-dir's generation settings travel; the tokenizer is the one the run trained with (here the byte tokenizer,
    # written as a real one: tests/test_user_intent.py), not --hf-dir's placeholder
    gen = "generation_config.json"
    assert (tmp_path / "export" / gen).read_text() == (source / gen).read_text()
    assert (
        json.loads((tmp_path / "export" / "tokenizer_config.json").read_text())["eos_token"]
        == "<|endoftext|>"
    )
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]  # the export's work directory is gone
