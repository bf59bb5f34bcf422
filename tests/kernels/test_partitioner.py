"""Partitioner pass, in one process: split reads and gradients equal the whole ones."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import autodist
from autodist import models
from autodist.ir.capture import capture
from autodist.kernels import partitioner
from autodist.kernels.program import Program, Stage, StageError
from autodist.search import builders


def _run(graph_def, graph_item, shards, values, feeds):
    """Imports the (rewritten) step with shard placeholders mapped to local variables."""
    variables = {}
    for var in graph_item.variables:
        full = values[var.name]
        for shard in shards[var.name]:
            index = [slice(None)] * full.ndim
            index[shard.axis] = slice(shard.offset, shard.offset + shard.shape[shard.axis])
            variables[shard.placeholder] = tf.Variable(full[tuple(index)])
    fetches = [graph_item.loss_tensor]
    for var in graph_item.variables:
        g = var.gradient
        fetches += [g.dense] if g.dense else [g.values, g.indices]

    def run():
        input_map = {f"{name}:0": tf.identity(v.handle) for name, v in variables.items()}
        for info in graph_item.inputs:
            if info.name not in feeds and info.role == "sample_weight":
                # Unweighted: each example weighs 1.
                batch = len(next(iter(feeds.values())))
                input_map[info.tensor] = tf.ones([batch], tf.float32)
                continue
            input_map[info.tensor] = tf.constant(feeds[info.name])
        return tf.graph_util.import_graph_def(graph_def, input_map=input_map,
                                              return_elements=fetches, name="step")

    return [np.asarray(t) for t in tf.function(run)()]


@pytest.mark.parametrize("builder", [
    builders.PartitionedPS(min_shard_bytes=64),
    builders.UnevenPartitionedPS(min_shard_bytes=64),
    builders.RandomAxisPartitionAR(seed=2, min_shard_bytes=64),
])
def test_partitioned_step_equals_whole_step(builder):
    model = models.embedding_model(num_users=13, num_items=29, dim=4)
    graph_item = capture(model)
    spec = autodist.ResourceSpec.local(workers=2, ps=3)
    strategy = builder.build(graph_item, spec)
    assert any(c.partitioner.num_shards > 1 for c in strategy.variables)
    program = partitioner.apply(Program(graph_item, spec, ("worker", 0)), strategy)
    assert program.stage == Stage.PARTITIONED
    whole = Program(graph_item, spec, ("worker", 0))
    whole.shards = partitioner.plan_shards(whole, builders.PS().build(graph_item, spec))
    rng = np.random.default_rng(0)
    feeds = {"user": rng.integers(0, 13, (9, 1)).astype(np.int32),
             "item": rng.integers(0, 29, (9, 1)).astype(np.int32),
             "y": rng.integers(0, 2, (9, 1)).astype(np.float32)}
    values = {v.path: v.numpy() for v in model.trainable_variables}
    got = _run(program.graph_def, graph_item, program.shards, values, feeds)
    want = _run(graph_item.graph_def(), graph_item, whole.shards, values, feeds)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # The whole-table handle is gone; reads go through the shard placeholders.
    names = {n.name for n in program.graph_def.node}
    table = graph_item.variable("item_embedding/embeddings")
    if len(program.shards[table.name]) > 1:
        assert table.handle_node not in names
        assert {s.placeholder for s in program.shards[table.name]} <= names


def test_split_gradient_dense_and_sparse():
    spec = autodist.ResourceSpec.local(workers=1, ps=2)
    graph_item = capture(models.embedding_model(num_users=10, num_items=7, dim=2))
    strategy = builders.PS().build(graph_item, spec)
    config = strategy.variable("user_embedding/embeddings")
    config.partitioner.CopyFrom(builders.base.partitioner(0, [6, 4]))
    config.shards.append(config.shards[0])
    shards = partitioner.plan_shards(Program(graph_item, spec, ("worker", 0)),
                                     strategy)["user_embedding/embeddings"]
    assert [(s.offset, s.shape) for s in shards] == [(0, [6, 2]), (6, [4, 2])]
    sparse = tf.IndexedSlices(tf.constant([[1., 1.], [2., 2.], [3., 3.]]),
                              tf.constant([7, 2, 9]), tf.constant([10, 2]))
    first, second = partitioner.split_gradient(sparse, shards)
    assert first.indices.numpy().tolist() == [2] and first.values.numpy().tolist() == [[2., 2.]]
    assert second.indices.numpy().tolist() == [1, 3]
    assert second.values.numpy().tolist() == [[1., 1.], [3., 3.]]
    dense = tf.reshape(tf.range(20.), [10, 2])
    a, b = partitioner.split_gradient(dense, shards)
    assert a.shape == (6, 2) and b.shape == (4, 2) and b.numpy()[0, 0] == 12.0


def test_pass_checks_its_stage():
    spec = autodist.ResourceSpec.local(workers=1, ps=1)
    graph_item = capture(models.mlp(input_dim=4, hidden=(3,)))
    program = Program(graph_item, spec, ("worker", 0), stage=Stage.PARTITIONED)
    with pytest.raises(StageError, match="partitioner needs a CAPTURED program; this one is "
                                         "PARTITIONED"):
        partitioner.apply(program, builders.PS().build(graph_item, spec))

