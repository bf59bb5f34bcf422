"""Elastic membership: which worker tasks run which steps of a job.

A resize schedule (`fit(..., resize_at={step: workers})`) splits the run into
segments; segment v (the membership version) runs steps [start, end) on
worker tasks 0..workers-1. Every task derives the same segments from the
RunConfig, so the membership of each step is agreed before the run starts.
In a followed run (`fit(..., elastic=True, callbacks=...)`), the chief also
appends segments on `DistributedRun.resize` requests and sends the list with
every run limit (`autodist.runtime.follow`), so all tasks still agree.

Between segments no process restarts and nothing is written to disk: each
member of the next segment builds a new program for the new membership (new
collective group key, new PS accumulators, virtual nodes remapped over the
new replicas) in a new session, and takes the variables, optimizer slots,
step count, per-virtual-node state and error-feedback residuals
(`autodist.runtime.residuals`) from the chief's memory, sent over the
mailboxes. Parameter-server variables stay where they are. The global
batch and the number of virtual nodes stay fixed, and virtual node i always
reads the same examples, so the run follows the same trajectory whatever
the sizes (`docs/tf_elastic_notes.md` has what TensorFlow allows).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from autodist.ir.errors import AutodistError
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy


@dataclasses.dataclass(frozen=True)
class Segment:
    """Steps [start, end) of the run, on worker tasks 0..workers-1.

    `plan` indexes the run's strategies: 0 is the job's strategy, k > 0 the
    k-th strategy switched to (`RunConfig.plans`, `DistributedRun.replan`).
    """

    version: int
    start: int
    end: int
    workers: int
    plan: int = 0

    def has(self, task_index: int) -> bool:
        return task_index < self.workers


def segments(total_steps: int, max_workers: int, resize_at: Mapping[int, int] | None,
             switch_at: Mapping[int, int] | None = None) -> list[Segment]:
    """The run's segments; without a schedule, one segment on every worker.

    Args:
        total_steps: Steps of the whole run.
        max_workers: Worker tasks of the cluster.
        resize_at: Step -> number of workers from that step on (step 0 sets
            the starting size; default: all workers).
        switch_at: Step -> plan (index of the strategy) from that step on.

    Raises:
        AutodistError: a step outside the run, or a size outside
            1..max_workers.
    """
    plans = {0: 0}
    for step, plan in sorted((int(k), int(v)) for k, v in (switch_at or {}).items()):
        if not 0 < step < total_steps:
            raise AutodistError(f"switch_at step {step} is outside the run's steps "
                                f"1..{total_steps - 1}")
        plans[step] = plan
    sizes = {0: max_workers}
    for step, workers in sorted((int(k), v) for k, v in (resize_at or {}).items()):
        if not 0 <= step < total_steps:
            raise AutodistError(f"resize_at step {step} is outside the run's steps "
                                f"0..{total_steps - 1}")
        if not isinstance(workers, int) or not 1 <= workers <= max_workers:
            raise AutodistError(f"resize_at[{step}] must be a number of workers in "
                                f"1..{max_workers} (the cluster's worker tasks). "
                                f"Received: {workers!r}")
        sizes[step] = workers
    starts = sorted(set(sizes) | set(plans))
    out = []
    workers, plan = max_workers, 0
    for version, start in enumerate(starts):
        end = starts[version + 1] if version + 1 < len(starts) else total_steps
        workers, plan = sizes.get(start, workers), plans.get(start, plan)
        out.append(Segment(version, start, end, workers, plan))
    return out


def check_elastic(strategy: Strategy, spec: ResourceSpec) -> None:
    """Raises unless `strategy` can change its number of workers mid-run.

    It must be synchronous (asynchronous and stale updates have no step
    boundary all members meet), have virtual nodes (they keep the global
    batch and the examples of each virtual node fixed), at least as many as
    the largest size, one replica per worker task, and keep its
    parameter-server variables on PS tasks or on worker 0 (the chief is
    always a member).
    """
    if strategy.global_batch_size is None:
        raise AutodistError("resizing needs a strategy with virtual nodes (a fixed global "
                            "batch): use strategy.with_virtual_nodes(B, V)")
    workers = spec.num_worker_tasks
    # A valid strategy has a virtual node on every replica, so V >= workers.
    tasks = [replica_task(d) for d in strategy.replicas]
    if sorted(tasks) != list(range(workers)):
        raise AutodistError("resizing needs one replica on each worker task; the strategy's "
                            f"replicas are {strategy.replicas}")
    for config in strategy.variables:
        for i, sync in enumerate(config.shards):
            if sync.WhichOneof("kind") != "ps":
                continue
            ps = sync.ps
            if not ps.sync or ps.staleness:
                raise AutodistError(f"variable {config.var_name!r} shard {i} is updated "
                                    "asynchronously; resizing needs synchronous training")
            destination = ps.reduction_destination
            if destination.startswith("/job:worker/") and \
                    not destination.startswith("/job:worker/task:0/"):
                raise AutodistError(
                    f"variable {config.var_name!r} shard {i} lives on {destination}, a worker "
                    "that may leave; put it on a PS task or on worker 0 to resize")


def check_switch(strategy: Strategy, new: Strategy, graph_item, spec: ResourceSpec,
                 batch_change: bool = False) -> None:
    """Raises unless a run of `strategy` can switch to `new` at a step boundary.

    Both must be valid and synchronous (every member meets the boundary),
    on the same replicas, with the same global batch and virtual nodes, so
    the data schedule and the numbers do not change. With `batch_change`
    the global batch may differ (a switch at an epoch's start).
    """
    new.validate(graph_item, spec)
    for name, s in (("the run's strategy", strategy), ("the new strategy", new)):
        for config in s.variables:
            for i, sync in enumerate(config.shards):
                if sync.WhichOneof("kind") == "ps" and (not sync.ps.sync or sync.ps.staleness):
                    raise AutodistError(
                        f"switching strategies needs synchronous training; in {name} "
                        f"variable {config.var_name!r} shard {i} is updated asynchronously")
    if sorted(strategy.replicas) != sorted(new.replicas):
        raise AutodistError("a strategy switched to must use the same replicas. Run: "
                            f"{sorted(strategy.replicas)}, new: {sorted(new.replicas)}")
    if not batch_change and (strategy.global_batch_size, strategy.num_virtual_nodes) != \
            (new.global_batch_size, new.num_virtual_nodes):
        raise AutodistError(
            "a strategy switched to must keep the global batch and the number of virtual "
            f"nodes. Run: B={strategy.global_batch_size}, V={strategy.num_virtual_nodes}; "
            f"new: B={new.global_batch_size}, V={new.num_virtual_nodes}")


def strategy_for(strategy: Strategy, workers: int) -> Strategy:
    """The strategy on worker tasks 0..workers-1, virtual nodes spread over them.

    On all of the strategy's worker tasks it is the strategy itself (its own
    virtual-node mapping, e.g. a balanced one).
    """
    if workers >= len({replica_task(d) for d in strategy.replicas}):
        return strategy
    replicas = sorted((d for d in strategy.replicas if replica_task(d) < workers),
                      key=replica_task)
    out = Strategy(strategy.proto)
    del out.proto.graph_config.replicas[:]
    out.proto.graph_config.replicas.extend(replicas)
    return out.with_virtual_nodes(strategy.global_batch_size, strategy.num_virtual_nodes)


def replica_task(device: str) -> int:
    """The worker task index of a replica device ("/job:worker/task:3/...")."""
    for part in device.split("/"):
        if part.startswith("task:"):
            return int(part[len("task:"):])
    raise AutodistError(f"replica device {device!r} names no task")
