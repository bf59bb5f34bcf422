"""The captured step run on random examples: static facts that shape
inference cannot tell (the batch axis of random draws) and added-loss kinds."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import tensorflow as tf

from autodist.ir import random_ops
from autodist.ir.capture.names import keras_variable_names
from autodist.ir.graph_item import GraphItem
from autodist.proto import graph_item_pb2


def random_examples(item: GraphItem, size: int, seed: int = 0, ids: bool = False,
                    unit: bool = False) -> dict[str, np.ndarray]:
    """Random examples for the step's inputs: normal floats (unit sample weights), zero
    ids, empty strings; unknown dimensions of length 3. With `ids`, numbers are ids
    1 and 2 instead, floats too (a float input of labels: keras-io's captcha_ocr feeds
    its CTC loss float labels, which must be non-negative integers). With `unit`,
    floats are uniform in [0, 1), as images scaled to it (keras-io's Zero-DCE iterates
    a curve that normal values drive to infinity)."""
    rng = np.random.default_rng(seed)
    out = {}
    for info in item.inputs:
        shape = [size] + [3 if d < 0 else d for d in info.shape[1:]]
        dtype = tf.as_dtype(info.dtype)
        if dtype == tf.string:
            out[info.tensor] = np.full(shape, b"")
        elif info.role == "sample_weight":
            out[info.tensor] = np.ones(shape, dtype.as_numpy_dtype)
        elif ids:
            out[info.tensor] = rng.integers(1, 3, size=shape).astype(dtype.as_numpy_dtype)
        elif unit and dtype.is_floating:
            out[info.tensor] = rng.uniform(size=shape).astype(dtype.as_numpy_dtype)
        elif dtype.is_floating:
            out[info.tensor] = rng.normal(size=shape).astype(dtype.as_numpy_dtype)
        else:
            out[info.tensor] = np.zeros(shape, dtype.as_numpy_dtype)
    return out


def infer_draw_shapes(item: GraphItem, model) -> None:
    """The batch axis of random draws whose shape static inference could not tell (after
    ops of unknown shapes, such as TextVectorization's): their shape inputs evaluated
    on random examples at two batch sizes (`random_ops.batch_axis`)."""
    unknown = [op for op in item.proto.random_ops
               if not op.reproducible and op.reason == random_ops.UNINFERRED]
    if not unknown:
        return
    graph_def = item.graph_def()
    nodes = {n.name: n for n in graph_def.node}
    shapes = {op.node: _tensor_name(nodes[op.node].input[op.shape_input]) for op in unknown}
    state = [(v, np.array(v.numpy())) for v in model.variables if not v.trainable]
    handles = model_variable_handles(item, model)
    try:
        small, large = (
            run_terms(graph_def, handles, random_examples(item, size), list(item.random_ops),
                       list(shapes.values()), item.tables)
            for size in random_ops.TRIAL_BATCHES)
    except Exception:  # noqa: BLE001  # examples that do not suit the model
        return
    finally:
        for variable, value in state:
            variable.assign(value)
    for op, a, b in zip(unknown, small, large):
        random_ops.set_batch_axis(op, [int(d) for d in a], [int(d) for d in b])


def _tensor_name(input_name: str) -> str:
    return input_name if ":" in input_name else f"{input_name}:0"


def model_variable_handles(item: GraphItem, model) -> dict[str, Any]:
    """The step's variable placeholders -> the model's variables' handles."""
    trainable, state = keras_variable_names(model)
    by_name = dict(zip(trainable, model.trainable_variables))
    by_name.update(zip(state, [v for v in model.variables if not v.trainable]))
    out = {}
    for info in list(item.variables) + list(item.state_variables):
        variable = by_name.get(info.name)
        if variable is not None and info.handle_node:
            tf_var = variable.value if isinstance(getattr(variable, "value", None),
                                                  tf.Variable) else variable
            out[f"{info.handle_node}:0"] = tf_var.handle
    return out


def _filled_tables(tables) -> dict[str, Any]:
    """A copy of each captured lookup table, filled, by its placeholder (in a graph)."""
    from tensorflow.core.framework import tensor_pb2

    def value(data: bytes):
        proto = tensor_pb2.TensorProto()
        proto.ParseFromString(data)
        return tf.constant(tf.make_ndarray(proto))

    out = {}
    for info in tables:
        handle = tf.raw_ops.AnonymousHashTable(key_dtype=tf.as_dtype(info.key_dtype),
                                               value_dtype=tf.as_dtype(info.value_dtype))
        with tf.control_dependencies([tf.raw_ops.LookupTableImportV2(
                table_handle=handle, keys=value(info.keys), values=value(info.values))]):
            out[f"{info.placeholder}:0"] = tf.identity(handle)
    return out


def run_terms(graph_def, handles, batch, draws, fetches, tables=()) -> list:
    """The step's `fetches` on one batch, its random draws fixed (see
    `classify_added_losses`)."""
    return terms_runner(graph_def, handles, draws, fetches, tables)(batch)


def terms_runner(graph_def, handles, draws, fetches, tables=()
                 ) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
    """`run_terms` for several batches of the same shapes, the step imported once."""
    fixed = _fixed_draws(graph_def, draws)
    traced = tf.function(lambda batch: _import_step(fixed, handles, batch, tables, fetches,
                                                    "terms"), autograph=False)
    concrete = []

    def call(batch: dict[str, np.ndarray]) -> list[np.ndarray]:
        tensors = {name: tf.constant(value) for name, value in batch.items()}
        if not concrete:
            # Traced here, not by a call: a capture after capture would have TensorFlow
            # warn of frequent retracing (its count is kept per code object).
            concrete.append(traced.get_concrete_function(tensors))
        return [np.asarray(v) for v in concrete[0](tensors)]
    return call


def run_batches(graph_def, handles, batches, draws, fetches, tables=()) -> list[list]:
    """The step's `fetches` on each of `batches` ({tensor name: value}, of any sizes), its
    random draws fixed, in one traced function (one import of the step per batch)."""
    fixed = _fixed_draws(graph_def, draws)

    def run():
        return [_import_step(fixed, handles, {name: tf.constant(value)
                                              for name, value in batch.items()},
                             tables, fetches, f"terms_{k}")
                for k, batch in enumerate(batches)]
    # Traced, then called: a call would count towards TensorFlow's retracing warning.
    concrete = tf.function(run, autograph=False).get_concrete_function()
    return [[np.asarray(v) for v in values] for values in concrete()]


def _import_step(fixed, handles, batch: dict, tables, fetches, name: str) -> list:
    """`fixed` imported into the function being traced, fed `batch` (tensors), the
    model's variable `handles` and filled copies of its lookup `tables`."""
    # Identities capture the eager handles into the function's graph.
    input_map = {tensor: tf.identity(handle) for tensor, handle in handles.items()}
    input_map.update(batch)
    input_map.update(_filled_tables(tables))
    return tf.graph_util.import_graph_def(fixed, input_map=input_map, return_elements=fetches,
                                          name=name)


def _fixed_draws(graph_def, draws):
    """`graph_def` with each random op of `draws` a Fill of its shape: uniform draws just
    under 1 (every Dropout keeps everything), integers and others 0."""
    if not draws:
        return graph_def
    names = {d.node for d in draws}
    out = tf.compat.v1.GraphDef()
    out.CopyFrom(graph_def)
    for node in out.node:
        if node.name not in names or "dtype" not in node.attr:
            continue
        dtype = node.attr["dtype"].type
        index_type = next((node.attr[k].type for k in ("Tshape", "S", "T") if k in node.attr),
                          tf.int32.as_datatype_enum)
        value = out.node.add(name=f"{node.name}/fixed_value", op="Const")
        value.attr["dtype"].type = dtype
        uniform = "Uniform" in node.op and tf.as_dtype(dtype).is_floating
        value.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(
            0.999 if uniform else 0, tf.as_dtype(dtype)))
        shape = node.input[0]
        attrs = {"T": dtype, "index_type": index_type}
        node.ClearField("input")
        node.ClearField("attr")
        node.op = "Fill"
        node.input.extend([shape, value.name])
        for key, enum in attrs.items():
            node.attr[key].type = enum
    return out


def every_draw(graph_def, draws) -> list:
    """`draws` and every other stateless draw of a shape in the step (RandomCrop's
    offsets, one draw for the whole batch: runs on several batches must crop alike)."""
    listed = {d.node for d in draws}
    return list(draws) + [graph_item_pb2.RandomOpInfo(node=n.name) for n in graph_def.node
                          if n.op in random_ops.SHAPED and n.name not in listed]


def without_batch_statistics(graph_def, batch_norms):
    """`graph_def` with each batch normalization's batch mean 0 and variance 1, and no
    gradient through them, for probes only: each example is normalized on its own.
    Through batch statistics an example's change moves every row of a 4-example batch,
    often more than its own (keras-io's movielens transformer: Dense ->
    BatchNormalization -> Dropout looked out of row order), and a batch's gradients or
    added loss terms are not those of its parts (the run's global-batch rewrite makes
    them so)."""
    if not batch_norms:
        return graph_def
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    nodes = {node.name: node for node in out.node}
    for info in batch_norms:
        for name, fill in ((info.mean, "ZerosLike"), (info.variance, "OnesLike"),
                           (info.mean_gradient, "ZerosLike"),
                           (info.variance_gradient, "ZerosLike")):
            node = nodes.get(name)
            if node is None or not node.input:
                continue
            filled = out.node.add(name=f"{name}/autodist_{fill.lower()}", op=fill)
            filled.input.append(node.input[0])
            filled.attr["T"].CopyFrom(node.attr["T"])
            node.input[0] = filled.name
    return out
