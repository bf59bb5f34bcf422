"""Local replication of PS shards, on the built graph (no cluster).

The replicas of a task read their local copies, never the PS variables, and
each copy is refreshed from its PS shard only after the shard's update is
applied: in the chief's step after its update (synchronous), in a non-chief
task after its token (synchronous), after the task's own updates
(asynchronous). The numbers are checked on real clusters in
tests/runtime/test_local_replication.py.
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

REPLICA_SCOPE = f"{replicator.SCOPE}/replica_"
READS = {"ReadVariableOp", "ResourceGather", "VarIsInitializedOp"}


@pytest.fixture(scope="module")
def ncf_item():
    return capture(models.embedding_model(num_users=13, num_items=29, dim=4))


def _program(graph_item, builder, task_index: int) -> Program:
    spec = autodist.ResourceSpec.local(workers=2, ps=2)
    strategy = builder.build(graph_item, spec)
    program = Program(graph_item, spec, ("worker", task_index))
    partitioner.apply(program, strategy)
    replicator.apply(program, strategy)
    return synchronizer.apply(program, strategy, synchronizer.SyncOptions(
        is_chief=task_index == 0, worker_tasks=2, task_index=task_index))


def _ancestors(op: tf.Operation) -> set[tf.Operation]:
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        todo += [t.op for t in current.inputs] + list(current.control_inputs)
    return seen


def _ps_shards(program: Program):
    return [s for shards in program.shards.values() for s in shards if s.kind == "ps"]


def _ps_variable(program: Program, shard) -> tf.Variable:
    return replicator.get_storage(program, shard, program.replicas[0])


def _refresh_of(program: Program, shard, within: set[tf.Operation]) -> tf.Operation:
    """The op in `within` that writes the shard's local copy (its one refresh)."""
    local = program.local_copies[shard.name]
    writes = [op for op in local.handle.consumers()
              if op in within and op.type not in READS]
    assert len(writes) == 1, (shard.name, writes)
    return writes[0]


def _ps_writes(program: Program, shard, within: set[tf.Operation]) -> list[tf.Operation]:
    return [op for op in _ps_variable(program, shard).handle.consumers()
            if op in within and op.type not in READS]


def test_replicas_read_local_copies_only(ncf_item):
    program = _program(ncf_item, builders.PartitionedPS(local_replication=True,
                                                        min_shard_bytes=64), 1)
    shards = _ps_shards(program)
    assert any(s.num_shards > 1 and s.sparse for s in shards)  # a partitioned embedding
    assert set(program.local_copies) == {s.name for s in shards}
    for shard in shards:
        local = program.local_copies[shard.name]
        assert local.device == "/job:worker/task:1/device:CPU:0"
        # The forward/backward pass reads the copy...
        readers = [op for op in local.handle.consumers() if op.name.startswith(REPLICA_SCOPE)]
        assert readers and {op.type for op in readers} <= READS
        # ...and nothing of the replica touches the PS variable.
        ps_users = [op.name for op in _ps_variable(program, shard).handle.consumers()
                    if op.name.startswith(REPLICA_SCOPE)]
        assert ps_users == []


def test_sync_chief_refreshes_after_its_update(ncf_item):
    program = _program(ncf_item, builders.PartitionedPS(local_replication=True,
                                                        min_shard_bytes=64), 0)
    step = _ancestors(program.outputs.train_op)
    for shard in _ps_shards(program):
        refresh = _refresh_of(program, shard, step)
        before = _ancestors(refresh)
        updates = _ps_writes(program, shard, step)
        assert updates and set(updates) <= before
        local = program.local_copies[shard.name]
        reads = [op for op in local.handle.consumers()
                 if op.name.startswith(REPLICA_SCOPE) and op in step]
        assert reads and set(reads) <= before
        # The refresh reads the PS variable once.
        ps_reads = [op for op in before if op.type == "ReadVariableOp"
                    and op.inputs[0] is _ps_variable(program, shard).handle]
        assert len(ps_reads) == 1


def test_sync_worker_refreshes_after_its_token(ncf_item):
    program = _program(ncf_item, builders.PS(local_replication=True), 1)
    step = _ancestors(program.outputs.train_op)
    after = _ancestors(program.outputs.after_step)
    for shard in _ps_shards(program):
        assert not [op for op in program.local_copies[shard.name].handle.consumers()
                    if op in step and op.type not in READS]
        refresh = _refresh_of(program, shard, after)
        assert any(op.type == "QueueDequeueV2" for op in _ancestors(refresh))
    # Waiting for the token does not rerun the step.
    assert not any(op.name.startswith(REPLICA_SCOPE) for op in after)


@pytest.mark.parametrize("builder", [builders.PS(sync=False, local_replication=True),
                                     builders.PS(staleness=2, local_replication=True)],
                         ids=["async", "staleness"])
def test_async_refreshes_after_own_update(ncf_item, builder):
    program = _program(ncf_item, builder, 1)
    step = _ancestors(program.outputs.train_op)
    assert program.outputs.after_step is None
    for shard in _ps_shards(program):
        updates = _ps_writes(program, shard, step)
        assert updates and set(updates) <= _ancestors(_refresh_of(program, shard, step))


def test_two_phase_refreshes_in_the_ps_run(ncf_item):
    # Parallax: embeddings on the PS (local copies), dense layers all-reduced.
    program = _program(ncf_item, builders.Parallax(local_replication=True,
                                                   min_shard_bytes=64), 0)
    assert program.local_copies
    train = _ancestors(program.outputs.train_op)
    ps_run = _ancestors(program.outputs.ps_op)
    assert not any(op.name.startswith(REPLICA_SCOPE) for op in ps_run)
    for shard in _ps_shards(program):
        refresh = _refresh_of(program, shard, ps_run)
        assert refresh not in train
        assert set(_ps_writes(program, shard, ps_run)) <= _ancestors(refresh)


def test_without_local_replication_replicas_read_the_ps(ncf_item):
    program = _program(ncf_item, builders.PS(), 0)
    assert program.local_copies == {} and program.outputs.refresh is None
    for shard in _ps_shards(program):
        assert any(op.name.startswith(REPLICA_SCOPE)
                   for op in _ps_variable(program, shard).handle.consumers())
