"""`fit(class_weight=...)` against the exact trajectory, step by step in float64.

`test_metrics.test_class_weight_equals_keras` compares autodist with Keras;
when they disagree, these tests say which of the two left the exact
trajectory: the same MLP, data, class weights and SGD steps computed in
float64 with NumPy, with Keras' semantics (each example weighs its class's
weight; the weighted losses are summed and divided by the batch's examples,
`sum_over_batch_size`). Float32 stays within 1e-7 of it over the 6 steps, and
no ReLU pre-activation comes within 8e-5 of zero on the way, so float32
summation order alone cannot move a weight by 1e-6.
"""
from __future__ import annotations

import numpy as np
import pytest

import keras
import autodist
from autodist import models
from autodist.search import builders

EXAMPLES, BATCH, EPOCHS, LEARNING_RATE = 96, 32, 2, 0.1
CLASS_WEIGHT = {c: 1.0 + c / 4 for c in range(10)}
# Float32 runs stay within 6e-8 of the float64 trajectory here.
TOLERANCE = 1e-6


def _data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(EXAMPLES, 20)).astype("float32"),
            rng.integers(0, 10, EXAMPLES).astype("int32"))


def _classifier():
    model = models.mlp(input_dim=20, hidden=(16,), optimizer=keras.optimizers.SGD(LEARNING_RATE))
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _exact(initial, x, y):
    """The weights after every step in float64, and the smallest |ReLU pre-activation|."""
    kernel, bias, out_kernel, out_bias = [np.asarray(w, np.float64) for w in initial]
    x = x.astype(np.float64)
    weights = np.asarray([CLASS_WEIGHT.get(int(c), 1.0) for c in y])
    steps, closest = [], np.inf
    for _ in range(EPOCHS):
        for start in range(0, EXAMPLES, BATCH):
            xb, yb = x[start:start + BATCH], y[start:start + BATCH]
            pre = xb @ kernel + bias
            closest = min(closest, float(np.abs(pre).min()))
            hidden = np.maximum(pre, 0.0)
            logits = hidden @ out_kernel + out_bias
            probs = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
            probs[np.arange(len(yb)), yb] -= 1.0
            d_logits = probs * weights[start:start + BATCH, None] / len(yb)
            d_pre = (d_logits @ out_kernel.T) * (pre > 0)
            kernel = kernel - LEARNING_RATE * (xb.T @ d_pre)
            bias = bias - LEARNING_RATE * d_pre.sum(axis=0)
            out_kernel = out_kernel - LEARNING_RATE * (hidden.T @ d_logits)
            out_bias = out_bias - LEARNING_RATE * d_logits.sum(axis=0)
            steps.append([kernel, bias, out_kernel, out_bias])
    return steps, closest


def _assert_on_trajectory(got, want, who):
    for name, g, w in zip(("kernel", "bias", "logits kernel", "logits bias"), got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=TOLERANCE,
                                   err_msg=f"{who}: {name} left the float64 trajectory")


def test_keras_follows_the_exact_trajectory_each_step():
    x, y = _data()
    model = _classifier()
    steps, closest = _exact(model.get_weights(), x, y)
    assert closest > 1e-5, "a ReLU pre-activation is too close to 0 for a float32 comparison"
    recorded = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            recorded.append(self.model.get_weights())

    model.fit(x, y, class_weight=CLASS_WEIGHT, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
              verbose=0, callbacks=[Record()])
    assert len(recorded) == len(steps)
    for step, (got, want) in enumerate(zip(recorded, steps), start=1):
        _assert_on_trajectory(got, want, f"Keras after step {step}")


@pytest.mark.cluster
def test_partitioned_ps_follows_the_exact_trajectory():
    x, y = _data()
    model = _classifier()
    steps, _ = _exact(model.get_weights(), x, y)
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    graph_item = autodist.capture(model)
    autodist.distribute(model, builders.PartitionedPS().build(graph_item, spec), spec,
                        graph_item=graph_item).fit(
        x, y, class_weight=CLASS_WEIGHT, batch_size=BATCH, epochs=EPOCHS, verbose=0,
        shuffle=False)
    _assert_on_trajectory(model.get_weights(), steps[-1], "autodist PartitionedPS")
