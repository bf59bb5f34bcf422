"""Capture of a `tf.compat.v1` graph: a loss tensor and a `tf.compat.v1.train`
optimizer."""
from __future__ import annotations


import tensorflow as tf

from autodist.ir.capture.assemble import (TracedVariable, assemble, proto_shape, state_info,
                                          state_update_ops)
from autodist.ir.capture.constraints import attach_constraints
from autodist.ir.capture.names import unique_names
from autodist.ir.capture.optimizer import describe_optimizer
from autodist.ir.errors import CaptureError
from autodist.ir.graph_item import GraphItem
from autodist.proto import graph_item_pb2


def capture_v1(loss, optimizer, variables, name, batch_size) -> GraphItem:
    """A `tf.compat.v1` graph's step: its loss and optimizer (see `capture`)."""
    if optimizer is None or not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise CaptureError("capturing a tf.compat.v1 graph needs optimizer= a "
                           "tf.compat.v1.train optimizer. Received: "
                           f"{type(optimizer).__name__}")
    graph = loss.graph
    with graph.as_default():
        var_list = list(variables) if variables is not None else \
            tf.compat.v1.trainable_variables()
        if not var_list:
            raise CaptureError("the v1 graph has no trainable variables")
        for v in var_list:
            if not isinstance(v, tf.Variable) or v.op.type != "VarHandleOp":
                raise CaptureError(
                    f"variable {getattr(v, 'name', v)!r} is a reference variable; create it "
                    "with use_resource=True (or tf.compat.v1.enable_resource_variables())")
        grads_and_vars = optimizer.compute_gradients(loss, var_list=var_list)
    names = unique_names([v.op.name for v in var_list])
    traced = [TracedVariable(n, v.op.name, v.dtype.base_dtype, [int(d) for d in v.shape], g)
              for n, (g, v) in zip(names, grads_and_vars)]
    inputs = [graph_item_pb2.TensorInfo(name=op.name, tensor=op.outputs[0].name,
                                        dtype=op.outputs[0].dtype.name,
                                        shape=proto_shape(op.outputs[0].shape))
              for op in graph.get_operations() if op.type == "Placeholder"]
    trainable_handles = {v.op.name for v in var_list}
    states = []
    for v in tf.compat.v1.global_variables() if graph is tf.compat.v1.get_default_graph() \
            else graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES):
        if v.op.name in trainable_handles or v.op.type != "VarHandleOp":
            continue
        updates = state_update_ops(graph, v.op.name)
        if updates:
            states.append(state_info(v.op.name, v.op.name, v.dtype.base_dtype,
                                      list(v.shape), updates))
    optimizer_info = describe_optimizer(optimizer, var_list)
    item = assemble(graph, graph.as_graph_def(), "v1_graph", name or "v1_graph", inputs, loss,
                    traced, states, optimizer_info, batch_size)
    # A tf.compat.v1.train optimizer assigns a variable's `constraint` after its update.
    attach_constraints(item, var_list, names)
    return item
