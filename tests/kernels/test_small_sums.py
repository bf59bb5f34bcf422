"""Small sums over replicas are gathered and added (one exchange, not the ring's two).

`ir.strategy.sums_by_gathering` decides; the all-reduce synchronizer builds
the gather where it says so, and the simulator prices what the kernel
builds; the step's own sums over replicas (batch statistics) are gathered
where small too. At two replicas the gathered sum is the ring's exactly (a + b);
every builder's Keras equality with it is checked on real clusters (ncf
under AllReduce, whose dense group is small, in
tests/runtime/test_distributed_training.py).
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import autodist
from autodist import models
from autodist.ir.capture import capture
from autodist.ir.strategy import GATHER_SUM_MAX_BYTES, sums_by_gathering
from autodist.kernels import partitioner, replicator, synchronizer
from autodist.kernels.all_reduce_synchronizer import CollectiveConfig, collective_sum
from autodist.kernels.program import Program
from autodist.kernels.replica_sums import ReplicaSums
from autodist.runtime.worker_session import build_program
from autodist.search import builders
from autodist.search.simulator import Simulator
from autodist.search.space import SearchSpace


def test_the_rule_gathers_small_tensors_of_few_replicas():
    assert sums_by_gathering(4000, 2)
    assert sums_by_gathering(GATHER_SUM_MAX_BYTES, 2)
    assert not sums_by_gathering(GATHER_SUM_MAX_BYTES + 4, 2)
    assert sums_by_gathering(4000, 4) and not sums_by_gathering(120_000, 4)
    assert not sums_by_gathering(12, 4)     # fewer elements than replicas: the ring
    assert not sums_by_gathering(6, 4, element_size=2)
    assert not sums_by_gathering(4000, 1)   # one replica: nothing to sum
    # The simulator asks for many fused groups at once.
    np.testing.assert_array_equal(sums_by_gathering(np.array([0, 4000, 10**6]), 2),
                                  [False, True, False])


def _program(graph_item, spec) -> Program:
    strategy = builders.AllReduce().build(graph_item, spec)
    program = Program(graph_item, spec, ("worker", 0))
    partitioner.apply(program, strategy)
    replicator.apply(program, strategy)
    return synchronizer.apply(program, strategy, synchronizer.SyncOptions(
        is_chief=True, worker_tasks=spec.num_worker_tasks, task_index=0))


def _dense_collectives(program: Program) -> list[tf.Operation]:
    """The dense groups' collectives (constant instance keys; rows' all-gathers change
    theirs per step)."""
    return [op for op in program.graph.get_operations()
            if op.type.startswith("Collective") and op.inputs[3].op.type == "Const"]


@pytest.mark.parametrize("workers", [2, 4])
def test_a_large_group_stays_a_ring(workers):
    mlp = capture(models.build("mlp", seed=0))   # one group of 1.07 MB
    (op,) = _dense_collectives(_program(mlp, autodist.ResourceSpec.local(workers=workers)))
    assert op.type == "CollectiveReduceV2"


def test_a_small_group_is_gathered_and_summed_and_priced_so():
    item = capture(models.embedding_model(num_users=13, num_items=29, dim=4))
    spec = autodist.ResourceSpec.local(workers=2)
    (op,) = _dense_collectives(_program(item, spec))
    assert op.type == "CollectiveGatherV2"
    elements = op.inputs[0].shape
    assert elements[0] == 1 and elements[1] == sum(
        v.byte_size // 4 for v in item.variables if not v.sparse_gradient)
    assert {c.type for c in op.outputs[0].consumers()} == {"Sum"}
    # The simulator counts its one exchange (the ring's would be two), plus the rows'
    # all-gather's one.
    prediction = Simulator(SearchSpace(item, spec), batch_size=16).predict_strategy(
        builders.AllReduce().build(item, spec))
    assert prediction.parts["collective_hops"][0] == 1 + 1


def test_at_two_replicas_the_gathered_sum_is_the_rings_exactly():
    rng = np.random.default_rng(0)
    # Magnitudes far apart, so that an order-dependent sum would show.
    values = [rng.standard_normal(1000).astype(np.float32) * 10.0 ** rng.integers(-6, 6, 1000)
              for _ in range(2)]
    config = CollectiveConfig(group_size=2, timeout_s=30.0)
    graph = tf.Graph()
    with graph.as_default():
        gathered, ring = [], []
        for replica in range(2):
            with tf.device(f"/device:CPU:{replica}"):
                tensor = tf.constant(values[replica])
                gathered.append(collective_sum(tensor, tf.constant(1), config))
                ring.append(tf.raw_ops.CollectiveReduceV2(
                    input=tensor, group_size=tf.constant(2), group_key=tf.constant(1),
                    instance_key=tf.constant(2), ordering_token=[], merge_op="Add",
                    final_op="Id", communication_hint="ring", timeout_seconds=30.0))
    assert [op.type for op in graph.get_operations()].count("CollectiveGatherV2") == 2
    with tf.compat.v1.Session(graph=graph, config=tf.compat.v1.ConfigProto(
            device_count={"CPU": 2})) as session:
        got_gathered, got_ring = session.run([gathered, ring])
    for g, r in zip(got_gathered, got_ring):
        np.testing.assert_array_equal(g, r)
        np.testing.assert_array_equal(g, values[0] + values[1])


def test_small_sums_inside_the_step_are_gathered_where_their_size_is_known():
    graph_def = tf.compat.v1.GraphDef()
    sums = ReplicaSums(graph_def, group_size=2, version=0, timeout_s=5.0)
    cases = {"known": 17, "large": 10**6, "unknown": None}
    for name, elements in cases.items():
        sums.sum(name, "x", tf.float32, elements)
    ops = {name: {n.op for n in graph_def.node if n.name.startswith(name)} for name in cases}
    assert {"CollectiveGatherV2", "Sum"} <= ops["known"]
    assert "CollectiveReduceV2" in ops["large"] and "CollectiveReduceV2" in ops["unknown"]


def test_a_cnns_batch_statistics_are_summed_by_gathering():
    # 3 layers x (mean, variance and their gradients), 16 channels each; the numbers
    # (two replicas = one device) in tests/kernels/test_batch_norm.py.
    item = capture(models.build("cnn", seed=0))
    spec = autodist.ResourceSpec.local(workers=2)
    program = build_program(item, builders.AllReduce().build(item, spec), spec, 0, 30.0)
    sums = [op for op in program.graph.get_operations()
            if op.type.startswith("Collective") and "autodist_sync" in op.name]
    assert len(sums) == 12 and {op.type for op in sums} == {"CollectiveGatherV2"}
