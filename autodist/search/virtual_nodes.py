"""Mapping virtual nodes to replicas of unequal speed.

A replica runs its virtual nodes one after the other, and a synchronous step
waits for the slowest replica, so the step takes about
``max_r count_r / throughput_r`` virtual-node times. `balance` chooses the
counts that minimise it; since every virtual node has the same batch, the
results of training do not change, only the step time.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from autodist.ir.errors import InvalidArgumentError, StrategyError
from autodist.ir.strategy import Strategy


def balanced_counts(num_virtual_nodes: int, throughputs: Sequence[float]) -> list[int]:
    """Virtual nodes per replica minimising the slowest replica's time.

    Every replica gets at least one (a replica without work would still
    have to join each synchronization). The rest go one at a time to the
    replica that would finish it first, which is optimal for equal-sized
    tasks on machines of different speeds.

    Args:
        num_virtual_nodes: V, at least the number of replicas.
        throughputs: Examples (or virtual nodes) per second of each replica;
            only their ratios matter.

    Returns:
        The count of each replica, summing to V.

    Raises:
        ValueError: no replica, a throughput that is not a positive finite
            number, or fewer virtual nodes than replicas.
    """
    if not throughputs:
        raise InvalidArgumentError("balanced_counts needs the throughput of at least one replica")
    for i, t in enumerate(throughputs):
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise InvalidArgumentError(f"throughput of replica {i} must be a positive number. "
                                       f"Received: {t!r}")
    if num_virtual_nodes < len(throughputs):
        raise InvalidArgumentError(f"{num_virtual_nodes} virtual nodes cannot cover "
                                   f"{len(throughputs)} replicas")
    counts = [1] * len(throughputs)
    for _ in range(num_virtual_nodes - len(throughputs)):
        # Ties go to the lower index: deterministic.
        best = min(range(len(counts)), key=lambda r: ((counts[r] + 1) / throughputs[r], r))
        counts[best] += 1
    return counts


def balance(strategy: Strategy, throughputs: Mapping[str, float],
            global_batch_size: int | None = None,
            num_virtual_nodes: int | None = None) -> Strategy:
    """A copy of `strategy` whose virtual nodes are spread by replica speed.

    Args:
        strategy: The strategy (with or without virtual nodes).
        throughputs: Replica device -> measured throughput (e.g. from
            `Run.measure_throughput`); every replica must have one.
        global_batch_size: B; default the strategy's.
        num_virtual_nodes: V; default the strategy's.

    Returns:
        The strategy with contiguous blocks of virtual nodes per replica, in
        replica order, sized by `balanced_counts`.

    Raises:
        StrategyError: a replica without a throughput, a throughput for a
            device that is not a replica, or no B / V given for a strategy
            without virtual nodes.
    """
    replicas = strategy.replicas
    unknown = sorted(set(throughputs) - set(replicas))
    missing = [r for r in replicas if r not in throughputs]
    if unknown or missing:
        raise StrategyError(f"throughputs must name exactly the replicas {replicas}; "
                            f"missing {missing}, not replicas {unknown}",
                            field="graph_config.replicas", received=sorted(throughputs))
    batch = global_batch_size or strategy.global_batch_size
    num = num_virtual_nodes or (strategy.num_virtual_nodes
                                if strategy.global_batch_size is not None else None)
    if batch is None or num is None:
        raise StrategyError("the strategy has no virtual nodes: give global_batch_size and "
                            "num_virtual_nodes", field="graph_config.virtual_nodes",
                            received=None)
    try:
        counts = balanced_counts(num, [throughputs[r] for r in replicas])
    except ValueError as e:
        raise StrategyError(str(e), field="graph_config.virtual_nodes",
                            received=dict(throughputs)) from e
    devices = [r for r, c in zip(replicas, counts) for _ in range(c)]
    return strategy.with_virtual_nodes(batch, num, devices)
