"""Parameter-server synchronizer.

Synchronous (``sync=True``): every replica pushes its scaled gradient of a
shard into a queue of its own on the shard's PS; the chief takes the sum in
replica order once all replicas have pushed (`OrderedSum`: the same bits on
every rerun, whatever order the gradients arrive in), applies one update there, and then hands
each other worker task a token on its own queue. A worker starts its next
step only with a token, so all replicas read the same variables each step.

Asynchronous (``sync=False``, or bounded staleness): each replica applies
its own gradient to the PS variable as soon as it has it; under bounded
staleness per-task step clocks on the first PS gate how far a task may lead.

Local copies (`local_replication`) are refreshed from the PS once the step's
update of their shard is applied: synchronous shards by the chief right
after its update, by other tasks right after they receive their token;
asynchronous shards (and bounded staleness) after this task's own updates.

`SyncPSLowering` and `AsyncPSLowering` lower these for one task.
"""
from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from autodist.ir.graph_item import optimizer_squares_gradient
from autodist.kernels import loss_scaling
from autodist.kernels.optimizers import ReducedGradient, Slots, dense_gradient
from autodist.kernels.program import Program, Shard
from autodist.kernels.replicator import get_slots, get_storage
from autodist.kernels.sync_lowering import (Lowered, StepStart, SyncOptions, atomic_updates,
                                            scale_gradient, shared_variable)

SCOPE = "autodist/ps"


class OrderedSum:
    """The sum of the replicas' gradients of one shard, in replica order, on its PS.

    Each replica enqueues its gradient into a queue of its own on the shard's
    parameter server (shared by name across tasks); the chief dequeues one
    from each queue in the strategy's replica order and adds them in that
    order. Float addition is not associative, so a sum taken as the
    gradients arrive (a conditional accumulator) differs from run to run in
    the last bits with three or more replicas; this one is the same on every
    rerun. Dense gradients are added (`tf.add_n`, inputs in order); sparse
    ones concatenated in order (their updates add repeated rows in order).

    Args:
        shard: The shard.
        replicas: The indices of the replicas that push a gradient of it.
        purpose: "gradient", or "square" for Keras' squared sparse rows.
        version: Membership version of an elastic job: each version has its
            own queues, so a gradient left by a lost worker is never taken.
    """

    def __init__(self, shard: Shard, replicas, purpose: str = "gradient", version: int = 0):
        self.shard = shard
        self.replicas = list(replicas)
        dtype = tf.as_dtype(shard.dtype)
        dtypes = [dtype, tf.int64] if shard.sparse else [dtype]
        self.queues = {}
        with tf.device(shard.synchronizer.ps.reduction_destination):
            for r in self.replicas:
                name = (f"{SCOPE}/sum/{purpose}/{shard.name}/replica_{r}" +
                        (f"/v{version}" if version else ""))
                # Any shape: a sparse gradient's rows change every step. Two slots: a
                # replica may push the next step before the chief has taken this one.
                self.queues[r] = tf.queue.FIFOQueue(2, dtypes, shared_name=name,
                                                    name=name.replace("/", "_"))

    def push(self, replica: int, grad) -> tf.Operation:
        """Hands in replica `replica`'s gradient (runs on the PS)."""
        if self.shard.sparse:
            return self.queues[replica].enqueue([grad.values, tf.cast(grad.indices, tf.int64)])
        return self.queues[replica].enqueue([grad])

    def take(self):
        """The sum in replica order (blocks until every replica's gradient is in)."""
        with tf.device(self.shard.synchronizer.ps.reduction_destination):
            parts = [self.queues[r].dequeue() for r in self.replicas]
            if self.shard.sparse:
                values = tf.concat([p[0] for p in parts], axis=0)
                indices = tf.concat([p[1] for p in parts], axis=0)
                values = tf.reshape(values, [-1] + list(self.shard.shape[1:]))
                return tf.IndexedSlices(values, indices,
                                        tf.constant(list(self.shard.shape), tf.int64))
            parts = [tf.reshape(p if not isinstance(p, (list, tuple)) else p[0],
                                self.shard.shape) for p in parts]
            return parts[0] if len(parts) == 1 else tf.add_n(parts)


def token_queue(device: str, task_index: int, capacity: int = 4,
                version: int = 0) -> tf.queue.FIFOQueue:
    """The queue through which the chief releases worker task `task_index`."""
    with tf.device(device):
        name = f"{SCOPE}/token_queue/task_{task_index}" + (f"/v{version}" if version else "")
        return tf.queue.FIFOQueue(capacity, [tf.int64], shapes=[[]], shared_name=name,
                                  name=name.replace("/", "_"))


class SyncPSLowering:
    """Synchronous PS shards: every replica pushes, the chief sums in replica order,
    applies one update where the shard lives and releases the other tasks.

    The chief takes every synchronous shard's gradient: one clipping group,
    and under loss scaling one flag of finite gradients, whose scale advance
    comes before the other workers are released (their next step reads it).
    """

    def lower(self, step: StepStart, shards: Sequence[Shard]) -> Lowered:
        """Builds the pushes and the chief's updates of `shards` (see `SynchronizerLowering`)."""
        pushes, takes = [], []
        for shard in shards:
            if not any(shard.name in step.gradients[r.index] for r in step.program.replicas):
                continue
            take, shard_pushes = self._push_and_take(step, shard)
            pushes += shard_pushes
            if take is not None:
                takes.append(take)
        return Lowered(self._apply(step, takes), pushes)

    @staticmethod
    def _push_and_take(step: StepStart, shard: Shard) -> tuple[tuple | None, list]:
        """This task's replicas' pushes of `shard`, and on the chief its take:
        (device, variable, slots, summed gradient)."""
        program, version = step.program, step.options.version
        first = program.replicas[0]
        var = get_storage(program, shard, first)
        slots = Slots(get_slots(program, shard, first))
        destination = shard.synchronizer.ps.reduction_destination
        # Every replica of the strategy pushes; the chief sums in replica order.
        everyone = range(len(step.strategy.replicas))
        total_sum = OrderedSum(shard, everyone, version=version)
        # Keras squares each occurrence of a sparse row: sum those too.
        square_sum = OrderedSum(shard, everyone, "square", version) \
            if shard.sparse and optimizer_squares_gradient(program.graph_item.optimizer) \
            else None
        pushes = []
        for r in program.replicas:
            if shard.name not in step.gradients[r.index]:
                continue
            grad = step.gradients[r.index][shard.name]
            with tf.device(r.device):
                squares = None if square_sum is None else tf.IndexedSlices(
                    tf.square(grad.values), grad.indices, grad.dense_shape)
            with tf.device(destination):   # where the queues are
                pushes.append(total_sum.push(r.index, grad))
                if squares is not None:
                    pushes.append(square_sum.push(r.index, squares))
        if not step.options.is_chief:
            return None, pushes
        # The update runs where the variable lives, once this task's pushes are in.
        with tf.device(destination), tf.control_dependencies(pushes):
            total = total_sum.take()
            total_square = None if square_sum is None else dense_gradient(
                square_sum.take(), shard.shape)
        return (destination, var, slots,
                ReducedGradient(shard.var_name, total, total_square, shard.sparse)), pushes

    @staticmethod
    def _apply(step: StepStart, takes: list[tuple]) -> list[tf.Operation]:
        """The chief's updates of the taken gradients (one clipping group)."""
        gi, loss_scale = step.program.graph_item, step.loss_scale
        aggregated = [t for _, _, _, g in takes for t in (g.grad, g.square) if t is not None]
        finite = None
        if loss_scale is not None and takes:
            with tf.device(loss_scale.scale.device):
                finite = loss_scaling.all_finite(
                    [g.grad for _, _, _, g in takes],
                    [gi.variable(g.variable).gradient.float16_sum for _, _, _, g in takes],
                    loss_scaling.read_scale(loss_scale))
        clipped = step.optimizer.clip([g for _, _, _, g in takes])
        updates = []
        with atomic_updates(step.options, aggregated):
            for (destination, var, slots, _), gradient in zip(takes, clipped):
                with tf.device(destination):
                    updates.append(step.optimizer.apply(var, gradient, slots, finite=finite))
        if finite is not None:
            # Before the other workers are released: their next step reads the scale.
            with tf.device(loss_scale.scale.device):
                updates += loss_scaling.advance(loss_scale, gi.optimizer, finite, after=updates)
        return updates

    @staticmethod
    def release(step: StepStart, shards: Sequence[Shard],
                updates: list[tf.Operation]) -> list[tf.Operation]:
        """On the chief, a token for every other task once `updates` are applied."""
        options = step.options
        if not shards or not options.is_chief:
            return []
        device = shards[0].synchronizer.ps.reduction_destination
        release = []
        with tf.control_dependencies(updates):
            for task in options.tasks:
                if task != options.task_index:
                    release.append(token_queue(device, task, version=options.version)
                                   .enqueue(step.step_value))
        return release

    @staticmethod
    def wait_for_chief(program: Program, options: SyncOptions,
                       shards: Sequence[Shard]) -> tf.Operation | None:
        """On a task other than the chief, what it runs after its step: its token,
        then the refresh of its local copies of `shards`; else None."""
        if not shards or options.is_chief:
            return None
        token = token_queue(shards[0].synchronizer.ps.reduction_destination,
                            options.task_index, version=options.version).dequeue()
        local = [s for s in shards if s.name in program.local_copies]
        return tf.group([token] + refresh_local_copies(program, local, after=[token]),
                        name="autodist/after_step")


class AsyncPSLowering:
    """Asynchronous (and bounded-staleness) PS shards: each replica applies its own
    gradient to the PS shards as soon as it has it.

    A replica's update is a full step on its part of the batch: its gradient
    is its mean-loss gradient (the scaled gradient times the replica count).
    Adam's bias correction counts every update applied, from any replica, on a
    counter shared through the first PS.
    """

    def lower(self, step: StepStart, shards: Sequence[Shard]) -> Lowered:
        """Builds each replica's own updates of `shards` (see `SynchronizerLowering`)."""
        if not shards:
            return Lowered([])
        program = step.program
        device = shards[0].synchronizer.ps.reduction_destination
        counter = shared_variable(program, "async_updates", 0, tf.int64, device)
        replicas = float(len(step.strategy.replicas))
        updates = []
        for r in program.replicas:
            own = step.gradients[r.index]
            mine = [s for s in shards if s.name in own]
            if not mine:
                continue
            with tf.device(device):
                taken = counter.assign_add(1, read_value=True) - 1
            # A replica's own update: its gradients are one clipping group.
            clipped = step.optimizer.clip(
                [ReducedGradient(s.var_name, scale_gradient(own[s.name], replicas),
                                 sparse=s.sparse) for s in mine], occurrences=True)
            for shard, gradient in zip(mine, clipped):
                var = get_storage(program, shard, program.replicas[0])
                slots = Slots(get_slots(program, shard, program.replicas[0]))
                with tf.device(shard.synchronizer.ps.reduction_destination):
                    updates.append(step.optimizer.apply(var, gradient, slots, step=taken))
        return Lowered(updates)

    @staticmethod
    def clocks(program: Program, options: SyncOptions, shards: Sequence[Shard], after):
        """Per-task step clocks on the first PS, for the bounded-staleness gate.

        Also creates the shared count of the tasks that finished (each counts
        itself when done; the chief reads the weights after all).

        Returns:
            (tick op of this task, run after `after`; read op of all clocks;
            staleness bound, 0 for plain asynchronous training).
        """
        staleness = max((s.synchronizer.ps.staleness for s in shards), default=0)
        device = shards[0].synchronizer.ps.reduction_destination
        clocks = [shared_variable(program, f"clock_{t}", 0, tf.int64, device)
                  for t in options.tasks]
        with tf.control_dependencies(after):
            tick = clocks[options.tasks.index(options.task_index)].assign_add(1, read_value=False)
        ssp = tick, tf.stack([c.read_value() for c in clocks]), staleness
        shared_variable(program, "finished", 0, tf.int64, device)
        return ssp


def refresh_local_copies(program: Program, shards: Sequence[Shard],
                         after) -> list[tf.Operation]:
    """Copies each PS shard's value into this task's local copy, once `after` has run.

    One read of the shard on its PS per call; the copy is written on this
    task's CPU.
    """
    ops = []
    for shard in shards:
        local = program.local_copies[shard.name]
        with tf.control_dependencies(after), \
                tf.device(shard.synchronizer.ps.reduction_destination):
            value = get_storage(program, shard, program.replicas[0]).read_value()
        with tf.device(local.device):
            ops.append(local.assign(value, read_value=False))
    return ops
