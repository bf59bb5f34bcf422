"""Synchronizer pass: aggregate gradients and apply updates as the strategy says.

Builds, for one task, the `train_op` that runs a step of its local replicas:
scaled gradients (each replica's gradient of its mean loss times its share of
the global batch, so uneven batches weigh correctly), split per shard, then
per shard either the PS protocol (`ps_synchronizer`) or collective reduction
(`all_reduce_synchronizer`), then the optimizer update (`optimizers`).

The results are `program.outputs` (`program.SyncOutputs`): the train op,
the scale placeholders, this task's part of the global loss, the update
count, what a non-chief task runs to wait for the chief, and the refresh of
this task's local copies.

Local copies (`local_replication`) are refreshed from the PS once the step's
update of their shard is applied: synchronous shards by the chief right
after its update, by other tasks right after they receive their token;
asynchronous shards (and bounded staleness) after this task's own updates.
So the next step reads exactly what it would have read from the PS in
synchronous training. Under bounded staleness the copy is refreshed before
the gate, so updates landing while the task waits there reach it one step
later.
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from autodist.ir.errors import StrategyError
from autodist.ir.graph_item import optimizer_squares_gradient
from autodist.ir.strategy import Strategy
from autodist.kernels import all_reduce_synchronizer as ar
from autodist.kernels import ps_synchronizer as ps
from autodist.kernels import loss_scaling, replica_sums
from autodist.kernels.optimizers import (ReducedGradient, Slots, apply_update, check_supported,
                                         clip_gradients, clip_occurrences, dense_gradient,
                                         hyperparameter_tensors)
from autodist.kernels.partitioner import split_gradient
from autodist.kernels.program import Program, Stage, StorageRole, SyncOutputs
from autodist.kernels.replicator import get_slots, get_storage
from autodist.kernels.variables import StorageVariable, VariableSpec, create_variable


@dataclasses.dataclass
class SyncOptions:
    """Options of the synchronizer pass.

    Attributes:
        is_chief: This task is the chief (applies synchronous PS updates).
        worker_tasks: Number of worker tasks in the job.
        members: The job's worker task indices, when not 0..worker_tasks-1
            (an elastic membership without some task, e.g. (0, 2)).
        task_index: This worker task's index.
        timeout_s: Bound on every collective.
        version: Membership version of an elastic job (0 otherwise): new
            collective group keys and PS accumulators / token queues per
            version.
        elastic: The job may resize: every step with collectives also runs
            the version tag (`all_reduce_synchronizer.version_tag`).
        atomic: No update starts before every gradient of the step is
            aggregated (all collectives done, all PS takes done), so a step
            that fails because a worker died applies no update at all and
            the job can go on from the last completed step.
    """

    is_chief: bool
    worker_tasks: int
    task_index: int
    timeout_s: float = 60.0
    version: int = 0
    elastic: bool = False
    atomic: bool = False
    members: tuple[int, ...] | None = None

    @property
    def tasks(self) -> tuple[int, ...]:
        """The job's worker task indices."""
        return self.members if self.members is not None else tuple(range(self.worker_tasks))


def apply(program: Program, strategy: Strategy, options: SyncOptions) -> Program:
    """REPLICATED -> SYNCHRONIZED: builds the train op of this task."""
    program.require(Stage.REPLICATED, "synchronizer")
    gi = program.graph_item
    check_supported(gi.optimizer)
    all_shards = [s for var in gi.variables for s in program.shards[var.name]]
    ar_shards = [s for s in all_shards if s.kind == "all_reduce"]
    with program.graph.as_default():
        hyper_cache: dict[tuple[tf.DType, str], dict[str, tf.Tensor]] = {}
        def update(var, gradient: ReducedGradient, slots, step=None, finite=None):
            dtype = var.dtype.base_dtype
            step = update_count if step is None else step
            key = (dtype, step.name)
            if key not in hyper_cache:
                with tf.device(None), tf.control_dependencies(None):
                    hyper_cache[key] = hyperparameter_tensors(
                        gi.optimizer, dtype, strategy.hyperparameters, step,
                        None if learning_rate is None else learning_rate.read_value())
            return apply_update(gi.optimizer, var, gradient.grad, slots, step, gradient.square,
                                hyper_cache[key], gradient.variable, finite=finite)

        def clip(gradients, occurrences=False):
            return clip_gradients(gi.optimizer, gradients, strategy.hyperparameters,
                                  occurrences=occurrences)

        first_device = program.replicas[0].device
        step = create_variable(program.graph, VariableSpec("autodist/step", (), tf.int64,
                                                           first_device))
        step_value = step.read_value()
        learning_rate = _learning_rate_variable(program, strategy, first_device)
        loss_scale = loss_scaling.state_of(program)
        if loss_scale is not None:
            _check_loss_scaling(all_shards)
        # Updates applied before this step's (under loss scaling, finite steps only).
        update_count = step_value if loss_scale is None else loss_scale.updates.read_value()
        advances = []
        scales = {}
        scaled: dict[int, dict[str, object]] = {}
        weighted_losses = []
        for replica in program.replicas:
            with tf.device(replica.device):
                scale = replica.scale
                scales[replica.index] = scale
                weighted_losses.append(tf.cast(replica.loss, tf.float32) * scale)
                # Under loss scaling the replica's share is in its gradients already
                # (`loss_scaling`): they are divided by the scale.
                multiplier = scale if loss_scale is None else \
                    tf.math.reciprocal(loss_scaling.read_scale(loss_scale))
                per_shard = {}
                for var in gi.variables:
                    grad = replica.gradients.get(var.name)
                    if grad is None:
                        continue
                    for shard, part in zip(program.shards[var.name],
                                           split_gradient(grad, program.shards[var.name])):
                        part = _scale(part, multiplier)
                        if not (shard.kind == "ps" and is_async(shard)):
                            part = clip_occurrences(gi.optimizer, part,
                                                    strategy.hyperparameters)
                        per_shard[shard.name] = part
                scaled[replica.index] = per_shard
        updates = []
        pushes = []
        # All-reduce shards: reduce, then each replica updates its own copy.
        ar_results = []
        for replica in program.replicas:
            with tf.device(replica.device):
                reduced = ar.reduce_gradients(
                    program, replica, ar_shards,
                    {s.name: scaled[replica.index][s.name] for s in ar_shards
                     if s.name in scaled[replica.index]},
                    ar.CollectiveConfig(len(strategy.replicas), options.timeout_s,
                                        options.version), step_value,
                    squares=optimizer_squares_gradient(gi.optimizer))
                mine = [s for s in ar_shards if s.name in reduced.gradients]
                finite = None if loss_scale is None or not mine else loss_scaling.all_finite(
                    [reduced.gradients[s.name] for s in mine],
                    [gi.variable(s.var_name).gradient.float16_sum for s in mine],
                    loss_scaling.read_scale(loss_scale))
                # Clipped per replica: each holds every all-reduced gradient.
                clipped = clip([ReducedGradient(s.var_name, reduced.gradients[s.name],
                                                reduced.squares.get(s.name), s.sparse)
                                for s in mine])
                ar_results += [(replica, s, g, finite) for s, g in zip(mine, clipped)]
        with tf.control_dependencies(_ops_of([g.grad for _, _, g, _ in ar_results])
                                     if options.atomic else None):
            for replica, shard, gradient, finite in ar_results:
                with tf.device(replica.device):
                    var = get_storage(program, shard, replica)
                    updates.append(update(var, gradient,
                                          Slots(get_slots(program, shard, replica)),
                                          finite=finite))
        if loss_scale is not None and ar_results:
            # Every replica's reduced gradients are the same: the first one's flag.
            with tf.device(loss_scale.scale.device):
                advances = loss_scaling.advance(loss_scale, gi.optimizer, ar_results[0][3],
                                                after=updates)
            updates = updates + advances
        # PS shards. With collectives in the step, TensorFlow gives every worker's
        # step the same step id (collective graphs are coordinated); two workers'
        # steps with one id on a shared PS task abort each other ("Cleanup
        # <step_id>"). So the PS protocol then runs in a second session run
        # without collectives, on gradients stashed in worker-local variables.
        sync_ps = [s for s in all_shards if s.kind == "ps" and not is_async(s)]
        async_ps = [s for s in all_shards if s.kind == "ps" and is_async(s)]
        has_sync_ps = bool(sync_ps)
        collectives = bool(ar_shards) or program.step_collectives
        two_phase = bool(sync_ps or async_ps) and collectives
        stashes = []
        if two_phase:
            scaled, stashes = _stash_ps_gradients(program, all_shards, scaled)
        ps_sync_updates = []
        ps_takes = []
        for shard in sync_ps:
            replicas_with_grad = [r for r in program.replicas if shard.name in scaled[r.index]]
            if not replicas_with_grad:
                continue
            var = get_storage(program, shard, program.replicas[0])
            slots = Slots(get_slots(program, shard, program.replicas[0]))
            destination = shard.synchronizer.ps.reduction_destination
            # Every replica of the strategy pushes; the chief sums in replica order.
            everyone = range(len(strategy.replicas))
            total_sum = ps.OrderedSum(shard, everyone, version=options.version)
            # Keras squares each occurrence of a sparse row: sum those too.
            square_sum = ps.OrderedSum(shard, everyone, "square", options.version) \
                if shard.sparse and optimizer_squares_gradient(gi.optimizer) else None
            shard_pushes = []
            for r in replicas_with_grad:
                grad = scaled[r.index][shard.name]
                with tf.device(r.device):
                    squares = None if square_sum is None else tf.IndexedSlices(
                        tf.square(grad.values), grad.indices, grad.dense_shape)
                with tf.device(destination):   # where the queues are
                    shard_pushes.append(total_sum.push(r.index, grad))
                    if squares is not None:
                        shard_pushes.append(square_sum.push(r.index, squares))
            pushes += shard_pushes
            if options.is_chief:
                # The update runs where the variable lives, once this task's pushes are in.
                with tf.device(destination), tf.control_dependencies(shard_pushes):
                    total = total_sum.take()
                    total_square = None if square_sum is None else dense_gradient(
                        square_sum.take(), shard.shape)
                ps_takes.append((destination, var, slots,
                                 ReducedGradient(shard.var_name, total, total_square,
                                                 shard.sparse)))
        takes_done = _ops_of([t for _, _, _, g in ps_takes
                              for t in (g.grad, g.square) if t is not None])
        # The chief takes every synchronous shard's gradient: one clipping group.
        finite = None
        if loss_scale is not None and ps_takes:
            with tf.device(loss_scale.scale.device):
                finite = loss_scaling.all_finite(
                    [g.grad for _, _, _, g in ps_takes],
                    [gi.variable(g.variable).gradient.float16_sum for _, _, _, g in ps_takes],
                    loss_scaling.read_scale(loss_scale))
        clipped = clip([g for _, _, _, g in ps_takes])
        with tf.control_dependencies(takes_done if options.atomic else None):
            for (destination, var, slots, _), gradient in zip(ps_takes, clipped):
                with tf.device(destination):
                    ps_sync_updates.append(update(var, gradient, slots, finite=finite))
        if finite is not None:
            # Before the other workers are released: their next step reads the scale.
            with tf.device(loss_scale.scale.device):
                ps_sync_updates += loss_scaling.advance(loss_scale, gi.optimizer, finite,
                                                        after=ps_sync_updates)
        async_updates = _async_updates(program, strategy, async_ps, scaled, update, clip)
        # In one run with the forward pass, a refresh must also wait for its reads.
        forward = [] if two_phase else _forward_ops(program)
        local_sync = [s for s in sync_ps if s.name in program.local_copies]
        refreshes = _refresh(program, [s for s in async_ps if s.name in program.local_copies],
                             after=async_updates + forward)
        if options.is_chief:
            refreshes += _refresh(program, local_sync, after=ps_sync_updates + forward)
        state_updates = [op for r in program.replicas for op in r.state_updates]
        release = []
        queue_device = sync_ps[0].synchronizer.ps.reduction_destination if sync_ps else None
        if has_sync_ps and options.is_chief:
            with tf.control_dependencies(ps_sync_updates):
                for task in options.tasks:
                    if task != options.task_index:
                        release.append(ps.token_queue(queue_device, task, version=options.version)
                                       .enqueue(step_value))
        staleness = max((s.synchronizer.ps.staleness for s in async_ps), default=0)
        ps_work = ps_sync_updates + pushes + release + async_updates + refreshes
        ssp = _ssp_clocks(program, options, async_ps, staleness, after=ps_work) \
            if async_ps else None
        if ssp is not None:
            ps_work = ps_work + [ssp[0]]
            # Counted by each worker when done; the chief reads the weights after all.
            shared_variable(program, "finished", 0, tf.int64,
                            async_ps[0].synchronizer.ps.reduction_destination)
        if collectives and options.elastic:
            updates = updates + [ar.version_tag(options.task_index, options.version,
                                                program.replicas[0].device)]
        if two_phase:
            first = updates + state_updates + stashes + [r.loss for r in program.replicas]
            if not ar_shards:
                # The step's own sums over replicas may come before some reads of PS
                # variables; every worker's collective run shares one step id, and the
                # first to finish would clean up the PS's part of the others'. A last
                # collective, after all of each replica's work, ends them together.
                first = _barrier(program, strategy, options, first)
            train_op = tf.group(first, name="autodist/train_op")
            with tf.control_dependencies(ps_work):
                ps_op = tf.group(step.assign_add(1, read_value=False), name="autodist/ps_op")
        else:
            with tf.control_dependencies(updates + state_updates + ps_work):
                train_op = tf.group(step.assign_add(1, read_value=False),
                                    name="autodist/train_op")
            ps_op = None
        after_step = None
        if has_sync_ps and not options.is_chief:
            token = ps.token_queue(queue_device, options.task_index,
                                   version=options.version).dequeue()
            after_step = tf.group([token] + _refresh(program, local_sync, after=[token]),
                                  name="autodist/after_step")
        all_local = [s for s in all_shards if s.name in program.local_copies]
        refresh = tf.group(_refresh(program, all_local, after=[]), name="autodist/refresh") \
            if all_local else None
        program.outputs = SyncOutputs(
            train_op=train_op, ps_op=ps_op, after_step=after_step, scales=scales,
            weighted_loss=tf.add_n(weighted_losses), step=step, ssp=ssp,
            asynchronous=bool(async_ps), refresh=refresh, learning_rate=learning_rate)
    program.stage = Stage.SYNCHRONIZED
    return program


def _check_loss_scaling(shards) -> None:
    """Dynamic loss scaling needs one finite flag per step for every update: all
    shards all-reduced, or all on synchronous parameter servers."""
    groups = sorted({"all-reduce" if s.kind == "all_reduce" else
                     "asynchronous PS" if is_async(s) else "synchronous PS" for s in shards})
    if len(groups) > 1 or groups == ["asynchronous PS"]:
        # `Strategy.validate` refuses these before launch, with the reason.
        raise StrategyError("dynamic loss scaling needs every variable all-reduced or every "
                            f"one on synchronous parameter servers; received {groups}",
                            field="shards", received=groups)


def _learning_rate_variable(program: Program, strategy: Strategy, device: str):
    """This task's learning rate, a variable the worker sets (a callback may change a
    fixed rate between epochs); None for a schedule or a rate the strategy fixes."""
    rate = program.graph_item.optimizer.hyperparameters.get("learning_rate")
    if rate is None or "learning_rate" in strategy.hyperparameters:
        return None
    name = "autodist/learning_rate"
    variable = create_variable(program.graph, VariableSpec(name, (), tf.float32, device,
                                                           initial=float(rate)))
    program.storage[name] = variable
    program.roles[name] = StorageRole("internal")  # local: starts at the captured rate
    return variable


def _barrier(program: Program, strategy: Strategy, options: SyncOptions, after: list) -> list:
    """One collective per replica, run after `after`: no replica's collective run ends
    before every replica's work is done."""
    config = ar.CollectiveConfig(len(strategy.replicas), options.timeout_s, options.version)
    config = dataclasses.replace(config, version=options.version + replica_sums.GROUP_KEY -
                                 ar.GROUP_KEY)
    out = []
    for replica in program.replicas:
        with tf.device(replica.device), tf.control_dependencies(after):
            out.append(ar.collective_sum(tf.zeros([], tf.float32),
                                         tf.constant(replica_sums.BARRIER_KEY), config).op)
    return out


def is_async(shard) -> bool:
    """A PS shard whose replicas apply their own updates (async, or bounded staleness)."""
    ps_sync = shard.synchronizer.ps
    return not ps_sync.sync or ps_sync.staleness > 0


def shared_variable(program: Program, name: str, initial: int | float, dtype: tf.DType,
                    device: str) -> StorageVariable:
    """A scalar variable every task shares by name; the chief initializes it."""
    key = f"autodist/shared/{name}"
    if key not in program.storage:
        program.storage[key] = create_variable(
            program.graph, VariableSpec(key, (), dtype, device, initial,
                                        role=StorageRole("shared")))
        program.roles[key] = StorageRole("shared")
    return program.storage[key]


def _async_updates(program: Program, strategy: Strategy, shards, scaled, update, clip) -> list:
    """Each replica applies its own gradient to the PS shards as soon as it has it.

    A replica's update is a full step on its part of the batch: its gradient
    is its mean-loss gradient (the scaled gradient times the replica count).
    Adam's bias correction counts every update applied, from any replica, on a
    counter shared through the first PS.
    """
    if not shards:
        return []
    counter = shared_variable(program, "async_updates", 0, tf.int64,
                              shards[0].synchronizer.ps.reduction_destination)
    updates = []
    for r in program.replicas:
        mine = [s for s in shards if s.name in scaled[r.index]]
        if not mine:
            continue
        with tf.device(shards[0].synchronizer.ps.reduction_destination):
            taken = counter.assign_add(1, read_value=True) - 1
        # A replica's own update: its gradients are one clipping group.
        own = clip([ReducedGradient(s.var_name,
                                    _scale(scaled[r.index][s.name], float(len(strategy.replicas))),
                                    sparse=s.sparse)
                    for s in mine], occurrences=True)
        for shard, gradient in zip(mine, own):
            var = get_storage(program, shard, program.replicas[0])
            slots = Slots(get_slots(program, shard, program.replicas[0]))
            with tf.device(shard.synchronizer.ps.reduction_destination):
                updates.append(update(var, gradient, slots, step=taken))
    return updates


def _forward_ops(program: Program) -> list[tf.Operation]:
    """The ops whose completion means this task's replicas have done all their reads.

    Every read that runs in a step feeds a replica's loss, gradients or state
    updates (nothing else of the imported step is fetched).
    """
    ops = []
    for replica in program.replicas:
        ops.append(replica.loss.op)
        for grad in replica.gradients.values():
            if isinstance(grad, tf.IndexedSlices):
                ops += [grad.values.op, grad.indices.op]
            else:
                ops.append(grad.op)
        ops += [u if isinstance(u, tf.Operation) else u.op for u in replica.state_updates]
    return ops


def _refresh(program: Program, shards, after) -> list[tf.Operation]:
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


def _ssp_clocks(program: Program, options: SyncOptions, shards, staleness: int, after):
    """Per-task step clocks on the first PS, for the bounded-staleness gate.

    Returns:
        (tick op of this task, run after `after`; read op of all clocks;
        staleness bound, 0 for plain asynchronous training).
    """
    device = shards[0].synchronizer.ps.reduction_destination
    clocks = [shared_variable(program, f"clock_{t}", 0, tf.int64, device)
              for t in options.tasks]
    with tf.control_dependencies(after):
        tick = clocks[options.tasks.index(options.task_index)].assign_add(1, read_value=False)
    return tick, tf.stack([c.read_value() for c in clocks]), staleness


def _stash_ps_gradients(program: Program, shards, scaled):
    """Worker-local copies of the PS shards' gradients, written by the first run.

    Returns:
        (gradients read back from the stash, per replica and shard; the ops
        that write the stash).
    """
    reads: dict[int, dict[str, object]] = {}
    writes = []
    for replica in program.replicas:
        reads[replica.index] = dict(scaled[replica.index])
        for shard in shards:
            grad = scaled[replica.index].get(shard.name)
            if shard.kind != "ps" or grad is None:
                continue
            base = f"autodist/stash/{shard.name}/replica_{replica.index}"
            with tf.device(replica.device):
                if isinstance(grad, tf.IndexedSlices):
                    values = _stash_variable(program, f"{base}/values", grad.values.dtype)
                    indices = _stash_variable(program, f"{base}/indices", grad.indices.dtype)
                    writes += [values.assign(grad.values, read_value=False),
                               indices.assign(grad.indices, read_value=False)]
                    reads[replica.index][shard.name] = tf.IndexedSlices(
                        values.read_value(), indices.read_value(), grad.dense_shape)
                else:
                    dense = _stash_variable(program, base, grad.dtype)
                    writes.append(dense.assign(grad, read_value=False))
                    reads[replica.index][shard.name] = tf.reshape(dense.read_value(),
                                                                  shard.shape)
    return reads, writes


def _stash_variable(program: Program, name: str, dtype: tf.DType) -> StorageVariable:
    # Any shape: sparse gradients change their row count every step. Placed by
    # the caller's device scope (its replica's device).
    var = create_variable(program.graph, VariableSpec(name, None, dtype, "", 0,
                                                      initial_shape=(0,)))
    program.storage[name] = var
    program.roles[name] = StorageRole("internal")
    return var


def _ops_of(tensors) -> list[tf.Operation]:
    """The ops producing `tensors` (dense or IndexedSlices)."""
    ops = []
    for t in tensors:
        if isinstance(t, tf.IndexedSlices):
            ops += [t.values.op, t.indices.op]
        else:
            ops.append(t.op)
    return ops


def _scale(grad, scale):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(scale, grad.values.dtype), grad.indices,
                                grad.dense_shape)
    return grad * tf.cast(scale, grad.dtype)
