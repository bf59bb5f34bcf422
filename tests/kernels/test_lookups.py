"""Embedding lookups gather rows on the table's device instead of reading the table."""
from __future__ import annotations

import numpy as np

from autodist import models
from autodist.ir.capture import capture
from autodist.kernels.lookups import gather_where_tables_live
from tests.kernels.test_partitioner import _run


def _whole(gi):
    return {v.name: [_Whole(v)] for v in gi.variables}


class _Whole:
    """A one-shard plan: the variable's own handle placeholder."""

    def __init__(self, var):
        self.placeholder = var.handle_node
        self.axis = 0
        self.offset = 0
        self.shape = list(var.shape)


def test_tables_are_gathered_not_read_and_the_step_is_unchanged():
    model = models.embedding_model(num_users=50, num_items=71, dim=8)
    gi = capture(model)
    before = gi.graph_def()
    after = gather_where_tables_live(before, gi)
    tables = {v.handle_node for v in gi.variables if v.sparse_gradient}
    assert len(tables) == 2
    reads = [n for n in after.node if n.op == "ReadVariableOp" and n.input[0] in tables]
    gathers = [n for n in after.node if n.op == "ResourceGather" and n.input[0] in tables]
    assert reads == [] or all(_unused(after, r.name) for r in reads)
    assert len(gathers) == 2
    # Dense variables keep their reads.
    dense = {v.handle_node for v in gi.variables if not v.sparse_gradient}
    assert any(n.op == "ReadVariableOp" and n.input[0] in dense for n in after.node)

    rng = np.random.default_rng(0)
    values = {v.name: w for v, w in zip(gi.variables, model.get_weights())}
    feeds = {info.name: (rng.integers(0, 50, (16, 1)).astype(info.dtype)
                         if info.role != "target" else
                         rng.integers(0, 2, (16, 1)).astype(info.dtype))
             for info in gi.inputs if info.role != "sample_weight"}
    want = _run(before, gi, _whole(gi), values, feeds)
    got = _run(after, gi, _whole(gi), values, feeds)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def _unused(graph_def, name):
    return not any(i.split(":")[0].lstrip("^") == name for n in graph_def.node for i in n.input)
