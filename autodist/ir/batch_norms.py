"""The batch statistics of a step's batch-normalization layers, and their gradients.

Keras' `BatchNormalization` in training computes its batch's moments with
`tf.nn.moments`: a `Mean` of the inputs over every axis but the features
(``.../moments/mean``) and a `Mean` of their squared difference from it
(``.../moments/variance``). The traced backward pass holds each Mean's
gradient as a `RealDiv` of the upstream gradient (reshaped, broadcast) by the
count of reduced elements; it is found by structure, through the `AddV2` that
reads the Mean's own reduction axes. A distributed step rewrites these four
ops to sum over the replicas (`autodist.kernels.batch_norm`), so every
replica normalizes with the global batch's statistics and the gradients are
those of one device.

A layer that normalizes the model's input (nothing trainable before it) has
no gradient of its moments: only its forward sums are rewritten. A layer
whose ops do not have this shape (masked moments, `synchronized=True`, a
custom normalization) is listed as not syncable, with the reason.
"""
from __future__ import annotations

from autodist.ir.device_names import input_op, op_name
from autodist.proto import graph_item_pb2


def analyze(graph_def, trainable_handles=frozenset()) -> list[graph_item_pb2.BatchNormInfo]:
    """Every batch-statistics computation of the step (see the module docstring).

    Args:
        graph_def: The step.
        trainable_handles: The nodes of the trainable variables' handles. A layer
            whose input depends on none of them (it normalizes the model's
            input) has no gradient of its moments: its statistics are summed
            forward only (`BatchNormInfo.mean_gradient` left empty).
    """
    nodes = {n.name: n for n in graph_def.node}
    consumers: dict[str, list] = {}
    for node in graph_def.node:
        for name in node.input:
            if not name.startswith("^"):
                consumers.setdefault(op_name(name), []).append(node)
    out = []
    for node in graph_def.node:
        if node.op != "Mean" or not node.name.endswith("/moments/mean") or \
                not _reduces_examples(node, nodes) or not _reads_examples(node, nodes):
            continue   # not moments, per example (LayerNormalization, GroupNormalization)
            # or of weights (a standardized kernel: keras-io's subclassing_conv_layers)
        scope = node.name[:-len("/moments/mean")]
        info = graph_item_pb2.BatchNormInfo(layer=_layer(scope), mean=node.name)
        variance = nodes.get(f"{scope}/moments/variance")
        if variance is None or variance.op != "Mean":
            out.append(_unsyncable(info, "its variance is not tf.nn.moments'"))
            continue
        info.variance = variance.name
        found = []
        for mean in (node, variance):
            gradient = _gradient_of(mean, nodes, consumers)
            if gradient is None:
                break
            found.append(gradient)
        if len(found) < 2:
            if not found and not _depends_on(node, nodes, set(trainable_handles)):
                info.syncable = True   # nothing trainable before it: no backward to sum
                out.append(info)
                continue
            out.append(_unsyncable(info, "the gradient of its moments was not found"))
            continue
        (info.mean_gradient, info.mean_upstream), \
            (info.variance_gradient, info.variance_upstream) = found
        info.syncable = True
        out.append(info)
    return out


def _reduces_examples(mean, nodes) -> bool:
    """Whether a Mean reduces over the batch axis (its reduction axes include 0)."""
    import tensorflow as tf

    axes = nodes.get(op_name(mean.input[1]))
    if axes is None or axes.op != "Const":
        return False
    return 0 in tf.make_ndarray(axes.attr["value"].tensor).reshape(-1).tolist()


def _reads_examples(mean, nodes) -> bool:
    """Whether a Mean's input is computed from the step's inputs (a placeholder that is
    not a variable's handle), not from weights alone."""
    from tensorflow.core.framework import types_pb2

    return _reaches(op_name(mean.input[0]), nodes, lambda node: (
        node.op == "Placeholder" and node.attr["dtype"].type != types_pb2.DT_RESOURCE))


def _gradient_of(mean, nodes, consumers) -> tuple[str, str] | None:
    """(the RealDiv of the Mean's gradient, the Reshape of its upstream gradient)."""
    axes = op_name(mean.input[1])
    for add in consumers.get(axes, []):
        if add.op != "AddV2":
            continue
        for mod in _of(consumers, add, "FloorMod"):
            for gather in _of(consumers, mod, "GatherV2"):
                for prod in _of(consumers, gather, "Prod"):
                    for cast in _of(consumers, prod, "Cast"):
                        for div in _of(consumers, cast, "RealDiv"):
                            if op_name(div.input[1]) != cast.name:
                                continue
                            broadcast = nodes.get(op_name(div.input[0]))
                            if broadcast is None or broadcast.op != "BroadcastTo":
                                continue
                            reshape = nodes.get(op_name(broadcast.input[0]))
                            if reshape is not None and reshape.op == "Reshape":
                                return div.name, reshape.name
    return None


def _depends_on(node, nodes, handles: set) -> bool:
    """Whether `node` is computed from any of the nodes named `handles`."""
    return _reaches(node.name, nodes, lambda found: found.name in handles)


def _reaches(start: str, nodes, hit) -> bool:
    """Whether `start` or a node it is computed from is one `hit` holds for."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen or name not in nodes:
            continue
        seen.add(name)
        if hit(nodes[name]):
            return True
        todo.extend(input_op(i) for i in nodes[name].input)
    return False


def _of(consumers, node, op: str) -> list:
    return [c for c in consumers.get(node.name, []) if c.op == op]


def _unsyncable(info, reason: str):
    info.syncable, info.reason = False, reason
    return info


def _layer(scope: str) -> str:
    """The layer's name scope in the step, nested models included (the traced step adds
    "_1" to each name: the user's `batch_normalization` is `batch_normalization_1`)."""
    return scope
