"""Per-op FLOP and output-byte estimates of a traced TensorFlow graph.

Estimates are static: shapes come from the graph, with unknown dimensions
(the batch) replaced by `batch_size`. Counting follows the usual convention:
one multiply-add is two FLOPs; element-wise ops cost one FLOP per output
element; data movement and bookkeeping ops cost none.
"""
from __future__ import annotations

import math
from typing import Sequence

import tensorflow as tf

from autodist.proto import graph_item_pb2

# Ops that move or describe data without arithmetic.
_FREE_OPS = frozenset({
    "Const", "Identity", "IdentityN", "Placeholder", "PlaceholderWithDefault",
    "ReadVariableOp", "VarHandleOp", "Shape", "ShapeN", "Size", "Rank",
    "Reshape", "ExpandDims", "Squeeze", "NoOp", "StopGradient",
    "StridedSlice", "Slice", "Pack", "Unpack", "ConcatV2", "Concat", "Split",
    "SplitV", "Transpose", "Tile", "Fill", "ZerosLike", "OnesLike", "Cast",
    "GatherV2", "Gather", "ResourceGather", "BroadcastTo", "BroadcastArgs",
    "BroadcastGradientArgs", "Range", "AssignVariableOp", "Switch", "Merge",
    "DynamicStitch", "UnsortedSegmentSum", "Where", "SelectV2",
})
_CONV_OPS = frozenset({"Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter",
                       "Conv3D", "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2"})
_DEPTHWISE_OPS = frozenset({"DepthwiseConv2dNative",
                            "DepthwiseConv2dNativeBackpropInput",
                            "DepthwiseConv2dNativeBackpropFilter"})
# Element-wise ops that cost several FLOPs per element.
_TRANSCENDENTAL = {"Exp": 4, "Log": 4, "Tanh": 6, "Sigmoid": 6, "Erf": 8, "Rsqrt": 2,
                   "Sqrt": 2, "Pow": 8, "Softmax": 5, "LogSoftmax": 5,
                   "SparseSoftmaxCrossEntropyWithLogits": 6,
                   "SoftmaxCrossEntropyWithLogits": 6,
                   "FusedBatchNormV3": 8, "FusedBatchNormGradV3": 10}


def static_shape(shape: tf.TensorShape, batch_size: int) -> list[int] | None:
    """The shape as ints, unknown dims replaced by `batch_size`; None if rank unknown."""
    if shape.rank is None:
        return None
    return [batch_size if d is None else int(d) for d in shape.as_list()]


def _elements(shape: Sequence[int] | None) -> int:
    return 0 if shape is None else math.prod(shape)


def _bytes(tensor: tf.Tensor, batch_size: int) -> int:
    if tensor.dtype in (tf.resource, tf.variant, tf.string):
        return 0
    shape = static_shape(tensor.shape, batch_size)
    return _elements(shape) * tensor.dtype.size


def _matmul_flops(op: tf.Operation, batch_size: int) -> float:
    out = static_shape(op.outputs[0].shape, batch_size)
    a = static_shape(op.inputs[0].shape, batch_size)
    if out is None or a is None or len(a) < 2:
        return 0.0
    transpose_a = False
    for attr in ("transpose_a", "adj_x"):
        try:
            transpose_a = bool(op.get_attr(attr))
            break
        except ValueError:
            continue
    k = a[-2] if transpose_a else a[-1]
    return 2.0 * _elements(out) * k


def _conv_flops(op: tf.Operation, batch_size: int) -> float:
    # Forward and both backward convs do the same multiply-adds:
    # 2 * (output elements of the forward conv) * (kernel spatial * in channels).
    if op.type.startswith("Conv2DBackpropFilter") or op.type.startswith("Conv3DBackpropFilter"):
        out_grad = static_shape(op.inputs[2].shape, batch_size)
        filt = static_shape(op.outputs[0].shape, batch_size)
    elif "BackpropInput" in op.type:
        out_grad = static_shape(op.inputs[2].shape, batch_size)
        filt = static_shape(op.inputs[1].shape, batch_size)
    else:
        out_grad = static_shape(op.outputs[0].shape, batch_size)
        filt = static_shape(op.inputs[1].shape, batch_size)
    if out_grad is None or filt is None:
        return 0.0
    return 2.0 * _elements(out_grad) * math.prod(filt[:-1])


def _depthwise_flops(op: tf.Operation, batch_size: int) -> float:
    if op.type.endswith("BackpropFilter"):
        out = static_shape(op.inputs[2].shape, batch_size)
        filt = static_shape(op.outputs[0].shape, batch_size)
    elif op.type.endswith("BackpropInput"):
        out = static_shape(op.inputs[2].shape, batch_size)
        filt = static_shape(op.inputs[1].shape, batch_size)
    else:
        out = static_shape(op.outputs[0].shape, batch_size)
        filt = static_shape(op.inputs[1].shape, batch_size)
    if out is None or filt is None:
        return 0.0
    return 2.0 * _elements(out) * math.prod(filt[:2])


def _einsum_flops(op: tf.Operation, batch_size: int) -> float:
    equation = op.get_attr("equation")
    if isinstance(equation, bytes):
        equation = equation.decode()
    lhs = equation.split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for labels, tensor in zip(lhs, op.inputs):
        shape = static_shape(tensor.shape, batch_size)
        if shape is None or "." in labels or len(labels) != len(shape):
            return float(_elements(static_shape(op.outputs[0].shape, batch_size)))
        for label, dim in zip(labels, shape):
            sizes[label] = max(sizes.get(label, 1), dim)
    return 2.0 * math.prod(sizes.values())


def op_flops(op: tf.Operation, batch_size: int) -> float:
    """Estimated FLOPs of one execution of `op`."""
    kind = op.type
    if kind in _FREE_OPS or not op.outputs:
        return 0.0
    if kind in ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
        return _matmul_flops(op, batch_size)
    if kind in _CONV_OPS:
        return _conv_flops(op, batch_size)
    if kind in _DEPTHWISE_OPS:
        return _depthwise_flops(op, batch_size)
    if kind == "Einsum":
        return _einsum_flops(op, batch_size)
    # Element-wise and reductions: proportional to the largest operand.
    sizes = [_elements(static_shape(t.shape, batch_size))
             for t in list(op.inputs) + list(op.outputs)
             if t.dtype not in (tf.resource, tf.variant, tf.string)]
    return float(max(sizes, default=0)) * _TRANSCENDENTAL.get(kind, 1)


def op_phase(op: tf.Operation, order: int, backward_start: int) -> str:
    """Classifies an op as input, forward, backward or update.

    The gradient ops are created after the loss, so an op created after the
    loss op (`order > backward_start`) belongs to the backward pass.
    """
    if op.type in ("Placeholder", "PlaceholderWithDefault"):
        return "input"
    if op.type in ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"):
        return "update"
    return "backward" if order > backward_start else "forward"


def estimate_ops(graph: tf.Graph, batch_size: int, loss_op: str,
                 keep: set[str] | None = None) -> list[graph_item_pb2.OpInfo]:
    """Per-op estimates for the ops of `graph`, in topological order.

    TensorFlow creates ops in topological order, so `graph.get_operations()`
    is one; the forward pass (up to the loss) comes before the backward pass.

    Args:
        graph: The traced graph.
        batch_size: Substituted for unknown dimensions.
        loss_op: Name of the op computing the loss.
        keep: If given, only ops with these names are estimated.
    """
    operations = graph.get_operations()
    backward_start = next(i for i, op in enumerate(operations) if op.name == loss_op)
    infos = []
    for order, op in enumerate(operations):
        if keep is not None and op.name not in keep:
            continue
        infos.append(graph_item_pb2.OpInfo(
            name=op.name, type=op.type, phase=op_phase(op, order, backward_start),
            flops=op_flops(op, batch_size),
            output_bytes=sum(_bytes(t, batch_size) for t in op.outputs)))
    return infos
