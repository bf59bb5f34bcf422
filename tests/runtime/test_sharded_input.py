"""fit on a ShardedDataset: each worker task reads only its share of every global batch.

The cluster tests compare with single-device Keras trained, step by step, on
the global batches the shards make together (each step's shard elements
concatenated in worker-task order), weights to 2e-5.
"""
from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import autodist
from autodist import models
from autodist.launch.job import DatasetFiles, JobDir
from autodist.runtime.run_config import RunConfig
from autodist.runtime import sharded_input
from autodist.runtime.batching import dataset_epochs
from autodist.runtime.dataset_stream import DatasetStream
from autodist.runtime.datasets import DatasetError
from autodist.runtime.sharded_input import InputShard, ShardedDataset

TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def mlp_8():
    model = models.mlp(input_dim=8, hidden=(16,), classes=3)
    spec = autodist.ResourceSpec.local(workers=2)
    graph_item = autodist.capture(model)
    return model, graph_item, spec, autodist.builders.AllReduce().build(graph_item, spec)


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8)).astype("float32"), rng.integers(0, 3, n).astype("int32")


def _by_shard(x, y, weights=None, seed=7, repeat=False):
    """Shard i of n: examples i, i + n, ... shuffled (seeded, anew each pass), scaled in a
    map, batched by the shard's share."""
    def make(shard: InputShard):
        parts = (x, y) if weights is None else (x, y, weights)
        ds = tf.data.Dataset.from_tensor_slices(parts).shard(shard.count, shard.index)
        ds = ds.shuffle(64, seed=seed + shard.index).map(
            lambda a, *rest: (a * 2.0, *rest))
        if repeat:
            ds = ds.repeat()
        return ds.batch(shard.batch_size, drop_remainder=True)
    return make


def test_each_task_holds_its_virtual_nodes_rows(mlp_8):
    _, _, _, strategy = mlp_8
    rows = sharded_input.task_rows(strategy, 10, 2)
    assert [r.tolist() for r in rows] == [list(range(5)), list(range(5, 10))]
    # 3 virtual nodes on 2 replicas (0, 0, 1): the first task holds two thirds.
    uneven = strategy.with_virtual_nodes(12, 3)
    assert [len(r) for r in sharded_input.task_rows(uneven, 12, 2)] == [8, 4]
    # Mapped by hand, not contiguously: task 0 holds parts 0 and 2.
    devices = uneven.replicas
    interleaved = strategy.with_virtual_nodes(12, 3, [devices[0], devices[1], devices[0]])
    assert [r.tolist() for r in sharded_input.task_rows(interleaved, 12, 2)] == [
        [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7]]


def test_each_shard_is_built_for_its_task_and_read_by_it_alone(mlp_8, tmp_path):
    _, graph_item, _, strategy = mlp_8
    strategy = strategy.with_virtual_nodes(12, 3)
    x, y = _data(48)
    seen = []

    def make(shard):
        seen.append(shard)
        return _by_shard(x, y)(shard).take(3)   # as many batches on either shard

    prepared = sharded_input.prepare(ShardedDataset(make), graph_item, strategy, 2,
                                     steps_per_epoch=None, epochs=2)
    assert seen == [InputShard(0, 2, 0, 8, 12), InputShard(1, 2, 1, 4, 12)]
    assert prepared.global_batch_size == 12 and prepared.epoch_steps == [3, 3]
    # The job holds each task's graph; a shipped copy too.
    files = DatasetFiles(b"", prepared.description.to_json(), prepared.graphs)
    job = JobDir(tmp_path / "job")
    job.write(graph_item, strategy, autodist.ResourceSpec.local(workers=2),
              RunConfig(global_batch_size=12, epochs=2), {}, [], None, files)
    assert sorted(p.name for p in (job.path / "data").iterdir()) == [
        "dataset.json", "dataset_shard_0.pb", "dataset_shard_1.pb"]
    assert job.dataset() == files
    job.write_ports([1, 2])
    assert JobDir.unpack(job.pack(), tmp_path / "shipped").dataset() == files
    # Task 1 reads its own shard: 4 rows (8..11) of each global batch of 12.
    rows = sharded_input.task_rows(strategy, 12, 2)[1]
    stream = DatasetStream(files, RunConfig(global_batch_size=12, epochs=2), graph_item,
                           strategy.num_virtual_nodes, strategy.global_batch_size,
                           held_rows=rows, task=1)
    want = _reads(_by_shard(x, y)(seen[1]).take(3), epochs=2, steps=None)
    try:
        for step in range(6):
            batch = stream.batch(step)
            assert batch.size == 12 and batch.held_rows.tolist() == [8, 9, 10, 11]
            np.testing.assert_array_equal(batch.inputs[0], want[step][0].numpy())
    finally:
        stream.close()


@pytest.mark.parametrize("make,message", [
    (lambda x, y: lambda shard: np.zeros(3), "returned ndarray.*must return a tf.data.Dataset"),
    (lambda x, y: lambda shard: _by_shard(x, y)(shard).filter(lambda *e: True),
     "unknown length.*assert_cardinality.*repeat"),
    (lambda x, y: lambda shard: _by_shard(x, y)(shard).take(2 + shard.index),
     "same number of batches per pass; worker task 0's has 2, worker task 1's 3"),
    (lambda x, y: lambda shard: tf.data.Dataset.from_tensor_slices((x, y)).batch(
        5, drop_remainder=True),
     "shard 0's batches .worker task 0. have 5 examples; its share of the global batch "
     "of 12 is 6"),
    (lambda x, y: lambda shard: _by_shard(x, y, repeat=True)(shard), "infinite.*steps_per_epoch"),
])
def test_shards_that_cannot_be_read_in_step_are_refused(mlp_8, make, message):
    _, graph_item, _, strategy = mlp_8
    x, y = _data(48)
    with pytest.raises(DatasetError, match=message):
        sharded_input.prepare(ShardedDataset(make(x, y), global_batch_size=12), graph_item,
                              strategy, 2, steps_per_epoch=None, epochs=1)


def test_the_global_batch_must_be_known_and_agree(mlp_8):
    _, graph_item, _, strategy = mlp_8
    x, y = _data(48)
    with pytest.raises(DatasetError, match="needs the global batch"):
        sharded_input.prepare(ShardedDataset(_by_shard(x, y)), graph_item, strategy, 2,
                              steps_per_epoch=None, epochs=1)
    with pytest.raises(DatasetError, match="fixes the global batch at 12.*asks for 10"):
        sharded_input.prepare(ShardedDataset(_by_shard(x, y), global_batch_size=10),
                              graph_item, strategy.with_virtual_nodes(12, 2), 2,
                              steps_per_epoch=None, epochs=1)
    with pytest.raises(autodist.AutodistError, match="global_batch_size must be an integer"):
        ShardedDataset(_by_shard(x, y), global_batch_size=0)
    with pytest.raises(autodist.AutodistError, match="needs a function"):
        ShardedDataset("data/*.tfrecord")


@pytest.mark.parametrize("options,message", [
    ({"elastic": True, "callbacks": [keras.callbacks.Callback()]},
     "elastic=True cannot work with a ShardedDataset"),
    ({"resize_at": {2: 1}}, "resize_at cannot work"),
    ({"on_failure": "continue"}, "on_failure='continue' cannot work"),
    ({"policies": [autodist.policies.ScheduledResize({2: 1})]}, "policies .* cannot work"),
    ({"batch_size": 12}, "pass neither y, sample_weight nor batch_size"),
    ({"validation_split": 0.2}, "validation_split needs arrays"),
])
def test_fit_refuses_what_fixed_shares_cannot_do_before_launch(mlp_8, options, message):
    model, graph_item, spec, strategy = mlp_8
    x, y = _data(48)
    run = autodist.distribute(model, strategy.with_virtual_nodes(12, 2), spec,
                              graph_item=graph_item)
    with pytest.raises(autodist.AutodistError, match=message):
        run.fit(ShardedDataset(_by_shard(x, y)), verbose=0, **options, shuffle=False)


def _global_batches(make, strategy, shards: int, epochs: int, steps: int | None = None):
    """Each step's global batch: the shards' elements of that step, in task order."""
    per_shard = [_reads(make(shard), epochs, steps) for shard in _shards(strategy, shards)]
    return [[np.concatenate([p[k].numpy() for p in parts]) for k in range(len(parts[0]))]
            for parts in zip(*per_shard)]


def _reads(dataset, epochs: int, steps: int | None) -> list:
    """A shard's elements as a worker reads them: as Keras' fit reads a dataset (new
    passes, each drawing new shuffles, where Keras starts them; `batching.dataset_epochs`
    is checked against Keras in test_datasets.py)."""
    cardinality = int(dataset.cardinality())
    plan = dataset_epochs(cardinality if cardinality >= 0 else None, True, steps, epochs)
    reads, created, iterator = [], 0, None
    for epoch in plan:
        while created <= epoch.iterator:
            iterator, created = iter(dataset), created + 1
        reads += [next(iterator) for _ in range(epoch.steps)]
    return reads


def _keras_step(model, x, y, weights=None) -> float:
    """One Keras step on a global batch; its loss (before the update, as ours)."""
    model.reset_metrics()
    return float(model.train_on_batch(x, y, sample_weight=weights, return_dict=True)["loss"])


def _shards(strategy, count):
    batch = strategy.global_batch_size
    rows = sharded_input.task_rows(strategy, batch, count)
    return [InputShard(t, count, t, len(rows[t]), batch) for t in range(count)]


@pytest.mark.cluster
def test_sharded_reading_with_uneven_virtual_nodes_and_sample_weights_equals_keras():
    """All-reduce on 2 workers, 3 virtual nodes of a global batch of 12 (8 + 4 examples),
    per-example weights, 2 epochs each reshuffling its shards."""
    model = models.mlp(input_dim=8, hidden=(16,), classes=3, optimizer="adam")
    x, y = _data(36)
    weights = np.linspace(0.5, 2.0, 36).astype("float32")
    reference = models.single_device_twin(model)
    spec = autodist.ResourceSpec.local(workers=2)
    strategy = autodist.builders.AllReduce().build(autodist.capture(model), spec)
    strategy = strategy.with_virtual_nodes(12, 3)
    steps = 3

    def make(shard):   # shard 0: examples 0-23 (8 a step), shard 1: 24-35 (4 a step)
        start = 0 if shard.index == 0 else (shard.global_batch_size - shard.batch_size) * steps
        rows = slice(start, start + shard.batch_size * steps)
        return tf.data.Dataset.from_tensor_slices((x[rows], y[rows], weights[rows])).shuffle(
            32, seed=7 + shard.index).map(lambda a, b, w: (a * 2.0, b, w)).batch(
                shard.batch_size, drop_remainder=True)

    history = autodist.distribute(model, strategy, spec).fit(
        ShardedDataset(make), epochs=2, verbose=0, shuffle=False)
    losses = [_keras_step(reference, bx, by, bw)
              for bx, by, bw in _global_batches(make, strategy, 2, epochs=2)]
    assert len(history.step_losses) == len(losses) == 6
    np.testing.assert_allclose(history.step_losses, losses, rtol=1e-4)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


@pytest.mark.cluster
def test_sharded_tfrecord_files_repeated_with_steps_per_epoch_equal_keras_on_ps(tmp_path):
    """Each worker reads every other TFRecord file (shard by file, before the parsing map),
    repeated, 3 steps per epoch over 2 epochs; 2 workers + 1 PS, global batch 16. Then
    measure_throughput on the same shards."""
    model = models.mlp(input_dim=8, hidden=(16,), classes=3,
                       optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
    x, y = _data(64)
    paths = []
    for f in range(4):
        paths.append(str(tmp_path / f"part-{f}.tfrecord"))
        with tf.io.TFRecordWriter(paths[-1]) as writer:
            for i in range(f, 64, 4):
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x[i])),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y[i]]))})
                ).SerializeToString())
    features = {"x": tf.io.FixedLenFeature([8], tf.float32),
                "y": tf.io.FixedLenFeature([], tf.int64)}

    def make(shard):
        files = tf.data.Dataset.from_tensor_slices(paths).shard(shard.count, shard.index)
        records = files.interleave(tf.data.TFRecordDataset, cycle_length=1)

        def parse(record):
            example = tf.io.parse_single_example(record, features)
            return example["x"] * 2.0, example["y"]

        return records.map(parse).shuffle(32, seed=3).repeat().batch(shard.batch_size,
                                                                     drop_remainder=True)

    reference = models.single_device_twin(model)
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    strategy = autodist.builders.PSLoadBalancing().build(autodist.capture(model), spec)
    run = autodist.distribute(model, strategy, spec)
    history = run.fit(ShardedDataset(make, global_batch_size=16), epochs=2, steps_per_epoch=3,
                      verbose=0, shuffle=False)
    strategy16 = strategy.with_virtual_nodes(16, strategy.num_virtual_nodes)
    losses = [_keras_step(reference, bx, by)
              for bx, by in _global_batches(make, strategy16, 2, epochs=2, steps=3)]
    assert len(history.step_losses) == 6
    np.testing.assert_allclose(history.step_losses, losses, rtol=1e-4)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    # The replicas' speeds are measured on the shards too, without training.
    before = model.get_weights()
    speeds = run.measure_throughput(ShardedDataset(make, global_batch_size=16), steps=1)
    assert sorted(speeds) == sorted(strategy.replicas) and min(speeds.values()) > 0
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)


def test_a_worker_task_without_rows_is_refused(mlp_8):
    _, graph_item, _, _ = mlp_8
    one = autodist.builders.AllReduce().build(graph_item, autodist.ResourceSpec.local(workers=1))
    x, y = _data(48)
    with pytest.raises(DatasetError, match="worker task 1 trains on no rows"):
        sharded_input.prepare(ShardedDataset(_by_shard(x, y), global_batch_size=12), graph_item,
                              one, 2, steps_per_epoch=None, epochs=1)
