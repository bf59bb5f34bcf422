"""Deterministic batching: which examples each replica sees at each step.

Every task computes the same schedule from the RunConfig alone, so no data
is exchanged while training: the global batch of a step is split into
contiguous, nearly equal parts, one per virtual node in virtual-node order
(without virtual nodes, one per replica in strategy order). Which examples a
virtual node reads never depends on the replica that runs it. A task on
another host is shipped only the rows its virtual nodes read (`rows_read`).

With arrays, the global batches are rows of the data in each epoch's order.
With a dataset, they are its elements, read in the order Keras' `fit`
reads them (`dataset_epochs`).
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from autodist.ir.errors import InvalidArgumentError


def steps_per_epoch(num_examples: int, global_batch_size: int,
                    requested: int | None = None) -> int:
    """Steps in one epoch: `requested`, capped by the batches the data holds."""
    available = math.ceil(num_examples / global_batch_size)
    if requested is None:
        return available
    if requested < 1:
        raise InvalidArgumentError(f"steps_per_epoch must be >= 1. Received: {requested}")
    return min(requested, available)


@dataclasses.dataclass(frozen=True)
class ArrayOrder:
    """The order in which each pass over arrays reads the examples.

    As Keras' array adapter: in order (`shuffle=False`), a permutation per
    pass (`True`), or each batch's rows permuted (`"batch"`). With TensorFlow's
    global seed set (`keras.utils.set_random_seed`), Keras' own order is
    reproduced: it is the same every pass, computed by Keras' input pipeline
    in the driver (`keras_order`) and shipped with the job. Without one,
    Keras' order cannot be known; each pass is then a permutation seeded by
    (`seed`, pass).

    Attributes:
        num_examples: Examples in the data.
        shuffle: False, True or "batch".
        seed: Seeds the permutations when Keras' order is not known.
        first_pass: Index of the run's first pass (`fit(initial_epoch=)`), so a
            continued run reads new orders.
        keras: Keras' order of every pass, or None.
    """

    num_examples: int
    shuffle: bool | str = False
    seed: int = 0
    first_pass: int = 0
    keras: np.ndarray | None = None

    def of_pass(self, index: int, batch: int) -> np.ndarray:
        """The examples in the order pass `index` reads them with global batch `batch`."""
        if not self.shuffle:
            return np.arange(self.num_examples)
        if self.keras is not None:
            return self.keras
        rng = np.random.default_rng([self.seed, self.first_pass + index])
        if self.shuffle != "batch":
            return rng.permutation(self.num_examples)
        order = np.arange(self.num_examples)
        for start in range(0, self.num_examples, batch):
            order[start:start + batch] = start + rng.permutation(
                len(order[start:start + batch]))
        return order


def epoch_order(num_examples: int, epoch: int, shuffle: bool, seed: int) -> np.ndarray:
    """The example order of an epoch that reads one whole pass (seeded when shuffling)."""
    return ArrayOrder(num_examples, shuffle, seed).of_pass(epoch, max(num_examples, 1))


def keras_order(num_examples: int, batch_size: int, shuffle: bool | str) -> np.ndarray | None:
    """Keras' order of the examples in every pass of `fit(x, y, shuffle=shuffle)`, or None
    when it cannot be reproduced (no TensorFlow global seed: Keras draws a new random
    order each pass) or is plain (`shuffle=False`).

    Runs Keras' own array input pipeline (`ArrayDataAdapter.get_tf_dataset`) on
    the example indices. Its shuffle is a `tf.random.shuffle` inside a dataset
    function: seeded by the global seed and the function's graph alone, it draws
    the same order every pass (checked on two passes).
    """
    from tensorflow.python.eager import context

    if not shuffle or context.global_seed() is None:
        return None
    from keras.src.trainers.data_adapters.array_data_adapter import (
        ArrayDataAdapter)

    adapter = ArrayDataAdapter(np.arange(num_examples, dtype=np.int64),
                               batch_size=batch_size, shuffle=shuffle)
    dataset = adapter.get_tf_dataset()
    passes = [np.concatenate([np.asarray(batch) for batch in dataset]) for _ in range(2)]
    if not np.array_equal(*passes) or sorted(passes[0].tolist()) != list(range(num_examples)):
        raise InvalidArgumentError(
            "Keras' shuffled order of the examples differs between passes here (a Keras or "
            "TensorFlow version this runtime does not know); it cannot be reproduced on the "
            "workers: pass shuffle=False, or shuffle the arrays yourself")
    return passes[0].astype(np.int64)


def batch_rows(order: np.ndarray, step: int, global_batch_size: int) -> np.ndarray:
    """Rows of the global batch at `step` of the epoch (the last may be short)."""
    return order[step * global_batch_size:(step + 1) * global_batch_size]


def virtual_node_rows(rows: np.ndarray, num_virtual_nodes: int) -> list[np.ndarray]:
    """Splits a global batch into contiguous parts, sizes differing by at most one."""
    return np.array_split(rows, num_virtual_nodes)


def rows_read(schedule: "EpochSchedule", order: ArrayOrder, num_virtual_nodes: int,
              virtual_nodes: Sequence[int]) -> np.ndarray:
    """Sorted indices of every example that `virtual_nodes` read over a whole run.

    A task on another host is shipped only these rows of the data.
    """
    wanted = set(virtual_nodes)
    parts = []
    seen_passes: set[int] = set()
    for epoch in schedule.array_epochs():
        if not order.shuffle and epoch.pass_index in seen_passes:
            continue
        seen_passes.add(epoch.pass_index)
        rows = order.of_pass(epoch.pass_index, epoch.batch)
        for step in range(epoch.start, epoch.start + epoch.steps):
            split = virtual_node_rows(batch_rows(rows, step, epoch.batch), num_virtual_nodes)
            parts += [split[r] for r in wanted]
    if not parts:
        return np.zeros([0], np.int64)
    return np.unique(np.concatenate(parts)).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class DatasetEpoch:
    """The batches one epoch of Keras' `fit(dataset)` reads.

    Attributes:
        iterator: Which `iter(dataset)` call of the fit they come from
            (0-based). Each call starts a new pass, and a shuffle with
            `reshuffle_each_iteration` draws its next seeds for it.
        start: Batches of that pass read by earlier epochs.
        steps: Batches this epoch reads (0: Keras runs an empty epoch).
        runs_out: Whether Keras' step after these finds the pass at its end
            (its `next()` raises, which ends the epoch).
    """

    iterator: int
    start: int
    steps: int
    runs_out: bool = False


def dataset_epochs(batches: int | None, cardinality_known: bool,
                   requested_steps: int | None, epochs: int) -> list[DatasetEpoch]:
    """What each epoch of Keras 3's `fit(dataset)` reads (TensorFlow backend).

    Follows Keras' `EpochIterator` step by step. Without `steps_per_epoch`
    every epoch reads one whole pass; Keras calls `iter` once per epoch,
    and twice (one iterator is never read) when the dataset's cardinality is
    known. With `steps_per_epoch` one iterator goes on across epochs until
    the dataset runs out: the epoch then ends early, and the next starts a
    new pass. A dataset of unknown cardinality that runs out exactly at an
    epoch's end is only found out at the next epoch's first step, which then
    runs no step at all.

    Args:
        batches: Batches in one pass (None: infinite).
        cardinality_known: Whether `dataset.cardinality()` gives `batches`
            (else Keras learns it by running out).
        requested_steps: `fit`'s steps_per_epoch (None: every batch).
        epochs: Epochs of the fit.

    Raises:
        ValueError: An infinite dataset without `requested_steps`, or an
            empty one.
    """
    return _read_like_keras(batches, cardinality_known, requested_steps, epochs)[0]


def dataset_passes(batches: int | None, cardinality_known: bool,
                   requested_steps: int | None, epochs: int) -> int:
    """How many times Keras 3's `fit(dataset)` calls `iter(dataset)` over `epochs`
    epochs (passes it reads, and those it starts without reading); arguments as
    `dataset_epochs`."""
    return _read_like_keras(batches, cardinality_known, requested_steps, epochs)[1]


def _read_like_keras(batches: int | None, cardinality_known: bool,
                     requested_steps: int | None, epochs: int
                     ) -> tuple[list[DatasetEpoch], int]:
    """(`dataset_epochs`, `dataset_passes`)."""
    if batches is None and requested_steps is None:
        raise InvalidArgumentError("an infinite dataset needs steps_per_epoch")
    if batches == 0:
        raise InvalidArgumentError("the dataset is empty")
    created = 0           # iter() calls so far
    current = None        # the iterator being read (its index), if any
    position = 0          # batches read from it
    seen = 0              # Keras' count of steps started on it
    known = batches if cardinality_known else None   # what Keras knows of the length
    out = []
    for _ in range(epochs):
        limit = requested_steps or known or -1
        if limit < 0 or current is None or requested_steps is None:
            current, position, seen = created, 0, 0
            created += 1
        iterator, start, ran_out = current, position, False
        while limit < 0 or position - start < limit:
            if limit > 0 and known and seen >= known:
                break
            seen += 1
            if batches is not None and position >= batches:   # next() raises
                ran_out, current = True, None
                if known is None:
                    known = seen
                break
            position += 1
        out.append(DatasetEpoch(iterator, start, position - start, ran_out))
        if not ran_out and limit > 0 and known and seen >= known:
            current, position, seen = created, 0, 0   # Keras starts the next pass now
            created += 1
    return out, created


def one_pass_epochs(lengths: Sequence[int], runs_out: bool = False) -> list[DatasetEpoch]:
    """Epochs of `lengths` steps read in turn from one pass: a dataset whose elements are
    already every step's batch in the run's order (a generator's or a PyDataset's,
    read in the driver as Keras reads them, `python_data`); `runs_out`: Keras' step
    after the last finds the input's end."""
    out, start = [], 0
    for k, steps in enumerate(lengths):
        out.append(DatasetEpoch(0, start, steps, runs_out and k == len(lengths) - 1))
        start += steps
    return out


@dataclasses.dataclass(frozen=True)
class ArrayEpoch:
    """The batches one epoch of Keras' `fit(x, y)` reads from its arrays.

    Attributes:
        pass_index: Which pass over the data (its order: `ArrayOrder`).
        start: Batches of that pass read by earlier epochs.
        steps: Batches this epoch reads.
        batch: Its global batch.
    """

    pass_index: int
    start: int
    steps: int
    batch: int


class EpochSchedule:
    """Where each epoch of a run starts, and its global batch.

    The global batch may change between epochs (a policy's
    `set_batch_size`): an epoch's batch is that of the strategy running its
    first step. With arrays, epochs read as Keras' `EpochIterator` reads its
    array adapter (`array_epochs`): a whole pass each, or with
    `steps_per_epoch` one pass goes on across epochs until it runs out (the
    epoch then ends early, and the next one starts a new pass). Every task
    derives the same schedule from the same segments. A dataset's epochs have
    the lengths Keras gives them (`dataset_epochs`), and its elements are its
    global batches.

    Args:
        num_examples: Examples in the data (arrays).
        epochs: Epochs of the run.
        requested_steps: `fit`'s steps_per_epoch (None: every batch).
        batch_at: The global batch of the strategy running a step.
        lengths: A dataset's steps in each epoch (None: arrays).
    """

    def __init__(self, num_examples: int, epochs: int, requested_steps: int | None,
                 batch_at: Callable[[int], int], lengths: Sequence[int] | None = None) -> None:
        self.num_examples = num_examples
        self.epochs = epochs
        self.requested_steps = requested_steps
        self.batch_at = batch_at
        self.lengths = None if lengths is None else list(lengths)

    def array_epochs(self) -> list[ArrayEpoch]:
        """What each epoch reads from the arrays, as Keras' `EpochIterator` reads them."""
        out: list[ArrayEpoch] = []
        pass_index, position, open_pass, previous, step = -1, 0, False, None, 0
        for _ in range(self.epochs):
            batch = self.batch_at(step)
            per_pass = max(1, math.ceil(self.num_examples / batch))
            if not open_pass or self.requested_steps is None or batch != previous:
                pass_index, position = pass_index + 1, 0   # Keras' iter(): a new pass
            left = per_pass - position
            steps = left if self.requested_steps is None else min(self.requested_steps, left)
            out.append(ArrayEpoch(pass_index, position, steps, batch))
            position, step, previous = position + steps, step + steps, batch
            open_pass = position < per_pass
        return out

    def starts(self) -> list[int]:
        """The first step of each epoch, then the run's end (epochs + 1 entries)."""
        out = [0]
        lengths = self.lengths[:self.epochs] if self.lengths is not None else \
            [e.steps for e in self.array_epochs()]
        for length in lengths:
            out.append(out[-1] + length)
        return out

    def total(self) -> int:
        """Steps of the whole run."""
        return self.starts()[-1]

    def locate(self, index: int) -> tuple[int, int, int, int]:
        """(epoch, step within it, its global batch, its steps) of step `index`."""
        starts = self.starts()
        epoch = min(bisect.bisect_right(starts, index) - 1, self.epochs - 1)
        return (epoch, index - starts[epoch], self.batch_at(starts[epoch]),
                starts[epoch + 1] - starts[epoch])

    def rows_at(self, index: int, order: ArrayOrder) -> np.ndarray:
        """Arrays: the examples of the global batch of step `index`."""
        starts = self.starts()
        epochs = self.array_epochs()
        epoch = min(bisect.bisect_right(starts, index) - 1, self.epochs - 1)
        reads = epochs[epoch]
        return batch_rows(order.of_pass(reads.pass_index, reads.batch),
                          reads.start + index - starts[epoch], reads.batch)

    def examples(self, index: int) -> int:
        """Examples in the global batch of step `index` (the last may be short); arrays
        only (a dataset's batches are counted as they are read)."""
        starts = self.starts()
        epoch = min(bisect.bisect_right(starts, index) - 1, self.epochs - 1)
        reads = self.array_epochs()[epoch]
        batch_index = reads.start + index - starts[epoch]
        return max(0, min(reads.batch, self.num_examples - batch_index * reads.batch))
