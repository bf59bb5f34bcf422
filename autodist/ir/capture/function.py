"""Capture of a user's loss function with explicit variables and optimizer."""
from __future__ import annotations


import tensorflow as tf

from autodist.ir.capture.constraints import attach_constraints
from autodist.ir.capture.keras_specs import spec_of
from autodist.ir.capture.names import unique_names
from autodist.ir.capture.optimizer import describe_optimizer
from autodist.ir.capture.traced_function import from_concrete_function
from autodist.ir.device_names import op_name
from autodist.ir.errors import CaptureError
from autodist.ir.graph_item import GraphItem


def capture_function(fn, variables, input_signature, optimizer, name, batch_size) -> GraphItem:
    """A loss function's step, with its variables and optimizer (see `capture`)."""
    missing = [arg for arg, value in (("variables", variables),
                                      ("input_signature", input_signature),
                                      ("optimizer", optimizer)) if value is None]
    if missing:
        raise CaptureError(f"capturing a loss function needs {', '.join(missing)}: "
                           "capture(loss_fn, variables=[...], "
                           "input_signature=[tf.TensorSpec(...)], optimizer=...)")
    variables = list(variables)
    if not variables:
        raise CaptureError("capture(loss_fn, variables=...) received an empty variable list")
    tf_vars = [_tf_variable(v, i) for i, v in enumerate(variables)]
    python_fn = getattr(fn, "python_function", fn)
    specs = [s if isinstance(s, tf.TensorSpec) else spec_of(s) for s in input_signature]

    def step(*args):
        with tf.GradientTape() as tape:
            loss = python_fn(*args)
        grads = tape.gradient(loss, tf_vars)
        return loss, grads

    concrete = tf.function(step, autograph=True).get_concrete_function(*specs)
    names = unique_names([_variable_name(v) for v in variables])
    input_infos = [(s.name or f"input_{i}", "") for i, s in enumerate(specs)]
    item = from_concrete_function(
        concrete, variables, names, [], [], input_infos,
        describe_optimizer(optimizer, variables, names),
        "function", name or getattr(python_fn, "__name__", "step"), batch_size)
    # The optimizer applies a variable's `constraint` after its update, as in a model.
    attach_constraints(item, variables, names)
    return item


def _tf_variable(v, index):
    inner = getattr(v, "value", None)
    if isinstance(v, tf.Variable):
        return v
    if isinstance(inner, tf.Variable):
        return inner
    raise CaptureError(f"variables[{index}] is not a tf.Variable or keras.Variable. "
                       f"Received: {type(v).__name__}")


def _variable_name(v) -> str:
    path = getattr(v, "path", None)
    if isinstance(path, str) and path:
        return path
    return op_name(v.name)
