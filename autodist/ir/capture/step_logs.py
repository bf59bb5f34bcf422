"""The logs a model's own `train_step` returns, as functions of the metrics' state.

Keras' fit puts the dict the step returns into History (flattened by
`pythonify_logs`: keys sorted, a nested dict's keys in its place). When each
log is a function of the metrics' variables (`tracker.result()`), the logs of
a distributed run are that function of the metrics' state summed over the
replicas and steps: the capture cuts it out of the traced step
(`CustomStepInfo.logs_graph_def`).
"""
from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from autodist.ir.device_names import input_op, op_name
from autodist.ir.errors import CaptureError

# Ops a log may not read: the batch, variables, anything stateful.
_FORBIDDEN = frozenset({"Placeholder", "PlaceholderWithDefault", "ReadVariableOp",
                        "VarHandleOp", "ResourceGather"})


def flat_logs(logs: Any, label: str) -> list[tuple[str, Any]]:
    """(key, scalar tensor) of the step's returned dict, flattened as Keras' fit does.

    Raises:
        CaptureError: the step returns no dict, or a log that is not a scalar.
    """
    if not isinstance(logs, dict):
        raise CaptureError(f"{label} returns {type(logs).__name__}, not a dict of logs "
                           "(Keras' fit reads a dict of metric results)")
    out = []
    for key, value in sorted(logs.items()):
        if isinstance(value, dict):
            out += flat_logs(value, label)
            continue
        tensor = tf.convert_to_tensor(value)
        if tensor.shape.rank != 0 or not tensor.dtype.is_floating and not tensor.dtype.is_integer:
            raise CaptureError(f"{label} logs {key!r} of shape {tensor.shape} and dtype "
                               f"{tensor.dtype.name}: a log must be a number (a metric's "
                               "result)")
        out.append((str(key), tf.cast(tensor, tf.float32)))
    return out


def logs_graph(graph_def, logs: Sequence[tuple[str, str]], states: Sequence[Any],
               label: str) -> tuple[bytes, list[str]]:
    """The logs as a GraphDef of the metrics' states.

    Args:
        graph_def: The traced step.
        logs: (key, tensor name) of each log in `graph_def`.
        states: Each metric variable's value at the step's end (a tensor of the
            traced graph), in `metric_states` order: they become placeholders.
        label: The step, for messages.

    Returns:
        The serialized GraphDef and its state placeholders' names.

    Raises:
        CaptureError: a log reads anything but the metrics' state (the batch, a
            variable): it is not a metric's result.
    """
    nodes = {node.name: node for node in graph_def.node}
    cut: dict[str, int] = {}
    for k, tensor in enumerate(states):
        if tensor.value_index != 0 or tensor.op.name in cut:
            raise CaptureError(f"{label}: metric state {tensor.name!r} is not the only output "
                               "of its op; cannot cut the logs at it")
        cut[tensor.op.name] = k
    keep: set[str] = set()
    for key, tensor in logs:
        todo = [op_name(tensor)]
        while todo:
            name = todo.pop()
            if name in keep:
                continue
            keep.add(name)
            if name in cut:
                continue
            node = nodes[name]
            if node.op in _FORBIDDEN or "Stateful" in node.op or "Random" in node.op:
                raise CaptureError(
                    f"{label} logs {key!r} from {node.op} {name!r}, not only from its metrics' "
                    "state: autodist takes logs that are metric results (keras.metrics.Mean "
                    "trackers listed by the model's `metrics` property, compiled metrics). "
                    "Track the value with a keras.metrics.Mean and log its result()")
            todo += [input_op(i) for i in node.input if not i.startswith("^")]
    out = tf.compat.v1.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)
    for node in graph_def.node:
        if node.name not in keep and node.name not in cut:
            continue
        copy = out.node.add()
        if node.name in cut:
            state = states[cut[node.name]]
            copy.name, copy.op = node.name, "Placeholder"
            copy.attr["dtype"].type = state.dtype.as_datatype_enum
            copy.attr["shape"].shape.CopyFrom(state.shape.as_proto())
            continue
        copy.CopyFrom(node)
        del copy.input[:]
        copy.input.extend(i for i in node.input if not i.startswith("^"))
    return out.SerializeToString(deterministic=True), [t.op.name for t in states]
