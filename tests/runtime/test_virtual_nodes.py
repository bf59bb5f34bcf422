"""Virtual nodes on real clusters: results depend on B and V, not on the hardware.

The same strategy with global batch B = 32 split into V = 4 virtual nodes
runs on 1 worker (1 x 4), 2 workers (2 x 2) and 4 workers (4 x 1): after 6
steps the weights equal each other and single-device Keras `fit` with batch
32, within 2e-5 (float32 sums in another order; observed <= 1.2e-7). An
uneven mapping (1 + 3) with Adam on sparse embedding gradients, parameter
servers on the workers' CPUs, gives the same numbers.
"""
from __future__ import annotations


import numpy as np
import pytest

import autodist
from autodist import models
from autodist.runtime.run import AutodistError
from autodist.search import builders
from tests import small_mlp
from autodist.search.virtual_nodes import balance

TOLERANCE = 2e-5
PIN = {0: {0}, 1: {1}}  # one core per worker
EXAMPLES, BATCH, EPOCHS, NODES = 96, 32, 2, 4


def _train(model, strategy, spec, x, y, job_dir):
    run = autodist.distribute(model, strategy, spec, job_dir=job_dir, step_timeout_s=60)
    history = run.fit(x, y, epochs=EPOCHS, shuffle=False, verbose=0)
    assert len(history.step_losses) == EPOCHS * EXAMPLES // BATCH
    return model.get_weights()


@pytest.mark.cluster
def test_mapping_does_not_change_the_result(tmp_path):
    x, y = small_mlp.data(EXAMPLES)
    expected = small_mlp.keras_weights(small_mlp.mlp(), x, y, BATCH, EPOCHS)
    results = {}
    for workers in (1, 2, 4):
        model = small_mlp.mlp()
        spec = autodist.ResourceSpec.local(workers=workers)
        strategy = builders.AllReduce().build(autodist.capture(model), spec)
        strategy = strategy.with_virtual_nodes(BATCH, NODES)
        results[workers] = _train(model, strategy, spec, x, y, str(tmp_path / f"w{workers}"))
    for workers, weights in results.items():
        for got, want in zip(weights, expected):
            np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE,
                                       err_msg=f"{workers} x {NODES // workers}")


@pytest.mark.cluster
def test_uneven_mapping_with_sparse_adam_on_worker_ps(tmp_path):
    model = models.embedding_model(num_users=50, num_items=71, dim=8, optimizer="adam")
    rng = np.random.default_rng(1)
    x = [rng.integers(0, 50, (EXAMPLES, 1)).astype("int32"),
         rng.integers(0, 71, (EXAMPLES, 1)).astype("int32")]
    y = rng.integers(0, 2, (EXAMPLES, 1)).astype("float32")
    expected = small_mlp.keras_weights(model, x, y, BATCH, EPOCHS)
    spec = autodist.ResourceSpec.local(workers=2)  # PS variables on the workers' CPUs
    strategy = builders.PS().build(autodist.capture(model), spec)
    w0, w1 = strategy.replicas
    strategy = strategy.with_virtual_nodes(BATCH, NODES, [w0, w1, w1, w1])
    weights = _train(model, strategy, spec, x, y, str(tmp_path / "job"))
    for got, want in zip(weights, expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


@pytest.mark.cluster
def test_batch_norm_statistics_do_not_depend_on_the_mapping(tmp_path):
    # Each virtual node normalizes with its own examples and keeps its own
    # moving statistics; virtual node 0's are written back.
    x, y = models.synthetic_data(models.cnn(image_size=8), 64, seed=2)
    results = []
    for workers in (1, 2):
        model = models.cnn(image_size=8, optimizer="sgd")
        spec = autodist.ResourceSpec.local(workers=workers)
        strategy = builders.AllReduce().build(autodist.capture(model), spec)
        run = autodist.distribute(model, strategy.with_virtual_nodes(32, 2), spec,
                                  job_dir=str(tmp_path / f"w{workers}"), step_timeout_s=60)
        run.fit(x, y, epochs=1, shuffle=False, verbose=0)
        results.append(model.get_weights())
    names = [w.path for w in model.weights]
    assert any("moving_mean" in n for n in names)
    for name, one, two in zip(names, *results):
        np.testing.assert_allclose(two, one, rtol=0, atol=TOLERANCE, err_msg=name)
    assert any(np.any(w != 0) for n, w in zip(names, results[0]) if "moving_mean" in n)


@pytest.mark.cluster
def test_balancing_gives_a_slowed_worker_fewer_virtual_nodes(tmp_path):
    """Worker 1 runs 40% of the time (SIGSTOP/SIGCONT, autodist.bench.slowdown).

    Each worker is pinned to its own core (a device each). The probe sees
    worker 1 slower, `balance` gives it fewer virtual nodes, and the
    balanced run gives the even run's numbers. How much faster it is lives in
    benchmarks/virtual_nodes.py (a timing is no test).
    """
    from autodist.bench.slowdown import Slowdown

    rng = np.random.default_rng(3)
    x = rng.normal(size=(2048, 256)).astype("float32")
    y = rng.integers(0, 10, 2048).astype("int32")
    model = models.mlp(input_dim=256, hidden=(512, 512), optimizer="sgd")
    graph_item = autodist.capture(model)
    spec = autodist.ResourceSpec.local(workers=2)
    even = builders.AllReduce().build(graph_item, spec).with_virtual_nodes(512, 8)
    before = model.get_weights()
    probe_dir = str(tmp_path / "probe")
    run = autodist.distribute(model, even, spec, graph_item=graph_item, job_dir=probe_dir)
    with Slowdown(probe_dir, 1, 0.4, pin=PIN):
        speeds = run.measure_throughput(x, y, steps=5)
    w0, w1 = even.replicas
    assert set(speeds) == {w0, w1} and speeds[w1] < speeds[w0]
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)  # measuring does not train
    balanced = balance(even, speeds)
    assert balanced.virtual_node_devices.count(w0) > 4
    weights = {}
    for name, strategy in (("even", even), ("balanced", balanced)):
        model.set_weights(before)
        job_dir = str(tmp_path / name)
        run = autodist.distribute(model, strategy, spec, graph_item=graph_item, job_dir=job_dir)
        with Slowdown(job_dir, 1, 0.4, pin=PIN):
            run.fit(x, y, epochs=1, verbose=0, shuffle=False)
        weights[name] = model.get_weights()
    for got, want in zip(weights["balanced"], weights["even"]):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


def test_fit_rejects_another_batch_size():
    model = small_mlp.mlp()
    spec = autodist.ResourceSpec.local(workers=2)
    strategy = builders.AllReduce().build(autodist.capture(model), spec).with_virtual_nodes(32, 4)
    run = autodist.distribute(model, strategy, spec)
    x, y = small_mlp.data(EXAMPLES)
    with pytest.raises(AutodistError, match="fixes the global batch at 32 examples .4 virtual "
                                            "nodes.; fit received batch_size 64"):
        run.fit(x, y, batch_size=64, shuffle=False)
    # A short last batch with fewer examples than virtual nodes trains (those without
    # examples add nothing: tests/runtime/test_short_last_batch.py), but not where batch
    # normalization computes each virtual node's own statistics.
    model = small_mlp.mlp_with_batch_norm()
    strategy = builders.AllReduce().build(autodist.capture(model), spec).with_virtual_nodes(32, 4)
    run = autodist.distribute(model, strategy, spec)
    with pytest.raises(AutodistError, match=r"the last batch of an epoch has 2 examples .66 "
                       r"examples, batch 32., fewer than 4 \(one for each of the 4 virtual nodes "
                       r"or replicas that split it: batch normalization layer\(s\) \['"):
        run.fit(x[:66], y[:66], shuffle=False)
