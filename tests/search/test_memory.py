"""Memory-aware search: per-device bytes by hand, options that cannot fit, the tuner's picks."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

from autodist.ir.resource_spec import ResourceSpec
from autodist.proto import strategy_pb2
from autodist.search import builders
from autodist.search.memory import (REPLICA, WORKER_HOST, DoesNotFitError, MemoryModel,
                                    activation_bytes, format_bytes)
from autodist.search.simulator import Simulator
from autodist.search.space import SearchSpace, SpaceOptions
from autodist.search.tuner import Tuner
from tests.search import workloads

AllReduceSynchronizer = strategy_pb2.AllReduceSynchronizer
W0 = "/job:worker/task:0/device:CPU:0"   # node 0's host (a PS device)
W1 = "/job:worker/task:1/device:CPU:0"   # node 1's host
HOST0, HOST1 = 2, 3                       # their columns


def _gpu_spec(gpu_memory: str = "1GB", cpu_memory: str = "64GB", nodes: int = 2,
              gpus: int = 2, ps_node: bool = False) -> ResourceSpec:
    """GPU nodes (also PS, or with `ps_node` workers only and a separate PS node)."""
    roles = ["worker"] if ps_node else ["worker", "ps"]
    nodes_ = [{"address": f"10.0.0.{i}", "gpus": gpus, "network_bandwidth": 10,
               "gpu_memory": gpu_memory, "cpu_memory": cpu_memory, "roles": roles}
              for i in range(nodes)]
    if ps_node:
        nodes_.append({"address": "10.0.1.0", "roles": ["ps"], "network_bandwidth": 10,
                       "cpu_memory": cpu_memory})
    return ResourceSpec.from_dict({"nodes": nodes_})


def _workload():
    # w: dense 1e6 B; emb: sparse 1e6 B, rows of 100 B, 2 lookups per example.
    # Adam: two slots, and it squares sparse gradients and densifies their updates.
    # Activations at the estimate batch 10: input 1000 + Relu 5000 + the largest forward
    # output again (its gradient) 5000; Identity and Reshape alias their input, backward
    # outputs do not count.
    return workloads.graph_item(
        [("w", (1000, 250), False), ("emb", (10000, 25), True)], optimizer="adam",
        slots=("m", "v"), lookups_per_example=2.0,
        ops=[("Placeholder", "input", 1000), ("Relu", "forward", 5000),
             ("Identity", "forward", 7777), ("Reshape", "forward", 100),
             ("MatMul", "backward", 3000), ("MatMul", "backward", 2000)])


def _ps(*devices, local=False, axis=0):
    config = strategy_pb2.VariableConfig()
    if len(devices) > 1:
        config.partitioner.axis = axis
        config.partitioner.num_shards = len(devices)
    for d in devices:
        config.shards.add(ps=strategy_pb2.PSSynchronizer(reduction_destination=d, sync=True,
                                                         local_replication=local))
    return config


def _ar(spec=AllReduceSynchronizer.AUTO):
    config = strategy_pb2.VariableConfig()
    config.shards.add(all_reduce=AllReduceSynchronizer(spec=spec))
    return config


# 4 replicas, a batch of 40: 10 examples, so 20 looked-up rows per replica and table.
@pytest.mark.parametrize("name,config,expected", [
    # Mirrored: (1 + 2 slots) x 1e6 + gradient 1e6 + fused buffer 1e6.
    ("w", _ar(), {REPLICA: 5e6}),
    # On node 1's PS: variable and slots, the 4 replicas' queued gradients and their sum;
    # replicas read it and push a gradient.
    ("w", _ps(W1), {HOST1: 3e6 + 5e6, REPLICA: 2e6}),
    ("w", _ps(W0, local=True), {HOST0: 8e6, REPLICA: 2e6, WORKER_HOST: 1e6}),
    ("w", _ps(W0, W1), {HOST0: 1.5e6 + 2.5e6, HOST1: 1.5e6 + 2.5e6, REPLICA: 2e6}),
    # Sparse on a PS: (1 + 2) x 1e6, the 4 replicas' queued rows 4 x 20 x (100 + 8) and
    # their concatenation, twice (their squares), and the dense temporary of Adam's update
    # 1e6; each replica reads 20 rows (2000 B) and pushes their gradient (2160 B).
    ("emb", _ps(W0), {HOST0: 3e6 + 2 * 17280 + 1e6, REPLICA: 4160}),
    ("emb", _ps(W0, W1), {HOST0: 1.5e6 + 2 * 8640 + 5e5, HOST1: 1.5e6 + 2 * 8640 + 5e5,
                          REPLICA: 4160}),
    # All-gathered: the table and slots, its own rows and all 4 replicas' (5 x 2160), and
    # the dense temporary of the update.
    ("emb", _ar(), {REPLICA: 3e6 + 5 * 2160 + 1e6}),
    # Densified (RING): a dense gradient and its squares, each with a fused buffer.
    ("emb", _ar(AllReduceSynchronizer.RING), {REPLICA: 3e6 + 4e6}),
])
def test_config_bytes_by_hand(name, config, expected):
    gi = _workload()
    space = SearchSpace(gi, _gpu_spec())
    config.var_name = name
    got = space.memory.config_columns(gi.variable(name), config)
    want = np.zeros(space.memory.columns)
    for column, nbytes in expected.items():
        want[column] = nbytes
    np.testing.assert_allclose(got, want)


def test_activation_estimate_by_hand():
    gi = _workload()
    # (1000 + 5000 + 5000) at batch 10, scaled to the batch per replica.
    assert activation_bytes(gi, 10) == 11000
    assert activation_bytes(gi, 25) == 27500


def test_pools_of_gpu_nodes():
    spec = _gpu_spec()
    model = MemoryModel(_workload(), spec, batch_size=40, rows_per_example={"emb": 2.0})
    names = [p.name for p in model.pools]
    assert names == ["GPU memory of /job:worker/task:0/device:GPU:0 (and 3 more alike)",
                     "host memory of /job:worker/task:0", "host memory of /job:worker/task:1"]
    np.testing.assert_allclose(model.capacities, [1e9, 64e9, 64e9])
    np.testing.assert_allclose(model.fixed[REPLICA], 11000)
    # w on node 1's PS with a local copy (its variable, 2 slots, the 4 replicas' queued
    # gradients and their sum), emb all-gathered.
    columns = (model.config_columns(_workload().variable("w"), _ps(W1, local=True))
               + model.config_columns(_workload().variable("emb"), _ar()))
    np.testing.assert_allclose(model.pool_bytes(columns)[0],
                               [11000 + 2e6 + 4010800, 1e6, 8e6 + 1e6])


def test_cpu_replicas_share_their_host_with_ps_variables():
    spec = ResourceSpec.local(workers=2, ps=0, cpu_memory="1GB")
    model = MemoryModel(_workload(), spec, batch_size=40)
    assert [p.name for p in model.pools] == ["host memory of /job:worker/task:0",
                                            "host memory of /job:worker/task:1"]
    # Node 0's host holds its replica, its PS variables and its local copies.
    np.testing.assert_allclose(model.coefficients[0][[REPLICA, WORKER_HOST, HOST0, HOST1]],
                               [1, 1, 1, 0])


def test_unknown_memory_constrains_nothing():
    spec = ResourceSpec.from_dict({"nodes": [{"address": "a", "gpus": 2}]})
    space = SearchSpace(workloads.graph_item([("table", (2_000_000, 250), True)]), spec)
    assert not space.memory.constrained and space.memory_refusals == [[]]
    assert all(math.isinf(p.capacity_bytes) for p in space.memory.pools)
    sim = Simulator(space)
    prediction = sim.predict(space.sample(20, np.random.default_rng(0)))
    assert prediction.fits.all() and (prediction.parts["memory_fraction"] == 0).all()


def _two_gb_table():
    # 2,000,000 rows of 1000 B: 2 GB, one lookup per example; a small dense layer.
    return workloads.graph_item([("table", (2_000_000, 250), True),
                                 ("dense", (1024, 1024), False)], optimizer="sgd", flops=1e9)


def test_a_2gb_table_on_1gb_gpus_is_never_all_reduced():
    spec = _gpu_spec("1GB", "64GB")
    gi = _two_gb_table()
    space = SearchSpace(gi, spec)
    table = space.options[0]
    assert table and all(s.WhichOneof("kind") == "ps" for c in table for s in c.shards)
    refused = {r.config.shards[0].all_reduce.spec for r in space.memory_refusals[0]}
    assert refused == {AllReduceSynchronizer.ALL_GATHER}  # the mirrored table
    sim = Simulator(space)
    samples = space.sample(500, np.random.default_rng(0))
    assert sim.predict(samples).fits.all()
    tuner = Tuner(gi, spec, search_budget=600)
    result = tuner.tune()
    assert {s.WhichOneof("kind") for s in result.strategy.variable("table").shards} == {"ps"}
    for name in ("AllReduce", "PartitionedAR", "RandomAxisPartitionAR"):
        assert name not in result.builder_step_times_s
        assert re.fullmatch(r"does not fit in memory: needs 2\.0\d GB in GPU memory of "
                            r"/job:worker/task:0/device:GPU:0 \(and 3 more alike\) "
                            r"\(capacity 1 GB\)", result.builder_errors[name])
    line = next(t for t in result.explanation.splitlines() if t.startswith("  table"))
    assert re.search(r"memory: all-gather would need 2\.0\d GB in GPU memory of", line)
    assert line.endswith("> 1 GB: not offered")
    # Unconstrained, the same search does all-gather the table on the GPUs.
    free = _gpu_spec("0", "0")
    assert "AllReduce" in Tuner(gi, free, search_budget=50).builder_strategies


def test_candidates_that_do_not_fit_together_are_never_picked():
    # Two dense 150 MB layers, plain SGD: mirrored each needs 450 MB per GPU (variable,
    # gradient, fused buffer), on a PS 300 MB (the read and the gradient). Both mirrored
    # (900 MB) overflow 800 MB GPUs; one mirrored and one on a PS (750 MB) fit.
    gi = workloads.graph_item([("a", (37500, 1000), False), ("b", (37500, 1000), False)],
                              optimizer="sgd", flops=1e9)
    options = SpaceOptions(allow_hybrid=False)
    free = Tuner(gi, _gpu_spec("0", "0", ps_node=True), space_options=options,
                 search_budget=400).tune()
    assert [_kinds(free.strategy, n) for n in "ab"] == [{"all_reduce"}, {"all_reduce"}]

    tuner = Tuner(gi, _gpu_spec("800MB", "64GB", ps_node=True), space_options=options,
                  search_budget=400)
    space = tuner.space
    # Each may be mirrored (with the other on a PS)...
    assert all(any(s.WhichOneof("kind") == "all_reduce" for c in o for s in c.shards)
               for o in space.options)
    # ... but not both.
    both = space.encode(free.strategy)
    prediction = tuner.simulator.predict(both[None, :])
    assert not prediction.fits[0] and prediction.parts["memory_fraction"][0] == \
        pytest.approx(900e6 / 800e6)
    result = tuner.tune()
    assert sorted(len(_kinds(result.strategy, n) & {"all_reduce"}) for n in "ab") == [0, 1]
    assert "does not fit in memory with the rest" in result.explanation
    assert "memory: fullest GPU memory of" in result.explanation
    assert result.builder_errors["AllReduce"].startswith(
        "does not fit in memory: needs 900 MB in GPU memory")


def test_a_variable_that_fits_nowhere_is_a_clear_error():
    gi = workloads.graph_item([("w", (500_000, 1000), False)])    # 2 GB, dense
    with pytest.raises(DoesNotFitError, match=(
            r"variable 'w' \(2 GB, dense gradient\) fits no device: its smallest option "
            r"needs 4 GB in GPU memory of /job:worker/task:0/device:GPU:0 \(and 3 more "
            r"alike\) \(capacity 1 GB\), with every other variable at its smallest and a "
            r"batch of 40")):
        SearchSpace(gi, _gpu_spec("1GB"))


def test_a_builder_strategy_is_checked_whole():
    gi = _two_gb_table()
    spec = _gpu_spec("1GB", "64GB")
    model = MemoryModel(gi, spec, batch_size=40, rows_per_example={"table": 1.0})
    ps = builders.PartitionedPS().build(gi, spec)
    assert model.overflow(model.strategy_columns(ps)) is None
    pool, needed = model.overflow(model.strategy_columns(builders.AllReduce().build(gi, spec)))
    assert pool.name.startswith("GPU memory of") and needed > 2e9


def test_format_bytes():
    assert [format_bytes(x) for x in (999, 1000, 2.15e9, 4.2e12)] == \
        ["999 B", "1 kB", "2.15 GB", "4.2 TB"]


def _kinds(strategy, name):
    return {s.WhichOneof("kind") for s in strategy.variable(name).shards}
