"""Pieces of a multi-host run that need no cluster: job archives and data shards,
TF_CONFIG task names, who may drive a remote cluster, and fit's argument checks."""
from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest

import autodist
from autodist.ir.errors import AutodistError, ResourceSpecError
from autodist.runtime import batching
from autodist.launch import tf_config
from autodist.launch.job import JobDir
from autodist.runtime.run_config import RunConfig
from autodist.runtime.run import DistributedRun


def _job(tmp_path, mlp_item, spec) -> tuple[JobDir, np.ndarray, np.ndarray]:
    strategy = autodist.builders.AllReduce().build(mlp_item, spec)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 784)).astype("float32")
    y = rng.integers(0, 10, 40).astype("int32")
    job = JobDir(tmp_path / "chief")
    job.write(mlp_item, strategy, spec, RunConfig(global_batch_size=8, job_id="j1"),
              {"dense_0/kernel": np.ones((784, 256), "float32")}, [x], y)
    job.write_ports([2222, 2223])
    return job, x, y


def test_archive_round_trip_with_a_data_shard(tmp_path, mlp_item):
    spec = autodist.ResourceSpec.local(workers=2)
    job, x, y = _job(tmp_path, mlp_item, spec)
    rows = np.array([1, 5, 6, 39])
    shipped = JobDir.unpack(job.pack(rows), tmp_path / "worker1")
    assert shipped.resource_spec() == spec and shipped.config() == job.config()
    assert shipped.ports() == [2222, 2223]
    assert shipped.graph_item().fingerprint == mlp_item.fingerprint
    np.testing.assert_array_equal(shipped.init_values()["dense_0/kernel"], 1.0)
    (xs,), ys = shipped.data()
    np.testing.assert_array_equal(xs, x[rows])
    np.testing.assert_array_equal(ys, y[rows])
    num_examples, held = shipped.shard()
    assert num_examples == 40
    np.testing.assert_array_equal(held, rows)
    assert job.shard() == (40, None)

    ps = JobDir.unpack(job.pack(with_data=False), tmp_path / "ps0")
    assert ps.config() == job.config() and not (ps.path / "init.npz").exists()
    assert not list((ps.path / "data").iterdir())


def test_a_reused_job_directory_starts_clean(tmp_path, mlp_item):
    """Progress, decisions and results of an earlier fit must not leak into the next."""
    spec = autodist.ResourceSpec.local(workers=2)
    job, _, _ = _job(tmp_path, mlp_item, spec)
    for path in (job.file("progress.jsonl"), job.stop_request(), job.epoch_decision(0),
                 job.result(1), job.file("final_weights.npz"), job.path / "data" / "x_1.npy"):
        path.write_text("old")
    job, _, _ = _job(tmp_path, mlp_item, spec)
    assert sorted(p.name for p in job.path.rglob("*") if p.is_file()) == [
        "cluster.json", "graph_item.pb", "init.npz", "resource_spec.pb", "run.json",
        "strategy.pb", "x_0.npy", "y.npy"]


@pytest.mark.parametrize("name", ["../evil", "/etc/passwd", "data/../../x", "extra.txt"])
def test_unpack_refuses_unexpected_members(tmp_path, name):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ValueError, match="unexpected member"):
        JobDir.unpack(buffer.getvalue(), tmp_path / "job")


def _rows_read(num_examples, batch, epochs, shuffle, seed, virtual_nodes, vns, steps=None):
    schedule = batching.EpochSchedule(num_examples, epochs, steps, lambda step: batch)
    return batching.rows_read(schedule, batching.ArrayOrder(num_examples, shuffle, seed), vns,
                              virtual_nodes)


def test_rows_read_are_what_the_virtual_nodes_feed():
    # 10 examples, batch 4 (4, 4, 2), 2 virtual nodes: node 1 reads rows 2-3, 6-7, 9.
    np.testing.assert_array_equal(_rows_read(10, 4, 2, False, 0, [1], 2), [2, 3, 6, 7, 9])
    np.testing.assert_array_equal(_rows_read(10, 4, 1, False, 0, [0, 1], 2), np.arange(10))
    shuffled = _rows_read(10, 4, 3, True, 7, [0], 2)
    expected = set()
    for epoch in range(3):
        order = batching.epoch_order(10, epoch, True, 7)
        for step in range(3):
            expected |= set(batching.virtual_node_rows(batching.batch_rows(order, step, 4), 2)[0])
    assert list(shuffled) == sorted(expected)
    # steps_per_epoch=2 over 3 epochs: batches 0-1, then 2, then a new pass's 0-1.
    cut = _rows_read(10, 4, 3, True, 7, [0], 2, steps=2)
    first, second = batching.epoch_order(10, 0, True, 7), batching.epoch_order(10, 1, True, 7)
    expected = set()
    for order, step in ((first, 0), (first, 1), (first, 2), (second, 0), (second, 1)):
        expected |= set(batching.virtual_node_rows(batching.batch_rows(order, step, 4), 2)[0])
    assert list(cut) == sorted(expected)


def test_tf_config_task_names_map_to_spec_tasks():
    cluster = {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "ps": ["p:1"]}

    def task(kind, index):
        return tf_config.task_from_tf_config({"cluster": cluster,
                                           "task": {"type": kind, "index": index}})[1]

    assert task("chief", 0) == ("worker", 0)
    assert task("worker", 0) == ("worker", 1)  # the chief is worker task 0 in the spec
    assert task("worker", 1) == ("worker", 2)
    assert task("ps", 0) == ("ps", 0)
    spec, own = tf_config.task_from_tf_config(json.dumps({"cluster": {"worker": ["a:1", "b:1"]},
                                                       "task": {"type": "worker", "index": 1}}))
    assert own == ("worker", 1) and spec.cluster_def() == {"worker": ["a:1", "b:1"]}
    with pytest.raises(ResourceSpecError, match="must name this process's task"):
        tf_config.task_from_tf_config({"cluster": cluster, "task": {"type": "ps", "index": 1}})
    with pytest.raises(ResourceSpecError, match="must name this process's task"):
        tf_config.task_from_tf_config({"cluster": cluster})
    with pytest.raises(ResourceSpecError, match="must name this process's task"):
        tf_config.task_from_tf_config({"cluster": cluster,
                                       "task": {"type": "worker", "index": True}})


def test_only_the_chief_drives_a_remote_cluster(monkeypatch, mlp_item):
    cluster = {"worker": ["a:1", "b:1"]}
    spec = tf_config.task_from_tf_config({"cluster": cluster, "task": {"type": "worker",
                                                                    "index": 0}})[0]
    strategy = autodist.builders.AllReduce().build(mlp_item, spec)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster,
                                                "task": {"type": "worker", "index": 1}}))
    with pytest.raises(AutodistError, match="task worker:1 of its TF_CONFIG, not the chief"):
        DistributedRun(None, strategy, spec, graph_item=mlp_item, launch="remote")
    with pytest.raises(AutodistError, match="launch must be one of"):
        DistributedRun(None, strategy, spec, graph_item=mlp_item, launch="ssh")
    with pytest.raises(AutodistError, match="node 0 has address 'a'.*use launch='remote'"):
        DistributedRun(None, strategy, spec, graph_item=mlp_item)


def test_callbacks_must_be_keras_callbacks(mlp_item):
    spec = autodist.ResourceSpec.local(workers=1)
    strategy = autodist.builders.AllReduce().build(mlp_item, spec)
    run = DistributedRun(None, strategy, spec, graph_item=mlp_item)
    with pytest.raises(AutodistError, match="callbacks must be keras.callbacks.Callback objects. "
                                            "Received: 'print'"):
        run.fit(np.zeros((4, 784), "float32"), np.zeros(4, "int32"), callbacks=["print"],
                shuffle=False)


def test_a_dataset_job_ships_the_dataset_not_rows(tmp_path, mlp_item):
    """A fit(dataset) job holds the dataset's graph and description, no arrays; every
    worker is shipped both whole (it reads every element), a PS neither."""
    from autodist.launch.job import DatasetFiles
    from autodist.runtime.cluster_jobs import rows_read_by as _rows_read_by

    spec = autodist.ResourceSpec.local(workers=2)
    strategy = autodist.builders.AllReduce().build(mlp_item, spec)
    job = JobDir(tmp_path / "chief")
    job.write(mlp_item, strategy, spec, RunConfig(global_batch_size=8, job_id="j2"),
              {}, [], None, DatasetFiles(b"graph-bytes", b'{"d": 1}'))
    job.write_ports([2222, 2223])
    assert sorted(p.name for p in (job.path / "data").iterdir()) == ["dataset.json",
                                                                     "dataset.pb"]
    assert _rows_read_by(job, 1) is None
    shipped = JobDir.unpack(job.pack(_rows_read_by(job, 1)), tmp_path / "worker1")
    assert shipped.dataset() == DatasetFiles(b"graph-bytes", b'{"d": 1}')
    with pytest.raises(ValueError, match="ships the dataset, not rows"):
        job.pack(np.array([0, 1]))
    ps = JobDir.unpack(job.pack(with_data=False), tmp_path / "ps0")
    assert ps.dataset() is None and not list((ps.path / "data").iterdir())
