"""Which task a process is, from TF_CONFIG or a resource-spec file (multi-host runs).

The convention of Kubernetes TF operators: every pod gets ``TF_CONFIG`` with
the whole cluster and its own task. The ResourceSpec makes the chief worker
task 0 and numbers the other workers after it.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from autodist.ir.device_names import DeviceNameError, TaskName
from autodist.ir.errors import AutodistError, ResourceSpecError
from autodist.ir.resource_spec import ResourceSpec, read_tf_config

_TF_CONFIG_JOBS = ("chief", "worker", "ps")  # the node order of ResourceSpec.from_tf_config


def task_from_tf_config(
        tf_config: str | Mapping[str, Any] | None = None, *, gpus_per_worker: int | None = None,
        cpu_replicas_per_worker: int = 1) -> tuple[ResourceSpec, tuple[str, int]]:
    """The cluster and this process's own (job, task index) in it, from TF_CONFIG.

    TF_CONFIG names tasks as the operator does (``chief:0``, ``worker:i``,
    ``ps:i``); the ResourceSpec makes the chief worker task 0 and numbers the
    other workers after it, so ``worker:0`` of a TF_CONFIG with a chief job is
    worker task 1 here.

    Args:
        tf_config: The JSON string or parsed dict; None reads the environment.
        gpus_per_worker, cpu_replicas_per_worker: The workers' devices, as
            `ResourceSpec.from_tf_config` takes them (None: the GPUs this
            host shows).

    Raises:
        ResourceSpecError: TF_CONFIG is missing, malformed, or its task is not
            in its cluster.
    """
    tf_config = read_tf_config(tf_config)
    spec = ResourceSpec.from_tf_config(tf_config, gpus_per_worker=gpus_per_worker,
                                       cpu_replicas_per_worker=cpu_replicas_per_worker)
    task = tf_config.get("task") if isinstance(tf_config, Mapping) else None
    cluster = tf_config["cluster"]
    kind = task.get("type") if isinstance(task, Mapping) else None
    index = task.get("index", 0) if isinstance(task, Mapping) else None
    if kind not in _TF_CONFIG_JOBS or not isinstance(index, int) or isinstance(index, bool) or \
            not 0 <= index < len(cluster.get(kind) or []):
        raise ResourceSpecError(
            "TF_CONFIG must name this process's task in its cluster, e.g. "
            f'"task": {{"type": "worker", "index": 1}}. Received task {task!r} for cluster '
            f"{dict(cluster)!r}")
    offset = sum(len(cluster.get(job) or []) for job in
                 _TF_CONFIG_JOBS[:_TF_CONFIG_JOBS.index(kind)])
    return spec, spec.task_of(offset + index)


def task_from_spec_file(path: str, task: str | None) -> tuple[ResourceSpec, tuple[str, int]]:
    """The cluster of a resource-spec YAML file and the task named "job:index" in it."""
    spec = ResourceSpec.from_yaml(path)
    tasks = [spec.task_of(i) for i in range(len(spec.nodes))]
    try:
        name = TaskName.parse_short(task)
    except DeviceNameError:
        name = None
    if name is None or (name.job, name.index) not in tasks:
        raise ResourceSpecError(f"--task must name a task of {path!r} as JOB:INDEX, one of "
                                f"{[f'{j}:{i}' for j, i in tasks]}. Received: {task!r}")
    return spec, (name.job, name.index)


def check_this_is_the_chief(spec: ResourceSpec) -> None:
    """Raises unless this process may drive `spec` (TF_CONFIG, if set, names the chief).

    Raises:
        AutodistError: naming this process's task and what to run instead.
    """
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return
    try:
        # Devices do not matter here (and need no GPU lookup): only the tasks.
        own_spec, own = task_from_tf_config(raw, gpus_per_worker=0)
        if own_spec.cluster_def() != spec.cluster_def():
            return
    except ResourceSpecError:
        return  # a TF_CONFIG of something else: the spec was given explicitly
    if own != spec.task_of(spec.chief_index):
        raise AutodistError(
            f"this process is task {own[0]}:{own[1]} of its TF_CONFIG, not the chief: "
            "run the training script on the chief only (TF_CONFIG task chief:0, or worker:0 "
            "without a chief job) and `autodist serve --tf-config` on every other host")
