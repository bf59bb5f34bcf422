"""Multi-host launch, on loopback: the TF operator convention.

Every task but the chief is an `autodist serve --tf-config` process with its
own TF_CONFIG and the cluster's secret (AUTODIST_SECRET_FILE), started in its
own empty directory and never told where the chief's job directory is: its
job arrives over TensorFlow, signed. The chief's side runs in the test
process (`launch="remote"`, TF_CONFIG task worker:0).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import keras
import autodist
from autodist import models
from autodist.launch import chunks, mailbox, signing
from autodist.launch.errors import TaskFailedError
from autodist.launch.job import JobDir
from autodist.runtime.run_config import RunConfig
from autodist.launch.local import free_ports
from autodist.launch.signing import SECRET_FILE_ENV, JobRejectedError
from autodist.search import builders
from tests.launch.conftest import SECRET

pytestmark = pytest.mark.cluster

TOLERANCE = 2e-5


def _tf_config(cluster: dict, kind: str, index: int) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})


def _serve(tmp_path, cluster: dict, kind: str, index: int, job_timeout: float,
           cpu_replicas: int = 1):
    home = tmp_path / f"{kind}{index}"
    home.mkdir()
    env = dict(os.environ, TF_CONFIG=_tf_config(cluster, kind, index))
    assert env[SECRET_FILE_ENV]  # see the fixture secret_file
    log = open(home / "serve.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "autodist.cli", "serve", "--tf-config", "--max-jobs", "1",
         "--job-timeout", str(job_timeout), "--work-dir", str(home / "jobs"),
         "--cpu-replicas-per-worker", str(cpu_replicas)],
        cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    return process, home / "serve.log"


class _CountBatches(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1


def test_tf_config_cluster_trains_like_keras(tmp_path, monkeypatch, secret_file):
    """2 workers + 1 PS from TF_CONFIG, Parallax (PS and all-reduce), with a callback."""
    ports = free_ports(3)
    cluster = {"worker": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"],
               "ps": [f"127.0.0.1:{ports[2]}"]}
    servers = [_serve(tmp_path, cluster, "worker", 1, 120), _serve(tmp_path, cluster, "ps", 0, 120)]
    try:
        model = models.embedding_model(num_users=50, num_items=71, dim=8, optimizer="adam")
        rng = np.random.default_rng(0)
        x = [rng.integers(0, 50, (90, 1)).astype("int32"),
             rng.integers(0, 71, (90, 1)).astype("int32")]
        y = rng.integers(0, 2, (90, 1)).astype("float32")
        reference = models.single_device_twin(model)
        reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)

        monkeypatch.setenv("TF_CONFIG", _tf_config(cluster, "worker", 0))
        spec = autodist.ResourceSpec.from_tf_config()
        graph_item = autodist.capture(model)
        strategy = builders.Parallax(min_shard_bytes=64).build(graph_item, spec)
        counter = _CountBatches()
        run = autodist.distribute(model, strategy, spec, graph_item=graph_item, launch="remote",
                                  job_dir=str(tmp_path / "chief"))
        history = run.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[counter],
                          shuffle=False)

        assert len(history.step_losses) == 6 and counter.batches == 6
        for got, want in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
        for process, log in servers:  # each served its one job and ended cleanly
            assert process.wait(timeout=60) == 0, log.read_text()[-3000:]
        worker_log = servers[0][1].read_text()
        assert "task worker:1 received a job" in worker_log and "task worker:1 done" in worker_log
    finally:
        for process, _ in servers:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)


def test_served_tasks_run_several_cpu_replicas(tmp_path, monkeypatch, secret_file):
    """2 workers x 2 CPU replicas + 1 PS from TF_CONFIG (`serve --cpu-replicas-per-worker 2`);
    Parallax with local copies of the embeddings, shared by each worker's replicas."""
    ports = free_ports(3)
    cluster = {"worker": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"],
               "ps": [f"127.0.0.1:{ports[2]}"]}
    servers = [_serve(tmp_path, cluster, "worker", 1, 120, cpu_replicas=2),
               _serve(tmp_path, cluster, "ps", 0, 120, cpu_replicas=2)]
    try:
        model = models.embedding_model(num_users=50, num_items=71, dim=8, optimizer="adam")
        rng = np.random.default_rng(0)
        x = [rng.integers(0, 50, (90, 1)).astype("int32"),
             rng.integers(0, 71, (90, 1)).astype("int32")]
        y = rng.integers(0, 2, (90, 1)).astype("float32")
        reference = models.single_device_twin(model)
        reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)

        monkeypatch.setenv("TF_CONFIG", _tf_config(cluster, "worker", 0))
        spec = autodist.ResourceSpec.from_tf_config(gpus_per_worker=0, cpu_replicas_per_worker=2)
        assert len(spec.replica_devices) == 4
        graph_item = autodist.capture(model)
        strategy = builders.Parallax(local_replication=True,
                                     min_shard_bytes=64).build(graph_item, spec)
        run = autodist.distribute(model, strategy, spec, graph_item=graph_item, launch="remote",
                                  job_dir=str(tmp_path / "chief"))
        history = run.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)

        assert len(history.step_losses) == 6
        for got, want in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
        for process, log in servers:
            assert process.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        for process, _ in servers:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)


def test_task_without_a_job_times_out_clearly(tmp_path, secret_file):
    ports = free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"]}
    process, log = _serve(tmp_path, cluster, "worker", 1, job_timeout=3)
    try:
        assert process.wait(timeout=60) == 1
    finally:
        if process.poll() is None:
            process.kill()
    assert (f"no job arrived for task worker:1 at 127.0.0.1:{ports[1]} within 3s"
            in log.read_text())


def test_chief_names_a_peer_that_is_not_up_and_aborts_the_others(tmp_path, monkeypatch,
                                                                   secret_file):
    """worker:1 serves, ps:0 never starts: fit fails naming ps:0's address within its
    startup bound, and tells worker:1 (which got its job) to stop at once."""
    ports = free_ports(3)
    cluster = {"worker": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"],
               "ps": [f"127.0.0.1:{ports[2]}"]}
    process, log = _serve(tmp_path, cluster, "worker", 1, job_timeout=120)
    try:
        deadline = time.monotonic() + 120
        while "serving at" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        monkeypatch.setenv("TF_CONFIG", _tf_config(cluster, "worker", 0))
        spec = autodist.ResourceSpec.from_tf_config()
        model = models.mlp(input_dim=8, hidden=(8,))
        graph_item = autodist.capture(model)
        strategy = builders.PS().build(graph_item, spec)
        run = autodist.distribute(model, strategy, spec, graph_item=graph_item,
                                  launch="remote", startup_timeout_s=3)
        start = time.monotonic()
        with pytest.raises(TaskFailedError, match=f"task ps:0 at 127.0.0.1:{ports[2]} did not "
                                                  "take its job within 3s"):
            run.fit(np.zeros((16, 8), "float32"), np.zeros(16, "int32"), batch_size=8,
                    verbose=0, shuffle=False)
        assert time.monotonic() - start < 15
        assert process.wait(timeout=30) == 1
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    assert "the driver aborted the job" in log.read_text()


def test_a_job_without_the_secret_is_rejected_and_the_task_serves_on(tmp_path, monkeypatch,
                                                                     secret_file):
    """A wrong secret, then none: each fit fails at once with the task's reason, the task
    logs a JobRejectedError and keeps waiting; then a correctly signed job trains like
    Keras on the same task process."""
    ports = free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"]}
    process, log = _serve(tmp_path, cluster, "worker", 1, job_timeout=180)
    try:
        monkeypatch.setenv("TF_CONFIG", _tf_config(cluster, "worker", 0))
        spec = autodist.ResourceSpec.from_tf_config()
        model = models.mlp(input_dim=20, hidden=(16,))
        rng = np.random.default_rng(0)
        x = rng.normal(size=(64, 20)).astype("float32")
        y = rng.integers(0, 10, 64).astype("int32")
        reference = models.single_device_twin(model)
        reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        graph_item = autodist.capture(model)
        strategy = builders.AllReduce().build(graph_item, spec)

        def fit(**options):
            run = autodist.distribute(model, strategy, spec, graph_item=graph_item,
                                      launch="remote", startup_timeout_s=60, **options)
            return run.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)

        # Signed jobs this task cannot run: a broken archive, a config of a newer version.
        mail = mailbox.Mailboxes(cluster)
        secret = secret_file.read_bytes().strip()
        newer = tmp_path / "newer"
        job = JobDir.create(newer)
        job.write(graph_item, strategy, spec, RunConfig(global_batch_size=16, job_id="cafe01"),
                  {}, [np.zeros((16, 20), "float32")], np.zeros(16, "int32"))
        job.write_ports(ports)
        config = json.loads(job.file("run.json").read_text())
        job.file("run.json").write_text(json.dumps(dict(config, a_field_from_the_future=1)))
        for job_id, archive in (("cafe00", b"not a tar archive"), ("cafe01", job.pack())):
            mail.send(("worker", 1), mailbox.JOB,
                      signing.seal(secret, job_id, "worker:1", archive, time.time()), 30)
        deadline = time.monotonic() + 60
        while log.read_text().count("rejected a job") < 2:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        wrong = tmp_path / "wrong"
        wrong.write_text("not-the-cluster-secret-at-all")
        start = time.monotonic()
        with pytest.raises(JobRejectedError, match=f"task worker:1 at 127.0.0.1:{ports[1]} "
                                                   "rejected the job: bad signature"):
            fit(secret_file=str(wrong))
        assert time.monotonic() - start < 30
        monkeypatch.delenv(SECRET_FILE_ENV)
        with pytest.raises(JobRejectedError, match="rejected the job: the job is "
                                                   "unsigned"):
            fit()
        assert process.poll() is None  # still serving
        history = fit(secret_file=str(secret_file))
        assert len(history.step_losses) == 4
        for got, want in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
        assert process.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    text = log.read_text()
    assert text.count("JobRejectedError: task worker:1") == 2
    # Named: a damaged archive and a config of another version are JobArchiveErrors.
    assert "JobArchiveError: task worker:1 rejected a job (claimed job id 'cafe00')" in text
    assert "the job archive cannot be read: ReadError" in text
    assert "JobArchiveError: task worker:1 rejected a job (claimed job id 'cafe01')" in text
    assert "unknown fields ['a_field_from_the_future']" in text
    assert "bad signature" in text and "the job is unsigned" in text
    assert SECRET not in text and "not-the-cluster-secret" not in text
    assert "task worker:1 received a job" in text and "task worker:1 done" in text


def test_served_workers_read_a_tfrecord_dataset_at_the_same_paths(tmp_path, monkeypatch,
                                                                   secret_file):
    """fit(dataset) on a served cluster: the job ships the dataset's graph (no rows); the
    served worker reads the TFRecord files at the paths the driver named, reshuffled
    each epoch as Keras reads them."""
    import tensorflow as tf

    ports = free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"]}
    servers = [_serve(tmp_path, cluster, "worker", 1, 120)]
    try:
        rng = np.random.default_rng(1)
        x = rng.normal(size=(48, 8)).astype("float32")
        y = rng.integers(0, 3, 48)
        path = str(tmp_path / "data.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for features, label in zip(x, y):
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=features)),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[label]))}))
                    .SerializeToString())
        spec_ = {"x": tf.io.FixedLenFeature([8], tf.float32),
                 "y": tf.io.FixedLenFeature([], tf.int64)}

        def parse(record):
            example = tf.io.parse_single_example(record, spec_)
            return example["x"], example["y"]

        def dataset():
            ds = tf.data.TFRecordDataset([path]).map(parse)
            ds = ds.apply(tf.data.experimental.assert_cardinality(48))
            return ds.shuffle(48, seed=3).batch(16)

        model = models.mlp(input_dim=8, hidden=(16,), classes=3, optimizer="adam")
        reference = models.single_device_twin(model)
        # A fresh dataset each: after Keras' fit on one, a fit on it reads the next orders.
        reference.fit(dataset(), epochs=2, verbose=0, shuffle=False)

        monkeypatch.setenv("TF_CONFIG", _tf_config(cluster, "worker", 0))
        spec = autodist.ResourceSpec.from_tf_config()
        graph_item = autodist.capture(model)
        strategy = builders.AllReduce().build(graph_item, spec)
        run = autodist.distribute(model, strategy, spec, graph_item=graph_item, launch="remote",
                                  job_dir=str(tmp_path / "chief"))
        history = run.fit(dataset(), epochs=2, verbose=0, shuffle=False)

        assert len(history.step_losses) == 6
        for got, want in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
        process, log = servers[0]
        assert process.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert "task worker:1 received a job" in log.read_text()
    finally:
        for process, _ in servers:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)


def test_a_big_job_travels_in_chunks(tmp_path, monkeypatch, secret_file):
    """Chunks of 256 KiB: worker:1's 3 MB of rows reach it as a dozen signed messages, put
    back together and checked before it trains; the result equals Keras'."""
    monkeypatch.setattr(chunks, "CHUNK_BYTES", 256 << 10)
    ports = free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"]}
    process, log = _serve(tmp_path, cluster, "worker", 1, job_timeout=120)
    try:
        model = models.mlp(input_dim=512, hidden=(8,), classes=4)
        rng = np.random.default_rng(2)
        x = rng.normal(size=(3072, 512)).astype("float32")   # 6 MiB of rows, half each
        y = rng.integers(0, 4, 3072).astype("int32")
        reference = models.single_device_twin(model)
        reference.fit(x, y, batch_size=512, epochs=1, shuffle=False, verbose=0)

        monkeypatch.setenv("TF_CONFIG", _tf_config(cluster, "worker", 0))
        spec = autodist.ResourceSpec.from_tf_config()
        graph_item = autodist.capture(model)
        strategy = builders.AllReduce().build(graph_item, spec)
        run = autodist.distribute(model, strategy, spec, graph_item=graph_item, launch="remote",
                                  job_dir=str(tmp_path / "chief"))
        history = run.fit(x, y, batch_size=512, epochs=1, verbose=0, shuffle=False)

        assert len(history.step_losses) == 6
        for got, want in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
        assert process.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    received = re.search(r"task worker:1 received a job \((\d+) bytes in (\d+) chunks, message "
                         r"format v2\)", log.read_text())
    assert received, log.read_text()[-3000:]
    size, count = map(int, received.groups())
    assert size > 3 << 20 and count == -(-size // (256 << 10)) >= 12
    assert not list((tmp_path / "worker1" / "jobs").glob("autodist-incoming-*"))
