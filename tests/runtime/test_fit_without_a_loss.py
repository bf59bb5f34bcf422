"""A model compiled without a loss (`compile(optimizer)`, its loss only what its layers
add), and a model input named "sample_weight": fit as Keras' `fit`.

Keras computes such a model's loss from its `add_loss` terms alone: it ignores `y`,
`sample_weight` and (given `y`) `class_weight`, and reads a dataset of `x` alone.
`class_weight` without `y` fails in Keras and is refused here. A model input named
"sample_weight" next to a compiled loss is refused before launch (the run would
confuse it with fit's sample weights).

The runs are on a real 2-worker cluster and are compared with single-device Keras
`fit` on the same data: weights to 2e-5, History to 1e-5.
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import keras
import autodist
from autodist.search import builders
from keras import layers, ops
from tests.keras_equal import assert_trains_as_keras, twin_models, two_worker_run
from tests.zoo.models import LogisticEndpoint



def _endpoint_pair():
    def build():
        inputs = keras.Input((6,), name="inputs")
        targets = keras.Input((1,), name="targets")
        weights = keras.Input((1,), name="sample_weight")
        logits = layers.Dense(1)(layers.Dense(4, activation="relu")(inputs))
        model = keras.Model([inputs, targets, weights],
                            LogisticEndpoint()(logits, targets, weights))
        model.compile(keras.optimizers.Adam(1e-2))
        return model

    model, reference = twin_models(build, seed=0)
    return model, reference


def _endpoint_data(n: int = 48):
    rng = np.random.default_rng(41)
    features = rng.random((n, 6))
    return {"inputs": features, "targets": (features[:, :1] > 0.5).astype("float64"),
            "sample_weight": rng.random((n, 1))}, rng






def test_class_weight_without_targets_is_refused_before_launch():
    """Keras' fit fails on it (class weights are looked up by y's classes)."""
    model, _ = _endpoint_pair()
    data, _ = _endpoint_data()
    run = two_worker_run(model)
    with pytest.raises(autodist.AutodistError, match="class_weight.*needs y"):
        run.fit(data, class_weight={0: 1.0, 1: 3.0}, verbose=0)


@pytest.mark.cluster
def test_a_model_without_a_loss_ignores_y_and_sample_weight():
    """fit(x, y, sample_weight=) trains as Keras' fit: both ignored (the loss is the
    endpoint layer's, weighted by the model input "sample_weight")."""
    model, reference = _endpoint_pair()
    data, rng = _endpoint_data()
    y = (rng.random((48, 1)) > 0.5).astype("int32")
    weights = 3.0 * rng.random(48)
    run = two_worker_run(model)
    history = run.fit(data, y, sample_weight=weights, batch_size=16, epochs=2,
                      shuffle=False, verbose=0)
    keras_history = reference.fit(data, y, sample_weight=weights, batch_size=16, epochs=2,
                                  shuffle=False, verbose=0)
    assert_trains_as_keras(model, reference, history, keras_history)
    assert int(model.optimizer.iterations.numpy()) == 6


@pytest.mark.cluster
def test_a_dataset_for_a_model_without_a_loss_trains_as_keras():
    """Keras reads x alone from each batch of a dataset for it, whether the batches are
    x, (x, y, sample_weight) or (x, y) with class_weight (y and the weights ignored); so
    does the run, on a dataset reshuffled each epoch, three fits in a row."""
    model, reference = _endpoint_pair()
    data, rng = _endpoint_data()
    y = (rng.random((48, 1)) > 0.5).astype("int32")

    def dataset(parts: int):
        elements = (data, y, rng.random(48))[:parts] if parts > 1 else data
        return tf.data.Dataset.from_tensor_slices(elements).shuffle(48, seed=3).batch(12)

    run = two_worker_run(model, ps=1, builder=builders.PS)
    fits = [({"epochs": 2}, 1), ({}, 3), ({"class_weight": {0: 1.0, 1: 4.0}}, 2)]
    for kwargs, parts in fits:
        history = run.fit(dataset(parts), verbose=0, **kwargs)
        keras_history = reference.fit(dataset(parts), verbose=0, **kwargs)
        assert_trains_as_keras(model, reference, history, keras_history)
    assert int(model.optimizer.iterations.numpy()) == 16
    with pytest.raises(autodist.AutodistError, match="class_weight.*needs y"):
        run.fit(dataset(1), class_weight={0: 2.0}, verbose=0)


def test_an_input_named_sample_weight_next_to_a_compiled_loss_is_refused():
    """The capture names fit's sample weights "sample_weight" too, and the run feeds its
    inputs by name: refused before launch, naming the input (a model without a loss,
    as the endpoint layer's, takes no sample weights: nothing is confused)."""
    features = keras.Input((3,), name="features")
    named = keras.Input((1,), name="sample_weight")
    hidden = layers.Dense(4, activation="tanh")(layers.concatenate([features, named]))
    model = keras.Model({"features": features, "sample_weight": named},
                        layers.Dense(1)(hidden))
    model.compile(keras.optimizers.SGD(0.1), "mse", weighted_metrics=["mse"])
    with pytest.raises(autodist.AutodistError,
                       match=r"input\(s\) \['sample_weight'\] have the name\(s\) of fit's "
                             "sample_weight.*Rename the input"):
        two_worker_run(model)


class _ActivityPenalty(layers.Layer):
    """Adds the mean square of its input as a loss (an activity penalty)."""

    def call(self, x):
        self.add_loss(ops.mean(ops.square(x)))
        return x


@pytest.mark.cluster
def test_a_model_without_a_loss_but_with_compiled_metrics_reads_y_for_them():
    """compile(optimizer, metrics=..., weighted_metrics=...) without a loss: Keras trains
    on the add_loss terms and computes the metrics on y (the weighted ones with
    sample_weight); so does the run (it was refused at capture with TensorFlow's "None
    values not supported")."""
    def build():
        inputs = keras.Input((4,))
        outputs = _ActivityPenalty()(layers.Dense(2)(layers.Dense(3, activation="tanh")(
            inputs)))
        model = keras.Model(inputs, outputs)
        model.compile(keras.optimizers.SGD(0.1), metrics=["mae"], weighted_metrics=["mse"])
        return model

    model, reference = twin_models(build, seed=0)
    rng = np.random.default_rng(5)
    x, y = rng.random((48, 4)).astype("float32"), rng.random((48, 2)).astype("float32")
    weights = 2.0 * rng.random(48)
    run = two_worker_run(model, ps=1, builder=builders.PS)
    history = run.fit(x, y, sample_weight=weights, batch_size=16, epochs=2, shuffle=False,
                      verbose=0)
    keras_history = reference.fit(x, y, sample_weight=weights, batch_size=16, epochs=2,
                                  shuffle=False, verbose=0)
    assert sorted(keras_history.history) == ["loss", "mae", "mse"]
    assert_trains_as_keras(model, reference, history, keras_history)
