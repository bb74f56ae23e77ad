"""Writing outputs without losing anything (safe_io.py): output paths checked before any work, never deleting what
the run did not create, one writer per --save. Each test says what the old behaviour did (the control it would
have failed)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time

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


_WRITER_RECORD = """
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("safe_io", sys.argv[1])
safe_io = importlib.util.module_from_spec(spec); spec.loader.exec_module(safe_io)
print(json.dumps([os.getpid(), safe_io._process_start(os.getpid())]))
"""


def test_the_writer_lock_and_its_stale_rule(tmp_path):
    """One writer per directory: a running owner (this process) is refused; a killed run's file (a dead pid of this
    host, or a record left empty or half-written) is taken over; another host's record is refused; a release
    removes only the writer's own file. Before: an empty file (a writer killed before its record) was refused
    forever."""
    first = safe_io.DirectoryLock(str(tmp_path), "--save")
    assert first.acquire() is None
    with pytest.raises(
        safe_io.OutputPathError, match=rf"being written by another run \(host .*, pid {os.getpid()}"
    ):
        safe_io.DirectoryLock(str(tmp_path), "--save").acquire()
    lock_path = tmp_path / safe_io.LOCK_FILE
    owner = json.loads(lock_path.read_text())
    first.release()
    assert not lock_path.exists()
    # a killed run's record, with its start time as a run writes it: the pid may be reused by the time it is read
    # (a busy machine's threads take pids too), the start time then tells them apart
    dead = subprocess.run(
        [sys.executable, "-c", _WRITER_RECORD, safe_io.__file__], capture_output=True, text=True
    )
    pid, started = json.loads(dead.stdout)
    lock_path.write_text(json.dumps(dict(owner, pid=pid, started=started, run="x")))
    second = safe_io.DirectoryLock(str(tmp_path), "--save")
    notice = second.acquire()
    assert notice is not None and f"stale lock of pid {pid}" in notice
    assert json.loads(lock_path.read_text())["run"] == second.run_id
    second.release()
    # a record whose pid runs again as another process (here: this one, started at another time): taken over, and
    # said so (before: "no longer running", which the user could see was false); control: a gone pid says that
    lock_path.write_text(json.dumps(dict(owner, pid=os.getpid(), started="1", run="z")))
    reused = safe_io.DirectoryLock(str(tmp_path), "--save")
    said = reused.acquire()
    assert said is not None and "its pid now belongs to another process" in said, said
    reused.release()
    assert "no longer running" in notice and "another process" not in notice
    for left in ("", '{"host": "x", "pi'):  # a writer killed before or while writing its record
        lock_path.write_text(left)
        third = safe_io.DirectoryLock(str(tmp_path), "--save")
        third.acquire()
        assert json.loads(lock_path.read_text())["run"] == third.run_id
        third.release()
    lock_path.write_text(json.dumps(dict(owner, host="another-node", run="y")))
    with pytest.raises(safe_io.OutputPathError, match="host another-node"):
        safe_io.DirectoryLock(str(tmp_path), "--save").acquire()
    assert json.loads(lock_path.read_text())["run"] == "y"  # refused: left as it was
    # this host's record from before a reboot: its pid (this very process, running) means nothing now; control: the
    # same record of this boot is a live writer, refused
    assert owner["boot"] == safe_io._boot_id() is not None
    lock_path.write_text(json.dumps(dict(owner, pid=os.getpid(), run="b")))
    with pytest.raises(safe_io.OutputPathError, match=f"pid {os.getpid()}"):
        safe_io.DirectoryLock(str(tmp_path), "--save").acquire()
    lock_path.write_text(json.dumps(dict(owner, pid=os.getpid(), boot="an-earlier-boot", run="b")))
    after = safe_io.DirectoryLock(str(tmp_path), "--save")
    assert "this host has rebooted since" in (after.acquire() or "")
    after.release()


_CONTENDER = """
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("safe_io", sys.argv[1])
safe_io = importlib.util.module_from_spec(spec); spec.loader.exec_module(safe_io)
if sys.argv[4] == "no-lock":  # the control: the file's record without the kernel's lock
    import fcntl; fcntl.flock = lambda fd, op: None
time.sleep(max(0.0, float(sys.argv[3]) - time.time()))
try:
    safe_io.DirectoryLock(sys.argv[2], "--save").acquire()
except safe_io.OutputPathError:
    print("refused"); sys.exit(0)
print("won"); sys.stdout.flush(); time.sleep(0.5)  # holds it, then dies without releasing (a stale lock next)
"""


def _contend(tmp_path, rounds, contenders, mode):
    winners = []
    for _ in range(rounds):
        start = time.time() + 0.4
        procs = [subprocess.Popen([sys.executable, "-c", _CONTENDER, safe_io.__file__, str(tmp_path), str(start),
                                   mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(contenders)]  # fmt: skip
        outs = [p.communicate(timeout=60) for p in procs]
        assert all(p.returncode == 0 for p in procs), [err for _, err in outs]  # no crash
        winners.append(sum(out.strip() == "won" for out, _ in outs))
    return winners


@pytest.mark.slow
def test_concurrent_runs_over_a_stale_lock_have_exactly_one_winner(tmp_path):
    """Before: 4 processes over a stale lock: two or more held --save in 6 of 40 rounds, one crashed
    (FileNotFoundError). Now the kernel's flock decides: one winner a round, no crash; the control (the same
    processes without the flock) finds rounds with several winners."""
    assert _contend(tmp_path / "a", 8, 4, "flock") == [1] * 8
    assert max(_contend(tmp_path / "b", 4, 4, "no-lock")) > 1


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


# ----------------------------------------------------------------------------- a forced export, killed anywhere
class _Killed(BaseException):
    """A kill at one file-system step (not an Exception: nothing may catch it)."""


_KILL = {"at": None, "seen": 0}
_MUTATING = {"os.rename", "os.link", "os.remove", "os.rmdir", "os.mkdir", "os.chmod", "shutil.rmtree",
             "ctypes.call_function", "os.symlink", "os.truncate"}  # fmt: skip


def _kill_hook(event, args):
    if _KILL["at"] is None:
        return
    writes = (
        event == "open" and len(args) > 1 and isinstance(args[1], str) and any(c in args[1] for c in "wax+")
    )
    if event in _MUTATING or writes:
        if _KILL["seen"] == _KILL["at"]:
            _KILL["at"] = None
            raise _Killed(event)
        _KILL["seen"] += 1


sys.addaudithook(_kill_hook)  # audit hooks cannot be removed: inert while _KILL["at"] is None

OLD = {"adapter_config.json": '{"lora_alpha": 4}', "adapter_model.safetensors": "old weights"}
NEW = {"adapter_config.json": '{"lora_alpha": 16}', "adapter_model.safetensors": "new weights"}
USERS = {"notes.txt": "mine", "eval/scores.csv": "1,2"}  # what the user keeps in the export directory


def _tree(root):
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f)).read()
            for d, _, files in os.walk(root) for f in files}  # fmt: skip


def _write(root, files):
    for rel, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "w") as f:
            f.write(text)


def _old_publish_dir(tmp, final):
    """The publish loop before this fix: each new file replaced its namesake in place, one at a time."""
    for directory, _, files in os.walk(tmp):
        dest = os.path.normpath(os.path.join(final, os.path.relpath(directory, tmp)))
        for name in files:
            os.replace(os.path.join(directory, name), os.path.join(dest, name))
    shutil.rmtree(tmp)


def _killed_states(tmp_path, publish):
    """Kill `publish` of NEW over OLD + USERS at each of its file-system steps in turn; the export directory's
    content after each kill (None: no directory), and what the leftovers beside it hold."""
    states, k = [], 0
    while True:
        root = tmp_path / f"k{k}"
        final = root / "export"
        _write(final, {**OLD, **USERS})
        tmp = safe_io.new_temp_dir(str(final))
        _write(tmp, NEW)
        _KILL.update(at=k, seen=0)
        try:
            publish(tmp, str(final))
            done = True
        except _Killed:
            done = False
        _KILL["at"] = None
        beside = [_tree(root / n) for n in os.listdir(root) if n != "export"]
        states.append((_tree(final) if final.exists() else None, beside))
        if done:
            return states
        k += 1


def test_a_forced_export_is_the_old_or_the_whole_new_at_every_instant(tmp_path):
    """Before (`_old_publish_dir`): killed after its first rename, the export held the new weights beside the old
    config (alpha 4 over weights trained at 16), silently. Now, killed at any of its steps, the directory is the old
    export or the whole new one, the user's files always with it; after the last step, the new one."""
    states = _killed_states(tmp_path, safe_io.publish_dir)
    assert len(states) > 5  # the kill reached every step of the publish
    for content, _ in states:
        assert content in ({**OLD, **USERS}, {**NEW, **USERS}), content
    assert states[-1][0] == {**NEW, **USERS} and states[-1][1] == []  # done: nothing left beside


def test_the_old_publish_loop_leaves_a_mixture_control(tmp_path):
    """The control: the same kills over the old loop find a mixture (the check above can fail)."""
    states = _killed_states(tmp_path, _old_publish_dir)
    mixtures = [c for c, _ in states if c not in ({**OLD, **USERS}, {**NEW, **USERS})]
    assert {**USERS, **OLD, "adapter_model.safetensors": "new weights"} in mixtures


def test_without_an_atomic_exchange_the_old_export_survives_whole_beside(tmp_path, monkeypatch):
    """A file system without RENAME_EXCHANGE: two renames; a kill between them leaves no export but the old one
    whole beside it (never a mixture, never a loss)."""
    monkeypatch.setattr(safe_io, "exchange", lambda a, b: False)
    for content, beside in _killed_states(tmp_path, safe_io.publish_dir):
        if content is None:
            assert {**OLD, **USERS} in beside
        else:
            assert content in ({**OLD, **USERS}, {**NEW, **USERS}), content


def test_outputs_follow_the_umask(tmp_path):
    """Before: a staged export kept mkdtemp's 0700, unreadable to a serving user. Now a new output has the mode
    mkdir gives under the umask; a replaced one keeps its directory's mode."""
    old_mask = os.umask(0o022)
    try:
        with safe_io.staged_dir(str(tmp_path / "new")) as tmp:
            _write(tmp, NEW)
        assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o755
        assert stat.S_IMODE(os.stat(tmp_path / "new" / "adapter_config.json").st_mode) == 0o644
        os.chmod(tmp_path / "new", 0o750)
        with safe_io.staged_dir(str(tmp_path / "new")) as tmp:
            _write(tmp, NEW)
        assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o750
    finally:
        os.umask(old_mask)


def test_a_full_disk_is_said_in_words_and_the_staging_is_removed(tmp_path, monkeypatch):
    """Before: a save on a full disk ended in torch's `[enforce fail at inline_container.cc:672] unexpected pos`
    and left its half-written staging directory taking the space. Now one error names the directory and its free
    space, and the staging is gone; another failure passes through unchanged (the control)."""
    import errno as errno_

    staging = tmp_path / ".step4.tmp-1"
    staging.mkdir()
    (staging / "half").write_text("x")
    with pytest.raises(
        safe_io.DiskFull, match=rf"no space left on {tmp_path} \(\d+ MiB free\): the save of step4"
    ):
        with safe_io.disk_full_said(str(tmp_path), str(staging), "the save of step4"):
            raise OSError(errno_.ENOSPC, "No space left on device")
    assert not staging.exists()
    staging.mkdir()
    monkeypatch.setattr(
        safe_io.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12, 1000)
    )
    with pytest.raises(safe_io.DiskFull):  # torch's own words for it, with the disk full
        with safe_io.disk_full_said(str(tmp_path), str(staging), "the save of step4"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4416 vs 4310")
    monkeypatch.undo()
    staging.mkdir()
    with pytest.raises(
        RuntimeError, match="unexpected pos"
    ):  # space left: not a full disk, passed on as it is
        with safe_io.disk_full_said(str(tmp_path), str(staging), "the save of step4"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4416 vs 4310")
    assert staging.exists()


def test_weights_files_follow_the_umask(tmp_path):
    """Before: every safetensors file the project wrote (HF exports, PEFT adapters, checkpoints) was 0600 under umask
    022 (safetensors 0.8 creates its files so), unreadable to a serving user. Now each is 0644, as `open` gives.
    Control: safetensors' own writer still gives 0600 (the case this guards)."""
    import torch
    from safetensors.torch import save_file

    from glm53_ds.checkpoint import ShardWriter
    from glm53_ds.convert.export_adapter import write_peft_adapter

    old_mask = os.umask(0o022)
    try:
        tensors = {"w": torch.zeros(2, 2)}
        save_file(tensors, str(tmp_path / "raw.safetensors"))
        assert stat.S_IMODE(os.stat(tmp_path / "raw.safetensors").st_mode) == 0o600  # the control
        write_peft_adapter(str(tmp_path / "adapter"), tensors, {"r": 1})
        writer = ShardWriter(str(tmp_path / "shards"), "model")
        writer.add("w", tensors["w"])
        writer.close()
        written = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f != "raw.safetensors"]
        assert len([p for p in written if p.endswith(".safetensors")]) == 2
        assert {p: stat.S_IMODE(os.stat(p).st_mode) for p in written} == dict.fromkeys(written, 0o644)
    finally:
        os.umask(old_mask)
