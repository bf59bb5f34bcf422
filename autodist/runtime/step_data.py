"""What a worker trains on at each step: the step's global batch.

Two sources give the same interface (`StepData`):

* `ArrayData`: arrays in the job directory (on another host, a shipped
  shard of the rows its virtual nodes read), batched by the seeded schedule
  of `batching`.
* `dataset_stream.DatasetStream`: the elements of the job's dataset, read
  in Keras' order by a background producer.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, Sequence

import numpy as np

from autodist.launch.job import JobDir
from autodist.runtime import batching
from autodist.runtime.run_config import RunConfig


@dataclasses.dataclass(frozen=True)
class GlobalBatch:
    """One step's global batch.

    Attributes:
        inputs: The model inputs: arrays that `rows` index.
        targets: The targets and sample weights as one array (`targets.pack`).
        rows: The batch's examples in `inputs` and `targets`, in order.
        held_rows: A shipped shard's sorted example indices (`rows` are
            then indices of the full data), or None.
    """

    inputs: Sequence[np.ndarray]
    targets: np.ndarray
    rows: np.ndarray
    held_rows: np.ndarray | None = None

    @property
    def size(self) -> int:
        return len(self.rows)


class StepData(Protocol):
    """The global batches of a run, by the step's global index."""

    schedule: batching.EpochSchedule

    @property
    def lengths(self) -> list[int]:
        """Steps of each epoch at the run's first global batch."""

    def batch(self, index: int) -> GlobalBatch:
        """The global batch of step `index` (steps are asked for in increasing order)."""

    def probe_batch(self, index: int) -> GlobalBatch:
        """The `index`-th batch a throughput probe runs (`RunConfig.probe_steps`)."""

    def examples(self, index: int) -> int:
        """Examples in the global batch of step `index` (one already read)."""

    def epochs_run_out(self) -> list[bool]:
        """Per epoch, whether Keras' step after its last finds the data's end
        (`autodist.runtime.run_outs`)."""

    def close(self) -> None:
        """Stops reading ahead."""


class ArrayData:
    """The job's arrays, batched by the schedule every task computes.

    Args:
        job: The job directory.
        config: The run's config.
        batch_at: The global batch of the strategy running a step.
    """

    def __init__(self, job: JobDir, config: RunConfig, batch_at: Callable[[int], int]) -> None:
        self.config = config
        self.inputs, self.targets = job.data()
        self.num_examples, self.held_rows = job.shard()
        self.schedule = batching.EpochSchedule(self.num_examples, config.epochs,
                                               config.steps_per_epoch, batch_at)
        self.order = batching.ArrayOrder(self.num_examples, config.shuffle, config.seed,
                                         config.first_epoch, job.order())

    def epochs_run_out(self) -> list[bool]:
        return []   # Keras knows the arrays' length: it never reads past their end

    @property
    def lengths(self) -> list[int]:
        return [e.steps for e in batching.EpochSchedule(
            self.num_examples, self.config.epochs, self.config.steps_per_epoch,
            lambda step: self.config.global_batch_size).array_epochs()]

    def batch(self, index: int) -> GlobalBatch:
        return GlobalBatch(self.inputs, self.targets, self.schedule.rows_at(index, self.order),
                           self.held_rows)

    def probe_batch(self, index: int) -> GlobalBatch:
        """The first pass's batches, from its first again when there are fewer."""
        batch = self.config.global_batch_size
        steps = batching.steps_per_epoch(self.num_examples, batch)
        return GlobalBatch(self.inputs, self.targets,
                           batching.batch_rows(self.order.of_pass(0, batch), index % steps,
                                               batch),
                           self.held_rows)

    def examples(self, index: int) -> int:
        return self.schedule.examples(index)

    def close(self) -> None:
        pass
