"""What a worker task does: build its program, initialize, train, report.

Runs inside a task process (see `task.py`). Workers read their job from a
job directory (shared with the driver on a local cluster, a shipped copy on
another host); everything else between tasks goes over TensorFlow: the chief
gathers the other workers' results through mailboxes, writes them with the
trained weights into its job directory, then tells every other task it is
done. All waits are bounded by the RunConfig's timeouts.

The parts of a task's training live in modules of their own: its program
and session (`worker_session`), its variables' first values
(`initial_values`), one step's feed, fetches and runs (`task_step`), how
its steps are reported (`step_reporting`), elastic membership and the
hand-over (`membership`), the chief's reads of the trained values
(`trained_values`: checkpoints, recovery, final weights), and the results
and failures sent to the chief (`worker_results`).
"""
from __future__ import annotations

import dataclasses
import logging
import pathlib
import time
from typing import Callable

import numpy as np
import tensorflow as tf

from autodist.ir.atomic import atomic_write
from autodist.ir.graph_item import GraphItem
from autodist.ir.strategy import Strategy
from autodist.kernels import global_batch
from autodist.kernels.program import Program
from autodist.kernels.variables import StorageVariable
from autodist.launch import mailbox
from autodist.launch.job import JobDir
from autodist.launch.mailbox import Mailboxes
from autodist.launch.server import server_config
from autodist.runtime import checkpoint
from autodist.runtime import elastic
from autodist.runtime import follow
from autodist.runtime import initial_values
from autodist.runtime import membership
from autodist.runtime import run_outs
from autodist.runtime import sharded_input
from autodist.runtime import worker_results
from autodist.runtime.dataset_stream import DatasetStream
from autodist.runtime.follow import CHIEF
from autodist.runtime.records import (MonitoredStep, ResizeEvent, WorkerMessage, WorkerResult,
                                      add_states)
from autodist.runtime.run_config import RunConfig
from autodist.runtime.step_data import ArrayData, StepData
from autodist.runtime.step_reporting import StepOutcome, StepReporter, Unreported, step_reporter
from autodist.runtime.task_step import StepResult, TaskStep
from autodist.runtime.trained_values import TrainedValues, write_weights
from autodist.runtime.worker_session import (ProgramSession, WorkerError, build_program,
                                             open_session, session_config)

logger = logging.getLogger(__name__)

# Importable from here, where they were defined before.
__all__ = ["CHIEF", "Trainer", "WorkerError", "build_program", "open_session",
           "open_step_data", "run_worker", "server_config", "session_config",
           "write_weights"]


@dataclasses.dataclass
class StepLog:
    """What this task's steps gave so far, for its `WorkerResult`.

    Attributes:
        losses: Its weighted loss of each step (0.0 while idle).
        times: Its time of each step (0.0 while idle).
        resizes: The chief's: every membership change.
        monitored: Its measurements of every monitored step.
        epoch_metrics: By epoch, its contribution to the metrics' state.
        max_lead: The most steps it started ahead of the slowest.
    """

    losses: list[float] = dataclasses.field(default_factory=list)
    times: list[float] = dataclasses.field(default_factory=list)
    resizes: list[ResizeEvent] = dataclasses.field(default_factory=list)
    monitored: list[MonitoredStep] = dataclasses.field(default_factory=list)
    epoch_metrics: dict[int, tuple] = dataclasses.field(default_factory=dict)
    max_lead: int = 0

    def idle(self, steps: int) -> None:
        """`steps` steps this task did not run: no loss, no time."""
        self.losses += [0.0] * steps
        self.times += [0.0] * steps

    def add(self, epoch: int, step: StepResult) -> None:
        """A step of `epoch` this task ran."""
        self.losses.append(step.loss)
        self.times.append(step.seconds)
        self.max_lead = max(self.max_lead, step.lead)
        if step.monitored is not None:
            self.monitored.append(step.monitored)
        self.epoch_metrics[epoch] = add_states(self.epoch_metrics.get(epoch, ()),
                                                step.metrics)

    def result(self, steps_per_epoch: int, epoch_starts: tuple[int, ...],
               step_examples: tuple[int, ...]) -> WorkerResult:
        """This task's result."""
        metrics = self.epoch_metrics
        return WorkerResult(
            losses=tuple(self.losses), step_times=tuple(self.times),
            steps_per_epoch=steps_per_epoch, epoch_starts=epoch_starts,
            step_examples=step_examples, max_lead=self.max_lead,
            resizes=tuple(self.resizes), monitor=tuple(self.monitored),
            epoch_metrics=tuple(metrics.get(e, ()) for e in range(
                max(metrics) + 1 if metrics else 0)))


class Trainer:
    """The training loop of one worker task.

    Args:
        job: The job directory.
        task_index: This worker's task index.
        target: The session target (this task's server).
        mail: The cluster's mailboxes (step reports and run limits of a
            followed run).
    """

    def __init__(self, job: JobDir, task_index: int, target: str, mail: Mailboxes) -> None:
        self.job = job
        self.mail = mail
        self.task_index = task_index
        self.graph_item = job.graph_item()
        self.strategy = job.strategy()
        self.spec = job.resource_spec()
        self.config: RunConfig = RunConfig.of_job(job)
        self.is_chief = task_index == 0
        self.target = target
        self.run_options = tf.compat.v1.RunOptions(
            timeout_in_ms=int(self.config.step_timeout_s * 1000))
        self.initial_step = 0
        self.elastic = self.config.elastic  # set with resize_at too (see fit)
        # Who runs which steps, with which strategy; a followed elastic run
        # extends both while it goes.
        self.membership = membership.Membership(self.strategy, list(self.config.plans or []),
                                                self.config.global_batch_size)
        # Each step's global batch, and the epochs (a strategy switched to may
        # bring another global batch).
        self.data = open_step_data(job, self.config, self.graph_item, self.strategy,
                                   self.membership.batch_at, self.task_index)
        self.schedule = self.data.schedule
        lengths = self.data.lengths
        self.steps_per_epoch = lengths[0]
        self.membership.segments[:] = elastic.segments(
            sum(lengths), self.spec.num_worker_tasks, self.config.resize_at,
            self.config.switch_at)
        # Epochs whose end Keras' step finds (a dataset of unknown length): what that
        # step changes though it trains nothing (`run_outs`).
        self.run_outs = run_outs.RunOuts.of(self.data.epochs_run_out(), self.schedule.starts)
        self.seeds: run_outs.SeedAdvance | None = None
        # Chosen when training starts (`train`).
        self.reporter: StepReporter = Unreported(self.membership.segments, task_index)
        self._init_shared = True  # the chief initializes the PS variables
        self._state_set = -1   # the step before which the driver's state was last set
        # This membership's program, its session, step and values (none while idle).
        self.program: Program | None = None
        self.session: tf.compat.v1.Session | None = None
        self.task_step: TaskStep | None = None
        self.values: TrainedValues | None = None
        self.assign_state: initial_values.StateAssign | None = None
        self._snapshot: dict[str, np.ndarray] | None = None
        self._handover_start = 0.0
        # Chief: the tasks it released when they left for good (told they are done).
        self.released: set[int] = set()
        self.next_index = self.config.start_step  # the first step not yet completed
        self.segment = self.membership.segment_at(self.config.start_step)
        if self.segment.has(task_index):
            self._build(self.segment)
        # Otherwise idle until a segment includes this task (see `train`).

    @property
    def total_steps(self) -> int:
        """Steps of the whole run (they change when the global batch does)."""
        return self.schedule.total()

    @property
    def segments(self) -> list[elastic.Segment]:
        """Who runs which steps (`Membership.segments`)."""
        return self.membership.segments

    @property
    def plans(self) -> list[str]:
        """The strategies switched to, as text (`Membership.plans`)."""
        return self.membership.plans

    def _build(self, segment: elastic.Segment) -> None:
        """A new program and session for the membership of `segment`."""
        if self.session is not None:
            self.session.close()
        # PS variables stay where they are unless the strategy changes.
        self._init_shared = self.program is None or segment.plan != self.segment.plan
        plan = self.membership.plan(segment.plan)
        self.strategy = elastic.strategy_for(plan, segment.members) if self.elastic else plan
        # No timeout of their own for the collectives: every run of the step is bounded
        # (`run_options`), and TensorFlow starts a thread sleeping out each collective's
        # timeout: at ~100 steps/s and 60 s, thousands of threads (a pids limit kills
        # the task).
        self.program = build_program(self.graph_item, self.strategy, self.spec, self.task_index,
                                     0.0, version=segment.version,
                                     elastic=self.elastic, atomic=True)
        self.session = open_session(
            self.target, self.program.graph,
            session_config(self.strategy, self.task_index,
                           segment.members if self.elastic else None, self.graph_item),
            self.config.startup_timeout_s)
        self.segment = segment
        task = ProgramSession(self.program, self.session, self.strategy, self.graph_item,
                              self.run_options)
        self.values = TrainedValues(task, self.config)
        self.assign_state = initial_values.StateAssign(task)
        if self.run_outs is not None:
            self.seeds = run_outs.SeedAdvance(task, self.assign_state)
        self.task_step = TaskStep(task, self.config, self.task_index,
                             self.job.file(f"losses_{self.task_index}.jsonl")
                             if self.config.on_failure == "continue" else None)

    def initialize(self, values: dict[str, np.ndarray] | None = None) -> None:
        """Chief: PS variables; everyone: its local variables; then a ready flag.

        Local copies of PS shards (`local_replication`) are then read from the
        initialized PS by every task.

        Args:
            values: Values by single-device name (and checkpoint slot keys);
                default the job's initial values. A task joining an elastic
                job in a later membership version waits for the chief's.
        """
        if self.session is None:
            return  # idle: initialized when a segment includes this task
        if values is None and self.segment.version > 0:
            # A joiner may wait for a whole segment of the others' training.
            values = membership.receive_snapshot(self.mail, self.task_index,
                                                 self.config.job_timeout_s)
        if values is None:
            values = self.job.init_values()
        self.values.keep_unused(values)
        initial_values.initialize_variables(
            self.task_step.task, values, init_shared=self._init_shared, is_chief=self.is_chief,
            ready_device=next(iter(self.spec.ps_devices), self.strategy.replicas[0]),
            version=self.segment.version, task_index=self.task_index,
            startup_timeout_s=self.config.startup_timeout_s)
        # The update count at the run's first step (values handed over at a
        # resize or switch count the steps run since).
        self.initial_step = int(values.get(checkpoint.ITERATIONS, 0)) - max(
            self.segment.start - self.config.start_step, 0)
        self.task_step.rate = None  # the variable holds the captured rate until set

    # --------------------------------------------------------------- train
    def train(self) -> WorkerResult:
        """Runs every step; returns this task's per-step weighted losses and times.

        In a followed run (`RunConfig.follow_steps`) the run limit may end it
        early, at the same step on every synchronous worker.
        """
        config = self.config
        if config.probe_steps:
            return self._probe()
        self.reporter = step_reporter(
            self.job, self.mail, config, self.task_index, self.spec.num_worker_tasks,
            self.steps_per_epoch, self.membership.segments, self.membership.plans,
            self.schedule, self._write_epoch_weights if config.epoch_weights else None)
        delay_s = float((config.task_step_delay_s or {}).get(str(self.task_index), 0.0))
        log = StepLog()
        index = config.start_step
        while index < self.total_steps:
            if self.session is None:
                index, joined = self._wait_idle(index, log)
                if not joined:
                    break
                continue
            if not self.reporter.may_start(index):
                break
            if not self._follow_membership(index, log):
                continue
            self._run_step(index, delay_s, log)
            index += 1
        self.reporter.end(index)
        return log.result(
            self.steps_per_epoch, tuple(self.schedule.starts()),
            # The chief's, from the run's first step (History weighs epochs by them).
            tuple(self.data.examples(i) for i in range(config.start_step + len(log.losses)))
            if self.is_chief else ())

    def _wait_idle(self, index: int, log: StepLog) -> tuple[int, bool]:
        """Idle from step `index`: no loss, no time until a segment includes this task.

        Returns:
            The step it goes on at, and whether it joins a segment there (if
            not, its run is over).
        """
        join = self.reporter.wait_to_join(index)
        end = self.total_steps if join is None else join
        if join is None and self.reporter.limit is not None:
            end = min(end, self.reporter.limit)
        log.idle(end - index)
        if join is None:
            return end, False
        self._enter(self.membership.segment_at(end), log)
        return end, True

    def _follow_membership(self, index: int, log: StepLog) -> bool:
        """Before step `index`: hands over where its segment is a new one; whether this
        task runs the step (if not, it is idle from here)."""
        segment = self.membership.segment_at(index)
        if segment.version == self.segment.version:
            return True
        self._hand_over(self.segment, segment)
        if not segment.has(self.task_index):
            self.segment = segment
            return False
        self._enter(segment, log)
        return True

    def _run_step(self, index: int, delay_s: float, log: StepLog) -> None:
        """Runs step `index`, checkpoints where due, logs and reports it."""
        since = time.perf_counter()
        self.task_step.set_learning_rate(self.reporter.learning_rate_at(index))
        self._set_state(index)
        epoch, epoch_step, _, epoch_steps = self.schedule.locate(index)
        data = self.data.batch(index)
        counted = 0 if self.run_outs is None else self.run_outs.before(index)

        def step() -> StepResult:
            return self.task_step.run(index, data, delay_s, since, counted)

        seeds = self.seeds
        result = seeds.measure(step) if seeds is not None and seeds.step is None else step()
        if seeds is not None:
            seeds.advance(self.run_outs.ending_after(index))
        done = self.initial_step + index - self.config.start_step + 1
        self.next_index = index + 1
        if self._checkpoint_due(done, last_of_epoch=epoch_step == epoch_steps - 1):
            self.save_checkpoint(done)
        log.add(epoch, result)
        self.reporter.record(StepOutcome(
            index=index, epoch=epoch, epoch_step=epoch_step, epoch_steps=epoch_steps,
            loss=result.loss, seconds=result.seconds, examples=data.size,
            task_examples=result.task_examples,
            monitor=None if result.monitored is None else result.monitored.sample,
            metrics=result.metrics, segment=self.segment))

    def _set_state(self, index: int) -> None:
        """Before step `index`, the first of an epoch: the state variables the driver's
        validation or callbacks changed at the epoch's end, in every virtual node's copy."""
        values = self.reporter.state_at(index)
        if values is None or self._state_set == index:
            return
        self._state_set = index
        self.assign_state(values)

    def _probe(self) -> WorkerResult:
        """Times each local replica's forward and backward passes; no update.

        Runs the first `probe_steps + 1` global batches of the schedule; the
        first is a warm-up.

        Returns:
            A result with no losses and a probe per replica device.
        """
        batches = [self.data.probe_batch(i) for i in range(self.config.probe_steps + 1)]
        return WorkerResult(steps_per_epoch=self.steps_per_epoch,
                            probe=self.task_step.probe(batches))

    # ------------------------------------------------------------- elastic
    def _hand_over(self, segment: elastic.Segment, following: elastic.Segment) -> None:
        """End of a membership version: the state goes to the chief and on to the
        members of `following` (`membership.hand_over`); others close their session."""
        self._handover_start = time.perf_counter()
        snapshot = membership.hand_over(
            self.task_step.task, self.values, self.mail, self.is_chief, segment, following,
            self.config.step_timeout_s + self.config.startup_timeout_s)
        if not self.is_chief:
            self.session.close()
            self.session = None
            return
        self._snapshot = snapshot
        if not self.config.follow_steps:   # a followed run may grow onto any task again
            self._release([t for t in segment.members if not following.has(t) and not any(
                s.has(t) for s in self.segments if s.start > following.start)])

    def _release(self, tasks: list[int]) -> None:
        """Chief: tasks that left for good are done: they send their results and end, so
        that their host (its `autodist serve`) is free for another job."""
        for task_index in tasks:
            task = ("worker", task_index)
            try:
                self.mail.send(task, mailbox.DONE, b"done", timeout_s=10.0)
            except mailbox.MailboxError as e:   # it ends when the job's timeout does
                logger.warning("could not release worker task %d: %s", task_index, e)
            self.mail.close([task])   # before it ends (see Mailboxes.close)
            self.released.add(task_index)

    def _enter(self, segment: elastic.Segment, log: StepLog) -> None:
        """Joins `segment`: new program and session, state from the chief."""
        self._build(segment)
        self.initialize(self._snapshot if self.is_chief else None)
        if self.is_chief:
            log.resizes.append(ResizeEvent(segment.start, segment.workers, segment.plan,
                                           time.perf_counter() - self._handover_start,
                                           segment.members))

    # ------------------------------------------------------------- finish
    def final_weights(self, with_optimizer: bool = True) -> dict[str, np.ndarray]:
        """Trained values by variable name, shards reassembled (chief's view); with
        `with_optimizer`, also the optimizer's slots, update count and the steps that
        found the data's end (`checkpoint.RUN_OUTS`), which return into the Keras
        optimizer as Keras counts its iterations."""
        values = self.values.read(with_optimizer=with_optimizer)
        if with_optimizer and checkpoint.ITERATIONS in values:
            values[checkpoint.RUN_OUTS] = np.asarray(self._run_outs_before(self.next_index),
                                                     np.int64)
        return values

    def _run_outs_before(self, index: int) -> int:
        """Keras' extra iterations before step `index` where the run counts them (not
        under loss scaling, whose update count Keras' run-out step leaves)."""
        counted = self.run_outs is not None and self.program is not None and \
            self.program.outputs.run_outs is not None
        return self.run_outs.before(index) if counted else 0

    def _write_epoch_weights(self, epoch: int) -> None:
        """Chief: the weights after `epoch`, for the driver's callbacks."""
        path = follow.epoch_weights_path(self.job, epoch)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_weights(path, self.final_weights(with_optimizer=False))

    def finish_barrier(self) -> None:
        """Asynchronous jobs: the chief waits until every worker has finished."""
        if self.program is None or not self.program.outputs.asynchronous:
            return
        with self.program.graph.as_default():
            counter = self._finished_counter()
            report = counter.assign_add(1, read_value=False)
            read = counter.read_value()
        self.session.run(report, options=self.run_options)
        if not self.is_chief:
            return
        deadline = time.monotonic() + self.config.step_timeout_s
        while self.session.run(read, options=self.run_options) < self.spec.num_worker_tasks:
            if time.monotonic() > deadline:
                raise WorkerError(f"workers did not finish within {self.config.step_timeout_s}s "
                                  "of the chief")
            time.sleep(0.01)

    def _finished_counter(self) -> StorageVariable:
        return self.program.storage["autodist/shared/finished"]

    def collect_results(self, own: WorkerResult,
                        absent: frozenset[int] = frozenset()) -> list[WorkerResult]:
        """Chief: every worker's result but the absent ones', by task index (the others'
        from the mailbox)."""
        return worker_results.collect_results(
            self.mail, own, self.spec.num_worker_tasks,
            self.config.step_timeout_s + self.config.startup_timeout_s, absent)

    def _checkpoint_due(self, done: int, last_of_epoch: bool) -> bool:
        if not self.is_chief or not self.config.checkpoint_dir:
            return False
        every = self.config.checkpoint_every_steps
        return done % every == 0 if every else last_of_epoch

    def save_checkpoint(self, step: int) -> pathlib.Path:
        """Writes a checkpoint atomically and durably (chief only); returns its directory."""
        return self.values.save_checkpoint(step, self._run_outs_before(self.next_index))

    def save_recovery(self) -> None:
        """Chief, after a failed step: the state after the last completed step.

        Steps are atomic (`SyncOptions.atomic`): a failed step applied no
        update, so every variable, slot and the update count are those after
        step `next_index - 1`. Reading them runs no collective (a process
        whose collectives were aborted can still do this). Written
        atomically, with the index of the step to resume at. Error-feedback
        residuals are not (a dead worker's cannot be read): after a
        recovery they start at zero.
        """
        self.values.save_recovery(self.job.recovery(), self.next_index,
                                  self._run_outs_before(self.next_index))

    def close(self) -> None:
        """Closes the current session (none after leaving an elastic job) and stops
        reading data."""
        self.data.close()
        if self.session is not None:
            self.session.close()
            self.session = None


def open_step_data(job: JobDir, config: RunConfig, graph_item: GraphItem, strategy: Strategy,
                   batch_at: Callable[[int], int], task: int) -> StepData:
    """The job's data: its dataset (or worker task `task`'s shard of it), streamed, or
    its arrays (batched by `batch_at`, the global batch of the strategy running a step)."""
    files = job.dataset()
    if files is None:
        return ArrayData(job, config, batch_at)
    held = None
    if files.shard_graphs:
        held = sharded_input.task_rows(strategy, config.global_batch_size,
                                       job.resource_spec().num_worker_tasks)[task]
    return DatasetStream(files, config, graph_item,
                         global_batch.smallest_batch(graph_item, strategy),
                         strategy.global_batch_size, held_rows=held, task=task)


def absent_workers(config: RunConfig, num_workers: int) -> frozenset[int]:
    """Worker tasks a job leaves out: those no segment of a scheduled run includes (a
    recovering remote job's lost workers among them: its starting membership,
    `resize_at[0]`, is the survivors; `runtime.recovery`)."""
    return elastic.scheduled_tasks(config, num_workers).absent


def run_worker(job: JobDir, task_index: int, target: str) -> None:
    """Builds, initializes and trains; the chief writes results and weights.

    Waits until every task of the cluster answers. Every worker reports
    "finished" on the PS before the chief reads the final weights
    (asynchronous workers may still be updating); the others send their
    results to the chief and keep serving until it says it is done (they may
    hold PS shards). A worker that fails tells the chief why, so the chief's
    error names it even when the worker runs on another host.
    """
    spec = job.resource_spec()
    config = RunConfig.of_job(job)
    mail = Mailboxes(spec.cluster_def(job.ports()), job_id=config.job_id)
    is_chief = task_index == 0
    schedule = elastic.scheduled_tasks(config, spec.num_worker_tasks)
    absent = schedule.absent
    if task_index in absent:
        return   # no segment includes it: nothing to do (a local launch starts it anyway)
    others = [t for t in mail.tasks if t != CHIEF and not (t[0] == "worker" and t[1] in absent)]
    trainer = None
    try:
        # Tasks that join later may not be served yet: the chief waits for each when
        # the run grows onto it (`membership.hand_over`).
        mail.wait_until_up([CHIEF] + [t for t in others if t[0] != "worker"
                                      or t[1] not in schedule.late or t[1] == task_index],
                           config.startup_timeout_s)
        trainer = Trainer(job, task_index, target, mail)
        trainer.initialize()
        result = trainer.train()
        trainer.finish_barrier()
    except Exception as e:
        if not is_chief:
            worker_results.report_failure(mail, task_index)
            raise
        if trainer is not None and trainer.session is not None:
            # The last completed step's state: recovery goes on from it, and a
            # failed fit leaves it in the model.
            try:
                trainer.save_recovery()
            except Exception:
                logger.exception("could not save the state for recovery")
        failure = worker_results.peer_failure(mail)
        if failure is not None:
            raise WorkerError(f"the chief stopped because {failure}") from e
        raise
    if not is_chief:
        mail.send(CHIEF, mailbox.RESULTS, WorkerMessage(task_index, result=result).to_json(),
                  config.step_timeout_s + config.startup_timeout_s)
        mail.receive(("worker", task_index), mailbox.DONE,
                     config.step_timeout_s + config.startup_timeout_s)
        mail.close()   # first: the chief may end at once
        trainer.close()
        return
    # First, so that a driver that stopped the job early gets them at once.
    write_weights(job.file("final_weights.npz"), trainer.final_weights())
    results = trainer.collect_results(result, absent)
    trainer.reporter.finish(results)
    present = [t for t in range(spec.num_worker_tasks) if t not in absent]
    for index, worker_result in zip(present, results):
        atomic_write(job.result(index), worker_result.to_json())
    for task in others:
        if task[0] == "worker" and task[1] in trainer.released:
            continue   # told at its leave, and gone
        try:
            mail.send(task, mailbox.DONE, b"done", timeout_s=10.0)
        except mailbox.MailboxError as e:  # it may be gone already; it times out alone
            logger.warning("could not tell %s:%d the job is done: %s", *task, e)
        mail.close([task])   # before it ends (see Mailboxes.close)
    trainer.close()
    mail.close()
