"""Variable constraints (Keras `kernel_constraint=...`, a custom `Constraint`) traced
into graphs of the variable's value, checked against the constraint itself.

Keras' optimizer assigns each trainable variable its constraint of its value after
the step's updates (`variable.assign(variable.constraint(variable))`). The task
processes never see the user's script, so the constraint travels as a graph
(`VariableConstraint`) that every task imports after the variable's update. It is a
function of the whole variable, so a constrained variable loses its partitionable axes.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from autodist.ir.capture import user_function
from autodist.ir.errors import CaptureError
from autodist.ir.graph_item import GraphItem
from autodist.proto import graph_item_pb2


def attach_constraints(item: GraphItem, trainable: Sequence[Any], names: Sequence[str]) -> None:
    """Traces the constraint of every constrained trainable variable into `item`.

    Args:
        item: The captured GraphItem; each constrained variable gets its
            `constraint` and loses its partitionable axes.
        trainable: The model's trainable variables, in the item's order.
        names: Their unique names in the item.

    Raises:
        CaptureError: a constraint cannot be traced as a function of the value.
    """
    for variable, name in zip(trainable, names):
        constraint = getattr(variable, "constraint", None)
        if constraint is None:
            continue
        info = item.variable(name)
        info.constraint.CopyFrom(trace_constraint(
            constraint, name, tf.as_dtype(info.dtype), list(info.shape),
            _eager_value(variable)))
        # The constraint reads the whole variable (a norm over an axis, a clip of the
        # kernel): a shard alone cannot compute it.
        del info.partitionable_axes[:]


def _eager_value(variable) -> np.ndarray | None:
    """The variable's value, or None for a variable of a `tf.compat.v1` graph (its value
    lives in a session)."""
    try:
        return np.asarray(variable)
    except (NotImplementedError, TypeError):   # not eager; or read outside its graph
        return None


def trace_constraint(constraint, variable: str, dtype: tf.DType, shape: list[int],
                     value: np.ndarray | None = None) -> graph_item_pb2.VariableConstraint:
    """Traces `constraint` on a value of `shape` and `dtype` into a graph.

    The graph is checked against the constraint called on the variable's value
    (`value`) and on random values large enough to activate it, so a constraint
    that depends on Python state, reads a variable or draws random numbers is
    refused rather than applied wrongly.

    Args:
        constraint: The callable (a `keras.constraints.Constraint`).
        variable: The variable's name, for messages.
        dtype: The variable's dtype.
        shape: The variable's shape.
        value: The variable's current value, one of the checked values.

    Raises:
        CaptureError: naming the variable and the constraint.
    """
    kind = type(constraint).__name__
    where = f"the constraint {kind} of variable {variable!r}"
    concrete = user_function.trace(
        lambda v: tf.convert_to_tensor(constraint(v), dtype),
        tf.TensorSpec(shape, dtype, name="value"), where, "the variable's value",
        hint=". Write it with keras.ops on its argument, or remove it")
    out = concrete.structured_outputs
    if out.shape.as_list() != shape:
        raise CaptureError(f"{where} returns shape {out.shape} for a variable of shape "
                           f"{shape}: Keras assigns its result to the variable")
    graph = concrete.graph
    stateful = sorted({op.type for op in graph.get_operations() if op.op_def.is_stateful})
    if stateful:
        raise CaptureError(f"{where} has side effects or random draws ({', '.join(stateful)}) "
                           "that every task would repeat at each step. Make it a function "
                           "of the variable's value only")
    _check_against_constraint(constraint, concrete, where, dtype, shape, value)
    return graph_item_pb2.VariableConstraint(
        class_name=kind, graph_def=user_function.serialized_graph(concrete),
        value_tensor=concrete.inputs[0].name, constrained_tensor=out.name)


def _check_against_constraint(constraint, concrete, where: str, dtype: tf.DType,
                              shape: list[int], value: np.ndarray | None) -> None:
    """The traced graph equals `constraint` on the variable's value and random values
    (small and large, of both signs), else CaptureError."""
    rng = np.random.default_rng(0)
    checks = [] if value is None else [value]
    checks += [rng.normal(size=shape), 10.0 * rng.normal(size=shape),
               rng.uniform(-0.1, 0.1, size=shape)]
    for values in checks:
        given = tf.constant(np.asarray(values), dtype)
        try:
            want = np.asarray(tf.convert_to_tensor(constraint(given), dtype))
        except Exception as e:  # whatever the user's constraint raises
            raise CaptureError(f"{where} fails on a tensor of the variable's value: "
                               f"{user_function.short_error(e)}") from e
        got = np.asarray(concrete(given))
        if not np.allclose(got, want, rtol=1e-6, atol=1e-7, equal_nan=True):
            raise CaptureError(f"{where} gives other values than its traced graph (largest "
                               f"difference {np.nanmax(np.abs(got - want)):.3g}): it depends "
                               "on something other than the variable's value (Python state). "
                               "Make it a function of the value only")

