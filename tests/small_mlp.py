"""The small MLP, its data and its Keras reference, shared by the cluster tests
of virtual nodes, elastic resizing and failure recovery."""
from __future__ import annotations

import numpy as np

import keras
from autodist import models


def mlp():
    """20 -> 16 -> 10, SGD with momentum (so the optimizer has a slot)."""
    return models.mlp(input_dim=20, hidden=(16,), optimizer=keras.optimizers.SGD(0.1, momentum=0.9))


def mlp_with_batch_norm():
    """20 -> 16 -> batch normalization -> 10: with virtual nodes each one computes its
    own statistics (and needs an example of every batch)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((20,), name="features")
    h = keras.layers.BatchNormalization()(keras.layers.Dense(16, activation="relu")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def data(examples: int):
    """Seeded inputs and integer targets for `mlp`."""
    rng = np.random.default_rng(0)
    return (rng.normal(size=(examples, 20)).astype("float32"),
            rng.integers(0, 10, examples).astype("int32"))


def keras_weights(model, x, y, batch: int, epochs: int) -> list[np.ndarray]:
    """The weights single-device Keras `fit` reaches from `model`'s initial weights."""
    reference = models.single_device_twin(model)
    reference.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return reference.get_weights()
