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
what survives is the state. When the chief or a parameter-server task
dies, nothing saved the last completed step (a parameter server's variables
are gone with it): where the fit writes checkpoints (`checkpoint_dir`), the
job starts again on fresh processes from the newest checkpoint, else the
original error is raised; so it is when a dead worker held parameter-server
variables.

Under ``launch="remote"`` the served tasks keep their TF_CONFIG identities,
so a recovery job runs on the same cluster with its membership changed, as
an elastic job starting at its first step (`run_recovering_remote`). After a
failure the driver waits (up to the startup timeout) for every served task
to answer again; the tasks that do not (their host or `autodist serve`
died: `launch.remote.TasksLostError`) are left out of every later job. A lost
worker's place is taken by a spare where one is served: a worker slot of
TF_CONFIG outside the job's membership (e.g. `fit(resize_at={0: [0, 1, 2]})`
on 4 worker slots) whose `autodist serve` answers; else the survivors go on
alone. Either way from the last completed step, with B and V kept. A worker
whose `autodist serve` is started again (a replacement in its slot, e.g. a
restarted pod) before the failure is judged is simply a member again. A killed chief
(`ChiefKilledError`), or a lost worker whose chief could not save the last
completed step, restarts the job from the newest checkpoint of the fit's
`checkpoint_dir` (from the fit's start when none is written yet). So does a
parameter server whose process or host died and whose slot answers again
within the startup timeout (its `autodist serve` restarted, e.g. a
restarted pod: `launch.remote.PeerRestartedError`): the variables it held
are gone, so the job restarts from the newest checkpoint even where the
chief saved a state. Without checkpointing, or with a parameter server
that does not come back (it held the variables and has no stand-in), the
error names the dead task.
"""
from __future__ import annotations


import dataclasses
import uuid
from typing import Any, Callable, Collection, Sequence

import numpy as np

from autodist.adapt.task_providers import ServedHosts
from autodist.ir.device_names import DeviceNameError, TaskName
from autodist.ir.errors import AutodistError
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.launch.errors import TaskFailedError
from autodist.launch.job import JobDir
from autodist.launch.remote import ChiefKilledError, PeerRestartedError, TasksLostError
from autodist.runtime import checkpoint, elastic
from autodist.runtime.records import LossRecord, ProgressRecord
from autodist.runtime.run_config import RunConfig

# In the recovery file: the run step to resume at (see worker.save_recovery).
NEXT_STEP = "autodist/next_step"
# A remote run gives up after this many recoveries beyond one per worker task
# (a chief killed again and again).
EXTRA_RESTARTS = 3

# Runs a job to its end: (its directory, its cluster, the tasks left out of it).
RunCluster = Callable[[JobDir, ResourceSpec, Collection[str]], None]
WriteJob = Callable[[JobDir, Strategy, ResourceSpec, RunConfig, dict[str, np.ndarray]], None]


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


def completed_losses(job: JobDir, workers: int | Sequence[int], first: int,
                     steps: int) -> tuple[list[float], list[float], list[int]]:
    """Global losses and the chief's step times of steps first..first+steps-1.

    `workers`: the worker tasks that ran them (a number n: tasks 0..n-1).

    Each worker of a recoverable run appends its weighted loss of every step
    it ran to the job directory as soon as its step's run returns (before
    waiting for the chief's update); the global loss of a completed step is
    their sum. Where a worker's record is missing (it died between handing
    over its gradient and recording) the chief's own estimate (its replicas'
    mean loss, from its progress records) stands in; the third list names
    those steps.
    """
    tasks = range(workers) if isinstance(workers, int) else list(workers)
    parts: dict[int, list[float]] = {}
    for task in tasks:
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
        if len(found) == len(tasks):
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
                   run_cluster: RunCluster, write_job: WriteJob,
                   on_new_job: Callable[[JobDir], None],
                   checkpoint_dir: str | None = None) -> Outcome:
    """Runs a job to its end, going on without each non-chief worker that dies.

    After a failure the chief has saved the state after the last completed
    step (`resume_point`); a new job, in ``recovery-<k>`` under the first
    job's directory, resumes there on the surviving workers with the
    strategy's replicas of the dead worker removed. Where the chief saved
    nothing (it died, or a parameter server did: the variables it held are
    gone) and the fit writes checkpoints, the new job starts from the newest
    checkpoint of `checkpoint_dir` (from the fit's start when none is written
    yet), on fresh processes of every task the failed job had but a dead
    non-chief worker.

    Args:
        job: The first job.
        strategy: Its strategy.
        spec: Its cluster.
        run_cluster: Runs a job on a cluster to its end (raises TaskFailedError);
            no task is left out of a local job.
        write_job: Writes a recovery job: (its directory, strategy, spec,
            config, initial values).
        on_new_job: Called with each recovery job before it runs.
        checkpoint_dir: The fit's checkpoint directory, or None.

    Raises:
        TaskFailedError: nothing was saved and no checkpoint is written (the
            chief or a parameter server died), the dead worker held
            parameter-server variables, or more restarts from checkpoints
            than `EXTRA_RESTARTS` plus one per worker task.
    """
    outcome = Outcome(job, spec)
    first = RunConfig.of_job(job)
    config = first
    first_values = job.init_values()
    limit = spec.num_worker_tasks + EXTRA_RESTARTS
    while True:
        try:
            run_cluster(outcome.job, outcome.spec, ())
            return outcome
        except TaskFailedError as error:
            dead = dead_worker(error.task)
            resumed = resume_point(outcome.job) if dead is not None else None
            if resumed is None and checkpoint_dir and len(outcome.recoveries) < limit:
                resumed = _checkpointed(checkpoint_dir, first, first_values)
            if resumed is None:
                raise
            values, next_step = resumed
            if dead is not None:
                try:
                    strategy = strategy_without(strategy, dead)
                except AutodistError as e:
                    raise error from e
            estimated = _keep_losses(outcome, outcome.job, range(outcome.spec.num_worker_tasks),
                                     config.start_step, next_step, first.start_step)
            if dead is not None:
                outcome.spec = without_worker(outcome.spec, dead)
            outcome.recoveries.append({
                "step": next_step, "failed_task": _task_index(error.task),
                "failed_job": error.task.partition(":")[0] or "worker",
                "cause": str(error).split(";")[0].splitlines()[0],
                "workers": outcome.spec.num_worker_tasks, "estimated_loss_steps": estimated})
            config = dataclasses.replace(config, start_step=next_step, job_id=uuid.uuid4().hex)
            path = job.path / f"recovery-{len(outcome.recoveries)}"
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            outcome.job = JobDir(path)
            write_job(outcome.job, strategy, outcome.spec, config, values)
            on_new_job(outcome.job)


def run_recovering_remote(job: JobDir, strategy: Strategy, spec: ResourceSpec, *,
                          run_cluster: RunCluster, write_job: WriteJob,
                          on_new_job: Callable[[JobDir], None],
                          checkpoint_dir: str | None) -> Outcome:
    """`run_recovering` for served tasks (``launch="remote"``): the cluster stays, the
    membership changes.

    After each failure `run_cluster` has raised what ended the job: tasks
    that did not come back (`TasksLostError`), a killed chief
    (`ChiefKilledError`), a task restarted mid-job (`PeerRestartedError`: a
    parameter server's restarts from the newest checkpoint, a worker's from
    the last completed step), or another failure, which is raised. The next job,
    in ``recovery-<k>``, leaves every lost task out; with lost workers it is
    elastic, on the survivors from its first step (`elastic.segments`), so
    the global batch and the virtual nodes stay. It resumes at the last
    completed step where the chief saved it (`resume_point`), else at the
    newest checkpoint of `checkpoint_dir`.

    Raises:
        TaskFailedError: a failure that is not a lost task or a killed chief;
            a lost parameter server; no saved state and no checkpointing;
            more recoveries than `EXTRA_RESTARTS` plus one per worker task.
        AutodistError: chained from the failure: the survivors cannot run
            the strategy (`elastic.check_elastic`).
    """
    outcome = Outcome(job, spec)
    first = RunConfig.of_job(job)
    config = first
    first_values = job.init_values()
    absent: set[str] = set()
    limit = spec.num_worker_tasks + EXTRA_RESTARTS
    members = list(elastic.scheduled_tasks(first, spec.num_worker_tasks).start)
    while True:
        try:
            run_cluster(outcome.job, spec, frozenset(absent))
            return outcome
        except TaskFailedError as error:
            lost = error.lost if isinstance(error, TasksLostError) else ()
            lost_ps = [t for t in lost if not t.startswith("worker:")]
            if not isinstance(error, (TasksLostError, ChiefKilledError, PeerRestartedError)) \
                    or lost_ps or len(outcome.recoveries) >= limit:
                raise
            # A restarted PS lost the variables it held: only a checkpoint has them.
            state_lost = isinstance(error, PeerRestartedError) and \
                not error.task.startswith("worker:")
            resumed = (None if state_lost else resume_point(outcome.job)) or (
                _checkpointed(checkpoint_dir, first, first_values) if checkpoint_dir else None)
            if resumed is None:
                saved = ("what it held is gone" if state_lost else
                         "the chief saved no state after the failure")
                raise TaskFailedError(
                    f"{error}\nThe run cannot go on: {saved} and the fit writes no "
                    "checkpoints (fit(checkpoint_dir=...) restarts from the newest)",
                    error.task, error.log) from error
            values, next_step = resumed
            absent |= set(lost)
            survivors = [t for t in members if f"worker:{t}" not in absent]
            following = sorted(survivors + served_spares(spec, members, absent,
                                                         len(members) - len(survivors)))
            partial = len(following) < spec.num_worker_tasks
            if partial:
                try:
                    elastic.check_elastic(strategy, spec)
                except AutodistError as e:
                    raise error from e
            estimated = _keep_losses(outcome, outcome.job, members, config.start_step,
                                     next_step, first.start_step)
            outcome.recoveries.append({
                "step": next_step, "failed_task": _task_index(error.task),
                "failed_job": error.task.partition(":")[0] or "worker",
                "cause": str(error).split(";")[0].splitlines()[0],
                "workers": len(following), "estimated_loss_steps": estimated})
            config = dataclasses.replace(
                config, start_step=next_step, job_id=uuid.uuid4().hex,
                resize_at={"0": following} if partial else None, elastic=partial)
            members = following
            path = job.path / f"recovery-{len(outcome.recoveries)}"
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            outcome.job = JobDir(path)
            write_job(outcome.job, strategy, spec, config, values)
            on_new_job(outcome.job)


def served_spares(spec: ResourceSpec, members: Sequence[int], lost: Collection[str],
                  count: int) -> list[int]:
    """Up to `count` worker slots outside `members`, not `lost` ("job:index"), whose
    `autodist serve` answers now (`ServedHosts`, lowest-numbered first): the spares that
    take lost workers' places."""
    if count <= 0:
        return []
    gone = {t for t in range(spec.num_worker_tasks) if f"worker:{t}" in lost}
    return ServedHosts.from_spec(spec).available(sorted(set(members) | gone))[:count]


def _checkpointed(directory: str, first: RunConfig, first_values: dict[str, np.ndarray]
                  ) -> tuple[dict[str, np.ndarray], int]:
    """The newest checkpoint of `directory` written by this run, with the step to resume
    at; the run's first values and step when it has none yet."""
    start = int(first_values.get(checkpoint.ITERATIONS, 0))
    prefix = checkpoint.latest(directory)
    if prefix is not None:
        values = checkpoint.load(prefix)
        done = int(values.get(checkpoint.ITERATIONS, 0)) - start
        if done >= 0:
            return values, first.start_step + done
    return dict(first_values), first.start_step


def _keep_losses(outcome: Outcome, job: JobDir, members: Sequence[int], job_start: int,
                 next_step: int, run_start: int) -> list[int]:
    """The losses and times of the steps before `next_step` in `outcome`: the failed
    job's completed steps added (their global losses where every member recorded one),
    or those after an older checkpoint dropped. Returns the steps whose loss is the
    chief's estimate."""
    if next_step >= job_start:
        losses, times, estimated = completed_losses(job, members, job_start,
                                                    next_step - job_start)
        outcome.earlier_losses += losses
        outcome.earlier_times += times
        return estimated
    del outcome.earlier_losses[next_step - run_start:]
    del outcome.earlier_times[next_step - run_start:]
    return []


def _task_index(task: str) -> int:
    """The task index of "job:index" (0 where it cannot be read)."""
    try:
        return TaskName.parse_short(task).index
    except DeviceNameError:
        return 0
