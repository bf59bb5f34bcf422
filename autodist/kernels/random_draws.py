"""Random ops that draw for the global batch, each replica keeping its rows.

One device draws Dropout's mask (and every other stateless draw spanning the
batch) for the whole batch; a replica or virtual node holds only some of its
rows. Its step is rewritten so that each such op (found at capture,
`autodist.ir.random_ops`) draws with the global batch's shape and the step
goes on with the slice of the rows its virtual node holds: the same numbers
one device uses for those rows, whatever the number of workers and virtual
nodes. The seed is the model's own (a `SeedGenerator` state, advanced once
per step in every virtual node's copy).

The rewritten step reads where its virtual node's examples sit in the global
batch (`batch_share`). An axis holding rows proportional to the examples
(examples x timesteps) is scaled by rows per example.
"""
from __future__ import annotations

from typing import Sequence

import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from autodist.kernels import batch_share, graph_edit

EXAMPLES, FIRST, LOCAL = batch_share.EXAMPLES, batch_share.FIRST, batch_share.LOCAL


def reproducible(random_ops: Sequence) -> list:
    """The ops the rewrite applies to."""
    return [op for op in random_ops if op.reproducible and op.batch_axis >= 0]


def for_global_batch(graph_def, random_ops: Sequence):
    """`graph_def` with each reproducible random op drawing for the global batch.

    Args:
        graph_def: The step (not modified).
        random_ops: The capture's `RandomOpInfo`s.

    Returns:
        A new GraphDef taking `EXAMPLES`, `FIRST` and `LOCAL`, or `graph_def`
        itself when no op needs it.
    """
    ops = reproducible(random_ops)
    if not ops:
        return graph_def
    out = tf.compat.v1.GraphDef()
    out.CopyFrom(graph_def)
    nodes = {node.name: node for node in out.node}
    batch_share.add_inputs(out)
    for info in ops:
        node = nodes[info.node]
        _rewrite(out, node, info, _shape_dtype(node, info.shape_input))
    return out


def _shape_dtype(node, index: int) -> tf.DType:
    op_def = op_def_registry.get(node.op)
    arg = op_def.input_arg[index]
    if arg.type_attr:
        return tf.as_dtype(node.attr[arg.type_attr].type)
    return tf.as_dtype(arg.type)


def _rewrite(graph_def, node, info, index_type: tf.DType) -> None:
    prefix = f"{node.name}/autodist_global"
    shape = node.input[info.shape_input]
    onehot = [1 if a == info.batch_axis else 0 for a in range(info.rank)]
    add, const = graph_edit.add, graph_edit.const
    const(graph_def, f"{prefix}/onehot", onehot, index_type)
    const(graph_def, f"{prefix}/keep", [1 - v for v in onehot], index_type)
    const(graph_def, f"{prefix}/axis", [0], tf.int32)
    for name, source in (("local", LOCAL), ("examples", EXAMPLES), ("first", FIRST)):
        add(graph_def, f"{prefix}/{name}", "Cast", [source], SrcT=tf.int32, DstT=index_type,
            Truncate=False)
    add(graph_def, f"{prefix}/masked", "Mul", [shape, f"{prefix}/onehot"], T=index_type)
    add(graph_def, f"{prefix}/dim", "Sum", [f"{prefix}/masked", f"{prefix}/axis"],
        T=index_type, Tidx=tf.int32, keep_dims=False)
    # Rows per example along the axis: 1 for examples, T for examples x timesteps. A
    # replica without examples in a short last batch draws none (0 // 1).
    const(graph_def, f"{prefix}/one", 1, index_type)
    add(graph_def, f"{prefix}/some_local", "Maximum", [f"{prefix}/local", f"{prefix}/one"],
        T=index_type)
    add(graph_def, f"{prefix}/per_example", "FloorDiv",
        [f"{prefix}/dim", f"{prefix}/some_local"], T=index_type)
    add(graph_def, f"{prefix}/global_dim", "Mul",
        [f"{prefix}/per_example", f"{prefix}/examples"], T=index_type)
    add(graph_def, f"{prefix}/kept", "Mul", [shape, f"{prefix}/keep"], T=index_type)
    add(graph_def, f"{prefix}/spread", "Mul", [f"{prefix}/onehot", f"{prefix}/global_dim"],
        T=index_type)
    add(graph_def, f"{prefix}/shape", "AddV2", [f"{prefix}/kept", f"{prefix}/spread"],
        T=index_type)
    readers = graph_edit.readers(graph_def, node.name)
    node.input[info.shape_input] = f"{prefix}/shape"
    blocks = list(info.row_blocks) or [None]
    rows = [_block_rows(graph_def, node, info, index_type, shape, k, blocks)
            for k in range(len(blocks))]
    if len(rows) > 1:
        const(graph_def, f"{prefix}/batch_axis", info.batch_axis, tf.int32)
        rows = [add(graph_def, f"{prefix}/rows", "ConcatV2", rows + [f"{prefix}/batch_axis"],
                    N=len(rows), T=tf.as_dtype(node.attr["dtype"].type), Tidx=tf.int32)]
    graph_edit.redirect(readers, node.name, rows[0])


def _block_rows(graph_def, node, info, index_type: tf.DType, shape: str, k: int,
                blocks: list[int | None]) -> str:
    """The rows of the replica's examples in block `k` of the global draw (`shape`: the
    replica's own draw shape; `blocks`: each block's rows per example, [None] for one
    block of any number)."""
    prefix = f"{node.name}/autodist_global"
    add, const = graph_edit.add, graph_edit.const
    if blocks == [None]:
        # One block: the replica's rows start at its first example's.
        per_example, start, size = f"{prefix}/per_example", None, shape
        name = f"{prefix}/rows"
    else:
        # Block k starts after the global batch's rows of the blocks before it.
        per_example = const(graph_def, f"{prefix}/block{k}/per_example", blocks[k], index_type)
        start = add(graph_def, f"{prefix}/block{k}/start", "Mul",
                    [const(graph_def, f"{prefix}/block{k}/rows_before", sum(blocks[:k]),
                           index_type), f"{prefix}/examples"], T=index_type)
        local_rows = add(graph_def, f"{prefix}/block{k}/local_rows", "Mul",
                         [per_example, f"{prefix}/local"], T=index_type)
        size = add(graph_def, f"{prefix}/block{k}/size", "AddV2", [
            f"{prefix}/kept", add(graph_def, f"{prefix}/block{k}/spread", "Mul",
                                  [f"{prefix}/onehot", local_rows], T=index_type)],
            T=index_type)
        name = f"{prefix}/block{k}/rows"
    first_row = add(graph_def, f"{prefix}/block{k}/first_row", "Mul",
                    [per_example, f"{prefix}/first"], T=index_type)
    if start is not None:
        first_row = add(graph_def, f"{prefix}/block{k}/begin_row", "AddV2",
                        [start, first_row], T=index_type)
    begin = add(graph_def, f"{prefix}/block{k}/begin", "Mul", [f"{prefix}/onehot", first_row],
                T=index_type)
    return add(graph_def, name, "Slice", [node.name, begin, size],
               T=tf.as_dtype(node.attr["dtype"].type), Index=index_type)
