"""Recovery across emulated hosts (`fit(..., on_failure="continue")`, ``launch="remote"``).

The chief's side runs in the test process (TF_CONFIG task worker:0, at the
bridge's address); every other task is an `autodist serve --tf-config` on a
host of its own (`tests.emulated_hosts`), serving job after job (no
``--max-jobs``), so that the tasks still alive take the recovery job.

* A worker's host dies (its `autodist serve` and job process killed) mid-run:
  the survivors go on from the last completed step, B and V kept, and the
  trained weights equal single-device Keras (no lost update). Epochs wholly
  after the recovery have the workers' exact losses; the failed job's steps
  carry the chief's estimate (a served worker's per-step losses stay on its
  host), checked to 5%.
* The chief's process is killed: the job restarts from the newest checkpoint
  on the same served tasks, again to Keras' weights.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import autodist
from autodist import models
from autodist.search import builders
from tests import emulated_hosts, small_mlp

pytestmark = pytest.mark.cluster

TOLERANCE = 2e-5
EXAMPLES, BATCH, EPOCHS = 96, 32, 3
STEPS_PER_EPOCH = EXAMPLES // BATCH


WORKERS = (("worker", 1), ("worker", 2))


def _served(host, tmp_path, cluster, kind: str, index: int):
    """`autodist serve` of kind:index on `host`, serving job after job."""
    return emulated_hosts.serve(host, tmp_path, cluster, kind, index, None,
                                "--idle-timeout", "60")[0]


def _remote_run(request, tmp_path, monkeypatch, tasks=WORKERS, builder=None):
    """`tasks` served on a host each (default worker:1 and worker:2), the chief here;
    (model, run, hosts' serve processes, Keras' reference model and per-epoch losses,
    data, the hosts and the cluster)."""
    hosts = emulated_hosts.start(request, count=len(tasks))
    cluster = emulated_hosts.cluster_on(hosts, tasks)
    servers = [_served(host, tmp_path, cluster, kind, index)
               for host, (kind, index) in zip(hosts.hosts, tasks)]
    x, y = small_mlp.data(EXAMPLES)
    model = small_mlp.mlp()
    reference = models.single_device_twin(model)
    keras_losses = reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                                 verbose=0).history["loss"]
    monkeypatch.setenv("TF_CONFIG", emulated_hosts.tf_config(cluster, "worker", 0))
    spec = autodist.ResourceSpec.from_tf_config()
    graph_item = autodist.capture(model)
    builder = builder or builders.AllReduce()
    strategy = builder.build(graph_item, spec).with_virtual_nodes(BATCH, 4)
    run = autodist.distribute(model, strategy, spec, graph_item=graph_item, launch="remote",
                              job_dir=str(tmp_path / "chief"), step_timeout_s=10,
                              startup_timeout_s=40,
                              task_step_delay_s={t: 0.2 for t in range(spec.num_worker_tasks)})
    return model, run, servers, reference, keras_losses, (x, y), (hosts, cluster)


def _check(model, reference, history, keras_losses, exact_epochs) -> None:
    assert len(history.step_losses) == EPOCHS * STEPS_PER_EPOCH
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    for epoch, (got, want) in enumerate(zip(history.history["loss"], keras_losses)):
        if epoch in exact_epochs:
            assert got == pytest.approx(want, abs=TOLERANCE), epoch
        else:
            assert got == pytest.approx(want, rel=5e-2), epoch


def _exact_epochs(resumed_at: int) -> range:
    """The epochs wholly after a recovery that resumed at step `resumed_at`: their losses
    are the workers' own, exact."""
    return range(resumed_at // STEPS_PER_EPOCH + (resumed_at % STEPS_PER_EPOCH > 0), EPOCHS)


def _fit_losing_worker_2(run, servers, tmp_path, x, y, **fit):
    """Fits with on_failure="continue" while worker 2's host dies after 4 steps (its
    `autodist serve` and job killed); (History, its one recovery, checked to be worker
    2's, resumed at step 4-6)."""
    killer = emulated_hosts.after_steps(str(tmp_path / "chief"), 4,
                                        lambda: os.killpg(servers[1].pid, signal.SIGKILL))
    history = run.fit(x, y, epochs=EPOCHS, shuffle=False, verbose=0, on_failure="continue",
                      **fit)
    killer.join(timeout=5)
    (event,) = history.recoveries
    assert event.failed_task == 2 and 4 <= event.step <= 6, event
    return history, event


def test_a_dead_worker_host_loses_no_update(request, tmp_path, monkeypatch, secret_file):
    """Worker 2's host dies after 4 of 9 steps: the run goes on with workers 0 and 1 from
    the last completed step, to Keras' weights."""
    model, run, servers, reference, keras_losses, (x, y), _ = _remote_run(
        request, tmp_path, monkeypatch)
    history, event = _fit_losing_worker_2(run, servers, tmp_path, x, y)
    assert event.workers == 2, event
    _check(model, reference, history, keras_losses, _exact_epochs(event.step))
    assert servers[0].poll() is None  # worker 1's serve took the recovery job, and serves on


def test_a_killed_chief_restarts_from_the_newest_checkpoint(request, tmp_path, monkeypatch,
                                                            secret_file):
    """The chief's process is killed after a checkpoint (every 2 steps): the job starts
    again from it on the same served workers, to Keras' weights."""
    from autodist.bench.slowdown import find_task_pid

    model, run, servers, reference, keras_losses, (x, y), _ = _remote_run(
        request, tmp_path, monkeypatch)
    job_dir = str(tmp_path / "chief")
    checkpoints = tmp_path / "checkpoints"

    def kill_chief():
        deadline = time.monotonic() + 60
        while not (checkpoints / "latest").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(find_task_pid(job_dir, "worker", 0), signal.SIGKILL)

    killer = emulated_hosts.after_steps(job_dir, 3, kill_chief)
    history = run.fit(x, y, epochs=EPOCHS, shuffle=False, verbose=0, on_failure="continue",
                      checkpoint_dir=str(checkpoints), checkpoint_every_steps=2)
    killer.join(timeout=5)
    (event,) = history.recoveries
    assert event.failed_task == 0 and event.workers == 3, event
    assert event.step % 2 == 0 and 2 <= event.step <= 6, event
    _check(model, reference, history, keras_losses,
           _exact_epochs(event.step))
    assert all(server.poll() is None for server in servers)


def _kill_after_checkpoint(job_dir: str, checkpoints, kill) -> None:
    """Waits (bounded) for the run's first checkpoint, then runs `kill`."""
    deadline = time.monotonic() + 60
    while not (checkpoints / "latest").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    kill()


def test_a_dead_parameter_server_restarts_from_the_newest_checkpoint(
        request, tmp_path, monkeypatch, secret_file):
    """worker:1 and ps:0 served on two hosts. The PS's host dies after a checkpoint (its
    `autodist serve` and job killed: the variables it held are gone), and its serve is
    started again there (a restarted pod): the job starts again from the newest
    checkpoint on the same slots, to Keras' weights."""
    model, run, servers, reference, keras_losses, (x, y), (hosts, cluster) = _remote_run(
        request, tmp_path, monkeypatch, tasks=(("worker", 1), ("ps", 0)),
        builder=builders.PS())
    job_dir = str(tmp_path / "chief")
    checkpoints = tmp_path / "checkpoints"
    restarted = []

    def kill_ps():
        os.killpg(servers[1].pid, signal.SIGKILL)
        servers[1].wait(timeout=10)
        restarted.append(_served(hosts[1], tmp_path / "again", cluster, "ps", 0))

    (tmp_path / "again").mkdir()
    killer = emulated_hosts.after_steps(job_dir, 3, lambda: _kill_after_checkpoint(
        job_dir, checkpoints, kill_ps))
    history = run.fit(x, y, epochs=EPOCHS, shuffle=False, verbose=0, on_failure="continue",
                      checkpoint_dir=str(checkpoints), checkpoint_every_steps=2)
    killer.join(timeout=5)
    (event,) = history.recoveries
    assert event.workers == 2, event
    assert event.failed_job == "ps" and event.failed_task == 0 and "ps:0" in event.cause, event
    assert event.step % 2 == 0 and 2 <= event.step <= 6, event
    _check(model, reference, history, keras_losses,
           _exact_epochs(event.step))
    assert servers[0].poll() is None and restarted[0].poll() is None


def test_a_served_spare_takes_a_dead_workers_place(request, tmp_path, monkeypatch,
                                                   secret_file):
    """Workers 1, 2 and 3 served on three hosts; the run starts on workers 0-2, worker 3 a
    spare (resize_at[0]). Worker 2's host dies after 4 steps: the run goes on from the
    last completed step on workers 0, 1 and 3, to Keras' weights."""
    model, run, servers, reference, keras_losses, (x, y), _ = _remote_run(
        request, tmp_path, monkeypatch, tasks=WORKERS + (("worker", 3),))
    history, event = _fit_losing_worker_2(run, servers, tmp_path, x, y,
                                          resize_at={0: [0, 1, 2]})
    assert event.workers == 3, event
    _check(model, reference, history, keras_losses, _exact_epochs(event.step))
    assert "received a job" in (tmp_path / "host2-worker3" / "serve.log").read_text()
