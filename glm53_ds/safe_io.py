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
import ctypes
import errno
import fcntl
import json
import os
import shutil
import socket
import stat
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
    within: dict[str, str | None] | None = None,
) -> None:
    """Refuse an output directory that would lose data; one `OutputPathError` naming `option` and the reason.

    `inputs` / `outputs`: other options' paths (None when not given) that the output may not equal, sit inside,
    or contain. `within`: other outputs it may sit inside (an export in the run's output directory), but not equal
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
    for other_option, other in (within or {}).items():
        if other and _inside(_real(other), target):
            o = _real(other)
            raise OutputPathError(
                f"{option} {path!r} {'is' if o == target else 'contains'} {other_option} {other!r}; an export may "
                f"sit inside {other_option} (e.g. {os.path.join(other, 'hf')}), not be it or hold it"
            )
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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_safetensors(tensors: dict, path: str, metadata: dict[str, str] | None = None) -> None:
    """`safetensors.torch.save_file`, the file then given the mode a plain `open` gives under the umask: safetensors
    0.8 creates its files 0600, which left every export, adapter and checkpoint unreadable to the serving user."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())


def new_temp_dir(final: str) -> str:
    """A fresh, empty directory beside `final` (same file system, so a rename moves it into place), with the mode a
    plain `mkdir` gives under the umask (`mkdtemp`'s 0700 would leave an export unreadable to its serving user)."""
    parent = os.path.dirname(_real(final))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(_real(final))}.tmp-", dir=parent)
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange(a: str, b: str) -> bool:
    """Swap two existing paths in one atomic step (Linux `renameat2(RENAME_EXCHANGE)`); False where the system or
    the file system cannot (then nothing moved)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), a)


def swap_in(new: str, final: str) -> str:
    """Put the finished directory `new` at the existing `final`; returns where the old `final` now is (the caller
    removes it). One atomic exchange where the file system has it: `final` is the old directory or the new one at
    every instant. Elsewhere two renames (old aside, new in): a kill between them leaves the old one whole beside,
    under the returned name."""
    if exchange(new, final):
        return new
    aside = f"{new}.old"
    os.rename(final, aside)
    os.rename(new, final)
    return aside


def _fsync_tree(root: str) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            if not os.path.islink(os.path.join(directory, name)):
                fsync_path(os.path.join(directory, name))
        fsync_path(directory)


def _keep_entries(old: str, new: str) -> None:
    """Everything of `old` that `new` does not replace, linked (a copy where links fail) into `new` at the same
    relative path: files the user keeps in an export directory survive it being replaced whole."""
    for directory, dirs, files in os.walk(old):
        rel = os.path.relpath(directory, old)
        dest = os.path.normpath(os.path.join(new, rel))
        if os.path.lexists(dest) and not os.path.isdir(dest):
            raise OutputPathError(
                f"{os.path.join(old, rel)!r} is a directory where the new output has a file"
            )
        os.makedirs(dest, exist_ok=True)
        entries = files + [d for d in dirs if os.path.islink(os.path.join(directory, d))]
        for name in entries:
            src, dst = os.path.join(directory, name), os.path.join(dest, name)
            if os.path.lexists(dst):
                if os.path.isdir(dst) and not os.path.islink(dst):
                    raise OutputPathError(f"{src!r} is a file where the new output has a directory")
                continue  # replaced by the new output
            try:
                os.link(src, dst, follow_symlinks=False)
            except OSError:
                shutil.copy2(src, dst, follow_symlinks=False)


def publish_dir(tmp: str, final: str) -> None:
    """Move the finished `tmp` to `final`. A rename when `final` does not exist (or is empty). Over an existing
    `final` (`--force`): what `final` holds that `tmp` does not replace is linked into `tmp`, then the two are
    exchanged in one step (`swap_in`) and the old one removed, so `final` is the old output or the whole new one at
    every instant, and nothing the user kept there is lost. `tmp` is gone afterwards."""
    final = _real(final)  # a symlinked target: the directory it names
    _fsync_tree(tmp)
    if os.path.isdir(final) and not os.listdir(final):
        os.rmdir(final)  # empty: nothing to lose
    if not os.path.exists(final):
        os.replace(tmp, final)
    else:
        _keep_entries(final, tmp)
        _fsync_tree(tmp)
        os.chmod(tmp, stat.S_IMODE(os.stat(final).st_mode))  # the directory keeps its mode
        shutil.rmtree(swap_in(tmp, final))
    fsync_path(os.path.dirname(final))


def remove_dir(path: str) -> None:
    """Remove a directory this run wrote, whole or not at all to a reader: renamed aside to a hidden name first
    (one atomic step: it is no longer at `path`), then deleted; a kill in between leaves only the hidden name."""
    aside = os.path.join(
        os.path.dirname(_real(path)), f".{os.path.basename(_real(path))}.removing-{uuid.uuid4().hex[:8]}"
    )
    os.rename(path, aside)
    fsync_path(os.path.dirname(aside))
    shutil.rmtree(aside)


@contextlib.contextmanager
def staged_dir(final: str) -> Iterator[str]:
    """Build a directory under a temporary name; published to `final` on success, removed on failure."""
    tmp = new_temp_dir(final)
    try:
        with disk_full_said(os.path.dirname(tmp), tmp, f"writing {final}"):
            yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # created by this run
        raise
    publish_dir(tmp, final)


class DiskFull(OSError):
    """A write stopped for want of space; the message names the file system's directory and what was removed."""


DISK_FULL_FREE = 64 * 2**20  # below this many free bytes, a failed write is taken for a full disk


def _is_disk_full(error: BaseException, directory: str) -> bool:
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # torch.save says "[enforce fail at inline_container.cc:...] unexpected pos" when its writer is cut short
    if isinstance(error, (OSError, RuntimeError)):
        try:
            return shutil.disk_usage(directory).free < DISK_FULL_FREE
        except OSError:
            return False
    return False


@contextlib.contextmanager
def disk_full_said(directory: str, staging: str, what: str) -> Iterator[None]:
    """A write into `staging` (a temporary directory under `directory`, this run's) that fails for want of space
    becomes one `DiskFull` naming `directory` and its free bytes, with `staging` removed (its space given back);
    any other failure passes unchanged."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        if not _is_disk_full(e, directory):
            raise
        shutil.rmtree(staging, ignore_errors=True)  # created by this run
        free = shutil.disk_usage(directory).free if os.path.isdir(directory) else 0
        raise DiskFull(f"no space left on {directory} ({free / 2**20:.0f} MiB free): {what} stopped and its "
                       f"temporary files are removed; what was there before is unchanged") from e  # fmt: skip


# ----------------------------------------------------------------------------- one writer per directory
LOCK_FILE = ".glm53-writer.lock"


def _boot_id() -> str | None:
    """This boot of this host's kernel (Linux), recorded with a pid: after a reboot the pid is another process's."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def _process_start(pid: int) -> str | None:
    """The kernel's start time of process `pid` (Linux /proc), so that a reused pid is not taken for the writer."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _running(pid: int, started: str | None) -> bool:
    """The process that wrote a record (pid and start time) still runs."""
    if not _pid_exists(pid):
        return False
    return started is None or _process_start(pid) in (None, started)


def _pid_exists(pid: int) -> bool:
    """Some process has this pid now (whichever)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class DirectoryLock:
    """An exclusive writer's lock on a directory: `<dir>/.glm53-writer.lock`, holding the writer's host, boot id, pid,
    process start time and a run id (for the messages).

    The lock itself is the kernel's `flock` on that file, held for the run and dropped by the kernel when the
    process ends however it ends, so exactly one of any number of concurrent runs wins, and a killed run's file is
    no lock. The winner checks that it locked the file the path names (a releasing writer unlinks it) and reads the
    record it finds: empty or unreadable (a writer killed while writing it), or a process of this host that no
    longer runs, is taken over with a notice; another host's record is refused (its run may live on a file system
    whose locks are not shared between hosts: remove the file by hand once that run is known to be gone).
    Where the file system has no `flock`, the file is created whole or not at all (written aside, then linked into
    place) and a stale one is never taken over automatically (two runs could both take it): the error says to
    remove it. `release` removes the file only while it is still this writer's."""

    def __init__(self, directory: str, option: str) -> None:
        self.directory, self.option = directory, option
        self.path = os.path.join(directory, LOCK_FILE)
        self.run_id = uuid.uuid4().hex
        self.held = False
        self._fd: int | None = None

    def _record(self) -> dict[str, object]:
        return dict(host=socket.gethostname(), boot=_boot_id(), pid=os.getpid(), started=_process_start(os.getpid()),
                    run=self.run_id, since=time.strftime("%Y-%m-%d %H:%M:%S"))  # fmt: skip

    def _owner(self) -> dict[str, object]:
        try:
            with open(self.path, encoding="utf-8") as f:
                owner = json.load(f)
            return owner if isinstance(owner, dict) else {}
        except (OSError, ValueError):
            return {}

    def _refuse(
        self, owner: dict[str, object], hint: str = "If that run is gone, remove the lock file"
    ) -> None:
        who = (f"host {owner.get('host', '?')}, pid {owner.get('pid', '?')}, since {owner.get('since', '?')}"
               if owner else "its record is not written yet")  # fmt: skip
        raise OutputPathError(
            f"{self.option} {self.directory!r} is being written by another run ({who}: {self.path}); two runs "
            f"would interleave their checkpoints. {hint}"
        ) from None

    def acquire(self) -> str | None:
        """Take the lock or raise `OutputPathError` naming its owner; returns a notice when a killed run's lock
        was taken over (else None)."""
        os.makedirs(self.directory, exist_ok=True)
        for _ in range(100):  # a retry only when a releasing writer unlinked the file under us
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                self._refuse(self._owner())
            except OSError as e:
                os.close(fd)
                if e.errno in _NO_FLOCK:
                    return self._acquire_without_flock()
                raise
            if not self._is_the_path(fd):  # a releasing writer unlinked it under us: try the path again
                os.close(fd)
                continue
            try:
                notice = self._take_over(self._owner())
            except OutputPathError:
                os.close(fd)
                raise
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(self._record()).encode(), 0)
            os.fsync(fd)
            self._fd, self.held = fd, True
            return notice
        raise OutputPathError(f"{self.option} {self.directory!r}: could not take the lock {self.path}")

    def _is_the_path(self, fd: int) -> bool:
        try:
            here, there = os.fstat(fd), os.stat(self.path)
        except FileNotFoundError:
            return False
        return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)

    def _take_over(self, owner: dict[str, object]) -> str | None:
        """Under the flock: the notice for what the file held before (None: nothing)."""
        if not owner:
            if os.path.getsize(self.path):
                return f"{self.option}: took over a lock whose record was unreadable (a run killed while writing it): {self.path}"  # fmt: skip
            return None
        pid, host = owner.get("pid"), owner.get("host")
        if host != socket.gethostname():
            self._refuse(owner, "The file was left by a run on another host; if that run is gone, remove the "
                                "lock file")  # fmt: skip
        rebooted = owner.get("boot") not in (None, _boot_id())  # its pid and start time mean nothing now
        if not rebooted and isinstance(pid, int) and _running(pid, owner.get("started")):  # type: ignore[arg-type]
            self._refuse(owner)  # alive without the flock: a writer of an older glm53_ds
        why = "this host has rebooted since" if rebooted else "no longer running"
        if (
            not rebooted and isinstance(pid, int) and _pid_exists(pid)
        ):  # the pid runs again, started at another time
            why = "its pid now belongs to another process, started after that run"
        return f"{self.option}: took over the stale lock of pid {pid} on {host} ({why}): {self.path}"

    def _acquire_without_flock(self) -> str | None:
        tmp = f"{self.path}.{self.run_id}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self._record(), f)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, self.path)  # whole or not at all; fails when the file exists
        except FileExistsError:
            owner = self._owner()
            stale = owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int) and not _running(owner["pid"], owner.get("started"))  # type: ignore[arg-type]  # fmt: skip
            self._refuse(owner, ("Its process is no longer running, but this file system has no flock(), so the "
                                 "lock is not taken over automatically: remove the lock file") if stale else
                         "If that run is gone, remove the lock file")  # fmt: skip
        finally:
            os.unlink(tmp)
        self.held = True
        return None

    def release(self) -> None:
        if self.held and self._owner().get("run") == self.run_id:
            os.unlink(self.path)  # before the flock drops: a run waiting on this file retries on the path
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
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
