"""Elastic resizing between batches, on real clusters, and its schedule rules.

A run resized 2 -> 4 -> 1 workers (global batch 32, 4 virtual nodes) keeps its
processes and takes the chief's state at each change: its per-step losses
equal a fixed 2-worker run's and its weights equal Keras `fit` with batch 32
within 2e-5 (observed <= 6e-8). With parameter servers and Adam on sparse
gradients (slots handed over), and with batch-norm statistics (per virtual
node, moved with their virtual node), the same holds.
"""
from __future__ import annotations

import numpy as np
import pytest

import keras
import autodist
from autodist import models
from autodist.ir.errors import AutodistError
from autodist.runtime import elastic
from autodist.search import builders
from tests import small_mlp
from tests.doubles import ResizeAfterEpochs

TOLERANCE = 2e-5
EXAMPLES, BATCH, EPOCHS = 96, 32, 3


def _fit(model, builder, spec, x, y, job_dir, resize_at=None, nodes=4):
    strategy = builder.build(autodist.capture(model), spec).with_virtual_nodes(BATCH, nodes)
    run = autodist.distribute(model, strategy, spec, job_dir=job_dir, step_timeout_s=60)
    return run.fit(x, y, epochs=EPOCHS, shuffle=False, verbose=0, resize_at=resize_at)


@pytest.mark.cluster
def test_resized_run_follows_the_fixed_size_trajectory(tmp_path):
    x, y = small_mlp.data(EXAMPLES)
    expected = small_mlp.keras_weights(small_mlp.mlp(), x, y, BATCH, EPOCHS)
    fixed = _fit(small_mlp.mlp(), builders.AllReduce(), autodist.ResourceSpec.local(workers=2),
                 x, y, str(tmp_path / "fixed"))
    model = small_mlp.mlp()
    resized = _fit(model, builders.AllReduce(), autodist.ResourceSpec.local(workers=4), x, y,
                   str(tmp_path / "resized"), resize_at={0: 2, 3: 4, 6: 1})
    np.testing.assert_allclose(resized.step_losses, fixed.step_losses, rtol=0, atol=TOLERANCE)
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    assert [(r.step, r.workers) for r in resized.resizes] == [(3, 4), (6, 1)]
    assert all(r.seconds > 0 for r in resized.resizes)


@pytest.mark.cluster
def test_resize_with_ps_and_sparse_adam(tmp_path):
    model = models.embedding_model(num_users=50, num_items=71, dim=8, optimizer="adam")
    rng = np.random.default_rng(1)
    x = [rng.integers(0, 50, (EXAMPLES, 1)).astype("int32"),
         rng.integers(0, 71, (EXAMPLES, 1)).astype("int32")]
    y = rng.integers(0, 2, (EXAMPLES, 1)).astype("float32")
    expected = small_mlp.keras_weights(model, x, y, BATCH, EPOCHS)
    _fit(model, builders.PartitionedPS(min_shard_bytes=64), autodist.ResourceSpec.local(
        workers=3, ps=1), x, y, str(tmp_path / "job"), resize_at={0: 3, 2: 1, 5: 2})
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


@pytest.mark.cluster
def test_resize_moves_batch_norm_statistics_with_their_virtual_nodes(tmp_path):
    x, y = models.synthetic_data(models.cnn(image_size=8), EXAMPLES, seed=2)
    fixed_model = models.cnn(image_size=8, optimizer="sgd")
    _fit(fixed_model, builders.AllReduce(), autodist.ResourceSpec.local(workers=1), x, y,
         str(tmp_path / "fixed"), nodes=2)
    model = models.cnn(image_size=8, optimizer="sgd")
    _fit(model, builders.AllReduce(), autodist.ResourceSpec.local(workers=2), x, y,
         str(tmp_path / "resized"), resize_at={0: 2, 4: 1, 7: 2}, nodes=2)
    names = [w.path for w in model.weights]
    assert any("moving_mean" in n for n in names)
    for name, got, want in zip(names, model.get_weights(), fixed_model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE, err_msg=name)


# ------------------------------------------------------------ schedule rules
def test_segments():
    everyone = (0, 1, 2, 3)
    assert elastic.segments(9, 4, None) == [elastic.Segment(0, 0, 9, everyone)]
    assert elastic.segments(9, 4, {3: 4, 0: 2, 6: 1}) == [
        elastic.Segment(0, 0, 3, (0, 1)), elastic.Segment(1, 3, 6, everyone),
        elastic.Segment(2, 6, 9, (0,))]
    # Without step 0 the run starts on every worker.
    assert elastic.segments(5, 3, {"2": 1}) == [elastic.Segment(0, 0, 2, (0, 1, 2)),
                                                elastic.Segment(1, 2, 5, (0,))]
    # Members by task: a count keeps the members, dropping the last or adding idle ones.
    assert elastic.segments(9, 4, {0: [0, 2, 3], 3: 2, 6: 3}) == [
        elastic.Segment(0, 0, 3, (0, 2, 3)), elastic.Segment(1, 3, 6, (0, 2)),
        elastic.Segment(2, 6, 9, (0, 1, 2))]
    assert elastic.segments(9, 4, {0: (3, 0)})[0].members == (0, 3)
    with pytest.raises(AutodistError, match="resize_at step 9 is outside the run's steps 0..8"):
        elastic.segments(9, 4, {9: 2})
    with pytest.raises(AutodistError, match=r"resize_at\[3\] must be a number of workers in "
                                            r"1..4 .*Received: 5"):
        elastic.segments(9, 4, {3: 5})


def test_strategy_for_remaps_virtual_nodes(mlp_item):
    spec = autodist.ResourceSpec.local(workers=4, ps=1)
    strategy = builders.PS().build(mlp_item, spec).with_virtual_nodes(48, 6)
    elastic.check_elastic(strategy, spec)
    two = elastic.strategy_for(strategy, (0, 1))
    w0, w1 = strategy.replicas[:2]
    assert two.replicas == [w0, w1]
    assert two.virtual_node_devices == [w0, w0, w0, w1, w1, w1]
    assert two.global_batch_size == 48 and two.variables == strategy.variables
    w2, w3 = strategy.replicas[2:]
    gap = elastic.strategy_for(strategy, (0, 2, 3))
    assert gap.replicas == [w0, w2, w3]
    assert gap.virtual_node_devices == [w0, w0, w2, w2, w3, w3]
    assert elastic.strategy_for(strategy, (0, 1, 2, 3)) is strategy


@pytest.mark.parametrize("members, message", [
    ([0, 4], r"names unknown worker tasks \[4\]; the spec has worker tasks 0..3"),
    ([0, 2, 2], r"repeats worker tasks \[2\]. Received: \[0, 2, 2\]"),
    ([1, 2], r"must include the chief \(worker task 0\).*Received: \[1, 2\]"),
    ([0, "1"], r"must be worker task indices \(integers\). Received: \[0, '1'\]"),
    ("01", r"must be a sequence of worker task indices. Received: '01'"),
    (list(range(10**6)), r"names unknown worker tasks \[4\]"),
])
def test_bad_members(members, message):
    with pytest.raises(AutodistError, match=r"resize_at\[2\] " + message):
        elastic.segments(9, 4, {2: members})


def test_check_elastic_rejects_a_strategy_without_virtual_nodes(mlp_item):
    spec = autodist.ResourceSpec.local(workers=4, ps=1)
    with pytest.raises(AutodistError, match="needs a strategy with virtual nodes"):
        elastic.check_elastic(builders.PS().build(mlp_item, spec), spec)


def test_check_elastic_rejects_async_and_leaving_ps(mlp_item):
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    asynchronous = builders.PS(sync=False).build(mlp_item, spec).with_virtual_nodes(32, 2)
    with pytest.raises(AutodistError, match="asynchronously; resizing needs synchronous"):
        elastic.check_elastic(asynchronous, spec)
    on_workers = autodist.ResourceSpec.local(workers=2)
    balanced = builders.PSLoadBalancing().build(mlp_item, on_workers).with_virtual_nodes(32, 2)
    with pytest.raises(AutodistError, match="lives on /job:worker/task:1/device:CPU:0, a worker "
                                            "that may leave"):
        elastic.check_elastic(balanced, on_workers)


def test_fit_checks_the_schedule_before_launching():
    model = small_mlp.mlp()
    spec = autodist.ResourceSpec.local(workers=2)
    strategy = builders.AllReduce().build(autodist.capture(model), spec)
    x, y = small_mlp.data(EXAMPLES)
    run = autodist.distribute(model, strategy, spec)
    with pytest.raises(AutodistError, match="needs a strategy with virtual nodes"):
        run.fit(x, y, batch_size=BATCH, resize_at={1: 1}, shuffle=False)
    run = autodist.distribute(model, strategy.with_virtual_nodes(BATCH, 2), spec)
    with pytest.raises(AutodistError, match="resize_at step 3 is outside the run's steps 0..2"):
        run.fit(x, y, resize_at={3: 1}, shuffle=False)


@pytest.mark.cluster
def test_resize_requested_by_a_callback(tmp_path):
    # Asked for in on_epoch_end, a resize starts exactly at the next epoch's
    # first step (the workers are all waiting at the run limit).
    x, y = small_mlp.data(EXAMPLES)
    expected = small_mlp.keras_weights(small_mlp.mlp(), x, y, BATCH, EPOCHS)
    model = small_mlp.mlp()
    spec = autodist.ResourceSpec.local(workers=4)
    strategy = builders.AllReduce().build(autodist.capture(model), spec)
    run = autodist.distribute(model, strategy.with_virtual_nodes(BATCH, 4), spec,
                              job_dir=str(tmp_path / "job"), step_timeout_s=60)
    history = run.fit(x, y, epochs=EPOCHS, shuffle=False, verbose=0, resize_at={0: 2},
                      elastic=True, callbacks=[ResizeAfterEpochs(run, {0: 4, 1: 1})])
    assert [(r.step, r.workers) for r in history.resizes] == [(3, 4), (6, 1)]
    assert len(history.step_losses) == EPOCHS * EXAMPLES // BATCH
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


def test_resize_outside_an_elastic_fit():
    model = small_mlp.mlp()
    spec = autodist.ResourceSpec.local(workers=2)
    strategy = builders.AllReduce().build(autodist.capture(model), spec)
    run = autodist.distribute(model, strategy.with_virtual_nodes(BATCH, 2), spec)
    with pytest.raises(AutodistError, match="works while fit.*elastic=True"):
        run.resize(1)
    x, y = small_mlp.data(EXAMPLES)
    with pytest.raises(AutodistError, match="elastic=True resizes on request from a callback"):
        run.fit(x, y, elastic=True, shuffle=False)
    with pytest.raises(AutodistError, match="only give the starting size"):
        run.fit(x, y, resize_at={1: 1}, callbacks=[keras.callbacks.Callback()], shuffle=False)
