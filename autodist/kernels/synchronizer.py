"""Synchronizer pass: aggregate gradients and apply updates as the strategy says.

Builds, for one task, the `train_op` that runs a step of its local replicas:
scaled gradients (each replica's gradient of its mean loss times its share of
the global batch, so uneven batches weigh correctly), split per shard, then
per kind of shard its lowering (`sync_lowering.SynchronizerLowering`):
collective reduction (`all_reduce_synchronizer.AllReduceLowering`) or the PS
protocol, synchronous or asynchronous / bounded-stale
(`ps_synchronizer.SyncPSLowering`, `ps_synchronizer.AsyncPSLowering`), each
ending in the optimizer update (`optimizers`). A step mixing collectives and
PS work runs in two session runs (`two_phase`).

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
from autodist.ir.strategy import Strategy
from autodist.kernels import all_reduce_synchronizer, loss_scaling, ps_synchronizer, two_phase
from autodist.kernels.optimizers import check_supported, clip_occurrences
from autodist.kernels.partitioner import split_gradient
from autodist.kernels.program import Program, Shard, Stage, StorageRole, SyncOutputs
from autodist.kernels.sync_lowering import Lowered, OptimizerUpdates, StepStart, scale_gradient
# Re-exported: they were defined here before.
from autodist.kernels.sync_lowering import SyncOptions, is_async, shared_variable  # noqa: F401
from autodist.kernels.variables import VariableSpec, create_variable


@dataclasses.dataclass
class _ShardKinds:
    """A program's shards by synchronizer kind, each in the strategy's order."""

    all: list[Shard]
    all_reduce: list[Shard]
    sync_ps: list[Shard]
    async_ps: list[Shard]

    @classmethod
    def of(cls, program: Program) -> _ShardKinds:
        shards = [s for var in program.graph_item.variables for s in program.shards[var.name]]
        return cls(shards, [s for s in shards if s.kind == "all_reduce"],
                   [s for s in shards if s.kind == "ps" and not is_async(s)],
                   [s for s in shards if s.kind == "ps" and is_async(s)])


def apply(program: Program, strategy: Strategy, options: SyncOptions) -> Program:
    """REPLICATED -> SYNCHRONIZED: builds the train op of this task."""
    program.require(Stage.REPLICATED, "synchronizer")
    check_supported(program.graph_item.optimizer)
    kinds = _ShardKinds.of(program)
    with program.graph.as_default():
        step = _start_step(program, strategy, options, kinds.all)
        all_reduced = all_reduce_synchronizer.AllReduceLowering().lower(step, kinds.all_reduce)
        runs_two = two_phase.needed(program, kinds.all_reduce, kinds.sync_ps + kinds.async_ps)
        stashes = []
        if runs_two:
            step.gradients, stashes = two_phase.stash_ps_gradients(program, kinds.all,
                                                                   step.gradients)
        synchronous = ps_synchronizer.SyncPSLowering()
        sync_lowered = synchronous.lower(step, kinds.sync_ps)
        async_lowered = ps_synchronizer.AsyncPSLowering().lower(step, kinds.async_ps)
        ps_work, ssp = _ps_work(step, kinds, sync_lowered, async_lowered,
                                forward=[] if runs_two else two_phase.forward_ops(program))
        updates = all_reduced.updates
        if (kinds.all_reduce or program.step_collectives) and options.elastic:
            updates = updates + [all_reduce_synchronizer.version_tag(
                options.task_index, options.version, program.replicas[0].device,
                options.timeout_s)]
        state_updates = [op for r in program.replicas for op in r.state_updates]
        train_op, ps_op = two_phase.train_ops(step, updates + state_updates, stashes, ps_work,
                                              runs_two, bool(kinds.all_reduce))
        after_step = synchronous.wait_for_chief(program, options, kinds.sync_ps)
        program.outputs = _outputs(step, kinds, train_op, ps_op, after_step, ssp)
    program.stage = Stage.SYNCHRONIZED
    return program


def _start_step(program: Program, strategy: Strategy, options: SyncOptions,
                shards: list[Shard]) -> StepStart:
    """The step counter, learning rate and loss scale, and every replica's scaled
    gradient per shard."""
    first_device = program.replicas[0].device
    step = create_variable(program.graph, VariableSpec("autodist/step", (), tf.int64,
                                                       first_device))
    step_value = step.read_value()
    learning_rate = _learning_rate_variable(program, strategy, first_device)
    loss_scale = loss_scaling.state_of(program)
    if loss_scale is not None:
        _check_loss_scaling(shards)
    # Updates applied before this step's (under loss scaling, finite steps only), plus
    # the iterations Keras counts when a step finds the data's end (fed).
    run_outs = None
    if loss_scale is None:
        with tf.device(first_device):
            run_outs = tf.compat.v1.placeholder_with_default(
                tf.constant(0, tf.int64), [], name="autodist/run_outs")
    update_count = step_value + run_outs if loss_scale is None else \
        loss_scale.updates.read_value()
    start = StepStart(program, strategy, options, step, step_value, loss_scale,
                      OptimizerUpdates(program.graph_item, strategy, update_count, learning_rate),
                      gradients={}, scales={}, weighted_losses=[], learning_rate=learning_rate,
                      run_outs=run_outs)
    for replica in program.replicas:
        with tf.device(replica.device):
            scale = replica.scale
            start.scales[replica.index] = scale
            start.weighted_losses.append(tf.cast(replica.loss, tf.float32) * scale)
            # Under loss scaling the replica's share is in its gradients already
            # (`loss_scaling`): they are divided by the scale.
            multiplier = scale if loss_scale is None else \
                tf.math.reciprocal(loss_scaling.read_scale(loss_scale))
            if loss_scale is None and len(strategy.replicas) == 1:
                multiplier = None  # the one replica's share is the whole batch: 1
            start.gradients[replica.index] = _scaled_gradients(program, strategy, replica,
                                                               multiplier)
    return start



def _scaled_gradients(program: Program, strategy: Strategy, replica,
                      multiplier) -> dict[str, object]:
    """Shard name -> `replica`'s gradient of it times `multiplier` (None: 1; each occurrence
    of a sparse row clipped, except where the replica applies its own update)."""
    gi = program.graph_item
    per_shard = {}
    for var in gi.variables:
        grad = replica.gradients.get(var.name)
        if grad is None:
            continue
        for shard, part in zip(program.shards[var.name],
                               split_gradient(grad, program.shards[var.name])):
            if multiplier is not None:
                part = scale_gradient(part, multiplier)
            if not (shard.kind == "ps" and is_async(shard)):
                part = clip_occurrences(gi.optimizer, part, strategy.hyperparameters)
            per_shard[shard.name] = part
    return per_shard


def _ps_work(step: StepStart, kinds: _ShardKinds, sync_lowered: Lowered,
             async_lowered: Lowered, forward: list) -> tuple[list, tuple | None]:
    """The PS protocol's ops of the step (updates, pushes, tokens, refreshes of local
    copies, this task's clock tick), and the bounded-staleness clocks or None.

    Args:
        forward: In a one-run step, the replicas' reads, which refreshes wait for.
    """
    program, options = step.program, step.options
    local_sync = [s for s in kinds.sync_ps if s.name in program.local_copies]
    refreshes = ps_synchronizer.refresh_local_copies(
        program, [s for s in kinds.async_ps if s.name in program.local_copies],
        after=async_lowered.updates + forward)
    if options.is_chief:
        refreshes += ps_synchronizer.refresh_local_copies(
            program, local_sync, after=sync_lowered.updates + forward)
    release = ps_synchronizer.SyncPSLowering.release(step, kinds.sync_ps, sync_lowered.updates)
    ps_work = (sync_lowered.updates + sync_lowered.pushes + release + async_lowered.updates +
               refreshes)
    if not kinds.async_ps:
        return ps_work, None
    ssp = ps_synchronizer.AsyncPSLowering.clocks(program, options, kinds.async_ps,
                                                 after=ps_work)
    return ps_work + [ssp[0]], ssp


def _outputs(step: StepStart, kinds: _ShardKinds, train_op: tf.Operation,
             ps_op: tf.Operation | None, after_step: tf.Operation | None,
             ssp: tuple | None) -> SyncOutputs:
    """The pass's results, with the refresh of every local copy (run once the PS
    is initialized)."""
    program = step.program
    all_local = [s for s in kinds.all if s.name in program.local_copies]
    refresh = tf.group(ps_synchronizer.refresh_local_copies(program, all_local, after=[]),
                       name="autodist/refresh") if all_local else None
    return SyncOutputs(
        train_op=train_op, ps_op=ps_op, after_step=after_step, scales=step.scales,
        weighted_loss=tf.add_n(step.weighted_losses), step=step.step, ssp=ssp,
        asynchronous=bool(kinds.async_ps), refresh=refresh, learning_rate=step.learning_rate,
        run_outs=step.run_outs)


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
