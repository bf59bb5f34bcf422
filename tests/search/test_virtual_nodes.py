"""Balancing virtual nodes over replicas of unequal speed (exact expectations)."""
from __future__ import annotations

import itertools

import pytest

from autodist.ir.errors import StrategyError
from autodist.search import builders
from autodist.search.virtual_nodes import balance, balanced_counts


def _slowest(counts, throughputs):
    return max(c / t for c, t in zip(counts, throughputs))


@pytest.mark.parametrize("v,throughputs,expected", [
    (4, [1.0, 1.0], [2, 2]),
    (4, [3.0, 1.0], [3, 1]),
    (8, [1.0, 2.0, 1.0], [2, 4, 2]),
    (5, [1.0, 1.0], [3, 2]),          # ties go to the first replica
    (3, [100.0, 1.0, 1.0], [1, 1, 1]),  # everyone gets one
])
def test_balanced_counts(v, throughputs, expected):
    assert balanced_counts(v, throughputs) == expected


def test_balanced_counts_are_optimal():
    for v, throughputs in [(7, [1.0, 2.5, 0.7]), (10, [1.0, 1.3]), (9, [2.0, 1.0, 1.0, 0.5])]:
        best = min(_slowest(c, throughputs)
                   for c in itertools.product(range(1, v + 1), repeat=len(throughputs))
                   if sum(c) == v)
        assert _slowest(balanced_counts(v, throughputs), throughputs) == pytest.approx(best)


@pytest.mark.parametrize("v,throughputs,match", [
    (4, [], "at least one replica"),
    (4, [1.0, 0.0], "replica 1 must be a positive number. Received: 0.0"),
    (4, [1.0, float("nan")], "replica 1 must be a positive number"),
    (1, [1.0, 1.0], "1 virtual nodes cannot cover 2 replicas"),
])
def test_balanced_counts_rejects(v, throughputs, match):
    with pytest.raises(ValueError, match=match):
        balanced_counts(v, throughputs)


def test_balance_maps_blocks_by_speed(mlp_item, local_spec):
    strategy = builders.AllReduce().build(mlp_item, local_spec)
    w0, w1 = strategy.replicas
    out = balance(strategy, {w0: 300.0, w1: 100.0}, global_batch_size=32, num_virtual_nodes=4)
    assert out.virtual_node_devices == [w0, w0, w0, w1] and out.global_batch_size == 32
    out.validate(mlp_item, local_spec)
    # A strategy with virtual nodes keeps its B and V.
    again = balance(out, {w0: 1.0, w1: 1.0})
    assert again.virtual_node_devices == [w0, w0, w1, w1]
    with pytest.raises(StrategyError, match="missing .'/job:worker/task:1/device:CPU:0'."):
        balance(out, {w0: 1.0})
    with pytest.raises(StrategyError, match="has no virtual nodes"):
        balance(strategy, {w0: 1.0, w1: 1.0})
