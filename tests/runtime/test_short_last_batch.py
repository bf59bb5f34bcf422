"""A last batch with fewer examples than the replicas or virtual nodes that split it
trains as Keras' `fit` on a real 2-worker cluster: a replica or virtual node without
examples adds a zero loss, zero gradients and nothing to the metrics, and still runs
the step's sums (synchronized batch normalization counts the global batch's examples,
not its own). Refused before: 33 examples in batches of 16 on 2 workers (a last batch
of 1) stopped `fit` with an error.

Where batch normalization computes each virtual node's own statistics (several virtual
nodes per replica), a batch still needs an example per virtual node: refused before
launch (`tests/runtime/test_virtual_nodes.py`).
"""
from __future__ import annotations

import numpy as np
import pytest

import keras
import autodist
from autodist.search import builders
from tests.keras_equal import assert_trains_as_keras, twin_models

pytestmark = pytest.mark.cluster


class _MeanPenalty(keras.layers.Layer):
    """Adds a loss term that is a mean over the batch's examples (0 / 0 on none)."""

    def call(self, x):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(x)))
        return x


def _model(batch_norm: bool):
    """Dropout, an activity regularizer (Keras divides it by the batch size with
    divide_no_nan), a loss term that is a mean over the examples (0 / 0 on none) and,
    synchronized over the replicas, batch normalization."""
    inputs = keras.Input((4,), name="features")
    h = keras.layers.Dense(8, activation="relu", activity_regularizer="l2")(inputs)
    h = _MeanPenalty()(h)
    if batch_norm:
        h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dropout(0.3, seed=2)(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
    return model


@pytest.mark.parametrize(("builder", "ps", "virtual_nodes"), [
    (builders.AllReduce, 0, None),   # batch norm synchronized; worker 1 holds nothing
    (builders.PS, 1, (16, 4)),       # virtual nodes 3 and 4 (worker 1) hold nothing
], ids=["all_reduce_batch_norm", "ps_virtual_nodes"])
def test_a_last_batch_smaller_than_the_replicas_trains_as_keras(builder, ps, virtual_nodes):
    rng = np.random.default_rng(0)
    n = 33 if virtual_nodes is None else 34   # a last batch of 1 (2 replicas) or 2 (4 nodes)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = rng.normal(size=(n, 1)).astype(np.float32)
    model, reference = twin_models(lambda: _model(batch_norm=virtual_nodes is None), seed=0)
    keras_history = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    spec = autodist.ResourceSpec.local(workers=2, ps=ps)
    strategy = builder().build(autodist.capture(model), spec)
    if virtual_nodes is not None:
        strategy = strategy.with_virtual_nodes(*virtual_nodes)
    history = autodist.distribute(model, strategy, spec).fit(
        x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert_trains_as_keras(model, reference, history, keras_history)
