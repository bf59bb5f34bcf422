"""Loss terms added by layers (`add_loss`), on virtual nodes (no cluster).

A term that is a mean over examples adds up over virtual nodes weighted by
their share of the batch, as the loss does; a sum over examples counts in
full on each. Capture tells them apart on random examples; the replicator
feeds a sum's scale so that, with virtual nodes, loss and gradients are one
batch's. Training on real clusters: the zoo (`tests/zoo`).
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras import ops
import autodist
from autodist.ir.capture import capture
from autodist.kernels import partitioner, replicator
from autodist.kernels.program import Program
from autodist.runtime import batching
from autodist.search import builders


class SumPenalty(keras.layers.Layer):
    def call(self, h):
        self.add_loss(0.01 * ops.sum(ops.square(h)))
        return h


class MeanPenalty(keras.layers.Layer):
    def call(self, h):
        self.add_loss(0.1 * ops.mean(ops.sum(h, axis=1)))
        return h


class BatchPenalty(keras.layers.Layer):
    def call(self, h):
        self.add_loss(ops.square(ops.sum(h)))   # neither a mean nor a sum over examples
        return h


class PerExampleCost(keras.layers.Layer):
    """An endpoint layer adding one cost per example, shape (batch, 1), looked up by a
    float label that must be a non-negative integer (as keras-io's captcha_ocr adds
    `ctc_batch_cost` of float labels): it fails on normal random values."""
    def call(self, h, label):
        costs = tf.constant([1.0, 2.0, 3.0])
        picked = tf.gather(costs, tf.cast(label, tf.int32))   # (batch, 1)
        self.add_loss(picked * ops.mean(ops.square(h), axis=1, keepdims=True))
        return h


@pytest.fixture(scope="module")
def penalized():
    inputs = keras.Input((6,), name="features")
    h = keras.layers.Dense(4, activation="tanh", kernel_regularizer="l2",
                           activity_regularizer=keras.regularizers.L1(0.01))(inputs)
    h = BatchPenalty()(MeanPenalty()(SumPenalty()(h)))
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model, capture(model)


def test_capture_tells_means_sums_and_others_apart(penalized):
    _, item = penalized
    kinds = {re.sub(r"(_\d+)+$", "", t.layer.split("/")[-1]): t.kind for t in item.added_losses}
    # Keras divides an activity regularizer by the batch size: a mean.
    assert kinds == {"dense": "mean", "sum_penalty": "sum", "mean_penalty": "mean",
                     "batch_penalty": "other"}


def _step(item, strategy, spec, x, y):
    program = Program(item, spec, ("worker", 0))
    partitioner.apply(program, strategy)
    replicator.apply(program, strategy)
    (replica,) = program.replicas
    rng = np.random.default_rng(1)
    with program.graph.as_default():
        assigns = [var.assign(rng.normal(scale=0.5, size=var.shape).astype(np.float32))
                   for name, var in sorted(program.storage.items())
                   if program.roles[name].kind == "variable"]
        init = tf.group([var.initializer for var in program.storage.values()])
        fetches = {k: tf.convert_to_tensor(g).name for k, g in replica.gradients.items()}
        fetches["loss"] = replica.loss.name
    graph_def = program.graph.as_graph_def()
    for node in graph_def.node:
        node.device = ""
    local = tf.Graph()
    with local.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    parts = batching.virtual_node_rows(np.arange(len(y)), strategy.num_virtual_nodes)
    feed = {replica.inputs["features"].name: x, replica.inputs["y"].name: y}
    if replica.all_sizes is not None:
        feed[replica.all_sizes.name] = [len(p) for p in parts]
    if replica.sizes is not None:
        feed[replica.sizes.name] = [len(p) for p in parts]
    with tf.compat.v1.Session(graph=local) as session:
        session.run(init.name)
        session.run([a.name for a in assigns])
        return session.run(fetches, feed)


def test_virtual_nodes_count_a_sum_in_full():
    inputs = keras.Input((6,), name="features")
    h = keras.layers.Dense(4, activation="tanh")(inputs)
    mine = keras.Model(inputs, keras.layers.Dense(1)(MeanPenalty()(SumPenalty()(h))))
    mine.compile(keras.optimizers.SGD(0.1), "mse")
    item = capture(mine)
    spec = autodist.ResourceSpec.local(workers=1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 6)).astype(np.float32)
    y = rng.normal(size=(12, 1)).astype(np.float32)
    strategy = builders.AllReduce().build(item, spec)
    one = _step(item, strategy, spec, x, y)
    four = _step(item, strategy.with_virtual_nodes(12, 4), spec, x, y)
    for name in one:
        np.testing.assert_allclose(four[name], one[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_term_of_per_example_values_over_float_labels_is_a_sum():
    """Keras adds a term of several values as their sum. The step fails on normal random
    labels (a negative index); ids 1 and 2 tell the term apart. Before, its kind was
    "unknown" (taken for a mean: the run's term 1/R of Keras'), and a (batch, 1) term
    crashed the capture."""
    features = keras.Input((6,), name="features")
    label = keras.Input((1,), name="label")
    h = keras.layers.Dense(4, activation="tanh")(features)
    model = keras.Model([features, label], PerExampleCost()(h, label))
    model.compile(keras.optimizers.SGD(0.1))
    item = capture(model)
    assert [t.kind for t in item.added_losses] == ["sum"]


def test_a_term_neither_mean_nor_sum_is_refused_before_launch(penalized):
    """keras-io's Switch Transformer adds a load-balancing loss over the batch's routing:
    each replica would compute it on its part and train something else (1.5% off Keras'
    loss on 2 workers when it was only warned of)."""
    from autodist.ir.errors import AutodistError
    from autodist.runtime import keras_parity

    model, item = penalized
    spec = autodist.ResourceSpec.local(workers=1)
    strategy = builders.AllReduce().build(item, spec)
    keras_parity.check(model, item, strategy)   # one replica computes it as Keras
    with pytest.raises(AutodistError, match=r"layer\(s\) \['.*batch_penalty.*'\] add a "
                                            r"loss term .* neither a mean nor a sum"):
        keras_parity.check(model, item, strategy.with_virtual_nodes(8, 2))


def test_a_term_that_could_not_be_evaluated_is_warned_of(penalized):
    from autodist.runtime import keras_parity
    from autodist.runtime.keras_parity import ParityWarning

    model, item = penalized
    proto = type(item.proto)()
    proto.CopyFrom(item.proto)
    for term in proto.added_losses:
        if term.kind == "other":
            term.kind = "unknown"   # what a step that did not run on random examples leaves
    strategy = builders.AllReduce().build(item, autodist.ResourceSpec.local(workers=1))
    with pytest.warns(ParityWarning, match=r"the step failed on random examples.*1/2 of Keras"):
        keras_parity.check(model, autodist.GraphItem(proto), strategy.with_virtual_nodes(8, 2))


class OrthogonalRegularizer(keras.regularizers.Regularizer):
    """keras-io's PointNet: ||X X^T - I||^2 of the transform, with its tensordot over the
    whole batch (every example's transform times every other's)."""

    def __init__(self, k):
        self.k = k

    def __call__(self, x):
        x = tf.reshape(x, (-1, self.k, self.k))
        xxt = tf.reshape(tf.tensordot(x, x, axes=(2, 2)), (-1, self.k, self.k))
        return tf.reduce_sum(1e-3 * tf.square(xxt - tf.eye(self.k)))


@pytest.mark.parametrize("batch_norm", [False, True])
def test_a_term_comparing_examples_is_refused_at_any_weights(batch_norm):
    """PointNet's T-net ends in a Dense with a zero kernel and the identity as bias: at
    those weights every example's transform is the same, and the pairwise term scaled
    like a sum (trained 1.2e-2 off Keras, said nothing). With a BatchNormalization before
    it, the term was only warned of ("depends on batch statistics"), and trained 2% off
    Keras' loss. The probe now perturbs the weights and normalizes each example on its
    own; a per-example term beside the batch norm stays a mean."""
    from autodist.ir.errors import AutodistError
    from autodist.runtime import keras_parity

    k = 4
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    if batch_norm:
        h = keras.layers.BatchNormalization()(h)
    t = keras.layers.Dense(k * k, kernel_initializer="zeros",
                           bias_initializer=keras.initializers.Constant(np.eye(k).flatten()),
                           activity_regularizer=OrthogonalRegularizer(k))(h)
    h = MeanPenalty()(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Concatenate()([h, t])))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    before = [v.numpy().copy() for v in model.variables]
    item = capture(model)
    kinds = sorted((re.sub(r"(_\d+)+$", "", t.layer.split("/")[-1]), t.kind)
                   for t in item.added_losses)
    assert kinds == [("dense", "other"), ("mean_penalty", "mean")]
    for variable, value in zip(model.variables, before):   # the perturbation is undone
        np.testing.assert_array_equal(variable.numpy(), value)
    strategy = builders.AllReduce().build(item, autodist.ResourceSpec.local(workers=2))
    with pytest.raises(AutodistError, match=r"layer\(s\) \['.*dense.*'\] add a loss term "
                                            r".* neither a mean nor a sum"):
        keras_parity.check(model, item, strategy)
