"""Losses normalized by the batch's count of unmasked values.

Where an output carries a Keras mask (a sequence after
`Embedding(mask_zero=True)` or `Masking`), Keras' loss weighs each value by
mask x total / valid (`apply_mask`): the loss is the masked values' sum over
the number of unmasked values in the whole batch. That count is found in the
step as the `Sum` of the cast mask that a `DivNoNan(total, valid)` divides by;
a distributed step sums it over replicas (`autodist.kernels.loss_masks`).
"""
from __future__ import annotations

from autodist.ir.device_names import op_name
from autodist.proto import graph_item_pb2


def analyze(graph_def) -> list[graph_item_pb2.LossMaskInfo]:
    """Each masked loss's count of unmasked values."""
    nodes = {n.name: n for n in graph_def.node}
    out = []
    for node in graph_def.node:
        if node.op != "DivNoNan" or not node.name.startswith("compile_loss/"):
            continue
        count = nodes.get(op_name(node.input[1]))
        if count is None or count.op != "Sum":
            continue
        mask = nodes.get(op_name(count.input[0]))
        if mask is not None and mask.op == "Cast":
            out.append(graph_item_pb2.LossMaskInfo(count=count.name,
                                                   loss=node.name.rsplit("/", 1)[0]))
    return out
