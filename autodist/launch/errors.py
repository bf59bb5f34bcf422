"""How a task process fails: its exit codes, and the error the driver raises for it."""
from __future__ import annotations

from autodist.ir.errors import AutodistError

# Exit codes of a task process (`autodist.launch.task`).
EXIT_OK = 0
EXIT_FAILED = 1          # traceback on stderr, i.e. in the task's log
EXIT_PORT_IN_USE = 3     # a local launcher retries with other ports
EXIT_NO_JOB = 4          # `autodist serve`: no job arrived in time


class TaskFailedError(AutodistError, RuntimeError):
    """A task of the cluster died or stopped answering.

    Attributes:
        task: "job:index" of the task.
        log: Path of its log.
    """

    def __init__(self, message: str, task: str, log: str) -> None:
        super().__init__(message)
        self.task = task
        self.log = log


class DeviceSetupError(AutodistError, RuntimeError):
    """A task cannot have the devices its node in the resource spec names."""


class JobArchiveError(AutodistError, ValueError):
    """A shipped job archive holds something the chief never writes, or is used wrongly."""


class JobMismatchError(AutodistError, RuntimeError):
    """A shipped job does not belong to this task (another job id or cluster)."""
