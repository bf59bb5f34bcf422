"""fit on a tf.data.Dataset: the same batches as Keras, clear errors otherwise."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import autodist
from autodist import models
from autodist.runtime.datasets import dataset_arrays, is_dataset


def _data(n=70):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 8)).astype("float32"), rng.integers(0, 3, n).astype("int32")


def test_batches_become_arrays_batched_the_same_way():
    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    assert is_dataset(ds) and not is_dataset(x)
    inputs, targets, weights, batch = dataset_arrays(ds, ["features"])
    assert batch == 32 and weights is None
    np.testing.assert_array_equal(inputs[0], x)
    np.testing.assert_array_equal(targets, y)
    named = tf.data.Dataset.from_tensor_slices(({"b": x[:, :2], "a": x}, y)).batch(10)
    inputs, _, _, batch = dataset_arrays(named, ["a", "b"])
    assert batch == 10 and inputs[0].shape == (70, 8) and inputs[1].shape == (70, 2)
    weighted = tf.data.Dataset.from_tensor_slices((x, y, np.arange(70, dtype="float32")))
    _, _, weights, _ = dataset_arrays(weighted.batch(32), ["features"])
    np.testing.assert_array_equal(weights, np.arange(70))


@pytest.mark.parametrize("make,message", [
    (lambda d: d.batch(32).repeat(), "must be finite"),
    (lambda d: d.batch(32).map(lambda x, y: (x, y, y, y)), "\\(x, y, sample_weight\\) batch; "
                                                           "received a tuple of 4"),
    (lambda d: d.take(10).batch(3).concatenate(d.skip(10).batch(20)), "one size except"),
    (lambda d: d.take(0).batch(4), "empty"),
])
def test_bad_datasets_are_named(make, message):
    x, y = _data()
    with pytest.raises(autodist.AutodistError, match=message):
        dataset_arrays(make(tf.data.Dataset.from_tensor_slices((x, y))), ["features"])


def test_dict_without_the_model_inputs():
    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices(({"other": x}, y)).batch(8)
    with pytest.raises(autodist.AutodistError, match=r"without the model's inputs \['features'\]"):
        dataset_arrays(ds, ["features"])


@pytest.mark.cluster
def test_fit_on_a_dataset_equals_keras_fit_on_it():
    model = models.mlp(input_dim=8, hidden=(16,), classes=3, optimizer="adam")
    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)   # 32, 32, 6
    reference = models.single_device_twin(model)
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    strategy = autodist.builders.PSLoadBalancing().build(autodist.capture(model), spec)
    run = autodist.distribute(model, strategy, spec)
    with pytest.raises(autodist.AutodistError, match="pass neither y, sample_weight nor batch_size"):
        run.fit(ds, batch_size=32)
    history = run.fit(ds, epochs=2, verbose=0)
    reference.fit(ds, epochs=2, verbose=0)
    assert len(history.step_losses) == 6
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
