"""Elastic resizing with several replicas per worker task (as on multi-GPU nodes).

2 worker tasks with 2 replicas each (logical CPU devices,
`ResourceSpec.local(cpu_replicas_per_worker=2)`), global batch 32 on 4
virtual nodes, go 2 -> 1 -> 2 tasks mid-run (4 -> 2 -> 4 replicas): with
all-reduce on a `resize_at` schedule, and with parameter servers on a
callback's `run.resize(n)`. Every step's loss and the final weights equal
single-device Keras with batch 32 within 2e-5. With batch normalization and
dropout (per-virtual-node statistics and seed generators, which move with
their virtual node between the tasks' replicas) the resized run equals a
one-device run of the same 4 virtual nodes.
"""
from __future__ import annotations

import numpy as np
import pytest

import keras
import autodist
from autodist.ir.errors import AutodistError
from autodist.runtime import elastic
from autodist.search import builders
from tests import small_mlp
from tests.doubles import ResizeAfterEpochs
from tests.runtime.test_replicas_per_task import keras_steps

TOLERANCE = 2e-5
EXAMPLES, BATCH, EPOCHS, NODES = 96, 32, 3, 4


def _spec(ps: int = 0):
    return autodist.ResourceSpec.local(workers=2, ps=ps, cpu_replicas_per_worker=2)


def _check_equals_keras(model, history, reference):
    want_losses, want_weights = reference
    np.testing.assert_allclose(history.step_losses, want_losses, rtol=0, atol=TOLERANCE)
    for got, want in zip(model.get_weights(), want_weights):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


@pytest.mark.cluster
def test_two_replica_tasks_resized_on_a_schedule_equal_keras(tmp_path):
    x, y = small_mlp.data(EXAMPLES)
    model = small_mlp.mlp()
    reference = keras_steps(model, x, y, BATCH, EPOCHS * EXAMPLES // BATCH)
    spec = _spec()
    strategy = builders.AllReduce().build(autodist.capture(model), spec) \
        .with_virtual_nodes(BATCH, NODES)
    assert len(strategy.replicas) == 4
    run = autodist.distribute(model, strategy, spec, job_dir=str(tmp_path / "job"),
                              step_timeout_s=60)
    history = run.fit(x, y, epochs=EPOCHS, shuffle=False, verbose=0,
                      resize_at={0: 2, 3: 1, 6: 2})
    assert [(r.step, tuple(r.members)) for r in history.resizes] == [(3, (0,)), (6, (0, 1))]
    _check_equals_keras(model, history, reference)


@pytest.mark.cluster
def test_two_replica_tasks_resized_by_a_callback_with_ps_equal_keras(tmp_path):
    x, y = small_mlp.data(EXAMPLES)
    model = small_mlp.mlp()
    reference = keras_steps(model, x, y, BATCH, EPOCHS * EXAMPLES // BATCH)
    spec = _spec(ps=1)
    strategy = builders.PS().build(autodist.capture(model), spec).with_virtual_nodes(BATCH, NODES)
    run = autodist.distribute(model, strategy, spec, job_dir=str(tmp_path / "job"),
                              step_timeout_s=60)
    history = run.fit(x, y, epochs=EPOCHS, shuffle=False, verbose=0, elastic=True,
                      callbacks=[ResizeAfterEpochs(run, {0: 1, 1: 2})])
    assert [(r.step, tuple(r.members)) for r in history.resizes] == [(3, (0,)), (6, (0, 1))]
    _check_equals_keras(model, history, reference)


def _bn_dropout_mlp():
    """Dense, batch normalization, dropout, dense: per-virtual-node state of both kinds
    (moving statistics, the dropout's seed generator)."""
    keras.utils.set_random_seed(4)
    inputs = keras.Input((20,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dropout(0.3, seed=5)(h)
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.cluster
def test_per_virtual_node_state_moves_between_the_tasks_replicas(tmp_path):
    # Ghost batch normalization is not Keras' (each virtual node normalizes its own
    # examples), so the resized run is compared with one device running the same 4
    # virtual nodes: wherever a virtual node runs (2 per replica on task 0 alone, 1
    # per replica on both tasks), its batch statistics and dropout masks are those of
    # its own rows. The moving statistics written back are virtual node 0's.
    x, y = small_mlp.data(EXAMPLES)

    def fit(spec, job, resize_at=None):
        model = _bn_dropout_mlp()
        strategy = builders.AllReduce().build(autodist.capture(model), spec) \
            .with_virtual_nodes(BATCH, NODES).with_batch_norm("ghost")
        run = autodist.distribute(model, strategy, spec, job_dir=str(tmp_path / job),
                                  step_timeout_s=60)
        history = run.fit(x, y, epochs=EPOCHS, shuffle=False, verbose=0, resize_at=resize_at)
        return model, history

    fixed, fixed_history = fit(autodist.ResourceSpec.local(workers=1), "fixed")
    model, history = fit(_spec(), "resized", resize_at={0: 2, 4: 1, 7: 2})
    np.testing.assert_allclose(history.step_losses, fixed_history.step_losses, rtol=0,
                               atol=TOLERANCE)
    names = [w.path for w in model.weights]
    assert any("moving_mean" in n for n in names)
    for name, got, want in zip(names, model.get_weights(), fixed.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE, err_msg=name)


# ------------------------------------------------------------ rules (no cluster)
def test_strategy_for_keeps_every_replica_of_the_members(mlp_item):
    spec = _spec()
    strategy = builders.AllReduce().build(mlp_item, spec).with_virtual_nodes(BATCH, NODES)
    elastic.check_elastic(strategy, spec)
    one = elastic.strategy_for(strategy, (0,))
    w0 = strategy.replicas[:2]
    assert one.replicas == w0
    assert one.virtual_node_devices == [w0[0], w0[0], w0[1], w0[1]]
    assert (one.global_batch_size, one.num_virtual_nodes) == (BATCH, NODES)


def test_resizing_refuses_fewer_virtual_nodes_than_replicas(mlp_item):
    spec = _spec()
    strategy = builders.AllReduce().build(mlp_item, spec)
    # Two virtual nodes mapped by hand onto the first task's replicas only.
    two = strategy.with_virtual_nodes(BATCH, 2, strategy.replicas[:2])
    with pytest.raises(AutodistError, match=r"V=2 virtual nodes cannot cover the 4 replicas "
                                            r"of all worker tasks"):
        elastic.check_elastic(two, spec)


def test_resizing_refuses_unequal_replicas_per_task(mlp_item):
    spec = _spec()
    strategy = builders.AllReduce().build(mlp_item, spec)
    three = strategy.with_replicas(strategy.replicas[:3], global_batch_size=36,
                                   num_virtual_nodes=3 * 2)
    with pytest.raises(AutodistError, match=r"same number of replicas on each worker task; "
                                            r"the strategy has \{0: 2, 1: 1\}"):
        elastic.check_elastic(three, spec)
