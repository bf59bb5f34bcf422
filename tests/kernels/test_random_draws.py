"""Random layers draw for the global batch on every virtual node (no cluster).

Keras' random layers draw from (seed, shape); the replicator has every
virtual node draw the global batch's tensor and keep its rows, so its
gradients are those of one device's step on the whole batch. Training on real
clusters: the zoo (`tests/zoo`) and `tests/runtime/test_keras_fit_semantics.py`.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import tensorflow as tf

import keras
import autodist
from autodist.ir.capture import capture
from autodist.kernels import partitioner, random_draws, replicator
from autodist.kernels.program import Program
from autodist.runtime import batching
from autodist.search import builders


def _noisy_model():
    inputs = keras.Input((6, 4), name="sequence")
    h = keras.layers.SpatialDropout1D(0.3)(inputs)
    h = keras.layers.GaussianNoise(0.2)(h)
    h = keras.layers.Dense(5, activation="relu")(h)
    h = keras.layers.Dropout(0.5)(keras.layers.Flatten()(h))
    h = keras.layers.GaussianDropout(0.2)(h)
    h = keras.layers.AlphaDropout(0.2)(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


@pytest.fixture(scope="module")
def noisy_item():
    keras.utils.set_random_seed(0)
    return capture(_noisy_model())


def test_capture_finds_each_random_layers_batch_axis(noisy_item):
    found = {re.sub(r"(_\d+)+$", "", op.layer.split("/")[-1]):
             (op.batch_axis, op.rank, op.reproducible) for op in noisy_item.random_ops}
    assert found == {"spatial_dropout1d": (0, 3, True), "gaussian_noise": (0, 3, True),
                     "dropout": (0, 2, True), "gaussian_dropout": (0, 2, True),
                     "alpha_dropout": (0, 2, True)}


def test_a_stateful_random_op_is_listed_as_not_reproducible():
    class Jitter(keras.layers.Layer):
        def call(self, x, training=None):
            return x + tf.random.uniform(tf.shape(x), seed=3) if training else x

    class Block(keras.layers.Layer):
        """keras-io's Swin: a drop path nested in a transformer block."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense, self.drop_path = keras.layers.Dense(3), Jitter(name="drop_path")

        def call(self, x, training=None):
            return x + self.drop_path(self.dense(x), training=training)

    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1)(Block(name="swin_block")(inputs)))
    model.compile("sgd", "mse")
    (op,) = capture(model).random_ops
    assert not op.reproducible and "stateful" in op.reason
    # Named to the innermost layer (it was the outer block's name), without the
    # scopes tf.random.uniform opens.
    assert re.fullmatch(r"functional(_\d+)*/swin_block(_\d+)*/drop_path(_\d+)*", op.layer), \
        op.layer


def _run_step(graph_item, strategy, spec, x, y, input_name="sequence"):
    """Task 0's replica loss and gradients for one global batch, in this process."""
    program = Program(graph_item, spec, ("worker", 0))
    partitioner.apply(program, strategy)
    replicator.apply(program, strategy)
    (replica,) = program.replicas
    rng = np.random.default_rng(1)
    with program.graph.as_default():
        assigns = [var.assign(rng.normal(scale=0.3, size=var.shape).astype(np.float32))
                   for name, var in sorted(program.storage.items())
                   if name.startswith(f"{replicator.SCOPE}/vars/") and "/slot/" not in name]
        init = tf.group([var.initializer for var in program.storage.values()])
        fetches = {name: tf.convert_to_tensor(g).name for name, g in replica.gradients.items()}
        fetches["loss"] = replica.loss.name
    graph_def = program.graph.as_graph_def()
    for node in graph_def.node:
        node.device = ""
    local = tf.Graph()
    with local.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    parts = batching.virtual_node_rows(np.arange(len(y)), strategy.num_virtual_nodes)
    mine = np.concatenate([parts[vn.index] for vn in replica.virtual_nodes])
    feed = {replica.inputs[input_name].name: x[mine], replica.inputs["y"].name: y[mine]}
    if replica.all_sizes is not None:
        feed[replica.all_sizes.name] = [len(p) for p in parts]
    if replica.sizes is not None:
        feed[replica.sizes.name] = [len(parts[vn.index]) for vn in replica.virtual_nodes]
    with tf.compat.v1.Session(graph=local) as session:
        session.run(init.name)
        session.run([a.name for a in assigns])
        return session.run(fetches, feed)


def test_virtual_nodes_draw_what_one_batch_draws(noisy_item):
    spec = autodist.ResourceSpec.local(workers=1)
    rng = np.random.default_rng(0)
    n = 22   # virtual nodes of 6, 6, 5 and 5 examples
    x = rng.normal(size=(n, 6, 4)).astype(np.float32)
    y = rng.normal(size=(n, 1)).astype(np.float32)
    strategy = builders.AllReduce().build(noisy_item, spec)
    one = _run_step(noisy_item, strategy, spec, x, y)
    four = _run_step(noisy_item, strategy.with_virtual_nodes(24, 4), spec, x, y)
    for name in one:
        np.testing.assert_allclose(four[name], one[name], rtol=0, atol=2e-6, err_msg=name)


def _long_kernel_model():
    """keras-io's pretrained_word_embeddings in small: ids of any length, convolutions and
    poolings that need more timesteps than a short stand-in length has, then Dropout."""
    inputs = keras.Input((None,), dtype="int32", name="ids")
    h = keras.layers.Embedding(30, 4)(inputs)
    h = keras.layers.Conv1D(4, 5, activation="relu")(h)
    h = keras.layers.MaxPooling1D(5)(h)
    h = keras.layers.Conv1D(4, 8, activation="relu")(h)
    h = keras.layers.GlobalMaxPooling1D()(h)
    h = keras.layers.Dropout(0.5)(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def test_a_draw_after_convolutions_over_a_variable_length_is_drawn_for_the_batch():
    """The capture infers the draw's shape with a stand-in length long enough for the
    convolutions (a length of 7 left the step unimportable, the draw "uninferred" and
    drawn per replica: weights 2e-2 off Keras'), and virtual nodes draw as one batch."""
    keras.utils.set_random_seed(0)
    item = capture(_long_kernel_model())
    (op,) = item.random_ops
    assert (op.reproducible, op.batch_axis, op.reason) == (True, 0, "")
    spec = autodist.ResourceSpec.local(workers=1)
    rng = np.random.default_rng(0)
    x = rng.integers(1, 30, size=(12, 60)).astype(np.int32)
    y = rng.normal(size=(12, 1)).astype(np.float32)
    strategy = builders.AllReduce().build(item, spec)
    one = _run_step(item, strategy, spec, x, y, input_name="ids")
    four = _run_step(item, strategy.with_virtual_nodes(12, 4), spec, x, y, input_name="ids")
    for name in one:
        np.testing.assert_allclose(four[name], one[name], rtol=0, atol=2e-6, err_msg=name)


def test_the_rewrite_leaves_a_step_without_random_ops_as_it_is(mlp_item):
    graph_def = mlp_item.graph_def()
    assert random_draws.for_global_batch(graph_def, mlp_item.random_ops) is graph_def


def test_without_the_rewrite_each_virtual_node_would_draw_its_own(noisy_item, monkeypatch):
    """The check above is not vacuous: drawing per virtual node changes the gradients."""
    spec = autodist.ResourceSpec.local(workers=1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 6, 4)).astype(np.float32)
    y = rng.normal(size=(24, 1)).astype(np.float32)
    strategy = builders.AllReduce().build(noisy_item, spec)
    one = _run_step(noisy_item, strategy, spec, x, y)
    monkeypatch.setattr(random_draws, "reproducible", lambda ops: [])
    four = _run_step(noisy_item, strategy.with_virtual_nodes(24, 4), spec, x, y)
    assert abs(four["loss"] - one["loss"]) > 1e-3


def _two_views_model(time_major: bool = False):
    """Dropout over two views of each example concatenated along the batch axis (rows
    in two blocks), or over a sequence reshaped time-major (a block per timestep)."""
    inputs = keras.Input((3, 4), name="x")
    h = keras.layers.Dense(6)(inputs)
    if time_major:
        h = keras.layers.Lambda(lambda t: keras.ops.reshape(
            keras.ops.transpose(t, (1, 0, 2)), (-1, 6)))(h)
        h = keras.layers.Dropout(0.5, seed=3)(h)
        h = keras.layers.Lambda(lambda t: keras.ops.transpose(
            keras.ops.reshape(t, (3, -1, 6)), (1, 0, 2)))(h)
    else:
        h = keras.layers.Lambda(lambda t: keras.ops.concatenate([t, 2 * t], axis=0))(h)
        h = keras.layers.Dropout(0.5, seed=3)(h)
        h = keras.layers.Lambda(
            lambda t: t[:keras.ops.shape(t)[0] // 2] * t[keras.ops.shape(t)[0] // 2:])(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(h)))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


@pytest.mark.parametrize("time_major, blocks", [(False, [1, 1]), (True, [1, 1, 1])])
def test_capture_finds_draws_in_blocks_of_the_batch(time_major, blocks):
    keras.utils.set_random_seed(0)
    (op,) = capture(_two_views_model(time_major)).random_ops
    assert op.reproducible and list(op.row_blocks) == blocks


def test_the_order_of_rows_is_found_for_string_inputs_from_the_vocabulary():
    """Strings are probed with words of the model's vocabulary (unknown strings all map
    to one id, which would leave the order undetermined)."""
    inputs = keras.Input((2,), dtype="string", name="words")
    h = keras.layers.Embedding(6, 3)(keras.layers.StringLookup(
        vocabulary=["red", "green", "blue"])(inputs))
    h = keras.layers.Lambda(lambda t: keras.ops.concatenate([t, t], axis=0))(h)
    h = keras.layers.Dropout(0.5, seed=1)(h)
    h = keras.layers.Lambda(lambda t: t[:keras.ops.shape(t)[0] // 2])(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(h)))
    model.compile("sgd", "mse")
    (op,) = capture(model).random_ops
    assert op.reproducible and list(op.row_blocks) == [1, 1]


@pytest.mark.parametrize("lookup", ["string", "integer"])
def test_a_draw_after_a_lookup_layer_is_drawn_for_the_batch(lookup):
    """keras-io's movielens transformer: ids through StringLookup, an Embedding, Dropout.
    The lookup's result had no shape when the step was imported at trial batches (its
    table a bare placeholder), so the draw was "uninferred" and drawn per replica (2.6e-2
    off Keras' weights on 4 virtual nodes); the table's key and value types now give it
    the keys' shape."""
    if lookup == "string":
        inputs = keras.Input((3,), dtype="string", name="ids")
        ids = keras.layers.StringLookup(vocabulary=["a", "b", "c"], mask_token=None,
                                        num_oov_indices=0)(inputs)
    else:
        inputs = keras.Input((3,), dtype="int64", name="ids")
        ids = keras.layers.IntegerLookup(vocabulary=[4, 5, 6], mask_token=None,
                                         num_oov_indices=0)(inputs)
    h = keras.layers.Dropout(0.5)(keras.layers.Flatten()(keras.layers.Embedding(3, 4)(ids)))
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile("sgd", "mse")
    (op,) = capture(model).random_ops
    assert (op.reproducible, op.batch_axis, op.reason) == (True, 0, "")


def test_a_draw_after_a_random_crop_is_drawn_for_the_batch():
    """keras-io's shiftvit: RandomCrop's offsets (one draw for the whole batch) moved
    between the capture's probe runs, so every later draw looked out of order and was
    drawn per replica with a ParityWarning (7e-3 off Keras' weights)."""
    inputs = keras.Input((12, 12, 3), dtype="uint8")
    h = keras.layers.RandomCrop(8, 8)(keras.layers.Rescaling(1 / 255.0)(inputs))
    h = keras.layers.Dropout(0.5)(keras.layers.Conv2D(2, 1)(h))
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(h)))
    model.compile("sgd", "mse")
    ops = {op.layer.split("/")[-1].rsplit("_", 2)[0]: op for op in capture(model).random_ops}
    assert (ops["dropout"].reproducible, ops["dropout"].batch_axis) == (True, 0)


@pytest.mark.parametrize("inputs", ["ids", "floats"])
def test_a_draw_after_batch_normalization_is_drawn_for_the_batch(inputs):
    """keras-io's movielens transformer's head: (Dense -> BatchNormalization -> LeakyReLU ->
    Dropout) x 2. Through the batch statistics one example's change moved every row of
    the row-order probe's batch, a Dropout looked out of order and was drawn per replica
    (4.9e-2 off Keras' weights); the probe now normalizes each example on its own."""
    keras.utils.set_random_seed(1)
    if inputs == "ids":
        x = keras.Input((3,), dtype="int64", name="ids")
        h = keras.layers.Flatten()(keras.layers.Embedding(10, 4)(keras.layers.IntegerLookup(
            vocabulary=list(range(10)), mask_token=None, num_oov_indices=0)(x)))
    else:
        x = keras.Input((3,), name="x")
        h = x
    for units in (16, 8):
        h = keras.layers.Dropout(0.1)(keras.layers.LeakyReLU()(
            keras.layers.BatchNormalization()(keras.layers.Dense(units)(h))))
    model = keras.Model(x, keras.layers.Dense(1)(h))
    model.compile("sgd", "mse")
    assert [(op.reproducible, op.batch_axis, list(op.row_blocks))
            for op in capture(model).random_ops] == [(True, 0, [])] * 2


def test_a_draw_of_examples_and_timesteps_is_one_block(noisy_item):
    assert all(not op.row_blocks for op in noisy_item.random_ops)


def test_rows_in_no_block_order_are_not_reproducible():
    inputs = keras.Input((4,), name="x")
    h = keras.layers.Lambda(lambda t: keras.ops.flip(t, axis=0))(keras.layers.Dense(6)(inputs))
    h = keras.layers.Lambda(lambda t: keras.ops.flip(t, axis=0))(keras.layers.Dropout(0.5)(h))
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile("sgd", "mse")
    (op,) = capture(model).random_ops
    assert not op.reproducible and "blocks" in op.reason


@pytest.mark.parametrize("keep_blocks", [True, False])
def test_virtual_nodes_draw_each_block_as_one_batch_does(keep_blocks):
    """With the blocks, four virtual nodes compute one batch's gradients; read as one
    block (the rewrite before), they do not."""
    keras.utils.set_random_seed(0)
    item = capture(_two_views_model())
    if not keep_blocks:
        for op in item.proto.random_ops:
            del op.row_blocks[:]
    spec = autodist.ResourceSpec.local(workers=1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(22, 3, 4)).astype(np.float32)
    y = rng.normal(size=(22, 1)).astype(np.float32)
    strategy = builders.AllReduce().build(item, spec)
    one = _run_step(item, strategy, spec, x, y, "x")
    four = _run_step(item, strategy.with_virtual_nodes(24, 4), spec, x, y, "x")
    if not keep_blocks:
        assert abs(four["loss"] - one["loss"]) > 1e-3
        return
    for name in one:   # a product of the two views: gradients up to ~60
        np.testing.assert_allclose(four[name], one[name], rtol=1e-6, atol=2e-6, err_msg=name)
