"""GPU replicas and NCCL all-reduce, against single-device Keras (skipped without GPUs).

On a real cluster of task processes, each given only its node's GPUs
(``CUDA_VISIBLE_DEVICES``) with memory growth:

* NCCL: every all-reduced variable with spec NCCL (sparse gradients
  densified), on the 2 GPUs of one task (in-graph), and on 2 tasks x 2 GPUs
  where there are 4; equal to Keras to 2e-5.
* Every builder, and PS builders with local replication, on GPU replicas
  (2 tasks x 2 GPUs with 4 GPUs, 2 x 1 with 2, two tasks sharing the GPU
  with 1); equal to Keras step by step to 2e-5 (see
  tests/runtime/test_replicas_per_task.py for the check).
* A task process sees exactly its node's GPUs, and the GPU count that
  `ResourceSpec.from_tf_config` detects without CUDA equals TensorFlow's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import autodist
from autodist import models
from autodist.ir.gpus import visible_gpus
from autodist.ir.resource_spec import TaskDevices
from autodist.ir.strategy import AllReduceSynchronizer
from autodist.launch.devices import task_environment
from autodist.search import builders
from tests.gpu.helpers import needs_gpus, usable_gpus
from tests.runtime.test_distributed_training import _data, _model
from tests.runtime.test_replicas_per_task import check_every_builder

pytestmark = pytest.mark.gpu

TOLERANCE = 2e-5
BATCH, EPOCHS = 32, 2


def _nccl(strategy):
    """`strategy` with every all-reduce shard on NCCL (sparse ones densified and reduced)."""
    for config in strategy.proto.variables:
        for shard in config.shards:
            if shard.WhichOneof("kind") == "all_reduce":
                shard.all_reduce.spec = AllReduceSynchronizer.NCCL
                shard.all_reduce.group = 0
    return strategy


@pytest.mark.cluster
@needs_gpus(2)
@pytest.mark.parametrize("workers,gpus", [(1, 2), pytest.param(2, 2, marks=needs_gpus(4))],
                         ids=["1x2", "2x2"])
@pytest.mark.parametrize("model_name", ["mlp", "ncf"])
def test_nccl_all_reduce_equals_keras(model_name, workers, gpus, tmp_path):
    model = _model(model_name)
    x, y = _data(model_name)
    reference = models.single_device_twin(model)
    reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    spec = autodist.ResourceSpec.local(workers=workers, gpus_per_worker=gpus)
    item = autodist.capture(model)
    strategy = _nccl(builders.AllReduce().build(item, spec))
    strategy.validate(item, spec)
    assert all("/device:GPU:" in d for d in strategy.replicas)
    run = autodist.distribute(model, strategy, spec, graph_item=item,
                              job_dir=str(tmp_path / "job"), step_timeout_s=120)
    run.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


def _gpu_spec():
    """2 worker tasks (+2 PS tasks) on the GPUs there are."""
    count = usable_gpus()
    if count >= 2:
        return autodist.ResourceSpec.local(workers=2, ps=2, gpus_per_worker=min(count // 2, 2))
    worker = {"address": "localhost", "gpus": [0], "roles": ["worker"]}
    ps = {"address": "localhost", "roles": ["ps"]}
    return autodist.ResourceSpec.from_dict({"nodes": [dict(worker, chief=True), worker, ps, ps]})


@pytest.mark.cluster
@pytest.mark.parametrize("model_name", ["mlp", "ncf", "transformer"])
def test_every_builder_on_gpu_replicas_equals_keras(model_name, tmp_path):
    spec = _gpu_spec()
    assert all("/device:GPU:" in d for d in spec.replica_devices)
    check_every_builder(model_name, tmp_path, spec)


@needs_gpus(1)
def test_detected_gpus_are_tensorflows():
    assert len(visible_gpus()) == usable_gpus()
    spec = autodist.ResourceSpec.from_tf_config(
        {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}})
    assert [len(n.gpus) for n in spec.nodes] == [usable_gpus()] * 2


@needs_gpus(1)
@pytest.mark.parametrize("node_gpus", [(), (0,), pytest.param((1,), marks=needs_gpus(2)),
                                       pytest.param((0, 1), marks=needs_gpus(2))])
def test_a_task_sees_only_its_gpus(node_gpus):
    env = dict(os.environ, **task_environment(TaskDevices(cpus=1, gpus=node_gpus),
                                              visible_gpus()))
    code = ("import json, tensorflow as tf; "
            "print(json.dumps([d.name for d in tf.config.list_physical_devices('GPU')]))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == [f"/physical_device:GPU:{i}" for i in range(len(node_gpus))]
