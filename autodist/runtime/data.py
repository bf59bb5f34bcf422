"""Deterministic batching: which examples each replica sees at each step.

Every task computes the same schedule from the RunConfig alone, so no data
is exchanged while training: the global batch of a step is split into
contiguous, nearly equal parts, one per replica in strategy order. A task on
another host is shipped only the rows its replicas read (`rows_read`).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def steps_per_epoch(num_examples: int, global_batch_size: int,
                    requested: int | None = None) -> int:
    """Steps in one epoch: `requested`, capped by the batches the data holds."""
    available = math.ceil(num_examples / global_batch_size)
    if requested is None:
        return available
    if requested < 1:
        raise ValueError(f"steps_per_epoch must be >= 1. Received: {requested}")
    return min(requested, available)


def epoch_order(num_examples: int, epoch: int, shuffle: bool, seed: int) -> np.ndarray:
    """The example order of an epoch (a seeded permutation when shuffling)."""
    if not shuffle:
        return np.arange(num_examples)
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def batch_rows(order: np.ndarray, step: int, global_batch_size: int) -> np.ndarray:
    """Rows of the global batch at `step` of the epoch (the last may be short)."""
    return order[step * global_batch_size:(step + 1) * global_batch_size]


def replica_rows(rows: np.ndarray, num_replicas: int) -> list[np.ndarray]:
    """Splits a global batch into contiguous parts, sizes differing by at most one."""
    return np.array_split(rows, num_replicas)


def rows_read(num_examples: int, global_batch_size: int, steps: int, epochs: int,
              shuffle: bool, seed: int, num_replicas: int,
              replicas: Sequence[int]) -> np.ndarray:
    """Sorted indices of every example that `replicas` read over a whole run.

    A task on another host is shipped only these rows of the data.
    """
    wanted = set(replicas)
    parts = []
    for epoch in range(epochs if shuffle else min(epochs, 1)):
        order = epoch_order(num_examples, epoch, shuffle, seed)
        for step in range(steps):
            split = replica_rows(batch_rows(order, step, global_batch_size), num_replicas)
            parts += [split[r] for r in wanted]
    if not parts:
        return np.zeros([0], np.int64)
    return np.unique(np.concatenate(parts)).astype(np.int64)
