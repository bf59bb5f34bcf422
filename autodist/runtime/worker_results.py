"""The workers' results and failures, as they reach the chief through mailboxes.

Every worker other than the chief sends the chief its `WorkerResult` at the
end, or the traceback of its failure, so that the chief's error names a
failed worker even when it runs on another host.
"""
from __future__ import annotations

import logging
import traceback

from autodist.launch import mailbox
from autodist.launch.mailbox import Mailboxes
from autodist.runtime.follow import CHIEF
from autodist.runtime.records import WorkerMessage, WorkerResult
from autodist.runtime.worker_session import WorkerError

logger = logging.getLogger(__name__)


def collect_results(mail: Mailboxes, own: WorkerResult, num_workers: int,
                    timeout_s: float, absent: frozenset[int] = frozenset()
                    ) -> list[WorkerResult]:
    """Chief: every worker's result but the `absent` ones', by task index (the others'
    from the mailbox).

    Raises:
        WorkerError: a worker failed, or sent nothing within `timeout_s`.
    """
    results: dict[int, WorkerResult] = {0: own}
    expected = [t for t in range(num_workers) if t not in absent]
    while len(results) < len(expected):
        try:
            message = WorkerMessage.from_json(mail.receive(CHIEF, mailbox.RESULTS, timeout_s))
        except mailbox.MailboxTimeout as e:
            missing = [t for t in expected if t not in results]
            raise WorkerError(f"workers {missing} sent no result within {timeout_s:g}s "
                              "of the chief's end") from e
        raise_if_error(message)
        results[message.task] = message.result
    return [results[t] for t in expected]


def report_failure(mail: Mailboxes, task_index: int) -> None:
    """A failing worker: tells the chief why (the exception being handled)."""
    message = WorkerMessage(task_index, error=traceback.format_exc(limit=8))
    try:
        mail.send(CHIEF, mailbox.RESULTS, message.to_json(), timeout_s=5.0)
    except Exception:  # noqa: BLE001
        logger.warning("could not tell the chief that this worker failed")


def peer_failure(mail: Mailboxes) -> str | None:
    """Chief: a failure another worker reported, or None (also where none can be read)."""
    try:
        messages = mail.receive_all(CHIEF, mailbox.RESULTS, timeout_s=5.0)
    except Exception:  # noqa: BLE001
        return None
    for raw in messages:
        message = WorkerMessage.from_json(raw)
        if message.error is not None:
            return f"worker {message.task} failed:\n{message.error}"
    return None


def raise_if_error(message: WorkerMessage) -> None:
    """Raises a `WorkerError` for a message that carries a failure or nothing."""
    if message.error is not None:
        raise WorkerError(f"worker {message.task} failed:\n{message.error}")
    if message.result is None:
        raise WorkerError(f"worker {message.task} sent neither a result nor an error")
