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


def epoch_order(num_examples: int, epoch: int, shuffle: bool, seed: int) -> np.ndarray:
    """The example order of an epoch (a seeded permutation when shuffling)."""
    if not shuffle:
        return np.arange(num_examples)
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def batch_rows(order: np.ndarray, step: int, global_batch_size: int) -> np.ndarray:
    """Rows of the global batch at `step` of the epoch (the last may be short)."""
    return order[step * global_batch_size:(step + 1) * global_batch_size]


def virtual_node_rows(rows: np.ndarray, num_virtual_nodes: int) -> list[np.ndarray]:
    """Splits a global batch into contiguous parts, sizes differing by at most one."""
    return np.array_split(rows, num_virtual_nodes)


def rows_read(num_examples: int, global_batch_size: int, steps: int, epochs: int,
              shuffle: bool, seed: int, num_virtual_nodes: int,
              virtual_nodes: Sequence[int]) -> np.ndarray:
    """Sorted indices of every example that `virtual_nodes` read over a whole run.

    A task on another host is shipped only these rows of the data.
    """
    wanted = set(virtual_nodes)
    parts = []
    for epoch in range(epochs if shuffle else min(epochs, 1)):
        order = epoch_order(num_examples, epoch, shuffle, seed)
        for step in range(steps):
            split = virtual_node_rows(batch_rows(order, step, global_batch_size),
                                      num_virtual_nodes)
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


class EpochSchedule:
    """Where each epoch of a run starts, and its global batch.

    The global batch may change between epochs (a policy's
    `set_batch_size`): an epoch's batch is that of the strategy running its
    first step, and it has `steps_per_epoch(num_examples, batch, requested)`
    steps. Every task derives the same schedule from the same segments.
    A dataset's epochs have the lengths Keras gives them (`dataset_epochs`),
    and its elements are its global batches.

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

    def starts(self) -> list[int]:
        """The first step of each epoch, then the run's end (epochs + 1 entries)."""
        out = [0]
        if self.lengths is not None:
            for length in self.lengths[:self.epochs]:
                out.append(out[-1] + length)
            return out
        for _ in range(self.epochs):
            out.append(out[-1] + steps_per_epoch(self.num_examples, self.batch_at(out[-1]),
                                                 self.requested_steps))
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

    def examples(self, index: int) -> int:
        """Examples in the global batch of step `index` (the last may be short); arrays
        only (a dataset's batches are counted as they are read)."""
        _, step, batch, _ = self.locate(index)
        return max(0, min(batch, self.num_examples - step * batch))
