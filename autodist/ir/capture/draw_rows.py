"""In which order a random draw's rows follow the batch's examples.

The runtime draws a global-batch tensor and keeps the rows of its replica's
examples (`autodist.kernels.random_draws`), so it must know which rows those
are. Shape inference tells only that the draw's batch axis holds a whole
number of rows per example. Usually an example's rows are adjacent (examples,
or examples x timesteps), but after a concatenation of batch-sized tensors
along the batch axis (two views of each example, a GAN's fake and real
images) the rows come in blocks, each holding every example in batch order;
a time-major reshape gives one block per timestep.

Found by running the step on random examples: the tensor whose shape the
draw takes, computed on a batch and again with one example changed at a
time; a row belongs to the example whose change moves it most (the others'
move it only through batch statistics). Ids take two values (1 and 2, else 0
and 1), strings two words of the model's vocabularies. Rows that no example
moves (inputs that all map to the same thing) leave the order undetermined
and the draw is read as one block, as shape inference alone would (rightly
where the draw's shape comes from an input-independent tensor, such as an
RNN's initial state). Rows in no block order (a shuffle, a reversal) make the
draw unreproducible, with the reason.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf

from autodist.ir.capture.example_runs import (every_draw, model_variable_handles, terms_runner,
                                              without_batch_statistics)
from autodist.ir.graph_item import GraphItem

EXAMPLES = 4   # examples in the probing batch
_SEARCH_DEPTH = 8   # ops between a draw's shape input and the `Shape` it comes from
# Lengths for the inputs' unknown dimensions, tried in turn (convolutions and
# poolings over a short sequence leave nothing to run on).
_PROBE_LENGTHS = (3, 61, 257)
UNORDERED = "its rows along the batch axis are not in blocks of the examples in batch order"


def find_row_blocks(item: GraphItem, model) -> None:
    """Sets `row_blocks` of the step's reproducible draws whose rows come in several
    blocks; marks unreproducible those in no block order (see the module)."""
    ops = [op for op in item.proto.random_ops if op.reproducible and op.batch_axis >= 0]
    if not ops:
        return
    graph_def = without_batch_statistics(item.graph_def(), item.batch_norms)
    nodes = {node.name: node for node in graph_def.node}
    sources = {op.node: _shape_source(nodes, nodes[op.node].input[op.shape_input])
               for op in ops}
    ops = [op for op in ops if sources[op.node] is not None]
    if not ops:
        return
    fetches = [sources[op.node] for op in ops] + \
        [_tensor_name(nodes[op.node].input[op.shape_input]) for op in ops]
    state = [(v, np.array(v.numpy())) for v in model.variables if not v.trainable]
    outputs = None
    try:
        # Every draw fixed: one that does not follow the batch (RandomCrop's offsets)
        # would otherwise differ from run to run and move every row.
        run = terms_runner(graph_def, model_variable_handles(item, model),
                           every_draw(graph_def, item.random_ops), fetches, item.tables)
        # Ids 1 and 2 first (0 is often padding, masked away); 0 and 1 where 2 is too many.
        attempts = [(ids, length) for length in _PROBE_LENGTHS for ids in ((1, 2), (0, 1))]
        for ids, length in attempts:
            values = _probe_values(item, ids)
            base = _probe_examples(item, values, np.random.default_rng(1), length)
            try:
                outputs = [run(batch) for batch in
                           [base] + _each_example_changed(item, base, values)]
                break
            except Exception:  # noqa: BLE001  # ids or a length the model does not take
                continue
    except Exception:  # noqa: BLE001  # a step that cannot run in the driver
        return
    finally:
        for variable, value in state:
            variable.assign(value)
    if outputs is None:   # examples that do not suit the model: nothing learned
        return
    for k, op in enumerate(ops):
        rows = int(outputs[0][len(ops) + k][op.batch_axis])
        blocks = _blocks(_owners([out[k] for out in outputs], rows, op.batch_axis))
        if blocks is None:
            op.reproducible, op.reason = False, UNORDERED
        elif len(blocks) > 1:
            op.row_blocks.extend(blocks)


def _tensor_name(input_name: str) -> str:
    return input_name if ":" in input_name else f"{input_name}:0"


def _shape_source(nodes, shape_input: str) -> str | None:
    """The tensor whose `Shape` the draw's shape is built from (nearest first)."""
    frontier, seen = [shape_input], set()
    for _ in range(_SEARCH_DEPTH):
        upstream = []
        for name in frontier:
            node_name, _, index = name.lstrip("^").partition(":")
            node = nodes.get(node_name)
            if node is None or node_name in seen:
                continue
            seen.add(node_name)
            if node.op == "Shape":
                return _tensor_name(node.input[0])
            if node.op == "ShapeN":
                return _tensor_name(node.input[int(index or 0)])
            upstream.extend(i for i in node.input if not i.startswith("^"))
        frontier = upstream
    return None


def _probe_values(item: GraphItem, ids: tuple[int, int]) -> dict[str, tuple]:
    """The two values each input's elements take (an example changed takes the other):
    `ids` for integers, two words of the model's vocabularies for strings (unknown
    strings all look the same), None for floats (normal values)."""
    words = _vocabulary_words(item)[:2]
    strings = tuple(words) if len(words) == 2 else (b"", b"a")
    out = {}
    for info in item.inputs:
        dtype = tf.as_dtype(info.dtype)
        out[info.tensor] = strings if dtype == tf.string else \
            None if dtype.is_floating or info.role == "sample_weight" else ids
    return out


def _vocabulary_words(item: GraphItem) -> list[bytes]:
    """String keys of the captured lookup tables (StringLookup, TextVectorization)."""
    from tensorflow.core.framework import tensor_pb2

    words = []
    for table in item.tables:
        if tf.as_dtype(table.key_dtype) != tf.string:
            continue
        proto = tensor_pb2.TensorProto()
        proto.ParseFromString(table.keys)
        words += [w for w in tf.make_ndarray(proto).ravel().tolist() if w and w not in words]
    return words


def _probe_examples(item: GraphItem, values: dict[str, tuple], rng: np.random.Generator,
                    length: int) -> dict[str, np.ndarray]:
    """`EXAMPLES` random examples: normal floats, each other element one of its input's
    two `values`, unit sample weights; unknown dimensions of `length`."""
    out = {}
    for info in item.inputs:
        shape = [EXAMPLES] + [length if d < 0 else d for d in info.shape[1:]]
        dtype = tf.as_dtype(info.dtype)
        pair = values[info.tensor]
        if info.role == "sample_weight":
            out[info.tensor] = np.ones(shape, dtype.as_numpy_dtype)
        elif pair is None:
            out[info.tensor] = rng.normal(size=shape).astype(dtype.as_numpy_dtype)
        else:
            chosen = np.where(rng.random(shape) < 0.5, 0, 1)
            out[info.tensor] = np.asarray(pair, dtype=object if dtype == tf.string else
                                          dtype.as_numpy_dtype)[chosen]
    return out


def _each_example_changed(item: GraphItem, base: dict[str, np.ndarray],
                          values: dict[str, tuple]) -> list[dict[str, np.ndarray]]:
    """One batch per example: `base` with that example's inputs (not its sample
    weights) changed everywhere (the other of two values; a float moved by over 1)."""
    roles = {info.tensor: info.role for info in item.inputs}
    out = []
    for example in range(EXAMPLES):
        batch = {name: value.copy() for name, value in base.items()}
        for name, value in batch.items():
            if roles[name] == "sample_weight":
                continue
            row, pair = value[example], values[name]
            if pair is None:
                value[example] = row + 1.0 + np.abs(row)
            else:
                value[example] = np.where(row == pair[0], pair[1], pair[0]).astype(value.dtype)
        out.append(batch)
    return out


def _owners(values: Sequence[np.ndarray], rows: int, draw_axis: int) -> np.ndarray | None:
    """The example each row of the draw belongs to, from the source's values on the
    base batch and with each example changed; None where some row moved for none."""
    base = values[0]
    axis = _row_axis(base.shape, rows, draw_axis)
    if axis is None:
        return None
    moved = np.stack([
        np.abs(np.moveaxis(changed.astype(np.float64) - base, axis, 0)).reshape(rows, -1)
        .max(axis=1, initial=0.0) for changed in values[1:]])
    if not np.all(np.isfinite(moved)) or np.any(moved.max(axis=0) <= 0):
        return None
    return moved.argmax(axis=0)


def _row_axis(shape: Sequence[int], rows: int, draw_axis: int) -> int | None:
    """The source's axis that the draw's batch axis follows: the one of `rows` length,
    the draw's own axis or else the first if several."""
    axes = [a for a, d in enumerate(shape) if d == rows]
    return draw_axis if draw_axis in axes else axes[0] if axes else None


def _blocks(owners: np.ndarray | None) -> list[int] | None:
    """Rows per example of each block (`RandomOpInfo.row_blocks`); [] when the order
    is undetermined; None when the rows are in no block order."""
    if owners is None:
        return []
    blocks, start = [], 0
    while start < len(owners):
        per_example = 0
        while start + per_example < len(owners) and owners[start + per_example] == 0:
            per_example += 1
        expected = np.repeat(np.arange(EXAMPLES), per_example)
        if per_example == 0 or not np.array_equal(
                owners[start:start + len(expected)], expected):
            return None
        blocks.append(per_example)
        start += len(expected)
    return blocks
