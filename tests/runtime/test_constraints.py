"""Variable constraints train as Keras' `fit` on a real 2-worker cluster: a MaxNorm kernel,
a NonNeg bias, a custom clip Constraint (the WGAN critic's) and an Embedding with
UnitNorm (its whole table, rows the step did not look up too), with parameter servers
and with all-reduce. The learning rate drives every constrained variable onto its
constraint's boundary in Keras (asserted), so a run that skipped a constraint would
differ. The capture and the updates one by one: tests/ir/test_capture_constraints.py,
tests/kernels/test_constraints.py."""
from __future__ import annotations

import numpy as np
import pytest

import keras
from keras import ops
from autodist.search import builders
from tests.keras_equal import assert_trains_as_keras, twin_models, two_worker_run

pytestmark = pytest.mark.cluster

MAX_NORM, CLIP = 0.5, 0.2


class ClipWeights(keras.constraints.Constraint):
    """The WGAN critic's weight clip."""

    def __init__(self, limit: float) -> None:
        self.limit = limit

    def __call__(self, w):
        return ops.clip(w, -self.limit, self.limit)


def _model() -> keras.Model:
    x = keras.Input((4,), name="x")
    ids = keras.Input((2,), dtype="int32", name="ids")
    rows = keras.layers.Embedding(10, 3, embeddings_constraint=keras.constraints.UnitNorm(
        axis=1), name="embedding")(ids)
    hidden = keras.layers.Dense(5, activation="tanh", name="hidden",
                                kernel_constraint=keras.constraints.MaxNorm(MAX_NORM),
                                bias_constraint=keras.constraints.NonNeg())(x)
    joined = keras.layers.Concatenate()([hidden, keras.layers.Flatten()(rows)])
    out = keras.layers.Dense(1, kernel_constraint=ClipWeights(CLIP), name="out")(joined)
    model = keras.Model([x, ids], out)
    # Plain SGD: the Embedding's update is a scatter of its looked-up rows, then
    # UnitNorm normalizes every row.
    model.compile(keras.optimizers.SGD(0.5), "mse", metrics=["mae"])
    return model


def _pair():
    return twin_models(_model, seed=5)


def _data(n: int = 64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    ids = rng.integers(0, 8, size=(n, 2)).astype("int32")   # rows 8 and 9 never looked up
    y = (3.0 * x.sum(axis=1) + ids[:, 0] - 4.0).astype("float32")
    return {"x": x, "ids": ids}, y


def _assert_on_the_boundaries(model) -> None:
    """Every constraint is active in the trained weights."""
    weights = {v.path: v.numpy() for v in model.trainable_variables}
    norms = np.sqrt(np.sum(np.square(weights["hidden/kernel"]), axis=0))
    assert np.all(norms <= MAX_NORM + 1e-6) and np.isclose(norms.max(), MAX_NORM, atol=1e-6)
    assert weights["hidden/bias"].min() == 0.0
    assert np.abs(weights["out/kernel"]).max() == pytest.approx(CLIP, abs=1e-7)
    rows = np.sqrt(np.sum(np.square(weights["embedding/embeddings"]), axis=1))
    np.testing.assert_allclose(rows, 1.0, atol=1e-6)


@pytest.mark.parametrize("ps, builder", [(1, builders.PS), (0, builders.AllReduce)],
                         ids=["ps", "all_reduce"])
def test_constraints_train_as_keras(ps, builder):
    x, y = _data()
    model, reference = _pair()
    run = two_worker_run(model, ps=ps, builder=builder)
    history = run.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    keras_history = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    _assert_on_the_boundaries(reference)
    assert_trains_as_keras(model, reference, history, keras_history)
