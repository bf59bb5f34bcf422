"""Local replication of PS variables on real multi-process clusters.

Each worker task reads worker-local copies refreshed from the PS once the
step's update is applied, so synchronous training gives the same numbers as
without local copies: single-device Keras `fit` to 2e-5 (the check of
test_distributed_training.py: same models, data and steps), for whole and
partitioned variables, dense layers and embedding tables, and with
all-reduce in the same step (Parallax). The asynchronous case is in
test_consistency.py.
"""
from __future__ import annotations

import pytest

import autodist
from autodist.search import builders
from tests.runtime.test_distributed_training import check_equals_single_device

pytestmark = pytest.mark.cluster

CASES = {
    "PS-mlp": (lambda: builders.PS(local_replication=True), "mlp"),
    "PartitionedPS-ncf": (lambda: builders.PartitionedPS(local_replication=True,
                                                         min_shard_bytes=64), "ncf"),
    "Parallax-ncf": (lambda: builders.Parallax(local_replication=True, min_shard_bytes=64),
                     "ncf"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sync_local_replication_equals_single_device(case, tmp_path):
    make_builder, model_name = CASES[case]
    spec = autodist.ResourceSpec.local(workers=2, ps=2)
    strategy = check_equals_single_device(make_builder(), model_name, spec,
                                          str(tmp_path / "job"))
    # The strategy really asked for local copies (of partitioned tables for ncf).
    local = {c.var_name for c in strategy.variables
             if any(s.WhichOneof("kind") == "ps" and s.ps.local_replication for s in c.shards)}
    assert local
    if model_name == "ncf":
        assert "item_embedding/embeddings" in local
        assert strategy.variable("item_embedding/embeddings").partitioner.num_shards > 1
