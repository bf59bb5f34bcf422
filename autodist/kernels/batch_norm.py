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
  loss depends on the shared moments) over the global count. A replica's
  loss is its examples' mean, weighted by its share of the batch afterwards
  (`synchronizer`), so each upstream gradient is weighted by its replica's
  share in the sum, and the sum divided by this replica's share (which the
  weighting then cancels): replicas holding unequal parts of a batch (a short
  last batch split 5/4) add up to one device's gradient.

The moving statistics then follow the global batch's on every replica, as
Keras'. Where a replica runs several virtual nodes one after the other, they
cannot share statistics within a step: each uses its own ("ghost batch
normalization"), which `keras_parity` says before launch.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import tensorflow as tf

from autodist.ir.graph_item import GraphItem
from autodist.kernels import batch_share, graph_edit
from autodist.kernels.replica_sums import ReplicaSums

def syncable(graph_item: GraphItem) -> list:
    """The batch-normalization layers the rewrite applies to."""
    return [bn for bn in graph_item.batch_norms if bn.syncable]


def for_global_batch(graph_def, batch_norms: Sequence, sums: ReplicaSums,
                     output_bytes: Mapping[str, int] | None = None) -> None:
    """Rewrites `graph_def` (in place) so its batch statistics and their gradients are
    summed over replicas.

    Args:
        graph_def: The step, with `batch_share.add_inputs`.
        batch_norms: The capture's syncable `BatchNormInfo`s.
        sums: Where the sums over replicas are added.
        output_bytes: The capture's op output bytes by node (`OpInfo`): the
            statistics' sizes (per channel: the same at any batch), so small
            sums are gathered; without it every sum is a ring all-reduce.
    """
    nodes = {node.name: node for node in graph_def.node}
    output_bytes = output_bytes or {}
    shares: dict[tf.DType, str] = {}
    for info in batch_norms:
        mean_count = _moment(graph_def, nodes[info.mean], sums, output_bytes.get(info.mean))
        variance_count = _moment(graph_def, nodes[info.variance], sums,
                                 output_bytes.get(info.variance))
        if not info.mean_gradient:   # it normalizes the model's input: no backward
            continue
        _gradient(graph_def, nodes[info.mean_gradient], nodes[info.mean_upstream], sums,
                  mean_count, shares, output_bytes.get(info.mean_upstream))
        _gradient(graph_def, nodes[info.variance_gradient], nodes[info.variance_upstream],
                  sums, variance_count, shares, output_bytes.get(info.variance_upstream))


def _elements(size_bytes: int | None, dtype: tf.DType, extra: int = 0) -> int | None:
    return None if not size_bytes else size_bytes // dtype.size + extra


def _moment(graph_def, mean, sums: ReplicaSums,
            size_bytes: int | None = None) -> tuple[str, tf.DType]:
    """Mean(x, axes) in place -> (sum over replicas of Sum(x, axes)) / the global count
    of reduced elements, both summed in one collective; returns the global count and
    its dtype.

    The count is summed, not scaled from the replica's own (its elements per example
    times the global batch's examples), so that a replica without examples (a short
    last batch split over more replicas) normalizes as the others do."""
    prefix = f"{mean.name}/autodist_sync"
    dtype = tf.as_dtype(mean.attr["T"].type)
    add, const = graph_edit.add, graph_edit.const
    local_sum = add(graph_def, f"{prefix}/local_sum", "Sum", list(mean.input[:2]), T=dtype,
                    Tidx=tf.as_dtype(mean.attr["Tidx"].type),
                    keep_dims=mean.attr["keep_dims"].b)
    # Elements reduced by this replica per output (its examples x the other axes' sizes).
    for name, of in (("size_in", mean.input[0]), ("size_out", local_sum)):
        add(graph_def, f"{prefix}/{name}", "Size", [of], T=dtype, out_type=tf.int32)
        add(graph_def, f"{prefix}/{name}_f", "Cast", [f"{prefix}/{name}"], SrcT=tf.int32,
            DstT=dtype, Truncate=False)
    add(graph_def, f"{prefix}/count", "RealDiv", [f"{prefix}/size_in_f", f"{prefix}/size_out_f"],
        T=dtype)
    const(graph_def, f"{prefix}/flat", [-1], tf.int32)
    const(graph_def, f"{prefix}/one", [1], tf.int32)
    const(graph_def, f"{prefix}/axis", 0, tf.int32)
    add(graph_def, f"{prefix}/sum_flat", "Reshape", [local_sum, f"{prefix}/flat"], T=dtype,
        Tshape=tf.int32)
    add(graph_def, f"{prefix}/count_flat", "Reshape", [f"{prefix}/count", f"{prefix}/one"],
        T=dtype, Tshape=tf.int32)
    add(graph_def, f"{prefix}/packed", "ConcatV2",
        [f"{prefix}/sum_flat", f"{prefix}/count_flat", f"{prefix}/axis"], N=2, T=dtype,
        Tidx=tf.int32)
    packed = sums.sum(f"{prefix}/sum", f"{prefix}/packed", dtype,
                      _elements(size_bytes, dtype, extra=1))
    # Split: the sums (in the local sum's shape), then the count.
    add(graph_def, f"{prefix}/size_out_1d", "Reshape", [f"{prefix}/size_out", f"{prefix}/one"],
        T=tf.int32, Tshape=tf.int32)
    const(graph_def, f"{prefix}/zero", [0], tf.int32)
    add(graph_def, f"{prefix}/total_flat", "Slice",
        [packed, f"{prefix}/zero", f"{prefix}/size_out_1d"], T=dtype, Index=tf.int32)
    add(graph_def, f"{prefix}/shape", "Shape", [local_sum], T=dtype, out_type=tf.int32)
    total = add(graph_def, f"{prefix}/total", "Reshape",
                [f"{prefix}/total_flat", f"{prefix}/shape"], T=dtype, Tshape=tf.int32)
    add(graph_def, f"{prefix}/count_1d", "Slice",
        [packed, f"{prefix}/size_out_1d", f"{prefix}/one"], T=dtype, Index=tf.int32)
    const(graph_def, f"{prefix}/scalar", [], tf.int32)
    count = add(graph_def, f"{prefix}/global_count", "Reshape",
                [f"{prefix}/count_1d", f"{prefix}/scalar"], T=dtype, Tshape=tf.int32)
    for attr in ("Tidx", "keep_dims"):
        del mean.attr[attr]
    mean.op = "RealDiv"
    del mean.input[:]
    mean.input.extend([total, count])
    return count, dtype


def _gradient(graph_def, div, reshape, sums: ReplicaSums, count: tuple[str, tf.DType],
              shares: dict[tf.DType, str], size_bytes: int | None = None) -> None:
    """broadcast(g) / count -> broadcast(sum over replicas of share * g, over this
    replica's share) / the global `count` (`shares`: this replica's share of the batch
    by dtype, added once)."""
    prefix = f"{div.name}/autodist_sync"
    dtype = tf.as_dtype(div.attr["T"].type)
    if dtype not in shares:
        shares[dtype] = batch_share.global_share(
            graph_def, f"autodist_batch_norm_share_{dtype.name}", dtype)
    share = shares[dtype]
    upstream = reshape.input[0]
    weighted = graph_edit.add(graph_def, f"{prefix}/upstream_weighted", "Mul",
                              [upstream, share], T=dtype)
    summed = sums.sum(f"{prefix}/upstream_sum", weighted, dtype, _elements(size_bytes, dtype))
    # 0 on a replica without examples (nothing flows back to its empty batch).
    reshape.input[0] = graph_edit.add(graph_def, f"{prefix}/upstream_global", "DivNoNan",
                                      [summed, share], T=dtype)
    div.input[1] = graph_edit.add(graph_def, f"{prefix}/global_count", "Cast", [count[0]],
                                  SrcT=count[1], DstT=dtype, Truncate=False)
