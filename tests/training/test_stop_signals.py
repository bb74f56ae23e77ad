"""`training/stop_signals.py`: a stop signal is reported once and the run's clean-up runs, also when the main
thread is blocked in a C++ call that does not return (a collective whose peers have gone). Before: a Python
handler alone never ran there, so the process sat until the launcher's or the scheduler's SIGKILL, lock held and
nothing said (the control below)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.cli import ROOT

BLOCKED = """
import ctypes, importlib.util, sys
spec = importlib.util.spec_from_file_location("stop_signals", sys.argv[1])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
if sys.argv[2] == "watchdog":
    mod.StopSignals(lambda signum: print("reported", signum, flush=True)).install()
else:  # the control: a Python-level handler only
    def handler(signum, frame):
        raise KeyboardInterrupt
    import signal; signal.signal(signal.SIGTERM, handler)
libc, mutex = ctypes.CDLL(None), ctypes.create_string_buffer(64)  # zeros: PTHREAD_MUTEX_INITIALIZER (glibc)
libc.pthread_mutex_lock(mutex)
print("blocked", flush=True)
libc.pthread_mutex_lock(mutex)  # a self-deadlock: never returns, no EINTR, never runs Python
"""


def _signal_blocked(mode: str, wait: float) -> tuple[int | None, str]:
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED, f"{ROOT}/glm53_ds/training/stop_signals.py", mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "blocked"
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=wait)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.kill()
        return None, proc.communicate()[0]


@pytest.mark.slow
def test_a_main_thread_stuck_in_a_call_still_reports_and_exits():
    from glm53_ds.training.stop_signals import GRACE_S

    started = time.time()
    code, out = _signal_blocked("watchdog", wait=GRACE_S + 20)
    assert code == 128 + signal.SIGTERM and out.strip().endswith(f"reported {int(signal.SIGTERM)}"), out
    assert time.time() - started >= GRACE_S  # the main thread had its grace first


@pytest.mark.slow
def test_a_python_handler_alone_never_runs_there_control():
    code, out = _signal_blocked("python-only", wait=5)
    assert code is None and "reported" not in out  # still blocked: only a SIGKILL ends it
