"""The common shape of a test that a distributed run trains as Keras' `fit`: a model
distributed on 2 local workers (optionally with parameter servers) and the check of its
weights and History against a single-device Keras reference."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

import autodist
from autodist.search import builders

WEIGHT_ATOL = 2e-5
HISTORY_RTOL, HISTORY_ATOL = 1e-5, 1e-7


def two_worker_run(model, ps: int = 0, builder=builders.AllReduce) -> autodist.DistributedRun:
    """`model` captured and distributed on 2 local workers and `ps` parameter servers by
    `builder`."""
    spec = autodist.ResourceSpec.local(workers=2, ps=ps)
    item = autodist.capture(model)
    return autodist.distribute(model, builder().build(item, spec), spec, graph_item=item)


def assert_trains_as_keras(model, reference, history, keras_history) -> None:
    """Weights within `WEIGHT_ATOL` of `reference`'s, the same History keys, every
    per-epoch value within `HISTORY_RTOL`."""
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=WEIGHT_ATOL)
    assert sorted(history.history) == sorted(keras_history.history)
    for key, values in keras_history.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=HISTORY_RTOL,
                                   atol=HISTORY_ATOL, err_msg=key)


def small_model_pair(optimizer: Callable[[], Any], **compile_options):
    """A 4-3-1 tanh MLP compiled with mse and mae, and its single-device twin (same
    weights, a fresh optimizer each from `optimizer`; `compile_options` to both)."""
    import keras

    def build():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer(), "mse", metrics=["mae"], **compile_options)
        return model

    return twin_models(build, seed=1)


def twin_models(build: Callable[[], Any], seed: int):
    """Two models from `build` after Keras' global seed is set to `seed`: the one to
    distribute and its single-device reference, with the first's weights and seed
    generators (`set_weights` leaves those: a Dropout would draw other masks)."""
    import keras

    keras.utils.set_random_seed(seed)
    model, reference = build(), build()
    reference.set_weights(model.get_weights())
    seeds = [(a, b) for a, b in zip(model.variables, reference.variables)
             if "seed_generator_state" in a.path]
    for source, target in seeds:
        target.assign(source.numpy())
    return model, reference


def sum_and_weighted_mean_model(learning_rate: float,
                                cls_reduction: str = "mean_with_sample_weight", metrics=None):
    """A two-output model (features (4,) -> "reg" (2,), "cls" 3 logits) whose "reg" loss
    is reduced by a sum and whose "cls" loss by `cls_reduction`, with loss weights 0.5
    and 2.0, compiled with SGD(`learning_rate`)."""
    import keras

    inputs = keras.Input((4,), name="features")
    h = keras.layers.Dense(5, activation="tanh")(inputs)
    model = keras.Model(inputs, [keras.layers.Dense(2, name="reg")(h),
                                 keras.layers.Dense(3, name="cls")(h)])
    model.compile(keras.optimizers.SGD(learning_rate), loss=[
        keras.losses.MeanSquaredError(reduction="sum"),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=cls_reduction)],
        loss_weights=[0.5, 2.0], metrics=metrics)
    return model
