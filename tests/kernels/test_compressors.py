"""Compressors of the all-reduce synchronizer, on a whole one-replica program.

The program is lowered from a captured Keras MLP whose batch dimension is
unknown, as in every real run (the flattened buffer of a group then has no
static shape), and partitioned into several shards in several fused groups.
With one replica the collective is the identity, so what is checked is the
compression, exactly (float32 and float16 round to nearest even in NumPy as
in TensorFlow):

- FP16: plain SGD applies fp16(g).
- FP16_ERROR_FEEDBACK: each step sends fp16(c) with c = g + e and keeps
  e' = c - fp16(c), per shard; what was sent plus the final residual equals
  the sum of the gradients.

Real 2-worker runs are in tests/runtime/test_compressors.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import keras
import autodist
from autodist import models
from autodist.ir.strategy import AllReduceSynchronizer
from autodist.kernels import all_reduce_synchronizer
from autodist.kernels import partitioner, replicator, synchronizer
from autodist.kernels.program import Program, StorageRole
from autodist.search import builders

LEARNING_RATE = 0.1


@pytest.fixture(scope="module")
def sgd_mlp():
    model = models.mlp(input_dim=20, hidden=(16,),
                       optimizer=keras.optimizers.SGD(LEARNING_RATE))
    return autodist.capture(model)


def _program(graph_item, strategy) -> Program:
    spec = autodist.ResourceSpec.local(workers=1)
    program = Program(graph_item, spec, ("worker", 0))
    partitioner.apply(program, strategy)
    replicator.apply(program, strategy)
    return synchronizer.apply(program, strategy, synchronizer.SyncOptions(
        is_chief=True, worker_tasks=1, task_index=0, timeout_s=10.0))


def _strategy(graph_item, compressor: str):
    # Small shards and groups: every variable split, several fused groups.
    spec = autodist.ResourceSpec.local(workers=1)
    return builders.PartitionedAR(min_shard_bytes=64, group_bytes=600,
                                  compressor=compressor).build(graph_item, spec)


class _Local:
    """Runs a program's step in this process (its graph without the cluster's devices)."""

    def __init__(self, program: Program) -> None:
        (self.replica,) = program.replicas
        self.shards = {s.name: s for var in program.shards.values() for s in var}
        with program.graph.as_default():
            init = [v.initializer for v in program.storage.values()] + \
                [program.outputs.step.initializer]
            reads = {name: var.read_value() for name, var in program.storage.items()
                     if program.roles[name].kind in ("variable", "residual")}
        self.roles = dict(program.roles)
        self.names = {"init": [op.name for op in init],
                      "reads": {k: v.name for k, v in reads.items()},
                      "train": program.outputs.train_op.name,
                      "scale": program.outputs.scales[0].name,
                      "gradients": {k: tf.convert_to_tensor(g).name
                                    for k, g in self.replica.gradients.items()},
                      "x": self.replica.inputs["features"].name,
                      "y": self.replica.inputs["y"].name}
        graph_def = program.graph.as_graph_def()
        for node in graph_def.node:
            node.device = ""
        graph = tf.Graph()
        with graph.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
        self.session = tf.compat.v1.Session(graph=graph)
        self.session.run(self.names["init"])
        rng = np.random.default_rng(0)
        with graph.as_default():
            for name in self.names["reads"]:
                if self.roles[name].kind == "variable":
                    var = program.storage[name]
                    value = rng.normal(scale=0.3, size=var.shape.as_list()).astype(np.float32)
                    placeholder = tf.compat.v1.placeholder(tf.float32, var.shape)
                    assign = tf.raw_ops.AssignVariableOp(
                        resource=graph.get_tensor_by_name(var.handle.name), value=placeholder)
                    self.session.run(assign, {placeholder: value})

    def read(self) -> dict[str, np.ndarray]:
        return self.session.run(self.names["reads"])

    def step(self, x, y) -> dict[str, np.ndarray]:
        """Runs one step; returns the replica's gradients (by variable)."""
        feed = {self.names["x"]: x, self.names["y"]: y, self.names["scale"]: 1.0}
        out = self.session.run({"g": self.names["gradients"], "train": self.names["train"]},
                               feed)
        return out["g"]

    def shard_part(self, full: np.ndarray, shard_name: str) -> np.ndarray:
        shard = self.shards[shard_name]
        index = [slice(None)] * full.ndim
        index[shard.axis] = slice(shard.offset, shard.offset + shard.shape[shard.axis])
        return full[tuple(index)]


def _fp16(value: np.ndarray) -> np.ndarray:
    return value.astype(np.float16).astype(np.float32)


def _batches():
    """Batches of different sizes (the batch dimension is not static)."""
    rng = np.random.default_rng(1)
    for size in (32, 32, 26, 32, 17):
        yield (rng.normal(size=(size, 20)).astype(np.float32),
               rng.integers(0, 10, size).astype(np.int32))


def _weights(local: _Local, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {local.roles[name].shard: v for name, v in values.items()
            if local.roles[name].kind == "variable"}


def _residuals(local: _Local, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {local.roles[name].shard: v for name, v in values.items()
            if local.roles[name].kind == "residual"}


def test_fp16_applies_the_rounded_gradient(sgd_mlp):
    local = _Local(_program(sgd_mlp, _strategy(sgd_mlp, "fp16")))
    assert len(local.shards) > len(sgd_mlp.variables)  # partitioned
    lr = np.float32(LEARNING_RATE)
    for x, y in _batches():
        before = _weights(local, local.read())
        grads = local.step(x, y)
        after = _weights(local, local.read())
        for name, shard in local.shards.items():
            sent = _fp16(local.shard_part(grads[shard.var_name], name))
            np.testing.assert_array_equal(after[name], before[name] - lr * sent, err_msg=name)
    assert not _residuals(local, local.read())


def test_error_feedback_keeps_exactly_what_was_not_sent(sgd_mlp):
    program = _program(sgd_mlp, _strategy(sgd_mlp, "fp16_error_feedback"))
    local = _Local(program)
    lr = np.float32(LEARNING_RATE)
    total_gradient = {name: 0.0 for name in local.shards}
    total_sent = {name: 0.0 for name in local.shards}
    for x, y in _batches():
        values = local.read()
        before, residual = _weights(local, values), _residuals(local, values)
        grads = local.step(x, y)
        values = local.read()
        after, kept = _weights(local, values), _residuals(local, values)
        for name in local.shards:
            g = local.shard_part(grads[local.shards[name].var_name], name)
            corrected = g + residual[name]
            sent = _fp16(corrected)
            np.testing.assert_array_equal(kept[name], corrected - sent, err_msg=name)
            np.testing.assert_array_equal(after[name], before[name] - lr * sent, err_msg=name)
            total_gradient[name] += g.astype(np.float64)
            total_sent[name] += sent.astype(np.float64)
    for name in local.shards:
        assert np.any(kept[name] != 0)
        # Nothing is lost: sent + residual == the gradients (float32 sums aside).
        np.testing.assert_allclose(total_sent[name] + kept[name], total_gradient[name],
                                   rtol=0, atol=1e-6, err_msg=name)


def test_residuals_are_by_shard_and_replica(sgd_mlp):
    program = _program(sgd_mlp, _strategy(sgd_mlp, "fp16_error_feedback"))
    residuals = {name: role for name, role in program.roles.items() if role.kind == "residual"}
    shards = [s for var in sgd_mlp.variables for s in program.shards[var.name]]
    assert sorted(role.shard for role in residuals.values()) == sorted(s.name for s in shards)
    for name, role in residuals.items():
        shard = next(s for s in shards if s.name == role.shard)
        assert role == StorageRole("residual", shard=shard.name, replica=0)
        assert program.storage[name].shape.as_list() == shard.shape
        assert name == all_reduce_synchronizer.residual_spec(shard, 0, "").name
    steps = [role for role in program.roles.values() if role.kind == "residual_step"]
    assert steps == [StorageRole("residual_step", replica=0)]
    # Without error feedback nothing is kept.
    plain = _program(sgd_mlp, _strategy(sgd_mlp, "fp16"))
    assert not [r for r in plain.roles.values() if r.kind.startswith("residual")]


def test_densified_sparse_gradient_keeps_a_residual_of_its_squares():
    model = models.embedding_model(num_users=30, num_items=40, dim=4, optimizer="adam")
    graph_item = autodist.capture(model)
    spec = autodist.ResourceSpec.local(workers=1)
    strategy = builders.AllReduce().build(graph_item, spec)
    for config in strategy.proto.variables:
        for sync in config.shards:
            sync.all_reduce.spec = AllReduceSynchronizer.RING  # densify sparse gradients
            sync.all_reduce.compressor = AllReduceSynchronizer.FP16_ERROR_FEEDBACK
            sync.all_reduce.group = 0
    strategy.validate(graph_item, spec)
    program = _program(graph_item, strategy)
    kept = {(r.shard, r.square) for r in program.roles.values() if r.kind == "residual"}
    sparse = {v.name for v in graph_item.variables if v.sparse_gradient}
    assert sparse
    assert kept == {(v.name, False) for v in graph_item.variables} | \
        {(name, True) for name in sparse}
