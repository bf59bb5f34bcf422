"""fit(callbacks=...): Keras' hooks and logs in the driver; stop_training stops every worker.

Each run is compared with single-device Keras: the same callbacks on Keras
`fit` must see the same hooks, and the trained weights must agree to 2e-5
(float32 sums in a different order) after the same number of steps.
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
EXAMPLES = 90
BATCH = 32  # 3 steps per epoch, the last one short (26 examples)


class Recorder(keras.callbacks.Callback):
    """Records every hook with its arguments and logs."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple] = []

    def on_train_begin(self, logs=None):
        self.events.append(("train_begin", None, logs))

    def on_epoch_begin(self, epoch, logs=None):
        self.events.append(("epoch_begin", epoch, logs))

    def on_train_batch_begin(self, batch, logs=None):
        self.events.append(("batch_begin", batch, logs))

    def on_train_batch_end(self, batch, logs=None):
        self.events.append(("batch_end", batch, dict(logs)))

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(("epoch_end", epoch, dict(logs)))

    def on_train_end(self, logs=None):
        self.events.append(("train_end", None, dict(logs or {})))


class StopAfterBatches(keras.callbacks.Callback):
    """Sets stop_training once `count` batches have ended (over the whole run)."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count
        self.seen = 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen >= self.count:
            self.model.stop_training = True


def _setup():
    model = models.mlp(input_dim=20, hidden=(16,),
                       optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, 20)).astype("float32")
    y = rng.integers(0, 10, EXAMPLES).astype("int32")
    return model, x, y


def _names(events):
    return [(hook, index) for hook, index, _ in events]


def test_hooks_logs_and_early_stopping_match_keras(tmp_path):
    """EarlyStopping in on_epoch_end stops exactly at that epoch's end, as in Keras."""
    model, x, y = _setup()
    reference = models.single_device_twin(model)
    keras_recorder = Recorder()
    # min_delta so large that epoch 1 is no improvement: stop after 2 of 6 epochs.
    keras_history = reference.fit(
        x, y, batch_size=BATCH, epochs=6, shuffle=False, verbose=0,
        callbacks=[keras_recorder, keras.callbacks.EarlyStopping(monitor="loss", min_delta=100,
                                                                 patience=1)])
    assert len(keras_history.history["loss"]) == 2

    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    graph_item = autodist.capture(model)
    strategy = builders.PS().build(graph_item, spec)
    recorder = Recorder()
    history = autodist.distribute(model, strategy, spec, graph_item=graph_item).fit(
        x, y, batch_size=BATCH, epochs=6, verbose=0,
        callbacks=[recorder, keras.callbacks.EarlyStopping(monitor="loss", min_delta=100,
                                                           patience=1)], shuffle=False)

    assert recorder.model is model
    assert recorder.params == {"epochs": 6, "steps": 3, "verbose": 0}
    assert _names(recorder.events) == _names(keras_recorder.events)
    assert len(history.step_losses) == 6 and len(history.history["loss"]) == 2
    # Logs: batch ends hold the running mean of the epoch, weighted by batch size.
    sizes = [32, 32, 26]
    batch_logs = [logs["loss"] for hook, _, logs in recorder.events if hook == "batch_end"]
    for epoch in range(2):
        losses = history.step_losses[epoch * 3:(epoch + 1) * 3]
        running = np.cumsum(np.multiply(losses, sizes)) / np.cumsum(sizes)
        np.testing.assert_allclose(batch_logs[epoch * 3:(epoch + 1) * 3], running, rtol=1e-6)
    epoch_logs = [logs["loss"] for hook, _, logs in recorder.events if hook == "epoch_end"]
    np.testing.assert_allclose(epoch_logs, history.history["loss"], rtol=1e-6)
    np.testing.assert_allclose(history.history["loss"], keras_history.history["loss"], rtol=1e-4)
    keras_batch_logs = [logs["loss"] for hook, _, logs in keras_recorder.events
                        if hook == "batch_end"]
    np.testing.assert_allclose(batch_logs, keras_batch_logs, rtol=1e-4)
    assert recorder.events[-1][2] == {"loss": history.history["loss"][-1]}
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


def test_stop_training_inside_an_epoch_stops_every_worker(tmp_path):
    """A stop request mid-epoch ends the run at a step boundary on all workers; the
    weights equal Keras after the same number of steps."""
    model, x, y = _setup()
    reference = models.single_device_twin(model)
    spec = autodist.ResourceSpec.local(workers=2)
    graph_item = autodist.capture(model)
    strategy = builders.AllReduce().build(graph_item, spec)
    recorder = Recorder()
    batch, steps, epochs = 8, 12, 10  # 12 steps per epoch, the last one of 2 examples
    history = autodist.distribute(model, strategy, spec, graph_item=graph_item,
                                  job_dir=str(tmp_path / "job")).fit(
        x, y, batch_size=batch, epochs=epochs, verbose=0,
        callbacks=[StopAfterBatches(3), recorder], shuffle=False)

    done = len(history.step_losses)
    assert 3 <= done < epochs * steps, done
    ends = [index for hook, index, _ in recorder.events if hook == "batch_end"]
    assert ends == [step % steps for step in range(done)]
    assert _names(recorder.events)[-2:] == [("epoch_end", (done - 1) // steps),
                                            ("train_end", None)]
    assert len(history.history["loss"]) == -(-done // steps)
    for step in range(done):  # Keras, one batch at a time over the same batches
        rows = slice((step % steps) * batch, (step % steps + 1) * batch)
        reference.train_on_batch(x[rows], y[rows])
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


def _keras_after_steps(model, x, y, batch: int, max_steps: int) -> list[list[np.ndarray]]:
    """Single-device Keras weights after 0, 1, ..., max_steps steps over the same batches,
    from `model`'s current weights."""
    reference = models.single_device_twin(model)
    steps = -(-len(x) // batch)
    out = [reference.get_weights()]
    for step in range(max_steps):
        rows = slice((step % steps) * batch, (step % steps + 1) * batch)
        reference.train_on_batch(x[rows], y[rows])
        out.append(reference.get_weights())
    return out


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.allclose(u, v, rtol=0, atol=TOLERANCE) for u, v in zip(a, b))


def test_callbacks_see_each_epochs_weights_as_in_keras(tmp_path):
    """ModelCheckpoint saves every epoch's trained weights, and EarlyStopping with
    restore_best_weights puts the best epoch's back, exactly as with Keras `fit`."""
    model, x, y = _setup()
    reference = models.single_device_twin(model)

    def callbacks(where):
        # mode="max": the first epoch (highest loss) is "best", so the run stops after
        # the second and must restore the first epoch's weights.
        return [keras.callbacks.ModelCheckpoint(str(where / "w-{epoch}.weights.h5"),
                                                save_weights_only=True),
                keras.callbacks.EarlyStopping(monitor="loss", mode="max", patience=1,
                                              restore_best_weights=True)]

    (tmp_path / "keras").mkdir()
    (tmp_path / "autodist").mkdir()
    keras_history = reference.fit(x, y, batch_size=BATCH, epochs=5, shuffle=False, verbose=0,
                                  callbacks=callbacks(tmp_path / "keras"))
    assert len(keras_history.history["loss"]) == 2
    spec = autodist.ResourceSpec.local(workers=2)
    graph_item = autodist.capture(model)
    strategy = builders.AllReduce().build(graph_item, spec)
    history = autodist.distribute(model, strategy, spec, graph_item=graph_item).fit(
        x, y, batch_size=BATCH, epochs=5, verbose=0, callbacks=callbacks(tmp_path / "autodist"),
        shuffle=False)

    assert len(history.history["loss"]) == 2 and model.history is history
    for epoch in (1, 2):
        saved = models.single_device_twin(model)
        saved.load_weights(str(tmp_path / "autodist" / f"w-{epoch}.weights.h5"))
        want = models.single_device_twin(model)
        want.load_weights(str(tmp_path / "keras" / f"w-{epoch}.weights.h5"))
        assert _same(saved.get_weights(), want.get_weights()), epoch
    assert _same(model.get_weights(), reference.get_weights())  # epoch 1's, restored


def test_validation_and_initial_epoch_match_keras(capsys):
    """validation_split / validation_data give Keras' val_* logs; initial_epoch numbers
    the epochs as Keras does; verbose=1 prints Keras' own per-epoch progress."""
    model, x, y = _setup()
    reference = models.single_device_twin(model)
    keras_history = reference.fit(x, y, batch_size=BATCH, epochs=3, initial_epoch=1,
                                  validation_split=0.25, shuffle=False, verbose=0)
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    graph_item = autodist.capture(model)
    strategy = builders.PS().build(graph_item, spec)
    run = autodist.distribute(model, strategy, spec, graph_item=graph_item)
    capsys.readouterr()
    history = run.fit(x, y, batch_size=BATCH, epochs=3, initial_epoch=1, validation_split=0.25,
                      verbose=1, shuffle=False)
    printed = capsys.readouterr().out
    assert "Epoch 2/3" in printed and "Epoch 3/3" in printed and "Epoch 1/3" not in printed
    assert history.epoch == keras_history.epoch == [1, 2]
    assert sorted(history.history) == sorted(keras_history.history) == ["loss", "val_loss"]
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(history.history[key], keras_history.history[key], rtol=1e-4)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)

    # validation_data every second epoch, seen by a callback's on_epoch_end.
    recorder = Recorder()
    val = (x[:30], y[:30])
    history = run.fit(x, y, batch_size=BATCH, epochs=2, validation_data=val, validation_freq=2,
                      verbose=0, callbacks=[recorder], shuffle=False)
    logs = [logs for hook, _, logs in recorder.events if hook == "epoch_end"]
    assert "val_loss" not in logs[0] and "val_loss" in logs[1]
    expected = models.single_device_twin(model)
    expected.set_weights(model.get_weights())
    np.testing.assert_allclose(logs[1]["val_loss"], expected.evaluate(*val, verbose=0),
                               rtol=1e-5)


class InterruptAfter(keras.callbacks.Callback):
    """Raises KeyboardInterrupt (as Ctrl-C would) once `count` batches have ended."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count
        self.seen = 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.count:
            raise KeyboardInterrupt


class InterruptAtEpochEnd(keras.callbacks.Callback):
    """Raises KeyboardInterrupt in the first on_epoch_end: the chief waits at the
    epoch's end for a decision the driver never writes."""

    def on_epoch_end(self, epoch, logs=None):
        raise KeyboardInterrupt


@pytest.mark.parametrize("followed", ["batch", "epoch_end", False],
                         ids=["callbacks", "at_epoch_end", "plain"])
def test_ctrl_c_keeps_the_weights_so_far_and_the_data_is_removed(followed, monkeypatch):
    """Ctrl-C: as in Keras the model keeps the weights trained so far (those after
    some step the chief completed) and the interrupt goes on; the temporary job
    directory keeps no copy of the data."""
    model, x, y = _setup()
    batch, epochs = 8, 20
    spec = autodist.ResourceSpec.local(workers=2)
    graph_item = autodist.capture(model)
    strategy = builders.AllReduce().build(graph_item, spec)
    run = autodist.distribute(model, strategy, spec, graph_item=graph_item)
    initial = model.get_weights()
    candidates = _keras_after_steps(model, x, y, batch, 12 * epochs)
    if followed:
        callback = InterruptAfter(4) if followed == "batch" else InterruptAtEpochEnd()
        with pytest.raises(KeyboardInterrupt):
            run.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, callbacks=[callback],
                    shuffle=False)
    else:
        # No callbacks: the interrupt arrives while the driver polls the cluster.
        from autodist.runtime import progress as progress_module

        original = progress_module.Progress.update

        def interrupting(self):
            original(self)
            if self.seen >= 4:
                raise KeyboardInterrupt

        monkeypatch.setattr(progress_module.Progress, "update", interrupting)
        with pytest.raises(KeyboardInterrupt):
            run.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, shuffle=False)
    trained = model.get_weights()
    assert not _same(trained, initial)
    assert any(_same(trained, c) for c in candidates[4:]), "not Keras' weights after any step"
    leftover = run.last_job_dir
    assert not (leftover / "data").exists() and not (leftover / "init.npz").exists()
