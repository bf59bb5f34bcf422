"""The same strategy on the same data trains the same bits on every rerun.

Three workers (so that the order in which their gradients arrive could
matter: float addition is not associative) train an embedding model with
Adam twice per strategy; the weights must be bitwise equal. A parameter
server sums the replicas' gradients in replica order (`OrderedSum`; the
conditional accumulator it replaced summed in arrival order and differed in
the last bit from run to run), collectives reduce in a fixed ring order.

The strategies cover every kernel the eight builders use: PS (dense and
sparse gradients on a PS; PSLoadBalancing only places differently),
PartitionedPS (shards on two PS; UnevenPartitionedPS only sizes them
differently) and Parallax (the dense variables' ring all-reduce and the
sparse ones on a PS in one step; the all-reduce builders use the same
collectives, whose ring order is fixed).
"""
from __future__ import annotations

import numpy as np
import pytest

import autodist
from autodist import models
from autodist.search import builders

pytestmark = pytest.mark.cluster


def _train(builder) -> list[np.ndarray]:
    model = models.embedding_model(num_users=50, num_items=40, dim=4, optimizer="adam")
    x, y = models.synthetic_data(model, 96)
    spec = autodist.ResourceSpec.local(workers=3, ps=2)
    graph_item = autodist.capture(model)
    strategy = builder.build(graph_item, spec)
    autodist.distribute(model, strategy, spec, graph_item=graph_item).fit(
        x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
    return model.get_weights()


@pytest.mark.parametrize("builder", [builders.PS(), builders.PartitionedPS(),
                                     builders.Parallax()],
                         ids=["PS", "PartitionedPS", "Parallax"])
def test_a_rerun_trains_the_same_bits(builder):
    first, second = _train(builder), _train(builder)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
