"""Making a traced graph self-contained: resources that are not the model's
variables dropped, captured eager tensors inlined as constants."""
from __future__ import annotations


import tensorflow as tf

from autodist.ir.device_names import op_name
from autodist.ir.errors import CaptureError


def drop_foreign_state(graph, graph_def, variable_handles: set[str], outputs) -> set[str]:
    """Removes what the step does to resources that are not the model's variables.

    Keras' loss of a model with several outputs updates a loss-tracking
    metric per output while it computes the loss; the updates are side
    effects (control inputs of the step's outputs), not part of the loss or
    the gradients, and they would read resources the distributed program does
    not have. They are removed, with every op fed by such a resource.

    Returns:
        The names of the removed nodes.

    Raises:
        CaptureError: the loss or a gradient depends on such a resource.
    """
    foreign = {internal.op.name for _, internal in graph.captures
               if internal.dtype == tf.resource and internal.op.name not in variable_handles}
    if not foreign:
        return set()
    consumers: dict[str, list[str]] = {}
    for node in graph_def.node:
        for inp in node.input:
            if not inp.startswith("^"):
                consumers.setdefault(op_name(inp), []).append(node.name)
    dropped = set(foreign)
    stack = list(foreign)
    while stack:
        for consumer in consumers.get(stack.pop(), []):
            if consumer not in dropped:
                dropped.add(consumer)
                stack.append(consumer)
    needed = _data_ancestors(graph_def, [t.op.name for t in _flat_tensors(outputs)])
    reached = sorted(needed & foreign)
    if reached:
        if _seeds_random_draws(graph_def, reached[0], consumers, needed):
            raise CaptureError(
                f"the step draws random numbers from a seed generator that is not one of "
                f"the model's variables ({reached[0]!r}): keras.random called without a "
                "seed uses Keras' global SeedGenerator, and a SeedGenerator made outside "
                "the layer (a module-level one) is not tracked by the model either: the "
                "run cannot carry their state to the workers. Give the layer its own, "
                "self.seed_generator = keras.random.SeedGenerator(seed) in __init__, and "
                "pass seed=self.seed_generator. A Keras layer with its own generator "
                "(RandomFlip, Dropout) called by the model but not one of its attributes "
                "(a module-level data_augmentation Sequential, as keras-io's Perceiver) is "
                "not tracked either: make it one (self.data_augmentation = ...)")
        raise CaptureError(
            f"the loss or a gradient reads {reached[0]!r}, a resource that is not one of "
            "the model's variables (model.variables); only those may be read. A plain "
            "tf.Variable made in a layer is one: Keras 3 does not track it (its fit never "
            "trains or saves it). Make it with self.add_weight(...) (trainable=False for a "
            "constant), or hold a constant as a tensor (keras-io's traffic forecasting "
            "GraphConv)")
    kept = [n for n in graph_def.node if n.name not in dropped]
    for node in kept:
        inputs = [i for i in node.input if not (i.startswith("^") and i[1:] in dropped)]
        del node.input[:]
        node.input.extend(inputs)
    del graph_def.node[:]
    graph_def.node.extend(kept)
    return dropped


def _seeds_random_draws(graph_def, resource: str, consumers: dict[str, list[str]],
                        needed: set[str]) -> bool:
    """Whether what the step reads from `resource` seeds a stateless random draw (a
    Keras SeedGenerator's state: its read, a few casts and slices, then the draw). A
    shape carries no values: a weight before a Dropout reaches the draw only through its
    shape (`Shape(x)`), and is no seed."""
    ops = {n.name: n.op for n in graph_def.node}
    seen, stack = set(), [resource]
    while stack:
        name = stack.pop()
        if name in seen or (name != resource and name not in needed) or \
                ops.get(name) in _SHAPE_OPS:
            continue
        seen.add(name)
        if ops.get(name, "").startswith("StatelessRandom"):
            return True
        stack.extend(consumers.get(name, []))
    return False


_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})


def _flat_tensors(values) -> list:
    out = []
    for v in values:
        out += [v.values, v.indices] if isinstance(v, tf.IndexedSlices) else [v]
    return out


def _data_ancestors(graph_def, names: list[str]) -> set[str]:
    """Nodes the given nodes read data from, through data edges only (and themselves)."""
    by_name = {n.name: n for n in graph_def.node}
    seen: set[str] = set()
    stack = list(names)
    while stack:
        name = stack.pop()
        if name in seen or name not in by_name:
            continue
        seen.add(name)
        stack.extend(op_name(i) for i in by_name[name].input if not i.startswith("^"))
    return seen


def inline_constant_captures(graph, graph_def, variable_handles: set[str]) -> None:
    """Replaces placeholders of captured eager tensors by constants.

    Resource captures must be the model's variables; anything else a traced
    step captured from Python (an eager tensor) becomes a Const node so that
    the GraphDef is self-contained.
    """
    nodes = {n.name: n for n in graph_def.node}
    for external, internal in graph.captures:
        node_name = internal.op.name
        if node_name in variable_handles:
            continue
        if internal.dtype == tf.resource:
            raise CaptureError(
                f"the step reads a resource ({node_name}) that is not one of the "
                "model's variables; only variables may be captured")
        value = tf.get_static_value(external)
        if value is None:
            raise CaptureError(f"the step captures a tensor ({node_name}) whose value is "
                               "not known at trace time")
        const = tf.compat.v1.NodeDef(name=node_name, op="Const")
        const.attr["dtype"].type = internal.dtype.as_datatype_enum
        const.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value))
        nodes[node_name].CopyFrom(const)
