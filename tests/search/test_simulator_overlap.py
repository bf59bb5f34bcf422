"""The simulator's overlap of fused all-reduce groups with the backward pass."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autodist.ir.resource_spec import ResourceSpec
from autodist.proto import strategy_pb2
from autodist.search.simulator import Calibration, Simulator, gradient_ready_fractions
from autodist.search.space import SearchSpace
from tests.search import workloads

NONE = strategy_pb2.AllReduceSynchronizer.NONE
# 3e6 FLOPs at batch 10 on 1e9 FLOP/s: 3 ms of compute, 2 ms of it backward (the
# ops carry no backward FLOPs, so the backward pass is 2/3 of the step).
CAL = Calibration(flops_per_s=1e9, op_overhead_s=0.0, latency_s=1e-4,
                  memory_bytes_per_s=1e9, run_overhead_s=1e-3, ps_overlap=1.0,
                  backward_overlap=1.0)


def _two_layers():
    # "a" then "b" in backward order, 1e6 bytes each: "a" is ready halfway.
    return workloads.graph_item([("a", (1000, 250), False), ("b", (1000, 250), False)],
                                flops=3e6)


def _candidate(space: SearchSpace, groups: tuple[int, int]) -> np.ndarray:
    row = []
    for v, group in enumerate(groups):
        row.append(next(i for i, c in enumerate(space.options[v])
                        if c.shards[0].WhichOneof("kind") == "all_reduce"
                        and c.partitioner.num_shards <= 1
                        and c.shards[0].all_reduce.compressor == NONE
                        and c.shards[0].all_reduce.group == group))
    return np.array(row + [0])


def _predict(gbps: float, calibration: Calibration = CAL):
    spec = ResourceSpec.local(workers=2, bandwidth_gbps=gbps)
    space = SearchSpace(_two_layers(), spec)
    sim = Simulator(space, calibration, batch_size=20)
    return sim, sim.predict(np.stack([_candidate(space, (0, 0)), _candidate(space, (0, 1))]))


def test_ready_fractions_follow_the_backward_order_by_bytes():
    item = workloads.graph_item([("last", (10, 10), False), ("first", (30, 10), False)])
    # gradient_order: "last" 0 (its gradient comes first), "first" 1.
    assert gradient_ready_fractions(item) == {"last": 0.25, "first": 1.0}


def test_one_group_ready_at_the_end_hides_nothing():
    sim, p = _predict(8)
    assert sim.backward_s == pytest.approx(2e-3)
    assert p.parts["overlap_s"][0] == 0.0
    additive = Simulator(sim.space, dataclasses.replace(CAL, backward_overlap=0.0),
                         batch_size=20).predict(_candidate(sim.space, (0, 0))[None, :])
    assert p.step_time_s[0] == additive.step_time_s[0]


def test_an_early_groups_transfer_hides_behind_the_backward_pass():
    # 8 Gbit/s = 1e9 B/s, 2 workers: each group's ring moves 1e6 B per node: 1 ms.
    # Group "a" ready at 1 ms, "b" at 2 ms: the link is done at 3 ms, 1 ms after the
    # backward pass; exposed: 1 ms + one group's fixed cost (2 hops x 0.1 ms), charged
    # additively: 2 ms + 0.4 ms -> 1.2 ms hidden.
    sim, p = _predict(8)
    assert p.parts["overlap_s"][1] == pytest.approx(1.2e-3)
    # The second group's hops (0.2 ms) cost, its hidden transfer saves.
    assert p.step_time_s[1] - p.step_time_s[0] == pytest.approx(0.2e-3 - 1.2e-3)


def test_fixed_costs_never_hide_behind_the_backward_pass():
    # At 800 Gbit/s the transfers take 10 us each; with 1 ms per hop the step waits
    # for both groups' fixed costs (4 ms) and hides only the transfers (20 us).
    cal = dataclasses.replace(CAL, collective_latency_s=1e-3)
    sim, p = _predict(800, cal)
    assert p.parts["overlap_s"][1] == pytest.approx(2e-5)
    assert p.step_time_s[1] > p.step_time_s[0]


def test_buckets_rank_first_only_where_the_link_is_slow():
    cal = dataclasses.replace(CAL, collective_latency_s=5e-4)
    for gbps, buckets_win in ((80, False), (4, True)):
        _, p = _predict(gbps, cal)
        assert (p.step_time_s[1] < p.step_time_s[0]) == buckets_win, gbps


def test_backward_overlap_zero_is_the_additive_model():
    cal = dataclasses.replace(CAL, backward_overlap=0.0)
    _, p = _predict(8, cal)
    assert list(p.parts["overlap_s"]) == [0.0, 0.0]
    assert p.step_time_s[1] - p.step_time_s[0] == pytest.approx(0.2e-3)


def test_backward_overlap_is_off_by_default():
    assert Calibration().backward_overlap == 0.0
    _, p = _predict(8, dataclasses.replace(CAL, backward_overlap=Calibration().backward_overlap))
    assert list(p.parts["overlap_s"]) == [0.0, 0.0]


def test_backward_overlap_is_checked():
    with pytest.raises(ValueError, match="backward_overlap must be in"):
        Calibration(backward_overlap=1.5)
    assert Calibration.from_dict({"backward_overlap": 0.25}).backward_overlap == 0.25
