"""A task's TensorFlow server: its config, and starting it on its port."""
from __future__ import annotations

import os
import sys

import tensorflow as tf

from autodist.ir.resource_spec import TaskDevices
from autodist.launch.errors import DeviceSetupError

# Collectives across processes need a group leader on every server and session.
COLLECTIVE_LEADER = "/job:worker/replica:0/task:0"


def server_config(devices: TaskDevices | None = None) -> tf.compat.v1.ConfigProto:
    """Config of a task's server (set before the job is known), and of sessions.

    Args:
        devices: The task's devices; None: one CPU (what a session config
            needs: devices are the server's).

    The server creates its devices from this config: ``device_count`` gives
    it logical CPU devices for CPU replicas (`tf.config.
    set_logical_device_configuration` configures only the eager context and
    does not reach a `tf.distribute.Server`), and GPU memory grows as needed.
    """
    config = tf.compat.v1.ConfigProto(allow_soft_placement=False)
    config.experimental.collective_group_leader = COLLECTIVE_LEADER
    if devices is not None and devices.cpus > 1:
        config.device_count["CPU"] = devices.cpus
    config.gpu_options.allow_growth = True
    return config


def check_gpus(devices: TaskDevices, where: str) -> None:
    """Raises unless TensorFlow shows this process the node's GPUs (before the server starts).

    The launcher set ``CUDA_VISIBLE_DEVICES`` to the node's GPUs; a
    CPU-only TensorFlow build, or GPUs the host does not have, show fewer.
    """
    if not devices.gpus:
        return
    found = tf.config.list_physical_devices("GPU")
    if len(found) < len(devices.gpus):
        raise DeviceSetupError(
            f"{where} should have {len(devices.gpus)} GPUs (the host's {list(devices.gpus)}) "
            f"but TensorFlow shows it {len(found)} (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}, TensorFlow built with CUDA: "
            f"{tf.test.is_built_with_cuda()}); install the `gpu` extra on GPU hosts, or give "
            "the node no GPUs")


def start_server(cluster: dict[str, list[str]], job: str, task: int,
                 devices: TaskDevices | None = None) -> tf.distribute.Server | None:
    """This task's TensorFlow server with its devices, or None when its port is taken.

    Raises:
        DeviceSetupError: The node's GPUs are not there.
    """
    if devices is not None:
        check_gpus(devices, f"task {job}:{task}")
    try:
        return tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=task,
                                    config=server_config(devices), start=True)
    except (tf.errors.UnknownError, tf.errors.InternalError) as e:
        # gRPC reports a taken port as "Could not start gRPC server".
        message = str(e).lower()
        if any(m in message for m in ("address already in use", "failed to bind",
                                      "could not start grpc server")):
            print(f"port taken: {cluster[job][task]}: {e}", file=sys.stderr)
            return None
        raise
