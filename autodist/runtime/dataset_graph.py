"""A `tf.data.Dataset` as a GraphDef: what the workers rebuild it from.

`serialize` writes a dataset's graph with TensorFlow's own serializer
(`DatasetToGraphV2`), refusing external state: Python functions
(`from_generator`, `py_function`), variables and stateful random ops cannot
run in another process. `check_reproducible` refuses what would differ from
one process to another: a random seed left to chance (a shuffle without a
seed and without `tf.random.set_seed`) and a nondeterministic order.
`restore` rebuilds the dataset from its graph with new seed generators, so
its passes draw the shuffle seeds from the start, as the passes over the
dataset object Keras iterates do.

Why new generators: a serialized shuffle names its seed generator, and
rebuilding the graph in the process that holds that generator (the driver)
would share it, drawing the seeds of its next passes instead.
"""
from __future__ import annotations

import itertools
from typing import Any

from autodist.ir.device_names import op_name
from autodist.ir.errors import AutodistError

# DatasetToGraphV2's external_state_policy: refuse state that cannot be serialized.
_FAIL_ON_EXTERNAL_STATE = 2
_MESSAGE_LIMIT = 500
_fresh_names = itertools.count()


class DatasetGraphError(AutodistError, ValueError):
    """A dataset cannot be rebuilt in the workers the way it reads in the driver."""


def serialize(dataset) -> bytes:
    """The dataset's graph (a serialized GraphDef).

    TensorFlow's serializer refuses a function call op (a `tf.function` used as a
    map function) whatever its body holds: where the refusal names no op with
    external state (only asserts, prints and control flow, whose bodies are in the
    graph's library), the graph is written without that check.

    Raises:
        DatasetGraphError: it holds state TensorFlow cannot serialize,
            naming the op, and how to avoid it.
    """
    import tensorflow as tf

    try:
        return tf.raw_ops.DatasetToGraphV2(
            input_dataset=tf.data.experimental.to_variant(dataset),
            external_state_policy=_FAIL_ON_EXTERNAL_STATE,
            strip_device_assignment=True).numpy()
    except tf.errors.OpError as e:
        reason = e.message.rsplit("graph:", 1)[-1].split("[Op:", 1)[0].strip().rstrip(".")
    graph = _without_state_check(dataset)
    found = _external_state(graph) if graph is not None else None
    if found is not None and not found:
        return graph   # only asserts and calls: nothing that holds state
    if found and reason.split(" ", 1)[0] in _WITHOUT_STATE:   # "StatefulPartitionedCall
        reason = f"{found[0].op} is stateful"                # is stateful": name the op
    scopes = _scopes(found or [])
    if scopes:
        named = [f"{scope!r} ({', '.join(sorted(ops))})"
                 for scope, ops in sorted(scopes.items())[:_SCOPES_NAMED]]
        more = len(scopes) - len(named)
        reason += (f" (stateful ops in its functions, under {', '.join(named)}"
                   + (f" and {more} more" if more > 0 else "") + ")")
    variables = any(ops & _VARIABLE_OPS for ops in scopes.values())
    raise DatasetGraphError(
        "the workers read the dataset themselves, so its graph must be serializable, "
        f"and TensorFlow could not serialize it: {reason[:_MESSAGE_LIMIT]}. "
        + ("Keras preprocessing layers (RandomFlip, RandomRotation, ...) keep their "
           "seed in a variable: call them in the model instead (they run in training "
           "only, as in Keras). " if variables else "")
        + "Python code "
        "(Dataset.from_generator, tf.py_function, tf.numpy_function), variables, "
        "stateful random ops (tf.random.uniform, tf.image.random_*) and shuffles "
        "inside a map or interleave function cannot run in another "
        "process: read files (e.g. TFRecordDataset) or tensors (from_tensor_slices), use "
        "stateless random ops (tf.random.stateless_*, "
        "tf.random.experimental.stateless_shuffle), or pass arrays as x and y"
    ) from None


_IGNORE_EXTERNAL_STATE = 1
_SCOPES_NAMED = 4
_VARIABLE_OPS = frozenset({"ReadVariableOp", "AssignVariableOp", "AssignAddVariableOp",
                           "AssignSubVariableOp", "VarHandleOp"})
# Stateful by their op definitions, but holding no state a worker would lack: asserts and
# prints, and calls and control flow (their bodies are in the library, judged there).
_WITHOUT_STATE = frozenset({"Assert", "Print", "PrintV2", "If", "While", "Case",
                            "StatefulPartitionedCall", "PartitionedCall"})


def _without_state_check(dataset) -> bytes | None:
    """The dataset's graph written ignoring external state (None: it cannot be)."""
    import tensorflow as tf

    try:
        return tf.raw_ops.DatasetToGraphV2(
            input_dataset=tf.data.experimental.to_variant(dataset),
            external_state_policy=_IGNORE_EXTERNAL_STATE, strip_device_assignment=True).numpy()
    except tf.errors.OpError:
        return None


def _external_state(graph: bytes) -> list:
    """The ops of the graph's functions (map, filter, ...) that hold state: stateful by
    their op definitions, not asserts, prints, calls or dataset ops."""
    from tensorflow.core.framework import graph_pb2
    from tensorflow.python.framework import op_def_registry

    graph_def = graph_pb2.GraphDef()
    graph_def.ParseFromString(graph)
    found = []
    for function in graph_def.library.function:
        for node in function.node_def:
            op_def = op_def_registry.get(node.op)
            if op_def is None or not op_def.is_stateful or node.op in _WITHOUT_STATE or \
                    "Dataset" in node.op:
                continue
            found.append(node)
    return found


def _scopes(nodes) -> dict[str, set[str]]:
    """The ops by the name scope they sit in (a Keras layer's, e.g.
    "augmentation/random_flip"); ops outside any scope are left out (their op's name is
    TensorFlow's message already)."""
    scopes: dict[str, set[str]] = {}
    for node in nodes:
        parts = node.name.split("/")[:-1][:2]
        if parts:
            scopes.setdefault("/".join(parts), set()).add(node.op)
    for scope in sorted(scopes, key=len, reverse=True):   # "layer/Add" into "layer"
        outer = scope.rsplit("/", 1)[0]
        if outer != scope and outer in scopes:
            scopes[outer] |= scopes.pop(scope)
    return scopes


def check_reproducible(graph: bytes) -> None:
    """Raises unless every process that rebuilds `graph` reads the same elements.

    Raises:
        DatasetGraphError: an op whose random seeds are left to chance (both
            seeds 0: `shuffle`, `Dataset.random`, `sample_from_datasets`
            without a seed), or a nondeterministic order
            (`deterministic=False`, `Options.deterministic = False`).
    """
    for nodes in _bodies(graph):
        by_name = {node.name: node for node in nodes}
        for node in nodes:
            if _attr(node, "deterministic").s == b"false" or _attr(node, "sloppy").b:
                raise DatasetGraphError(
                    f"the dataset's {node.op} reads in a nondeterministic order "
                    "(deterministic=False), so the workers would see different batches: "
                    "leave `deterministic` at its default")
            if node.op in ("CacheDataset", "CacheDatasetV2") and len(node.input) > 1 and \
                    _const_bytes(by_name, op_name(node.input[1])) != b"":
                raise DatasetGraphError(
                    f"the dataset's cache writes files ({node.op} with a filename), which "
                    "every worker would write at the same path at once: use cache() in "
                    "memory, or write the cache once beforehand and read it")
            if node.op == "OptionsDataset":
                options = _options(node)
                if options.WhichOneof("optional_deterministic") and not options.deterministic:
                    raise DatasetGraphError(
                        "the dataset's options allow a nondeterministic order "
                        "(Options.deterministic = False), so the workers would see "
                        "different batches: leave it at its default")
            # An input is "node", "node:index" or, in a function, "node:output:index".
            seeds = [_const_value(by_name, op_name(node.input[i]))
                     for i in _seed_inputs(node)]
            if len(seeds) == 2 and seeds[0] == 0 and seeds[1] == 0:
                raise DatasetGraphError(
                    f"the dataset's {node.op} has no random seed, so every worker would draw "
                    "its own order and no run could repeat Keras' one: give it a seed "
                    "(e.g. shuffle(buffer_size, seed=1)), or call tf.random.set_seed(...) "
                    "before building the dataset")


# The inputs of tf.data ops that autotuning tunes when they are AUTOTUNE (-1). (Elsewhere
# -1 may mean something else: a TFRecordDataset's buffer_size -1 is its default buffer.)
_PARALLEL_CALLS = ("num_parallel_calls",)
_TUNABLE_INPUTS = {
    "ParallelMapDataset": _PARALLEL_CALLS, "ParallelMapDatasetV2": _PARALLEL_CALLS,
    "ParallelBatchDataset": _PARALLEL_CALLS, "MapAndBatchDataset": _PARALLEL_CALLS,
    "ParallelFilterDataset": _PARALLEL_CALLS, "PrefetchDataset": ("buffer_size",),
    "ParallelInterleaveDatasetV2": ("cycle_length", "num_parallel_calls"),
    "ParallelInterleaveDatasetV3": ("cycle_length", "num_parallel_calls"),
    "ParallelInterleaveDatasetV4": ("cycle_length", "num_parallel_calls",
                                    "buffer_output_elements", "prefetch_input_elements"),
}


def relies_on_autotune(graph: bytes) -> bool:
    """Whether the dataset of `graph` uses tf.data's autotuning: a knob set to
    `tf.data.AUTOTUNE` (a parallel map's calls, a prefetch's buffer, ...), or options
    that set `autotune` themselves.

    Without either, autotuning tunes nothing, and it is not free: an iterator's
    destruction waits for the tuning thread's current sleep (observed up to 4 s
    on this TensorFlow), which stalls a reader at every pass's end.
    """
    for nodes in _bodies(graph):
        by_name = {node.name: node for node in nodes}
        for node in nodes:
            if node.op == "OptionsDataset" and _options(node).autotune_options.ListFields():
                return True   # options that set autotune (any of its fields)
            for index in _named_inputs(node, _TUNABLE_INPUTS.get(node.op, ())):
                if _const_value(by_name, op_name(node.input[index])) == -1:
                    return True
    return False


def without_autotune(dataset):
    """`dataset` with tf.data's autotuning off (see `relies_on_autotune`)."""
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def restore(graph: bytes, element_spec: Any):
    """The dataset of `graph`, with seed generators of its own.

    Args:
        graph: What `serialize` returned.
        element_spec: The dataset's element spec.
    """
    import tensorflow as tf

    variant = tf.raw_ops.DatasetFromGraph(graph_def=_with_new_generators(graph))
    return tf.data.experimental.from_variant(variant, element_spec)


def seed_generators(graph: bytes) -> tuple[str, ...]:
    """The names of the resources `graph` holds: the seed generators of reshuffling ops,
    which each pass over the dataset advances (unique to a dataset in its process)."""
    from tensorflow.core.framework import graph_pb2

    graph_def = graph_pb2.GraphDef()
    graph_def.ParseFromString(graph)
    return tuple(sorted(f"{h.container}/{h.name}" for h in _resource_handles(graph_def)))


def _with_new_generators(graph: bytes) -> bytes:
    """`graph` with every resource it names renamed to a name of this call's own."""
    from tensorflow.core.framework import graph_pb2

    graph_def = graph_pb2.GraphDef()
    graph_def.ParseFromString(graph)
    suffix = f"/autodist_{next(_fresh_names)}"
    for handle in _resource_handles(graph_def):
        handle.name += suffix
    return graph_def.SerializeToString()


def _resource_handles(graph_def):
    """The resource handles the Const nodes of `graph_def` (and its functions) hold."""
    from tensorflow.core.framework import types_pb2

    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes += list(function.node_def)
    for node in nodes:
        if node.op == "Const" and node.attr["dtype"].type == types_pb2.DT_RESOURCE:
            yield from node.attr["value"].tensor.resource_handle_val


def _bodies(graph: bytes) -> list[list]:
    """The node lists of a serialized GraphDef: its own, then each function's."""
    from tensorflow.core.framework import graph_pb2

    graph_def = graph_pb2.GraphDef()
    graph_def.ParseFromString(graph)
    return [list(graph_def.node)] + [list(f.node_def) for f in graph_def.library.function]


def _options(node):
    """The `tf.data.Options` an OptionsDataset node sets (as their protobuf)."""
    from tensorflow.core.framework import dataset_options_pb2

    options = dataset_options_pb2.Options()
    options.ParseFromString(node.attr["serialized_options"].s)
    return options


def _seed_inputs(node) -> list[int]:
    """Indices of `node`'s inputs named seed and seed2 (none if it has no such inputs)."""
    indices = _named_inputs(node, ("seed", "seed2"))
    return indices if len(indices) == 2 else []


def _named_inputs(node, names: tuple[str, ...]) -> list[int]:
    """Indices in `node.input` of its single inputs called one of `names` (by its op)."""
    from tensorflow.python.framework import op_def_registry

    op_def = op_def_registry.get(node.op)
    if op_def is None:
        return []
    indices, position = [], 0
    for arg in op_def.input_arg:
        if arg.number_attr:
            count = node.attr[arg.number_attr].i
        elif arg.type_list_attr:
            count = len(node.attr[arg.type_list_attr].list.type)
        else:
            count = 1
        if arg.name in names and count == 1 and position < len(node.input):
            indices.append(position)
        position += count
    return indices


def _attr(node, name: str):
    """`node`'s attribute `name`, or an empty one (without adding it to the node)."""
    from tensorflow.core.framework import attr_value_pb2

    return node.attr[name] if name in node.attr else attr_value_pb2.AttrValue()


def _const_value(by_name: dict, name: str) -> int | None:
    """The integer a Const node holds, or None (another op, or a function argument)."""
    import tensorflow as tf

    node = by_name.get(name)
    if node is None or node.op != "Const":
        return None
    value = tf.make_ndarray(node.attr["value"].tensor)
    return int(value) if value.size == 1 else None


def _const_bytes(by_name: dict, name: str) -> bytes | None:
    """The string a scalar Const node holds, or None (another op, or a function argument)."""
    node = by_name.get(name)
    if node is None or node.op != "Const":
        return None
    values = node.attr["value"].tensor.string_val
    return values[0] if len(values) == 1 else None
