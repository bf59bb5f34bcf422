"""The driver's side of a followed fit, fed records by hand (no cluster).

The cluster tests (`test_callbacks.py`) cover the same paths end to end, but
whether the chief stops before or at an epoch's end depends on timing there;
here each order is played out deterministically.
"""
import time

import keras
import numpy as np
import pytest

from autodist.launch.job import JobDir
from autodist.runtime import follow
from autodist.runtime.history import History
from autodist.runtime.progress import Progress
from autodist.runtime.records import EpochDecision, ProgressRecord

STEPS = 4


class StopAfterBatch(keras.callbacks.Callback):
    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch = batch
        self.events: list[tuple[str, int]] = []

    def on_train_batch_end(self, batch, logs=None):
        self.events.append(("batch_end", batch))
        if batch == self.batch:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(("epoch_end", epoch))


def _progress(tmp_path, callback) -> tuple[Progress, JobDir, list]:
    job = JobDir(tmp_path)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    loaded = []
    progress = Progress(job, epochs=3, steps_per_epoch=STEPS, verbose=0, model=model,
                        callbacks=[callback], history=History(), followed=True,
                        epoch_weights=True, wait_s=0.5,
                        load_weights=lambda w: loaded.append({k: w[k] for k in w.files}))
    return progress, job, loaded


def _write_records(job: JobDir, steps: range) -> None:
    with open(job.file("progress.jsonl"), "a") as f:
        for step in steps:
            f.write(ProgressRecord(step=step, epoch=step // STEPS, epoch_step=step % STEPS,
                                   loss=1.0, seconds=0.01, examples=8,
                                   last_of_epoch=step % STEPS == STEPS - 1,
                                   workers=2).to_json())


@pytest.mark.parametrize("weights_sent", [False, True])
def test_an_epoch_ending_after_a_stop_request_waits_for_the_final_weights(tmp_path,
                                                                          weights_sent):
    """The chief stops at the first step boundary after the request. When that is the
    epoch's end, it may or may not have sent the epoch's weights (it sends them only
    if it reached the end before reading the request): either way the driver ends
    the epoch with the run's final weights, without waiting."""
    callback = StopAfterBatch(1)
    progress, job, loaded = _progress(tmp_path, callback)
    progress.begin()
    _write_records(job, range(0, 2))
    progress.update()
    assert job.stop_request().exists()
    path = follow.epoch_weights_path(job, 0)
    if weights_sent:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, w=np.zeros(1))
    _write_records(job, range(2, STEPS))  # the workers ran the epoch out
    start = time.monotonic()
    progress.update()
    assert time.monotonic() - start < 0.4  # did not wait for the epoch's weights
    assert loaded == []
    assert ("epoch_end", 0) not in callback.events  # left for the final weights
    progress.finish_epochs()
    progress.finish()
    assert callback.events == [("batch_end", b) for b in range(STEPS)] + [("epoch_end", 0)]
    assert not path.exists()  # no trained weights left behind in the job


def test_an_epoch_end_without_a_stop_loads_that_epochs_weights(tmp_path):
    callback = StopAfterBatch(-1)
    progress, job, loaded = _progress(tmp_path, callback)
    progress.begin()
    path = follow.epoch_weights_path(job, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, w=np.ones(1))
    _write_records(job, range(0, STEPS))
    progress.update()
    assert [float(w["w"][0]) for w in loaded] == [1.0]
    assert callback.events[-1] == ("epoch_end", 0)
    decision = EpochDecision.from_json(job.epoch_decision(0).read_bytes())
    assert decision == EpochDecision(stop=False, learning_rate=None)
    assert not path.exists()


def test_missing_epoch_weights_are_a_bounded_error_naming_the_chiefs_log(tmp_path):
    progress, job, _ = _progress(tmp_path, StopAfterBatch(-1))
    progress.begin()
    _write_records(job, range(0, STEPS))
    with pytest.raises(follow.FollowError, match=r"after epoch 0 within 0.5s.*worker_0\.log"):
        progress.update()
