"""A task's TensorFlow server: its config, and starting it on its port."""
from __future__ import annotations

import os
import sys

import tensorflow as tf

from autodist.ir.resource_spec import TaskDevices
from autodist.launch.errors import DeviceSetupError
from autodist.launch.local import is_loopback

# Collectives across processes need a group leader on every server and session.
COLLECTIVE_LEADER = "/job:worker/replica:0/task:0"


def intra_op_threads(cluster: dict[str, list[str]], job: str, task: int,
                     cores: int | None = None) -> int | None:
    """Threads for one op of task `job:task` where several workers share its host, else None.

    TensorFlow gives each process's ops as many threads as the host has
    cores, so workers sharing a host oversubscribe it (two workers on 2 cores:
    4 busy threads during the backward passes, and the collective's transfer
    threads wait for a core). Each task on such a host gets the cores over
    the workers there, at least one. Parameter servers do not count (they
    compute little: a worker beside one keeps every core). Tasks share a
    host where their addresses name the same host (every loopback name is
    one host). ``TF_NUM_INTRAOP_THREADS``, where set, is TensorFlow's and the
    user's choice: None.

    Args:
        cluster: {job: ["host:port", ...]}.
        job: This task's job.
        task: Its index.
        cores: This host's usable cores (default: the process's CPU affinity).
    """
    if os.environ.get("TF_NUM_INTRAOP_THREADS"):
        return None
    own = _host(cluster[job][task])
    workers = sum(_host(address) == own for address in cluster.get("worker", ()))
    if workers <= 1:
        return None
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else (os.cpu_count() or 1)
    return max(1, cores // workers)


def _host(address: str) -> str:
    """The host of "host:port" ("[v6]:port" too), every loopback name as one."""
    host = address.rsplit(":", 1)[0]
    return "localhost" if is_loopback(host) else host


def server_config(devices: TaskDevices | None = None,
                  threads: int | None = None) -> tf.compat.v1.ConfigProto:
    """Config of a task's server (set before the job is known), and of sessions.

    Args:
        devices: The task's devices; None: one CPU (what a session config
            needs: devices are the server's).
        threads: Threads for one op (`intra_op_threads`); None: TensorFlow's
            default (every core).

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
    if threads is not None:
        config.intra_op_parallelism_threads = threads
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
    config = server_config(devices, intra_op_threads(cluster, job, task))
    try:
        return tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=task,
                                    config=config, start=True)
    except (tf.errors.UnknownError, tf.errors.InternalError) as e:
        # gRPC reports a taken port as "Could not start gRPC server".
        message = str(e).lower()
        if any(m in message for m in ("address already in use", "failed to bind",
                                      "could not start grpc server")):
            print(f"port taken: {cluster[job][task]}: {e}", file=sys.stderr)
            return None
        raise
