"""Where a virtual node's examples sit in its step's global batch.

The rewrites that make a replica's step compute what one device computes on
the whole batch (`random_draws`, `batch_norm`, `loss_masks`) read three int32
scalars, inputs of the rewritten step that the replicator maps for each
virtual node: `EXAMPLES` (the global batch's examples), `FIRST` (the virtual
node's first example in it) and `LOCAL` (its examples).
"""
from __future__ import annotations

import tensorflow as tf

from autodist.kernels import graph_edit

EXAMPLES = "autodist_batch/examples"
FIRST = "autodist_batch/first"
LOCAL = "autodist_batch/local"


def add_inputs(graph_def) -> None:
    """Adds the `EXAMPLES`, `FIRST` and `LOCAL` inputs to `graph_def` (once)."""
    names = {node.name for node in graph_def.node}
    for name in (EXAMPLES, FIRST, LOCAL):
        if name not in names:
            graph_edit.add(graph_def, name, "Placeholder", [], dtype=tf.int32, shape=[])


def uses_inputs(graph_def) -> bool:
    return any(node.name == EXAMPLES for node in graph_def.node)


def global_share(graph_def, prefix: str, dtype: tf.DType) -> str:
    """The virtual node's share of the global batch's examples (local / examples)."""
    for name, source in (("local", LOCAL), ("examples", EXAMPLES)):
        graph_edit.add(graph_def, f"{prefix}/{name}", "Cast", [source], SrcT=tf.int32,
                       DstT=dtype, Truncate=False)
    return graph_edit.add(graph_def, f"{prefix}/share", "RealDiv",
                          [f"{prefix}/local", f"{prefix}/examples"], T=dtype)
