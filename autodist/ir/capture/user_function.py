"""A user's callable of one tensor (a learning-rate schedule of the step, a variable's
constraint of its value) traced into a graph that the task processes import: they
never see the user's script."""
from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from autodist.ir.capture.graph_cleanup import inline_constant_captures
from autodist.ir.errors import CaptureError


def trace(fn: Callable[[tf.Tensor], Any], spec: tf.TensorSpec, what: str, argument: str,
          hint: str = ""):
    """`fn` traced on a tensor of `spec` (a concrete function).

    Args:
        fn: The callable, returning a tensor.
        spec: Its argument.
        what: Names the callable in messages ("the learning-rate schedule
            ExponentialDecay").
        argument: What its argument is, for messages ("the step").
        hint: Appended to the message when it cannot be traced.

    Raises:
        CaptureError: it cannot be traced, or it reads a variable (whose later
            changes would not reach the tasks).
    """
    try:
        concrete = tf.function(fn, autograph=True).get_concrete_function(spec)
    except Exception as e:  # whatever the user's callable raises
        raise CaptureError(f"{what} cannot be traced as a TensorFlow function of {argument}: "
                           f"{short_error(e)}{hint}") from e
    if any(internal.dtype == tf.resource for _, internal in concrete.graph.captures):
        raise CaptureError(f"{what} reads a variable; its changes would not reach the "
                           f"cluster. Make it a function of {argument} only")
    return concrete


def serialized_graph(concrete) -> bytes:
    """The traced graph, its captured constants inlined, serialized deterministically."""
    graph = concrete.graph
    graph_def = graph.as_graph_def()
    inline_constant_captures(graph, graph_def, set())
    return graph_def.SerializeToString(deterministic=True)


def short_error(error: Exception, limit: int = 300) -> str:
    """`error`'s type and message, cut to `limit` characters in the middle: TensorFlow
    puts the cause last (a traced error's final line, `TypeError: where() got an
    unexpected keyword argument 'name'`), Python first."""
    text = f"{type(error).__name__}: {error}"
    if len(text) <= limit:
        return text
    head = limit * 2 // 5
    return f"{text[:head]} ... {text[-(limit - head):]}"
