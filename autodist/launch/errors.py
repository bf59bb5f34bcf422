"""How a task process fails: its exit codes, and the error the driver raises for it."""
from __future__ import annotations

import re

from autodist.ir.errors import AutodistError

# How TensorFlow names the task a failed remote call went to.
_REMOTE_TARGET = re.compile(r"remote target /job:(\w+)/replica:\d+/task:(\d+)")

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


def unreachable_peer(error: BaseException) -> str | None:
    """The task ("job:index") a session's failed step could not reach, when `error` (or
    its cause) is TensorFlow's UnavailableError naming the remote target, else None.

    A task's process that died (or whose host restarted it) refuses the
    connection: the step fails with UNAVAILABLE, and gRPC names the task it
    called ("... from remote target /job:ps/replica:0/task:0 ...").
    """
    for e in (error, error.__cause__):
        if e is not None and type(e).__name__ == "UnavailableError":
            found = _REMOTE_TARGET.search(str(e))
            if found:
                return f"{found.group(1)}:{found.group(2)}"
    return None
