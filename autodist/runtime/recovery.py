"""Going on without a dead worker (`fit(..., on_failure="continue")`).

With `on_failure="continue"` every step is atomic: the synchronizer starts no
update before all the step's gradients are aggregated, so a step that fails
because a worker died applies nothing. The chief, whose step fails with the
others' (a collective aborted by the lost connection, or a parameter-server
take that times out), saves the state after the last completed step in
memory-backed form to the job directory (`JobDir.recovery`). The driver then
starts the job again on the survivors (the dead worker's node removed, tasks
renumbered, virtual nodes remapped so the global batch stays B) from that
state, at the next step of the same data schedule. No applied update is
lost, and the run equals one that never failed (synchronous strategies).
A stopped or hung worker (no heartbeat for half a step's timeout,
`launch.heartbeats`) is killed by the launcher and recovered from alike.

TensorFlow aborts every collective of a process that took part in a failed
collective, and nothing resets that short of a new process
(`docs/tf_elastic_notes.md`), so the survivors' processes are started anew;
what survives is the state. The job cannot go on when the chief or a
parameter-server task dies, or when a dead worker held parameter-server
variables: the original error is raised.
"""
from __future__ import annotations


import dataclasses
import uuid
from typing import Any, Callable

import numpy as np

from autodist.ir.device_names import DeviceNameError, TaskName
from autodist.ir.errors import AutodistError
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.launch.errors import TaskFailedError
from autodist.launch.job import JobDir
from autodist.runtime.records import LossRecord, ProgressRecord
from autodist.runtime.run_config import RunConfig

# In the recovery file: the run step to resume at (see worker.save_recovery).
NEXT_STEP = "autodist/next_step"


def dead_worker(task: str) -> int | None:
    """The index of a failed non-chief worker task ("worker:2" -> 2), else None."""
    try:
        name = TaskName.parse_short(task)
    except DeviceNameError:
        return None
    return name.index if name.job == "worker" and name.index != 0 else None


def without_worker(spec: ResourceSpec, task_index: int) -> ResourceSpec:
    """`spec` without the node of worker task `task_index` (tasks renumbered)."""
    return spec.with_worker_tasks([t for t in range(spec.num_worker_tasks) if t != task_index])


def strategy_without(strategy: Strategy, task_index: int) -> Strategy:
    """`strategy` without worker task `task_index`: its replica dropped, tasks renumbered.

    Devices of later worker tasks move down by one, as in `without_worker`;
    virtual nodes keep B and V and are spread over the remaining replicas.

    Raises:
        AutodistError: a variable lives on the dead worker.
    """
    dead = TaskName("worker", task_index)
    for config in strategy.variables:
        for i, sync in enumerate(config.shards):
            destination = sync.ps.reduction_destination
            if sync.WhichOneof("kind") == "ps" and destination.startswith(dead.device_prefix):
                raise AutodistError(f"variable {config.var_name!r} shard {i} lived on the "
                                    f"dead worker {task_index} ({destination})")
    out = strategy.with_replicas([d for d in strategy.replicas
                                  if not d.startswith(dead.device_prefix)])
    workers = {d.index for d in out.devices() if d.job == "worker"}
    return out.with_worker_tasks_renumbered({t: t - (t > task_index) for t in workers})


def resume_point(job: JobDir) -> tuple[dict[str, np.ndarray], int] | None:
    """(state after the last completed step, the step to resume at), if saved."""
    if not job.recovery().exists():
        return None
    with np.load(job.recovery()) as arrays:
        values = {name: arrays[name] for name in arrays.files}
    return values, int(values.pop(NEXT_STEP))


def newest_saved_state(job: JobDir) -> tuple[dict[str, np.ndarray], int] | None:
    """`resume_point` of the newest state saved by `job` or by one of its recovery
    jobs (``recovery-<k>`` under it), or None."""
    jobs = [job] + [JobDir(p) for p in sorted(job.path.glob("recovery-*")) if p.is_dir()]
    saved = [j for j in jobs if j.recovery().exists()]
    if not saved:
        return None
    return resume_point(max(saved, key=lambda j: j.recovery().stat().st_mtime))


def completed_losses(job: JobDir, workers: int, first: int,
                     steps: int) -> tuple[list[float], list[float], list[int]]:
    """Global losses and the chief's step times of steps first..first+steps-1.

    Each worker of a recoverable run appends its weighted loss of every step
    it ran to the job directory as soon as its step's run returns (before
    waiting for the chief's update); the global loss of a completed step is
    their sum. Where a worker's record is missing (it died between handing
    over its gradient and recording) the chief's own estimate (its replicas'
    mean loss, from its progress records) stands in; the third list names
    those steps.
    """
    parts: dict[int, list[float]] = {}
    for task in range(workers):
        path = job.file(f"losses_{task}.jsonl")
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            if line.strip():
                record = LossRecord.from_json(line)
                parts.setdefault(record.step, []).append(record.loss)
    progress: list[ProgressRecord] = []
    path = job.file("progress.jsonl")
    if path.exists():
        progress = [ProgressRecord.from_json(line) for line in path.read_text().splitlines()
                    if line.strip()]
    losses, estimated = [], []
    for k in range(steps):
        found = parts.get(first + k, [])
        if len(found) == workers:
            losses.append(sum(found))
        else:
            losses.append(progress[k].loss)
            estimated.append(first + k)
    return losses, [r.seconds for r in progress[:steps]], estimated


@dataclasses.dataclass
class Outcome:
    """How a run ended, through its recoveries.

    Attributes:
        job: The job that finished (the last recovery's, or the first).
        spec: Its cluster (without the workers that died).
        earlier_losses: Global losses of the steps completed before the
            last recovery.
        earlier_times: The chief's times of those steps.
        recoveries: Per failure, {"step": the step the job resumed at,
            "failed_task": the dead worker's task index at that time,
            "cause": how it failed (its exit code, or "stopped responding"
            with the seconds of silence),
            "workers": workers after it, "estimated_loss_steps": steps whose
            global loss is the chief's estimate}.
    """

    job: JobDir
    spec: ResourceSpec
    earlier_losses: list[float] = dataclasses.field(default_factory=list)
    earlier_times: list[float] = dataclasses.field(default_factory=list)
    recoveries: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def run_recovering(job: JobDir, strategy: Strategy, spec: ResourceSpec, *,
                   run_cluster: Callable[[JobDir, ResourceSpec], None],
                   write_job: Callable[[JobDir, Strategy, ResourceSpec, RunConfig,
                                        dict[str, np.ndarray]], None],
                   on_new_job: Callable[[JobDir], None]) -> Outcome:
    """Runs a job to its end, going on without each non-chief worker that dies.

    After a failure the chief has saved the state after the last completed
    step (`resume_point`); a new job, in ``recovery-<k>`` under the first
    job's directory, resumes there on the surviving workers with the
    strategy's replicas of the dead worker removed.

    Args:
        job: The first job.
        strategy: Its strategy.
        spec: Its cluster.
        run_cluster: Runs a job on a cluster to its end (raises TaskFailedError).
        write_job: Writes a recovery job: (its directory, strategy, spec,
            config, initial values).
        on_new_job: Called with each recovery job before it runs.

    Raises:
        TaskFailedError: the chief or a parameter server died, the dead
            worker held parameter-server variables, or nothing was saved.
    """
    outcome = Outcome(job, spec)
    config = RunConfig.of_job(job)
    while True:
        try:
            run_cluster(outcome.job, outcome.spec)
            return outcome
        except TaskFailedError as error:
            dead = dead_worker(error.task)
            resumed = resume_point(outcome.job) if dead is not None else None
            if resumed is None:
                raise
            values, next_step = resumed
            try:
                strategy = strategy_without(strategy, dead)
            except AutodistError as e:
                raise error from e
            losses, times, estimated = completed_losses(
                outcome.job, outcome.spec.num_worker_tasks, config.start_step,
                next_step - config.start_step)
            outcome.spec = without_worker(outcome.spec, dead)
            outcome.earlier_losses += losses
            outcome.earlier_times += times
            outcome.recoveries.append({"step": next_step, "failed_task": dead,
                                       "cause": str(error).split(";")[0].splitlines()[0],
                                       "workers": outcome.spec.num_worker_tasks,
                                       "estimated_loss_steps": estimated})
            config = dataclasses.replace(config, start_step=next_step, job_id=uuid.uuid4().hex)
            path = job.path / f"recovery-{len(outcome.recoveries)}"
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            outcome.job = JobDir(path)
            write_job(outcome.job, strategy, outcome.spec, config, values)
            on_new_job(outcome.job)
