"""How a worker task reports its steps and learns how far the run goes.

One `StepReporter` per task, chosen when training starts (`step_reporter`):

* `ChiefFollowingDriver`: the chief of a followed run (`follow.ChiefFollower`):
  the global loss of each step in ``progress.jsonl``, the driver's
  decisions at epochs' ends, the run limit it sends the other workers.
* `WorkerFollowingChief`: another worker of a followed run
  (`follow.WorkerFollower`): its loss of each step to the chief, the
  chief's run limit and segments.
* `ProgressFile`: the chief of a run nobody follows: an estimate of each
  step's loss in ``progress.jsonl``; it stops at the driver's stop request.
* `Unreported`: another worker of a run nobody follows.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Protocol, Sequence

from autodist.launch.job import JobDir
from autodist.launch.mailbox import Mailboxes
from autodist.runtime.batching import EpochSchedule
from autodist.runtime.elastic import Segment
from autodist.runtime.follow import ChiefFollower, WorkerFollower
from autodist.runtime.records import MonitorSample, ProgressRecord, WorkerResult
from autodist.runtime.run_config import RunConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """One step this task ran, as it is reported.

    Attributes:
        index: The step's global index.
        epoch: Its epoch.
        epoch_step: Its index within the epoch.
        epoch_steps: Steps of its epoch.
        loss: This task's weighted loss.
        seconds: The step's time on this task.
        examples: The step's global batch.
        task_examples: The examples of it that this task's replicas ran.
        monitor: This task's measurements, where monitored.
        metrics: This task's contribution to the metrics' state.
        segment: The membership segment that ran it.
    """

    index: int
    epoch: int
    epoch_step: int
    epoch_steps: int
    loss: float
    seconds: float
    examples: int
    task_examples: int
    monitor: MonitorSample | None
    metrics: tuple
    segment: Segment

    @property
    def last_of_epoch(self) -> bool:
        return self.epoch_step == self.epoch_steps - 1


class StepReporter(Protocol):
    """Where a task's steps go, and whether the next one runs."""

    @property
    def limit(self) -> int | None:
        """The step a followed run stops before (None: nothing follows the run)."""

    def may_start(self, index: int) -> bool:
        """Whether step `index` runs (a followed run may wait for the driver here)."""

    def wait_to_join(self, index: int) -> int | None:
        """An idle task: the first step from `index` on that it runs, or None."""

    def record(self, outcome: StepOutcome) -> None:
        """Reports a step this task ran."""

    def end(self, index: int) -> None:
        """After this task's last step (`index` is the first not run)."""

    def learning_rate_at(self, index: int) -> float | None:
        """The learning rate the driver's callbacks set for step `index`, or None."""

    def state_at(self, index: int) -> dict[str, Any] | None:
        """The state variables the driver changed before step `index`, or None."""

    def finish(self, results: Sequence[WorkerResult]) -> None:
        """Chief, after the run: what the reports of the last steps did not bring."""


class _Unfollowed:
    """What the tasks of a run nobody follows share: the segments known at the start."""

    limit = None

    def __init__(self, segments: Sequence[Segment], task_index: int) -> None:
        self.segments = segments
        self.task_index = task_index

    def may_start(self, index: int) -> bool:
        return True

    def wait_to_join(self, index: int) -> int | None:
        return next((max(s.start, index) for s in self.segments
                     if s.has(self.task_index) and s.end > index), None)

    def record(self, outcome: StepOutcome) -> None:
        pass

    def end(self, index: int) -> None:
        pass

    def learning_rate_at(self, index: int) -> float | None:
        return None

    def state_at(self, index: int) -> dict[str, Any] | None:
        return None

    def finish(self, results: Sequence[WorkerResult]) -> None:
        pass


class Unreported(_Unfollowed):
    """A worker other than the chief in a run nobody follows: nothing to report."""


class ProgressFile(_Unfollowed):
    """The chief of a run nobody follows: its estimate of each step's global loss in
    ``progress.jsonl``; the driver's stop request ends the run.

    Args:
        job: The job directory.
        segments: The run's segments.
    """

    def __init__(self, job: JobDir, segments: Sequence[Segment]) -> None:
        super().__init__(segments, 0)
        self.job = job
        self.path = job.file("progress.jsonl")

    def may_start(self, index: int) -> bool:
        if self.job.stop_request().exists():
            # The driver was interrupted: it takes the weights so far and ends the job.
            logger.info("stop requested by the driver before step %d", index)
            return False
        return True

    def record(self, outcome: StepOutcome) -> None:
        # This task's replicas' mean loss: an estimate of the global loss.
        share = outcome.task_examples / outcome.examples
        record = ProgressRecord(
            step=outcome.index, epoch=outcome.epoch, epoch_step=outcome.epoch_step,
            loss=outcome.loss / max(share, 1e-12), seconds=outcome.seconds,
            examples=outcome.examples, last_of_epoch=outcome.last_of_epoch,
            workers=outcome.segment.workers, plan=outcome.segment.plan, estimate=True,
            metrics=outcome.metrics)
        with open(self.path, "a") as f:
            f.write(record.to_json())


class _Followed:
    """What both sides of a followed run share: the limit, rates and state changes."""

    def __init__(self, follower: ChiefFollower | WorkerFollower) -> None:
        self.follower = follower

    @property
    def limit(self) -> int:
        return self.follower.limit

    def may_start(self, index: int) -> bool:
        return self.follower.may_start(index)

    def learning_rate_at(self, index: int) -> float | None:
        return self.follower.learning_rate_at(index)

    def state_at(self, index: int) -> dict[str, Any] | None:
        return next((v for step, v in self.follower.state_changes if step == index), None)


class ChiefFollowingDriver(_Followed):
    """The chief of a followed run (`follow.ChiefFollower`).

    Args:
        follower: The chief's follower.
        task_index: This task (the chief).
    """

    def __init__(self, follower: ChiefFollower, task_index: int = 0) -> None:
        super().__init__(follower)
        self.task_index = task_index

    def wait_to_join(self, index: int) -> int | None:
        return next((max(s.start, index) for s in self.follower.segments
                     if s.has(self.task_index) and s.end > index), None)

    def record(self, outcome: StepOutcome) -> None:
        self.follower.record(outcome.index, outcome.loss, outcome.seconds, outcome.monitor,
                             outcome.metrics, outcome.examples)

    def end(self, index: int) -> None:
        self.follower.end(index)  # releases idle workers

    def finish(self, results: Sequence[WorkerResult]) -> None:
        self.follower.finish([r.losses for r in results], results[0].step_times,
                             [r.monitor for r in results])


class WorkerFollowingChief(_Followed):
    """A worker other than the chief in a followed run (`follow.WorkerFollower`)."""

    def wait_to_join(self, index: int) -> int | None:
        return self.follower.wait_to_join(index)

    def record(self, outcome: StepOutcome) -> None:
        self.follower.record(outcome.index, outcome.loss, outcome.monitor, outcome.metrics)

    def end(self, index: int) -> None:
        pass

    def finish(self, results: Sequence[WorkerResult]) -> None:
        pass


def step_reporter(job: JobDir, mail: Mailboxes, config: RunConfig, task_index: int,
                  num_workers: int, steps_per_epoch: int, segments: list[Segment],
                  plans: list[str], schedule: EpochSchedule,
                  epoch_end: Callable[[int], None] | None) -> StepReporter:
    """The reporter of worker task `task_index`.

    Args:
        job: The job directory.
        mail: The cluster's mailboxes.
        config: The run's config (`follow_steps`: a followed run).
        task_index: This worker task.
        num_workers: Worker tasks of the cluster.
        steps_per_epoch: Steps of the first epoch.
        segments: The run's segments (a followed run extends them in place).
        plans: The strategies switched to, as text (likewise).
        schedule: The run's epochs.
        epoch_end: Chief of a followed run: called with each epoch's index
            at its end, or None.
    """
    if not config.follow_steps:
        return ProgressFile(job, segments) if task_index == 0 else \
            Unreported(segments, task_index)
    if task_index == 0:
        return ChiefFollowingDriver(ChiefFollower(
            job, mail, num_workers, steps_per_epoch, config, segments, plans, schedule,
            epoch_end=epoch_end), task_index)
    return WorkerFollowingChief(WorkerFollower(mail, task_index, steps_per_epoch, config,
                                               segments, plans))
