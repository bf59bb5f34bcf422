"""A deliberately slowed task: duty-cycle a process with SIGSTOP / SIGCONT.

`Slowdown(job_dir, task=1, fraction=0.5)` finds the worker process of a local
cluster (by its command line) once it starts and, while active, lets it run
only `fraction` of every period: a real process running at a fraction of its
speed, as a slower device would. Used by benchmarks and by tests of unequal
or failing workers (`find_task_pid`); the process is always resumed on exit.
Linux only (it reads `/proc`).
"""
from __future__ import annotations

import os
import signal
import threading
import time

from autodist.ir.errors import InvalidArgumentError
from autodist.runtime.entry import TASK_MODULE


def find_task_pid(job_dir: str, job: str, task: int) -> int | None:
    """The pid of a running task process (`TASK_MODULE`) of `job_dir`, or None."""
    wanted = [TASK_MODULE, "--job-dir", str(job_dir), "--job", job, "--task",
              str(task)]
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if all(w in args for w in wanted):
            return int(entry)
    return None


def pin_workers(job_dir: str, cores: dict[int, set[int]], timeout_s: float = 120.0) -> None:
    """Pins worker task processes to CPU cores, e.g. {0: {0}, 1: {1}}: one device each.

    Waits (up to `timeout_s`) for each process to appear. Without pinning,
    the workers of a local cluster share every core, and slowing one frees
    CPU for the others.
    """
    deadline = time.monotonic() + timeout_s
    for task, allowed in cores.items():
        pid = None
        while pid is None and time.monotonic() < deadline:
            pid = find_task_pid(job_dir, "worker", task)
            if pid is None:
                time.sleep(0.05)
        if pid is None:
            raise TimeoutError(f"worker {task} of {job_dir} did not start in {timeout_s}s")
        for thread in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(thread), allowed)
            except OSError:
                pass  # a thread that just ended


class Slowdown:
    """Runs worker `task` of the job in `job_dir` at `fraction` of its speed.

    Args:
        job_dir: The run's job directory (`distribute(..., job_dir=)`).
        task: Worker task index.
        fraction: Share of each period the process may run, in (0, 1].
        period_s: Length of one stop/continue cycle.
        find_timeout_s: How long to wait for the process to appear.
        pin: Worker task -> CPU cores to pin it to first (`pin_workers`).
    """

    def __init__(self, job_dir: str, task: int, fraction: float, period_s: float = 0.004,
                 find_timeout_s: float = 120.0, pin: dict[int, set[int]] | None = None) -> None:
        if not 0 < fraction <= 1:
            raise InvalidArgumentError(f"fraction must be in (0, 1]. Received: {fraction}")
        self.pin = pin
        self.job_dir, self.task, self.fraction = job_dir, task, fraction
        self.period_s, self.find_timeout_s = period_s, find_timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Slowdown:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        if self.pin:
            pin_workers(self.job_dir, self.pin, self.find_timeout_s)
        deadline = time.monotonic() + self.find_timeout_s
        pid = None
        while pid is None and not self._stop.is_set() and time.monotonic() < deadline:
            pid = find_task_pid(self.job_dir, "worker", self.task)
            if pid is None:
                time.sleep(0.05)
        if pid is None or self.fraction >= 1:
            return
        run_s = self.period_s * self.fraction
        try:
            while not self._stop.is_set():
                time.sleep(run_s)
                os.kill(pid, signal.SIGSTOP)
                time.sleep(self.period_s - run_s)
                os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
