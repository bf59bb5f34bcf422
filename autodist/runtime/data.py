"""Deterministic batching: which examples each replica sees at each step.

Every task computes the same schedule from the RunConfig alone, so no data
is exchanged while training: the global batch of a step is split into
contiguous, nearly equal parts, one per virtual node in virtual-node order
(without virtual nodes, one per replica in strategy order). Which examples a
virtual node reads never depends on the replica that runs it. A task on
another host is shipped only the rows its virtual nodes read (`rows_read`).
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
