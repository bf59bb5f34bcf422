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

import numpy as np
import tensorflow as tf

from autodist.ir.device_names import input_op, op_name
from autodist.ir.errors import CaptureError
from autodist.proto import graph_item_pb2

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


def import_step_logs(info: graph_item_pb2.CustomStepInfo, states: Sequence[Any]) -> dict:
    """The logs of `info` (a custom step's) for the metrics' `states`, as tensors: its
    logs graph imported (in the current graph or traced function)."""
    graph_def = tf.compat.v1.GraphDef()
    graph_def.ParseFromString(info.logs_graph_def)
    values = tf.graph_util.import_graph_def(
        graph_def, input_map={f"{name}:0": tf.convert_to_tensor(state)
                              for name, state in zip(info.state_inputs, states)},
        return_elements=[log.tensor for log in info.logs], name="step_logs")
    return {log.name: value for log, value in zip(info.logs, values)}


def check_epoch_logs(model, info: graph_item_pb2.CustomStepInfo, metric_variables: list,
                     keys: set, label: str) -> None:
    """Keras' fit ends an epoch with the metrics' results (`get_metrics_result`) instead
    of the step's last logs when their keys are the same (`_get_metrics_result_or_logs`);
    the run logs what the step returns throughout, so there the two must agree.

    Raises:
        CaptureError: a log under a metric's name that is not its result (seen on
            random states of the metrics).
    """
    rng = np.random.default_rng(2)
    states = [rng.uniform(1.0, 2.0, size=v.shape).astype(v.dtype) for v in metric_variables]
    saved = [np.array(v.numpy()) for v in metric_variables]
    try:
        for variable, state in zip(metric_variables, states):
            variable.assign(state)
        results = {k: float(np.asarray(v)) for k, v in model.get_metrics_result().items()}
    finally:
        for variable, value in zip(metric_variables, saved):
            variable.assign(value)
    if set(keys) != set(results):
        return  # Keras keeps the step's logs, as the run does
    logs = tf.function(lambda: import_step_logs(info, states), autograph=False) \
        .get_concrete_function()()
    for key, result in results.items():
        value = float(np.asarray(logs[key]))
        if not np.isclose(value, result, rtol=1e-5, atol=1e-7):
            raise CaptureError(
                f"{label} logs {key!r} as {value:.6g} where the metric {key!r} gives "
                f"{result:.6g} (on random metric states): Keras' fit shows the metrics' "
                "results at each epoch's end when the logs have the metrics' names, and the "
                "step's logs after each batch, which the run cannot both give. Log the "
                "metrics' results (m.result()), or log other names")
