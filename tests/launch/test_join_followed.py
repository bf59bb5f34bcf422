"""A followed elastic run grows onto a host served after launch (`tests.emulated_hosts`).

As `test_join`, but the resizes are decided while the run goes: a callback
calls `run.resize(n)` (`fit(..., elastic=True, callbacks=[...])`), and the
run's task provider (`ServedHosts`, the default under launch="remote")
chooses the tasks. The chief's side runs in the test process (worker:0);
worker:1's `autodist serve --tf-config` runs on host0 from the start;
worker:2's slot is declared in TF_CONFIG, but its `autodist serve` starts on
host1 only after the job's first steps. The job (all-reduce, 4 virtual
nodes: the global batch stays 32) starts on workers 0 and 1 and nobody waits
for worker 2 at launch. At the first epoch's end the callback waits until
worker 2's slot answers and asks for 3 workers: the grow lands on worker 2
(the driver shipped it the job once its slot answered; it starts from the
chief's state). At the second epoch's end it asks for 2: worker 2, the last
to join, leaves. Where worker 2's slot is never served, the grow is refused
with the reason and the run ends on workers 0 and 1.
"""
from __future__ import annotations

import pathlib
import subprocess
import time

import keras
import numpy as np
import pytest

import autodist
from autodist import models
from autodist.adapt.task_providers import ServedHosts, TaskProviderError
from autodist.ir.addresses import accepts
from autodist.search import builders
from tests import emulated_hosts, small_mlp


pytestmark = pytest.mark.cluster

TOLERANCE = 2e-5
EXAMPLES, BATCH, EPOCHS = 96, 32, 3


class _GrowThenShrink(keras.callbacks.Callback):
    """After epoch 0: waits (bounded) for `address` to answer, then resize(3); after
    epoch 1: resize(2)."""

    def __init__(self, run, address: str, wait_s: float = 120.0) -> None:
        super().__init__()
        self.run, self.address, self.wait_s = run, address, wait_s
        self.asked: list[tuple[int, ...]] = []

    def on_epoch_end(self, epoch, logs=None) -> None:
        if epoch == 0:
            deadline = time.monotonic() + self.wait_s
            while not accepts(self.address) and time.monotonic() < deadline:
                time.sleep(0.1)
            self.asked.append(self.run.resize(3))
        elif epoch == 1:
            self.asked.append(self.run.resize(2))


def _remote_run(model, cluster: dict, tmp_path: pathlib.Path, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", emulated_hosts.tf_config(cluster, "worker", 0))
    spec = autodist.ResourceSpec.from_tf_config()
    graph_item = autodist.capture(model)
    strategy = builders.AllReduce().build(graph_item, spec).with_virtual_nodes(BATCH, 4)
    return autodist.distribute(model, strategy, spec, graph_item=graph_item, launch="remote",
                               job_dir=str(tmp_path / "chief"), step_timeout_s=20,
                               startup_timeout_s=60)


def _check_like_keras(model, history, expected, reference) -> None:
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=0,
                               atol=TOLERANCE)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


def test_a_followed_run_grows_onto_a_host_served_after_launch_and_shrinks_off_it(
        request, tmp_path, monkeypatch, secret_file):
    """Workers 0 and 1; worker 2's serve starts after step 2; a callback grows the run to
    3 (onto worker 2) from step 3 and shrinks it to 2 from step 6: weights and per-epoch
    losses equal single-device Keras."""
    hosts, cluster, first = emulated_hosts.late_slot_cluster(request, tmp_path)
    late: list[tuple[subprocess.Popen, pathlib.Path]] = []
    x, y = small_mlp.data(EXAMPLES)
    model = small_mlp.mlp()
    reference = models.single_device_twin(model)
    expected = reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)

    run = _remote_run(model, cluster, tmp_path, monkeypatch)
    assert isinstance(run.task_provider, ServedHosts)
    callback = _GrowThenShrink(run, cluster["worker"][2])

    starter = emulated_hosts.after_steps(tmp_path / "chief", 2, lambda: late.append(
        emulated_hosts.serve(hosts[1], tmp_path, cluster, "worker", 2)))
    history = run.fit(x, y, epochs=EPOCHS, verbose=0, shuffle=False, resize_at={0: [0, 1]},
                      elastic=True, callbacks=[callback])
    starter.join(timeout=5)

    assert callback.asked == [(0, 1, 2), (0, 1)]
    assert [(r.step, r.members) for r in history.resizes] == [(3, (0, 1, 2)), (6, (0, 1))]
    _check_like_keras(model, history, expected, reference)
    (joiner,) = late
    for process, log in (first, joiner):   # each served its one job and ended cleanly
        assert process.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert "received a job" in log.read_text()


class _TryToGrow(keras.callbacks.Callback):
    """After epoch 0: asks for 3 workers, keeping the refusal."""

    def __init__(self, run) -> None:
        super().__init__()
        self.run = run
        self.refusal: TaskProviderError | None = None

    def on_epoch_end(self, epoch, logs=None) -> None:
        if epoch == 0:
            try:
                self.run.resize(3)
            except TaskProviderError as e:
                self.refusal = e


def test_a_grow_onto_a_slot_never_served_is_refused_and_the_run_goes_on(
        request, tmp_path, monkeypatch, secret_file):
    """Worker 2's slot is never served: nobody waits for it at launch, resize(3) is refused
    naming its slot, and the run ends on workers 0 and 1, equal to single-device Keras."""
    hosts, cluster, first = emulated_hosts.late_slot_cluster(request, tmp_path)
    x, y = small_mlp.data(EXAMPLES)
    model = small_mlp.mlp()
    reference = models.single_device_twin(model)
    expected = reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    run = _remote_run(model, cluster, tmp_path, monkeypatch)
    callback = _TryToGrow(run)

    history = run.fit(x, y, epochs=EPOCHS, verbose=0, shuffle=False, resize_at={0: [0, 1]},
                      elastic=True, callbacks=[callback])

    assert callback.refusal is not None and cluster["worker"][2] in str(callback.refusal)
    assert history.resizes == []
    _check_like_keras(model, history, expected, reference)
    assert first[0].wait(timeout=60) == 0, first[1].read_text()[-3000:]
