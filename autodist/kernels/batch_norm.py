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
from autodist.ir.strategy import Strategy
from autodist.kernels import graph_edit, random_draws

# Far from the gradients' group keys (1 + membership version) and the version
# tags' (1,000,000 + task): their own group, so instance keys never meet.
GROUP_KEY = 2_000_000
_COLLECTIVES_PER_LAYER = 4


def syncable(graph_item: GraphItem) -> list:
    """The batch-normalization layers the rewrite applies to."""
    return [bn for bn in graph_item.batch_norms if bn.syncable]


def syncs(graph_item: GraphItem, strategy: Strategy) -> bool:
    """Whether the step sums batch statistics over replicas: it has such layers, several
    replicas, one virtual node per replica, and the strategy does not ask for ghost
    statistics."""
    return bool(syncable(graph_item)) and len(strategy.replicas) > 1 and \
        strategy.num_virtual_nodes == len(strategy.replicas) and strategy.batch_norm != "ghost"


def for_global_batch(graph_def, batch_norms: Sequence, *, group_size: int, version: int,
                     timeout_s: float, hint: str = "ring"):
    """`graph_def` whose batch statistics and their gradients are summed over replicas.

    Args:
        graph_def: The step (not modified).
        batch_norms: The capture's syncable `BatchNormInfo`s.
        group_size: Replicas in the step.
        version: Membership version of an elastic job (a new group each).
        timeout_s: Bound on every collective.
        hint: The collectives' communication hint.

    Returns:
        A new GraphDef taking `random_draws.EXAMPLES` and `LOCAL`.
    """
    out = tf.compat.v1.GraphDef()
    out.CopyFrom(graph_def)
    random_draws.add_position_inputs(out)
    nodes = {node.name: node for node in out.node}
    collective = _Collectives(out, group_size, GROUP_KEY + version, timeout_s, hint)
    for i, info in enumerate(batch_norms):
        key = 1 + _COLLECTIVES_PER_LAYER * i
        _moment(out, nodes[info.mean], collective, key)
        _moment(out, nodes[info.variance], collective, key + 1)
        _gradient(out, nodes[info.mean_gradient], nodes[info.mean_upstream], collective,
                  key + 2)
        _gradient(out, nodes[info.variance_gradient], nodes[info.variance_upstream],
                  collective, key + 3)
    return out


class _Collectives:
    """Adds sum-over-replicas nodes to a GraphDef."""

    def __init__(self, graph_def, group_size: int, group_key: int, timeout_s: float,
                 hint: str) -> None:
        self.graph_def, self.timeout_s, self.hint = graph_def, float(timeout_s), hint
        self.size = graph_edit.const(graph_def, "autodist_sync_bn/group_size", group_size,
                                     tf.int32)
        self.group = graph_edit.const(graph_def, "autodist_sync_bn/group_key", group_key,
                                      tf.int32)

    def sum(self, name: str, tensor: str, key: int, dtype: tf.DType) -> str:
        instance = graph_edit.const(self.graph_def, f"{name}/instance_key", key, tf.int32)
        return graph_edit.add(
            self.graph_def, name, "CollectiveReduceV2", [tensor, self.size, self.group, instance],
            T=dtype, merge_op="Add", final_op="Id", communication_hint=self.hint,
            timeout_seconds=self.timeout_s, Nordering_token=0, is_stateless=False,
            max_subdivs_per_device=-1)


def _moment(graph_def, mean, collective: _Collectives, key: int) -> None:
    """Mean(x, axes) in place -> (sum over replicas of Sum(x, axes)) / the global count."""
    prefix = f"{mean.name}/autodist_sync"
    dtype = tf.as_dtype(mean.attr["T"].type)
    local_sum = graph_edit.add(graph_def, f"{prefix}/local_sum", "Sum", list(mean.input[:2]),
                               T=dtype, Tidx=tf.as_dtype(mean.attr["Tidx"].type),
                               keep_dims=mean.attr["keep_dims"].b)
    total = collective.sum(f"{prefix}/sum", local_sum, key, dtype)
    # Elements reduced by this replica (its examples x the other reduced axes' sizes).
    for name, of in (("size_in", mean.input[0]), ("size_out", local_sum)):
        graph_edit.add(graph_def, f"{prefix}/{name}", "Size", [of], T=dtype, out_type=tf.int32)
        graph_edit.add(graph_def, f"{prefix}/{name}_f", "Cast", [f"{prefix}/{name}"],
                       SrcT=tf.int32, DstT=dtype, Truncate=False)
    graph_edit.add(graph_def, f"{prefix}/count", "RealDiv",
                   [f"{prefix}/size_in_f", f"{prefix}/size_out_f"], T=dtype)
    count = _global_count(graph_def, prefix, f"{prefix}/count", dtype)
    for attr in ("Tidx", "keep_dims"):
        del mean.attr[attr]
    mean.op = "RealDiv"
    del mean.input[:]
    mean.input.extend([total, count])


def _gradient(graph_def, div, reshape, collective: _Collectives, key: int) -> None:
    """broadcast(g) / count -> broadcast(sum over replicas of g) / the global count."""
    prefix = f"{div.name}/autodist_sync"
    dtype = tf.as_dtype(div.attr["T"].type)
    upstream = reshape.input[0]
    reshape.input[0] = collective.sum(f"{prefix}/upstream_sum", upstream, key, dtype)
    div.input[1] = _global_count(graph_def, prefix, div.input[1], dtype)


def _global_count(graph_def, prefix: str, local_count: str, dtype: tf.DType) -> str:
    """A replica's count of reduced elements scaled to the global batch: (count / its
    examples) x the global batch's examples, exact in floating point."""
    for name, source in (("local", random_draws.LOCAL), ("examples", random_draws.EXAMPLES)):
        graph_edit.add(graph_def, f"{prefix}/{name}", "Cast", [source], SrcT=tf.int32,
                       DstT=dtype, Truncate=False)
    graph_edit.add(graph_def, f"{prefix}/per_example", "RealDiv",
                   [local_count, f"{prefix}/local"], T=dtype)
    return graph_edit.add(graph_def, f"{prefix}/global_count", "Mul",
                          [f"{prefix}/per_example", f"{prefix}/examples"], T=dtype)
