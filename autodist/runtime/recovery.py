"""Going on without a dead worker (`fit(..., on_failure="continue")`).

With `on_failure="continue"` every step is atomic: the synchronizer starts no
update before all the step's gradients are aggregated, so a step that fails
because a worker died applies nothing. The chief, whose step fails with the
others' (a collective aborted by the lost connection, or a parameter-server
take that times out), saves the state after the last completed step in
memory-backed form to the job directory (`JobDir.recovery`). The driver then
starts the job again on the survivors (the dead worker's node removed, tasks
renumbered, virtual nodes remapped so the global batch stays B) from that
state, at the next step of the same data schedule. No applied update is
lost, and the run equals one that never failed (synchronous strategies).

TensorFlow aborts every collective of a process that took part in a failed
collective, and nothing resets that short of a new process
(`docs/tf_elastic_notes.md`), so the survivors' processes are started anew;
what survives is the state. The job cannot go on when the chief or a
parameter-server task dies, or when a dead worker held parameter-server
variables: the original error is raised.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from autodist.ir.errors import AutodistError
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.proto import resource_spec_pb2
from autodist.runtime.elastic import replica_task
from autodist.launch.job import JobDir

# In the recovery file: the run step to resume at (see worker.save_recovery).
NEXT_STEP = "autodist/next_step"


def dead_worker(task: str) -> int | None:
    """The index of a failed non-chief worker task ("worker:2" -> 2), else None."""
    job, _, index = task.partition(":")
    if job != "worker" or not index.isdigit() or int(index) == 0:
        return None
    return int(index)


def without_worker(spec: ResourceSpec, task_index: int) -> ResourceSpec:
    """`spec` without the node of worker task `task_index` (tasks renumbered)."""
    node = next(i for i in range(len(spec.nodes)) if spec.task_of(i) == ("worker", task_index))
    proto = resource_spec_pb2.ResourceSpec()
    proto.CopyFrom(spec.proto)
    del proto.nodes[node]
    return ResourceSpec(proto)


def strategy_without(strategy: Strategy, task_index: int) -> Strategy:
    """`strategy` without worker task `task_index`: its replica dropped, tasks renumbered.

    Devices of later worker tasks move down by one, as in `without_worker`;
    virtual nodes keep B and V and are spread over the remaining replicas.

    Raises:
        AutodistError: a variable lives on the dead worker.
    """
    def renamed(device: str) -> str:
        if not device.startswith("/job:worker/"):
            return device
        index = replica_task(device)
        if index == task_index:
            raise AutodistError(f"{device} belonged to the dead worker {task_index}")
        return device.replace(f"/task:{index}/", f"/task:{index - (index > task_index)}/", 1)

    out = Strategy(strategy.proto)
    proto = out.proto
    for config in proto.variables:
        for i, sync in enumerate(config.shards):
            if sync.WhichOneof("kind") == "ps":
                destination = sync.ps.reduction_destination
                if destination.startswith(f"/job:worker/task:{task_index}/"):
                    raise AutodistError(f"variable {config.var_name!r} shard {i} lived on the "
                                        f"dead worker {task_index} ({destination})")
                sync.ps.reduction_destination = renamed(destination)
    replicas = [renamed(d) for d in strategy.replicas
                if not d.startswith(f"/job:worker/task:{task_index}/")]
    del proto.graph_config.replicas[:]
    proto.graph_config.replicas.extend(replicas)
    if strategy.global_batch_size is None:
        return out
    proto.graph_config.ClearField("virtual_nodes")
    return out.with_virtual_nodes(strategy.global_batch_size, strategy.num_virtual_nodes)


def resume_point(job: JobDir) -> tuple[dict[str, np.ndarray], int] | None:
    """(state after the last completed step, the step to resume at), if saved."""
    if not job.recovery().exists():
        return None
    with np.load(job.recovery()) as arrays:
        values = {name: arrays[name] for name in arrays.files}
    return values, int(values.pop(NEXT_STEP))


def completed_losses(job: JobDir, workers: int, first: int,
                     steps: int) -> tuple[list[float], list[float], list[int]]:
    """Global losses and the chief's step times of steps first..first+steps-1.

    Each worker of a recoverable run appends its weighted loss of every step
    it ran to the job directory as soon as its step's run returns (before
    waiting for the chief's update); the global loss of a completed step is
    their sum. Where a worker's record is missing (it died between handing
    over its gradient and recording) the chief's own estimate (its replicas'
    mean loss, from its progress records) stands in; the third list names
    those steps.
    """
    parts: dict[int, list[float]] = {}
    for task in range(workers):
        path = job.file(f"losses_{task}.jsonl")
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                parts.setdefault(int(record["index"]), []).append(float(record["loss"]))
    progress: list[dict[str, Any]] = []
    path = job.file("progress.jsonl")
    if path.exists():
        progress = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    losses, estimated = [], []
    for k in range(steps):
        found = parts.get(first + k, [])
        if len(found) == workers:
            losses.append(sum(found))
        else:
            losses.append(float(progress[k]["loss"]))
            estimated.append(first + k)
    return losses, [float(r["time"]) for r in progress[:steps]], estimated
