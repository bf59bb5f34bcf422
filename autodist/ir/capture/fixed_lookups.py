"""Rows of a table looked up at indices that do not depend on the batch, some more
than once (Swin's relative position bias: a table read through a fixed index of
its pairs of positions).

The capture makes such a gradient dense (`keras_model.rows_per_example`): each
row summed over the batch and its lookups, summed over the replicas as a dense
gradient is. Keras' optimizers that square the gradient (Adam's second moment,
`clipnorm`) square each lookup of the batch's sparse gradient before adding the
repeats, and a replica's part of a lookup is not the batch's: the run cannot
give those squares. The capture evaluates the indices (they depend on no input)
and marks the gradient (`GradientInfo.repeated_lookups`); `keras_parity`
refuses it where several replicas or virtual nodes would train it.
"""
from __future__ import annotations

import numpy as np

from autodist.ir.capture.example_runs import model_variable_handles, random_examples, run_terms
from autodist.ir.device_names import op_name
from autodist.ir.graph_item import GraphItem, optimizer_squares_gradient

# The name scope of such a gradient's densification (`rows_per_example`).
FIXED_ROWS_SCOPE = "autodist_fixed_rows"


def find_repeated_lookups(item: GraphItem, model) -> None:
    """Marks each dense gradient made of rows looked up at fixed indices that repeat."""
    if not optimizer_squares_gradient(item.optimizer):
        return
    graph_def = item.graph_def()
    nodes = {node.name: node for node in graph_def.node}
    indices = {}
    for var in item.proto.variables:
        node = _source(nodes, var.gradient.dense, ("Identity",)) if var.gradient.dense \
            else None
        if node is not None and node.op == "UnsortedSegmentSum" and any(
                scope.startswith(FIXED_ROWS_SCOPE) for scope in node.name.split("/")[:-1]) \
                and not _is_range(_source(nodes, node.input[1], _RESHAPING)):
            indices[var.name] = node.input[1] if ":" in node.input[1] else f"{node.input[1]}:0"
    if not indices:
        return
    state = [(v, np.array(v.numpy())) for v in model.variables if not v.trainable]
    try:
        values = run_terms(graph_def, model_variable_handles(item, model),
                           random_examples(item, 2), [], list(indices.values()), item.tables)
    except Exception:  # noqa: BLE001  # examples that do not suit the model: left unmarked
        return
    finally:
        for variable, value in state:
            variable.assign(value)
    repeated = {name for name, value in zip(indices, values)
                if np.unique(value).size < np.size(value)}
    for var in item.proto.variables:
        if var.name in repeated:
            var.gradient.repeated_lookups = True


# Ops that pass their first input's values on (an `arange` seen through them is one).
_RESHAPING = ("Identity", "Cast", "Reshape")


def _source(nodes, tensor: str, through: tuple[str, ...]):
    """The node computing `tensor`, seen through the ops `through` (None if absent)."""
    node = nodes.get(op_name(tensor))
    while node is not None and node.op in through and node.input:
        node = nodes.get(op_name(node.input[0]))
    return node


def _is_range(node) -> bool:
    """An `arange`: unique indices (a position embedding's), with nothing to evaluate."""
    return node is not None and node.op == "Range"
