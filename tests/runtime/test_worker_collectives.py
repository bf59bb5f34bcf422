"""A worker's program builds its collectives without a timeout of their own.

TensorFlow starts a thread that sleeps out each collective's `timeout_seconds`
(base_collective_executor.cc), so a fast step's collectives pile threads up
(a 2-worker MLP fit held ~6,000 threads after 25 s with 60 s timeouts, and a
pids limit kills the task). The worker bounds every run with RunOptions
instead, which aborts a run's collectives when it expires (the recovery and
chaos tests check that failures are still named in time).
"""
from __future__ import annotations

import autodist
from autodist import models
from autodist.ir.capture import capture
from autodist.runtime.worker_session import build_program
from autodist.search import builders

_COLLECTIVES = {"CollectiveReduceV2", "CollectiveGatherV2", "CollectiveReduce"}


def test_an_elastic_workers_collectives_take_the_programs_timeout_none():
    """ncf (a small dense group gathered and summed, sparse all-gathers) and the MLP
    (its one large group ring-reduced) with virtual nodes, elastic (the version
    tag's V1 collective): every collective of worker 1's program has
    timeout_seconds 0 when built with 0, and the given bound otherwise."""
    spec = autodist.ResourceSpec.local(workers=2)
    items = [capture(models.embedding_model(num_users=13, num_items=29, dim=4)),
             capture(models.build("mlp", seed=0))]
    for timeout_s in (0.0, 7.0):
        types = set()
        for item in items:
            strategy = builders.AllReduce().build(item, spec).with_virtual_nodes(32, 4)
            program = build_program(item, strategy, spec, 1, timeout_s, elastic=True,
                                    atomic=True)
            collectives = [op for op in program.graph.get_operations()
                           if op.type in _COLLECTIVES]
            types |= {op.type for op in collectives}
            assert {op.get_attr("timeout_seconds") for op in collectives} == {timeout_s}
        assert types == _COLLECTIVES
