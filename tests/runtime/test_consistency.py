"""Asynchronous and bounded-staleness PS, checked against their definitions.

* With one worker, asynchronous PS is plain SGD/Adam: equal to Keras `fit`,
  also when the worker reads a local copy of the PS variables.
* With a deliberately slowed worker, asynchronous training lets the fast
  worker run ahead without bound, while staleness s keeps its lead <= s.
"""
from __future__ import annotations

import numpy as np
import pytest

import autodist
from autodist import models
from autodist.search import builders

pytestmark = pytest.mark.cluster


def _data(n=96):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 20)).astype("float32"),
            rng.integers(0, 10, n).astype("int32"))


@pytest.mark.parametrize("optimizer,local_replication", [
    ("sgd", False), ("adam", False),
    ("adam", True),  # the worker-local copy is refreshed after each own update
])
def test_async_with_one_worker_equals_keras(optimizer, local_replication):
    model = models.mlp(input_dim=20, hidden=(16,), optimizer=optimizer)
    x, y = _data()
    reference = models.single_device_twin(model)
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    spec = autodist.ResourceSpec.local(workers=1, ps=1)
    graph_item = autodist.capture(model)
    strategy = builders.PartitionedPS(sync=False, local_replication=local_replication,
                                      min_shard_bytes=64).build(graph_item, spec)
    autodist.distribute(model, strategy, spec, graph_item=graph_item).fit(
        x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)


def _slowed_run(sync: bool, staleness: int):
    model = models.mlp(input_dim=20, hidden=(16,), optimizer="sgd")
    x, y = _data(n=640)
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    graph_item = autodist.capture(model)
    strategy = builders.PS(sync=sync, staleness=staleness).build(graph_item, spec)
    run = autodist.distribute(model, strategy, spec, graph_item=graph_item,
                              task_step_delay_s={1: 0.05})
    history = run.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    assert all(np.isfinite(w).all() for w in model.get_weights())
    return history


def test_bounded_staleness_keeps_the_fast_worker_within_s_steps():
    history = _slowed_run(sync=True, staleness=2)
    assert len(history.step_losses) == 20
    # The fast chief did run ahead of the slowed worker, never by more than 2.
    assert 1 <= history.max_lead[0] <= 2
    assert history.max_lead[1] <= 2


def test_async_lets_the_fast_worker_run_ahead():
    history = _slowed_run(sync=False, staleness=0)
    assert history.max_lead[0] > 2
