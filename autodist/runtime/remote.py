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
mailbox over TensorFlow (`autodist.runtime.mailbox`), then starts the chief
(worker task 0) as a child process on its own host, as a local cluster
would. Everything after that between tasks also goes through TensorFlow.
"""
from __future__ import annotations

import os
import time
from typing import Any, Mapping

from autodist.ir.errors import AutodistError, ResourceSpecError
from autodist.ir.resource_spec import ResourceSpec, read_tf_config
from autodist.runtime import data as batching
from autodist.runtime.job import JobDir
from autodist.runtime.launcher import LocalCluster, TaskFailedError

_TF_CONFIG_JOBS = ("chief", "worker", "ps")  # the node order of ResourceSpec.from_tf_config
_RETRY_S = 0.2


def task_from_tf_config(
        tf_config: str | Mapping[str, Any] | None = None) -> tuple[ResourceSpec, tuple[str, int]]:
    """The cluster and this process's own (job, task index) in it, from TF_CONFIG.

    TF_CONFIG names tasks as the operator does (``chief:0``, ``worker:i``,
    ``ps:i``); the ResourceSpec makes the chief worker task 0 and numbers the
    other workers after it, so ``worker:0`` of a TF_CONFIG with a chief job is
    worker task 1 here.

    Args:
        tf_config: The JSON string or parsed dict; None reads the environment.

    Raises:
        ResourceSpecError: TF_CONFIG is missing, malformed, or its task is not
            in its cluster.
    """
    tf_config = read_tf_config(tf_config)
    spec = ResourceSpec.from_tf_config(tf_config)
    task = tf_config.get("task") if isinstance(tf_config, Mapping) else None
    cluster = tf_config["cluster"]
    kind = task.get("type") if isinstance(task, Mapping) else None
    index = task.get("index", 0) if isinstance(task, Mapping) else None
    if kind not in _TF_CONFIG_JOBS or not isinstance(index, int) or \
            not 0 <= index < len(cluster.get(kind) or []):
        raise ResourceSpecError(
            "TF_CONFIG must name this process's task in its cluster, e.g. "
            f'"task": {{"type": "worker", "index": 1}}. Received task {task!r} for cluster '
            f"{dict(cluster)!r}")
    offset = sum(len(cluster.get(job) or []) for job in
                 _TF_CONFIG_JOBS[:_TF_CONFIG_JOBS.index(kind)])
    return spec, spec.task_of(offset + index)


def task_from_spec_file(path: str, task: str | None) -> tuple[ResourceSpec, tuple[str, int]]:
    """The cluster of a resource-spec YAML file and the task named "job:index" in it."""
    spec = ResourceSpec.from_yaml(path)
    tasks = [spec.task_of(i) for i in range(len(spec.nodes))]
    job, _, index = (task or "").partition(":")
    if not index.isdigit() or (job, int(index)) not in tasks:
        raise ResourceSpecError(f"--task must name a task of {path!r} as JOB:INDEX, one of "
                                f"{[f'{j}:{i}' for j, i in tasks]}. Received: {task!r}")
    return spec, (job, int(index))


def check_this_is_the_chief(spec: ResourceSpec) -> None:
    """Raises unless this process may drive `spec` (TF_CONFIG, if set, names the chief).

    Raises:
        AutodistError: naming this process's task and what to run instead.
    """
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return
    try:
        own_spec, own = task_from_tf_config(raw)
    except ResourceSpecError:
        return  # a TF_CONFIG of something else: the spec was given explicitly
    if own_spec != spec:
        return
    if own != spec.task_of(spec.chief_index):
        raise AutodistError(
            f"this process is task {own[0]}:{own[1]} of its TF_CONFIG, not the chief: "
            "run the training script on the chief only (TF_CONFIG task chief:0, or worker:0 "
            "without a chief job) and `autodist serve --tf-config` on every other host")


class RemoteCluster:
    """A cluster whose other tasks already serve on their hosts; the chief runs here.

    Use as a context manager, like `LocalCluster`:

        with RemoteCluster(job, spec, startup_timeout_s=120) as cluster:
            cluster.wait_ready(timeout_s=60)
            cluster.wait_workers(timeout_s=600)

    Args:
        job: The job directory written by the driver (on this host).
        spec: The cluster; every node needs its port.
        startup_timeout_s: Bound on each other task answering and taking its job.
    """

    def __init__(self, job: JobDir, spec: ResourceSpec, *, startup_timeout_s: float) -> None:
        missing = [f"{n.address} (node {i})" for i, n in enumerate(spec.nodes) if not n.port]
        if missing:
            raise AutodistError(f"launch='remote' needs the port of every node; none for "
                                f"{missing}")
        self.job = job
        self.spec = spec
        self.startup_timeout_s = startup_timeout_s
        self.chief = LocalCluster(job, spec, nodes=[spec.chief_index], port_retries=0)

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
        """Ships every other task its job, then starts the chief here."""
        self.ship()
        self.chief.start()

    def ship(self) -> None:
        """Puts each other task's job into its job mailbox.

        Raises:
            TaskFailedError: naming the task and its address when it does not
                answer or take the job within `startup_timeout_s`.
        """
        from autodist.runtime import mailbox  # pylint: disable=import-outside-toplevel

        self.job.write_ports([n.port for n in self.spec.nodes])
        mail = mailbox.Mailboxes(self.spec.cluster_def(), job_id=self.job.config().job_id)
        try:
            chief = self.spec.task_of(self.spec.chief_index)
            for task in mail.tasks:
                if task != chief:
                    self._ship_one(mail, task, self._archive(task))
        finally:
            mail.close()

    def _archive(self, task: tuple[str, int]) -> bytes:
        if task[0] != "worker":
            return self.job.pack(with_data=False)
        config = self.job.config()
        strategy = self.job.strategy()
        num_examples, _ = self.job.shard()
        prefix = f"/job:worker/task:{task[1]}/"
        devices = strategy.virtual_node_devices
        mine = [i for i, d in enumerate(devices) if d.startswith(prefix)]
        steps = batching.steps_per_epoch(num_examples, config.global_batch_size,
                                         config.steps_per_epoch)
        rows = batching.rows_read(num_examples, config.global_batch_size, steps, config.epochs,
                                  config.shuffle, config.seed, len(devices), mine)
        return self.job.pack(rows)

    def _ship_one(self, mail, task: tuple[str, int], archive: bytes) -> None:
        from autodist.runtime import mailbox  # pylint: disable=import-outside-toplevel

        deadline = time.monotonic() + self.startup_timeout_s
        name = f"{task[0]}:{task[1]}"
        address = mail.address(task)
        while True:
            remaining = deadline - time.monotonic()
            try:
                mail.wait_until_up([task], max(remaining, 0.0))
                mail.send(task, mailbox.JOB, archive, max(remaining, 1.0))
                return
            except mailbox.MailboxError as e:
                # A task that just finished a job closes its box; its next process follows.
                if time.monotonic() + _RETRY_S > deadline:
                    raise TaskFailedError(
                        f"task {name} at {address} did not take its job within "
                        f"{self.startup_timeout_s:g}s: {e}. Start `autodist serve --tf-config` "
                        "there (or check its address and port).", name, address) from e
                time.sleep(_RETRY_S)

    def abort(self, timeout_s: float = 5.0) -> None:
        """Tells every other task that this job failed (they end at once); best effort."""
        from autodist.runtime import mailbox  # pylint: disable=import-outside-toplevel

        mail = mailbox.Mailboxes(self.spec.cluster_def(), job_id=self.job.config().job_id)
        chief = self.spec.task_of(self.spec.chief_index)
        try:
            for task in mail.tasks:
                if task != chief and mailbox.accepts(mail.address(task)):
                    try:
                        mail.send(task, mailbox.ABORT, b"abort", timeout_s)
                    except mailbox.MailboxError:
                        pass  # not up, or already gone: nothing to stop there
        finally:
            mail.close()

    def wait_ready(self, timeout_s: float) -> None:
        self.chief.wait_ready(timeout_s)

    def wait_workers(self, timeout_s: float, on_poll=None) -> None:
        self.chief.wait_workers(timeout_s, on_poll=on_poll)

    def stop(self, grace_s: float = 5.0) -> None:
        self.chief.stop(grace_s)

