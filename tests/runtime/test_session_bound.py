"""Session creation is bounded: a task named in the device filters that never answers
is a WorkerError after the timeout, not a hang (autodist.runtime.worker.open_session)."""
from __future__ import annotations

import socket
import time

import pytest
import tensorflow as tf

from autodist.runtime.worker import WorkerError, open_session

pytestmark = pytest.mark.cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_with_a_missing_peer():
    """Task 0 of a two-task cluster whose task 1 is never started."""
    cluster = tf.train.ClusterSpec({"worker": [f"localhost:{_free_port()}",
                                               f"localhost:{_free_port()}"]})
    return tf.distribute.Server(cluster, job_name="worker", task_index=0, start=True)


def _graph() -> tuple[tf.Graph, tf.Tensor]:
    graph = tf.Graph()
    with graph.as_default(), tf.device("/job:worker/task:0"):
        value = tf.constant(2.0) * 3.0
    return graph, value


def test_a_session_on_live_tasks_opens_and_runs(server_with_a_missing_peer):
    graph, value = _graph()
    config = tf.compat.v1.ConfigProto(device_filters=["/job:worker/task:0"])
    session = open_session(server_with_a_missing_peer.target, graph, config, timeout_s=60)
    assert session.run(value) == 6.0
    session.close()


def test_a_task_that_never_answers_is_an_error_after_the_timeout(server_with_a_missing_peer):
    graph, _ = _graph()
    config = tf.compat.v1.ConfigProto(device_filters=["/job:worker/task:0",
                                                      "/job:worker/task:1"])
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"did not finish within 3s: a task among "
                                          r"\['/job:worker/task:0', '/job:worker/task:1'\] "
                                          r"does not answer"):
        open_session(server_with_a_missing_peer.target, graph, config, timeout_s=3)
    assert time.monotonic() - start < 10
