"""Losses reduced by a sum and by a mean over the sample weights train as Keras' fit on
2 workers (all-reduce, and parameter servers).

One model covers both: output "reg" with `MeanSquaredError(reduction="sum")`,
output "cls" with `SparseCategoricalCrossentropy(reduction="mean_with_sample_weight")`,
`loss_weights`, uneven sample weights (the first half of each batch weighs six times
the second, which the other worker holds; some weigh 0) and a short last batch that
the workers split unevenly (Keras' `reg_loss` and `cls_loss` count each batch once, with
its loss: the workers' 7 and 6 examples one count; so does a loss instance passed as a
metric, `reg_mae_loss`).
Weighting each worker's loss by its share of the batch, as for a mean, halves the
sum's gradient and divides by each worker's own weights (SGD shows both). The in-process
checks of the step: `tests/kernels/test_loss_reductions.py`.
"""
from __future__ import annotations

import numpy as np
import pytest

import keras

from autodist.search import builders
from tests.keras_equal import (assert_trains_as_keras, sum_and_weighted_mean_model,
                               twin_models, two_worker_run)

pytestmark = pytest.mark.cluster

EXAMPLES, BATCH = 45, 16   # batches of 16, 16 and 13 (the workers hold 7 and 6 of it)


def _model():
    # A loss instance as a metric is one value per batch, counted once like the trackers.
    return sum_and_weighted_mean_model(
        0.02, metrics=[[keras.losses.MeanAbsoluteError(name="mae_loss")], ["accuracy"]])


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, 4)).astype(np.float32)
    y = [rng.normal(size=(EXAMPLES, 2)).astype(np.float32),
         rng.integers(0, 3, size=EXAMPLES).astype(np.int32)]
    first_half = (np.arange(EXAMPLES) % BATCH) < BATCH // 2
    weights = [rng.uniform(0.5, 2.0, size=EXAMPLES).astype(np.float32),
               np.where(first_half, 3.0, 0.5).astype(np.float32)]
    weights[1][[1, 20]] = 0.0
    return x, y, weights


@pytest.mark.parametrize(("ps", "builder"), [(0, builders.AllReduce), (1, builders.PS)],
                         ids=["all_reduce", "ps"])
def test_sum_and_mean_with_sample_weight_train_as_keras(ps, builder):
    x, y, weights = _data()
    model, reference = twin_models(_model, seed=0)
    run = two_worker_run(model, ps=ps, builder=builder)
    history = run.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=2, shuffle=False,
                      verbose=0)
    keras_history = reference.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=2,
                                  shuffle=False, verbose=0)
    assert {"loss", "reg_loss", "cls_loss", "cls_accuracy", "reg_mae_loss"} <= \
        set(keras_history.history)
    assert_trains_as_keras(model, reference, history, keras_history)
