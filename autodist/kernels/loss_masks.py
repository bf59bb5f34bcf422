"""A loss's divisor that sums over the batch, summed over the replicas of a step.

Keras divides a masked loss by the number of unmasked values in the whole
batch (`autodist.ir.loss_masks`), and a `reduction="mean_with_sample_weight"`
loss by the batch's sum of sample weights (`autodist.ir.loss_reductions`). A
replica's loss is weighted by its share of the global batch afterwards
(`synchronizer`), so its divisor is rewritten as the global one times that
share: the replica's weighted loss is then its values' sum over the global
divisor, and the replicas' sum is one device's loss (a global divisor of 0
gives 0, as Keras' `divide_no_nan`). The divisor has no gradient: the backward
pass reads the rewritten node, nothing else changes there.
"""
from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from autodist.kernels import batch_share, graph_edit
from autodist.kernels.replica_sums import ReplicaSums


def for_global_batch(graph_def, divisors: Sequence[str], sums: ReplicaSums) -> None:
    """Rewrites each divisor (a `Sum` node) in `graph_def` (in place; it has
    `batch_share.add_inputs`)."""
    nodes = {node.name: node for node in graph_def.node}
    for name in divisors:
        count = nodes[name]
        prefix = f"{count.name}/autodist_global"
        dtype = tf.as_dtype(count.attr["T"].type)
        local = graph_edit.add(graph_def, f"{prefix}/local_count", "Sum", list(count.input),
                               T=dtype, Tidx=tf.as_dtype(count.attr["Tidx"].type),
                               keep_dims=count.attr["keep_dims"].b)
        total = sums.sum(f"{prefix}/sum", local, dtype)
        share = batch_share.global_share(graph_def, prefix, dtype)
        for attr in ("Tidx", "keep_dims"):
            del count.attr[attr]
        count.op = "Mul"
        del count.input[:]
        count.input.extend([total, share])
