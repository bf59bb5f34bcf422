"""A masked loss's count of unmasked values, summed over the replicas of a step.

Keras divides a masked loss by the number of unmasked values in the whole
batch (`autodist.ir.loss_masks`). A replica's loss is weighted by its share
of the global batch afterwards (`synchronizer`), so its count is rewritten as
the global count times that share: the replica's weighted loss is then its
masked values' sum over the global count, and the replicas' sum is one
device's loss. The count has no gradient: nothing changes in the backward pass.
"""
from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from autodist.kernels import batch_share, graph_edit
from autodist.kernels.replica_sums import ReplicaSums


def for_global_batch(graph_def, loss_masks: Sequence, sums: ReplicaSums) -> None:
    """Rewrites each masked loss's count in `graph_def` (in place; it has
    `batch_share.add_inputs`)."""
    nodes = {node.name: node for node in graph_def.node}
    for info in loss_masks:
        count = nodes[info.count]
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
