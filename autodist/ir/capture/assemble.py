"""The GraphItem assembled from a traced step: per-variable facts, op
estimates, batch norms, loss masks and random draws."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import tensorflow as tf

from autodist.ir import batch_norms, loss_masks, random_ops
from autodist.ir.batch_shapes import graph_at_batch
from autodist.ir.capture.optimizer import slot_names
from autodist.ir.device_names import op_name
from autodist.ir.graph_item import GraphItem
from autodist.ir.op_costs import estimate_ops
from autodist.proto import graph_item_pb2


@dataclasses.dataclass
class TracedVariable:
    name: str
    handle_node: str
    dtype: tf.DType
    shape: list[int]
    gradient: Any  # tf.Tensor, tf.IndexedSlices or None


def state_update_ops(graph, handle_node: str) -> list[str]:
    """The ops of `graph` that assign to the variable behind `handle_node`."""
    out = []
    for op in graph.get_operations():
        if op.type in ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp") \
                and op.inputs[0].op.name == handle_node:
            out.append(op.name)
    return out


def _is_float16_sum(grad: tf.Tensor) -> bool:
    """Whether a dense gradient is a float16 tensor cast to the variable's dtype (a
    layer computing in float16 under 'mixed_float16': its sum over the batch is a
    float16 sum, which overflows where a float32 one would not)."""
    op = grad.op
    while op.type == "Identity":
        op = op.inputs[0].op
    return op.type == "Cast" and op.inputs[0].dtype == tf.float16 and grad.dtype != tf.float16


def assemble(graph, graph_def, source, name, inputs, loss, traced, states, optimizer_info,
              batch_size, dropped: set[str] = frozenset(),
              metrics: Sequence[graph_item_pb2.TensorInfo] = (),
              tables: Sequence[graph_item_pb2.TableInfo] = ()) -> GraphItem:
    """The GraphItem of a step's graph, its loss and variables."""
    order = {op.name: i for i, op in enumerate(graph.get_operations())}
    fetches = [loss.op] + [op for s in states for op in map(graph.get_operation_by_name,
                                                              s.update_ops)]
    variables = []
    for t in traced:
        info = graph_item_pb2.VariableInfo(
            name=t.name, handle_node=t.handle_node, dtype=t.dtype.name, shape=t.shape,
            byte_size=math.prod(t.shape) * t.dtype.size)
        grad = t.gradient
        if isinstance(grad, tf.IndexedSlices):
            info.sparse_gradient = True
            info.gradient.values = grad.values.name
            info.gradient.indices = grad.indices.name
            if grad.dense_shape is not None:
                info.gradient.dense_shape = grad.dense_shape.name
            producer = grad.values
        elif grad is not None:
            info.gradient.dense = grad.name
            info.gradient.float16_sum = _is_float16_sum(grad)
            producer = grad
        else:
            producer = None
        if producer is not None:
            fetches.append(producer.op)
            info.gradient_order = order.get(_producer(producer.op).name, 0)
        info.partitionable_axes.extend(_partitionable_axes(t.shape, info.sparse_gradient))
        info.slots.extend(slot_names(optimizer_info, t.name))
        variables.append(info)

    # Shapes at exactly `batch_size` examples where shape inference can tell them (a
    # dimension derived from the batch, e.g. UpSampling2D's gradient reshapes, is then
    # known, not guessed as the batch); the traced graph's otherwise.
    at_batch = graph_at_batch(graph_def, inputs, batch_size, _handles(traced, states))
    ops = estimate_ops(at_batch or graph, batch_size, _producer(loss.op).name,
                       keep=_ancestors(fetches) - dropped)
    if at_batch is not None:
        _count_sparse_rows(at_batch, variables, ops)
    proto = graph_item_pb2.GraphItem(
        graph_def=graph_def.SerializeToString(deterministic=True), source=source, name=name,
        inputs=inputs, loss_tensor=loss.name, variables=variables, state_variables=states,
        optimizer=optimizer_info, ops=ops, estimate_batch_size=batch_size,
        metric_states=metrics,
        batch_norms=batch_norms.analyze(graph_def, {v.handle_node for v in variables}),
        loss_masks=loss_masks.analyze(graph_def),
        random_ops=random_ops.analyze(graph_def, inputs, _handles(traced, states)),
        tables=tables)
    return GraphItem(proto)


def _handles(traced, states) -> dict[str, tuple[str, list[int]]]:
    """The step's variable placeholders -> (dtype, shape) of what they hold."""
    out = {t.handle_node: (t.dtype.name, list(t.shape)) for t in traced if t.handle_node}
    out.update({s.handle_node: (s.dtype, list(s.shape)) for s in states})
    return out


def _producer(op):
    """The op behind Identity wrappers (a traced function's outputs are Identities)."""
    while op.type == "Identity" and op.inputs:
        op = op.inputs[0].op
    return op


def _ancestors(fetch_ops) -> set[str]:
    seen: set[str] = set()
    stack = list(fetch_ops)
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return seen


def _partitionable_axes(shape: list[int], sparse: bool) -> list[int]:
    if sparse:
        # A gather reads rows: only axis 0 can be split.
        return [0] if shape and shape[0] > 1 else []
    return [axis for axis, dim in enumerate(shape) if dim > 1]


def state_info(name, handle_node, dtype, shape, updates) -> graph_item_pb2.StateInfo:
    """A non-trainable variable the step updates."""
    shape = [int(d) for d in shape]
    return graph_item_pb2.StateInfo(name=name, handle_node=handle_node, dtype=dtype.name,
                                    shape=shape, byte_size=math.prod(shape) * dtype.size,
                                    update_ops=updates)


def _count_sparse_rows(graph: tf.Graph, variables, ops) -> None:
    """Sets the output bytes of each sparse gradient's values in `graph` (the step at
    the estimate batch, `_graph_at_batch`).

    A lookup of several ids per example flattens them into one unknown
    dimension (batch x ids), which the per-op estimate takes for the batch
    alone. Shape inference on the step whose inputs hold exactly the batch
    gives the real number of rows (one per lookup); where it cannot tell, the
    estimate stays.
    """
    by_name = {op.name: op for op in ops}
    for var in variables:
        if not var.sparse_gradient:
            continue
        op = by_name.get(op_name(var.gradient.values))
        shape = graph.get_tensor_by_name(var.gradient.values).shape
        if op is not None and shape.is_fully_defined():
            op.output_bytes = shape.num_elements() * tf.as_dtype(var.dtype).size


def proto_shape(shape: tf.TensorShape) -> list[int]:
    """A shape as the protos keep it: -1 for an unknown dimension, [] for an unknown rank."""
    if shape.rank is None:
        return []
    return [-1 if d is None else int(d) for d in shape.as_list()]
