"""Planning at scale: realistic synthetic captures, a bounded space, memory-steered picks."""
from __future__ import annotations

import numpy as np
import pytest

from autodist.bench import synthetic
from autodist.ir.resource_spec import ResourceSpec
from autodist.search.algorithms import _top
from autodist.search.simulator import Calibration, Simulator
from autodist.search.space import SearchSpace, SpaceOptions
from autodist.search.tuner import Tuner
from tests.search import workloads

GPU = Calibration(flops_per_s=1e13, memory_bytes_per_s=8e11, latency_s=2.5e-5)


def _cluster(nodes: int, gbps: float = 25, gpu_memory: str = "32GB",
             cpu_memory: str = "512GB") -> ResourceSpec:
    return ResourceSpec.from_dict({"nodes": [
        {"address": f"10.0.{i // 250}.{i % 250 + 1}", "gpus": 8, "network_bandwidth": gbps,
         "gpu_memory": gpu_memory, "cpu_memory": cpu_memory} for i in range(nodes)]})


@pytest.mark.parametrize("build,variables,params,sparse_bytes", [
    (synthetic.bert_large, 391, 335_141_888, 127_123_456),
    (synthetic.resnet50, 161, 25_557_032, 0),
    (synthetic.dlrm, 42, 24_036_595_969, 96_136_908_288),
])
def test_synthetic_models_have_their_published_sizes(build, variables, params, sparse_bytes):
    gi = build()
    assert len(gi.variables) == variables and gi.num_parameters == params
    assert sum(v.byte_size for v in gi.variables if v.sparse_gradient) == sparse_bytes


def test_resnet50_flops_and_state():
    gi = synthetic.resnet50()
    forward = sum(op.flops for op in gi.ops if op.phase == "forward")
    # 4.1 G multiply-adds per 224x224 image (He et al. count 3.8 G for v1; v1.5 strides
    # the 3x3 convolution): 2 FLOPs each.
    assert forward / synthetic.ESTIMATE_BATCH_SIZE == pytest.approx(8.18e9, rel=0.01)
    assert len(gi.state_variables) == 2 * 53                    # moving mean and variance


def test_thinned_layouts_at_scale():
    spec = _cluster(32)
    gi = workloads.graph_item([("w", (1024, 4096), False), ("e", (1_000_000, 64), True)])
    space = SearchSpace(gi, spec)
    assert space.at_scale
    # Whole on each of 32 PS, or split 2/4/8/16/32 ways over aligned blocks (16+8+4+2+1),
    # each with and without local copies, plus 4 fusion slots of all-reduce.
    assert space.option_counts[0] == 2 * (32 + 31) + 4
    layouts = [tuple(s.ps.reduction_destination for s in c.shards) for c in space.options[0]
               if c.partitioner.num_shards == 8 and not c.shards[0].ps.local_replication]
    ps = spec.ps_devices
    assert layouts == [tuple(ps[start:start + 8]) for start in range(0, 32, 8)]
    assert not any(len({s.WhichOneof("kind") for s in c.shards}) > 1 for c in space.options[0])
    # Every shard count, rotation and split up to exhaustive_ps_devices.
    eight = _cluster(8)
    thinned = SearchSpace(gi, eight)
    full = SearchSpace(gi, eight, SpaceOptions(exhaustive_ps_devices=8))
    assert thinned.option_counts[0] == 2 * (8 + 4 + 2 + 1) + 4
    assert not full.at_scale and full.option_counts[0] == 1470


def test_dlrm_tables_never_mirrored_on_gpus():
    # 96 GB of tables, 32 GB GPUs: every table that cannot fit goes to the hosts.
    gi = synthetic.dlrm()
    tuner = Tuner(gi, _cluster(2), calibration=GPU, batch_size=16 * 2048, search_budget=800)
    result = tuner.tune()
    big = [v.name for v in gi.variables if v.byte_size > 8e9]
    assert len(big) == 5
    for name in big:
        assert {s.WhichOneof("kind") for s in result.strategy.variable(name).shards} == {"ps"}
    assert "AllReduce" in result.builder_errors and "Parallax" in result.builder_step_times_s
    prediction = tuner.simulator.predict_strategy(result.strategy)
    assert prediction.fits[0]
    assert result.predicted_step_time_s <= min(result.builder_step_times_s.values())


def test_predict_sums_shared_entries_once_and_agrees():
    # The greedy step's candidates share all entries but one; the sum must not change.
    gi = workloads.many_variables(60)
    space = SearchSpace(gi, ResourceSpec.local(workers=4, ps=2, cpu_memory=0))
    sim = Simulator(space)
    rng = np.random.default_rng(0)
    start = space.sample(1, rng)[0]
    block = np.repeat(start[None, :], space.option_counts[7], axis=0)
    block[:, 7] = np.arange(space.option_counts[7])
    together = sim.predict(block).step_time_s
    one_by_one = np.array([sim.predict(row[None, :]).step_time_s[0] for row in block])
    np.testing.assert_allclose(together, one_by_one, rtol=1e-12)


def test_top_keeps_the_best_distinct_candidates_as_np_unique_would():
    rng = np.random.default_rng(1)
    for _ in range(50):
        candidates = rng.integers(0, 3, (int(rng.integers(1, 400)), 5))
        scores = rng.integers(0, 20, len(candidates)).astype(float)   # many ties
        scores = np.array([scores[np.flatnonzero((candidates == c).all(axis=1))[0]]
                           for c in candidates])  # equal candidates, equal scores
        keep = int(rng.integers(1, 40))
        got = _top(candidates, scores, keep, len(candidates))
        unique, index = np.unique(candidates, axis=0, return_index=True)
        order = np.lexsort((np.arange(len(unique)), scores[index]))[:keep]
        np.testing.assert_array_equal(got.candidates, unique[order])
        np.testing.assert_array_equal(got.scores, scores[index][order])
