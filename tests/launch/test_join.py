"""Tasks that join and leave a running job across emulated hosts (`tests.emulated_hosts`).

The chief's side runs in the test process (TF_CONFIG task worker:0, at the
bridge's address); worker:1's `autodist serve --tf-config` runs on host0 from
the start. Worker:2's slot is declared in TF_CONFIG, but nothing serves it at
launch: its `autodist serve` starts on host1 only after the job's first steps.
The job (all-reduce, 4 virtual nodes: the global batch stays 32) starts on
workers 0 and 1, grows onto worker 2 (the driver ships it the job once its
slot answers, and it starts from the chief's state), and later shrinks off
it: worker 2 is released, and its `autodist serve` (one job) ends.
"""
from __future__ import annotations

import pathlib
import subprocess
import time

import numpy as np
import pytest

import autodist
from autodist import models
from autodist.launch.errors import TaskFailedError
from autodist.search import builders
from tests import emulated_hosts, small_mlp

pytestmark = pytest.mark.cluster

TOLERANCE = 2e-5
EXAMPLES, BATCH, EPOCHS = 96, 32, 3


def _run(model, cluster: dict, tmp_path: pathlib.Path, monkeypatch, **timeouts):
    monkeypatch.setenv("TF_CONFIG", emulated_hosts.tf_config(cluster, "worker", 0))
    spec = autodist.ResourceSpec.from_tf_config()
    graph_item = autodist.capture(model)
    strategy = builders.AllReduce().build(graph_item, spec).with_virtual_nodes(BATCH, 4)
    return autodist.distribute(model, strategy, spec, graph_item=graph_item, launch="remote",
                               job_dir=str(tmp_path / "chief"), **timeouts)


def test_a_job_grows_onto_a_host_served_after_launch_and_shrinks_off_it(
        request, tmp_path, monkeypatch, secret_file):
    """Workers 0 and 1, then 0, 1 and 2 from step 3 (worker 2's serve started after step
    2), then 0 and 1 from step 6: weights and per-epoch losses equal single-device Keras."""
    hosts, cluster, first = emulated_hosts.late_slot_cluster(request, tmp_path)
    late: list[tuple[subprocess.Popen, pathlib.Path]] = []
    x, y = small_mlp.data(EXAMPLES)
    model = small_mlp.mlp()
    reference = models.single_device_twin(model)
    expected = reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    run = _run(model, cluster, tmp_path, monkeypatch, step_timeout_s=20,
               startup_timeout_s=60)

    starter = emulated_hosts.after_steps(tmp_path / "chief", 2, lambda: late.append(
        emulated_hosts.serve(hosts[1], tmp_path, cluster, "worker", 2)))
    history = run.fit(x, y, epochs=EPOCHS, verbose=0, shuffle=False,
                      resize_at={0: [0, 1], 3: [0, 1, 2], 6: [0, 1]})
    starter.join(timeout=5)

    assert [(r.step, r.members) for r in history.resizes] == [(3, (0, 1, 2)), (6, (0, 1))]
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=0,
                               atol=TOLERANCE)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    (joiner,) = late
    for process, log in (first, joiner):   # each served its one job and ended cleanly
        assert process.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert "received a job" in log.read_text()


def test_a_late_slot_never_served_fails_naming_it(request, tmp_path, monkeypatch,
                                                  secret_file):
    """The job grows onto worker 2 at step 3, but nothing ever serves its slot: fit fails
    within the bounds, naming the slot and its address."""
    hosts, cluster, first = emulated_hosts.late_slot_cluster(request, tmp_path)
    x, y = small_mlp.data(EXAMPLES)
    run = _run(small_mlp.mlp(), cluster, tmp_path, monkeypatch, step_timeout_s=4,
               startup_timeout_s=20)
    start = time.monotonic()
    with pytest.raises(TaskFailedError) as failure:
        run.fit(x, y, epochs=EPOCHS, verbose=0, shuffle=False,
                resize_at={0: [0, 1], 3: [0, 1, 2]})
    assert time.monotonic() - start < 90
    message = str(failure.value)
    assert "worker:2" in message and cluster["worker"][2] in message, message
    assert first[0].wait(timeout=60) is not None
