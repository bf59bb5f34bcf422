"""Optimizer updates equal the Keras optimizers they stand for, dense and sparse."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import keras
from autodist.ir.capture import _optimizer_info, _slot_names
from autodist.kernels.optimizers import Slots, apply_update, check_supported, slot_initial_value
from autodist.ir.errors import StrategyError

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "amsgrad": lambda: keras.optimizers.Adam(0.01, amsgrad=True),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "rmsprop_centered_momentum": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5,
                                                                  centered=True),
}
STEPS = 4


def _gradients(sparse: bool, rng):
    out = []
    for _ in range(STEPS):
        if sparse:  # repeated rows on purpose
            indices = np.array([0, 3, 3, 5])
            out.append(tf.IndexedSlices(tf.constant(rng.normal(size=(4, 3)), tf.float32),
                                        tf.constant(indices), tf.constant([6, 3])))
        else:
            out.append(tf.constant(rng.normal(size=(6, 3)), tf.float32))
    return out


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_update_equals_keras(name, sparse):
    rng = np.random.default_rng(0)
    initial = rng.normal(size=(6, 3)).astype(np.float32)
    grads = _gradients(sparse, rng)

    reference = keras.Variable(initial)
    optimizer = OPTIMIZERS[name]()
    for g in grads:
        optimizer.apply_gradients([(g, reference)])

    info = _optimizer_info(OPTIMIZERS[name](), [])
    check_supported(info)
    graph = tf.Graph()
    with graph.as_default():
        var = tf.compat.v1.Variable(initial, use_resource=True)
        slots = {s: tf.compat.v1.Variable(tf.fill([6, 3], slot_initial_value(info, s)),
                                          use_resource=True)
                 for s in _slot_names(info, "v")}
        step = tf.compat.v1.placeholder(tf.int64, [])
        values = tf.compat.v1.placeholder(tf.float32)
        if sparse:
            indices = tf.compat.v1.placeholder(tf.int64)
            grad = tf.IndexedSlices(values, indices, tf.constant([6, 3], tf.int64))
        else:
            grad = values
        update = apply_update(info, var, grad, Slots(slots), step)
        init = tf.compat.v1.global_variables_initializer()
        with tf.compat.v1.Session() as session:
            session.run(init)
            for i, g in enumerate(grads):
                feed = {step: i}
                if sparse:
                    feed.update({values: g.values.numpy(), indices: g.indices.numpy()})
                else:
                    feed[values] = g.numpy()
                session.run(update, feed)
            got = session.run(var)
    np.testing.assert_allclose(got, reference.numpy(), rtol=1e-5, atol=1e-6)


def test_unsupported_options_are_named():
    info = _optimizer_info(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), [])
    with pytest.raises(StrategyError, match="uses gradient_accumulation_steps=2, which the "
                                            "distributed runtime does not support"):
        check_supported(info)
    info = _optimizer_info(keras.optimizers.SGD(0.1, loss_scale_factor=128.0), [])
    with pytest.raises(StrategyError, match="loss_scale_factor=128"):
        check_supported(info)
    info = _optimizer_info(keras.optimizers.Adam(0.1, use_ema=True), [])
    with pytest.raises(StrategyError, match="use_ema=True.*moving average"):
        check_supported(info)
