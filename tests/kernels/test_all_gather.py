"""Sparse gradients all-gathered together, on the built graph.

Every sparse shard whose rows travel in the same wire dtype shares one
all-gather (three collectives: counts, values, indices) instead of three
collectives each: ncf's two tables take 3 collectives, not 6. The numbers
(equal to single-device Keras) are checked on real clusters in
tests/runtime/test_distributed_training.py (ncf under AllReduce).
"""
from __future__ import annotations

import pytest

import autodist
from autodist import models
from autodist.ir.capture import capture
from autodist.kernels import partitioner, replicator, synchronizer
from autodist.kernels.all_reduce_synchronizer import gather_bucket, instance_keys
from autodist.kernels.program import Program
from autodist.proto import strategy_pb2
from autodist.search import builders


@pytest.fixture(scope="module")
def ncf_item():
    return capture(models.embedding_model(num_users=13, num_items=29, dim=4))


def _program(graph_item, strategy, spec) -> Program:
    program = Program(graph_item, spec, ("worker", 0))
    partitioner.apply(program, strategy)
    replicator.apply(program, strategy)
    return synchronizer.apply(program, strategy, synchronizer.SyncOptions(
        is_chief=True, worker_tasks=2, task_index=0))


def _gathers(program: Program) -> list:
    """The all-gathers of rows: their instance keys change per step (a small dense
    group's gathered sum has a constant key)."""
    return [op for op in program.graph.get_operations() if op.type == "CollectiveGatherV2"
            and op.inputs[3].op.type != "Const"]


def test_two_tables_share_one_all_gather(ncf_item):
    spec = autodist.ResourceSpec.local(workers=2)
    strategy = builders.AllReduce().build(ncf_item, spec)
    sparse = [v.name for v in ncf_item.variables if v.sparse_gradient]
    assert len(sparse) == 2
    program = _program(ncf_item, strategy, spec)
    assert len(_gathers(program)) == 3  # counts, values, indices: both tables at once


def test_float16_rows_travel_in_their_own_all_gather(ncf_item):
    spec = autodist.ResourceSpec.local(workers=2)
    strategy = builders.AllReduce().build(ncf_item, spec)
    first = next(v for v in strategy.proto.variables
                 if ncf_item.variable(v.var_name).sparse_gradient)
    first.shards[0].all_reduce.compressor = strategy_pb2.AllReduceSynchronizer.FP16
    program = _program(ncf_item, strategy, spec)
    assert len(_gathers(program)) == 6
    shards = [s for shards in program.shards.values() for s in shards
              if s.kind == "all_reduce"]
    buckets = {gather_bucket(s) for s in shards if ncf_item.variable(s.var_name).sparse_gradient}
    assert buckets == {(False, "float32"), (True, "float32")}
    keys = instance_keys(shards)
    # Each bucket its own key range of 4, every step moving past all of them.
    bases = sorted(keys[("gather", b)] for b in buckets)
    assert bases[1] - bases[0] == 4 and keys[("stride", 0)] == 8
