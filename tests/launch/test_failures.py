"""Failures are reported within bounded time, naming the task and its log; nothing hangs."""
from __future__ import annotations

import os
import signal
import socket
import time

import numpy as np
import pytest

import autodist
from autodist import models
from autodist.launch.job import JobDir
from autodist.runtime.run_config import RunConfig
from autodist.launch.errors import TaskFailedError
from autodist.launch.local import LocalCluster
from autodist.runtime.entry import TASK_MODULE

pytestmark = pytest.mark.cluster


def _long_job(tmp_path, spec, step_timeout_s=60.0) -> JobDir:
    model = models.mlp(input_dim=8, hidden=(8,))
    graph_item = autodist.capture(model)
    strategy = autodist.builders.AllReduce().build(graph_item, spec)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.integers(0, 10, 64).astype("int32")
    job = JobDir(tmp_path / "job")
    init = {n: v.numpy() for n, v in zip(graph_item.variable_names, model.trainable_variables)}
    job.write(graph_item, strategy, spec, RunConfig(global_batch_size=8, epochs=10_000,
                                                    step_timeout_s=step_timeout_s),
              init, [x], y)
    return job


def _wait_for_progress(job: JobDir, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    path = job.file("progress.jsonl")
    while not (path.exists() and path.read_text().count("\n") >= 3):
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.1)


def test_killed_worker_is_reported_quickly(tmp_path):
    spec = autodist.ResourceSpec.local(workers=2)
    job = _long_job(tmp_path, spec)
    with LocalCluster(job, spec, task_module=TASK_MODULE) as cluster:
        cluster.wait_ready(120)
        _wait_for_progress(job)
        victim = next(t for t in cluster.tasks if t.name == "worker:1")
        os.kill(victim.process.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TaskFailedError, match="task worker:1 exited with code -9") as err:
            cluster.wait_workers(timeout_s=120)
        assert time.monotonic() - start < 10
        assert err.value.task == "worker:1"
        assert err.value.log.endswith("worker_1.log")
        processes = [t.process for t in cluster.tasks]
    assert all(p.poll() is not None for p in processes)  # everything was stopped


def test_unresponsive_worker_times_out(tmp_path):
    spec = autodist.ResourceSpec.local(workers=2)
    job = _long_job(tmp_path, spec, step_timeout_s=5.0)
    with LocalCluster(job, spec, task_module=TASK_MODULE) as cluster:
        cluster.wait_ready(120)
        _wait_for_progress(job)
        victim = next(t for t in cluster.tasks if t.name == "worker:1")
        os.kill(victim.process.pid, signal.SIGSTOP)
        start = time.monotonic()
        try:
            with pytest.raises(TaskFailedError, match="task worker:0 exited with code 1") as err:
                cluster.wait_workers(timeout_s=120)
        finally:
            os.kill(victim.process.pid, signal.SIGCONT)
        assert time.monotonic() - start < 30
        assert "Deadline" in str(err.value) or "deadline" in str(err.value) or \
            "timed out" in str(err.value).lower()


def test_taken_port_is_reported(tmp_path):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        spec = autodist.ResourceSpec.from_dict({"nodes": [
            {"address": "localhost", "port": port, "chief": True}]})
        job = _long_job(tmp_path, spec)
        with LocalCluster(job, spec, task_module=TASK_MODULE, port_retries=0) as cluster:
            with pytest.raises(TaskFailedError, match="worker:0 found its port taken"):
                cluster.wait_ready(120)


def test_local_cluster_rejects_remote_addresses(tmp_path):
    spec = autodist.ResourceSpec.from_dict({"nodes": [{"address": "10.1.2.3", "chief": True}]})
    with pytest.raises(autodist.AutodistError, match="this machine only"):
        LocalCluster(JobDir(tmp_path), spec, task_module=TASK_MODULE)


def test_tasks_exit_when_the_launcher_dies(tmp_path):
    """A launcher killed outright (no cleanup) leaves no task running."""
    import subprocess
    import sys

    script = tmp_path / "launcher.py"
    script.write_text(f"""
import os, sys, time
import autodist
from autodist.launch.job import JobDir
from autodist.launch.local import LocalCluster
spec = autodist.ResourceSpec.local(workers=1, ps=1)
cluster = LocalCluster(JobDir({str(tmp_path / 'job')!r}), spec,
                       task_module='autodist.runtime.entry')
cluster.start()
print(" ".join(str(t.process.pid) for t in cluster.tasks), flush=True)
time.sleep(600)
""")
    spec = autodist.ResourceSpec.local(workers=1, ps=1)
    _long_job(tmp_path, spec)
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in launcher.stdout.readline().split()]
        assert len(pids) == 2
    finally:
        launcher.kill()
        launcher.wait(timeout=10)
    deadline = time.monotonic() + 30
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = [p for p in pids if _alive(p)]
    assert not alive, f"tasks {alive} outlived their launcher"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
