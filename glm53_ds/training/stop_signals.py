"""Stopping on Ctrl-C or a scheduler's SIGTERM: the run says where it stopped and what survived, once, and releases
what it holds (the --save lock), however the signal finds it.

Every rank gets the signal (a terminal's Ctrl-C reaches the whole process group; DeepSpeed's launcher passes a
SIGTERM on to each rank). Python runs a signal's handler in the main thread between bytecodes: a rank in Python
code raises `Interrupted` (SIGTERM) or `KeyboardInterrupt` (Ctrl-C) there, and the trainer's `main` reports it and
cleans up. A rank blocked inside a C++ call that will not return (a collective whose peers have already gone, a
rendezvous) never gets there: the interpreter's C-level handler writes the signal to a wake-up socket at once, and
a watchdog thread reading it gives the main thread `GRACE_S` seconds, then reports, releases and exits itself with
the signal's status (128 + signal), before a launcher's or scheduler's SIGKILL (30 s by default in both).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable

GRACE_S = 10.0


class Interrupted(KeyboardInterrupt):
    """A scheduler's SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt."""


class StopSignals:
    """Installed by `install()` in the main thread for the length of a run. `report(signum)` says the one line
    (rank 0) and runs the clean-up; it runs once, from the main thread or from the watchdog, whichever is first."""

    def __init__(self, report: Callable[[int], None]) -> None:
        self._report = report
        self.received: int | None = None
        self._done = threading.Event()
        self._once = threading.Lock()
        self._reported = False
        self._quiet = False
        self._socket: socket.socket | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers belong to the main thread (a trainer run from a worker thread)
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._socket = reader
        self._writer = writer
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        threading.Thread(target=self._watch, name="glm53-stop-watchdog", daemon=True).start()
        return self

    def quiet(self) -> None:
        """The run is ending anyway (a refusal or a stop being reported): a signal now (the launcher's SIGTERM to
        a rank waiting for rank 0 to print) interrupts nothing; the watchdog still ends a rank stuck in a call."""
        self._quiet = True

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.received is not None or self._quiet:
            self.received = self.received or signum
            return  # a second Ctrl-C while the first is handled, or a stop of a run already ending
        self.received = signum
        raise Interrupted() if signum == signal.SIGTERM else KeyboardInterrupt()

    def _watch(self) -> None:
        assert self._socket is not None
        try:
            data = self._socket.recv(1)
        except OSError:
            return
        if not data or self._done.wait(GRACE_S):
            return
        self.report(data[0])  # the main thread is stuck in a call that does not return
        os._exit(128 + data[0])

    def report(self, signum: int) -> int:
        """Say it once and clean up; returns the exit status (128 + the signal)."""
        with self._once:
            if not self._reported:
                self._reported = True
                self._report(signum)
        return 128 + signum

    def code_of(self, error: BaseException) -> int:
        """The main thread's report of the interrupt it raised (or of a collective a stopped peer broke)."""
        return self.report(
            self.received or (signal.SIGTERM if isinstance(error, Interrupted) else signal.SIGINT)
        )

    def uninstall(self) -> None:
        """The run is over (main's `finally`): the watchdog stands down; a second signal now does nothing."""
        self._done.set()
        if self._socket is None:
            return
        for sig in self._previous:
            signal.signal(sig, signal.SIG_IGN if self.received else self._previous[sig])  # type: ignore[arg-type]
        signal.set_wakeup_fd(-1)
        self._writer.close()
        self._socket.shutdown(socket.SHUT_RDWR)  # wakes the watchdog's recv with nothing
        self._socket.close()


def signal_name(signum: int) -> str:
    return (
        "SIGTERM"
        if signum == signal.SIGTERM
        else "Ctrl-C (SIGINT)"
        if signum == signal.SIGINT
        else str(signum)
    )
