"""Running one job on the cluster to its end: local processes or remote tasks.

Starts the job's tasks (`launch.local.LocalCluster`, or ships the job to the
hosts' `autodist serve` tasks: `launch.remote.RemoteCluster`), waits for the
workers within the fit's bounds, and on a failure or Ctrl-C leaves the chief
the time to save what was trained before the cluster is torn down.
"""
from __future__ import annotations

import pathlib
import shutil
import time
from typing import Callable, Collection

import numpy as np

from autodist.ir.device_names import TaskName
from autodist.ir.resource_spec import ResourceSpec
from autodist.launch import heartbeats
from autodist.launch.errors import TaskFailedError
from autodist.launch.job import JobDir
from autodist.launch.local import LocalCluster
from autodist.launch.remote import RemoteCluster
from autodist.runtime import batching, recovery
from autodist.runtime.elastic import scheduled_tasks
from autodist.runtime.entry import TASK_MODULE
from autodist.runtime.run_config import RunConfig


class ClusterJobs:
    """Runs jobs on one cluster, as a `DistributedRun` launches them.

    Args:
        spec: The cluster.
        launch: "local" (every task a process started here) or "remote".
        allow_exposed: Local tasks may run reachable from other hosts.
        secret: The shared secret signing remote jobs (None: unsigned).
        step_timeout_s: Bound on one step of any task.
        startup_timeout_s: Bound on the cluster coming up.
        request_stop: Asks a job's chief to stop at its next step (Ctrl-C).
    """

    def __init__(self, spec: ResourceSpec, *, launch: str, allow_exposed: bool,
                 secret: bytes | None, step_timeout_s: float, startup_timeout_s: float,
                 request_stop: Callable[[JobDir], None]) -> None:
        self.spec = spec
        self.launch = launch
        self.allow_exposed = allow_exposed
        self.secret = secret
        self.step_timeout_s = step_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.request_stop = request_stop

    def run(self, job: JobDir, timeout_s: float, on_poll: Callable[[], object],
            spec: ResourceSpec | None = None, absent: Collection[str] = (),
            recovering: bool = False) -> None:
        """Runs the job to its end. A failed worker leaves the chief time to save its
        state (it learns of the failure within a step's timeout) before the cluster
        is torn down.

        Args:
            job: The job.
            timeout_s: Bound on the whole job.
            on_poll: Called while the workers run (the driver's progress).
            spec: The cluster of this job, if not the run's (after a recovery).
            absent: Remote launch: tasks ("job:index") lost in an earlier job,
                left out of this one.
            recovering: Remote launch, a run that recovers: a failure is
                raised as what ended the job (`RemoteCluster.failure`: the
                tasks that did not come back within `startup_timeout_s`, or
                a killed chief).

        Raises:
            TaskFailedError: a task failed (remote and `recovering`: a
                `TasksLostError` or `ChiefKilledError` where one applies).
        """
        spec = spec or self.spec
        cluster = (LocalCluster(job, spec, task_module=TASK_MODULE,
                                allow_exposed=self.allow_exposed,
                                hang_timeout_s=heartbeats.hang_timeout(self.step_timeout_s))
                   if self.launch == "local" else self._remote(job, spec, absent))
        try:
            self._run(job, cluster, timeout_s, on_poll)
        except TaskFailedError as error:
            if self.launch != "remote" or not recovering:
                raise
            failure = cluster.failure(error, self.startup_timeout_s)
            if failure is error:
                raise
            raise failure from error

    def _remote(self, job: JobDir, spec: ResourceSpec, absent: Collection[str]) -> RemoteCluster:
        """The remote cluster of `job`: workers that no segment includes are left out, and
        those it grows onto later are shipped the job once their slot is served."""
        schedule = scheduled_tasks(RunConfig.of_job(job), spec.num_worker_tasks)
        return RemoteCluster(job, spec, task_module=TASK_MODULE,
                             worker_rows=lambda task: rows_read_by(job, task),
                             startup_timeout_s=self.startup_timeout_s, secret=self.secret,
                             absent=set(absent) | {f"worker:{t}" for t in schedule.absent},
                             late=[f"worker:{t}" for t in schedule.late])

    def _run(self, job: JobDir, cluster: LocalCluster | RemoteCluster, timeout_s: float,
             on_poll: Callable[[], object]) -> None:
        with cluster:
            cluster.wait_ready(self.startup_timeout_s)
            try:
                cluster.wait_workers(timeout_s, on_poll=on_poll)
            except TaskFailedError as error:
                if recovery.dead_worker(error.task) is not None:
                    cluster.wait_exit("worker", 0, self.step_timeout_s + 30.0)
                raise
            except KeyboardInterrupt:
                # As Keras keeps the weights trained so far: the chief stops at its
                # next step and writes them (bounded; a second Ctrl-C gives up).
                self.request_stop(job)
                deadline = time.monotonic() + self.step_timeout_s
                try:
                    while not job.file("final_weights.npz").exists() and \
                            time.monotonic() < deadline and \
                            cluster.wait_exit("worker", 0, 0.05) is None:
                        pass
                except KeyboardInterrupt:
                    pass
                raise


def discard(path: pathlib.Path) -> None:
    """A temporary job directory after a failure: its copy of the data goes, and its logs
    stay where a task wrote any (an error names them); a run refused before any task
    started leaves nothing."""
    logs = path / "logs"
    if not any(log.stat().st_size for log in logs.glob("*.log")) if logs.is_dir() else True:
        shutil.rmtree(path, ignore_errors=True)
        return
    for name in ("data", "init.npz", "final_weights.npz", "weights", "recovery.npz"):
        target = path / name
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        elif target.exists():
            target.unlink()


def rows_read_by(job: JobDir, task_index: int) -> np.ndarray | None:
    """The rows of the job's data that worker task `task_index` reads over the run (None:
    every row: a job with a dataset, which every worker reads whole, or a job that
    may resize or switch strategies, whose virtual nodes may move to other workers)."""
    if job.dataset() is not None:
        return None
    config = RunConfig.of_job(job)
    if config.elastic or config.plans:
        return None
    num_examples, _ = job.shard()
    devices = job.strategy().virtual_node_devices
    prefix = TaskName("worker", task_index).device_prefix
    mine = [i for i, d in enumerate(devices) if d.startswith(prefix)]
    schedule = batching.EpochSchedule(num_examples, config.epochs, config.steps_per_epoch,
                                      lambda step: config.global_batch_size)
    order = batching.ArrayOrder(num_examples, config.shuffle, config.seed, config.first_epoch,
                                job.order())
    return batching.rows_read(schedule, order, len(devices), mine)
