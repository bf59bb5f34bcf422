"""A replica's step made to compute what one device computes on the global batch.

Most of a step is a mean over examples, which a replica's share-weighted loss
reproduces. Where Keras' step couples the examples of a batch, the step a
replica imports is rewritten first:

* random draws spanning the batch are drawn for the global batch and sliced
  (`random_draws`; any number of virtual nodes);
* loss terms a layer adds (`add_loss`) that sum over examples, and compiled
  losses reduced by a sum (`reduction="sum"`), count in full on every virtual
  node (the loss is weighted by its share of the batch); terms that are a mean
  over examples are 0 on a virtual node without examples (not 0 / 0);
* batch statistics and their gradients (`batch_norm`), a masked loss's
  count of unmasked values and a `reduction="mean_with_sample_weight"` loss's
  sum of sample weights (`loss_masks`) are summed over the replicas of the
  step (`replica_sums`) where the strategy has no virtual nodes of its own
  (`sums_batch_quantities`; virtual nodes of one replica run one after another
  and cannot share a sum, and a strategy with virtual nodes keeps each one's
  own, the same on any hardware).
"""
from __future__ import annotations

import tensorflow as tf

from autodist.ir.graph_item import BATCH_PART_INPUT, GraphItem
from autodist.ir.strategy import Strategy
from autodist.kernels import batch_norm, batch_share, graph_edit, loss_masks, random_draws
from autodist.kernels.replica_sums import ReplicaSums


def one_virtual_node_each(strategy: Strategy) -> bool:
    """Several replicas, each running one virtual node: sums over replicas are possible."""
    return len(strategy.replicas) > 1 and \
        strategy.num_virtual_nodes == len(strategy.replicas)


def sums_batch_quantities(strategy: Strategy) -> bool:
    """Whether batch statistics and masked losses' counts are the global batch's.

    Without virtual nodes of its own a strategy computes Keras' step, so they are
    summed over replicas. A strategy with virtual nodes promises the same result
    for any hardware given its global batch and number of virtual nodes, so each
    virtual node keeps its own, unless it asks for sums (`with_batch_norm("sync")`,
    one virtual node per replica).
    """
    if not one_virtual_node_each(strategy) or strategy.batch_norm == "ghost":
        return False
    return strategy.batch_norm == "sync" or strategy.global_batch_size is None


def synced_batch_norms(graph_item: GraphItem, strategy: Strategy) -> list:
    """The batch-normalization layers whose statistics the step sums over replicas."""
    return batch_norm.syncable(graph_item) if sums_batch_quantities(strategy) else []


# `smallest_batch` where a part of a batch may have no examples.
ANY_BATCH = (1, "a batch needs an example")


def layers_needing_examples(graph_item: GraphItem, strategy: Strategy) -> list[str]:
    """The layers that cannot run on a virtual node without examples (a short last batch
    split over more virtual nodes than it has examples): batch normalization computing
    the virtual node's own statistics (a mean of no values). Everything else gives
    such a virtual node a zero loss and zero gradients, as it gives one device the
    batch's examples alone."""
    if strategy.num_virtual_nodes <= 1:
        return []
    synced = {bn.layer for bn in synced_batch_norms(graph_item, strategy)}
    return sorted({bn.layer for bn in graph_item.batch_norms if bn.layer not in synced})


def smallest_batch(graph_item: GraphItem, strategy: Strategy) -> tuple[int, str]:
    """The fewest examples a global batch may have, and why (for messages; see
    `layers_needing_examples`)."""
    if graph_item.proto.HasField("custom_step") and strategy.num_virtual_nodes > 1:
        # Its means over a part's examples are 0 / 0 on a part without any.
        return strategy.num_virtual_nodes, (
            f"one for each of the {strategy.num_virtual_nodes} virtual nodes or replicas "
            f"that split it: the model's own train_step "
            f"({graph_item.proto.custom_step.step_class}) computes its losses and metrics "
            "over each one's examples")
    layers = layers_needing_examples(graph_item, strategy)
    if not layers:
        return ANY_BATCH
    return strategy.num_virtual_nodes, (
        f"one for each of the {strategy.num_virtual_nodes} virtual nodes or replicas that "
        f"split it: batch normalization layer(s) {layers} compute each one's own statistics")


def loss_divisors(graph_item: GraphItem) -> list[str]:
    """The losses' divisors that are sums over the batch (nodes): masked losses' counts
    of unmasked values, `mean_with_sample_weight` losses' sums of sample weights."""
    names = [m.count for m in graph_item.loss_masks] + \
        [r.node for r in graph_item.loss_reductions if r.reduction == "mean_with_sample_weight"]
    return list(dict.fromkeys(names))   # each rewritten once


def synced_loss_divisors(graph_item: GraphItem, strategy: Strategy) -> list[str]:
    """The losses' divisors the step sums over replicas (`loss_divisors`)."""
    return loss_divisors(graph_item) if sums_batch_quantities(strategy) else []


def sums_over_replicas(graph_item: GraphItem, strategy: Strategy) -> bool:
    """Whether the step itself has collectives (besides the gradients')."""
    return bool(synced_batch_norms(graph_item, strategy) or
                synced_loss_divisors(graph_item, strategy))


def rewrite(graph_def, graph_item: GraphItem, strategy: Strategy, *, version: int,
            timeout_s: float, hint: str):
    """The step with every rewrite the strategy allows (a new GraphDef, or `graph_def`
    itself when none applies); it then reads `batch_share`'s inputs."""
    out = random_draws.for_global_batch(graph_def, graph_item.random_ops)
    norms = synced_batch_norms(graph_item, strategy)
    masks = synced_loss_divisors(graph_item, strategy)
    sums = [t.scale for t in graph_item.added_losses if t.kind == "sum"] + \
        [r.node for r in graph_item.loss_reductions if r.reduction == "sum"]
    means = [t.tensor for t in graph_item.added_losses if t.kind == "mean"]
    part = next((node for node in graph_def.node if node.name == BATCH_PART_INPUT), None)
    if not (norms or masks or sums or means or part):
        return out
    if out is graph_def:
        out = type(graph_def)()
        out.CopyFrom(graph_def)
    batch_share.add_inputs(out)
    _count_in_full(out, sums)
    _zero_without_examples(out, means)
    if part is not None:   # Keras' per-output loss trackers: a part of one batch each
        share = batch_share.global_share(out, "autodist_batch_part_share",
                                         tf.as_dtype(part.attr["dtype"].type))
        graph_edit.redirect_tensor(out, BATCH_PART_INPUT, share)
    if not (norms or masks):
        return out
    sums = ReplicaSums(out, group_size=len(strategy.replicas), version=version,
                       timeout_s=timeout_s, hint=hint)
    batch_norm.for_global_batch(out, norms, sums,
                                {op.name: op.output_bytes for op in graph_item.ops})
    loss_masks.for_global_batch(out, masks, sums)
    return out


def _count_in_full(graph_def, scales: list[str]) -> None:
    """Feeds the scale of each sum over examples (an added loss term's,
    `AddedLossInfo.scale`; a compiled loss's reduced by a sum, `LossReductionInfo.node`)
    the global batch's examples over the virtual node's: after the loss's weighting by
    its share of the batch, each virtual node's sum (and its gradient) counts in full,
    and they add up to one device's."""
    nodes = {node.name: node for node in graph_def.node}
    for i, name in enumerate(scales):
        scale = nodes[name]
        dtype = tf.as_dtype(scale.attr["dtype"].type)
        prefix = f"autodist_added_loss_{i}"
        share = batch_share.global_share(graph_def, prefix, dtype)
        graph_edit.const(graph_def, f"{prefix}/one", 1.0, dtype)
        # 0 for a virtual node without examples (its sum is 0): no 0 x inf.
        graph_edit.add(graph_def, f"{prefix}/inverse", "DivNoNan", [f"{prefix}/one", share],
                       T=dtype)
        graph_edit.redirect_tensor(graph_def, name, f"{prefix}/inverse")


def _zero_without_examples(graph_def, terms: list[str]) -> None:
    """Makes each added loss term that is a mean over examples 0 on a virtual node without
    examples (a short last batch split over more virtual nodes), where a custom
    `add_loss(ops.mean(...))` is 0 / 0 (Keras' activity regularizers divide with
    `divide_no_nan` already)."""
    nodes = {node.name: node for node in graph_def.node}
    for i, tensor in enumerate(terms):
        attrs = nodes[tensor.partition(":")[0]].attr
        dtype = tf.as_dtype(next(attrs[k].type for k in ("T", "DstT", "dtype") if k in attrs))
        prefix = f"autodist_mean_term_{i}"
        # Its readers first, then the nodes that read the term itself.
        graph_edit.redirect_tensor(graph_def, tensor, f"{prefix}/term")
        graph_edit.const(graph_def, f"{prefix}/zero", 0, tf.int32)
        graph_edit.add(graph_def, f"{prefix}/has_examples", "Greater",
                       [batch_share.LOCAL, f"{prefix}/zero"], T=tf.int32)
        graph_edit.add(graph_def, f"{prefix}/zeros", "ZerosLike", [tensor], T=dtype)
        graph_edit.add(graph_def, f"{prefix}/term", "SelectV2",
                       [f"{prefix}/has_examples", tensor, f"{prefix}/zeros"], T=dtype)
