"""Switching strategies mid-training, on real clusters, and its rules.

A run that switches at step boundaries between all-reduce (sparse gradients
all-gathered), partitioned parameter servers and whole-variable parameter
servers keeps its processes and takes the chief's state at each switch: its
weights equal Keras `fit` with the same batches within 2e-5, with Adam (slots
re-sharded at each switch) and sparse embedding gradients. The same holds for
a switch requested by a callback (`run.replan`) while the run goes.
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

TOLERANCE = 2e-5
EXAMPLES, BATCH, EPOCHS = 96, 32, 3


def _embedding_data():
    rng = np.random.default_rng(1)
    x = [rng.integers(0, 50, (EXAMPLES, 1)).astype("int32"),
         rng.integers(0, 71, (EXAMPLES, 1)).astype("int32")]
    return x, rng.integers(0, 2, (EXAMPLES, 1)).astype("float32")


@pytest.mark.cluster
def test_switch_keeps_the_weights_of_an_unswitched_run(tmp_path):
    model = models.embedding_model(num_users=50, num_items=71, dim=8, optimizer="adam")
    x, y = _embedding_data()
    expected = small_mlp.keras_weights(model, x, y, BATCH, EPOCHS)
    spec = autodist.ResourceSpec.local(workers=2, ps=2)
    item = autodist.capture(model)
    all_reduce = builders.AllReduce().build(item, spec)
    partitioned = builders.PartitionedPS(min_shard_bytes=64).build(item, spec)
    whole = builders.PS().build(item, spec)
    run = autodist.distribute(model, all_reduce, spec, graph_item=item,
                              job_dir=str(tmp_path / "job"), step_timeout_s=60)
    history = run.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                      switch_at={2: partitioned, 4: whole, 7: all_reduce})
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    assert [(r.step, r.plan) for r in history.resizes] == [(2, 1), (4, 2), (7, 3)]
    assert len(history.step_losses) == EPOCHS * EXAMPLES // BATCH


class _Replanner(keras.callbacks.Callback):
    """A policy: after epoch e, switch to plans[e]; at batch b of epoch 1, to inside."""

    def __init__(self, run, plans, inside):
        super().__init__()
        self.run, self.plans, self.inside = run, plans, inside
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 1 and batch == 0:
            self.run.replan(self.inside)

    def on_epoch_end(self, epoch, logs=None):
        if epoch in self.plans:
            self.run.replan(self.plans[epoch])


@pytest.mark.cluster
def test_replan_requested_by_a_callback(tmp_path):
    x, y = small_mlp.data(EXAMPLES)
    expected = small_mlp.keras_weights(small_mlp.mlp(), x, y, BATCH, EPOCHS)
    model = small_mlp.mlp()
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    item = autodist.capture(model)
    all_reduce = builders.AllReduce().build(item, spec).with_virtual_nodes(BATCH, 4)
    ps = builders.PS().build(item, spec).with_virtual_nodes(BATCH, 4)
    run = autodist.distribute(model, all_reduce, spec, graph_item=item,
                              job_dir=str(tmp_path / "job"), step_timeout_s=60)
    history = run.fit(x, y, epochs=EPOCHS, shuffle=False, verbose=0, elastic=True,
                      callbacks=[_Replanner(run, {0: ps}, inside=all_reduce)])
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    # From on_epoch_end: the next epoch's first step; inside an epoch: one
    # step ahead of the chief at the earliest (the driver learns late).
    steps = [(r.step, r.plan) for r in history.resizes]
    assert steps[0] == (3, 1)
    assert len(steps) == 2 and steps[1][1] == 0 and 4 < steps[1][0] <= 6


# ------------------------------------------------------------------- rules
def test_segments_with_switches():
    assert elastic.segments(9, 2, None, {3: 1, 6: 2}) == [
        elastic.Segment(0, 0, 3, (0, 1), 0), elastic.Segment(1, 3, 6, (0, 1), 1),
        elastic.Segment(2, 6, 9, (0, 1), 2)]
    # Resizes and switches merge; each keeps its value until it changes.
    assert elastic.segments(9, 4, {0: 2, 5: 4}, {3: 1}) == [
        elastic.Segment(0, 0, 3, (0, 1), 0), elastic.Segment(1, 3, 5, (0, 1), 1),
        elastic.Segment(2, 5, 9, (0, 1, 2, 3), 1)]
    with pytest.raises(AutodistError, match="switch_at step 0 is outside the run's steps 1..8"):
        elastic.segments(9, 2, None, {0: 1})


def test_check_switch(mlp_item):
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    base = builders.AllReduce().build(mlp_item, spec)
    elastic.check_switch(base, builders.PS().build(mlp_item, spec), mlp_item, spec)
    with pytest.raises(AutodistError, match="asynchronously"):
        elastic.check_switch(base, builders.PS(sync=False).build(mlp_item, spec), mlp_item, spec)
    with pytest.raises(AutodistError, match=r"keep the global batch.*Run: B=None, V=2; "
                                            r"new: B=32, V=4"):
        elastic.check_switch(base, base.with_virtual_nodes(32, 4), mlp_item, spec)


def test_fit_and_replan_check_the_strategies():
    model = small_mlp.mlp()
    spec = autodist.ResourceSpec.local(workers=2)
    item = autodist.capture(model)
    strategy = builders.AllReduce().build(item, spec)
    x, y = small_mlp.data(EXAMPLES)
    run = autodist.distribute(model, strategy, spec, graph_item=item)
    with pytest.raises(AutodistError, match="must keep the global batch"):
        run.fit(x, y, batch_size=BATCH, switch_at={1: strategy.with_virtual_nodes(BATCH, 2)},
                shuffle=False)
    with pytest.raises(AutodistError, match=r"switch_at\[1\] must be a Strategy"):
        run.fit(x, y, batch_size=BATCH, switch_at={1: "PS"}, shuffle=False)
    with pytest.raises(AutodistError, match="replan\\(strategy\\) works while fit"):
        run.replan(strategy)
    one = builders.AllReduce().build(item, autodist.ResourceSpec.local(workers=1))
    with pytest.raises(AutodistError, match="same replicas"):
        run.fit(x, y, batch_size=BATCH, switch_at={1: one}, shuffle=False)
