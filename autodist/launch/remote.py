"""Multi-host runs: tasks on other hosts, reached over TensorFlow only.

The convention of Kubernetes TF operators: every pod gets ``TF_CONFIG`` with
the whole cluster and its own task, and runs the same image. The user's
script runs on the chief's pod (TF_CONFIG task ``chief:0``, or ``worker:0``
when there is no chief job), as with Keras' MultiWorkerMirroredStrategy; every
other pod runs ``autodist serve --tf-config``, which starts that task's
TensorFlow server and waits for a job.

When the script calls `fit` (``launch="remote"``), the driver ships each
other task its job (GraphItem, Strategy, ResourceSpec, RunConfig, initial
values, and the rows of the data its replicas read) into that task's job
mailbox over TensorFlow (`autodist.launch.mailbox`), then starts the chief
(worker task 0) as a child process on its own host, as a local cluster
would. Everything after that between tasks also goes through TensorFlow.

A job is packed into a private temporary file, sent in chunks of
`chunks.CHUNK_BYTES` (`autodist.launch.chunks`: no message nears
TensorFlow's 2 GiB limit), each sealed with the cluster's shared secret
(`autodist.launch.signing`) for the task it is for; at most `chunks.WINDOW`
chunks wait in a task's job box at a time. The task checks each chunk before
keeping it, and the whole before unpacking anything, and answers with a
receipt (accepted, or why not), so a wrong or missing secret fails `fit` at
once with the task's reason (read between chunks: a rejected job is not sent
to its end).

An elastic job may grow onto tasks that are not served at launch (`late`):
each is shipped its job in the background once its slot answers, and the
chief waits for it when the job grows onto it.

A job that failed leaves its other tasks free for the next one: workers end
with the failed step, the others when told (`RemoteCluster.abort`), and each
`autodist serve` starts a fresh process for the next job. A task whose host
or `autodist serve` died does not come back; `RemoteCluster.lost` finds such
tasks, so that a recovering run (`autodist.runtime.recovery`) goes on
without them, and a later job leaves them out (``absent``).
"""
from __future__ import annotations

import logging
import tempfile
import threading
import time
from typing import BinaryIO, Callable, Collection

import numpy as np

from autodist.ir import addresses
from autodist.ir.errors import AutodistError
from autodist.ir.resource_spec import ResourceSpec
from autodist.launch import chunks, mailbox, signing
from autodist.launch.errors import TaskFailedError
from autodist.launch.job import JobDir
from autodist.launch.local import LocalCluster

_RETRY_S = 0.2
# After a failed job: a dead task's process may answer until its own watchdog
# (`task._exit_with_parent`, 1 s period) ends it; only later answers count.
_SETTLE_S = 2.0
_POLL_S = (0.005, 0.1)   # first and longest wait while a task's job box is full

logger = logging.getLogger(__name__)


class TasksLostError(TaskFailedError):
    """Tasks of a remote cluster did not come back after a failed job (their host or
    `autodist serve` died).

    Attributes:
        lost: "job:index" of every task that did not answer, parameter
            servers first; `task` is the first of them.
    """

    def __init__(self, message: str, lost: tuple[str, ...], address: str) -> None:
        super().__init__(message, lost[0], address)
        self.lost = lost


class ChiefKilledError(TaskFailedError):
    """The chief's process of a remote job was killed (by a signal), its other tasks
    all still served."""


class PeerRestartedError(TaskFailedError):
    """The chief's step failed because another task stopped answering, and that task's
    slot answers again (its process, or its host's `autodist serve`, was started
    anew): whatever it held in memory (a parameter server's variables) is gone.
    `task` names it."""


class RemoteCluster:
    """A cluster whose other tasks already serve on their hosts; the chief runs here.

    Use as a context manager, like `LocalCluster`:

        with RemoteCluster(job, spec, task_module=..., worker_rows=...,
                           startup_timeout_s=120) as cluster:
            cluster.wait_ready(timeout_s=60)
            cluster.wait_workers(timeout_s=600)

    Args:
        job: The job directory written by the driver (on this host).
        spec: The cluster; every node needs its port.
        task_module: The module the chief's process runs (see `LocalCluster`).
        worker_rows: Worker task index -> the rows of the data its virtual
            nodes read (only those are shipped to it).
        startup_timeout_s: Bound on each other task answering and taking its job.
        secret: The cluster's shared secret (`signing.load_secret`); None
            ships unsigned jobs, which only tasks serving with ``--insecure``
            accept.
        chunk_bytes: The size of the chunks a job is sent in (None:
            `chunks.CHUNK_BYTES` when the job is shipped).
        absent: Tasks ("job:index") known to be gone (lost in an earlier
            job), or that the job does not use: they are neither shipped the
            job nor told it failed.
        late: Tasks ("job:index") the job grows onto later (an elastic job's
            workers outside its starting membership): their slot's
            `autodist serve` may start after launch. Each gets the job, in
            the background, as soon as it answers; the chief waits for it
            when the job grows onto it. A job that fails before a late task
            was shipped names it.
    """

    def __init__(self, job: JobDir, spec: ResourceSpec, *, task_module: str,
                 worker_rows: Callable[[int], np.ndarray], startup_timeout_s: float,
                 secret: bytes | None = None, chunk_bytes: int | None = None,
                 absent: Collection[str] = (), late: Collection[str] = ()) -> None:
        missing = [f"{n.address} (node {i})" for i, n in enumerate(spec.nodes) if not n.port]
        if missing:
            raise AutodistError(f"launch='remote' needs the port of every node; none for "
                                f"{missing}")
        self.job = job
        self.secret = secret
        self.spec = spec
        self.worker_rows = worker_rows
        self.startup_timeout_s = startup_timeout_s
        self.chunk_bytes = chunk_bytes
        self.absent = frozenset(absent)
        self.late = frozenset(late) - self.absent
        self._chief_code: int | None = None
        self._stopping = threading.Event()
        self._joiners: list[threading.Thread] = []
        self._shipped: set[str] = set()
        self._late_errors: dict[str, BaseException] = {}
        self.chief = LocalCluster(job, spec, task_module=task_module, nodes=[spec.chief_index],
                                  port_retries=0)

    def __enter__(self) -> RemoteCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            self.abort()
            raise
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.stop()
        if exc_type is not None:
            self.abort()

    def start(self) -> None:
        """Ships every other task but the late ones its job, then starts the chief here
        and ships the late ones theirs as they come."""
        self.ship()
        self.chief.start()
        for name in sorted(self.late):
            thread = threading.Thread(target=self._ship_when_served, args=(name,),
                                      name=f"autodist-ship-{name}", daemon=True)
            thread.start()
            self._joiners.append(thread)

    def _ship_when_served(self, name: str) -> None:
        """Waits (until the job ends) for late task `name` to answer, then ships its job."""
        job, _, index = name.partition(":")
        task = (job, int(index))
        mail = mailbox.Mailboxes(self.spec.cluster_def(), job_id=self.job.settings().job_id)
        try:
            while not addresses.accepts(mail.address(task)):
                if self._stopping.wait(_RETRY_S):
                    return
            logger.info("late task %s answers at %s: shipping its job", name,
                        mail.address(task))
            with tempfile.TemporaryFile(dir=self.job.path) as archive:
                self._pack(task, archive)
                self._ship_one(mail, task, archive)
            self._shipped.add(name)
        except (AutodistError, OSError) as e:  # reported when the job fails (`unshipped`)
            logger.warning("could not ship late task %s its job: %s", name, e)
            self._late_errors[name] = e
        finally:
            mail.close()

    def unshipped(self, error: TaskFailedError) -> TaskFailedError:
        """After a failed job: what a late task that never got its job says (its shipping
        error, or that nothing served its slot), else `error`."""
        for name in sorted(self.late - self._shipped):
            late_error = self._late_errors.get(name)
            if isinstance(late_error, TaskFailedError):
                return late_error
            address = self.address(name)
            reason = (f"shipping it failed: {late_error}" if late_error is not None else
                      "nothing served its slot (start `autodist serve --tf-config` there, "
                      "with the cluster's TF_CONFIG and secret)")
            return TaskFailedError(f"task {name} at {address} was to join the job but never "
                                   f"got it: {reason}. The job failed with: {error}",
                                   name, address)
        return error

    def ship(self) -> None:
        """Sends each other task its job, in chunks into its job mailbox, and reads its receipt.

        `startup_timeout_s` bounds each task answering, each chunk being
        taken, and the receipt after the last one.

        Raises:
            TaskFailedError: naming the task and its address when it does not
                answer or take the job within `startup_timeout_s`.
            signing.JobRejectedError: a task rejected the job (its reason: a
                wrong or missing secret, another cluster, ...).
        """
        if self.secret is None:
            logger.warning("shipping unsigned jobs (no secret: secret_file=, %s or %s); only "
                           "tasks serving with --insecure accept them", signing.SECRET_FILE_ENV,
                           signing.SECRET_ENV)
        self.job.write_ports([n.port for n in self.spec.nodes])
        mail = mailbox.Mailboxes(self.spec.cluster_def(), job_id=self.job.settings().job_id)
        try:
            for task in self._others(mail):
                if mailbox.task_name(task) in self.late:
                    continue   # shipped once it answers (`start`)
                # Private: in the job directory (0700), created 0600 and unlinked at once.
                with tempfile.TemporaryFile(dir=self.job.path) as archive:
                    self._pack(task, archive)
                    self._ship_one(mail, task, archive)
        finally:
            mail.close()

    def _pack(self, task: tuple[str, int], archive: BinaryIO) -> None:
        if task[0] != "worker":
            self.job.pack_into(archive, with_data=False)
        else:
            self.job.pack_into(archive, self.worker_rows(task[1]))
        archive.flush()

    def _ship_one(self, mail, task: tuple[str, int], archive: BinaryIO) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        name = f"{task[0]}:{task[1]}"
        address = mail.address(task)
        while True:
            try:
                mail.wait_until_up([task], max(deadline - time.monotonic(), 0.0))
                messages = chunks.sealed_chunks(self.secret, mail.job_id, name, archive,
                                                chunk_bytes=self.chunk_bytes)
                while True:
                    if self._wait_for_room(mail, task, deadline):
                        return   # accepted: it had every chunk already (a retry)
                    message = next(messages, None)   # sealed now, once there is room
                    if message is None:
                        break
                    mail.send(task, mailbox.JOB, message,
                              max(deadline - time.monotonic(), 1.0))
                    deadline = time.monotonic() + self.startup_timeout_s  # it took a chunk
                self._check_receipt(mail, task, mail.receive(
                    task, mailbox.RECEIPT, max(deadline - time.monotonic(), 1.0)))
                return
            except mailbox.MailboxError as e:
                # A task that just finished a job closes its box; its next process follows
                # (and takes the job from its first chunk).
                if time.monotonic() + _RETRY_S > deadline:
                    raise TaskFailedError(
                        f"task {name} at {address} did not take its job within "
                        f"{self.startup_timeout_s:g}s: {e}. Start `autodist serve --tf-config` "
                        "there (or check its address and port).", name, address) from e
                time.sleep(_RETRY_S)

    def _wait_for_room(self, mail, task: tuple[str, int], deadline: float) -> bool:
        """Waits until fewer than `chunks.WINDOW` messages wait in the task's job box; True
        if the task accepted the job already (it had every chunk: a retry).

        Raises:
            signing.JobRejectedError: the task rejected the job (a receipt came).
            mailbox.MailboxTimeout: the box stayed full until `deadline`.
        """
        pause = _POLL_S[0]
        while True:
            for receipt in mail.receive_all(task, mailbox.RECEIPT):
                if self._check_receipt(mail, task, receipt):
                    return True
            remaining = deadline - time.monotonic()
            waiting = mail.waiting(task, mailbox.JOB, max(remaining, 1.0))
            if waiting < chunks.WINDOW:
                return False
            if remaining <= 0:
                name = f"{task[0]}:{task[1]}"
                raise mailbox.MailboxTimeout(
                    f"task {name} at {mail.address(task)}: {waiting} messages still waited "
                    f"in its job box after {self.startup_timeout_s:g}s", name,
                    mail.address(task))
            time.sleep(min(pause, max(remaining, 0.0)))
            pause = min(pause * 2, _POLL_S[1])

    @staticmethod
    def _check_receipt(mail, task: tuple[str, int], receipt: bytes) -> bool:
        """True for an accepting receipt; raises JobRejectedError, with the task's reason,
        for any other."""
        if receipt == mailbox.ACCEPTED:
            return True
        name = f"{task[0]}:{task[1]}"
        reason = receipt.decode(errors="replace").removeprefix("rejected: ")
        if reason.startswith("not a job message"):
            reason += (" (is autodist older there? This chief sends jobs as format-v2 "
                       "chunks, which autodist reads since jobs are chunked; update it)")
        raise signing.JobRejectedError(
            f"task {name} at {mail.address(task)} rejected the job: {reason[:600]}",
            mail.job_id)

    def abort(self, timeout_s: float = 5.0) -> None:
        """Tells every other task that this job failed (they end at once); best effort."""
        mail = mailbox.Mailboxes(self.spec.cluster_def(), job_id=self.job.settings().job_id)
        try:
            for task in self._others(mail):
                name = mailbox.task_name(task)
                if name in self.late and name not in self._shipped:
                    continue   # it has no job: nothing to stop there
                if addresses.accepts(mail.address(task)):
                    try:
                        mail.send(task, mailbox.ABORT, b"abort", timeout_s)
                    except mailbox.MailboxError:
                        pass  # not up, or already gone: nothing to stop there
        finally:
            mail.close()

    def lost(self, within_s: float) -> list[str]:
        """After a failed job (call it once the cluster is stopped and aborted): the other
        tasks that do not accept connections again within `within_s`, parameter servers
        first.

        Every task that is still served answers again once its `autodist serve` has
        started the process for the next job; a task whose host or `autodist serve`
        died does not. Tasks answering only in the first `_SETTLE_S` (a dead task's
        process ending) are not counted.
        """
        mail = mailbox.Mailboxes(self.spec.cluster_def())
        waiting = sorted(self._others(mail), key=lambda task: task[0] != "ps")
        time.sleep(min(_SETTLE_S, within_s))
        deadline = time.monotonic() + max(within_s - _SETTLE_S, 0.0)
        while True:
            waiting = [t for t in waiting if not addresses.accepts(mail.address(t))]
            if not waiting or time.monotonic() >= deadline:
                return [mailbox.task_name(t) for t in waiting]
            time.sleep(min(_RETRY_S, max(deadline - time.monotonic(), 0.0)))

    def failure(self, error: TaskFailedError, within_s: float) -> TaskFailedError:
        """What ended a failed job, once the cluster is stopped and aborted: the tasks
        `lost` within `within_s` (a `TasksLostError`), else a chief killed by a signal
        (a `ChiefKilledError`), else a task the chief's step could not reach that
        answers again (a `PeerRestartedError`), else `error`."""
        lost = self.lost(within_s)
        if lost:
            address = self.address(lost[0])
            return TasksLostError(
                f"task {lost[0]} at {address} did not come back within {within_s:g}s of the "
                f"job's failure: its host or its `autodist serve` is gone (lost: "
                f"{', '.join(lost)}). The job failed with: {error}", tuple(lost), address)
        code = self.chief_exit_code()
        if code is not None and code < 0:
            return ChiefKilledError(f"the chief was killed (exit code {code}): {error}",
                                    error.task, error.log)
        chief = self.spec.task_of(self.spec.chief_index)
        record = self.job.unreachable_peer(*chief)
        peer = record.read_text().strip() if record.exists() else ""
        if peer and peer != mailbox.task_name(chief) and peer not in self.absent:
            address = self.address(peer)
            return PeerRestartedError(
                f"task {peer} at {address} stopped answering during the job and answers "
                f"again (its process or host was restarted; what it held is gone). The job "
                f"failed with: {error}", peer, address)
        return error

    def address(self, task: str) -> str:
        """The "host:port" of task "job:index"."""
        job, _, index = task.partition(":")
        return mailbox.Mailboxes(self.spec.cluster_def()).address((job, int(index)))

    def chief_exit_code(self) -> int | None:
        """The chief's exit code when the job failed (None: it ran on, or had not ended)."""
        return self._chief_code

    def _others(self, mail: mailbox.Mailboxes) -> list[tuple[str, int]]:
        """The tasks other than the chief that take part: every one not absent."""
        chief = self.spec.task_of(self.spec.chief_index)
        return [t for t in mail.tasks
                if t != chief and mailbox.task_name(t) not in self.absent]

    def wait_ready(self, timeout_s: float) -> None:
        self.chief.wait_ready(timeout_s)

    def wait_workers(self, timeout_s: float, on_poll=None) -> None:
        try:
            self.chief.wait_workers(timeout_s, on_poll=on_poll)
        except TaskFailedError as error:
            self._chief_code = self.chief.wait_exit("worker", 0, 0.0)  # before `stop`
            failure = self.unshipped(error)
            if failure is not error:
                raise failure from error
            raise

    def wait_exit(self, job: str, index: int, timeout_s: float) -> int | None:
        """Waits until task job:index exits, if it runs here (the chief); its exit code,
        or None (still running, or not a task of this host)."""
        return self.chief.wait_exit(job, index, timeout_s)

    def stop(self, grace_s: float = 5.0) -> None:
        self._stopping.set()
        self.chief.stop(grace_s)
        for thread in self._joiners:   # a shipment in flight ends within its own bounds
            thread.join(timeout=grace_s)

