"""A worker task's program and the session that runs it.

`build_program` lowers the step for one worker task (the kernel passes);
`session_config` restricts its session to the tasks it needs (device
filters); `open_session` bounds the session's creation, which TensorFlow
does not.
"""
from __future__ import annotations

import dataclasses
import threading

import tensorflow as tf

from autodist.ir.errors import AutodistError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.kernels import global_batch, partitioner, replicator, synchronizer
from autodist.kernels.program import Program
from autodist.launch.server import server_config
from autodist.runtime.elastic import replica_task


class WorkerError(AutodistError, RuntimeError):
    """A worker could not start or finish its part of the job."""


def session_config(strategy: Strategy, task_index: int,
                   members: tuple[int, ...] | None = None,
                   graph_item: GraphItem | None = None) -> tf.compat.v1.ConfigProto:
    """Session config: the server's, plus device filters.

    Args:
        strategy: The strategy the session runs.
        task_index: This worker task.
        members: In an elastic job, the worker tasks of the current
            membership. A session must name exactly the
            live tasks it uses: one that can see an idle or absent task
            waits for it without a timeout.
        graph_item: The step (its batch statistics may be summed over
            replicas by collectives, which need every worker).
    """
    config = server_config()
    # On GPUs, an op of the step without a GPU kernel runs on its task's CPU
    # rather than failing the step (placement is otherwise the strategy's).
    config.allow_soft_placement = any("/device:GPU:" in d for d in strategy.replicas)
    uses_collectives = any(s.WhichOneof("kind") == "all_reduce"
                           for v in strategy.variables for s in v.shards) or \
        (graph_item is not None and global_batch.sums_over_replicas(graph_item, strategy))
    if uses_collectives and members is not None:
        config.device_filters.extend(["/job:ps"] + [f"/job:worker/task:{t}"
                                                    for t in members])
    elif not uses_collectives:
        # This task, the PS tasks, and the worker tasks holding PS variables
        # (a cluster without PS-only tasks).
        filters = {"/job:ps", f"/job:worker/task:{task_index}"}
        for config_ in strategy.variables:
            for sync in config_.shards:
                destination = sync.ps.reduction_destination
                if destination.startswith("/job:worker/"):
                    filters.add(f"/job:worker/task:{replica_task(destination)}")
        config.device_filters.extend(sorted(filters))
    return config


def open_session(target: str, graph: tf.Graph, config: tf.compat.v1.ConfigProto,
                 timeout_s: float) -> tf.compat.v1.Session:
    """A session on `target` whose creation is bounded by `timeout_s`.

    TensorFlow creates the session on the master at the first run, and the
    master waits without end for every task its device filters name (no
    option bounds that wait: not `operation_timeout_in_ms`, not `RunOptions`).
    So the first run, a no-op, goes on a helper thread, and a task that does
    not answer in time is a `WorkerError` instead of a hang.

    Raises:
        WorkerError: naming the target, the device filters and the timeout.
    """
    session = tf.compat.v1.Session(target, graph=graph, config=config)
    with graph.as_default():
        noop = tf.no_op(name="autodist/session_ready")
    outcome: list[BaseException | None] = []

    def first_run() -> None:
        try:
            session.run(noop)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001  # re-raised below
            outcome.append(e)

    thread = threading.Thread(target=first_run, name="autodist-session-create", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        # The thread stays blocked inside TensorFlow; the task is failing anyway.
        raise WorkerError(f"creating a session on {target} did not finish within "
                          f"{timeout_s:g}s: a task among {list(config.device_filters) or 'all'} "
                          "does not answer (down or unreachable)")
    if outcome[0] is not None:
        raise outcome[0]
    return session


def build_program(graph_item: GraphItem, strategy: Strategy, spec: ResourceSpec,
                  task_index: int, timeout_s: float, version: int = 0,
                  elastic: bool = False, atomic: bool = False) -> Program:
    """Runs the three passes for worker task `task_index` (see `SyncOptions`); every
    collective is bounded by `timeout_s` (0: by the session run's timeout only)."""
    program = Program(graph_item, spec, ("worker", task_index), collective_timeout_s=timeout_s,
                      version=version)
    partitioner.apply(program, strategy)
    replicator.apply(program, strategy)
    if not program.replicas:
        raise WorkerError(f"worker task {task_index} has no replica in the strategy "
                          f"(replicas: {strategy.replicas})")
    members = tuple(sorted({replica_task(d) for d in strategy.replicas})) \
        if elastic else tuple(range(spec.num_worker_tasks))
    synchronizer.apply(program, strategy, synchronizer.SyncOptions(
        is_chief=task_index == 0, worker_tasks=len(members), task_index=task_index,
        timeout_s=timeout_s, version=version, elastic=elastic, atomic=atomic,
        members=members))
    return program


@dataclasses.dataclass(frozen=True)
class ProgramSession:
    """One membership's program of this task and the session that runs it.

    Attributes:
        program: The lowered step of this task.
        session: The session on this task's server.
        strategy: The strategy the program runs (for the membership).
        graph_item: The captured step.
        run_options: Every run's options (the step's timeout).
    """

    program: Program
    session: tf.compat.v1.Session
    strategy: Strategy
    graph_item: GraphItem
    run_options: tf.compat.v1.RunOptions

    def run(self, fetches, feed_dict: dict | None = None):
        """Runs `fetches` in the session with the run's options."""
        return self.session.run(fetches, feed_dict=feed_dict, options=self.run_options)
