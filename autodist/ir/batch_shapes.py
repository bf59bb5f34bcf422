"""A step imported with inputs of a given number of examples, for static shapes.

The traced step's inputs have an unknown batch dimension, so shape inference
leaves every shape derived from it unknown, and a guess (the batch, for each
unknown dimension) can be far off: an upsampling gradient reshapes to several
dimensions at once. Importing the step with inputs of exactly `batch` examples
and with variable handles that carry their variable's shape lets TensorFlow's
shape inference compute them. A table lookup's result has no shape there (its
table is a placeholder of the captured step, and TensorFlow infers none through
it), which would hide the batch from everything after a StringLookup: for the
import each lookup becomes its default value broadcast to the keys' shape (and
the value's), which has the lookup's shape and type. Used for the per-op cost
estimates and the rows of sparse gradients (`capture`) and for the shapes random
ops draw (`random_ops`).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import tensorflow as tf

# Stand-ins for an input's unknown dimension other than the batch's (a variable
# length), tried in turn: a stack of convolutions and poolings shrinks a short one
# below zero and the step does not import (pretrained_word_embeddings's three
# Conv1D(5) and two MaxPooling1D(5) need 149). Primes: never a trial batch's multiple.
STAND_IN_LENGTHS = (7, 61, 257, 1031, 4099)


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


def graphs_at_batches(graph_def, inputs, batches: Sequence[int],
                      handles: Mapping[str, tuple[str, Sequence[int]]]
                      ) -> tuple[int, list[tf.Graph]] | None:
    """The step imported at each of `batches`, with the first of `STAND_IN_LENGTHS` for
    the other unknown dimensions at which it imports at all of them (that length and
    the graphs); None where it imports at none."""
    for length in STAND_IN_LENGTHS:
        graphs = [graph_at_batch(graph_def, inputs, b, handles, length) for b in batches]
        if all(g is not None for g in graphs):
            return length, graphs
    return None


_LOOKUPS = frozenset({"LookupTableFindV2", "LookupTableFind"})


def _lookups_shaped(graph_def):
    """`graph_def` with every table lookup (table, keys, default) replaced by the default
    broadcast to the keys' shape and its own: the lookup's shape and type, for shape
    inference only."""
    if not any(node.op in _LOOKUPS for node in graph_def.node):
        return graph_def
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    int32 = tf.int32.as_datatype_enum
    for node in list(out.node):
        if node.op not in _LOOKUPS:
            continue
        keys, default = node.input[1], node.input[2]
        shapes = []
        for part, source, dtype in (("keys", keys, node.attr["Tin"]),
                                    ("default", default, node.attr["Tout"])):
            shape = out.node.add(name=f"{node.name}/autodist_{part}_shape", op="Shape")
            shape.input.append(source)
            shape.attr["T"].CopyFrom(dtype)
            shape.attr["out_type"].type = int32
            shapes.append(shape.name)
        axis = out.node.add(name=f"{node.name}/autodist_axis", op="Const")
        axis.attr["dtype"].type = int32
        axis.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(0, tf.int32))
        joined = out.node.add(name=f"{node.name}/autodist_shape", op="ConcatV2")
        joined.input.extend(shapes + [axis.name])
        joined.attr["N"].i = 2
        joined.attr["T"].type = int32
        joined.attr["Tidx"].type = int32
        controls = [i for i in node.input if i.startswith("^")]
        value_type = type(node.attr["Tout"])()
        value_type.CopyFrom(node.attr["Tout"])
        node.op = "BroadcastTo"
        del node.input[:]
        node.input.extend([default, joined.name] + controls)
        node.attr.clear()
        node.attr["T"].CopyFrom(value_type)
        node.attr["Tidx"].type = int32
    return out
