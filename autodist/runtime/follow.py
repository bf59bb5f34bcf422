"""A run the driver follows step by step (`fit(callbacks=...)`).

The driver runs the callbacks; the steps run in the worker tasks. The
driver and the chief share the job directory (the driver starts the chief on
its own host, locally or in a multi-host run); the chief and the other
workers talk through mailboxes (`autodist.launch.mailbox`), so no other
task needs the directory.

* Step reports. Every worker sends the chief its weighted loss of each step;
  the chief sums them into the global loss (the sum `History.step_losses`
  holds) and appends one record per step, in order, to ``progress.jsonl``,
  which the driver tails.
* The run limit. A worker may start step i (counted from 0 over the whole
  run) only while i < limit. The chief owns the limit and sends each change
  to the other workers. It starts at the end of the first epoch; at the end
  of each epoch the chief waits for the driver's decision (written after
  ``on_epoch_end`` and the next ``on_epoch_begin``) and either extends the
  limit by an epoch or makes it final there, so a stop at an epoch's end is
  exact. A learning rate a callback set there (``ReduceLROnPlateau``,
  ``LearningRateScheduler``) travels with the limit: every worker sets it
  before the next epoch's first step, as Keras applies it.
* A stop request inside an epoch (``control/stop``, from a callback setting
  ``model.stop_training``) makes the limit final one step ahead of the chief:
  another worker may already have started the chief's next step, which in
  synchronous training needs the chief. With one worker it stops at once.
* A resize or replan request (``control/resize``, from
  `DistributedRun.resize` / `replan`) starts a new membership one step ahead
  of the chief, for the same reason: the chief ends the current segment
  there and appends one on the requested member tasks and strategy
  (`elastic.Segment`; new strategies travel as text in the limit messages).
  Every limit message carries the whole segment list, so every worker, idle
  ones included, agrees on who
  runs each step. Only members report step losses; an idle worker waits for
  a segment that includes it, or for the chief's final limit at the end.
* Workers outside the starting membership (``resize_at={0: [...]}``) may
  have no process yet: under launch="remote" their slot's `autodist serve`
  may start after launch. The chief sends such a worker the latest limit
  message (which carries everything) as soon as its slot answers, and waits
  for it (bounded, naming its slot and address) only when a segment that
  includes it starts. One that never answered by the end took no part: the
  chief records for it the result an idle worker sends (no loss, no time).

Why every worker stops at the same step in synchronous training: a worker
finishes step i only after the chief has started step i, and the chief sends
a new limit before it starts its next step; a worker reads its limit box
before each step, so after step i it sees every limit set before step i.
Asynchronous workers are not in step: one ahead of a final limit stops at its
next step, one behind runs up to it, and `History` covers the steps every
worker completed.
"""
from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from autodist.ir.errors import AutodistError
from autodist.ir.strategy import Strategy
from autodist.launch import mailbox
from autodist.launch.job import JobDir
from autodist.launch.mailbox import Mailboxes, Task
from autodist.runtime.batching import EpochSchedule
from autodist.runtime.elastic import Segment
from autodist.runtime.records import (ChangeRequest, EpochDecision, MonitoredStep,
                                      MonitorSample, ProgressRecord, RunLimit, StepReport,
                                      WorkerMessage, WorkerResult, add_states)
from autodist.runtime.run_config import RunConfig

STOP = "stop"
CHIEF: Task = ("worker", 0)
_POLL_S = 0.005
_JOIN_POLL_S = 0.2   # between looks at a joiner's slot


class FollowError(AutodistError, RuntimeError):
    """A report, decision, limit or the weights did not arrive within its bound."""


def epoch_weights_path(job: JobDir, epoch: int) -> pathlib.Path:
    """Where the chief puts the trained weights after `epoch` (followed runs with callbacks)."""
    return job.file(f"weights/epoch-{epoch}.npz")


def write_decision(job: JobDir, epoch: int, stop: bool,
                   learning_rate: float | None = None,
                   state: Mapping[str, Any] | None = None) -> None:
    """Driver: what the run does after `epoch` (called after on_epoch_end, and the next
    epoch's on_epoch_begin): stop, or go on, with `learning_rate` from the next epoch
    on where a callback set one (None: unchanged), and the state variables validation
    or a callback changed (`state`, by name)."""
    values = {name: np.asarray(value).tolist() for name, value in (state or {}).items()}
    job.write_file(job.epoch_decision(epoch),
                   EpochDecision(stop, learning_rate, values).to_json())


def learning_rate_at(changes: Sequence[tuple[int, float]], step: int) -> float | None:
    """The learning rate a callback set for `step` (changes: (first step, rate), in
    order), or None where none did."""
    rate = None
    for start, value in changes:
        if start <= step:
            rate = value
    return rate


def request_stop(job: JobDir) -> None:
    """Driver: stop the run at the next step boundary the workers can all meet."""
    job.write_file(job.stop_request(), STOP.encode())


def request_change(job: JobDir, sequence: int, members: tuple[int, ...] | None = None,
                   strategy_text: str | None = None) -> None:
    """Driver: the membership to run from a step boundary the workers can all meet.

    The request holds the whole target (the latest requested member worker
    tasks and strategy, None for unchanged), so a later request never loses an
    earlier one the chief has not read yet.
    """
    job.write_file(job.resize_request(), ChangeRequest(sequence, members, strategy_text).to_json())


def first_limit(steps_per_epoch: int, epochs: int) -> int:
    return steps_per_epoch if epochs > 1 else steps_per_epoch * epochs


class ChiefFollower:
    """The chief's side: decisions, the run limit, and the global step losses.

    Args:
        job: The driver's job directory.
        mail: The cluster's mailboxes.
        num_workers: Worker tasks (the chief is worker 0).
        steps_per_epoch: Steps of one epoch.
        config: The run's config (epochs and timeouts).
        segments: Who runs which steps (shared with the trainer, and
            extended here by resize requests); default every worker.
        plans: The strategies switched to, as text (shared with the
            trainer, and extended here by replan requests).
        schedule: The run's epochs (their batch may change with the
            strategy); default fixed.
        epoch_end: Called with each epoch's index at its end, or None.
        answers: Whether something accepts connections at a task's
            "host:port" (a worker outside the starting membership is sent
            limits once its slot answers).
    """

    def __init__(self, job: JobDir, mail: Mailboxes, num_workers: int, steps_per_epoch: int,
                 config: RunConfig, segments: list[Segment] | None = None,
                 plans: list[str] | None = None,
                 schedule: EpochSchedule | None = None,
                 epoch_end: Callable[[int], None] | None = None,
                 answers: Callable[[str], bool] = mailbox.accepts) -> None:
        self.job = job
        self.epoch_end = epoch_end
        self.mail = mail
        self.num_workers = num_workers
        self.segments = segments if segments is not None else [
            Segment(0, 0, steps_per_epoch * config.epochs,
                    tuple(range(num_workers)))]
        self.plans = plans if plans is not None else []
        self._base_text: str | None = None  # plan 0, read when first needed
        self._resize_sequence = 0
        self.peers: list[Task] = [("worker", t) for t in range(1, num_workers)]
        # Workers outside the starting membership not yet sent a limit: their slot
        # may have no process yet (see the module's docstring).
        starting = self.members_at(config.start_step)
        self.pending: set[int] = {t for _, t in self.peers if t not in starting}
        self.answers = answers
        self.steps = steps_per_epoch
        # The epochs (their batch may change with the strategy); default fixed.
        self.schedule = schedule or EpochSchedule(steps_per_epoch, config.epochs, None,
                                                  lambda step: 1)
        self.config = config
        self.limit = first_limit(steps_per_epoch, config.epochs)
        self.final = False
        # (first step, learning rate) set by the driver's callbacks between epochs.
        self.learning_rates: list[tuple[int, float]] = []
        # (first step, state variable -> value) changed by the driver between epochs.
        self.state_changes: list[tuple[int, dict[str, Any]]] = []
        self._losses: dict[int, dict[int, float]] = {}
        self._times: dict[int, float] = {}
        self._monitors: dict[int, list[MonitorSample]] = {}
        self._metrics: dict[int, tuple] = {}
        self._examples: dict[int, int] = {}
        self._written = 0  # steps whose record is in progress.jsonl
        self._progress = job.file("progress.jsonl")

    def may_start(self, step: int) -> bool:
        """Whether step `step` runs; at an epoch's end, waits for the driver."""
        if not self.final and step == self.limit:  # a non-final limit is an epoch's end
            self.flush(step)
            epoch, _, _, _ = self.schedule.locate(step)
            if self.epoch_end is not None:
                self.epoch_end(epoch - 1)
            decision = self._decision(epoch - 1)
            stop = decision.stop or self.job.stop_request().exists()
            if decision.learning_rate is not None and not stop and \
                    decision.learning_rate != self.learning_rate_at(step):
                self.learning_rates.append((step, decision.learning_rate))
            if decision.state and not stop:
                self.state_changes.append((step, decision.state))
            # Nobody has started `step`: a resize asked for at the epoch's end
            # (on_epoch_end runs before the decision) starts right here.
            self._take_resize_request(step, at_limit=True, announce=False)
            steps = self.schedule.locate(step)[3]  # of the epoch starting here
            self._set(step if stop else min(step + steps, self.schedule.total()), stop)
        else:
            self._take_resize_request(step)
            if not self.final and self.job.stop_request().exists():
                self._set(step + 1 if self.peers else step, True)
        if step < self.limit:
            self._wait_for_joiners(step)
        return step < self.limit

    def learning_rate_at(self, step: int) -> float | None:
        """The learning rate the driver's callbacks set for `step` (None: the run's)."""
        return learning_rate_at(self.learning_rates, step)

    def members_at(self, step: int) -> tuple[int, ...]:
        """The worker tasks that run `step`."""
        return next((s.members for s in self.segments if s.start <= step < s.end),
                    self.segments[-1].members)

    def end(self, done: int) -> None:
        """After the chief's last step: the final limit, which releases idle workers.

        A worker outside the starting membership whose slot never answered took
        no part: the chief puts into its own results box the result an idle
        worker sends (no loss, no time for each step), so that the results of
        every worker are there.
        """
        if not (self.final and self.limit == done):
            self._set(done, True)
        message = self._limit_message()
        for task_index in sorted(self.pending):
            if self._reach(task_index, message):
                continue
            steps = done - self.config.start_step
            idle = WorkerResult(losses=(0.0,) * steps, step_times=(0.0,) * steps,
                                steps_per_epoch=self.steps,
                                epoch_starts=tuple(self.schedule.starts()))
            self.mail.send(CHIEF, mailbox.RESULTS,
                           WorkerMessage(task_index, result=idle).to_json(),
                           self.config.step_timeout_s)

    def record(self, step: int, loss: float, seconds: float,
               monitor: MonitorSample | None = None, metrics: Sequence = (),
               examples: int = 0) -> None:
        """The chief's own loss of `step`; writes every record now complete.

        `monitor`: the chief's squared gradient norms of a monitored step
        (batch sizes and norms); the record gets every member's. `metrics`:
        the chief's contribution to the metrics' state; the record gets the
        sum over members. `examples`: the step's global batch.
        """
        self._examples[step] = examples
        self._losses.setdefault(step, {})[0] = loss
        self._times[step] = seconds
        self._metrics[step] = add_states(self._metrics.get(step, ()), metrics)
        if monitor is not None:
            self._monitors.setdefault(step, []).append(monitor)
        if self.peers:
            self._absorb(self.mail.receive_all(CHIEF, mailbox.STEPS,
                                               self.config.step_timeout_s))
        self._write_complete()

    def flush(self, through: int) -> None:
        """Waits until every worker reported every step before `through`."""
        while self._written < through:
            try:
                message = self.mail.receive(CHIEF, mailbox.STEPS, self.config.step_timeout_s)
            except mailbox.MailboxTimeout as e:
                have = self._losses.get(self._written, {})
                missing = [t for t in self.members_at(self._written)
                           if t and t not in have]
                raise FollowError(f"workers {missing} did not report step {self._written} "
                                  f"within {self.config.step_timeout_s:g}s") from e
            self._absorb([message])
            self._write_complete()

    def finish(self, losses_by_task: Sequence[Sequence[float]], times: Sequence[float],
               monitors_by_task: Sequence[Sequence[MonitoredStep]] = ()) -> None:
        """After the run: records for the steps not yet written, from the results.

        `monitors_by_task`: each task's monitored steps (the reports of the
        last steps may not have reached the chief yet).
        """
        done = min(len(losses) for losses in losses_by_task)
        if self.peers:  # reports still in the box (each came before its sender's result)
            self._absorb(self.mail.receive_all(CHIEF, mailbox.STEPS,
                                               self.config.step_timeout_s))
            self._write_complete()
        unwritten: dict[int, list[MonitorSample]] = {}
        for records in monitors_by_task:
            for record in records:
                if record.step >= self._written:
                    unwritten.setdefault(record.step, []).append(record.sample)
        for step, samples in unwritten.items():
            # Samples the chief holds already (its own, reports) stay unless a result repeats them.
            tasks = {t for sample in samples for t in sample.tasks}
            kept = [m for m in self._monitors.get(step, []) if not set(m.tasks) & tasks]
            self._monitors[step] = kept + samples
        with open(self._progress, "a") as f:
            for step in range(self._written, done):
                f.write(self._line(step, sum(losses[step] for losses in losses_by_task),
                                   times[step]))
        self._written = max(self._written, done)

    # ------------------------------------------------------------ internals
    def _set(self, limit: int, final: bool) -> None:
        self.limit, self.final = limit, final
        message = self._limit_message()
        for peer in self.peers:
            if peer[1] in self.pending:
                self._reach(peer[1], message)   # it gets a later one if not up yet
            else:
                self.mail.send(peer, mailbox.LIMIT, message, self.config.step_timeout_s)

    def _limit_message(self) -> bytes:
        """The run's limit and everything the workers follow (each message holds all)."""
        return RunLimit(self.limit, self.final, tuple(self.segments), tuple(self.plans),
                        tuple(self.learning_rates), tuple(self.state_changes)).to_json()

    def _reach(self, task_index: int, message: bytes) -> bool:
        """A pending worker: sends it `message` if its slot answers; whether it did (it is
        then a worker like the others)."""
        task = ("worker", task_index)
        if not self.answers(self.mail.address(task)):
            return False
        try:
            self.mail.send(task, mailbox.LIMIT, message, self.config.step_timeout_s)
        except mailbox.MailboxError:
            return False   # its server is not up yet: tried again later
        self.pending.discard(task_index)
        return True

    def _wait_for_joiners(self, step: int) -> None:
        """Before `step`: a segment starting there waits for its pending members (up to a
        step's and a start-up's timeouts, as a hand-over does) and sends them the limit.

        Raises:
            FollowError: naming the first that did not answer, and its address.
        """
        segment = next((s for s in self.segments if s.start == step), None)
        joiners = [] if segment is None else [t for t in segment.members if t in self.pending]
        if not joiners:
            return
        bound = self.config.step_timeout_s + self.config.startup_timeout_s
        deadline = time.monotonic() + bound
        for task_index in joiners:
            while not self._reach(task_index, self._limit_message()):
                if time.monotonic() > deadline:
                    address = self.mail.address(("worker", task_index))
                    raise FollowError(
                        f"worker task {task_index} at {address} did not join the run at step "
                        f"{step} within {bound:g}s: nothing served its slot (start `autodist "
                        "serve --tf-config` there, with the cluster's TF_CONFIG and secret)")
                time.sleep(_JOIN_POLL_S)

    def _take_resize_request(self, step: int, at_limit: bool = False,
                             announce: bool = True) -> None:
        """A new membership request starts a segment one step ahead of the chief.

        At once when no other worker can have started `step`: with one
        worker, or at the run limit (`at_limit`). A request may change the
        number of workers, the strategy (a new plan), or both.
        """
        path = self.job.resize_request()
        if self.final or not path.exists():
            return
        request = ChangeRequest.from_json(path.read_bytes())
        if request.sequence <= self._resize_sequence:
            return
        members = self.members_at(step)
        boundary = step + 1 if len(members) > 1 and not at_limit else step
        # An announced segment is never changed: idle workers may be joining it.
        boundary = max(boundary, self.segments[-1].start + 1)
        total = self.segments[-1].end
        text = request.strategy
        batch = None if text is None else \
            Strategy.from_text(text).global_batch_size or self.config.global_batch_size
        if batch is not None and batch != self.schedule.batch_at(step) and boundary != step:
            return  # a new global batch starts with an epoch: kept for the epoch's end
        self._resize_sequence = request.sequence
        if boundary >= total:
            return
        current = self.segments[-1]
        members = current.members if request.members is None else request.members
        plan = current.plan
        if text is not None:
            if self._base_text is None:
                self._base_text = self.job.strategy().to_text()
            known = [self._base_text] + self.plans
            if text not in known:
                self.plans.append(text)
                known.append(text)
            plan = known.index(text)
        if members == current.members and plan == current.plan:
            return
        kept = [s for s in self.segments if s.start < boundary]
        last = kept.pop()
        kept.append(dataclasses.replace(last, end=boundary))
        kept.append(Segment(last.version + 1, boundary, total, members, plan))
        self.segments[:] = kept
        # The run's length follows the epochs' batches.
        self.segments[-1] = dataclasses.replace(self.segments[-1], end=self.schedule.total())
        if announce:
            self._set(self.limit, self.final)

    def _decision(self, epoch: int) -> EpochDecision:
        path = self.job.epoch_decision(epoch)
        # The driver's callbacks and validation run meanwhile: bounded by the job's time.
        deadline = time.monotonic() + self.config.job_timeout_s
        while not path.exists():
            if self.job.stop_request().exists():
                return EpochDecision(stop=True)  # Ctrl-C in the driver: it decides no more
            if time.monotonic() > deadline:
                raise FollowError(f"the driver did not decide how to go on after epoch {epoch} "
                                  f"within the job's {self.config.job_timeout_s:g}s")
            time.sleep(_POLL_S)
        return EpochDecision.from_json(path.read_bytes())

    def _absorb(self, messages: list[bytes]) -> None:
        for raw in messages:
            report = StepReport.from_json(raw)
            self._losses.setdefault(report.step, {})[report.task] = report.loss
            self._metrics[report.step] = add_states(self._metrics.get(report.step, ()),
                                                    report.metrics)
            if report.monitor is not None:
                self._monitors.setdefault(report.step, []).append(report.monitor)

    def _write_complete(self) -> None:
        lines = []
        while len(self._losses.get(self._written, {})) == len(self.members_at(self._written)) \
                and \
                self._written in self._times:
            step = self._written
            lines.append(self._line(step, sum(self._losses.pop(step).values()),
                                    self._times.pop(step)))
            self._written += 1
        if lines:
            with open(self._progress, "a") as f:
                f.write("".join(lines))

    def _line(self, step: int, loss: float, seconds: float) -> str:
        epoch, in_epoch, _, epoch_steps = self.schedule.locate(step)
        segment = next((s for s in self.segments if s.start <= step < s.end),
                       self.segments[-1])
        monitors = self._monitors.pop(step, None)
        return ProgressRecord(step=step, epoch=epoch, epoch_step=in_epoch, loss=loss,
                              seconds=seconds, examples=self._examples.pop(step, 0),
                              last_of_epoch=in_epoch == epoch_steps - 1,
                              workers=segment.workers, plan=segment.plan,
                              monitor=MonitorSample.merge(monitors) if monitors else None,
                              metrics=self._metrics.pop(step, ())).to_json()


class WorkerFollower:
    """A non-chief worker's side: reports its losses, obeys the run limit.

    Args:
        mail: The cluster's mailboxes.
        task_index: This worker's task index.
        steps_per_epoch: Steps of one epoch.
        config: The run's config.
    """

    def __init__(self, mail: Mailboxes, task_index: int, steps_per_epoch: int,
                 config: RunConfig, segments: list[Segment] | None = None,
                 plans: list[str] | None = None) -> None:
        self.mail = mail
        self.task: Task = ("worker", task_index)
        self.config = config
        self.limit = first_limit(steps_per_epoch, config.epochs)
        self.final = False
        self.segments = segments if segments is not None else []
        self.plans = plans if plans is not None else []
        self.learning_rates: list[tuple[int, float]] = []
        self.state_changes: list[tuple[int, dict[str, Any]]] = []

    def learning_rate_at(self, step: int) -> float | None:
        """The learning rate the driver's callbacks set for `step` (None: the run's)."""
        return learning_rate_at(self.learning_rates, step)

    def wait_to_join(self, step: int) -> int | None:
        """An idle worker: the first step from `step` on that it runs, or None at the end.

        Waits (up to the job's timeout) until the chief's segments include this
        worker from some step on, or its limit is final.
        """
        deadline = time.monotonic() + self.config.job_timeout_s
        while True:
            self._absorb(self.mail.receive_all(self.task, mailbox.LIMIT,
                                               self.config.step_timeout_s))
            join = next((max(s.start, step) for s in self.segments
                         if s.has(self.task[1]) and s.end > step), None)
            if join is not None and (not self.final or join < self.limit):
                return join
            if self.final:
                return None
            self._next_limit(deadline, "no segment included it and the run did not end")

    def may_start(self, step: int) -> bool:
        """Whether step `step` runs; at an epoch's end, waits for the chief's limit."""
        self._absorb(self.mail.receive_all(self.task, mailbox.LIMIT, self.config.step_timeout_s))
        deadline = time.monotonic() + self.config.job_timeout_s
        while step >= self.limit and not self.final:
            self._next_limit(deadline,
                             f"the chief did not let step {step} start or end the run")
        return step < self.limit

    def _next_limit(self, deadline: float, waiting_for: str) -> None:
        """Absorbs the next limit message; FollowError naming `waiting_for` after `deadline`."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise FollowError(f"worker {self.task[1]}: {waiting_for} within "
                              f"{self.config.job_timeout_s:g}s")
        try:
            self._absorb([self.mail.receive(self.task, mailbox.LIMIT, remaining)])
        except mailbox.MailboxTimeout:
            pass

    def record(self, step: int, loss: float, monitor: MonitorSample | None = None,
               metrics: Sequence = ()) -> None:
        """Reports this worker's loss of `step` (its gradient norms if monitored, its
        contribution to the metrics' state)."""
        report = StepReport(self.task[1], step, loss, monitor, tuple(metrics))
        self.mail.send(CHIEF, mailbox.STEPS, report.to_json(), self.config.step_timeout_s)

    def _absorb(self, messages: list[bytes]) -> None:
        for raw in messages:
            message = RunLimit.from_json(raw)
            self.limit, self.final = message.limit, message.final
            self.segments[:] = message.segments
            self.plans[:] = message.plans
            self.learning_rates[:] = message.learning_rates
            self.state_changes[:] = message.state_changes
