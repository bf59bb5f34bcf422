"""`fit` on a `keras.utils.PyDataset` and on a Python generator, as Keras' `fit`.

The driver reads them as Keras' fit does (`autodist.runtime.python_data`; the order
and the calls are checked without a cluster in `test_python_data.py`) and the workers
train on the batches read. Each run is on a real 2-worker cluster and is compared with
single-device Keras `fit` on a twin of the same input: weights to 2e-5, History to 1e-5.
"""
from __future__ import annotations

import numpy as np
import pytest

import keras
from autodist.ir.errors import AutodistError
from autodist.search import builders
from tests.keras_equal import assert_trains_as_keras, small_model_pair, two_worker_run


class Examples(keras.utils.PyDataset):
    """50 examples in batches of 16 (the last of 2); each epoch's end reorders the
    examples with NumPy's global generator, as keras-io's data-loading examples do."""

    def __init__(self, seed: int, **kwargs) -> None:
        super().__init__(**kwargs)
        rng = np.random.default_rng(seed)
        self.x, self.y = rng.normal(size=(50, 4)), rng.normal(size=(50,))
        self.order = np.arange(50)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i):
        rows = self.order[16 * i:16 * (i + 1)]
        return self.x[rows], self.y[rows]

    def on_epoch_end(self) -> None:
        self.order = np.random.permutation(50)


@pytest.mark.cluster
def test_a_py_dataset_with_on_epoch_end_and_validation_trains_as_keras():
    """Two epochs, each pass shuffled by fit (its default) and reordered by on_epoch_end,
    validated on a PyDataset."""
    model, reference = small_model_pair(lambda: keras.optimizers.Adam(0.05))
    run = two_worker_run(model)
    keras.utils.set_random_seed(7)
    history = run.fit(Examples(0), epochs=2, validation_data=Examples(1), verbose=0)
    keras.utils.set_random_seed(7)
    keras_history = reference.fit(Examples(0), epochs=2, validation_data=Examples(1),
                                  verbose=0)
    assert len(history.step_losses) == 8 and "val_loss" in history.history
    assert_trains_as_keras(model, reference, history, keras_history)


@pytest.mark.cluster
def test_an_endless_generator_with_steps_per_epoch_trains_as_keras():
    """Weighted batches, each drawn anew (augmented), 3 epochs of 3 steps from one
    iterator, on parameter servers."""
    def batches(seed: int):
        rng = np.random.default_rng(seed)
        x, y = rng.normal(size=(64, 4)), rng.normal(size=(64,))
        while True:
            rows = rng.choice(64, 16, replace=False)
            noise = rng.normal(scale=0.1, size=(16, 4))
            yield (x[rows] + noise).astype("float32"), y[rows], rng.random(16)

    model, reference = small_model_pair(lambda: keras.optimizers.SGD(0.1, momentum=0.9))
    run = two_worker_run(model, ps=1, builder=builders.PS)
    history = run.fit(batches(3), epochs=3, steps_per_epoch=3, verbose=0)
    keras_history = reference.fit(batches(3), epochs=3, steps_per_epoch=3, verbose=0)
    assert len(history.step_losses) == 9
    assert_trains_as_keras(model, reference, history, keras_history)


@pytest.mark.cluster
def test_a_generator_read_to_its_end_leaves_keras_counts_for_the_next_fit():
    """One epoch of a finite generator: Keras' step that finds its end advances the
    Dropout's seed and counts an Adam iteration (5 for 4 batches), and the next fit
    (on arrays) starts from them; so does the run's."""
    def build():
        keras.utils.set_random_seed(2)   # the same Dropout seed in both
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"),
                                  keras.layers.Dropout(0.5), keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(0.05), "mse")
        return model

    def finite():
        rng = np.random.default_rng(4)
        for _ in range(4):
            yield rng.normal(size=(16, 4)).astype("float32"), rng.normal(size=(16,))

    model, reference = build(), build()
    run = two_worker_run(model)
    run.fit(finite(), epochs=1, verbose=0)
    reference.fit(finite(), epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 5 == \
        int(reference.optimizer.iterations.numpy())
    x, y = np.random.default_rng(5).normal(size=(32, 4)), np.random.default_rng(6).normal(
        size=(32,))
    history = run.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    keras_history = reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert_trains_as_keras(model, reference, history, keras_history)


def test_what_keras_would_read_otherwise_is_refused_before_launch():
    model, _ = small_model_pair(lambda: keras.optimizers.SGD(0.1))
    run = two_worker_run(model)

    def finite():
        for _ in range(3):
            yield np.ones((4, 4)), np.ones((4,))

    with pytest.raises(AutodistError, match="epochs=2 and no steps_per_epoch"):
        run.fit(finite(), epochs=2, verbose=0)
    with pytest.raises(AutodistError, match="pass neither y nor sample_weight"):
        run.fit(Examples(0), np.ones(50), verbose=0)
    with pytest.raises(AutodistError, match="defines on_epoch_end"):
        run.fit(Examples(0), epochs=2, steps_per_epoch=3, verbose=0)
    assert run.last_job_dir is None   # nothing launched
