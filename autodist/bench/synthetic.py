"""GraphItems of realistic size, built from layer shapes without TensorFlow.

Capturing BERT-large or a production DLRM takes minutes and gigabytes; the
search needs only what a capture records about each variable (shape, bytes,
sparse gradient and lookups per example, optimizer slots), the step's FLOPs
and the per-op output bytes the activation estimate reads. These builders
write exactly that from the published architectures:

* `bert_large`: BERT-large (Devlin et al., 2019), 24 layers, hidden 1024,
  16 heads, feed-forward 4096, vocabulary 30522, 512 positions, sequence 128,
  Adam: 335M parameters. FLOPs 2 per multiply-add of the dense layers and
  the attention products, backward twice the forward. Activations per layer
  and example s·h·(34 + 5·a·s/h) bytes for 16-bit activations (Korthikanti
  et al., 2022, "Reducing Activation Recomputation"), doubled for float32.
* `resnet50`: ResNet-50 v1.5 (He et al., 2016) at 224×224, 1000 classes,
  SGD with momentum: 25.6M parameters in 161 trainable variables (batch-norm
  scales and offsets included; their moving statistics are state). FLOPs of
  every convolution (4.1 G multiply-adds forward); activations: the output
  of every convolution, batch normalization and ReLU in float32.
* `dlrm`: DLRM as in MLPerf Training on Criteo 1TB (Naumov et al., 2019):
  26 embedding tables of dimension 128 with the row counts of the MLPerf
  reference (capped at 40M rows: 188M rows, 96 GB in float32), one lookup
  per table and example, bottom MLP 13-512-256-128, top MLP
  479-1024-1024-512-256-1, plain SGD.

Each returns a `GraphItem` whose per-op estimates are at
`ESTIMATE_BATCH_SIZE` examples, as a capture's are.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from autodist.ir.deprecation import renamed_names
from autodist.ir.graph_item import GraphItem
from autodist.proto import graph_item_pb2

ESTIMATE_BATCH_SIZE = 32
_SLOTS = {"adam": ["momentum", "velocity"], "sgd": [], "momentum": ["momentum"]}

# MLPerf Training DLRM (Criteo 1TB, --max-ind-range=40000000): rows per table.
DLRM_TABLE_ROWS = (39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951,
                   2953546, 403346, 10, 2208, 11938, 155, 4, 976, 14, 39979771, 25641295,
                   39664984, 585935, 12972, 108, 36)


@dataclasses.dataclass(frozen=True)
class Variable:
    """One trainable float32 variable of a synthetic GraphItem.

    Attributes:
        name: Its name.
        shape: Its shape.
        lookups_per_example: Rows a sparse gradient holds per example; 0 for
            a dense gradient.
    """

    name: str
    shape: tuple[int, ...]
    lookups_per_example: float = 0.0

    @property
    def sparse(self) -> bool:
        return self.lookups_per_example > 0


def synthetic_graph_item(name: str, variables: Sequence[Variable], *, optimizer: str,
                         forward_flops_per_example: float,
                         activation_bytes_per_example: Sequence[float],
                         input_bytes_per_example: float,
                         state_shapes: Sequence[tuple[str, tuple[int, ...]]] = ()) -> GraphItem:
    """A GraphItem with the variables and per-example costs given.

    Args:
        name: The model's name.
        variables: The trainable variables, in the order their gradients
            become ready is the reverse (the last layer's first).
        optimizer: "adam", "sgd" (plain) or "momentum" (SGD with momentum 0.9).
        forward_flops_per_example: FLOPs of the forward pass per example
            (the backward pass counts twice as many).
        activation_bytes_per_example: Output bytes per example of each
            forward op that holds an activation (one op each).
        input_bytes_per_example: Bytes of one example's inputs and targets.
        state_shapes: Non-trainable state variables (batch-norm statistics).
    """
    b = ESTIMATE_BATCH_SIZE
    proto = graph_item_pb2.GraphItem(name=name, source="synthetic", estimate_batch_size=b)
    info = proto.optimizer
    info.algorithm = "sgd" if optimizer == "momentum" else optimizer
    info.family = "keras"
    info.class_name = {"adam": "Adam", "sgd": "SGD", "momentum": "SGD"}[optimizer]
    info.hyperparameters["learning_rate"] = 0.001
    info.hyperparameters["momentum"] = 0.9 if optimizer == "momentum" else 0.0
    proto.inputs.add(name="x", tensor="x:0", dtype="float32", shape=[-1], role="x")
    proto.ops.add(name="x", type="Placeholder", phase="input",
                  output_bytes=int(input_bytes_per_example * b))
    for i, nbytes in enumerate(activation_bytes_per_example):
        proto.ops.add(name=f"forward_{i}", type="Activation", phase="forward",
                      output_bytes=int(nbytes * b))
    proto.ops.add(name="forward_flops", type="MatMul", phase="forward",
                  flops=forward_flops_per_example * b)
    proto.ops.add(name="loss", type="Mean", phase="forward", output_bytes=4)
    proto.ops.add(name="backward_flops", type="MatMul", phase="backward",
                  flops=2 * forward_flops_per_example * b)
    proto.loss_tensor = "loss:0"
    count = len(variables)
    for order, var in enumerate(variables):
        size = 4 * math.prod(var.shape)
        v = proto.variables.add(name=var.name, handle_node=f"{var.name}/handle", dtype="float32",
                                shape=list(var.shape), byte_size=size,
                                sparse_gradient=var.sparse,
                                gradient_order=count - 1 - order)
        v.slots.extend(_SLOTS[optimizer])
        if var.sparse:
            v.partitionable_axes.append(0)
            values = f"{var.name}/grad_values"
            v.gradient.values = values + ":0"
            v.gradient.indices = f"{var.name}/grad_indices:0"
            row_bytes = size // var.shape[0]
            proto.ops.add(name=values, type="Gather", phase="backward",
                          output_bytes=int(row_bytes * var.lookups_per_example * b))
        else:
            v.partitionable_axes.extend(range(len(var.shape)))
            v.gradient.dense = f"{var.name}/grad:0"
    for state_name, shape in state_shapes:
        proto.state_variables.add(name=state_name, handle_node=f"{state_name}/handle",
                                  dtype="float32", shape=list(shape),
                                  byte_size=4 * math.prod(shape))
    return GraphItem(proto)


def bert_large(seq_len: int = 128) -> GraphItem:
    """BERT-large pre-training encoder at sequence length `seq_len` (Adam)."""
    h, f, layers, heads, vocab = 1024, 4096, 24, 16, 30522
    variables = [Variable("embeddings/word", (vocab, h), seq_len),
                 Variable("embeddings/position", (512, h), seq_len),
                 Variable("embeddings/token_type", (2, h), seq_len),
                 Variable("embeddings/norm/gamma", (h,)), Variable("embeddings/norm/beta", (h,))]
    for layer in range(layers):
        p = f"layer_{layer}"
        for part in ("query", "key", "value", "output"):
            variables += [Variable(f"{p}/attention/{part}/kernel", (h, h)),
                          Variable(f"{p}/attention/{part}/bias", (h,))]
        variables += [Variable(f"{p}/attention/norm/gamma", (h,)),
                      Variable(f"{p}/attention/norm/beta", (h,)),
                      Variable(f"{p}/ffn/intermediate/kernel", (h, f)),
                      Variable(f"{p}/ffn/intermediate/bias", (f,)),
                      Variable(f"{p}/ffn/output/kernel", (f, h)),
                      Variable(f"{p}/ffn/output/bias", (h,)),
                      Variable(f"{p}/output/norm/gamma", (h,)),
                      Variable(f"{p}/output/norm/beta", (h,))]
    variables += [Variable("pooler/kernel", (h, h)), Variable("pooler/bias", (h,))]
    s = seq_len
    layer_flops = 2 * s * (4 * h * h + 2 * h * f) + 2 * 2 * s * s * h
    activations = [2 * s * h * (34 + 5 * heads * s / h)] * layers
    return synthetic_graph_item(
        "bert_large", variables, optimizer="adam",
        forward_flops_per_example=layers * layer_flops + 2 * h * h,
        activation_bytes_per_example=activations, input_bytes_per_example=4 * 4 * s)


def resnet50(image_size: int = 224, classes: int = 1000) -> GraphItem:
    """ResNet-50 v1.5 at `image_size` (SGD with momentum)."""
    variables: list[Variable] = []
    states: list[tuple[str, tuple[int, ...]]] = []
    activations: list[float] = []
    flops = 0.0

    def conv(name: str, k: int, cin: int, cout: int, out_size: int, relu: bool) -> None:
        nonlocal flops
        variables.append(Variable(f"{name}/kernel", (k, k, cin, cout)))
        variables.extend([Variable(f"{name}/bn/gamma", (cout,)),
                          Variable(f"{name}/bn/beta", (cout,))])
        states.extend([(f"{name}/bn/moving_mean", (cout,)),
                       (f"{name}/bn/moving_variance", (cout,))])
        flops += 2.0 * out_size * out_size * k * k * cin * cout
        out = 4.0 * out_size * out_size * cout
        activations.extend([out, out] + ([out] if relu else []))  # conv, bn, relu

    size = image_size // 2
    conv("stem", 7, 3, 64, size, relu=True)
    size //= 2  # max pooling
    cin = 64
    for stage, (blocks, width) in enumerate(((3, 64), (4, 128), (6, 256), (3, 512))):
        for block in range(blocks):
            p = f"stage_{stage}/block_{block}"
            conv(f"{p}/conv_1", 1, cin, width, size, True)
            if block == 0 and stage > 0:
                size //= 2  # v1.5: the 3x3 convolution strides
            conv(f"{p}/conv_2", 3, width, width, size, True)
            conv(f"{p}/conv_3", 1, width, 4 * width, size, False)
            if block == 0:
                conv(f"{p}/shortcut", 1, cin, 4 * width, size, False)
            activations.append(4.0 * size * size * 4 * width)  # the residual sum's ReLU
            cin = 4 * width
    variables += [Variable("fc/kernel", (cin, classes)), Variable("fc/bias", (classes,))]
    flops += 2.0 * cin * classes
    return synthetic_graph_item(
        "resnet50", variables, optimizer="momentum", forward_flops_per_example=flops,
        activation_bytes_per_example=activations,
        input_bytes_per_example=4.0 * image_size * image_size * 3 + 4, state_shapes=states)


def dlrm(table_rows: Sequence[int] = DLRM_TABLE_ROWS, dim: int = 128) -> GraphItem:
    """DLRM on Criteo 1TB as in MLPerf Training (plain SGD)."""
    variables = [Variable(f"embedding_{i}", (rows, dim), 1.0) for i, rows in enumerate(table_rows)]
    activations: list[float] = [4.0 * dim * len(table_rows)]  # the looked-up rows
    flops = 0.0
    features = len(table_rows) + 1
    interactions = dim + features * (features - 1) // 2
    for prefix, sizes in (("bottom", (13, 512, 256, dim)),
                          ("top", (interactions, 1024, 1024, 512, 256, 1))):
        for i, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:])):
            variables += [Variable(f"{prefix}_mlp/dense_{i}/kernel", (fan_in, fan_out)),
                          Variable(f"{prefix}_mlp/dense_{i}/bias", (fan_out,))]
            flops += 2.0 * fan_in * fan_out
            activations += [4.0 * fan_out, 4.0 * fan_out]  # matmul + bias, activation
    flops += 2.0 * features * features * dim  # the pairwise dot products
    activations.append(4.0 * interactions)
    return synthetic_graph_item(
        "dlrm", variables, optimizer="sgd", forward_flops_per_example=flops,
        activation_bytes_per_example=activations,
        input_bytes_per_example=4.0 * (13 + len(table_rows) + 1))


GRAPH_ITEM_FACTORIES = {"bert_large": bert_large, "resnet50": resnet50, "dlrm": dlrm}


# Old names, kept working with a DeprecationWarning that names the new one.
__getattr__ = renamed_names(__name__, globals(), {"BUILDERS": "GRAPH_ITEM_FACTORIES"})
