"""Small edits of a GraphDef: adding nodes, rewiring a node's readers.

The step's rewrites that must happen inside the traced graph (random draws
for the global batch, batch statistics summed over replicas) edit the
GraphDef before the replicator imports it.
"""
from __future__ import annotations

import tensorflow as tf


def const(graph_def, name: str, values, dtype: tf.DType) -> str:
    """Adds a Const node; returns its name."""
    node = graph_def.node.add(name=name, op="Const")
    node.attr["dtype"].type = dtype.as_datatype_enum
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(values, dtype))
    return name


def add(graph_def, name: str, op: str, inputs: list[str], **attrs) -> str:
    """Adds a node; attributes are dtypes, bools, ints, floats, strings or (for
    `shape`) a list of dimensions. Returns its name."""
    node = graph_def.node.add(name=name, op=op)
    node.input.extend(inputs)
    for key, value in attrs.items():
        if isinstance(value, tf.DType):
            node.attr[key].type = value.as_datatype_enum
        elif isinstance(value, bool):
            node.attr[key].b = value
        elif isinstance(value, int):
            node.attr[key].i = value
        elif isinstance(value, float):
            node.attr[key].f = value
        elif isinstance(value, str):
            node.attr[key].s = value.encode()
        else:   # a shape
            node.attr[key].shape.CopyFrom(tf.TensorShape(value).as_proto())
    return name


def reads(input_name: str, node_name: str) -> bool:
    """Whether an input reads the node's first output (not a control input)."""
    return input_name in (node_name, f"{node_name}:0")


def readers(graph_def, node_name: str) -> list:
    """The nodes reading `node_name`'s first output."""
    return [n for n in graph_def.node if any(reads(i, node_name) for i in n.input)]


def redirect(nodes, node_name: str, new_name: str) -> None:
    """Makes `nodes` read `new_name` where they read `node_name`'s first output."""
    for node in nodes:
        for k, name in enumerate(node.input):
            if reads(name, node_name):
                node.input[k] = new_name


def redirect_tensor(graph_def, tensor: str, new_name: str, skip: str = "") -> None:
    """Makes every node but `skip` read `new_name` where it reads `tensor` ("node:k")."""
    node, _, index = tensor.partition(":")
    names = {tensor} | ({node} if index in ("", "0") else set())
    for reader in graph_def.node:
        if reader.name == skip:
            continue
        for k, name in enumerate(reader.input):
            if name in names:
                reader.input[k] = new_name

