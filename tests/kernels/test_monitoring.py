"""Gradient-noise-scale statistics against NumPy computed from the same gradients."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import autodist
from autodist.kernels import monitoring, partitioner, replicator
from autodist.kernels.program import Program
from autodist.search import builders


def _without_devices(graph: tf.Graph) -> tf.Graph:
    """A copy of `graph` that runs here, without the cluster's devices."""
    graph_def = graph.as_graph_def()
    for node in graph_def.node:
        node.device = ""
    local = tf.Graph()
    with local.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    return local


def test_sq_norm_sums_repeated_sparse_rows():
    values = np.arange(12, dtype=np.float32).reshape(4, 3)
    indices = np.array([2, 0, 2, 5], np.int64)
    dense = np.zeros((6, 3), np.float32)
    np.add.at(dense, indices, values)
    extra = np.ones((2, 2), np.float32)
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        grad = tf.IndexedSlices(tf.constant(values), tf.constant(indices), tf.constant([6, 3]))
        got = session.run(monitoring.sq_norm([grad, tf.constant(extra)]))
    assert got == pytest.approx(float(np.sum(dense ** 2) + np.sum(extra ** 2)), rel=1e-6)


@pytest.mark.parametrize("model", ["mlp", "ncf"])
def test_replica_statistics_equal_numpy(model, mlp_item, ncf_item):
    graph_item = mlp_item if model == "mlp" else ncf_item
    spec = autodist.ResourceSpec.local(workers=1)
    strategy = builders.AllReduce().build(graph_item, spec).with_virtual_nodes(24, 4)
    program = Program(graph_item, spec, ("worker", 0))
    partitioner.apply(program, strategy)
    replicator.apply(program, strategy)
    (replica,) = program.replicas
    rng = np.random.default_rng(0)
    with program.graph.as_default():
        stats = monitoring.gradient_sq_norms(replica)
        dense = {
            "vn": [[tf.convert_to_tensor(g) for g in vn.gradients.values()]
                   for vn in replica.virtual_nodes],
            "replica": [tf.convert_to_tensor(g) for g in replica.gradients.values()]}
        assigns = [var.assign(rng.normal(scale=0.1, size=var.shape.as_list()).astype(np.float32),
                              read_value=False)
                   for name, var in program.storage.items() if "/slot/" not in name
                   and name.startswith(f"{replicator.SCOPE}/vars/")]
    local = _without_devices(program.graph)
    n = 24
    if model == "mlp":
        inputs = [rng.normal(size=(n, graph_item.inputs[0].shape[1])).astype(np.float32)]
        targets = rng.integers(0, 10, n).astype(np.int32)
    else:
        inputs = [rng.integers(0, 1000, (n, 1)).astype(np.int32),
                  rng.integers(0, 20011, (n, 1)).astype(np.int32)]
        targets = rng.integers(0, 2, (n, 1)).astype(np.float32)
    feed = {replica.sizes.name: [6, 6, 6, 6], replica.inputs["y"].name: targets}
    for info, array in zip([i for i in graph_item.inputs if i.role != "y"], inputs):
        feed[replica.inputs[info.name].name] = array
    names = tf.nest.map_structure(lambda t: t.name, {"stats": stats, "dense": dense})
    with tf.compat.v1.Session(graph=local) as session:
        session.run([a.name for a in assigns])
        got = session.run(names, feed)
    # Of each virtual node's mean-loss gradient: its gradients are weighted (6 of 24).
    assert all(vn.weighted for vn in replica.virtual_nodes)
    want_vn = [sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads) * 4 ** 2
               for grads in got["dense"]["vn"]]
    want_replica = sum(float(np.sum(g.astype(np.float64) ** 2))
                       for g in got["dense"]["replica"])
    np.testing.assert_allclose(got["stats"]["virtual_nodes"], want_vn, rtol=1e-5)
    assert got["stats"]["replica"] == pytest.approx(want_replica, rel=1e-5)


def test_noise_scale_recovers_a_known_noise():
    # Per-example gradients G + e, e ~ N(0, s^2 I): tr(Σ) = d s^2, B_noise = d s^2 / |G|^2.
    rng = np.random.default_rng(1)
    d, s, small, big, trials = 50, 2.0, 8, 64, 4000
    G = rng.normal(size=d)
    def mean_sq(b):
        means = G + rng.normal(scale=s, size=(trials, b, d)).mean(axis=1)
        return float(np.mean(np.sum(means ** 2, axis=1)))
    estimate = monitoring.noise_scale(mean_sq(small), small, mean_sq(big), big)
    assert estimate.gradient_sq == pytest.approx(float(G @ G), rel=0.05)
    assert estimate.trace_sigma == pytest.approx(d * s * s, rel=0.05)
    assert estimate.noise_scale == pytest.approx(d * s * s / float(G @ G), rel=0.08)


def test_noise_scale_exact_and_errors():
    # |G|^2 = 1, tr(Σ) = 8: E|g_b|^2 = 1 + 8/b.
    exact = monitoring.noise_scale(1 + 8 / 2, 2, 1 + 8 / 8, 8)
    assert (exact.gradient_sq, exact.trace_sigma, exact.noise_scale) == pytest.approx((1, 8, 8))
    with pytest.raises(ValueError, match="1 <= small_batch < big_batch"):
        monitoring.noise_scale(1.0, 8, 1.0, 8)
    # A noisy step can estimate |G|^2 <= 0: no finite noise scale.
    assert monitoring.noise_scale(5.0, 2, 1.0, 4).noise_scale == float("inf")


def test_smoothing_averages_each_term():
    smooth = monitoring.SmoothedNoiseScale(decay=0.5)
    first = smooth.update(monitoring.NoiseScale(2.0, 8.0, 4.0))
    assert (first.gradient_sq, first.trace_sigma, first.noise_scale) == (2.0, 8.0, 4.0)
    second = smooth.update(monitoring.NoiseScale(4.0, 4.0, 1.0))
    assert (second.gradient_sq, second.trace_sigma) == (3.0, 6.0)
    assert second.noise_scale == 2.0
    with pytest.raises(ValueError, match="decay must be in"):
        monitoring.SmoothedNoiseScale(decay=1.0)


def test_fit_equals_the_two_point_estimate():
    two = monitoring.noise_scale(1 + 8 / 2, 2, 1 + 8 / 8, 8)
    fit = monitoring.noise_scale_fit([2, 2, 8], [1 + 8 / 2, 1 + 8 / 2, 1 + 8 / 8])
    assert (fit.gradient_sq, fit.trace_sigma) == pytest.approx((two.gradient_sq, two.trace_sigma))
    assert monitoring.noise_scale_fit([4, 4], [1.0, 2.0]) is None


def test_step_timestamps_put_the_gradients_after_the_start_of_every_step(mlp_item):
    """The start is fed by the host before the run: a timestamp op with no inputs ran
    after the gradients in some steps (then the step had no compute time)."""
    import time

    spec = autodist.ResourceSpec.local(workers=1)
    strategy = builders.AllReduce().build(mlp_item, spec)
    program = Program(mlp_item, spec, ("worker", 0))
    partitioner.apply(program, strategy)
    replicator.apply(program, strategy)
    (replica,) = program.replicas
    with program.graph.as_default():
        update = tf.group(*[tf.convert_to_tensor(g) for g in replica.gradients.values()])
        times = monitoring.step_timestamps(program.replicas, update)
    local = _without_devices(program.graph)
    init = [op.name for op in local.get_operations() if op.type == "AssignVariableOp"]
    rng = np.random.default_rng(0)
    feed = {replica.inputs["y"].name: rng.integers(0, 10, 4).astype(np.int32)}
    x = next(i for i in mlp_item.inputs if i.role != "y")
    feed[replica.inputs[x.name].name] = rng.normal(size=(4, x.shape[1])).astype(np.float32)
    names = {k: t.name for k, t in times.items()}
    with tf.compat.v1.Session(graph=local) as session:
        session.run(init)
        marks = []
        for _ in range(300):
            feed[names["start"]] = time.time()
            marks.append(session.run(names, feed))
    bad = [(m["gradients"] - m["start"], m["end"] - m["gradients"]) for m in marks
           if not m["start"] < m["gradients"] <= m["end"]]
    assert not bad, bad[:5]
