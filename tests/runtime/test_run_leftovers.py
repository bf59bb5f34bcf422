"""What a refused or failed fit leaves behind, and a warning before an oversubscribed one
(no cluster: each refusal comes before any task starts)."""
from __future__ import annotations

import tempfile

import numpy as np
import pytest

import autodist
from autodist.ir.errors import AutodistError
from autodist.runtime import cluster_jobs
from autodist.runtime import run as run_module
from autodist.search import builders


def test_a_fit_refused_after_its_job_was_written_leaves_no_directory(tmp_path, monkeypatch,
                                                                     mlp_item):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model = autodist.models.mlp()
    spec = autodist.ResourceSpec.local(workers=2)
    run = autodist.distribute(model, builders.AllReduce().build(mlp_item, spec), spec,
                              graph_item=mlp_item)
    x, y = np.zeros((8, 784), "float32"), np.zeros(8, "int32")
    with pytest.raises(AutodistError, match="validation_data must be"):
        run.fit(x, y, batch_size=4, validation_data=[x], verbose=0)
    assert run.last_job_dir is not None and not run.last_job_dir.exists()
    assert list(tmp_path.glob("autodist-job-*")) == []


def test_a_failed_run_keeps_only_the_logs_its_error_names(tmp_path):
    job = tmp_path / "job"
    (job / "logs").mkdir(parents=True)
    (job / "data").mkdir()
    (job / "data" / "x_0.npy").write_bytes(b"rows")
    (job / "init.npz").write_bytes(b"values")
    (job / "logs" / "worker_0.log").write_text("Traceback ...")
    cluster_jobs.discard(job)
    assert sorted(p.name for p in job.iterdir()) == ["logs"]
    (job / "logs" / "worker_0.log").write_text("")
    cluster_jobs.discard(job)
    assert not job.exists()


def test_more_cpu_replicas_than_cores_is_said_before_launch(monkeypatch, mlp_item):
    monkeypatch.setattr(run_module.os, "cpu_count", lambda: 2)
    spec = autodist.ResourceSpec.local(workers=4)
    strategy = builders.AllReduce().build(mlp_item, spec)
    with pytest.warns(UserWarning, match="4 CPU replicas on this machine's 2 cores"):
        autodist.distribute(autodist.models.mlp(), strategy, spec, graph_item=mlp_item)
