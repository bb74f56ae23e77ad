"""Writing outputs without losing anything (safe_io.py): output paths checked before any work, never deleting what
the run did not create, one writer per --save. Each test says what the old behaviour did (the control it would
have failed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from glm53_ds import safe_io
from tests.cli import QUICK, one_error, run, tiny_hf_checkpoint


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
    tiny_hf_checkpoint_dir = tmp_path / "hf"
    tiny_hf_checkpoint_dir.mkdir()
    tiny_hf_checkpoint(tiny_hf_checkpoint_dir)
    before = sorted(os.listdir(tiny_hf_checkpoint_dir))
    (tmp_path / "repo" / ".git").mkdir(parents=True)
    paths = {"HF": str(tmp_path / "hf"), "HF/sub": str(tmp_path / "hf" / "sub"), "CK": str(tmp_path / "ck"),
             "REPO": str(tmp_path / "repo")}  # fmt: skip
    error = one_error(run(*QUICK, "--hf-dir", str(tmp_path / "hf"), "--tokenizer", "bytes", "--save",
                          str(tmp_path / "ck"), "--output-dir", str(tmp_path / "out"),
                          "--export-hf", paths.get(target, target), "--force"))  # fmt: skip
    assert message in error, error
    assert sorted(os.listdir(tiny_hf_checkpoint_dir)) == before


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


def test_the_writer_lock_and_its_stale_rule(tmp_path):
    """One writer per directory: a running owner (this process) is refused, a dead one on this host is taken over
    with a notice, another host's lock is refused; a lock is released only by its own writer."""
    first = safe_io.DirectoryLock(str(tmp_path), "--save")
    assert first.acquire() is None
    with pytest.raises(
        safe_io.OutputPathError, match=rf"being written by another run \(host .*, pid {os.getpid()}"
    ):
        safe_io.DirectoryLock(str(tmp_path), "--save").acquire()
    lock_path = tmp_path / safe_io.LOCK_FILE
    owner = json.loads(lock_path.read_text())
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    lock_path.write_text(
        json.dumps(dict(owner, pid=int(dead.stdout), started=None, run="x"))
    )  # a killed run's lock
    second = safe_io.DirectoryLock(str(tmp_path), "--save")
    notice = second.acquire()
    assert notice is not None and f"stale lock of pid {int(dead.stdout)}" in notice
    first.release()  # no longer its lock: left alone
    assert json.loads(lock_path.read_text())["run"] == second.run_id
    lock_path.write_text(json.dumps(dict(owner, host="another-node", run="y")))
    with pytest.raises(safe_io.OutputPathError, match="host another-node"):
        safe_io.DirectoryLock(str(tmp_path), "--save").acquire()
    lock_path.write_text(json.dumps(dict(owner, run=second.run_id)))
    second.release()
    assert not lock_path.exists()


@pytest.mark.slow
def test_a_second_writer_of_a_save_directory_is_refused(tmp_path):
    """Before: two concurrent runs on one --save interleaved their tags and moved `latest` backwards (both rc 0).
    Now the second is refused at set-up, naming the first run's lock (held here by this test process)."""
    lock = safe_io.DirectoryLock(str(tmp_path / "ck"), "--save")
    lock.acquire()
    try:
        error = one_error(run(*QUICK, "--save", str(tmp_path / "ck"), "--output-dir", str(tmp_path / "a")))
        assert "is being written by another run" in error and f"pid {os.getpid()}" in error, error
        assert os.listdir(tmp_path / "ck") == [safe_io.LOCK_FILE]
    finally:
        lock.release()
    proc = run(*QUICK, "--save", str(tmp_path / "ck"), "--output-dir", str(tmp_path / "a"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "ck" / safe_io.LOCK_FILE).exists()  # released at the end
