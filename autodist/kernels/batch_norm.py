"""Batch statistics summed over the replicas of a step (synchronized batch normalization).

One device normalizes with the whole batch's mean and variance. Where every
replica of a step runs one virtual node, each replica's step is rewritten
(before it is imported) so that its batch-normalization layers (found at
capture, `autodist.ir.batch_norms`) use the global batch's statistics and
their gradients are one device's:

* forward: each `Mean` of the moments becomes the sum over replicas
  (`CollectiveReduceV2`) of the replica's sum, over the global count of
  reduced elements (the mean first, then the variance around it: the same
  two passes as `tf.nn.moments`);
* backward: each moment's gradient, the upstream gradient broadcast over the
  count, takes the upstream gradient summed over replicas (every replica's
  loss depends on the shared moments) over the global count.

The moving statistics then follow the global batch's on every replica, as
Keras'. Where a replica runs several virtual nodes one after the other, they
cannot share statistics within a step: each uses its own ("ghost batch
normalization"), which `keras_parity` says before launch.
"""
from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from autodist.ir.graph_item import GraphItem
from autodist.kernels import batch_share, graph_edit
from autodist.kernels.replica_sums import ReplicaSums

def syncable(graph_item: GraphItem) -> list:
    """The batch-normalization layers the rewrite applies to."""
    return [bn for bn in graph_item.batch_norms if bn.syncable]


def for_global_batch(graph_def, batch_norms: Sequence, sums: ReplicaSums) -> None:
    """Rewrites `graph_def` (in place) so its batch statistics and their gradients are
    summed over replicas.

    Args:
        graph_def: The step, with `batch_share.add_inputs`.
        batch_norms: The capture's syncable `BatchNormInfo`s.
        sums: Where the sums over replicas are added.
    """
    nodes = {node.name: node for node in graph_def.node}
    for info in batch_norms:
        _moment(graph_def, nodes[info.mean], sums)
        _moment(graph_def, nodes[info.variance], sums)
        if not info.mean_gradient:   # it normalizes the model's input: no backward
            continue
        _gradient(graph_def, nodes[info.mean_gradient], nodes[info.mean_upstream], sums)
        _gradient(graph_def, nodes[info.variance_gradient], nodes[info.variance_upstream],
                  sums)


def _moment(graph_def, mean, sums: ReplicaSums) -> None:
    """Mean(x, axes) in place -> (sum over replicas of Sum(x, axes)) / the global count."""
    prefix = f"{mean.name}/autodist_sync"
    dtype = tf.as_dtype(mean.attr["T"].type)
    local_sum = graph_edit.add(graph_def, f"{prefix}/local_sum", "Sum", list(mean.input[:2]),
                               T=dtype, Tidx=tf.as_dtype(mean.attr["Tidx"].type),
                               keep_dims=mean.attr["keep_dims"].b)
    total = sums.sum(f"{prefix}/sum", local_sum, dtype)
    # Elements reduced by this replica (its examples x the other reduced axes' sizes).
    for name, of in (("size_in", mean.input[0]), ("size_out", local_sum)):
        graph_edit.add(graph_def, f"{prefix}/{name}", "Size", [of], T=dtype, out_type=tf.int32)
        graph_edit.add(graph_def, f"{prefix}/{name}_f", "Cast", [f"{prefix}/{name}"],
                       SrcT=tf.int32, DstT=dtype, Truncate=False)
    graph_edit.add(graph_def, f"{prefix}/count", "RealDiv",
                   [f"{prefix}/size_in_f", f"{prefix}/size_out_f"], T=dtype)
    count = batch_share.global_count(graph_def, prefix, f"{prefix}/count", dtype)
    for attr in ("Tidx", "keep_dims"):
        del mean.attr[attr]
    mean.op = "RealDiv"
    del mean.input[:]
    mean.input.extend([total, count])


def _gradient(graph_def, div, reshape, sums: ReplicaSums) -> None:
    """broadcast(g) / count -> broadcast(sum over replicas of g) / the global count."""
    prefix = f"{div.name}/autodist_sync"
    dtype = tf.as_dtype(div.attr["T"].type)
    upstream = reshape.input[0]
    reshape.input[0] = sums.sum(f"{prefix}/upstream_sum", upstream, dtype)
    div.input[1] = batch_share.global_count(graph_def, prefix, div.input[1], dtype)
