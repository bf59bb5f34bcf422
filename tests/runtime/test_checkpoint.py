"""Checkpoints: written by the chief atomically under single-device names, read by plain
TensorFlow and Keras, and a run continued from one equals an uninterrupted run."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import autodist
from autodist import models
from autodist.runtime import checkpoint
from autodist.search import builders

pytestmark = pytest.mark.cluster


def _setup():
    model = models.embedding_model(num_users=50, num_items=71, dim=8, optimizer="adam")
    rng = np.random.default_rng(0)
    x = [rng.integers(0, 50, (90, 1)).astype("int32"),
         rng.integers(0, 71, (90, 1)).astype("int32")]
    y = rng.integers(0, 2, (90, 1)).astype("float32")
    spec = autodist.ResourceSpec.local(workers=2, ps=2)
    graph_item = autodist.capture(model)
    # Partitioned tables on two servers: checkpoints must reassemble shards.
    strategy = builders.PartitionedPS(min_shard_bytes=64).build(graph_item, spec)
    return model, x, y, spec, graph_item, strategy


def test_checkpoint_names_values_and_keras_restore(tmp_path):
    model, x, y, spec, graph_item, strategy = _setup()
    ckpt_dir = tmp_path / "ckpt"
    run = autodist.distribute(model, strategy, spec, graph_item=graph_item)
    run.fit(x, y, batch_size=32, epochs=2, verbose=0, checkpoint_dir=str(ckpt_dir), shuffle=False)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["latest", "step-00000003",
                                                          "step-00000006"]
    reader = tf.train.load_checkpoint(str(ckpt_dir / "step-00000006" / "ckpt"))
    assert reader.get_tensor("optimizer/iterations") == 6
    for name, var in zip(graph_item.variable_names, model.trainable_variables):
        np.testing.assert_array_equal(reader.get_tensor(name), var.numpy())
        assert reader.get_tensor(f"{name}/optimizer/momentum").shape == tuple(var.shape)
    fresh = models.embedding_model(num_users=50, num_items=71, dim=8, seed=7)
    autodist.restore_keras_weights(fresh, ckpt_dir)
    for a, b in zip(fresh.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    bad = models.embedding_model(num_users=50, num_items=72, dim=8)
    with pytest.raises(autodist.AutodistError,
                       match="has shape \\[71, 8\\], the model \\[72, 8\\]"):
        autodist.restore_keras_weights(bad, ckpt_dir)


def test_continuing_from_a_checkpoint_equals_an_uninterrupted_run(tmp_path):
    model, x, y, spec, graph_item, strategy = _setup()
    reference = models.single_device_twin(model)
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)

    ckpt_dir = tmp_path / "ckpt"
    autodist.distribute(model, strategy, spec, graph_item=graph_item).fit(
        x, y, batch_size=32, epochs=1, verbose=0, checkpoint_dir=str(ckpt_dir), shuffle=False)
    # A new run (a new cluster) picks up variables, Adam's slots and its step.
    resumed = models.embedding_model(num_users=50, num_items=71, dim=8, seed=3)
    autodist.distribute(resumed, strategy, spec, graph_item=graph_item).fit(
        x, y, batch_size=32, epochs=1, verbose=0, initial_checkpoint=str(ckpt_dir), shuffle=False)
    for got, want in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)


def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(autodist.AutodistError, match="no checkpoint at"):
        checkpoint.resolve(tmp_path / "nothing")


def test_checkpoints_to_keep_retains_the_newest(tmp_path):
    model, x, y, spec, graph_item, strategy = _setup()
    run = autodist.distribute(model, strategy, spec, graph_item=graph_item)
    with pytest.raises(autodist.AutodistError, match="checkpoints_to_keep must be an integer "
                                                     ">= 1. Received: 0"):
        run.fit(x, y, batch_size=32, epochs=1, verbose=0, checkpoint_dir=str(tmp_path),
                checkpoints_to_keep=0, shuffle=False)
    ckpt_dir = tmp_path / "ckpt"
    run.fit(x, y, batch_size=32, epochs=3, verbose=0, checkpoint_dir=str(ckpt_dir),
            checkpoints_to_keep=2, shuffle=False)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["latest", "step-00000006",
                                                          "step-00000009"]
    assert (ckpt_dir / "step-00000009" / "manifest.json").exists()
    assert checkpoint.load(ckpt_dir)["optimizer/iterations"] == 9
