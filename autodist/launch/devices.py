"""A task process's environment for its devices, set before TensorFlow starts.

TensorFlow fixes a process's devices when its server starts, so the launcher
prepares them per task:

* GPUs: ``CUDA_VISIBLE_DEVICES`` lists only the node's GPUs (positions among
  those the launcher's host shows, `autodist.ir.gpus`), so each task uses its
  own and sees them as ``GPU:0`` ..; a task without GPUs (a parameter server,
  a CPU worker) gets none, so it holds no GPU memory on a GPU host.
  ``TF_FORCE_GPU_ALLOW_GROWTH`` makes GPU memory grow as needed rather than
  be taken whole at start, so tasks sharing a GPU (and the driver) fit.
* Logical CPU devices (CPU replicas) are part of the server's config
  (`autodist.launch.server.server_config`), not of the environment.
"""
from __future__ import annotations

from typing import Mapping

from autodist.ir.gpus import visible_gpus
from autodist.ir.resource_spec import ResourceSpec, TaskDevices
from autodist.launch.errors import DeviceSetupError


def task_environment(devices: TaskDevices, visible: list[str],
                     where: str = "this task") -> dict[str, str]:
    """The environment variables to set for a task with `devices`.

    Args:
        devices: The task's devices (`ResourceSpec.task_devices`).
        visible: The GPUs the launcher's host shows (`visible_gpus()`; only
            read when the task has GPUs).
        where: The task, for messages ("task worker:1 (node 1)").

    Raises:
        DeviceSetupError: The node names a GPU the host does not show.
    """
    env = {"TF_FORCE_GPU_ALLOW_GROWTH": "true"}
    missing = [g for g in devices.gpus if g >= len(visible)]
    if missing:
        raise DeviceSetupError(
            f"{where} has GPUs {list(devices.gpus)} but this host shows {len(visible)} "
            f"(its CUDA_VISIBLE_DEVICES if set, else `nvidia-smi -L`): GPUs {missing} do not "
            "exist here")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[g] for g in devices.gpus)
    return env


def task_environments(spec: ResourceSpec, nodes: list[int],
                      environ: Mapping[str, str]) -> dict[int, dict[str, str]]:
    """Node index -> the variables to set for its task, for `nodes` started on this host.

    GPUs are looked up once (`visible_gpus(environ)`), and only when a node has some.

    Raises:
        DeviceSetupError: A node names a GPU this host does not show.
    """
    visible = visible_gpus(environ) if any(spec.nodes[i].gpus for i in nodes) else []
    out = {}
    for i in nodes:
        job, task = spec.task_of(i)
        out[i] = task_environment(spec.task_devices(i), visible, f"task {job}:{task} (node {i})")
    return out


def check_shipped_devices(shipped: ResourceSpec, job: str, task: int,
                          started_with: TaskDevices) -> None:
    """Raises unless the chief's spec gives this served task the devices its server has.

    A served task (``autodist serve``) starts its server before the job
    arrives, from its own TF_CONFIG or spec file and flags.

    Raises:
        DeviceSetupError: naming both and the flags to give.
    """
    wanted = shipped.task_devices(shipped.node_of_task(job, task))
    if wanted != started_with:
        raise DeviceSetupError(
            f"the chief's resource spec gives task {job}:{task} {wanted}, but its server "
            f"started with {started_with}: give `autodist serve` the --gpus-per-worker and "
            "--cpu-replicas-per-worker of the chief's ResourceSpec.from_tf_config (or the same "
            "spec file)")
