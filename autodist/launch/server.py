"""A task's TensorFlow server: its config, and starting it on its port."""
from __future__ import annotations

import sys

import tensorflow as tf

# Collectives across processes need a group leader on every server and session.
COLLECTIVE_LEADER = "/job:worker/replica:0/task:0"


def server_config() -> tf.compat.v1.ConfigProto:
    """Config of every task's server (the same for any strategy: set before the job is known)."""
    config = tf.compat.v1.ConfigProto(allow_soft_placement=False)
    config.experimental.collective_group_leader = COLLECTIVE_LEADER
    return config


def start_server(cluster: dict[str, list[str]], job: str, task: int) -> tf.distribute.Server | None:
    """This task's TensorFlow server, or None when its port is taken."""
    try:
        return tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=task,
                                    config=server_config(), start=True)
    except (tf.errors.UnknownError, tf.errors.InternalError) as e:
        # gRPC reports a taken port as "Could not start gRPC server".
        message = str(e).lower()
        if any(m in message for m in ("address already in use", "failed to bind",
                                      "could not start grpc server")):
            print(f"port taken: {cluster[job][task]}: {e}", file=sys.stderr)
            return None
        raise
