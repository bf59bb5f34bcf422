"""Going on without a dead worker (`fit(..., on_failure="continue")`).

Worker 2 of 3 is killed (SIGKILL) after 4 of 9 steps. The job goes on from
the chief's state after the last completed step on the two survivors, with
the same global batch (4 virtual nodes remapped): no applied update is lost,
so the weights equal Keras `fit` with batch 32 within 2e-5 (observed 6e-8),
and the per-epoch losses equal Keras' (the workers' recorded losses; a step
the dead worker completed without recording its loss is the chief's estimate,
reported in the recovery event, and its epoch is checked to 5%).
"""
from __future__ import annotations

import os
import pathlib
import signal
import threading
import time

import numpy as np
import pytest

import keras
import autodist
from autodist import models
from autodist.ir.errors import AutodistError
from autodist.runtime import recovery
from autodist.search import builders
from tests import small_mlp

TOLERANCE = 2e-5
EXAMPLES, BATCH, EPOCHS = 96, 32, 3


def _kill_after(job_dir: str, task: int, steps: int, timeout_s: float = 120.0,
                sig: int = signal.SIGKILL) -> threading.Thread:
    """Sends `sig` (default SIGKILL) to worker `task` once the chief has recorded `steps`
    steps."""
    from autodist.bench.slowdown import find_task_pid

    def kill():
        progress = pathlib.Path(job_dir) / "progress.jsonl"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if progress.exists() and len(progress.read_text().splitlines()) >= steps:
                pid = find_task_pid(job_dir, "worker", task)
                if pid is not None:
                    os.kill(pid, sig)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def _kill_after_first_checkpoint(job_dir: str, checkpoints: pathlib.Path,
                                 job: str) -> threading.Thread:
    """SIGKILLs task `job`:0 once the run's first checkpoint is written (bounded wait)."""
    from autodist.bench.slowdown import find_task_pid

    def kill():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (checkpoints / "latest").exists():
                os.kill(find_task_pid(job_dir, job, 0), signal.SIGKILL)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


@pytest.mark.cluster
@pytest.mark.parametrize("builder,ps", [(builders.AllReduce(), 0), (builders.PS(), 1)],
                         ids=["AllReduce", "PS"])
def test_killed_worker_loses_no_update(builder, ps, tmp_path):
    x, y = small_mlp.data(EXAMPLES)
    reference = models.single_device_twin(small_mlp.mlp())
    keras_losses = reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                                 verbose=0).history["loss"]
    model = small_mlp.mlp()
    spec = autodist.ResourceSpec.local(workers=3, ps=ps)
    strategy = builder.build(autodist.capture(model), spec).with_virtual_nodes(BATCH, 4)
    job_dir = str(tmp_path / "job")
    # Slow steps so the kill lands mid-run; a PS chief learns of it at its step timeout.
    run = autodist.distribute(model, strategy, spec, job_dir=job_dir, step_timeout_s=10,
                              task_step_delay_s={0: 0.2, 1: 0.2, 2: 0.2})
    killer = _kill_after(job_dir, task=2, steps=4)
    history = run.fit(x, y, epochs=EPOCHS, shuffle=False, verbose=0, on_failure="continue")
    killer.join(timeout=5)
    assert len(history.recoveries) == 1
    (event,) = history.recoveries
    assert event.failed_task == 2 and event.workers == 2 and 4 <= event.step <= 6
    assert len(history.step_losses) == EPOCHS * EXAMPLES // BATCH
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    # The recorded losses are exact, except a step the dead worker completed but
    # died before recording: the chief's estimate (its replicas' mean) stands in.
    estimated_epochs = {k // (EXAMPLES // BATCH) for k in event.estimated_loss_steps}
    for epoch, (got, want) in enumerate(zip(history.history["loss"], keras_losses)):
        assert got == pytest.approx(want, rel=5e-2 if epoch in estimated_epochs else 1e-4)


@pytest.mark.cluster
def test_a_stopped_worker_is_named_killed_and_recovered_from(tmp_path):
    """Worker 2 of 3 is stopped (SIGSTOP: alive, silent) after 4 steps. Its heartbeat
    goes stale; the launcher names it, kills it, and the run recovers as from a killed
    worker, before any step times out, to Keras' weights."""
    x, y = small_mlp.data(EXAMPLES)
    reference = models.single_device_twin(small_mlp.mlp())
    reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    model = small_mlp.mlp()
    spec = autodist.ResourceSpec.local(workers=3)
    strategy = builders.AllReduce().build(autodist.capture(model), spec).with_virtual_nodes(
        BATCH, 4)
    job_dir = str(tmp_path / "job")
    # A step times out after 30 s; the stopped worker is named after 15 s of silence.
    run = autodist.distribute(model, strategy, spec, job_dir=job_dir, step_timeout_s=30,
                              task_step_delay_s={0: 0.2, 1: 0.2, 2: 0.2})
    stopper = _kill_after(job_dir, task=2, steps=4, sig=signal.SIGSTOP)
    started = time.monotonic()
    history = run.fit(x, y, epochs=EPOCHS, shuffle=False, verbose=0, on_failure="continue")
    stopper.join(timeout=5)
    (event,) = history.recoveries
    assert event.failed_task == 2 and event.workers == 2, event
    assert "stopped responding" in event.cause, event
    assert time.monotonic() - started < 120
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


@pytest.mark.cluster
def test_a_stopped_worker_fails_the_run_naming_it(tmp_path):
    """Without recovery, a stopped worker fails fit with an error that names it (not
    the chief, whose step would time out later), within the hang timeout."""
    from autodist.launch.errors import TaskFailedError

    x, y = small_mlp.data(EXAMPLES)
    model = small_mlp.mlp()
    spec = autodist.ResourceSpec.local(workers=2)
    strategy = builders.AllReduce().build(autodist.capture(model), spec)
    job_dir = str(tmp_path / "job")
    run = autodist.distribute(model, strategy, spec, job_dir=job_dir, step_timeout_s=30,
                              task_step_delay_s={0: 0.2, 1: 0.2})
    stopper = _kill_after(job_dir, task=1, steps=3, sig=signal.SIGSTOP)
    with pytest.raises(TaskFailedError, match=r"task worker:1 stopped responding") as raised:
        run.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    stopper.join(timeout=5)
    assert raised.value.task == "worker:1"


def _held_step(message: str) -> int:
    import re

    found = re.search(r"the model holds the weights after step (\d+) of the run", message)
    assert found, message
    return int(found.group(1))


@pytest.mark.cluster
@pytest.mark.parametrize("builder,ps", [(builders.AllReduce(), 0), (builders.PS(), 1)],
                         ids=["AllReduce", "PS"])
def test_a_failed_fit_keeps_the_last_completed_step(builder, ps, tmp_path):
    """Default on_failure: worker 1 killed mid-run fails fit naming it, and the model
    holds the weights (and momenta) after the last step every replica completed,
    equal to Keras fit on that many batches, as after Ctrl-C; not its initial ones."""
    from autodist.launch.errors import TaskFailedError

    x, y = small_mlp.data(EXAMPLES * 2)
    model = small_mlp.mlp()
    initial = [w.copy() for w in model.get_weights()]
    twin = models.single_device_twin(model)
    spec = autodist.ResourceSpec.local(workers=2, ps=ps)
    strategy = builder.build(autodist.capture(model), spec)
    job_dir = str(tmp_path / "job")
    run = autodist.distribute(model, strategy, spec, job_dir=job_dir, step_timeout_s=10,
                              task_step_delay_s={0: 0.2, 1: 0.2})
    killer = _kill_after(job_dir, task=1, steps=4)
    with pytest.raises(TaskFailedError, match="task worker:1 exited with code -9") as raised:
        run.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    killer.join(timeout=5)
    steps = _held_step(str(raised.value))
    assert 4 <= steps < EPOCHS * 2 * EXAMPLES // BATCH
    twin.fit(x[:steps * BATCH], y[:steps * BATCH], batch_size=BATCH, epochs=1, shuffle=False,
             verbose=0)
    for got, want, first in zip(model.get_weights(), twin.get_weights(), initial):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
        assert not np.allclose(got, first)
    assert int(model.optimizer.iterations.numpy()) == steps
    for got, want in zip(model.optimizer.variables, twin.optimizer.variables):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=TOLERANCE,
                                   err_msg=got.path)


@pytest.mark.cluster
def test_a_dead_parameter_server_leaves_the_newest_checkpoint(tmp_path):
    """The parameter server (which holds the variables) killed: the chief cannot read
    the trained state back; the newest checkpoint goes into the model, and the error
    says so."""
    from autodist.launch.errors import TaskFailedError
    from autodist.runtime import checkpoint

    x, y = small_mlp.data(EXAMPLES * 2)
    model = small_mlp.mlp()
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    strategy = builders.PS().build(autodist.capture(model), spec)
    job_dir, checkpoints = str(tmp_path / "job"), tmp_path / "checkpoints"
    run = autodist.distribute(model, strategy, spec, job_dir=job_dir, step_timeout_s=10,
                              task_step_delay_s={0: 0.2, 1: 0.2})

    killer = _kill_after_first_checkpoint(job_dir, checkpoints, "ps")
    with pytest.raises(TaskFailedError, match="ps:0") as raised:
        run.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                checkpoint_dir=str(checkpoints), checkpoint_every_steps=3)
    killer.join(timeout=5)
    assert "the model holds the newest checkpoint" in str(raised.value)
    saved = checkpoint.load(checkpoint.latest(checkpoints))
    got = dict(zip([v.path for v in model.trainable_variables], model.get_weights()))
    for name, value in got.items():
        np.testing.assert_array_equal(value, saved[name])


@pytest.mark.cluster
@pytest.mark.parametrize("job", ["ps", "worker"], ids=["parameter_server", "chief"])
def test_a_dead_chief_or_parameter_server_restarts_from_the_newest_checkpoint(job, tmp_path):
    """Local launch, synchronous PS on 2 workers, checkpoints every 2 steps: the
    parameter server (which held the variables) or the chief killed after the first
    checkpoint. With on_failure="continue" the job starts again on fresh processes from
    the newest checkpoint, to Keras' weights; the epochs wholly after it have Keras'
    losses."""

    x, y = small_mlp.data(EXAMPLES)
    model = small_mlp.mlp()
    reference = models.single_device_twin(model)
    keras_losses = reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                                 verbose=0).history["loss"]
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    strategy = builders.PS().build(autodist.capture(model), spec)
    job_dir, checkpoints = str(tmp_path / "job"), tmp_path / "checkpoints"
    run = autodist.distribute(model, strategy, spec, job_dir=job_dir, step_timeout_s=10,
                              task_step_delay_s={0: 0.2, 1: 0.2})

    killer = _kill_after_first_checkpoint(job_dir, checkpoints, job)
    history = run.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                      on_failure="continue", checkpoint_dir=str(checkpoints),
                      checkpoint_every_steps=2)
    killer.join(timeout=5)
    (event,) = history.recoveries
    assert (event.failed_job, event.failed_task, event.workers) == (job, 0, 2), event
    steps_per_epoch = EXAMPLES // BATCH
    assert event.step % 2 == 0 and 2 <= event.step < EPOCHS * steps_per_epoch, event
    assert len(history.step_losses) == EPOCHS * steps_per_epoch
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    first_exact = -(-event.step // steps_per_epoch)
    for epoch in range(first_exact, EPOCHS):
        assert history.history["loss"][epoch] == pytest.approx(keras_losses[epoch],
                                                               abs=TOLERANCE), epoch
    assert int(model.optimizer.iterations.numpy()) == EPOCHS * steps_per_epoch


@pytest.mark.cluster
def test_a_recovered_run_reads_a_dataset_on_where_it_stopped(tmp_path):
    """fit(dataset) (reshuffled each epoch) with worker 2 of 3 killed after 4 steps: the
    recovery job's workers read the dataset anew up to the step it resumes at, so the run
    trains on Keras' batches and its weights equal Keras fit's."""
    import tensorflow as tf

    x, y = small_mlp.data(EXAMPLES)

    def dataset():
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(EXAMPLES, seed=8).batch(BATCH)

    reference = models.single_device_twin(small_mlp.mlp())
    reference.fit(dataset(), epochs=EPOCHS, verbose=0, shuffle=False)
    model = small_mlp.mlp()
    spec = autodist.ResourceSpec.local(workers=3)
    strategy = builders.AllReduce().build(autodist.capture(model), spec).with_virtual_nodes(
        BATCH, 4)
    job_dir = str(tmp_path / "job")
    run = autodist.distribute(model, strategy, spec, job_dir=job_dir, step_timeout_s=10,
                              task_step_delay_s={0: 0.2, 1: 0.2, 2: 0.2})
    killer = _kill_after(job_dir, task=2, steps=4)
    history = run.fit(dataset(), epochs=EPOCHS, verbose=0, on_failure="continue", shuffle=False)
    killer.join(timeout=5)
    assert len(history.recoveries) == 1 and history.recoveries[0].failed_task == 2
    assert len(history.step_losses) == EPOCHS * EXAMPLES // BATCH
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


# ------------------------------------------------------------------ pieces
def test_dead_worker_names_a_non_chief_worker():
    assert recovery.dead_worker("worker:2") == 2
    assert recovery.dead_worker("worker:0") is None
    assert recovery.dead_worker("ps:0") is None


def test_strategy_and_spec_without_a_worker(mlp_item):
    spec = autodist.ResourceSpec.local(workers=3, ps=1)
    strategy = builders.PS().build(mlp_item, spec).with_virtual_nodes(48, 6)
    smaller = recovery.without_worker(spec, 1)
    assert smaller.num_worker_tasks == 2 and len(smaller.ps_devices) == 1
    remaining = recovery.strategy_without(strategy, 1)
    w0, w2 = "/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0"
    assert remaining.replicas == [w0, w2]
    assert remaining.virtual_node_devices == [w0] * 3 + [w2] * 3
    remaining.validate(mlp_item, smaller)


def test_strategy_without_the_worker_holding_variables(mlp_item):
    spec = autodist.ResourceSpec.local(workers=2)
    strategy = builders.PSLoadBalancing().build(mlp_item, spec)
    with pytest.raises(AutodistError, match="lived on the dead worker 1"):
        recovery.strategy_without(strategy, 1)


def test_fit_rejects_what_cannot_recover():
    model = small_mlp.mlp()
    x, y = small_mlp.data(EXAMPLES)
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    graph_item = autodist.capture(model)
    asynchronous = autodist.distribute(model, builders.PS(sync=False).build(graph_item, spec),
                                       spec, graph_item=graph_item)
    with pytest.raises(AutodistError, match="needs synchronous training"):
        asynchronous.fit(x, y, batch_size=BATCH, on_failure="continue", shuffle=False)
    run = autodist.distribute(model, builders.AllReduce().build(graph_item, spec), spec,
                              graph_item=graph_item)
    with pytest.raises(AutodistError, match="on_failure must be 'stop' or 'continue'. "
                                            "Received: 'retry'"):
        run.fit(x, y, batch_size=BATCH, on_failure="retry", shuffle=False)
    with pytest.raises(AutodistError, match="without callbacks, resize_at or switch_at"):
        run.fit(x, y, batch_size=BATCH, on_failure="continue",
                callbacks=[keras.callbacks.Callback()], shuffle=False)


def test_fit_rejects_a_mixed_strategy(ncf_item):
    model = models.embedding_model(num_users=1000, num_items=20011, dim=64)
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    run = autodist.distribute(model, builders.Parallax().build(ncf_item, spec), spec,
                              graph_item=ncf_item)
    x = [np.zeros((64, 1), "int32"), np.zeros((64, 1), "int32")]
    with pytest.raises(AutodistError, match="all parameter-server or all all-reduce"):
        run.fit(x, np.zeros((64, 1), "float32"), batch_size=BATCH, on_failure="continue",
                shuffle=False)
