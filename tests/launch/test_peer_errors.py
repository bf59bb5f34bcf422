"""Which task a failed step could not reach (`launch.errors.unreachable_peer`)."""
from __future__ import annotations

import tensorflow as tf

from autodist.launch.errors import unreachable_peer

# As TensorFlow 2.21 words a step whose parameter server's process died (seen on
# emulated hosts: the PS's host restarted it, the connection was refused).
DEAD_PS = """Graph execution error:
UNAVAILABLE: From /job:worker/replica:0/task:1:
failed to connect to all addresses; last error: UNKNOWN: ipv4:10.77.1.12:52197: Failed to \
connect to remote host: Connection refused
Additional GRPC error information from remote target /job:ps/replica:0/task:0 while calling \
/tensorflow.WorkerService/RecvTensor:"""


def test_an_unavailable_remote_target_names_the_task():
    error = tf.errors.UnavailableError(None, None, DEAD_PS)
    assert unreachable_peer(error) == "ps:0"


def test_the_cause_of_a_wrapping_error_counts():
    try:
        try:
            raise tf.errors.UnavailableError(None, None, DEAD_PS.replace("ps", "worker"))
        except tf.errors.UnavailableError as e:
            raise RuntimeError("the chief stopped") from e
    except RuntimeError as wrapped:
        assert unreachable_peer(wrapped) == "worker:0"


def test_other_errors_name_no_peer():
    assert unreachable_peer(tf.errors.InvalidArgumentError(None, None, DEAD_PS)) is None
    assert unreachable_peer(tf.errors.UnavailableError(None, None, "Socket closed")) is None
    assert unreachable_peer(ValueError("remote target /job:ps/replica:0/task:0")) is None
