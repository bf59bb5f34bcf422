"""Optimizer updates with the exact semantics of the user's optimizer.

The captured step does not contain the optimizer: the GraphItem records it
(`OptimizerInfo`) and this module builds its update for one variable (or
shard) wherever the strategy puts it. Keras 3 optimizers follow Keras'
`update_step` formulas; tf.compat.v1 optimizers use TensorFlow's fused
``ResourceApply*`` kernels, as `minimize` would.

Sparse gradients (IndexedSlices) are summed into a dense gradient before the
update, as Keras does (its update formulas densify IndexedSlices), so every
row's slots decay each step. Plain SGD (no momentum, no weight decay) is the
exception, in Keras and here: its update is a scatter of the touched rows
(`ResourceScatterSub`), so a step costs the rows, not the table. Keras squares
a sparse gradient before densifying it, so where a row occurs several times in
a batch its "squared
gradient" is the sum of the squares of its occurrences, not the square of
their sum; `apply_update` takes that sum (`grad_square`) to match Keras
exactly.

Keras clips the gradient before the update (`clipnorm`, `global_clipnorm`,
`clipvalue`); here `clip_gradients` clips the aggregated gradients of one
update group (all the shards a task updates in one run), so a variable's or
the model's norm is taken over the global gradient, never a replica's part.
Keras measures a sparse gradient's norm over its looked-up rows (the sum of
`grad_square`), and `global_clipnorm` makes it dense; `clipvalue` clips each
looked-up row, so a sparse gradient is clipped per replica before it is
aggregated (`clip_occurrences`). A learning-rate schedule is evaluated at the
update's step, the number of updates applied before it, as Keras evaluates
`schedule(optimizer.iterations)` before incrementing it.

A variable's constraint (`VariableInfo.constraint`, a traced graph) is assigned
after its update (`apply_constraint`), as Keras' `Optimizer.apply` assigns
`variable.constraint(variable)` after the step's updates; it is a function of the
variable alone, so applying it right after that variable's update is the same.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import tensorflow as tf

from autodist.ir.errors import StrategyError
from autodist.ir.graph_item import gradient_clipping, optimizer_squares_gradient
from autodist.kernels import loss_scaling
from autodist.proto import graph_item_pb2

# Keras options that change the update in ways not implemented, and why.
_UNSUPPORTED_KERAS_OPTIONS = {
    "gradient_accumulation_steps": "it applies an update only every few steps",
    "loss_scale_factor": "it scales the loss inside Keras' train step",
}
# Flags and options that are not numbers the update computes with.
_NON_TENSOR_HYPERPARAMETERS = ("nesterov", "amsgrad", "centered", "use_ema", "clipnorm",
                               "global_clipnorm", "clipvalue")


@dataclasses.dataclass
class Slots:
    """The optimizer slot variables of one variable (or shard), by slot name."""

    variables: dict[str, tf.Variable]

    def __getitem__(self, name: str) -> tf.Variable:
        return self.variables[name]


def slot_initial_value(info: graph_item_pb2.OptimizerInfo, slot: str) -> float:
    """The value a slot starts at (TensorFlow v1 Adagrad and RMSProp do not start at 0)."""
    hp = info.hyperparameters
    if info.family == "v1" and info.algorithm == "adagrad":
        return hp.get("initial_accumulator_value", 0.1)
    if info.family == "v1" and info.algorithm == "rmsprop" and slot == "rms":
        return 1.0
    if info.family == "keras" and info.algorithm == "adagrad":
        return hp.get("initial_accumulator_value", 0.1)
    return 0.0


def check_supported(info: graph_item_pb2.OptimizerInfo) -> None:
    """Raises StrategyError for optimizer options the runtime cannot reproduce."""
    hp = info.hyperparameters
    for option, why in _UNSUPPORTED_KERAS_OPTIONS.items():
        if hp.get(option):
            raise StrategyError(f"optimizer {info.class_name} uses {option}={hp[option]:g}, "
                                f"which the distributed runtime does not support ({why}); "
                                f"compile the model without {option}",
                                field=f"optimizer.{option}", received=hp[option])
    if hp.get("use_ema"):
        raise StrategyError(f"optimizer {info.class_name} uses use_ema=True, which the "
                            "distributed runtime does not support (Keras keeps a moving "
                            "average of the weights and writes it into the model when fit "
                            "ends); compile the model without use_ema",
                            field="optimizer.use_ema", received=True)
    if info.family == "v1" and info.algorithm not in ("sgd", "adam"):
        raise StrategyError(f"tf.compat.v1 optimizer {info.class_name} is not supported by "
                            "the distributed runtime yet (supported: GradientDescent, Momentum, "
                            "Adam)", field="optimizer", received=info.class_name)


def dense_gradient(grad, shape: list[int]) -> tf.Tensor:
    """A dense gradient; IndexedSlices are summed into their rows."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.math.unsorted_segment_sum(grad.values, grad.indices, shape[0])
    return grad


def square_gradient(grad, shape: list[int]) -> tf.Tensor:
    """Keras' squared gradient: for IndexedSlices, the sum of squared occurrences."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.math.unsorted_segment_sum(tf.square(grad.values), grad.indices, shape[0])
    return tf.square(grad)


def hyperparameter_tensors(info: graph_item_pb2.OptimizerInfo, dtype: tf.DType,
                           overrides: Mapping[str, float] | None = None,
                           step: tf.Tensor | None = None,
                           learning_rate: tf.Tensor | None = None) -> dict[str, tf.Tensor]:
    """The numeric hyper-parameters as tensors of `dtype` (build once per step, share).

    Args:
        info: The captured optimizer.
        dtype: The dtype of the variables they update.
        overrides: A strategy's `hyperparameters`; they replace the captured values.
        step: The number of updates applied before this one (int64 scalar); a
            learning-rate schedule is evaluated at it.
        learning_rate: The run's fixed learning rate as a tensor (a variable the
            worker sets where a callback changes it), used unless the
            strategy overrides it or the rate is a schedule.

    Raises:
        StrategyError: a scheduled learning rate without a step.
    """
    values = dict(info.hyperparameters)
    values.update(overrides or {})
    tensors = {k: tf.constant(v, dtype) for k, v in values.items()
               if k not in _NON_TENSOR_HYPERPARAMETERS}
    if learning_rate is not None and "learning_rate" in tensors and \
            "learning_rate" not in (overrides or {}):
        tensors["learning_rate"] = tf.cast(learning_rate, dtype)
    if "learning_rate" not in tensors and info.HasField("learning_rate_schedule"):
        if step is None:
            raise StrategyError(f"the learning rate of {info.class_name} is a schedule, so "
                                "its value needs the step", field="optimizer.learning_rate",
                                received=info.learning_rate_schedule.class_name)
        tensors["learning_rate"] = tf.cast(scheduled_learning_rate(
            info.learning_rate_schedule, step), dtype)
    return tensors


def scheduled_learning_rate(schedule: graph_item_pb2.LearningRateSchedule,
                            step: tf.Tensor) -> tf.Tensor:
    """The captured schedule's learning rate at `step` (imported into the default graph)."""
    from tensorflow.core.framework import graph_pb2

    graph_def = graph_pb2.GraphDef()
    graph_def.ParseFromString(schedule.graph_def)
    [rate] = tf.import_graph_def(
        graph_def, input_map={schedule.step_tensor: tf.cast(step, tf.int64)},
        return_elements=[schedule.learning_rate_tensor], name="autodist/learning_rate")
    return rate


def apply_constraint(constraint: graph_item_pb2.VariableConstraint, var, update: tf.Operation,
                     finite: tf.Tensor | None = None) -> tf.Operation:
    """Keras' `variable.assign(variable.constraint(variable))` once `update` has run.

    Args:
        constraint: The variable's captured constraint.
        var: The whole variable (a copy of it, or its storage on a PS), as `apply_update`
            takes it.
        update: Its update; the constraint reads the updated value.
        finite: Under dynamic loss scaling, whether the step's gradients are finite:
            a skipped step assigns nothing, as Keras then calls no `apply`.

    Returns:
        The assignment, which runs after `update` (what waits for the update waits
        for it).
    """
    from tensorflow.core.framework import graph_pb2

    graph_def = graph_pb2.GraphDef()
    graph_def.ParseFromString(constraint.graph_def)
    target = var if finite is None else loss_scaling.Gated(var, finite)
    with tf.device(var.device), tf.control_dependencies([update]):
        [constrained] = tf.import_graph_def(
            graph_def, input_map={constraint.value_tensor: var.read_value()},
            return_elements=[constraint.constrained_tensor], name="autodist/constraint")
        return target.assign(constrained, read_value=False)


def uses_weight_decay(info: graph_item_pb2.OptimizerInfo, variable: str) -> bool:
    """Whether Keras decays `variable` (a weight decay is set and does not exclude it)."""
    return "weight_decay" in info.hyperparameters and \
        variable not in info.weight_decay_excluded


@dataclasses.dataclass
class ReducedGradient:
    """The aggregated gradient of one variable or shard, as its update takes it.

    Attributes:
        variable: The trainable variable it belongs to (shards share it).
        grad: Dense, or IndexedSlices.
        square: Keras' squared gradient of a sparse gradient (see the module
            doc), or None to derive it from `grad`.
        sparse: The variable's gradient is sparse (looked-up rows), even if
            its aggregation made `grad` dense.
    """

    variable: str
    grad: Any
    square: Any = None
    sparse: bool = False


def clip_gradients(info: graph_item_pb2.OptimizerInfo, gradients: Sequence[ReducedGradient],
                   overrides: Mapping[str, float] | None = None, *,
                   occurrences: bool = False) -> list[ReducedGradient]:
    """Keras' gradient clipping of one update group, as `Optimizer._clip_gradients`.

    Args:
        info: The captured optimizer.
        gradients: Every aggregated gradient of the group: all shards of each
            variable in it (`clipnorm`), and every variable (`global_clipnorm`);
            the strategy's validation makes sure no variable or norm spans
            two groups.
        overrides: A strategy's `hyperparameters`.
        occurrences: The sparse gradients' values are single lookups (a
            replica's own gradient), so `clipvalue` clips them here. Otherwise
            they are sums, and each replica's lookups were clipped before the
            aggregation (`clip_occurrences`).

    Returns:
        The clipped gradients, in order.
    """
    values = dict(info.hyperparameters)
    values.update(overrides or {})
    clipping = gradient_clipping(values) if info.family == "keras" else None
    if clipping is None or not gradients:
        return list(gradients)
    option, limit = clipping
    if option == "clipvalue":
        return [g if g.sparse and not occurrences else
                dataclasses.replace(g, grad=_clip_values(g.grad, limit)) for g in gradients]
    sums = [_squared_sum(g) for g in gradients]
    if option == "clipnorm":
        scales = {}
        for name in dict.fromkeys(g.variable for g in gradients):
            total = tf.add_n([s for g, s in zip(gradients, sums) if g.variable == name])
            scales[name] = limit / tf.maximum(_safe_sqrt(total), limit)
        return [_scaled(g, scales[g.variable], dense=False) for g in gradients]
    # global_clipnorm: clip_by_global_norm, NaN or infinite norm making NaN.
    norm = tf.sqrt(tf.add_n(sums))
    scale = limit * tf.minimum(1.0 / norm, 1.0 / limit) + (norm - norm)
    return [_scaled(g, scale, dense=True) for g in gradients]


def clip_occurrences(info: graph_item_pb2.OptimizerInfo, grad,
                     overrides: Mapping[str, float] | None = None):
    """`clipvalue` on each looked-up row of one replica's sparse gradient.

    Keras clips a sparse gradient's rows one by one, before repeats are
    summed; so the rows are clipped where they are computed, before the
    replicas' gradients are aggregated. Other gradients pass unchanged.
    """
    values = dict(info.hyperparameters)
    values.update(overrides or {})
    clipping = gradient_clipping(values) if info.family == "keras" else None
    if clipping is None or clipping[0] != "clipvalue" or not isinstance(grad, tf.IndexedSlices):
        return grad
    return _clip_values(grad, clipping[1])


def _clip_values(grad, limit: float):
    if isinstance(grad, tf.IndexedSlices):
        values = tf.clip_by_value(grad.values, -limit, limit)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return tf.clip_by_value(grad, -limit, limit)


def _squared_sum(gradient: ReducedGradient) -> tf.Tensor:
    """The gradient's squared L2 norm as Keras takes it (float32): over looked-up rows."""
    grad = gradient.grad
    with tf.device(_device(grad)):
        if gradient.square is not None:
            return tf.cast(tf.reduce_sum(gradient.square), tf.float32)
        values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
        return tf.cast(tf.reduce_sum(tf.square(values)), tf.float32)


def _safe_sqrt(total: tf.Tensor) -> tf.Tensor:
    # As tf.clip_by_norm: a zero gradient has norm 0 without a NaN gradient of sqrt.
    positive = total > 0
    return tf.where(positive, tf.sqrt(tf.where(positive, total, tf.ones_like(total))), total)


def _scaled(gradient: ReducedGradient, scale: tf.Tensor, dense: bool) -> ReducedGradient:
    """The gradient times `scale`; `dense`: a sparse gradient becomes dense, as Keras'
    `global_clipnorm` makes it (its squared gradient is then the dense one's)."""
    grad = gradient.grad
    with tf.device(_device(grad)):
        if isinstance(grad, tf.IndexedSlices):
            factor = tf.cast(scale, grad.values.dtype)
            if dense:
                summed = tf.math.unsorted_segment_sum(grad.values, grad.indices,
                                                      grad.dense_shape[0]) * factor
                return ReducedGradient(gradient.variable, summed, None, gradient.sparse)
            scaled = tf.IndexedSlices(grad.values * factor, grad.indices, grad.dense_shape)
        else:
            scaled = grad * tf.cast(scale, grad.dtype)
            if dense:
                return ReducedGradient(gradient.variable, scaled, None, gradient.sparse)
        square = None if gradient.square is None else \
            gradient.square * tf.cast(scale * scale, gradient.square.dtype)
        return ReducedGradient(gradient.variable, scaled, square, gradient.sparse)


def _device(grad) -> str:
    return (grad.values if isinstance(grad, tf.IndexedSlices) else grad).device


def apply_update(info: graph_item_pb2.OptimizerInfo, var: tf.Variable, grad, slots: Slots,
                 step: tf.Tensor, grad_square=None,
                 hyperparameters: dict[str, tf.Tensor] | None = None,
                 variable: str = "", finite: tf.Tensor | None = None) -> tf.Operation:
    """Builds one optimizer update of `var` with gradient `grad`.

    Args:
        info: The captured optimizer.
        var: The variable (or shard) to update, a tf.Variable or a `StorageVariable`
            (it needs `handle`, `read_value` and `assign*`); the update runs on its device.
        grad: Its gradient, dense or IndexedSlices (already aggregated).
        slots: Its slot variables, named as in `VariableInfo.slots`.
        step: The number of updates applied before this one (int64 scalar);
            Adam's bias correction uses step + 1.
        grad_square: The squared gradient as Keras computes it (see the module
            doc); by default derived from `grad`.
        hyperparameters: From `hyperparameter_tensors` for the variable's
            dtype and this step; pass them to share the tensors between
            updates (made here if absent).
        variable: The trainable variable `var` is (a shard of), for Keras'
            `exclude_from_weight_decay`.
        finite: Under dynamic loss scaling, a bool scalar: whether the step's
            gradients are all finite; the update changes nothing where not
            (`loss_scaling.Gated`).

    Returns:
        The update op.
    """
    if finite is not None:
        if info.family != "keras":
            raise StrategyError(f"dynamic loss scaling needs a Keras optimizer, not "
                                f"{info.family} {info.class_name}", field="optimizer",
                                received=info.class_name)
        var = loss_scaling.Gated(var, finite)
        slots = Slots({k: loss_scaling.Gated(v, finite) for k, v in slots.variables.items()})
    shape = var.shape.as_list()
    hp = dict(hyperparameters if hyperparameters is not None else
              hyperparameter_tensors(info, var.dtype.base_dtype, step=step))
    if not uses_weight_decay(info, variable):
        hp.pop("weight_decay", None)
    if isinstance(grad, tf.IndexedSlices) and _is_plain_sgd(info, slots, hp):
        rows = tf.cast(grad.values, var.dtype) * hp["learning_rate"]
        if finite is not None:
            rows = var.gate(rows)
        return tf.raw_ops.ResourceScatterSub(resource=var.handle, indices=grad.indices,
                                             updates=rows)
    if optimizer_squares_gradient(info):
        if grad_square is None:
            grad_square = square_gradient(grad, shape)
        grad_square = tf.cast(grad_square, var.dtype)
    else:
        grad_square = None  # not part of the update
    grad = tf.cast(dense_gradient(grad, shape), var.dtype)
    builder = _KERAS if info.family == "keras" else _V1
    try:
        update = builder[info.algorithm]
    except KeyError:
        raise StrategyError(f"no update rule for {info.family} optimizer {info.class_name}",
                            field="optimizer", received=info.class_name) from None
    flags = info.hyperparameters
    return update(var, grad, grad_square, slots, step, hp, flags)


def _is_plain_sgd(info: graph_item_pb2.OptimizerInfo, slots: Slots,
                  hp: dict[str, tf.Tensor]) -> bool:
    """SGD whose update touches only the gradient's rows (no momentum, no decay)."""
    if info.algorithm != "sgd" or "weight_decay" in hp:
        return False
    if info.family == "keras":
        return info.hyperparameters.get("momentum", 0.0) == 0.0
    return "momentum" not in slots.variables


# ---------------------------------------------------------------- Keras 3
def _keras_weight_decay(var, grad, hp):
    """Keras decays the variable after its gradient is computed, before the update."""
    if "weight_decay" not in hp:
        return []
    # After the gradient: it waits for every read of the variable in this step
    # (a PS variable's aggregated gradient waits for every worker's pass).
    with tf.control_dependencies([grad]):
        return [var.assign_sub(var.read_value() * hp["weight_decay"] * hp["learning_rate"],
                               read_value=False)]


def _keras_sgd(var, grad, grad_square, slots, step, hp, flags):
    lr = hp["learning_rate"]
    deps = _keras_weight_decay(var, grad, hp)
    with tf.control_dependencies(deps):
        if flags.get("momentum", 0.0) == 0.0:
            return var.assign_sub(grad * lr, read_value=False)
        m = slots["momentum"]
        momentum = hp["momentum"]
        new_m = m.assign(m.read_value() * momentum - grad * lr)
        with tf.control_dependencies([new_m]):
            if flags.get("nesterov"):
                return var.assign_add(new_m * momentum - grad * lr, read_value=False)
            return var.assign_add(new_m, read_value=False)


def _keras_adam(var, grad, grad_square, slots, step, hp, flags):
    # alpha = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t), as in keras.optimizers.Adam.
    lr = hp["learning_rate"]
    beta_1, beta_2, epsilon = hp["beta_1"], hp["beta_2"], hp["epsilon"]
    t = tf.cast(step + 1, var.dtype)
    alpha = lr * tf.sqrt(1 - tf.pow(beta_2, t)) / (1 - tf.pow(beta_1, t))
    deps = _keras_weight_decay(var, grad, hp)
    with tf.control_dependencies(deps):
        m = slots["momentum"]
        v = slots["velocity"]
        new_m = m.assign_add((grad - m.read_value()) * (1 - beta_1))
        new_v = v.assign_add((grad_square - v.read_value()) * (1 - beta_2))
        if flags.get("amsgrad"):
            v_hat = slots["velocity_hat"]
            new_v = v_hat.assign(tf.maximum(v_hat.read_value(), new_v))
        return var.assign_sub(new_m * alpha / (tf.sqrt(new_v) + epsilon), read_value=False)


def _keras_adagrad(var, grad, grad_square, slots, step, hp, flags):
    lr, epsilon = hp["learning_rate"], hp["epsilon"]
    deps = _keras_weight_decay(var, grad, hp)
    with tf.control_dependencies(deps):
        acc = slots["accumulator"].assign_add(grad_square)
        return var.assign_sub(lr * grad / tf.sqrt(acc + epsilon), read_value=False)


def _keras_rmsprop(var, grad, grad_square, slots, step, hp, flags):
    lr, rho, epsilon = hp["learning_rate"], hp["rho"], hp["epsilon"]
    deps = _keras_weight_decay(var, grad, hp)
    with tf.control_dependencies(deps):
        velocity = slots["velocity"].assign(rho * slots["velocity"].read_value() +
                                            (1 - rho) * grad_square)
        if flags.get("centered"):
            average = slots["average_gradient"].assign(
                rho * slots["average_gradient"].read_value() + (1 - rho) * grad)
            denominator = velocity - tf.square(average) + epsilon
        else:
            denominator = velocity + epsilon
        increment = lr * grad / tf.sqrt(denominator)
        if flags.get("momentum", 0.0) > 0:
            m = slots["momentum"].assign(hp["momentum"] * slots["momentum"].read_value() +
                                         increment)
            return var.assign_sub(m, read_value=False)
        return var.assign_sub(increment, read_value=False)


_KERAS: dict[str, Callable] = {"sgd": _keras_sgd, "adam": _keras_adam,
                               "adamw": _keras_adam, "adagrad": _keras_adagrad,
                               "rmsprop": _keras_rmsprop}


# ------------------------------------------------------------ tf.compat.v1
def _v1_sgd(var, grad, grad_square, slots, step, hp, flags):
    lr = hp["learning_rate"]
    if "momentum" not in slots.variables:
        return tf.raw_ops.ResourceApplyGradientDescent(var=var.handle, alpha=lr, delta=grad)
    return tf.raw_ops.ResourceApplyMomentum(var=var.handle, accum=slots["momentum"].handle,
                                            lr=lr, grad=grad, momentum=hp["momentum"],
                                            use_nesterov=bool(flags.get("nesterov")))


def _v1_adam(var, grad, grad_square, slots, step, hp, flags):
    t = tf.cast(step + 1, var.dtype)
    beta_1, beta_2 = hp["beta_1"], hp["beta_2"]
    return tf.raw_ops.ResourceApplyAdam(
        var=var.handle, m=slots["m"].handle, v=slots["v"].handle,
        beta1_power=tf.pow(beta_1, t), beta2_power=tf.pow(beta_2, t), lr=hp["learning_rate"],
        beta1=beta_1, beta2=beta_2, epsilon=hp["epsilon"], grad=grad)


_V1: dict[str, Callable] = {"sgd": _v1_sgd, "adam": _v1_adam}
