"""Several replicas per worker task (in-graph, as on a multi-GPU node), on CPU.

Each of 2 worker processes runs 2 replicas on logical CPU devices
(`ResourceSpec.local(cpu_replicas_per_worker=2)`), with 2 parameter-server
processes. Every builder, and PS, PartitionedPS and Parallax again with local
replication (one local copy per task and PS shard, read by both its
replicas), trains {MLP, two-embedding NCF, small Transformer} and must equal
single-device Keras on the same global batches: the loss of every step and
the final weights within 2e-5 (float32 sums in another order).

To keep it to one cluster launch per model, the strategies take turns in one
run (`switch_at`, every 2 steps; each strategy builds its own program and
starts from the previous one's state in memory), so a wrong strategy shows
as a wrong loss from its first step on; a strategy equal to an earlier one
is skipped. 90 examples in global batches of 32: 3 steps per epoch, the last
of 26 examples, split 7/7/6/6 over the replicas.

Mixed PS and all-reduce strategies need parameter-server tasks of their own
here: with the PS variables on worker tasks (`ps=0`) their steps fail in
TensorFlow ("ValidateDevices called before initialization"), with one
replica per task as well.
"""
from __future__ import annotations

import numpy as np
import pytest

import autodist
from autodist import models
from autodist.search import builders
from tests.runtime.test_distributed_training import BUILDERS, _data, _model

pytestmark = pytest.mark.cluster

TOLERANCE = 2e-5
BATCH = 32
STEPS_PER_STRATEGY = 2
# Whole, partitioned and (Parallax) sparse-only PS variables again, each task's
# replicas reading one local copy per PS shard. (PSLoadBalancing and
# UnevenPartitionedPS place and size shards otherwise, with the same copies.)
LOCAL_REPLICATION = {
    "PS+local": lambda: builders.PS(local_replication=True),
    "PartitionedPS+local": lambda: builders.PartitionedPS(local_replication=True,
                                                          min_shard_bytes=64),
    "Parallax+local": lambda: builders.Parallax(local_replication=True, min_shard_bytes=64),
}
STRATEGIES = {**BUILDERS, **LOCAL_REPLICATION}


def _spec():
    return autodist.ResourceSpec.local(workers=2, ps=2, cpu_replicas_per_worker=2)


def distinct_strategies(item, spec) -> tuple[list[str], list]:
    """Each of STRATEGIES' strategies once (names of equal ones joined: "A = B")."""
    names, strategies = [], []
    for name, make in STRATEGIES.items():
        strategy = make().build(item, spec)
        ps_shards = [sh.ps for c in strategy.variables for sh in c.shards
                     if sh.WhichOneof("kind") == "ps"]
        assert all(ps.local_replication == name.endswith("+local") for ps in ps_shards), name
        same = next((i for i, s in enumerate(strategies)
                     if list(s.proto.variables) == list(strategy.proto.variables)), None)
        if same is None:
            names.append(name)
            strategies.append(strategy)
        else:
            names[same] += f" = {name}"
    return names, strategies


def keras_steps(model, x, y, batch: int, steps: int):
    """Single-device Keras on the same batches, in order: (losses of every step, weights)."""
    reference = models.single_device_twin(model)
    count = len(y)
    per_epoch = -(-count // batch)
    losses = []
    for step in range(steps):
        start = (step % per_epoch) * batch
        rows = slice(start, min(start + batch, count))
        xb = [part[rows] for part in x] if isinstance(x, list) else x[rows]
        losses.append(float(reference.train_on_batch(xb, y[rows])))
    return losses, reference.get_weights()


def check_steps_equal_keras(model, history, reference, names: list[str]):
    """Every step's loss and the final weights against Keras; names the strategy of a bad step.

    Args:
        model: The model `fit` trained (its weights are the trained ones).
        history: What `fit` returned.
        reference: `keras_steps` of the model before training.
        names: The strategy of every step.
    """
    want_losses, want_weights = reference
    assert len(history.step_losses) == len(want_losses)
    bad = [(i, names[i], got, want)
           for i, (got, want) in enumerate(zip(history.step_losses, want_losses))
           if abs(got - want) > TOLERANCE * max(1.0, abs(want))]
    assert not bad, f"steps whose loss differs from Keras (step, strategy, got, want): {bad}"
    for got, want in zip(model.get_weights(), want_weights):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


def check_every_builder(model_name: str, tmp_path, spec=None) -> None:
    """Every distinct strategy of STRATEGIES, 2 steps each, in one run; equal to Keras.

    Args:
        model_name: "mlp", "ncf" or "transformer".
        tmp_path: Where the job directory goes.
        spec: The cluster (default: 2 tasks x 2 CPU replicas, 2 PS tasks).
    """
    model = _model(model_name)
    x, y = _data(model_name)
    spec = spec or _spec()
    item = autodist.capture(model)
    names, strategies = distinct_strategies(item, spec)
    steps = STEPS_PER_STRATEGY * len(names)
    epochs = -(-steps // 3)
    reference = keras_steps(model, x, y, BATCH, epochs * 3)
    run = autodist.distribute(model, strategies[0], spec, graph_item=item,
                              job_dir=str(tmp_path / "job"), step_timeout_s=60)
    history = run.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                      switch_at={STEPS_PER_STRATEGY * i: s
                                 for i, s in enumerate(strategies) if i})
    names = [names[min(i // STEPS_PER_STRATEGY, len(names) - 1)] for i in range(epochs * 3)]
    check_steps_equal_keras(model, history, reference, names)


@pytest.mark.parametrize("model_name", ["mlp", "ncf"])
def test_every_builder_on_two_replicas_per_task_equals_single_device(model_name, tmp_path):
    # The Transformer: test_replicas_per_task_transformer.py (a file stays under ~5 minutes).
    assert len(_spec().replica_devices) == 4
    check_every_builder(model_name, tmp_path)


def test_virtual_nodes_on_replicas_of_a_task_equal_single_device(tmp_path):
    """8 virtual nodes of 4 examples on the 4 replicas (2 each, run one after the other)."""
    model = _model("ncf")
    x, y = _data("ncf")
    spec = _spec()
    item = autodist.capture(model)
    names = ["AllReduce", "Parallax+local"]
    strategies = [STRATEGIES[n]().build(item, spec).with_virtual_nodes(BATCH, 8) for n in names]
    assert strategies[0].virtual_node_devices == [d for d in strategies[0].replicas
                                                  for _ in range(2)]
    reference = keras_steps(model, x, y, BATCH, 6)
    run = autodist.distribute(model, strategies[0], spec, graph_item=item,
                              job_dir=str(tmp_path / "job"), step_timeout_s=60)
    history = run.fit(x, y, epochs=2, shuffle=False, verbose=0,
                      switch_at={STEPS_PER_STRATEGY: strategies[1]})
    check_steps_equal_keras(model, history, reference, [names[0]] * 2 + [names[1]] * 4)
