"""Runs on Hugging Face datasets, as a user starts them: a DatasetDict split trains the same steps as the same rows in
.jsonl, resumes bitwise, and a source changed since the checkpoint is refused; `python -m glm53_ds.data prepare`
builds the cache the run then reads; a `.json` of chat rows trains as chat, an unknown form is one error line
before start-up."""

from __future__ import annotations

import json
import os

import pytest

datasets = pytest.importorskip("datasets")

from tests.cli import ROOT, deepspeed_run, metrics, module_run, one_error, python_run  # noqa: E402

CHAT = os.path.join(ROOT, "data", "tiny_chat.jsonl")


def _dataset_dict(path, rows_file: str = CHAT, drop: int | None = None) -> str:
    datasets.disable_progress_bars()
    ds = datasets.load_dataset("json", data_files=rows_file, split="train", cache_dir=str(path) + ".hf")
    if drop is not None:
        ds = ds.select([i for i in range(len(ds)) if i != drop])
    datasets.DatasetDict(train=ds, test=ds.select(range(4))).save_to_disk(str(path))
    return str(path)


@pytest.mark.slow
def test_a_datasetdict_run_equals_jsonl_resumes_bitwise_and_refuses_changed_data(tmp_path):
    data = _dataset_dict(tmp_path / "dd") + ":train"
    common = [
        "--train-iters",
        "4",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--data-workers",
        "2",
    ]
    first = python_run("--data", data, *common, "--save-interval", "2", "--save", str(tmp_path / "ckpt"),
                       "--output-dir", str(tmp_path / "a"))  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    assert "a DatasetDict.save_to_disk folder; chat rows, 'messages' (role/content turns)" in first.stderr
    jsonl = python_run("--data", CHAT, *common, "--output-dir", str(tmp_path / "j"))
    assert jsonl.returncode == 0, jsonl.stderr[-3000:]
    keys = ("lm_loss", "grad_norm", "target_tokens")
    assert [[r[k] for k in keys] for r in metrics(tmp_path / "a")] == [
        [r[k] for k in keys] for r in metrics(tmp_path / "j")
    ]
    again = python_run("--data", data, *common, "--load", str(tmp_path / "ckpt"), "--load-tag", "step2",
                       "--output-dir", str(tmp_path / "b"))  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = metrics(tmp_path / "b")
    assert [r["step"] for r in resumed] == [3, 4]
    assert [[r[k] for k in keys] for r in resumed] == [
        [r[k] for k in keys] for r in metrics(tmp_path / "a")[2:]
    ]
    # two ranks build the same cache at once (rank 0 builds under the lock, rank 1 waits, both map it): the same steps
    two = deepspeed_run(2, "--data", data, *common, "--output-dir", str(tmp_path / "two"))
    assert two.returncode == 0, two.stderr[-3000:]
    got = [[r[k] for k in keys] for r in metrics(tmp_path / "two")]
    for mine, single in zip(got, [[r[k] for k in keys] for r in metrics(tmp_path / "a")], strict=True):
        assert mine[2] == single[2] and abs(mine[0] - single[0]) <= 1e-5 * single[0], (got, single)
    # the same folder, one row fewer: the checkpoint's data is gone
    changed = _dataset_dict(tmp_path / "dd2", drop=5)
    os.rename(tmp_path / "dd", tmp_path / "dd_old")
    os.rename(changed, tmp_path / "dd")
    refused = python_run("--data", data, *common, "--load", str(tmp_path / "ckpt"), "--load-tag", "step2",
                         "--output-dir", str(tmp_path / "c"))  # fmt: skip
    assert "the data differs from the checkpoint's" in one_error(refused)


def test_prepare_ahead_then_train_and_the_forms_said_before_start_up(tmp_path):
    rows = [json.loads(line) for line in open(CHAT, encoding="utf-8")]
    chat_json = tmp_path / "train.json"  # JSON Lines under .json, as Dataset.to_json writes it
    chat_json.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = tmp_path / "shared_cache"
    prepared = module_run("glm53_ds.data", "prepare", "--data", str(chat_json), "--data-cache", str(cache),
                          "--data-workers", "2")  # fmt: skip
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    assert "prepared --data" in prepared.stdout and "tokenising train.json" in prepared.stderr
    built = sorted(os.listdir(cache))
    run = python_run("--data", str(chat_json), "--data-cache", str(cache), "--train-iters", "2",
                     "--output-dir", str(tmp_path / "run"))  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "chat rows, 'messages'" in run.stderr and "tokenising" not in run.stderr  # read, not built again
    assert sorted(os.listdir(cache)) == built
    (tmp_path / "rows.xlsx").write_bytes(b"PK\x03\x04")
    error = one_error(python_run("--data", str(tmp_path / "rows.xlsx"), "--output-dir", str(tmp_path / "x")))
    assert (
        "error: --data" in error
        and "rows.xlsx': not a form --data reads; it takes" in error
        and ".parquet" in error
    )
    missing = one_error(python_run("--data", "nobody/absent-dataset", "--output-dir", str(tmp_path / "y")))
    assert "hf download --repo-type dataset nobody/absent-dataset" in missing
