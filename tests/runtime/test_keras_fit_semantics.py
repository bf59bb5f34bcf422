"""`fit` as Keras' `fit`: its shuffle default and order, epochs cut by steps_per_epoch, the
optimizer's state across fits, learning rates set by callbacks, a dataset with batch_size.

Each run is on a real 2-worker cluster and is compared with single-device Keras `fit`
on the same data: weights to 2e-5 and History to 1e-5 (float32 sums in another order).
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import keras
import autodist
from autodist.search import builders
from tests.keras_equal import assert_trains_as_keras, small_model_pair, two_worker_run

pytestmark = pytest.mark.cluster

TOLERANCE = 2e-5


def _data(n: int = 50):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)), rng.normal(size=(n,))   # float64 and 1-D, as users have







def test_shuffle_by_default_in_keras_order_and_epochs_cut_by_steps_per_epoch():
    """With Keras' seed set, fit shuffles by default in Keras' own order; with
    steps_per_epoch one pass goes on across epochs (4 batches: epochs of 3, 1, 3)."""
    x, y = _data()
    model, reference = small_model_pair(lambda: keras.optimizers.SGD(0.1))
    run = two_worker_run(model)
    keras.utils.set_random_seed(7)
    history = run.fit(x, y, batch_size=16, epochs=3, steps_per_epoch=3, verbose=0)
    keras.utils.set_random_seed(7)
    with pytest.warns(UserWarning, match="ran out of data"):
        keras_history = reference.fit(x, y, batch_size=16, epochs=3, steps_per_epoch=3,
                                      verbose=0)
    assert [len(e) for e in np.split(np.asarray(history.step_losses), [3, 4])] == [3, 1, 3]
    assert_trains_as_keras(model, reference, history, keras_history)


def test_a_second_fit_goes_on_with_the_optimizers_state_and_the_models_learning_rate():
    x, y = _data(48)
    model, reference = small_model_pair(lambda: keras.optimizers.Adam(0.05))
    run = two_worker_run(model, ps=1, builder=builders.PS)
    run.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 3
    for got, want in zip(model.optimizer.variables, reference.optimizer.variables):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=TOLERANCE)
    # As Keras: the rate set on the model between fits is the one the next fit uses.
    model.optimizer.learning_rate = 0.02
    reference.optimizer.learning_rate = 0.02
    history = run.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    keras_history = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 9
    assert_trains_as_keras(model, reference, history, keras_history)


def _callbacks():
    return [keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                              min_delta=10.0),
            keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.8
                                                  if epoch == 2 else rate)]


def test_learning_rates_set_by_callbacks_apply_from_the_next_epoch_on_a_dataset():
    """ReduceLROnPlateau (on_epoch_end) and LearningRateScheduler (on_epoch_begin) change
    the rate between epochs, as in Keras; a dataset's batch_size is ignored, as Keras does."""
    x, y = _data(48)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(12)
    model, reference = small_model_pair(lambda: keras.optimizers.SGD(0.1, momentum=0.5))
    run = two_worker_run(model)
    history = run.fit(dataset, batch_size=32, epochs=4, callbacks=_callbacks(), verbose=0)
    keras_history = reference.fit(dataset, batch_size=32, epochs=4, callbacks=_callbacks(),
                                  verbose=0)
    rates = keras_history.history["learning_rate"]
    assert len(set(np.round(rates, 6))) >= 3, rates
    assert float(model.optimizer.learning_rate.numpy()) == \
        float(reference.optimizer.learning_rate.numpy())
    assert_trains_as_keras(model, reference, history, keras_history)


def test_a_learning_rate_changed_inside_an_epoch_is_refused():
    x, y = _data(32)
    model, _ = small_model_pair(lambda: keras.optimizers.SGD(0.1))
    run = two_worker_run(model)
    halve = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: setattr(model.optimizer, "learning_rate", 0.05))
    with pytest.raises(autodist.AutodistError, match="in on_train_batch_end .*only between "
                                                     "epochs"):
        run.fit(x, y, batch_size=8, epochs=2, callbacks=[halve], verbose=0)


def test_initial_epoch_numbers_the_epochs_and_reads_the_data_from_the_start_as_keras():
    """fit(initial_epoch=2): a LearningRateScheduler by epoch sees epochs 2 and 3, and a
    shuffled repeated dataset (a fresh one each, read as Keras reads it from the fit's
    start) trains as Keras on parameter servers."""
    x, y = _data(48)
    schedule = [keras.callbacks.LearningRateScheduler(lambda epoch, rate: 0.1 / (1 + epoch))]

    def dataset():
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(48, seed=1).batch(16).repeat()

    model, reference = small_model_pair(lambda: keras.optimizers.SGD(0.1, momentum=0.5))
    run = two_worker_run(model, ps=1, builder=builders.PS)
    kwargs = dict(epochs=4, initial_epoch=2, steps_per_epoch=2, verbose=0, callbacks=schedule)
    history = run.fit(dataset(), **kwargs)
    keras_history = reference.fit(dataset(), **kwargs)
    assert history.epoch == keras_history.epoch == [2, 3]
    np.testing.assert_allclose(history.history["learning_rate"], [0.1 / 3, 0.1 / 4], rtol=1e-6)
    assert_trains_as_keras(model, reference, history, keras_history)


class WithAnUnusedWeight(keras.Model):
    """keras-io's deit: a subclass creates `pos_embedding` again, and the base class's
    (same path) stays tracked but unused: Keras trains the model and leaves it as it is."""

    def __init__(self) -> None:
        super().__init__(name="unused_weight")   # one name: a checkpoint restores into a twin
        self.pos = self.add_weight(shape=(1, 4), initializer="zeros", name="pos")
        self.dense = keras.layers.Dense(1)
        self.pos = self.add_weight(shape=(1, 4), initializer="ones", name="pos")

    def call(self, x):
        return self.dense(x + self.pos)


@pytest.mark.cluster
@pytest.mark.parametrize("ps", [0, 1], ids=["all-reduce", "PS"])
def test_a_trainable_variable_the_step_does_not_use_is_left_as_keras_leaves_it(ps, tmp_path):
    """The workers failed at the end reading the trained values of a variable no step
    reads ("Could not find variable autodist/vars/.../replica_0"): it has no storage. Its
    value at the start is in the final weights and the checkpoints."""
    from autodist.runtime import checkpoint

    def build():
        keras.utils.set_random_seed(1)
        model = WithAnUnusedWeight()
        model.compile(keras.optimizers.Adam(0.05), "mse")
        return model

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype("float32"), rng.normal(size=(32, 1))
    model, reference = build(), build()
    item = autodist.capture(model, x=x[:4], y=y[:4])
    assert sum(not v.handle_node for v in item.variables) == 1
    spec = autodist.ResourceSpec.local(workers=2, ps=ps)
    strategy = (builders.PS() if ps else builders.AllReduce()).build(item, spec)
    history = autodist.distribute(model, strategy, spec, graph_item=item).fit(
        x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
        checkpoint_dir=str(tmp_path), checkpoint_every_steps=1)
    keras_history = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert_trains_as_keras(model, reference, history, keras_history)
    restored = build()
    checkpoint.restore_keras_weights(restored, checkpoint.latest(str(tmp_path)))
    for got, want in zip(restored.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, want)
