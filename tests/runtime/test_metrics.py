"""Keras `fit` parity: compiled metrics, sample and class weights, several outputs.

Every run is compared with single-device Keras `fit` on the same data: the
History's per-epoch logs (the loss, the compiled metrics, per-output losses)
and the trained weights. The metrics are computed on the workers (each step
returns its batch's contribution to every metric's state) and summed, so
they equal Keras' up to float32 summation order.
"""
from __future__ import annotations

import numpy as np
import pytest

import keras
import autodist
from autodist import models
from autodist.search import builders

pytestmark = pytest.mark.cluster

TOLERANCE = 2e-5
EXAMPLES, BATCH, EPOCHS = 96, 32, 2


def _loss():
    # From logits: the MLP's outputs are logits. (Taken as probabilities, they would be
    # clipped to [1e-7, 1 - 1e-7] before the log: a loss whose gradient jumps where an
    # output crosses the clip, so float32 summation order alone moved weights by 5e-5.)
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _classifier(**compile_args):
    model = models.mlp(input_dim=20, hidden=(16,), optimizer=keras.optimizers.SGD(0.1))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss(), **compile_args)
    return model


def _data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(EXAMPLES, 20)).astype("float32"),
            rng.integers(0, 10, EXAMPLES).astype("int32"),
            rng.uniform(0.1, 3.0, EXAMPLES).astype("float32"))


def _compare(history, keras_history, model, reference, rtol=1e-4):
    assert sorted(history.history) == sorted(keras_history.history)
    for key, values in keras_history.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=rtol, atol=1e-6,
                                   err_msg=key)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


def test_compiled_metrics_and_sample_weights_equal_keras():
    """Metrics (plain and weighted) with per-example weights, on a PS cluster without
    callbacks (History's exact values replace the chief's estimates) and on an
    all-reduce cluster with a callback (whose batch logs are the global ones)."""
    x, y, weights = _data()
    compile_args = dict(metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=3)],
                        weighted_metrics=["accuracy"])
    model = _classifier(**compile_args)
    reference = models.single_device_twin(model)
    reference.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=_loss(), **compile_args)
    keras_logs = []
    keras_history = reference.fit(
        x, y, sample_weight=weights, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: keras_logs.append(dict(logs)))])
    assert sorted(keras_history.history) == ["accuracy", "loss", "sparse_top_k_categorical_"
                                             "accuracy", "weighted_accuracy"]

    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    graph_item = autodist.capture(model)
    history = autodist.distribute(model, builders.PS().build(graph_item, spec), spec,
                                  graph_item=graph_item).fit(
        x, y, sample_weight=weights, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False)
    _compare(history, keras_history, model, reference)

    model = _classifier(**compile_args)
    reference.set_weights(model.get_weights())
    keras_logs.clear()
    keras_history = reference.fit(
        x, y, sample_weight=weights, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: keras_logs.append(dict(logs)))])
    spec = autodist.ResourceSpec.local(workers=2)
    graph_item = autodist.capture(model)
    batch_logs = []
    history = autodist.distribute(model, builders.AllReduce().build(graph_item, spec), spec,
                                  graph_item=graph_item).fit(
        x, y, sample_weight=weights, batch_size=BATCH, epochs=EPOCHS, verbose=0,
        callbacks=[keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: batch_logs.append(dict(logs)))], shuffle=False)
    _compare(history, keras_history, model, reference)
    assert len(batch_logs) == len(keras_logs)
    for got, want in zip(batch_logs, keras_logs):
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6, err_msg=key)


def test_class_weight_equals_keras():
    x, y, _ = _data()
    class_weight = {c: 1.0 + c / 4 for c in range(10)}
    model = _classifier(weighted_metrics=["accuracy"])
    reference = models.single_device_twin(model)
    reference.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=_loss(), weighted_metrics=["accuracy"])
    keras_history = reference.fit(x, y, class_weight=class_weight, batch_size=BATCH,
                                  epochs=EPOCHS, shuffle=False, verbose=0)
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    graph_item = autodist.capture(model)
    history = autodist.distribute(model, builders.PartitionedPS().build(graph_item, spec), spec,
                                  graph_item=graph_item).fit(
        x, y, class_weight=class_weight, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False)
    _compare(history, keras_history, model, reference)


def test_several_outputs_log_each_outputs_loss_and_metrics_as_keras():
    def build():
        inputs = keras.Input((20,), name="features")
        hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
        outputs = {"cls": keras.layers.Dense(10, name="cls")(hidden),
                   "reg": keras.layers.Dense(1, name="reg")(hidden)}
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.05),
                      loss={"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                            "reg": "mse"},
                      loss_weights={"cls": 1.0, "reg": 0.5},
                      metrics={"cls": ["accuracy"], "reg": ["mae"]})
        return model

    model = build()
    x, labels, _ = _data()
    values = np.random.default_rng(1).normal(size=(EXAMPLES, 1)).astype("float32")
    y = {"cls": labels, "reg": values}
    reference = build()
    reference.set_weights(model.get_weights())
    keras_history = reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                                  verbose=0)
    assert {"cls_loss", "reg_loss", "cls_accuracy", "reg_mae"} <= set(keras_history.history)
    spec = autodist.ResourceSpec.local(workers=2)
    graph_item = autodist.capture(model)
    history = autodist.distribute(model, builders.AllReduce().build(graph_item, spec), spec,
                                  graph_item=graph_item).fit(
        x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False)
    _compare(history, keras_history, model, reference)
