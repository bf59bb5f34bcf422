"""A deliberately slowed task (SIGSTOP / SIGCONT duty cycle).

The implementation moved into the package (`autodist.bench.slowdown`) so that
tests need nothing from this folder; the benchmark scripts here keep
importing it under this name.
"""
from __future__ import annotations

from autodist.bench.slowdown import Slowdown, find_task_pid, pin_workers

__all__ = ["Slowdown", "find_task_pid", "pin_workers"]
