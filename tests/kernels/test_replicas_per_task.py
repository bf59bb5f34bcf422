"""Several replicas in one task's program (in-graph replication), on the built graph.

With 2 tasks x 2 replicas every collective is one of a group of 4 (all
replicas of all tasks) under one group key, and each instance key is used
once per local replica; a synchronous PS update waits for 4 gradients; with
local replication both replicas of a task read its one local copy. The
numbers are checked on real clusters in tests/runtime/test_replicas_per_task.py.
"""
from __future__ import annotations

import pytest
import tensorflow as tf

import autodist
from autodist import models
from autodist.ir.capture import capture
from autodist.kernels import partitioner, replicator, synchronizer
from autodist.kernels.program import Program
from autodist.search import builders

COLLECTIVES = {"CollectiveReduceV2", "CollectiveGatherV2"}


@pytest.fixture(scope="module")
def ncf_item():
    return capture(models.embedding_model(num_users=13, num_items=29, dim=4))


def _program(graph_item, builder, task_index: int) -> Program:
    spec = autodist.ResourceSpec.local(workers=2, ps=1, cpu_replicas_per_worker=2)
    strategy = builder.build(graph_item, spec)
    program = Program(graph_item, spec, ("worker", task_index))
    partitioner.apply(program, strategy)
    replicator.apply(program, strategy)
    return synchronizer.apply(program, strategy, synchronizer.SyncOptions(
        is_chief=task_index == 0, worker_tasks=2, task_index=task_index))


def _const(tensor: tf.Tensor):
    assert tensor.op.type == "Const", tensor.op
    return tf.make_ndarray(tensor.op.get_attr("value")).item()


def test_a_task_builds_its_replicas_on_its_devices(ncf_item):
    program = _program(ncf_item, builders.AllReduce(), 1)
    assert [(r.index, r.device) for r in program.replicas] == [
        (2, "/job:worker/task:1/device:CPU:0"), (3, "/job:worker/task:1/device:CPU:1")]
    for replica in program.replicas:
        assert {p.device for p in replica.inputs.values()} == {replica.device}
        assert replica.loss.device == replica.device
    # Each replica has its own mirrored copy of every variable, on its device.
    copies = {}
    for name, role in program.roles.items():
        if role.kind == "variable":
            copies.setdefault(role.shard, {})[role.replica] = program.storage[name].device
    assert len(copies) == len(ncf_item.variables)
    for devices in copies.values():
        assert devices == {2: "/job:worker/task:1/device:CPU:0",
                           3: "/job:worker/task:1/device:CPU:1"}


@pytest.mark.parametrize("task_index", [0, 1])
def test_collectives_span_every_replica_of_every_task(ncf_item, task_index):
    # AllReduce: dense gradients summed in groups (this small one gathered and added,
    # `sums_by_gathering`), sparse ones all-gathered.
    program = _program(ncf_item, builders.AllReduce(), task_index)
    ops = [op for op in program.graph.get_operations() if op.type in COLLECTIVES]
    assert {op.type for op in ops} == {"CollectiveGatherV2"}
    assert {_const(op.inputs[1]) for op in ops} == {4}   # group_size: 2 tasks x 2 replicas
    assert len({_const(op.inputs[2]) for op in ops}) == 1  # one group key
    devices = [f"/job:worker/task:{task_index}/device:CPU:{c}" for c in (0, 1)]
    # A dense group's instance key (a constant) once per local replica.
    dense_keys: dict[int, list[str]] = {}
    for op in ops:
        if op.inputs[3].op.type == "Const":
            dense_keys.setdefault(_const(op.inputs[3]), []).append(op.device)
    assert dense_keys and all(sorted(d) == devices for d in dense_keys.values())
    # All-gathers of rows (keys that change per step): as many on each replica.
    rows = [op.device for op in ops if op.inputs[3].op.type != "Const"]
    assert rows and rows.count(devices[0]) == rows.count(devices[1]) == len(rows) // 2


def test_the_chief_takes_every_replicas_gradient(ncf_item):
    program = _program(ncf_item, builders.PS(), 0)
    ops = program.graph.get_operations()
    # One queue per replica (4: 2 tasks x 2) for every variable, and for Adam one of
    # squared rows per embedding; the chief dequeues from each, in replica order.
    queues = [op for op in ops if op.type == "FIFOQueueV2" and "_ps_sum_" in op.name]
    assert len(queues) == 4 * (len(ncf_item.variables) + 2)
    assert len([op for op in ops if op.type == "QueueDequeueV2"
                and "_ps_sum_" in op.inputs[0].op.name]) == len(queues)
    # This task's 2 local replicas push to their own queues of each variable.
    pushes = [op.inputs[0].op.name for op in ops if op.type == "QueueEnqueueV2"
              and "_ps_sum_" in op.inputs[0].op.name]
    assert len(pushes) == len(set(pushes)) == 2 * (len(ncf_item.variables) + 2)
    assert {name.rsplit("_replica_", 1)[1] for name in pushes} == {"0", "1"}


def test_local_replication_one_copy_per_task_read_by_both_replicas(ncf_item):
    program = _program(ncf_item, builders.PartitionedPS(local_replication=True,
                                                        min_shard_bytes=64), 1)
    assert program.local_copies
    for name, local in program.local_copies.items():
        assert local.device == "/job:worker/task:1/device:CPU:0"
        readers = {op.name.split("/")[1] for op in local.handle.consumers()
                   if op.name.startswith(f"{replicator.SCOPE}/replica_")}
        assert readers == {"replica_2", "replica_3"}, name
