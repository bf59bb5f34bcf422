"""Mailboxes: byte messages between the tasks of a cluster, over TensorFlow itself.

Each task owns named boxes: string FIFO queues on its first CPU, in the
resource container ``autodist``, found by a shared name. A process that can
reach a task's gRPC address puts a message into that task's box through a
client session to that address, restricted by device filters to that one
task (so the rest of the cluster need not be up); the task takes its messages
out through its own server. This is how tasks on different hosts exchange
the job, step reports, the run limit, results and the end-of-job signal
without a shared filesystem, and without a network protocol of their own.

Boxes live as long as the task's server. A message is one scalar string
tensor (TensorFlow's limit: under 2 GiB; a job therefore travels as chunks,
`autodist.launch.chunks`), tagged with the id of the job that sent it: a
receiver takes only its own job's messages, so a task left over from a
failed job cannot confuse the next one.
"""
from __future__ import annotations

import time
from typing import Mapping, Sequence

import tensorflow as tf

from autodist.ir.addresses import accepts
from autodist.ir.errors import AutodistError

# Box names.
JOB = "job"          # driver -> task: the job archive, in signed chunks
STEPS = "steps"      # worker -> chief: per-step weighted losses (runs followed by callbacks)
LIMIT = "limit"      # chief -> workers: how many steps may run
RESULTS = "results"  # worker -> chief: losses, times, or an error
DONE = "done"        # chief -> every other task: the chief has what it needs
ABORT = "abort"      # driver -> every other task: the job failed, stop now
STATE_UP = "state_up"  # worker -> chief: its virtual nodes' state at a resize
STATE = "state"      # chief -> next members: every variable's value at a resize
RECEIPT = "receipt"  # serving task -> chief, in the task's own box: ACCEPTED or b"rejected: why"

ACCEPTED = b"accepted"

CONTAINER = "autodist"
CAPACITY = 100_000
_CONNECT_POLL_S = 0.05
_PING_TIMEOUT_S = 10.0

Task = tuple[str, int]


class MailboxError(AutodistError, RuntimeError):
    """A message could not be delivered or did not arrive in time.

    Attributes:
        task: "job:index" of the task whose box it was.
        address: That task's "host:port".
    """

    def __init__(self, message: str, task: str, address: str) -> None:
        super().__init__(message)
        self.task = task
        self.address = address


class MailboxTimeout(MailboxError, TimeoutError):
    """Nothing arrived in a box within the time allowed."""


def task_name(task: Task) -> str:
    return f"{task[0]}:{task[1]}"


class Mailboxes:
    """Sends to and receives from the boxes of a cluster's tasks.

    Args:
        cluster: {job: ["host:port", ...]}, as `ResourceSpec.cluster_def`.
        job_id: Tags what this object sends; it receives only messages with
            this tag (None: sends untagged, receives any message).

    Example:
        >>> mail = Mailboxes({"worker": ["localhost:2222", "localhost:2223"]})  # doctest: +SKIP
        >>> mail.send(("worker", 1), JOB, archive, timeout_s=30)
        >>> mail.receive(("worker", 1), JOB, timeout_s=600)   # on worker 1
    """

    def __init__(self, cluster: Mapping[str, Sequence[str]], job_id: str | None = None) -> None:
        self.job_id = job_id
        self._tag = (job_id or "").encode()
        self._cluster = {job: list(addresses) for job, addresses in cluster.items()}
        self._graphs: dict[Task, tf.Graph] = {}
        self._sessions: dict[Task, tf.compat.v1.Session] = {}
        self._ops: dict[tuple[Task, str], dict[str, tf.Operation | tf.Tensor]] = {}

    def address(self, task: Task) -> str:
        """The "host:port" of a task; raises MailboxError for an unknown task."""
        job, index = task
        addresses = self._cluster.get(job, [])
        if not 0 <= index < len(addresses):
            raise MailboxError(f"task {task_name(task)} is not in the cluster "
                               f"{self._cluster}", task_name(task), "")
        return addresses[index]

    @property
    def tasks(self) -> list[Task]:
        """Every task of the cluster."""
        return [(job, i) for job, addresses in self._cluster.items()
                for i in range(len(addresses))]

    # -------------------------------------------------------------- messages
    def send(self, task: Task, box: str, message: bytes, timeout_s: float) -> None:
        """Puts `message` into `task`'s box.

        Raises:
            MailboxError: naming the task and address when it cannot be
                reached or the box is closed or full for `timeout_s`.
        """
        ops = self._box(task, box)
        self._run(task, ops["enqueue"], timeout_s, f"send to box {box!r}",
                  {ops["message"]: self._tag + b"\0" + message})

    def receive(self, task: Task, box: str, timeout_s: float) -> bytes:
        """Takes the next message of this job out of `task`'s box, waiting up to `timeout_s`.

        Raises:
            MailboxTimeout: nothing arrived in time.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise MailboxTimeout(f"task {task_name(task)} at {self.address(task)}: nothing "
                                     f"arrived in box {box!r} within {timeout_s:g}s",
                                     task_name(task), self.address(task))
            raw = self._run(task, self._box(task, box)["dequeue"], remaining,
                            f"receive from box {box!r}")
            message = self._untag(raw)
            if message is not None:
                return message

    def receive_all(self, task: Task, box: str, timeout_s: float = 10.0) -> list[bytes]:
        """Every message of this job now in `task`'s box (maybe none), without waiting."""
        ops = self._box(task, box)
        count = int(self._run(task, ops["size"], timeout_s, f"read box {box!r}"))
        if not count:
            return []
        raw = self._run(task, ops["dequeue_many"], timeout_s, f"receive from box {box!r}",
                        {ops["count"]: count})
        return [m for m in map(self._untag, raw) if m is not None]

    def waiting(self, task: Task, box: str, timeout_s: float = 10.0) -> int:
        """How many messages (of any job) wait in `task`'s box now."""
        return int(self._run(task, self._box(task, box)["size"], timeout_s, f"read box {box!r}"))

    def close_box(self, task: Task, box: str, timeout_s: float = 10.0) -> None:
        """Closes a box: later sends fail (the sender retries elsewhere or reports it)."""
        self._run(task, self._box(task, box)["close"], timeout_s, f"close box {box!r}")

    # ------------------------------------------------------------- liveness
    def wait_until_up(self, tasks: Sequence[Task], timeout_s: float) -> None:
        """Waits until every task's TensorFlow server answers.

        First waits for its port to accept connections (cheap, so a task that
        starts late costs no gRPC reconnection back-off), then runs an op on
        the task.

        Raises:
            MailboxError: naming the first task (and its address) that did
                not answer within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        for task in tasks:
            address = self.address(task)
            while not accepts(address):
                if time.monotonic() > deadline:
                    raise MailboxError(
                        f"task {task_name(task)} at {address} did not answer within "
                        f"{timeout_s:g}s (nothing accepts connections there; is its "
                        "server started, e.g. `autodist serve`, and is the address right?)",
                        task_name(task), address)
                time.sleep(_CONNECT_POLL_S)
            while True:
                remaining = max(1.0, min(_PING_TIMEOUT_S, deadline - time.monotonic()))
                try:
                    self._run(task, self._box(task, DONE)["size"], remaining, "answer")
                    break
                except MailboxTimeout:
                    raise
                except MailboxError:
                    # Its server went away after accepting (a served task between two
                    # jobs: the last job's process ends, the next one starts on the port).
                    if time.monotonic() + _CONNECT_POLL_S > deadline:
                        raise
                    time.sleep(_CONNECT_POLL_S)

    def close(self, tasks: Sequence[Task] | None = None) -> None:
        """Closes the client sessions to `tasks` (default: all; the boxes stay with their
        tasks).

        Close a task's session before the task can end (right after sending
        it its last message): closing a session whose task is gone waits for
        gRPC to give up (about 10 s). If it is gone already, closing fails,
        which does not matter.
        """
        for task in list(self._sessions) if tasks is None else tasks:
            self._forget_session(task)

    # ------------------------------------------------------------ internals
    def _untag(self, raw: bytes) -> bytes | None:
        tag, _, message = bytes(raw).partition(b"\0")
        return message if self.job_id is None or tag == self._tag else None

    def _box(self, task: Task, box: str) -> dict:
        key = (task, box)
        if key not in self._ops:
            graph = self._graph(task)
            job, index = task
            with graph.as_default(), tf.device(f"/job:{job}/replica:0/task:{index}/device:CPU:0"), \
                    tf.compat.v1.container(CONTAINER):
                queue = tf.queue.FIFOQueue(CAPACITY, [tf.string], shapes=[[]],
                                           shared_name=f"autodist/mailbox/{box}",
                                           name=f"mailbox_{box}")
                message = tf.compat.v1.placeholder(tf.string, [])
                count = tf.compat.v1.placeholder(tf.int32, [])
                self._ops[key] = {"message": message, "enqueue": queue.enqueue(message),
                                  "dequeue": queue.dequeue(), "size": queue.size(),
                                  "count": count, "dequeue_many": queue.dequeue_many(count),
                                  "close": queue.close()}
        return self._ops[key]

    def _graph(self, task: Task) -> tf.Graph:
        # One graph per task: a session places every node of its graph, and a
        # session filtered to one task cannot place nodes of another.
        if task not in self._graphs:
            self._graphs[task] = tf.Graph()
        return self._graphs[task]

    def _session(self, task: Task, timeout_s: float) -> tf.compat.v1.Session:
        if task not in self._sessions:
            job, index = task
            # The operation timeout bounds creating the session on the task's
            # master, which RunOptions do not (from a process that runs a
            # server of the same cluster, it would wait for a dead task forever).
            config = tf.compat.v1.ConfigProto(device_filters=[f"/job:{job}/task:{index}"],
                                              operation_timeout_in_ms=_ms(timeout_s))
            self._sessions[task] = tf.compat.v1.Session(f"grpc://{self.address(task)}",
                                                        graph=self._graph(task), config=config)
        return self._sessions[task]

    def _run(self, task: Task, fetch, timeout_s: float, what: str, feed=None):
        options = tf.compat.v1.RunOptions(timeout_in_ms=_ms(timeout_s))
        address = self.address(task)
        try:
            return self._session(task, timeout_s).run(fetch, feed_dict=feed, options=options)
        except tf.errors.DeadlineExceededError as e:
            raise MailboxTimeout(f"task {task_name(task)} at {address}: could not {what} "
                                 f"within {timeout_s:g}s", task_name(task), address) from e
        except tf.errors.AbortedError as e:
            # "Session ... is not found": the task's server restarted since this session
            # was made (a served task runs each job in a fresh process on its port). The
            # next run makes a session on the new server.
            self._forget_session(task)
            raise MailboxError(f"task {task_name(task)} at {address}: could not {what}: its "
                               f"server restarted ({e.message.strip()})", task_name(task),
                               address) from e
        except (tf.errors.UnavailableError, tf.errors.CancelledError,
                tf.errors.OutOfRangeError) as e:
            raise MailboxError(f"task {task_name(task)} at {address}: could not {what}: "
                               f"{e.message.strip()}", task_name(task), address) from e

    def _forget_session(self, task: Task) -> None:
        session = self._sessions.pop(task, None)
        if session is not None:
            try:
                session.close()
            except tf.errors.OpError:
                pass


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))

