"""Deterministic batching: which examples each replica sees at each step.

Every task computes the same schedule from the RunConfig alone, so no data
is exchanged while training: the global batch of a step is split into
contiguous, nearly equal parts, one per virtual node in virtual-node order
(without virtual nodes, one per replica in strategy order). Which examples a
virtual node reads never depends on the replica that runs it. A task on
another host is shipped only the rows its virtual nodes read (`rows_read`).
"""
from __future__ import annotations

import bisect
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


class EpochSchedule:
    """Where each epoch of a run starts, and its global batch.

    The global batch may change between epochs (a policy's
    `set_batch_size`): an epoch's batch is that of the strategy running its
    first step, and it has `steps_per_epoch(num_examples, batch, requested)`
    steps. Every task derives the same schedule from the same segments.

    Args:
        num_examples: Examples in the data.
        epochs: Epochs of the run.
        requested_steps: `fit`'s steps_per_epoch (None: every batch).
        batch_at: The global batch of the strategy running a step.
    """

    def __init__(self, num_examples: int, epochs: int, requested_steps: int | None,
                 batch_at: Callable[[int], int]) -> None:
        self.num_examples = num_examples
        self.epochs = epochs
        self.requested_steps = requested_steps
        self.batch_at = batch_at

    def starts(self) -> list[int]:
        """The first step of each epoch, then the run's end (epochs + 1 entries)."""
        out = [0]
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
        """Examples in the global batch of step `index` (the last may be short)."""
        _, step, batch, _ = self.locate(index)
        return max(0, min(batch, self.num_examples - step * batch))
