"""Keras' dynamic loss scaling, as a LossScaleOptimizer (the 'mixed_float16' policy) does it.

Keras differentiates the loss times a dynamic scale, so that small float16
gradients do not flush to zero; it applies an update only when every
gradient is finite, after dividing them by the scale; after
`dynamic_growth_steps` finite steps in a row the scale doubles, and a step
with an infinite or NaN gradient halves it and updates nothing (the inner
optimizer's update count, Adam's bias correction and a learning-rate schedule
do not advance either).

The distributed step does the same:

- each replica differentiates its loss times the scale times its share of
  the global batch (the step's `graph_item.LOSS_SCALE_INPUT`), so each
  example's part of the backward pass is what it is in Keras' one batch
  (the same float16 overflows, not ones of a larger per-replica mean);
- the gradients are divided by the scale before they are aggregated;
- a step is finite where every aggregated gradient is, and where Keras
  computes a gradient as one float16 sum over the batch (a layer computing in
  float16), where that sum times the scale is finite in float16: the parts
  of the batch that replicas and virtual nodes sum overflow less often than
  the whole batch's sum, whose overflow is what Keras sees;
- the updates write through `Gated` variables: when the step's aggregated
  gradients are not all finite, each write leaves its variable as it was;
- `advance` then moves the scale, its counter and the update count.

The state lives in three storage variables named as checkpoints name them
(`SCALE`, `COUNTER`, `UPDATES`). All-reduce strategies keep one copy per
task: every task sees the same all-reduced gradients (an infinity or NaN
survives the sum), so the copies agree. Synchronous parameter-server
strategies keep one on the first shard's parameter server, which the chief
updates before it releases the other workers' next step.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import tensorflow as tf

from autodist.kernels.program import Program, StorageRole
from autodist.kernels.variables import StorageVariable, VariableSpec, create_variables
from autodist.proto import graph_item_pb2

SCALE = "optimizer/loss_scale"
COUNTER = "optimizer/loss_scale_counter"
UPDATES = "optimizer/updates"
NAMES = (SCALE, COUNTER, UPDATES)


def enabled(info: graph_item_pb2.OptimizerInfo) -> bool:
    """Whether the captured optimizer scales the loss dynamically."""
    return info.HasField("loss_scale")


@dataclasses.dataclass
class LossScaleState:
    """The storage of dynamic loss scaling in one task's program.

    Attributes:
        scale: The current scale (float32).
        counter: Finite steps in a row since the scale last changed (int64).
        updates: Updates applied (int64): Keras' `optimizer.iterations`,
            which steps with non-finite gradients do not count.
    """

    scale: StorageVariable
    counter: StorageVariable
    updates: StorageVariable


def create_state(program: Program, device: str, shared: bool) -> LossScaleState:
    """Creates (once per program) the loss-scaling storage on `device`.

    Args:
        program: The task's program (its graph item has `loss_scale`).
        device: Where the state lives.
        shared: One copy for the job (on a parameter server, initialized by
            the chief), else one per task.
    """
    if SCALE not in program.storage:
        role = StorageRole("shared" if shared else "internal")
        info = program.graph_item.optimizer.loss_scale
        specs = [VariableSpec(SCALE, (), tf.float32, device, float(info.initial_scale), role=role),
                 VariableSpec(COUNTER, (), tf.int64, device, 0, role=role),
                 VariableSpec(UPDATES, (), tf.int64, device, 0, role=role)]
        for spec, var in zip(specs, create_variables(program.graph, specs)):
            program.storage[spec.name] = var
            program.roles[spec.name] = role
    return state_of(program)


def state_of(program: Program) -> LossScaleState | None:
    """The program's loss-scaling storage, or None without loss scaling."""
    if SCALE not in program.storage:
        return None
    return LossScaleState(*(program.storage[name] for name in NAMES))


def read_scale(state: LossScaleState) -> tf.Tensor:
    """A read of the current scale, on the scale's device."""
    with tf.device(state.scale.device):
        return state.scale.read_value()


def all_finite(gradients: Sequence[Any], float16_sums: Sequence[bool] = (),
               scale: tf.Tensor | None = None) -> tf.Tensor:
    """True where every element of every gradient (dense or IndexedSlices) is finite.

    Args:
        gradients: The step's aggregated (unscaled) gradients.
        float16_sums: Per gradient, whether Keras computes it as one float16 sum
            over the batch (`GradientInfo.float16_sum`): that sum times the scale
            must also be finite in float16. Replicas and virtual nodes sum their
            own examples in float16, which overflow where Keras' one sum does not;
            the check sees the overflow of the whole batch's sum as Keras does.
        scale: The scale the step's loss was multiplied by (with `float16_sums`).
    """
    flags = list(float16_sums) or [False] * len(gradients)
    checks = []
    for grad, float16_sum in zip(gradients, flags):
        values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
        if float16_sum:
            values = tf.cast(values * tf.cast(scale, values.dtype), tf.float16)
        checks.append(tf.reduce_all(tf.math.is_finite(values)))
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)


class Gated:
    """A variable whose writes take effect only where `finite` is true.

    Reads pass through; `assign` writes the old value, `assign_add` and
    `assign_sub` add zero otherwise (a selection: the infinities and NaNs of
    the unselected value do not reach the variable).
    """

    def __init__(self, variable, finite: tf.Tensor):
        self._variable = variable
        self._finite = finite

    def __getattr__(self, name: str):
        return getattr(self._variable, name)

    def read_value(self) -> tf.Tensor:
        """The variable's value."""
        return self._variable.read_value()

    def assign(self, value: Any, read_value: bool = True):
        """Assigns `value` where the step is finite, else the value it holds."""
        value = tf.convert_to_tensor(value, self._variable.dtype.base_dtype)
        return self._variable.assign(tf.where(self._finite, value, self._variable.read_value()),
                                     read_value=read_value)

    def assign_add(self, delta: Any, read_value: bool = True):
        """Adds `delta` where the step is finite."""
        return self._variable.assign_add(self.gate(delta), read_value=read_value)

    def assign_sub(self, delta: Any, read_value: bool = True):
        """Subtracts `delta` where the step is finite."""
        return self._variable.assign_sub(self.gate(delta), read_value=read_value)

    def gate(self, delta: Any) -> tf.Tensor:
        """`delta` where the step is finite, else zeros of its shape."""
        delta = tf.convert_to_tensor(delta, self._variable.dtype.base_dtype)
        return tf.where(self._finite, delta, tf.zeros_like(delta))


def advance(state: LossScaleState, info: graph_item_pb2.OptimizerInfo, finite: tf.Tensor,
            after: Sequence[Any]) -> list[tf.Operation]:
    """Moves the scale, its counter and the update count once the step's updates ran.

    As Keras: finite and the counter at `dynamic_growth_steps - 1`: the
    scale doubles and the counter restarts; finite otherwise: the counter
    counts; not finite: the scale halves and the counter restarts. The
    update count counts finite steps.
    """
    growth = info.loss_scale.dynamic_growth_steps
    with tf.control_dependencies(after):
        counter = state.counter.read_value()
        scale = state.scale.read_value()
        grow = tf.logical_and(finite, tf.equal(counter, growth - 1))
        new_scale = tf.where(grow, scale * 2.0, tf.where(finite, scale, scale * 0.5))
        new_counter = tf.where(tf.logical_and(finite, tf.logical_not(grow)), counter + 1,
                               tf.zeros_like(counter))
        return [state.scale.assign(new_scale, read_value=False),
                state.counter.assign(new_counter, read_value=False),
                state.updates.assign_add(tf.cast(finite, tf.int64), read_value=False)]
