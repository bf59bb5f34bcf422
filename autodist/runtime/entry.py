"""A task process of the runtime: ``python -m autodist.runtime.entry``.

The process's life (server, job, watchdogs, exit codes) is
`autodist.launch.task`; a worker task's work is the training loop,
`autodist.runtime.worker.run_worker`. Launchers start this module
(`TASK_MODULE`); `autodist serve` runs `main` in its own process.
"""
from __future__ import annotations

import sys

TASK_MODULE = "autodist.runtime.entry"


def main(argv: list[str] | None = None) -> int:
    """Runs one task process (see `autodist.launch.task.build_parser` for `argv`)."""
    from autodist.launch import task
    from autodist.runtime.run_config import RunConfig
    from autodist.runtime.worker import run_worker

    return task.main(argv, run_worker, check_job=RunConfig.of_job)


if __name__ == "__main__":
    sys.exit(main())
