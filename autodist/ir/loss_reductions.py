"""Compiled losses reduced by a sum over the batch, or by a mean over its sample weights.

Keras' `reduce_values` divides a loss's weighted sum by the batch's count of
values (`sum_over_batch_size`, `mean`), which a replica's loss weighted by its
share of the global batch reproduces. Two reductions need more:

* `reduction="sum"`: the loss is the batch's sum. The capture multiplies the
  loss's sample weights by a scalar input of the step (`SUM_SCALE`_i, 1 unless
  fed); the runtime feeds the global batch's examples over the virtual node's
  there, so after the share weighting each part's sum (and its gradient)
  counts in full, and the parts add up to one device's.
* `reduction="mean_with_sample_weight"`: the loss divides by the batch's sum
  of sample weights, a `Sum` that a `DivNoNan` divides by (found here). A
  distributed step sums it over replicas, as a masked loss's count of
  unmasked values (`autodist.kernels.loss_masks`).
"""
from __future__ import annotations

import re
from typing import Iterable

from autodist.ir.device_names import op_name
from autodist.proto import graph_item_pb2

SUM_SCALE = "autodist_loss_sum_scale"
# The compiled loss's scope: Keras' train step ("compile_loss") and the per-output
# loss trackers' second call ("compile_loss_1").
_COMPILE_LOSS = re.compile(r"compile_loss(_\d+)?/")
# Ops between a Sum and the DivNoNan that divides by it (Keras casts the sum).
_PASS_THROUGH = frozenset({"Cast", "Identity"})


def weight_sums(graph_def, weights: Iterable[str]) -> list[graph_item_pb2.LossReductionInfo]:
    """Each compiled loss's sum of sample weights that it divides by.

    Args:
        graph_def: The step.
        weights: The step's sample-weight inputs (node names).
    """
    nodes = {n.name: n for n in graph_def.node}
    reads = readers_of(graph_def, set(weights))
    out = []
    for node in graph_def.node:
        if node.op != "DivNoNan" or not _COMPILE_LOSS.match(node.name):
            continue
        divisor = nodes.get(op_name(node.input[1]))
        while divisor is not None and divisor.op in _PASS_THROUGH:
            divisor = nodes.get(op_name(divisor.input[0]))
        numerator = nodes.get(op_name(node.input[0]))
        if divisor is None or divisor.op != "Sum" or divisor.name not in reads or \
                numerator is None or numerator.op != "Sum":
            continue
        out.append(graph_item_pb2.LossReductionInfo(
            loss=node.name.rsplit("/", 1)[0], reduction="mean_with_sample_weight",
            node=divisor.name))
    return out


def readers_of(graph_def, sources: set[str]) -> set[str]:
    """The nodes that read any of `sources`, directly or through other nodes."""
    consumers: dict[str, list[str]] = {}
    for node in graph_def.node:
        for name in node.input:
            if not name.startswith("^"):  # data only
                consumers.setdefault(op_name(name), []).append(node.name)
    seen, todo = set(), list(sources)
    while todo:
        for reader in consumers.get(todo.pop(), []):
            if reader not in seen:
                seen.add(reader)
                todo.append(reader)
    return seen
