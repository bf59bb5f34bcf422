"""Virtual nodes in the replicator, on the built graph (no cluster).

A replica running k virtual nodes imports the step k times, runs them one
after the other, and its gradient is theirs weighted by examples: the same
gradient as one replica running all its examples in one batch. Training
results on real clusters are in tests/runtime/test_virtual_nodes.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import autodist
from autodist.kernels import partitioner, replicator
from autodist.kernels.program import Program
from autodist.runtime import batching
from autodist.search import builders

W0 = "/job:worker/task:0/device:CPU:0"
W1 = "/job:worker/task:1/device:CPU:0"


def _replicated(graph_item, strategy, spec, task_index: int = 0) -> Program:
    program = Program(graph_item, spec, ("worker", task_index))
    partitioner.apply(program, strategy)
    return replicator.apply(program, strategy)


def _ancestors(op: tf.Operation) -> set[tf.Operation]:
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo += [t.op for t in current.inputs] + list(current.control_inputs)
    return seen


def test_replica_runs_its_virtual_nodes_in_order(mlp_item, local_spec):
    strategy = builders.AllReduce().build(mlp_item, local_spec).with_virtual_nodes(
        36, 6, [W0, W1, W0, W1, W1, W1])
    program = _replicated(mlp_item, strategy, local_spec, task_index=1)
    (replica,) = program.replicas
    assert [vn.index for vn in replica.virtual_nodes] == [1, 3, 4, 5]
    assert all(vn.weight is not None for vn in replica.virtual_nodes)
    names = {vn.inputs["y"].name for vn in replica.virtual_nodes}
    assert len(names) == 4  # each virtual node its part of the replica's inputs
    assert replica.sizes is not None and replica.sizes.shape.as_list() == [4]
    # Virtual node i+1 starts only after virtual node i's gradients.
    for previous, vn in zip(replica.virtual_nodes, replica.virtual_nodes[1:]):
        first_grad = next(iter(previous.gradients.values()))
        before = _ancestors(next(iter(vn.gradients.values())).op)
        assert first_grad.op in before and previous.loss.op in before
        assert next(iter(vn.gradients.values())).op not in _ancestors(first_grad.op)
    # The replica's gradient depends on every virtual node's.
    for name, grad in replica.gradients.items():
        for vn in replica.virtual_nodes:
            assert vn.gradients[name].op in _ancestors(grad.op)


def test_without_virtual_nodes_the_replica_is_its_one_node(mlp_item, local_spec):
    strategy = builders.AllReduce().build(mlp_item, local_spec)
    program = _replicated(mlp_item, strategy, local_spec)
    (replica,) = program.replicas
    (vn,) = replica.virtual_nodes
    assert vn.index == 0 and vn.weight is None and replica.sizes is None
    assert replica.gradients == vn.gradients and replica.loss is vn.loss
    assert vn.inputs["y"] is replica.inputs["y"]
    assert vn.inputs["y"].name.startswith(f"{replicator.SCOPE}/replica_0/")


def _gradients(graph_item, strategy, spec, inputs, targets, values, feed_sizes=True):
    """Task 0's replica gradients (dense) for one global batch, in a local session."""
    program = _replicated(graph_item, strategy, spec)
    (replica,) = program.replicas
    with program.graph.as_default():
        assigns = [var.assign(values[name.removesuffix("/replica_0")])
                   for name, var in program.storage.items()
                   if name.startswith(f"{replicator.SCOPE}/vars/") and "/slot/" not in name]
        init = tf.compat.v1.global_variables_initializer()
        fetches = {name: tf.convert_to_tensor(g) for name, g in replica.gradients.items()}
        fetches["loss"] = replica.loss
    # Run in this process: the same graph without the cluster's devices.
    graph_def = program.graph.as_graph_def()
    for node in graph_def.node:
        node.device = ""
    local = tf.Graph()
    with local.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    fetches = {k: v.name for k, v in fetches.items()}
    with tf.compat.v1.Session(graph=local) as session:
        session.run(init.name)
        session.run([a.name for a in assigns])
        rows = np.arange(len(targets))
        parts = batching.virtual_node_rows(rows, strategy.num_virtual_nodes)
        mine = np.concatenate([parts[vn.index] for vn in replica.virtual_nodes])
        feed = {}
        if replica.sizes is not None and feed_sizes:
            feed[replica.sizes.name] = [len(parts[vn.index]) for vn in replica.virtual_nodes]
        x_names = [i.name for i in graph_item.inputs if i.role != "y"]
        for name, array in zip(x_names, inputs):
            feed[replica.inputs[name].name] = array[mine]
        feed[replica.inputs["y"].name] = targets[mine]
        return session.run(fetches, feed)


@pytest.mark.parametrize("model", ["mlp", "ncf"])
@pytest.mark.parametrize("weighting", ["seeded", "multiplied", "default sizes"])
def test_accumulated_gradient_equals_one_batch(model, weighting, mlp_item, ncf_item,
                                               monkeypatch):
    if weighting == "multiplied":  # as for a step whose backward seed is not recognized
        monkeypatch.setattr(replicator, "gradient_seed", lambda *args: None)
    graph_item = mlp_item if model == "mlp" else ncf_item
    spec = autodist.ResourceSpec.local(workers=1)
    rng = np.random.default_rng(0)
    n = 24
    if model == "mlp":
        dim = graph_item.inputs[0].shape[1]
        inputs = [rng.normal(size=(n, dim)).astype(np.float32)]
        targets = rng.integers(0, 10, n).astype(np.int32)
    else:
        inputs = [rng.integers(0, 1000, (n, 1)).astype(np.int32),
                  rng.integers(0, 20011, (n, 1)).astype(np.int32)]
        targets = rng.integers(0, 2, (n, 1)).astype(np.float32)
    values = {f"{replicator.SCOPE}/vars/{v.name}":
              rng.normal(scale=0.1, size=list(v.shape)).astype(np.float32)
              for v in graph_item.variables}
    strategy = builders.AllReduce().build(graph_item, spec)
    one = _gradients(graph_item, strategy, spec, inputs, targets, values)
    four = _gradients(graph_item, strategy.with_virtual_nodes(n, 4), spec, inputs, targets,
                      values, feed_sizes=weighting != "default sizes")
    assert set(one) == set(four)
    for name in one:
        np.testing.assert_allclose(four[name], one[name], rtol=0, atol=2e-6, err_msg=name)
    assert any(np.any(g != 0) for name, g in one.items() if name != "loss")


def test_weight_seeds_each_virtual_nodes_backward_pass(mlp_item, ncf_item, local_spec):
    for graph_item in (mlp_item, ncf_item):
        strategy = builders.AllReduce().build(graph_item, local_spec).with_virtual_nodes(
            24, 4, [W0, W0, W0, W1])
        (replica,) = _replicated(graph_item, strategy, local_spec).replicas
        assert replica.default_sizes == [6, 6, 6]
        assert all(vn.weighted for vn in replica.virtual_nodes)
        for name, grad in replica.gradients.items():
            # Summed (or concatenated) as they come: no multiply per gradient.
            total = grad.values if isinstance(grad, tf.IndexedSlices) else grad
            parts = [g.values if isinstance(g, tf.IndexedSlices) else g
                     for g in (vn.gradients[name] for vn in replica.virtual_nodes)]
            assert list(total.op.inputs)[:3] == parts, name


def _captured_function(fn, signature, variables):
    import keras

    from autodist.ir.capture import capture

    return capture(tf.function(fn), variables=variables, input_signature=signature,
                   optimizer=keras.optimizers.SGD(0.1))


def _seed(graph_item):
    grads = [v.gradient.dense or v.gradient.values for v in graph_item.variables]
    return replicator.gradient_seed(graph_item.graph_def(), graph_item.loss_tensor, grads)


def test_gradient_seed_is_the_backward_passes_own():
    w = tf.Variable(tf.ones([4, 3]), name="w")
    # A forward constant 1 named like the tape's seed, and a backward one
    # (the gradient of pow): neither is the seed.
    item = _captured_function(
        lambda x: tf.reduce_mean(tf.pow(tf.matmul(x, w), 3.0)) * tf.ones([]),
        [tf.TensorSpec([None, 4])], [w])
    assert _seed(item) == "ones_1:0"
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 5], name="x")
        v = tf.compat.v1.get_variable("W", [5, 1], use_resource=True)
        loss = tf.reduce_mean(tf.square(tf.matmul(x, v)))
        optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    from autodist.ir.capture import capture

    assert _seed(capture(loss, optimizer=optimizer)) == "gradients/grad_ys_0/Const:0"
    # Not recognized unless exactly one constant fits and every gradient comes from it.
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [3], name="x")
        loss = tf.reduce_sum(x * x)
        ones = tf.constant(1.0, name="ones")
        both = x * ones * tf.constant(1.0, name="ones_1")
        alone = x * 2.0
    graph_def = graph.as_graph_def()
    assert replicator.gradient_seed(graph_def, loss.name, [both.name]) is None
    assert replicator.gradient_seed(graph_def, loss.name, [alone.name]) is None


def test_random_ops_are_seeded_by_virtual_node():
    graph = tf.Graph()
    with graph.as_default():
        tf.raw_ops.RandomUniform(shape=[3], dtype=tf.float32, seed=7, seed2=3, name="noise")
        tf.raw_ops.RandomUniform(shape=[3], dtype=tf.float32, name="unseeded")
    graph_def = graph.as_graph_def()
    assert replicator._seeded(graph_def, 0) is graph_def
    seeds = []
    for vn in range(3):
        nodes = {n.name: n for n in replicator._seeded(graph_def, vn).node}
        seeds.append(nodes["noise"].attr["seed2"].i)
        assert nodes["unseeded"].attr["seed2"].i == 0 and nodes["noise"].attr["seed"].i == 7
    assert len(set(seeds)) == 3


def test_virtual_node_rows_do_not_depend_on_the_mapping():
    rows = np.arange(100, 132)
    parts = batching.virtual_node_rows(rows, 4)
    assert [list(p) for p in parts] == [list(range(100 + 8 * i, 108 + 8 * i)) for i in range(4)]
