"""What every synchronizer kind's lowering takes and builds.

The synchronizer pass (`synchronizer.apply`) starts a task's step once
(`StepStart`: the step counter, the learning rate, every replica's scaled
gradient per shard), hands each kind of shard to its lowering
(`SynchronizerLowering`: `all_reduce_synchronizer.AllReduceLowering`,
`ps_synchronizer.SyncPSLowering`, `ps_synchronizer.AsyncPSLowering`), and
ends the step with what they built (`Lowered`). Every lowering aggregates
its shards' gradients and applies the optimizer's updates through
`OptimizerUpdates`; under `SyncOptions.atomic` no update starts before the
gradients it aggregated are in (`atomic_updates`).
"""
from __future__ import annotations

import dataclasses
from typing import ContextManager, Protocol, Sequence

import tensorflow as tf

from autodist.ir.errors import StrategyError
from autodist.ir.graph_item import GraphItem
from autodist.ir.strategy import Strategy
from autodist.kernels.loss_scaling import LossScaleState
from autodist.kernels.optimizers import (ReducedGradient, Slots, apply_constraint, apply_update,
                                         clip_gradients, hyperparameter_tensors)
from autodist.kernels.program import Program, Shard, StorageRole
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
        timeout_s: Bound on every collective (0: none; then the session run's
            own timeout must bound it). Each collective with a timeout makes
            TensorFlow start a thread that sleeps the timeout out, so a fast
            step's collectives pile up threads (collectives/s x timeout).
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


class OptimizerUpdates:
    """The optimizer's updates and gradient clipping for one task's step.

    The hyper-parameter tensors are built once per dtype and step tensor and
    shared by every update that uses them. A constrained variable's update is
    followed by its constraint (`optimizers.apply_constraint`).

    Args:
        graph_item: The captured step (its optimizer).
        strategy: The strategy (its hyper-parameter overrides).
        update_count: The number of updates applied before this step: the
            step of every update not given its own.
        learning_rate: The task's learning-rate variable, or None.
    """

    def __init__(self, graph_item: GraphItem, strategy: Strategy, update_count: tf.Tensor,
                 learning_rate: StorageVariable | None) -> None:
        self.optimizer = graph_item.optimizer
        self.hyperparameters = strategy.hyperparameters
        self.update_count = update_count
        self.learning_rate = learning_rate
        self._hyper_cache: dict[tuple[tf.DType, str], dict[str, tf.Tensor]] = {}
        self._constrained = {v.name: v for v in graph_item.variables
                             if v.HasField("constraint")}

    def apply(self, var, gradient: ReducedGradient, slots: Slots,
              step: tf.Tensor | None = None, finite: tf.Tensor | None = None) -> tf.Operation:
        """One update of `var` (on its device) with its aggregated `gradient`.

        Args:
            var: The variable or shard.
            gradient: Its aggregated (and clipped) gradient.
            slots: Its optimizer slots.
            step: The updates applied before this one; `update_count` if None.
            finite: Under loss scaling, whether the step's gradients are finite.
        """
        dtype = var.dtype.base_dtype
        step = self.update_count if step is None else step
        key = (dtype, step.name)
        if key not in self._hyper_cache:
            with tf.device(None), tf.control_dependencies(None):
                self._hyper_cache[key] = hyperparameter_tensors(
                    self.optimizer, dtype, self.hyperparameters, step,
                    None if self.learning_rate is None else self.learning_rate.read_value())
        update = apply_update(self.optimizer, var, gradient.grad, slots, step,
                              gradient.square, self._hyper_cache[key], gradient.variable,
                              finite=finite)
        info = self._constrained.get(gradient.variable)
        if info is None:
            return update
        if var.shape.as_list() != list(info.shape):
            # Validation keeps constrained variables whole; a shard cannot compute it.
            raise StrategyError(
                f"variable {info.name!r} has a constraint ({info.constraint.class_name}), a "
                f"function of the whole variable, but is updated in shards of shape "
                f"{var.shape.as_list()}", variable=info.name, field="partitioner",
                received=var.shape.as_list())
        return apply_constraint(info.constraint, var, update, finite)

    def clip(self, gradients: Sequence[ReducedGradient],
             occurrences: bool = False) -> list[ReducedGradient]:
        """Keras' clipping of one update group (`optimizers.clip_gradients`)."""
        return clip_gradients(self.optimizer, gradients, self.hyperparameters,
                              occurrences=occurrences)


@dataclasses.dataclass
class StepStart:
    """A task's step as every lowering starts from it.

    Attributes:
        program: The program being lowered.
        strategy: The strategy.
        options: The pass's options.
        step: The step counter (updates applied; shared int64 variable).
        step_value: Its value read at the start of the step.
        loss_scale: The dynamic loss scaling state, or None.
        optimizer: The optimizer's updates and clipping.
        gradients: Replica index -> shard name -> the replica's scaled
            gradient (read back from the stash in a two-phase step).
        scales: Replica index -> its share of the global batch (fed).
        weighted_losses: Each replica's loss times its share.
        learning_rate: The task's learning-rate variable, or None.
        run_outs: The fed count of Keras' extra iterations (`SyncOutputs.run_outs`).
    """

    program: Program
    strategy: Strategy
    options: SyncOptions
    step: StorageVariable
    step_value: tf.Tensor
    loss_scale: LossScaleState | None
    optimizer: OptimizerUpdates
    gradients: dict[int, dict[str, object]]
    scales: dict[int, tf.Tensor]
    weighted_losses: list[tf.Tensor]
    learning_rate: StorageVariable | None
    run_outs: tf.Tensor | None = None


@dataclasses.dataclass
class Lowered:
    """What a lowering built for its shards.

    Attributes:
        updates: The ops applying the updates (and advancing the loss scale).
        pushes: The ops handing this task's gradients to a parameter server
            (synchronous PS only).
    """

    updates: list[tf.Operation]
    pushes: list[tf.Operation] = dataclasses.field(default_factory=list)


class SynchronizerLowering(Protocol):
    """How one kind of shard gets its gradients aggregated and its updates applied."""

    def lower(self, step: StepStart, shards: Sequence[Shard]) -> Lowered:
        """Builds the aggregation and updates of `shards` for this task's replicas.

        Args:
            step: The task's step (its replicas' scaled gradients).
            shards: Every shard of this kind in the strategy, in a fixed order.
        """


def atomic_updates(options: SyncOptions, aggregated: Sequence) -> ContextManager:
    """The scope of a step's updates: under `options.atomic`, they wait for the
    `aggregated` gradients (dense or IndexedSlices)."""
    return tf.control_dependencies(ops_of(aggregated) if options.atomic else None)


def is_async(shard: Shard) -> bool:
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


def ops_of(tensors) -> list[tf.Operation]:
    """The ops producing `tensors` (dense or IndexedSlices)."""
    ops = []
    for t in tensors:
        if isinstance(t, tf.IndexedSlices):
            ops += [t.values.op, t.indices.op]
        else:
            ops.append(t.op)
    return ops


def scale_gradient(grad, scale):
    """`grad` (dense or IndexedSlices) times `scale`, cast to its dtype."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(scale, grad.values.dtype), grad.indices,
                                grad.dense_shape)
    return grad * tf.cast(scale, grad.dtype)
