"""A step imported with inputs of a given number of examples, for static shapes.

The traced step's inputs have an unknown batch dimension, so shape inference
leaves every shape derived from it unknown, and a guess (the batch, for each
unknown dimension) can be far off: an upsampling gradient reshapes to several
dimensions at once. Importing the step with inputs of exactly `batch`
examples and with variable handles that carry their variable's shape lets
TensorFlow's shape inference compute them. A table lookup's result has no
shape there (its table is a placeholder of the captured step, and TensorFlow
infers none through it), which would hide the batch from everything after a
StringLookup: for the import each lookup becomes a `Fill` of its keys' shape
with its default value, which has the lookup's shape and type. Used for the per-op cost
estimates and the rows of sparse gradients (`capture`) and for the shapes
random ops draw (`random_ops`).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import tensorflow as tf


def graph_at_batch(graph_def, inputs, batch: int, handles: Mapping[str, tuple[str, Sequence[int]]],
                   length: int | None = None) -> tf.Graph | None:
    """A copy of the step whose inputs hold `batch` examples; None if it cannot be imported.

    Args:
        graph_def: The step.
        inputs: Its `TensorInfo` inputs (an unknown dimension is -1).
        batch: Examples per input.
        handles: Each variable placeholder -> (dtype, shape) of its variable.
        length: Substituted for the inputs' other unknown dimensions (variable
            lengths); default `batch`.
    """
    return import_at_batch(graph_def, inputs, batch, handles, length)[0]


def import_at_batch(graph_def, inputs, batch: int,
                    handles: Mapping[str, tuple[str, Sequence[int]]],
                    length: int | None = None) -> tuple[tf.Graph | None, str]:
    """`graph_at_batch`, with the import's error message where it failed (else "")."""
    length = batch if length is None else length
    graph = tf.Graph()
    with graph.as_default():
        feeds = {f"{node}:0": tf.raw_ops.VarHandleOp(dtype=tf.as_dtype(dtype), shape=shape,
                                                     shared_name=f"shape_of_{i}",
                                                     name=f"autodist_shape_of_{i}")
                 for i, (node, (dtype, shape)) in enumerate(sorted(handles.items()))}
        for i, info in enumerate(inputs):
            if not info.shape:
                continue
            shape = [batch if d < 0 and k == 0 else length if d < 0 else d
                     for k, d in enumerate(info.shape)]
            feeds[info.tensor] = tf.compat.v1.placeholder(tf.as_dtype(info.dtype), shape,
                                                          name=f"autodist_input_at_batch_{i}")
        try:
            tf.import_graph_def(_lookups_shaped(graph_def), input_map=feeds, name="")
        except (ValueError, tf.errors.OpError) as e:
            return None, str(e)
    return graph, ""


_LOOKUPS = frozenset({"LookupTableFindV2", "LookupTableFind"})


def _lookups_shaped(graph_def):
    """`graph_def` with every table lookup (table, keys, default) replaced by a `Fill` of
    the keys' shape with the default: the same shape and type, for shape inference only
    (a lookup of scalar values, as Keras' lookup layers make)."""
    if not any(node.op in _LOOKUPS for node in graph_def.node):
        return graph_def
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    for node in list(out.node):
        if node.op not in _LOOKUPS:
            continue
        shape = out.node.add()
        shape.name = f"{node.name}/autodist_keys_shape"
        shape.op = "Shape"
        shape.input.append(node.input[1])
        shape.attr["T"].CopyFrom(node.attr["Tin"])
        shape.attr["out_type"].type = tf.int32.as_datatype_enum
        default = node.input[2]
        controls = [i for i in node.input if i.startswith("^")]
        value_type = type(node.attr["Tout"])()
        value_type.CopyFrom(node.attr["Tout"])
        node.op = "Fill"
        del node.input[:]
        node.input.extend([shape.name, default] + controls)
        node.attr.clear()
        node.attr["T"].CopyFrom(value_type)
        node.attr["index_type"].type = tf.int32.as_datatype_enum
    return out
