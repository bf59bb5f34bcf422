"""Batch statistics summed over replicas (synchronized batch normalization), no cluster.

Two replicas in one task's program (two logical CPUs of this process) each
hold half of a batch; with their moments and the moments' gradients summed
over the replicas, their gradients average to those of one device's step on
the whole batch, and their moving statistics are one device's. Training on
real clusters: the zoo (`tests/zoo`).
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import tensorflow as tf

import keras
import autodist
from autodist.ir.capture import capture
from autodist.kernels import global_batch, partitioner, replicator
from autodist.kernels.program import Program
from autodist.runtime import keras_parity
from autodist.search import builders
from tests.local_graph import local_graph


def _cnn():
    inputs = keras.Input((5, 5, 2), name="image")
    h = keras.layers.Conv2D(3, 3, padding="same", use_bias=False)(inputs)
    h = keras.layers.BatchNormalization(momentum=0.5)(h)
    h = keras.layers.Dense(4)(keras.layers.Flatten()(keras.layers.ReLU()(h)))
    h = keras.layers.BatchNormalization()(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


@pytest.fixture(scope="module")
def cnn():
    keras.utils.set_random_seed(0)
    model = _cnn()
    return model, capture(model)


def test_capture_finds_each_layers_moments_and_their_gradients(cnn):
    _, item = cnn
    assert [bn.syncable for bn in item.batch_norms] == [True, True]
    for bn in item.batch_norms:
        assert bn.mean.endswith("/moments/mean") and bn.variance.endswith("/moments/variance")
        assert bn.mean_gradient.startswith("gradient_tape/")
        assert bn.variance_gradient != bn.mean_gradient


def _step(item, spec, strategy, x, y):
    """Each local replica's loss, gradients and state updates, in this process."""
    program = Program(item, spec, ("worker", 0))
    partitioner.apply(program, strategy)
    replicator.apply(program, strategy)
    rng = np.random.default_rng(1)
    values = {v.name: rng.normal(scale=0.5, size=v.shape).astype(np.float32)
              for v in item.variables}
    with program.graph.as_default():
        assigns = [var.assign(values[role.shard]) for name, var in program.storage.items()
                   if (role := program.roles.get(name)) is not None and role.kind == "variable"]
        init = tf.group([var.initializer for var in program.storage.values()])
        fetches = [{"loss": r.loss.name, "updates": [u.name for u in r.state_updates],
                    **{k: tf.convert_to_tensor(g).name for k, g in r.gradients.items()}}
                   for r in program.replicas]
        states = {name: var.read_value().name for name, var in program.storage.items()
                  if program.roles[name].kind == "state"}
    local = local_graph(program)
    halves = np.array_split(np.arange(len(y)), len(program.replicas))
    feed = {}
    for replica, rows in zip(program.replicas, halves):
        feed[replica.inputs["image"].name] = x[rows]
        feed[replica.inputs["y"].name] = y[rows]
        if replica.all_sizes is not None:
            feed[replica.all_sizes.name] = [len(h) for h in halves]
    config = tf.compat.v1.ConfigProto(device_count={"CPU": 2})
    with tf.compat.v1.Session(graph=local, config=config) as session:
        session.run(init.name)
        session.run([a.name for a in assigns])
        out = session.run(fetches, feed)
        return out, session.run(states), program


def _one_and_two_replicas(item, examples: int, seed: int):
    """One replica's step on a random batch of `examples`, then two replicas' (the batch
    split as `np.array_split` splits it): (outputs, states), and (outputs, states,
    program, strategy, spec, x, y)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, 5, 5, 2)).astype(np.float32)
    y = rng.normal(size=(examples, 1)).astype(np.float32)
    one_spec = autodist.ResourceSpec.local(workers=1)
    two_spec = autodist.ResourceSpec.local(workers=1, cpu_replicas_per_worker=2)
    (one,), one_states, _ = _step(item, one_spec, builders.AllReduce().build(item, one_spec),
                                  x, y)
    strategy = builders.AllReduce().build(item, two_spec)
    two, two_states, program = _step(item, two_spec, strategy, x, y)
    return (one, one_states), (two, two_states, program, strategy, two_spec, x, y)


def test_two_replicas_compute_one_devices_gradients_and_moving_statistics(cnn):
    _, item = cnn
    (one, one_states), (two, two_states, program, strategy, two_spec, x, y) = \
        _one_and_two_replicas(item, 12, seed=0)
    assert global_batch.sums_over_replicas(item, strategy)
    assert program.step_collectives
    assert two[0]["loss"] + two[1]["loss"] == pytest.approx(2 * one["loss"], rel=1e-5)
    for name in one:
        if name not in ("loss", "updates"):
            np.testing.assert_allclose((two[0][name] + two[1][name]) / 2, one[name],
                                       rtol=1e-5, atol=2e-6, err_msg=name)
    # Not vacuous: with each replica's own statistics the gradients differ.
    ghost, _, _ = _step(item, two_spec, strategy.with_batch_norm("ghost"), x, y)
    assert not np.allclose(ghost[0]["loss"] + ghost[1]["loss"], 2 * one["loss"], rtol=1e-3)
    # Both replicas' moving statistics after the step: one device's.
    for name, value in two_states.items():
        np.testing.assert_allclose(value, one_states[name.replace("vn_1", "vn_0")],
                                   rtol=1e-5, atol=1e-6, err_msg=name)


def test_unequal_parts_of_a_batch_add_up_to_one_devices_gradients(cnn):
    """9 examples split 5/4 (a short last batch): each replica's gradient is weighted by
    its share afterwards, so the moments' upstream gradients are summed weighted by
    theirs. Before, they were summed unweighted: a replica's share times the sum, 4.5e-3
    off Keras' weights after two epochs (keras-io's gnn_citations baseline, 81 examples
    in batches of 32)."""
    _, item = cnn
    (one, _), (two, *_) = _one_and_two_replicas(item, 9, seed=2)
    shares = [5 / 9, 4 / 9]
    assert sum(s * t["loss"] for s, t in zip(shares, two)) == pytest.approx(one["loss"],
                                                                           rel=1e-5)
    for name in one:
        if name not in ("loss", "updates"):
            np.testing.assert_allclose(sum(s * t[name] for s, t in zip(shares, two)),
                                       one[name], rtol=1e-5, atol=2e-6, err_msg=name)


def test_ghost_statistics_are_kept_when_asked_and_said_when_chosen(cnn):
    model, item = cnn
    spec = autodist.ResourceSpec.local(workers=2)
    strategy = builders.AllReduce().build(item, spec)
    assert not global_batch.sums_over_replicas(item, strategy.with_batch_norm("ghost"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        keras_parity.check(model, item, strategy)                          # synced: silent
        keras_parity.check(model, item, strategy.with_virtual_nodes(8, 4)
                           .with_batch_norm("ghost"))                      # asked for: silent
    with pytest.warns(keras_parity.ParityWarning, match="ghost batch normalization"):
        keras_parity.check(model, item, strategy.with_virtual_nodes(8, 4))
    with pytest.raises(autodist.AutodistError, match=r"with_batch_norm\('sync'\).*one "
                                                     "virtual node per replica"):
        keras_parity.check(model, item, strategy.with_virtual_nodes(8, 4)
                           .with_batch_norm("sync"))
    with pytest.raises(autodist.StrategyError, match="mode must be one of"):
        strategy.with_batch_norm("global")


def test_per_example_normalizations_are_not_batch_statistics():
    inputs = keras.Input((3, 4))
    h = keras.layers.LayerNormalization()(inputs)
    h = keras.layers.GroupNormalization(groups=2)(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile("sgd", "mse")
    assert capture(model).batch_norms == []


@pytest.mark.parametrize("trainable", [True, False])
def test_moments_of_weights_are_not_batch_statistics(trainable):
    """keras-io's subclassing_conv_layers standardizes its kernel with tf.nn.moments over
    axes [0, 1, 2]: the Mean reduces axis 0 but reads no example. It was taken for batch
    statistics: warned of as unsyncable (trainable), or summed over the replicas each
    step (frozen)."""
    class StandardizedConv2D(keras.layers.Conv2D):
        def convolution_op(self, inputs, kernel):
            mean, var = tf.nn.moments(kernel, axes=[0, 1, 2], keepdims=True)
            return tf.nn.conv2d(inputs, (kernel - mean) / tf.sqrt(var + 1e-10),
                                strides=1, padding="VALID")

    inputs = keras.Input((6, 6, 2))
    conv = StandardizedConv2D(3, 3, trainable=trainable)
    h = keras.layers.BatchNormalization()(conv(keras.layers.Conv2D(2, 1)(inputs)))
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(h)))
    model.compile("sgd", "mse")
    item = capture(model)
    assert [(bn.layer.split("/")[-1].startswith("batch_normalization"), bn.syncable)
            for bn in item.batch_norms] == [(True, True)]
    strategy = builders.AllReduce().build(item, autodist.ResourceSpec.local(workers=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        keras_parity.check(model, item, strategy)


def test_batch_normalization_run_in_inference_mode_is_not_batch_statistics():
    # A custom call that runs its BatchNormalization with training=False (as keras-io's
    # GNN example ends up doing) normalizes with the moving statistics, as Keras does:
    # nothing to sum, nothing to say.
    class Frozen(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.norm = keras.layers.BatchNormalization()

        def call(self, x):
            return self.norm(x, training=False)

    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(1)(Frozen()(keras.layers.Dense(4)(inputs))))
    model.compile("sgd", "mse")
    item = capture(model)
    assert item.batch_norms == []
    spec = autodist.ResourceSpec.local(workers=2)
    strategy = builders.AllReduce().build(item, spec)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        keras_parity.check(model, item, strategy)
        keras_parity.check(model, item, strategy.with_virtual_nodes(8, 4))
