"""Heartbeats: telling a stopped or hung task from a slow one.

A task process that is stopped (SIGSTOP, a paused VM, a debugger) or hung
does not exit, so nothing that waits for exit codes notices it; its peers
only see their next collective or parameter-server take time out, and the
error then names whichever task timed out first (usually the chief). Each
task process of a local cluster therefore touches a file of the job
directory (`JobDir.heartbeat`) from a thread of its own every
`PERIOD_S`; the launcher treats a task whose file is older than its hang
timeout as hung: it kills it and names it, so the run fails, or recovers,
as from a dead task.

The hang timeout is shorter than a step's timeout (`hang_timeout`), so the
hung task is named before its peers' steps time out.
"""
from __future__ import annotations

import os
import pathlib
import threading
import time

PERIOD_S = 0.5
# Never shorter: a task that builds a large graph holds Python's lock for a
# second or two, and a loaded machine delays threads.
MIN_TIMEOUT_S = 5.0
MAX_TIMEOUT_S = 60.0


def hang_timeout(step_timeout_s: float) -> float:
    """How long a task may go without a heartbeat: half a step's timeout, 5 to 60 s."""
    return min(max(step_timeout_s / 2.0, MIN_TIMEOUT_S), MAX_TIMEOUT_S)


def start(path: pathlib.Path, period_s: float = PERIOD_S) -> threading.Event:
    """Touches `path` every `period_s` from a daemon thread, until the returned event
    is set or the process ends."""
    stop = threading.Event()
    path.touch()

    def beat() -> None:
        while not stop.wait(period_s):
            try:
                os.utime(path)
            except OSError:
                return  # the job directory is gone: the run is over

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()
    return stop


def silence_s(path: pathlib.Path) -> float | None:
    """Seconds since the task last touched `path`; None before its first heartbeat."""
    try:
        return max(0.0, time.time() - path.stat().st_mtime)
    except OSError:
        return None
