"""Writing outputs without losing anything: path checks before any work, atomic files and directories, manifests.

Rules every writer of glm53_ds follows:
  - an output path is checked before any work (`check_output_dir`): never a git checkout's top, `.`, the home
    directory or `/`; never equal to, inside, or around an input or another output; an existing non-empty directory only with
    `force`; writable (probed next to it, nothing left behind);
  - nothing is ever removed that this run did not create: a directory is built under a fresh temporary name and
    renamed into place (`staged_dir`); into an existing directory (`force`) only its own files are moved, each
    replacing the file of the same name, everything else stays;
  - files are written to a temporary name, fsynced and renamed; directories are fsynced after a rename;
  - `write_manifest` / `verify_manifest`: every file of a checkpoint with its size and CRC-32, written last and
    checked before anything is read.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import socket
import tempfile
import time
import uuid
import zlib
from collections.abc import Iterator, Sequence

MANIFEST = "manifest.json"
_CHUNK = 16 * 1024 * 1024


class OutputPathError(ValueError):
    """An output path that would overwrite or delete something it must not; the message names the option."""


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(os.path.expanduser(path)))


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_output_dir(
    path: str,
    option: str,
    force: bool = False,
    inputs: dict[str, str | None] | None = None,
    outputs: dict[str, str | None] | None = None,
    may_exist: bool = False,
) -> None:
    """Refuse an output directory that would lose data; one `OutputPathError` naming `option` and the reason.

    `inputs` / `outputs`: other options' paths (None when not given) that the output may not equal, sit inside,
    or contain. `may_exist`: an existing directory is expected (a checkpoint directory that accumulates tags)."""
    target = _real(path)
    protected = {
        "/": "the file system root",
        _real("~"): "the home directory",
        _real("."): "the current directory",
    }
    if target in protected:
        raise OutputPathError(f"{option} {path!r} is {protected[target]}; give a directory of its own")
    if os.path.exists(os.path.join(target, ".git")):
        raise OutputPathError(f"{option} {path!r} is a git checkout; give a directory of its own")
    for other_option, other in {**(inputs or {}), **(outputs or {})}.items():
        if not other:
            continue
        o = _real(other)
        if _inside(target, o):
            raise OutputPathError(
                f"{option} {path!r} is {'equal to' if target == o else 'inside'} {other_option} {other!r}"
            )
        if _inside(o, target):
            raise OutputPathError(f"{option} {path!r} contains {other_option} {other!r}")
    if os.path.exists(target):
        if not os.path.isdir(target):
            raise OutputPathError(f"{option} {path!r} exists and is not a directory")
        if os.listdir(target) and not (force or may_exist):
            raise OutputPathError(
                f"{option} {path!r} exists and is not empty; refusing to overwrite (with --force only the files "
                "this run writes are replaced, nothing is deleted)"
            )
    probe_writable(target, option)


def probe_writable(target: str, option: str) -> None:
    """Create and remove a file in `target`, or in its nearest existing parent when it does not exist yet."""
    probe_dir = target
    while not os.path.isdir(probe_dir):
        if os.path.exists(probe_dir):
            raise OutputPathError(f"{option} {target!r}: cannot write there ({probe_dir!r} is a file)")
        parent = os.path.dirname(probe_dir)
        if parent == probe_dir:
            break
        probe_dir = parent
    try:
        fd, probe = tempfile.mkstemp(prefix=".glm53-write-probe-", dir=probe_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OutputPathError(f"{option} {target!r}: cannot write in {probe_dir!r} ({e.strerror})") from e


def fsync_path(path: str) -> None:
    """Flush a file's data, or a directory's entries (after a rename in it), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    """`path` holds `text` completely or keeps what it held: temp file, fsync, rename, fsync the directory."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def new_temp_dir(final: str) -> str:
    """A fresh, empty directory beside `final` (same file system, so a rename moves it into place)."""
    parent = os.path.dirname(_real(final))
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(_real(final))}.tmp-", dir=parent)


def publish_dir(tmp: str, final: str) -> None:
    """Move the finished `tmp` to `final`: a rename when `final` does not exist (or is empty); else each file of
    `tmp` replaces its namesake in `final`, and nothing else in `final` is touched. `tmp` is gone afterwards."""
    for directory, _, files in os.walk(tmp):
        for name in files:
            fsync_path(os.path.join(directory, name))
        fsync_path(directory)
    if os.path.isdir(final) and not os.listdir(final):
        os.rmdir(final)  # empty: nothing to lose
    if not os.path.exists(final):
        os.replace(tmp, final)
    else:
        for directory, _, files in os.walk(tmp):
            rel = os.path.relpath(directory, tmp)
            dest_dir = os.path.normpath(os.path.join(final, rel))
            os.makedirs(dest_dir, exist_ok=True)
            for name in files:
                os.replace(os.path.join(directory, name), os.path.join(dest_dir, name))
            fsync_path(dest_dir)
        shutil.rmtree(tmp)
    fsync_path(os.path.dirname(_real(final)))


@contextlib.contextmanager
def staged_dir(final: str) -> Iterator[str]:
    """Build a directory under a temporary name; published to `final` on success, removed on failure."""
    tmp = new_temp_dir(final)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # created by this run
        raise
    publish_dir(tmp, final)


# ----------------------------------------------------------------------------- one writer per directory
LOCK_FILE = ".glm53-writer.lock"


def _process_start(pid: int) -> str | None:
    """The kernel's start time of process `pid` (Linux /proc), so that a reused pid is not taken for the writer."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _running(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return started is None or _process_start(pid) in (None, started)


class DirectoryLock:
    """An exclusive writer's lock on a directory: `<dir>/.glm53-writer.lock`, created with O_EXCL, holding the
    writer's host, pid, process start time and a run id.

    Stale-lock rule: a lock written on this host by a process that no longer runs (its pid gone, or reused by a
    process that started later) is taken over, with a notice; a lock of another host, or of a running process, is
    refused with its owner named (remove the file by hand once that run is known to be gone). `release` removes the
    file only while it is still this writer's."""

    def __init__(self, directory: str, option: str) -> None:
        self.directory, self.option = directory, option
        self.path = os.path.join(directory, LOCK_FILE)
        self.run_id = uuid.uuid4().hex
        self.held = False

    def _owner(self) -> dict[str, object]:
        try:
            with open(self.path, encoding="utf-8") as f:
                owner = json.load(f)
            return owner if isinstance(owner, dict) else {}
        except (OSError, ValueError):
            return {}

    def acquire(self) -> str | None:
        """Take the lock or raise `OutputPathError` naming its owner; returns a notice when a stale lock was
        taken over (else None)."""
        os.makedirs(self.directory, exist_ok=True)
        me = dict(host=socket.gethostname(), pid=os.getpid(), started=_process_start(os.getpid()),
                  run=self.run_id, since=time.strftime("%Y-%m-%d %H:%M:%S"))  # fmt: skip
        notice = None
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                pid = owner.get("pid")
                stale = owner.get("host") == me["host"] and isinstance(pid, int) and not _running(pid, owner.get("started"))  # type: ignore[arg-type]  # fmt: skip
                if not stale:
                    who = f"host {owner.get('host', '?')}, pid {owner.get('pid', '?')}, since {owner.get('since', '?')}"
                    raise OutputPathError(
                        f"{self.option} {self.directory!r} is being written by another run ({who}: {self.path}); "
                        "two runs would interleave their checkpoints. If that run is gone, remove the lock file"
                    ) from None
                os.unlink(self.path)
                notice = (f"{self.option}: took over the stale lock of pid {pid} on {me['host']} (no longer "
                          f"running): {self.path}")  # fmt: skip
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(me, f)
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            return notice
        raise OutputPathError(f"{self.option} {self.directory!r}: could not take the lock {self.path}")

    def release(self) -> None:
        if self.held and self._owner().get("run") == self.run_id:
            os.unlink(self.path)
        self.held = False


# ----------------------------------------------------------------------------- manifests
def file_crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def list_files(root: str) -> list[str]:
    """Every file under `root`, relative, sorted (the manifest itself excluded)."""
    out = []
    for directory, _, files in os.walk(root):
        for name in files:
            rel = os.path.relpath(os.path.join(directory, name), root)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def describe_files(root: str, names: Sequence[str]) -> dict[str, dict[str, object]]:
    return {
        n: {"size": os.path.getsize(os.path.join(root, n)), "crc32": file_crc32(os.path.join(root, n))}
        for n in names
    }


def write_manifest(root: str, entries: dict[str, dict[str, object]]) -> None:
    atomic_write_text(
        os.path.join(root, MANIFEST), json.dumps({"files": dict(sorted(entries.items()))}, indent=1)
    )


def read_manifest(root: str) -> dict[str, dict[str, object]]:
    path = os.path.join(root, MANIFEST)
    if not os.path.isfile(path):
        raise ValueError(f"{root}: no {MANIFEST}: not a complete glm53_ds checkpoint (an interrupted save, or "
                         "written by another tool)")  # fmt: skip
    try:
        with open(path, encoding="utf-8") as f:
            files = json.load(f)["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not an object")
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a glm53_ds manifest ({type(e).__name__}: {e})") from e
    outside = [n for n in files if not _confined(n)]
    if outside:
        raise ValueError(f"{path}: lists {outside[0]!r}, a path outside the checkpoint directory")
    return dict(files)


def _confined(name: str) -> bool:
    """A relative path that stays inside its directory (no absolute path, no `..` component)."""
    parts = name.replace(os.sep, "/").split("/")
    return bool(name) and not os.path.isabs(name) and ".." not in parts and "" not in parts


def verify_files(root: str, manifest: dict[str, dict[str, object]], names: Sequence[str]) -> list[str]:
    """Problems with `names` (a share of the manifest's files): missing, wrong size, wrong checksum. The checksums
    run on a few threads (zlib and file reads release the GIL), in the order of `names`."""

    def problem(name: str) -> str | None:
        want = manifest[name]
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if os.path.getsize(path) != want["size"]:
            return f"{name} has {os.path.getsize(path)} bytes, the manifest says {want['size']}"
        if file_crc32(path) != want["crc32"]:
            return f"{name} does not match its checksum"
        return None

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, max(1, len(names)))) as pool:
        return [p for p in pool.map(problem, names) if p is not None]


def published_tags(directory: str) -> list[str]:
    """The checkpoints a directory holds: its sub-directories with a manifest (a published tag), sorted."""
    if not os.path.isdir(directory):
        return []
    return sorted(n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n, MANIFEST)))


def unlisted_files(root: str, manifest: dict[str, dict[str, object]]) -> list[str]:
    return [n for n in list_files(root) if n not in manifest]
