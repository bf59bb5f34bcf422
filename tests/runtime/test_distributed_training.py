"""Distributed training on real multi-process local clusters equals single-device Keras.

Every builder x {two-embedding NCF, small Transformer} (and an MLP with PS and with
all-reduce) trains on 2 worker
processes (+2 PS processes where the builder uses PS) for 6 steps: 2 epochs
of 3 global batches of 32, the last batch short (26 examples, split 13/13).
The trained weights must equal Keras `fit` of the same model on the same data
with the same global batch: |distributed - keras| <= 2e-5 (float32 sums in a
different order; observed <= 4e-7).
"""
from __future__ import annotations

import numpy as np
import pytest

import keras
import autodist
from autodist import models
from autodist.ir.strategy import AllReduceSynchronizer
from autodist.search import builders

pytestmark = pytest.mark.cluster

TOLERANCE = 2e-5
EXAMPLES = 90
BATCH = 32
EPOCHS = 2

# Small thresholds so the partitioning builders really split variables.
BUILDERS = {
    "PS": lambda: builders.PS(),
    "PSLoadBalancing": lambda: builders.PSLoadBalancing(),
    "PartitionedPS": lambda: builders.PartitionedPS(min_shard_bytes=64),
    "UnevenPartitionedPS": lambda: builders.UnevenPartitionedPS(min_shard_bytes=64),
    "AllReduce": lambda: builders.AllReduce(),
    "PartitionedAR": lambda: builders.PartitionedAR(min_shard_bytes=64),
    "RandomAxisPartitionAR": lambda: builders.RandomAxisPartitionAR(seed=1, min_shard_bytes=64),
    "Parallax": lambda: builders.Parallax(min_shard_bytes=64),
}
USES_PS = {"PS", "PSLoadBalancing", "PartitionedPS", "UnevenPartitionedPS", "Parallax"}


def _model(name: str):
    if name == "mlp":
        return models.mlp(input_dim=20, hidden=(16,),
                          optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
    if name == "ncf":
        return models.embedding_model(num_users=50, num_items=71, dim=8, optimizer="adam")
    return models.transformer(vocab_size=50, seq_len=6, dim=8, heads=2, layers_count=1,
                              optimizer="adam")


def _data(name: str):
    rng = np.random.default_rng(0)
    if name == "mlp":
        return (rng.normal(size=(EXAMPLES, 20)).astype("float32"),
                rng.integers(0, 10, EXAMPLES).astype("int32"))
    if name == "ncf":
        return ([rng.integers(0, 50, (EXAMPLES, 1)).astype("int32"),
                 rng.integers(0, 71, (EXAMPLES, 1)).astype("int32")],
                rng.integers(0, 2, (EXAMPLES, 1)).astype("float32"))
    return (rng.integers(0, 50, (EXAMPLES, 6)).astype("int32"),
            rng.integers(0, 2, EXAMPLES).astype("int32"))


def _keras_reference(model, x, y):
    reference = models.single_device_twin(model)
    history = reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return reference.get_weights(), history.history["loss"]


def check_equals_single_device(builder, model_name: str, spec, job_dir: str):
    """Trains `model_name` with the builder's strategy on `spec`; compares with Keras.

    Returns:
        The strategy that was trained.
    """
    model = _model(model_name)
    x, y = _data(model_name)
    expected, keras_losses = _keras_reference(model, x, y)
    graph_item = autodist.capture(model)
    strategy = builder.build(graph_item, spec)
    run = autodist.distribute(model, strategy, spec, graph_item=graph_item,
                              job_dir=job_dir, step_timeout_s=60)
    history = run.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False)
    assert len(history.step_losses) == EPOCHS * 3
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    # Keras reports the running mean over each epoch's batches.
    np.testing.assert_allclose(history.history["loss"], keras_losses, rtol=1e-4)
    return strategy


# The MLP's dense layers are a part of the Transformer's: it runs with one PS and one
# all-reduce builder (the plainest step), the other two models with every builder.
_BUILDER_MODEL_PAIRS = [(b, m) for m in ("ncf", "transformer") for b in BUILDERS] + [
    ("PS", "mlp"), ("AllReduce", "mlp")]


@pytest.mark.parametrize(("builder_name", "model_name"), _BUILDER_MODEL_PAIRS,
                         ids=[f"{b}-{m}" for b, m in _BUILDER_MODEL_PAIRS])
def test_distributed_equals_single_device(builder_name, model_name, tmp_path):
    spec = autodist.ResourceSpec.local(workers=2, ps=2 if builder_name in USES_PS else 0)
    check_equals_single_device(BUILDERS[builder_name](), model_name, spec,
                               str(tmp_path / "job"))


class _Hybrid:
    """Every dense variable that can split: half its shards on the PS, half all-reduced."""

    def build(self, graph_item, spec):
        from autodist.search.space import SearchSpace, SpaceOptions

        space = SearchSpace(graph_item, spec, SpaceOptions(min_shard_bytes=64, max_shards=4))
        candidate = []
        for options in space.options:
            kinds = [{s.WhichOneof("kind") for s in c.shards} for c in options]
            hybrid = [i for i, k in enumerate(kinds) if len(k) == 2
                      and options[i].partitioner.num_shards == 4
                      and sum(s.WhichOneof("kind") == "ps" for s in options[i].shards) == 2]
            candidate.append(hybrid[0] if hybrid else
                             next(i for i, k in enumerate(kinds) if k == {"all_reduce"}))
        return space.decode(candidate + [0])


@pytest.mark.parametrize("model_name", ["mlp", "ncf"])
def test_variables_split_between_ps_and_all_reduce_equal_single_device(model_name, tmp_path):
    spec = autodist.ResourceSpec.local(workers=2, ps=2)
    strategy = check_equals_single_device(_Hybrid(), model_name, spec, str(tmp_path / "job"))
    split = [c for c in strategy.variables
             if {s.WhichOneof("kind") for s in c.shards} == {"ps", "all_reduce"}]
    assert split, "no variable was split between PS and all-reduce"


@pytest.mark.parametrize("builder,model_name", [
    (lambda: builders.Parallax(min_shard_bytes=64), "ncf"), (_Hybrid, "mlp")])
def test_ps_and_all_reduce_on_workers_without_ps_tasks_equal_single_device(
        builder, model_name, tmp_path):
    """PS shards on the workers' own CPUs next to collectives (read through local copies)."""
    spec = autodist.ResourceSpec.local(workers=2, ps=0)
    strategy = check_equals_single_device(builder(), model_name, spec, str(tmp_path / "job"))
    kinds = {s.WhichOneof("kind") for c in strategy.variables for s in c.shards}
    assert kinds == {"ps", "all_reduce"}
    assert not any(s.ps.local_replication for c in strategy.variables for s in c.shards)


class _Densified:
    """A builder's strategy with every sparse all-reduce shard densified (spec RING).

    The densified shards join the group of the first dense all-reduce shard,
    so they are reduced in one buffer with dense gradients.
    """

    def __init__(self, builder) -> None:
        self.builder = builder

    def build(self, graph_item, spec):
        strategy = self.builder.build(graph_item, spec)
        sparse = {v.name for v in graph_item.variables if v.sparse_gradient}
        dense_group = next(s.all_reduce.group for c in strategy.proto.variables
                           if c.var_name not in sparse for s in c.shards)
        for config in strategy.proto.variables:
            if config.var_name in sparse:
                for shard in config.shards:
                    shard.all_reduce.spec = AllReduceSynchronizer.RING
                    shard.all_reduce.group = dense_group
        return strategy


@pytest.mark.parametrize("model_name", ["ncf", "transformer"])
@pytest.mark.parametrize("builder_name", ["AllReduce", "PartitionedAR"])
def test_densified_sparse_gradients_equal_single_device(builder_name, model_name, tmp_path):
    """Adam squares repeated rows one by one; a densified table must reduce those squares too."""
    spec = autodist.ResourceSpec.local(workers=2, ps=0)
    strategy = check_equals_single_device(_Densified(BUILDERS[builder_name]()), model_name, spec,
                                          str(tmp_path / "job"))
    assert any(s.all_reduce.spec == AllReduceSynchronizer.RING
               for c in strategy.proto.variables for s in c.shards)
