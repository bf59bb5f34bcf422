"""Elastic membership: which worker tasks run which steps of a job.

A resize schedule (`fit(..., resize_at={step: workers})`) splits the run into
segments; segment v (the membership version) runs steps [start, end) on its
member worker tasks (a sorted tuple that always holds the chief, task 0, e.g.
(0, 2, 3) after worker 1 left). Every task derives the same segments from
the RunConfig, so the membership of each step is agreed before the run
starts.
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

from autodist.ir.device_names import DeviceName, TaskName
from autodist.ir.errors import AutodistError, short_repr
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy, is_asynchronous
from autodist.runtime.run_config import RunConfig


@dataclasses.dataclass(frozen=True)
class Segment:
    """Steps [start, end) of the run, on the worker tasks `members`.

    `members` is sorted and holds the chief (task 0). `plan` indexes the
    run's strategies: 0 is the job's strategy, k > 0 the k-th strategy
    switched to (`RunConfig.plans`, `DistributedRun.replan`).
    """

    version: int
    start: int
    end: int
    members: tuple[int, ...]
    plan: int = 0

    @property
    def workers(self) -> int:
        """How many worker tasks run the segment."""
        return len(self.members)

    def has(self, task_index: int) -> bool:
        return task_index in self.members


def members_for(current: tuple[int, ...], workers, max_workers: int,
                where: str) -> tuple[int, ...]:
    """The members a resize asks for: a number n (`resized` from `current`) or a list.

    Raises:
        AutodistError: naming `where` and the value received.
    """
    if isinstance(workers, int) and not isinstance(workers, bool):
        if not 1 <= workers <= max_workers:
            raise AutodistError(f"{where} must be a number of workers in 1..{max_workers} "
                                "(the cluster's worker tasks) or a list of worker tasks. "
                                f"Received: {workers!r}")
        return resized(current, workers, max_workers)
    return check_members(workers, max_workers, where)


def check_members(members, max_workers: int, what: str = "members") -> tuple[int, ...]:
    """`members` as a sorted tuple of worker task indices, checked.

    Raises:
        AutodistError: not a sequence of task indices, an index outside
            0..max_workers-1, a repeated index, or no chief (task 0).
    """
    if isinstance(members, (str, bytes)) or not hasattr(members, "__iter__"):
        raise AutodistError(f"{what} must be a sequence of worker task indices. "
                            f"Received: {short_repr(members)}")
    values = list(members)[:max_workers + 1]  # more cannot be distinct tasks
    if any(not isinstance(t, int) or isinstance(t, bool) for t in values):
        raise AutodistError(f"{what} must be worker task indices (integers). "
                            f"Received: {short_repr(values)}")
    unknown = sorted({t for t in values if not 0 <= t < max_workers})
    if unknown:
        raise AutodistError(f"{what} names unknown worker tasks {short_repr(unknown)}; the "
                            f"spec has worker tasks 0..{max_workers - 1}")
    repeated = sorted({t for t in values if values.count(t) > 1})
    if repeated:
        raise AutodistError(f"{what} repeats worker tasks {short_repr(repeated)}. "
                            f"Received: {short_repr(values)}")
    if 0 not in values:
        raise AutodistError(f"{what} must include the chief (worker task 0), which holds the "
                            f"run's state and cannot be dropped. Received: "
                            f"{short_repr(sorted(values))}")
    return tuple(sorted(values))


def resized(members: tuple[int, ...], workers: int, max_workers: int) -> tuple[int, ...]:
    """`members` grown or shrunk to `workers` tasks.

    Shrinking keeps the lowest-numbered members (drops the last ones);
    growing adds the lowest-numbered idle tasks. From (0, 1, 2, 3), 2 gives
    (0, 1); from (0, 2, 3), 3 is unchanged and 4 adds task 1.
    """
    if workers <= len(members):
        return members[:workers]
    idle = [t for t in range(max_workers) if t not in members]
    return tuple(sorted(members + tuple(idle[:workers - len(members)])))


def segments(total_steps: int, max_workers: int, resize_at: Mapping[int, int] | None,
             switch_at: Mapping[int, int] | None = None) -> list[Segment]:
    """The run's segments; without a schedule, one segment on every worker.

    Args:
        total_steps: Steps of the whole run.
        max_workers: Worker tasks of the cluster.
        resize_at: Step -> the members from that step on: a number n of
            workers (the previous members grown or shrunk to n, see
            `resized`) or a sequence of worker task indices (step 0 sets the
            starting membership; default: all workers).
        switch_at: Step -> plan (index of the strategy) from that step on.

    Raises:
        AutodistError: a step outside the run, a size outside
            1..max_workers, or bad members (`check_members`).
    """
    plans = {0: 0}
    for step, plan in sorted((int(k), int(v)) for k, v in (switch_at or {}).items()):
        if not 0 < step < total_steps:
            raise AutodistError(f"switch_at step {step} is outside the run's steps "
                                f"1..{total_steps - 1}")
        plans[step] = plan
    everyone = tuple(range(max_workers))
    sizes: dict[int, tuple[int, ...]] = {0: everyone}
    members = everyone
    for step, workers in sorted((int(k), v) for k, v in (resize_at or {}).items()):
        if not 0 <= step < total_steps:
            raise AutodistError(f"resize_at step {step} is outside the run's steps "
                                f"0..{total_steps - 1}")
        members = members_for(members, workers, max_workers, f"resize_at[{step}]")
        sizes[step] = members
    starts = sorted(set(sizes) | set(plans))
    out = []
    members, plan = everyone, 0
    for version, start in enumerate(starts):
        end = starts[version + 1] if version + 1 < len(starts) else total_steps
        members, plan = sizes.get(start, members), plans.get(start, plan)
        out.append(Segment(version, start, end, members, plan))
    return out


def check_elastic(strategy: Strategy, spec: ResourceSpec) -> None:
    """Raises unless `strategy` can change its number of workers mid-run.

    It must be synchronous (asynchronous and stale updates have no step
    boundary all members meet), have virtual nodes (they keep the global
    batch and the examples of each virtual node fixed), at least as many as
    the replicas of the largest membership (every worker task), the same
    number of replicas (one or more, e.g. a node's GPUs) on each worker
    task, and keep its parameter-server variables on PS tasks or on worker 0
    (the chief is always a member).
    """
    if strategy.global_batch_size is None:
        raise AutodistError("resizing needs a strategy with virtual nodes (a fixed global "
                            "batch): use strategy.with_virtual_nodes(B, V)")
    if strategy.num_virtual_nodes < len(strategy.replicas):
        raise AutodistError(
            f"resizing needs at least one virtual node per replica of the largest "
            f"membership: V={strategy.num_virtual_nodes} virtual nodes cannot cover the "
            f"{len(strategy.replicas)} replicas of all worker tasks; use "
            f"strategy.with_virtual_nodes(B, V) with V >= {len(strategy.replicas)}")
    per_task = replicas_per_task(strategy)
    if sorted(per_task) != list(range(spec.num_worker_tasks)):
        raise AutodistError("resizing needs replicas on each worker task; the strategy's "
                            f"replicas are {strategy.replicas}")
    if len(set(per_task.values())) > 1:
        raise AutodistError(
            "resizing needs the same number of replicas on each worker task; the strategy "
            f"has {dict(sorted(per_task.items()))} replicas by worker task")
    for config in strategy.variables:
        for i, sync in enumerate(config.shards):
            if sync.WhichOneof("kind") != "ps":
                continue
            if is_asynchronous(sync):
                raise AutodistError(f"variable {config.var_name!r} shard {i} is updated "
                                    "asynchronously; resizing needs synchronous training")
            destination = sync.ps.reduction_destination
            if destination.startswith("/job:worker/") and \
                    not destination.startswith(TaskName("worker", 0).device_prefix):
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
        shards = s.asynchronous_shards()
        if shards:
            variable, i = shards[0]
            raise AutodistError(
                f"switching strategies needs synchronous training; in {name} "
                f"variable {variable!r} shard {i} is updated asynchronously")
    if sorted(strategy.replicas) != sorted(new.replicas):
        raise AutodistError("a strategy switched to must use the same replicas. Run: "
                            f"{sorted(strategy.replicas)}, new: {sorted(new.replicas)}")
    if not batch_change and (strategy.global_batch_size, strategy.num_virtual_nodes) != \
            (new.global_batch_size, new.num_virtual_nodes):
        raise AutodistError(
            "a strategy switched to must keep the global batch and the number of virtual "
            f"nodes. Run: B={strategy.global_batch_size}, V={strategy.num_virtual_nodes}; "
            f"new: B={new.global_batch_size}, V={new.num_virtual_nodes}")


def strategy_for(strategy: Strategy, members: tuple[int, ...]) -> Strategy:
    """The strategy on the worker tasks `members`, virtual nodes spread over them.

    On all of the strategy's worker tasks it is the strategy itself (its own
    virtual-node mapping, e.g. a balanced one).
    """
    if set(members) >= {replica_task(d) for d in strategy.replicas}:
        return strategy
    return strategy.with_replicas(sorted(
        (d for d in strategy.replicas if replica_task(d) in members), key=replica_task))


def replicas_per_task(strategy: Strategy) -> dict[int, int]:
    """Worker task index -> how many of `strategy`'s replicas it runs."""
    counts: dict[int, int] = {}
    for device in strategy.replicas:
        task = replica_task(device)
        counts[task] = counts.get(task, 0) + 1
    return counts


def replica_task(device: str) -> int:
    """The worker task index of a replica device ("/job:worker/task:3/device:CPU:0").

    Raises:
        DeviceNameError: `device` is not a device name.
    """
    return DeviceName.parse(device).index


@dataclasses.dataclass(frozen=True)
class TaskSchedule:
    """Which worker tasks a scheduled elastic run (`resize_at`, nobody following) needs
    when.

    Attributes:
        start: The starting members (they and the PS tasks meet at launch).
        late: Tasks that join only at a later resize: nobody waits for them
            at launch; under launch="remote" their slot may be served later
            (the driver ships them the job once it answers) and the chief
            waits for them when the run grows onto them.
        absent: Tasks no segment includes: they take no part (not shipped,
            not waited for, no results).
        released: Tasks that leave for good before the last segment: they
            end (their `autodist serve` is free again) once they left.
    """

    start: tuple[int, ...]
    late: frozenset[int] = frozenset()
    absent: frozenset[int] = frozenset()
    released: frozenset[int] = frozenset()


def task_schedule(resize_at: Mapping | None, max_workers: int) -> TaskSchedule:
    """The `TaskSchedule` of a run resized at the steps of `resize_at` (keys may be
    strings, as in a RunConfig); without one every task runs every step.

    Raises:
        AutodistError: a bad size or members (`members_for`).
    """
    members = tuple(range(max_workers))
    if not resize_at:
        return TaskSchedule(members)
    memberships = []
    for step, workers in sorted((int(k), v) for k, v in resize_at.items()):
        members = members_for(members, workers, max_workers, f"resize_at[{step}]")
        memberships.append(members)
    if min(int(k) for k in resize_at) != 0:
        memberships.insert(0, tuple(range(max_workers)))
    start = memberships[0]
    ever = set().union(*memberships)
    return TaskSchedule(
        start=start, late=frozenset(ever - set(start)),
        absent=frozenset(range(max_workers)) - ever,
        released=frozenset(ever - set(memberships[-1])))


def scheduled_tasks(config: RunConfig, num_workers: int) -> TaskSchedule:
    """Which tasks the run of `config` needs when. A followed run may grow onto any
    task at any step: the tasks outside its starting membership (`resize_at[0]`) are
    late (the chief waits for each only when a segment includes it,
    `follow.ChiefFollower`); none is absent, none released."""
    schedule = task_schedule(config.resize_at, num_workers)
    if config.follow_steps:
        return TaskSchedule(schedule.start,
                            late=frozenset(range(num_workers)) - set(schedule.start))
    return schedule
