"""Embedding lookups gather rows where the table lives, not after reading it whole.

Keras 3 looks up an embedding as ``GatherV2(ReadVariableOp(table), ids,
axis=0)``: the whole table is read and then gathered. With the table on a
parameter server that moves every row over the network on every step. This
rewrite (part of the partitioner pass, applied to every variable) turns
such a read into ``ResourceGather(table, ids)``, which runs on the table's
device and returns only the touched rows, and replaces ``Shape`` of the read
by the variable's static shape. The read is then unused; it is removed with
the control edges to it (a tf.function orders its reads with control edges
to a final NoOp; reads have no side effects, so dropping them changes no
value), and so are colocation constraints naming it. A read with any other
consumer is left as it is.
"""
from __future__ import annotations

import tensorflow as tf

from autodist.ir.device_names import op_name
from autodist.ir.graph_item import GraphItem


def gather_where_tables_live(graph_def, graph_item: GraphItem):
    """Returns a GraphDef in which whole-table reads that only feed gathers are gone."""
    handles = {v.handle_node: v for v in graph_item.variables if v.handle_node}
    nodes = {n.name: n for n in graph_def.node}
    consumers: dict[str, list] = {}
    for node in graph_def.node:
        for inp in node.input:
            if not inp.startswith("^"):
                consumers.setdefault(op_name(inp), []).append(node)
    replace: dict[str, tf.compat.v1.NodeDef] = {}
    removed: set[str] = set()
    for read in graph_def.node:
        if read.op != "ReadVariableOp" or op_name(read.input[0]) not in handles:
            continue
        users = consumers.get(read.name, [])
        if not users or not all(_is_row_gather(u, read.name, nodes) or u.op == "Shape"
                                for u in users):
            continue
        var = handles[op_name(read.input[0])]
        for user in users:
            replace[user.name] = (_resource_gather(user, read) if user.op == "GatherV2"
                                  else _static_shape(user, list(var.shape)))
        removed.add(read.name)
    if not removed:
        return graph_def
    out = tf.compat.v1.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)
    for node in graph_def.node:
        if node.name in removed:
            continue
        copy = out.node.add()
        copy.CopyFrom(replace.get(node.name, node))
        kept = [i for i in copy.input if not (i.startswith("^") and i[1:] in removed)]
        del copy.input[:]
        copy.input.extend(kept)
        if "_class" in copy.attr:
            # Colocation with a removed read is meaningless (and fails import).
            groups = [c for c in copy.attr["_class"].list.s
                      if c.decode().removeprefix("loc:@") not in removed]
            del copy.attr["_class"]
            if groups:
                copy.attr["_class"].list.s.extend(groups)
    return out


def _is_row_gather(node, read_name: str, nodes) -> bool:
    """GatherV2 of the read's rows (params input, axis 0, no batch dims)."""
    if node.op != "GatherV2" or op_name(node.input[0]) != read_name:
        return False
    if op_name(node.input[1]) == read_name or node.attr["batch_dims"].i != 0:
        return False
    axis = nodes.get(op_name(node.input[2]))
    if axis is None or axis.op != "Const":
        return False
    return int(tf.make_ndarray(axis.attr["value"].tensor)) == 0


def _resource_gather(gather, read) -> tf.compat.v1.NodeDef:
    node = tf.compat.v1.NodeDef(name=gather.name, op="ResourceGather", device=gather.device)
    node.input.extend([read.input[0], gather.input[1]])
    node.input.extend(i for i in gather.input if i.startswith("^"))
    node.attr["dtype"].CopyFrom(read.attr["dtype"])
    node.attr["Tindices"].CopyFrom(gather.attr["Tindices"])
    node.attr["batch_dims"].i = 0
    node.attr["validate_indices"].b = True
    return node


def _static_shape(shape_op, shape: list[int]) -> tf.compat.v1.NodeDef:
    out_type = tf.as_dtype(shape_op.attr["out_type"].type)
    node = tf.compat.v1.NodeDef(name=shape_op.name, op="Const", device=shape_op.device)
    node.input.extend(i for i in shape_op.input if i.startswith("^"))
    node.attr["dtype"].type = out_type.as_datatype_enum
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(shape, dtype=out_type))
    return node
