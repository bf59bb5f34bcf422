"""`compile(steps_per_execution=k)`: fit's callbacks, History and weights as Keras' `fit`.

Keras 3 (TensorFlow backend) runs k batches per call of its train function: each
step is the same, so the numbers do not depend on k, but `on_train_batch_begin`
sees only the first batch of each group of k (0, k, 2k, ...) and
`on_train_batch_end` the group's last index (k - 1, 2k - 1, ..., also where the
epoch's last group is short), with the logs after the group's last batch. A
`steps_per_epoch` that k does not divide runs whole groups: ceil(spe / k) * k
steps an epoch, as far as the data goes. The validation pass is Keras'
`evaluate` in the driver, on the model compiled with k.

The run is on a real 2-worker cluster and is compared with single-device Keras
`fit` on the same data: weights to 2e-5, History and callback logs to 1e-5.
"""
from __future__ import annotations

import numpy as np
import pytest

import keras
import autodist
from autodist.runtime import steps_per_execution
from autodist.search import builders
from tests.keras_equal import assert_trains_as_keras, small_model_pair



class Recorder(keras.callbacks.Callback):
    """Records the hooks a fit calls, with their indices and logs."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.events.append(("epoch_begin", epoch, {}))

    def on_train_batch_begin(self, batch, logs=None):
        self.events.append(("batch_begin", batch, {}))

    def on_train_batch_end(self, batch, logs=None):
        self.events.append(("batch_end", batch, dict(logs or {})))

    def on_test_batch_end(self, batch, logs=None):
        self.events.append(("test_batch_end", batch, {}))

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(("epoch_end", epoch, dict(logs or {})))



def _assert_same_events(got: list[tuple], want: list[tuple]) -> None:
    assert [e[:2] for e in got] == [e[:2] for e in want]
    for (hook, index, logs), (_, _, expected) in zip(got, want):
        assert sorted(logs) == sorted(expected), (hook, index)
        for key, value in expected.items():
            np.testing.assert_allclose(logs[key], value, rtol=1e-5, atol=1e-7,
                                       err_msg=f"{hook} {index} {key}")


def test_group_hooks_of_keras():
    """The hooks of each step of an epoch, as Keras calls them for k steps a call."""
    hooks = steps_per_execution.batch_hooks
    assert [hooks(step, 1, last=step == 2) for step in range(3)] == \
        [(0, 0), (1, 1), (2, 2)]
    # 5 steps, k=2: groups (0, 1), (2, 3), (4, [5]): the short last group ends at 5.
    assert [hooks(step, 2, last=step == 4) for step in range(5)] == \
        [(0, None), (None, 1), (2, None), (None, 3), (4, 5)]
    assert [hooks(step, 3, last=step == 3) for step in range(4)] == \
        [(0, None), (None, None), (None, 2), (3, 5)]
    assert steps_per_execution.steps_run(None, 4) is None
    assert [steps_per_execution.steps_run(s, 2) for s in (1, 2, 3, 4, 5)] == [2, 2, 4, 4, 6]
    assert steps_per_execution.steps_run(3, 1) == 3


@pytest.mark.cluster
def test_steps_per_execution_callbacks_history_and_weights_match_keras():
    """k=2 with 5 batches a pass and steps_per_epoch=3 (not a multiple of k): Keras runs
    epochs of 4 and 1 steps (a pass goes on across epochs); from initial_epoch=1, with
    validation. Same hooks (indices and logs), History, weights and update count."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(80, 4)), rng.normal(size=(80,))
    model, reference = small_model_pair(lambda: keras.optimizers.SGD(0.1, momentum=0.5),
                                        steps_per_execution=2)
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    item = autodist.capture(model)
    run = autodist.distribute(model, builders.PS().build(item, spec), spec, graph_item=item)
    kwargs = dict(batch_size=16, epochs=4, initial_epoch=1, steps_per_epoch=3,
                  validation_data=(x[:24], y[:24]), validation_batch_size=8, verbose=0)
    recorder, keras_recorder = Recorder(), Recorder()
    keras.utils.set_random_seed(7)
    history = run.fit(x, y, callbacks=[recorder], **kwargs)
    keras.utils.set_random_seed(7)
    with pytest.warns(UserWarning, match="ran out of data"):
        keras_history = reference.fit(x, y, callbacks=[keras_recorder], **kwargs)
    assert [len(e) for e in np.split(np.asarray(history.step_losses), [4, 5])] == [4, 1, 4]
    assert int(model.optimizer.iterations.numpy()) == \
        int(reference.optimizer.iterations.numpy()) == 9
    _assert_same_events(recorder.events, keras_recorder.events)
    assert_trains_as_keras(model, reference, history, keras_history)


def test_a_dataset_of_unknown_length_with_steps_per_epoch_is_refused():
    """Keras' fit then runs epochs without steps once the pass ends: refused before launch,
    naming steps_per_execution and what to do instead."""
    import tensorflow as tf

    model, _ = small_model_pair(lambda: keras.optimizers.SGD(0.1, momentum=0.5),
                                steps_per_execution=3)
    spec = autodist.ResourceSpec.local(workers=2)
    item = autodist.capture(model)
    run = autodist.distribute(model, builders.AllReduce().build(item, spec), spec,
                              graph_item=item)
    rng = np.random.default_rng(0)
    dataset = tf.data.Dataset.from_tensor_slices(
        (rng.normal(size=(40, 4)), rng.normal(size=(40,)))).filter(lambda x, y: True).batch(8)
    with pytest.raises(autodist.AutodistError,
                       match="length is unknown.*steps_per_execution=3.*assert_cardinality"):
        run.fit(dataset, steps_per_epoch=4, verbose=0)
