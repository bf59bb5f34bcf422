"""The gradient noise scale measured inside a distributed step equals NumPy's.

2 workers x 2 virtual nodes of 8 examples (global batch 32). At step 0 the
weights are the model's initial ones, so each virtual node's and replica's
gradient is Keras' gradient of the same examples (computed eagerly here);
the least-squares fit of |g_b|^2 = |G|^2 + tr(Σ)/b over those six norms must
give the same |G|^2 and tr(Σ) as History.noise_scale (rtol 1e-4).
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import keras
import autodist
from autodist import models
from autodist.kernels import monitoring
from autodist import policies
from autodist.runtime.run import AutodistError
from autodist.search import builders


def _mlp():
    return models.mlp(input_dim=20, hidden=(16,), optimizer=keras.optimizers.SGD(0.1))


def _sq_norm(model, x, y) -> float:
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    return float(sum(np.sum(g.numpy().astype(np.float64) ** 2) for g in grads))


@pytest.mark.cluster
class _Recorder(policies.Policy):
    def __init__(self):
        self.metrics = []

    def on_step_end(self, metrics, control):
        self.metrics.append(metrics)


def test_noise_scale_equals_numpy_from_the_same_gradients(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 20)).astype("float32")
    y = rng.integers(0, 10, 64).astype("int32")
    model = _mlp()
    reference = models.single_device_twin(model)
    spec = autodist.ResourceSpec.local(workers=2)
    strategy = builders.AllReduce().build(autodist.capture(model), spec).with_virtual_nodes(32, 4)
    run = autodist.distribute(model, strategy, spec, job_dir=str(tmp_path / "job"))
    recorder = _Recorder()
    history = run.fit(x, y, epochs=1, shuffle=False, verbose=0, monitor_every=1,
                      policies=[recorder])
    assert [r.step for r in history.noise_scale] == [0, 1]
    # Step 0: virtual nodes read rows 0-7, 8-15 (worker 0) and 16-23, 24-31 (worker 1).
    batches, norms = [], []
    for replica in range(2):
        for vn in range(2):
            rows = slice(16 * replica + 8 * vn, 16 * replica + 8 * vn + 8)
            batches.append(8)
            norms.append(_sq_norm(reference, x[rows], y[rows]))
        rows = slice(16 * replica, 16 * replica + 16)
        batches.append(16)
        norms.append(_sq_norm(reference, x[rows], y[rows]))
    want = monitoring.noise_scale_fit(batches, norms)
    got = history.noise_scale[0]
    assert got.gradient_sq == pytest.approx(want.gradient_sq, rel=1e-4)
    assert got.trace_sigma == pytest.approx(want.trace_sigma, rel=1e-4)
    assert np.isfinite(history.noise_scale[1].smoothed)
    # The step's split, timed in the graph: the slowest task's local compute,
    # then the rest of the chief's step. The other worker may start its step
    # before the chief's clock does (on loaded cores, by more than its
    # compute), so the rest is clamped at zero rather than compared in time.
    for record, seconds in zip(history.noise_scale, history.step_times):
        assert record.compute_s > 0
        assert record.communication_s == pytest.approx(max(0.0, seconds - record.compute_s))
    # Policies see the same estimates live, step by step.
    live = recorder.metrics
    assert [m.step for m in live] == [0, 1]
    assert live[0].gradient_variance == pytest.approx(want.trace_sigma, rel=1e-4)
    assert live[1].noise_scale.noise_scale == pytest.approx(history.noise_scale[1].smoothed)
    assert live[0].compute_s == pytest.approx(got.compute_s)


def test_monitoring_needs_two_virtual_nodes_on_a_replica():
    model = _mlp()
    spec = autodist.ResourceSpec.local(workers=2)
    run = autodist.distribute(model, builders.AllReduce().build(autodist.capture(model), spec),
                              spec)
    x = np.zeros((32, 20), "float32")
    with pytest.raises(AutodistError, match="needs a replica with two or more virtual nodes"):
        run.fit(x, np.zeros(32, "int32"), batch_size=32, monitor_every=1, shuffle=False)
