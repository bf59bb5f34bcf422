"""A traced `tf.function` step (a Keras model's or a loss function's) as a
GraphItem: variables, state, inputs, metrics and lookup tables found in its graph."""
from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from autodist.ir.capture.added_losses import ADDED_LOSS_SCALE, layer_scope
from autodist.ir.capture.assemble import (TracedVariable, assemble, proto_shape, state_info,
                                          state_update_ops)
from autodist.ir.capture.graph_cleanup import drop_foreign_state, inline_constant_captures
from autodist.ir.errors import CaptureError
from autodist.ir.graph_item import GraphItem
from autodist.proto import graph_item_pb2


logger = logging.getLogger(__name__)


def from_concrete_function(concrete, trainable, names, state, state_names, input_infos,
                            optimizer_info, source, name, batch_size,
                            metric_names: Sequence[str] = (),
                            tables: Sequence[tuple[str, Any]] = ()) -> GraphItem:
    """The GraphItem of a traced step returning (loss, gradients[, metric states, added loss
    terms])."""
    graph = concrete.graph
    loss, grads, *rest = concrete.structured_outputs
    metric_states = list(rest[0]) if rest else []
    # A traced function's outputs are Identities of what the step computes.
    terms = [t.op.inputs[0] if t.op.type == "Identity" else t
             for t in (rest[1] if len(rest) > 1 else [])]
    added = [graph_item_pb2.AddedLossInfo(tensor=t.name, layer=layer_scope(t.op.name),
                                          kind="unknown", scale=f"{ADDED_LOSS_SCALE}_{i}")
             for i, t in enumerate(terms)]
    if loss.shape.rank not in (0, None):
        raise CaptureError(f"the loss must be a scalar. Received shape {loss.shape}")
    captured = {id(external): internal for external, internal in graph.captures}
    handle_of = {}
    for v in list(trainable) + list(state):
        tf_var = v.value if isinstance(getattr(v, "value", None), tf.Variable) else v
        internal = captured.get(id(tf_var.handle))
        if internal is not None:
            handle_of[id(v)] = internal.op.name

    traced = []
    for v, var_name, grad in zip(trainable, names, grads):
        if id(v) not in handle_of:
            logger.warning("variable %s is not used by the step; it gets no gradient", var_name)
        traced.append(TracedVariable(var_name, handle_of.get(id(v), ""), tf.as_dtype(v.dtype),
                                      [int(d) for d in v.shape], grad))
    known_handles = set(handle_of.values())
    table_infos = []
    for layer_name, table in tables:
        internal = captured.get(id(table.resource_handle))
        if internal is not None:
            table_infos.append(_table_info(internal.op.name, layer_name, table))
    known_handles |= {t.placeholder for t in table_infos}

    graph_def = graph.as_graph_def()
    dropped = drop_foreign_state(graph, graph_def, known_handles,
                                  [loss] + [g for g in grads if g is not None] + metric_states)
    inline_constant_captures(graph, graph_def, known_handles | dropped)

    num_inputs = len(input_infos)
    inputs = []
    # Arguments that are None (a step without targets) are no inputs of the graph.
    num_args = sum(1 for s in tf.nest.flatten(concrete.structured_input_signature)
                   if s is not None)
    flat_inputs = concrete.inputs[:num_args]
    if len(flat_inputs) != num_inputs:
        input_infos = [(t.op.name, "") for t in flat_inputs]
    for (in_name, role), tensor in zip(input_infos, flat_inputs):
        inputs.append(graph_item_pb2.TensorInfo(
            name=in_name, tensor=tensor.name, dtype=tensor.dtype.name,
            shape=proto_shape(tensor.shape), role=role))

    states = []
    for v, var_name in zip(state, state_names):
        node = handle_of.get(id(v))
        if node is None:
            continue
        updates = state_update_ops(graph, node)
        states.append(state_info(var_name, node, tf.as_dtype(v.dtype), list(v.shape), updates))
    metrics = [graph_item_pb2.TensorInfo(name=metric_name, tensor=t.name, dtype=t.dtype.name,
                                         shape=proto_shape(t.shape))
               for metric_name, t in zip(metric_names, metric_states)]
    item = assemble(graph, graph_def, source, name, inputs, loss, traced, states,
                     optimizer_info, batch_size, dropped, metrics, table_infos)
    item.proto.added_losses.extend(added)
    return item


def _table_info(placeholder: str, layer_name: str, table) -> graph_item_pb2.TableInfo:
    """A lookup table's contents, as every task rebuilds it."""
    keys, values = table.export()
    default = getattr(table, "default_value", None)
    if default is None:
        raise CaptureError(f"layer {layer_name!r} holds a lookup table without a default value "
                           f"({type(table).__name__}); only static tables can be rebuilt on "
                           "the workers")
    return graph_item_pb2.TableInfo(
        placeholder=placeholder, key_dtype=table.key_dtype.name,
        value_dtype=table.value_dtype.name, layer=layer_name,
        keys=tf.make_tensor_proto(keys.numpy()).SerializeToString(),
        values=tf.make_tensor_proto(values.numpy()).SerializeToString(),
        default_value=tf.make_tensor_proto(np.asarray(default)).SerializeToString())
