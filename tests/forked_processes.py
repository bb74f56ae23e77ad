"""The tests' processes, forked from one server that has imported what each of them imports.

A test rank or trainer process started fresh spent ~10 s of CPU importing torch, DeepSpeed, megatron-core and
transformers before its first line of work: most of a small multi-rank test on CI's two cores, and ~40% of the
suite. A fork server (multiprocessing's `forkserver`) imports them once (`tests/rank_imports.py`); every process
forked from it starts with those modules imported and nothing else: the server holds no threads, process groups,
models or warnings state of a test. Each process takes the environment the test has at its start, not the
server's.

`run_script` runs a script (`launch/train.py`, a test's variant of it) as `python script` in one process, or on N
ranks as DeepSpeed's launcher would: its environment variables and `--local_rank`, the first failing rank's exit
status, the other ranks stopped by SIGTERM then SIGKILL. What a test checks of the launcher itself runs the real
one (`tests/cli.py`, `launcher=True`, and the README commands).
"""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STOP_GRACE_S = 30  # DeepSpeed's launcher waits this long between SIGTERM and SIGKILL of the other ranks


def context():  # type: ignore[no-untyped-def]
    """The fork server's context (started on first use, kept for the pytest session)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.rank_imports"])
    return ctx


def take_environment(env: dict[str, str]) -> None:
    """In a forked process: the test's environment, whatever the server's was when it started."""
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # read by the OpenMP runtime when the server imported torch
        import torch

        torch.set_num_threads(int(threads))


def launcher_environment(rank: int, world: int, port: int) -> dict[str, str]:
    """What DeepSpeed's launcher (deepspeed/launcher/launch.py) sets for one rank on one node."""
    return dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), CROSS_RANK="0",
                CROSS_SIZE="1", LOCAL_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))  # fmt: skip


def _exit_status(code: Any) -> int:
    """Python's own rule for `sys.exit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _script_process(
    script: str, argv: list[str], env: dict[str, str], out_dir: str, name: str, module: bool = False
) -> None:
    """`python script argv...` (`python -m script argv...` when `module`) in this forked process: its output in
    <out_dir>/<name>.out / .err, its exit status as the interpreter's would be, atexit handlers run."""
    with (
        open(os.path.join(out_dir, f"{name}.out"), "wb") as out,
        open(os.path.join(out_dir, f"{name}.err"), "wb") as err,
    ):
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
    take_environment(env)
    os.chdir(ROOT)
    sys.argv = [script, *argv]
    # as the interpreter puts the script's folder first, or for `-m` the current directory
    sys.path[0] = ROOT if module else os.path.dirname(os.path.abspath(script))
    status = 0
    try:
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        status = _exit_status(e.code)
    except BaseException:  # noqa: BLE001 - what the interpreter prints and returns for an uncaught exception
        traceback.print_exc()
        status = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _stop(procs: list) -> None:  # type: ignore[type-arg]
    for p in procs:
        if p.is_alive() and p.pid is not None:
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def run_script(script: str, argv: list[str], ranks: int | None = None, env: dict[str, str] | None = None,
               timeout: float = 900, port: int | None = None, module: bool = False) -> subprocess.CompletedProcess:  # fmt: skip
    """`python script argv` (ranks None) or DeepSpeed's launcher's `--num_gpus ranks --master_port port script
    argv`, each process forked from the server; stdout and stderr are the ranks' in rank order. `module`: `script`
    is a module run as `python -m script` (the planner's commands)."""
    import tempfile

    base = {**os.environ, **(env or {})}
    ctx = context()
    with tempfile.TemporaryDirectory(prefix="glm53_run_") as out_dir:
        names, procs = [], []
        for rank in range(ranks or 1):
            process_env, process_argv = base, list(argv)
            if ranks is not None:
                assert port is not None, "a launch of ranks needs its rendezvous port"
                process_env = {**base, **launcher_environment(rank, ranks, port)}
                process_argv = [f"--local_rank={rank}", *argv]
            names.append(f"rank{rank}")
            procs.append(ctx.Process(target=_script_process, args=(script, process_argv, process_env, out_dir,
                                                                   names[-1], module)))  # fmt: skip
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed: int | None = None
        while any(p.is_alive() for p in procs):
            failed = next((p.exitcode for p in procs if p.exitcode not in (None, 0)), None)
            if failed is not None or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        timed_out = failed is None and any(p.is_alive() for p in procs)
        _stop(procs)
        if failed is None:
            failed = next((p.exitcode for p in procs if p.exitcode not in (None, 0)), 0)

        def read(suffix: str) -> str:
            text = []
            for name in names:
                with open(os.path.join(out_dir, f"{name}{suffix}"), encoding="utf-8", errors="replace") as f:
                    text.append(f.read())
            return "".join(text)

        stdout, stderr = read(".out"), read(".err")
    command = [sys.executable, *(["-m"] if module else []), script, *argv]
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    # the launcher exits with the failed rank's status (a signal's negative code as the shell sees it)
    return subprocess.CompletedProcess(command, failed & 0xFF, stdout, stderr)
