"""What a GraphItem read from bytes must hold before anything believes it.

`GraphItem.deserialize` (a saved `.pb`, a job's graph item) runs
`check_graph_item`: every field the search, the strategies and the kernels
read is checked, and the first one that is wrong raises `CaptureError`
naming the field and the value received: unique names, known dtypes, shapes
of non-negative dimensions whose sizes fit in memory arithmetic, byte sizes
that agree with them, axes within the rank, a gradient that is dense or
sparse (values and indices), finite non-negative op estimates, finite
hyper-parameters, a positive estimate batch and known loss reductions. It does not parse the
GraphDef (that needs TensorFlow): the kernels name a missing node when they
import it.
"""
from __future__ import annotations

import math

from autodist.ir.errors import CaptureError, short_repr
from autodist.proto import graph_item_pb2

# Bytes per element of the dtypes a captured variable or input can have.
DTYPE_SIZES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1,
               "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8,
               "uint64": 8, "bool": 1, "complex64": 8, "complex128": 16, "string": 0,
               "half": 2, "double": 8}
# Far above any model (2^50 bytes: a petabyte), far below int64 overflow.
MAX_BYTES = 2 ** 50
MAX_RANK = 32
PHASES = ("input", "forward", "backward", "update", "")


# The newest GraphItem schema this autodist writes and reads.
GRAPH_ITEM_SCHEMA_VERSION = 1


def check_graph_item(proto: graph_item_pb2.GraphItem, source: str = "the GraphItem") -> None:
    """Raises `CaptureError` naming the first field of `proto` that is wrong.

    Args:
        proto: A GraphItem as read from bytes.
        source: Names it in errors (a file path).
    """
    if proto.schema_version > GRAPH_ITEM_SCHEMA_VERSION:
        _fail(source, "schema_version", proto.schema_version,
              f"newer than {GRAPH_ITEM_SCHEMA_VERSION}, the newest this autodist reads")
    if proto.estimate_batch_size < 0 or proto.estimate_batch_size > 2 ** 31:
        _fail(source, "estimate_batch_size", proto.estimate_batch_size, "must be in [0, 2^31]")
    if not proto.loss_tensor:
        _fail(source, "loss_tensor", proto.loss_tensor, "must name the step's loss")
    for i, info in enumerate(proto.inputs):
        where = f"inputs[{i}]"
        if not info.name or not info.tensor:
            _fail(source, f"{where}.name/tensor", (info.name, info.tensor), "must be set")
        _check_dtype(source, f"{where}.dtype", info.dtype)
        _check_shape(source, f"{where}.shape", info.shape, unknown_ok=True)
    names = set()
    for i, var in enumerate(proto.variables):
        where = f"variables[{i}] ({short_repr(var.name, 80)})"
        if not var.name or var.name in names:
            _fail(source, f"{where}.name", var.name, "must be set and unique")
        names.add(var.name)
        size = DTYPE_SIZES.get(var.dtype)
        _check_dtype(source, f"{where}.dtype", var.dtype)
        elements = _check_shape(source, f"{where}.shape", var.shape)
        if var.byte_size != elements * size:
            _fail(source, f"{where}.byte_size", var.byte_size,
                  f"must be its {elements} elements x {size} bytes")
        bad = [a for a in var.partitionable_axes if not 0 <= a < len(var.shape)]
        if bad:
            _fail(source, f"{where}.partitionable_axes", list(var.partitionable_axes),
                  f"must be axes of its rank-{len(var.shape)} shape")
        constraint = var.constraint
        if var.HasField("constraint") and not (constraint.graph_def and constraint.value_tensor
                                               and constraint.constrained_tensor):
            _fail(source, f"{where}.constraint", constraint.class_name,
                  "needs graph_def, value_tensor and constrained_tensor")
        if var.HasField("constraint") and var.partitionable_axes:
            _fail(source, f"{where}.partitionable_axes", list(var.partitionable_axes),
                  "must be empty: its constraint reads the whole variable")
        gradient = var.gradient
        if gradient.dense and (gradient.values or gradient.indices):
            _fail(source, f"{where}.gradient", str(gradient), "is dense or sparse, not both")
        if bool(gradient.values) != bool(gradient.indices):
            _fail(source, f"{where}.gradient", str(gradient), "needs values and indices")
        if var.sparse_gradient and not gradient.values and gradient.dense:
            _fail(source, f"{where}.sparse_gradient", True, "with a dense gradient")
    for i, state in enumerate(proto.state_variables):
        where = f"state_variables[{i}] ({short_repr(state.name, 80)})"
        _check_dtype(source, f"{where}.dtype", state.dtype)
        _check_shape(source, f"{where}.shape", state.shape)
    for i, reduction in enumerate(proto.loss_reductions):
        # The kernels rewrite these two kinds; another would train as a mean, silently.
        if reduction.reduction not in ("sum", "mean_with_sample_weight") or \
                not reduction.node:
            _fail(source, f"loss_reductions[{i}]", (reduction.reduction, reduction.node),
                  "needs reduction 'sum' or 'mean_with_sample_weight' and its node")
    if proto.HasField("custom_step"):
        _check_custom_step(proto, source)
    for key, value in proto.optimizer.hyperparameters.items():
        if not math.isfinite(value):
            _fail(source, f"optimizer.hyperparameters[{short_repr(key, 40)}]", value,
                  "must be finite")
    for i, op in enumerate(proto.ops):
        if not (math.isfinite(op.flops) and 0 <= op.flops <= 1e24) or \
                not 0 <= op.output_bytes <= MAX_BYTES or op.phase not in PHASES:
            _fail(source, f"ops[{i}] ({short_repr(op.name, 80)})",
                  (op.phase, op.flops, op.output_bytes),
                  f"needs a phase of {list(PHASES)}, finite FLOPs in [0, 1e24] and output "
                  f"bytes in [0, 2^50]")


def _check_custom_step(proto: graph_item_pb2.GraphItem, source: str) -> None:
    """A custom step's logs: a function of every metric state, its keys unique."""
    step = proto.custom_step
    if step.data not in ("x", "x,y", "x,y,sample_weight"):
        _fail(source, "custom_step.data", step.data,
              "must be 'x', 'x,y' or 'x,y,sample_weight'")
    if len(step.state_inputs) != len(proto.metric_states) or \
            (step.logs and not step.logs_graph_def):
        _fail(source, "custom_step.state_inputs", len(step.state_inputs),
              f"needs one per metric state ({len(proto.metric_states)}) and the logs' graph")
    keys = [log.name for log in step.logs]
    if len(set(keys)) != len(keys) or not all(log.tensor for log in step.logs):
        _fail(source, "custom_step.logs", keys, "must be unique keys, each with its tensor")


def _check_dtype(source: str, field: str, dtype: str) -> None:
    if dtype not in DTYPE_SIZES:
        _fail(source, field, dtype, f"must be one of {sorted(DTYPE_SIZES)}")


def _check_shape(source: str, field: str, shape, unknown_ok: bool = False) -> int:
    """The number of elements of a shape (unknown dimensions count 1)."""
    if len(shape) > MAX_RANK:
        _fail(source, field, list(shape)[:8], f"has rank {len(shape)} > {MAX_RANK}")
    elements = 1
    for d in shape:
        if d < 0 and not (unknown_ok and d == -1):
            _fail(source, field, list(shape), "must hold non-negative dimensions")
        elements *= max(d, 1) if d < 0 else d
        if elements > MAX_BYTES:
            _fail(source, field, list(shape), "holds more than 2^50 elements")
    return elements


def _fail(source: str, field: str, value, why: str) -> None:
    raise CaptureError(f"{source}: {field} {why}. Received: {short_repr(value, 200)}")
