"""Synthetic GraphItems for search tests (no TensorFlow needed)."""
from __future__ import annotations

from typing import Sequence

from autodist.ir.graph_item import GraphItem
from autodist.proto import graph_item_pb2


def graph_item(variables: Sequence[tuple[str, Sequence[int], bool]], *, name: str = "synthetic",
               flops: float = 0.0, estimate_batch_size: int = 10,
               lookups_per_example: float = 1.0, optimizer: str = "",
               momentum: float = 0.0, slots: Sequence[str] = (),
               ops: Sequence[tuple[str, str, int]] = ()) -> GraphItem:
    """A GraphItem with float32 variables (name, shape, sparse gradient).

    Each sparse variable's gradient values come from an op whose size at the
    estimate batch means `lookups_per_example` rows per example. `flops`
    goes to one op. `optimizer` names a Keras algorithm ("sgd", "adam", ...);
    every variable gets the optimizer `slots`. `ops` adds (type, phase,
    output bytes at the estimate batch) ops, e.g. activations.
    """
    proto = graph_item_pb2.GraphItem(name=name, estimate_batch_size=estimate_batch_size)
    if optimizer:
        proto.optimizer.algorithm = optimizer
        proto.optimizer.family = "keras"
        proto.optimizer.hyperparameters["momentum"] = momentum
    if flops:
        proto.ops.add(name="matmul", type="MatMul", phase="forward", flops=flops)
    for i, (op_type, phase, output_bytes) in enumerate(ops):
        proto.ops.add(name=f"op_{i}", type=op_type, phase=phase, output_bytes=output_bytes)
    for order, (var_name, shape, sparse) in enumerate(variables):
        size = 4
        for d in shape:
            size *= d
        v = proto.variables.add(name=var_name, dtype="float32", shape=list(shape),
                                byte_size=size, sparse_gradient=sparse, gradient_order=order)
        v.partitionable_axes.extend([0] if sparse else range(len(shape)))
        v.slots.extend(slots)
        if sparse:
            values = f"{var_name}/grad_values"
            v.gradient.values = values + ":0"
            v.gradient.indices = f"{var_name}/grad_indices:0"
            row_bytes = size // shape[0]
            proto.ops.add(name=values, type="Identity", phase="backward",
                          output_bytes=int(row_bytes * lookups_per_example
                                           * estimate_batch_size))
        else:
            v.gradient.dense = f"{var_name}/grad:0"
    return GraphItem(proto)


def many_variables(n: int = 200, seed: int = 0) -> GraphItem:
    """`n` variables of mixed sizes, a tenth of them embeddings."""
    import numpy as np

    rng = np.random.default_rng(seed)
    variables = []
    for i in range(n):
        if i % 10 == 0:
            variables.append((f"embedding_{i}", (int(rng.integers(1000, 50000)), 32), True))
        else:
            variables.append((f"dense_{i}", (int(rng.integers(16, 1024)),
                                             int(rng.integers(16, 512))), False))
    return graph_item(variables, name=f"many_{n}", flops=1e9)
