"""Compiled losses reduced by a sum (`reduction="sum"`) or by a mean over the batch's
sample weights (`reduction="mean_with_sample_weight"`), no cluster.

Two replicas in one task's program (two logical CPUs of this process) each hold
half of a batch with uneven sample weights; their losses and gradients weighted
by their shares of the batch add up to Keras' own on the whole batch (the sum
counted in full on each, the weights' sum summed over the replicas). With
virtual nodes a sum is still one device's; a mean over the weights is each
virtual node's own, said by a `ParityWarning`. The whole step (all-reduce and
SGD updates) trains as Keras' `train_on_batch` in this process too. Training on
real clusters: `tests/runtime/test_loss_reductions_cluster.py`.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import tensorflow as tf

import keras
import autodist
from autodist.ir.capture import capture
from autodist.kernels import global_batch, partitioner, replicator, synchronizer
from autodist.kernels.program import Program
from autodist.runtime import keras_parity
from autodist.search import builders
from tests.keras_equal import sum_and_weighted_mean_model
from tests.local_graph import local_graph

N = 12


def _model(cls_reduction: str = "mean_with_sample_weight"):
    keras.utils.set_random_seed(0)
    return sum_and_weighted_mean_model(0.1, cls_reduction)


@pytest.fixture(scope="module")
def two_outputs():
    model = _model()
    return model, capture(model)


def _data():
    rng = np.random.default_rng(0)
    feed = {"features": rng.normal(size=(N, 4)).astype(np.float32),
            "y/reg": rng.normal(size=(N, 2)).astype(np.float32),
            "y/cls": rng.integers(0, 3, size=N).astype(np.int32),
            "sample_weight/reg": rng.uniform(0.5, 2.0, size=N).astype(np.float32),
            # Uneven, the first half weighing more than the second, one example none.
            "sample_weight/cls": np.r_[np.full(6, 3.0), np.full(6, 0.5)].astype(np.float32)}
    feed["sample_weight/cls"][2] = 0.0
    return feed


def _values(item):
    rng = np.random.default_rng(1)
    return {v.name: rng.normal(scale=0.5, size=v.shape).astype(np.float32)
            for v in item.variables}


def _step(item, spec, strategy, data, vn_sizes=None, parts=None):
    """Each local replica's loss and gradients times its share of the batch, summed; and
    under "metrics" the task's metric states (summed over its replicas). `parts`: the
    replicas' examples (default: the batch split evenly)."""
    program = Program(item, spec, ("worker", 0))
    partitioner.apply(program, strategy)
    replicator.apply(program, strategy)
    values = _values(item)
    with program.graph.as_default():
        assigns = [var.assign(values[role.shard]) for name, var in program.storage.items()
                   if (role := program.roles.get(name)) is not None and role.kind == "variable"]
        init = tf.group([var.initializer for var in program.storage.values()])
        fetches = [{"loss": r.loss.name,
                    **{k: tf.convert_to_tensor(g).name for k, g in r.gradients.items()}}
                   for r in program.replicas]
        metrics = [tf.convert_to_tensor(m).name for m in program.metric_states]
    local = local_graph(program)
    if parts is None:
        parts = np.array_split(np.arange(N), len(program.replicas))
    feed = {}
    for replica, rows in zip(program.replicas, parts):
        feed.update({replica.inputs[name].name: value[rows] for name, value in data.items()})
        if replica.all_sizes is not None:
            feed[replica.all_sizes.name] = vn_sizes or [len(p) for p in parts]
        if replica.sizes is not None:
            feed[replica.sizes.name] = vn_sizes
    config = tf.compat.v1.ConfigProto(device_count={"CPU": 2})
    with tf.compat.v1.Session(graph=local, config=config) as session:
        session.run(init.name)
        session.run([a.name for a in assigns])
        out, states = session.run((fetches, metrics), feed)
    shares = [len(rows) / N for rows in parts]
    summed = {name: sum(share * o[name] for share, o in zip(shares, out)) for name in out[0]}
    return dict(summed, metrics=states)


def _keras_step(model, item, data):
    """Keras' loss and gradients on the whole batch, from the same weights."""
    values = _values(item)
    for variable, info in zip(model.trainable_variables, item.variables):
        variable.assign(values[info.name])
    x = tf.constant(data["features"])
    y = [tf.constant(data["y/reg"]), tf.constant(data["y/cls"])]
    weights = [tf.constant(data["sample_weight/reg"]), tf.constant(data["sample_weight/cls"])]
    with tf.GradientTape() as tape:
        loss = model.compute_loss(x, y, model(x, training=True), weights, training=True)
    grads = tape.gradient(loss, model.trainable_variables)
    return {"loss": float(loss), **{info.name: g.numpy()
                                    for info, g in zip(item.variables, grads)}}


def test_capture_lists_the_sum_scale_and_the_weights_sums(two_outputs):
    _, item = two_outputs
    reductions = [(r.reduction, r.node) for r in item.loss_reductions]
    assert reductions[0] == ("sum", "autodist_loss_sum_scale_0")
    # The train step's sum of the weights, and the per-output tracker's.
    assert [r for r, _ in reductions[1:]] == ["mean_with_sample_weight"] * 2
    assert [n.split("/")[0] for _, n in reductions[1:]] == ["compile_loss", "compile_loss_1"]


@pytest.mark.parametrize("replicas", [1, 2])
def test_replicas_compute_keras_loss_and_gradients(two_outputs, replicas):
    model, item = two_outputs
    data = _data()
    want = _keras_step(model, item, data)
    spec = autodist.ResourceSpec.local(workers=1, cpu_replicas_per_worker=replicas)
    strategy = builders.AllReduce().build(item, spec)
    assert global_batch.sums_over_replicas(item, strategy) == (replicas == 2)
    got = _step(item, spec, strategy, data)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def _metric_states_on_parts(model, item, parts, keras_update):
    """The metric states of 2 replicas holding `parts` of the batch (summed), by metric
    variable; `keras_update(x, y, y_pred)` then updates the model's metrics from zero
    on the whole batch with the same weights."""
    from autodist.ir.capture.keras_metrics import keras_metric_variables

    data = _data()
    spec = autodist.ResourceSpec.local(workers=1, cpu_replicas_per_worker=2)
    rows = np.split(np.arange(N), np.cumsum(parts)[:-1])
    got = _step(item, spec, builders.AllReduce().build(item, spec), data, parts=rows)
    _keras_step(model, item, data)   # the same weights in the model
    for metric in model.metrics:
        metric.reset_state()
    x = tf.constant(data["features"])
    keras_update(x, [tf.constant(data["y/reg"]), tf.constant(data["y/cls"])],
                 model(x, training=True))
    index = {id(v): i for i, v in enumerate(keras_metric_variables(model))}
    return lambda variable: got["metrics"][index[id(variable)]]


@pytest.mark.parametrize("parts", [[8, 4], [3, 9]])
def test_per_output_loss_trackers_count_one_batch_on_uneven_replicas(two_outputs, parts):
    """Keras' `<output>_loss` trackers count each batch of `fit` once (its traced batch
    size is unknown), with the batch's loss: replicas holding 8 and 4 of its 12 examples
    report together one count and the whole batch's loss (not the mean of theirs)."""
    model, item = two_outputs
    weights = [tf.constant(_data()[f"sample_weight/{k}"]) for k in ("reg", "cls")]
    state = _metric_states_on_parts(model, item, parts, lambda x, y, p: model.compute_loss(
        x, y, p, weights, training=True))
    trackers = model._compile_loss.metrics
    assert len(trackers) == 2
    for tracker in trackers:
        assert state(tracker.count) == pytest.approx(1.0, rel=1e-6), tracker.name
        assert state(tracker.total) == pytest.approx(float(tracker.result()), rel=1e-5), \
            tracker.name


@pytest.mark.parametrize("parts", [[8, 4], [3, 9]])
def test_a_loss_as_a_metric_counts_one_batch_on_uneven_replicas(parts):
    """A `keras.losses.Loss` instance passed as a metric is one value per batch that Keras
    averages over batches: replicas holding 8 and 4 of the 12 examples report together
    one count and the whole batch's value (not the mean of theirs); a per-example metric
    ("mae") still counts the examples."""
    keras.utils.set_random_seed(0)
    model = sum_and_weighted_mean_model(
        0.1, metrics={"reg": [keras.losses.MeanAbsoluteError(name="reg_mae_loss"), "mae"]})
    state = _metric_states_on_parts(model, capture(model), parts, lambda x, y, p: (
        model.compute_metrics(x, y, p, sample_weight=None)))
    by_name = {m.name: m for m in model._compile_metrics.metrics}
    for name, count in (("reg_mae_loss", 1.0), ("mae", float(N))):
        metric = by_name[name]
        assert state(metric.count) == pytest.approx(count, rel=1e-6), name
        assert state(metric.total) / state(metric.count) == \
            pytest.approx(float(metric.result()), rel=1e-5), name


def test_virtual_nodes_count_a_sum_in_full_and_said_for_the_weights_sum(two_outputs):
    model, item = two_outputs
    spec = autodist.ResourceSpec.local(workers=1)
    strategy = builders.AllReduce().build(item, spec)
    data = _data()
    data["sample_weight/cls"] = np.ones(N, np.float32)   # parts' sums = the batch's share
    one = _step(item, spec, strategy, data)
    four = _step(item, spec, strategy.with_virtual_nodes(N, 4), data, vn_sizes=[3] * 4)
    for name in one:
        np.testing.assert_allclose(four[name], one[name], rtol=1e-5, atol=1e-6, err_msg=name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        keras_parity.check(model, item, builders.AllReduce().build(
            item, autodist.ResourceSpec.local(workers=2)))      # summed over replicas: silent
    with pytest.warns(keras_parity.ParityWarning,
                      match=r"compile_loss/sparse_categorical_crossentropy.*sum of sample "
                            r"weights.*its own sum"):
        keras_parity.check(model, item, strategy.with_virtual_nodes(N, 4))


def test_mean_is_a_mean_over_the_batch_and_needs_nothing():
    model = _model("mean")
    item = capture(model)
    assert [r.reduction for r in item.loss_reductions] == ["sum"]
    data = _data()
    want = _keras_step(model, item, data)
    spec = autodist.ResourceSpec.local(workers=1, cpu_replicas_per_worker=2)
    got = _step(item, spec, builders.AllReduce().build(item, spec), data)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_two_replicas_train_as_keras_train_on_batch():
    """The whole step (replicas, sums, all-reduce, SGD updates) in this process: three
    steps of batches of 12 (the halves' weights uneven) reach Keras' weights and losses."""
    model, reference = _model(), _model()
    item = capture(model)
    spec = autodist.ResourceSpec.local(workers=1, cpu_replicas_per_worker=2)
    strategy = builders.AllReduce().build(item, spec)
    program = Program(item, spec, ("worker", 0))
    partitioner.apply(program, strategy)
    replicator.apply(program, strategy)
    synchronizer.apply(program, strategy, synchronizer.SyncOptions(
        is_chief=True, worker_tasks=1, task_index=0, timeout_s=10.0))
    values = {v.name: w.numpy() for v, w in zip(item.variables, model.trainable_variables)}
    with program.graph.as_default():
        init = [v.initializer for v in program.storage.values()] + \
            [program.outputs.step.initializer]
        assigns = [var.assign(values[role.shard]) for name, var in program.storage.items()
                   if (role := program.roles.get(name)) is not None and role.kind == "variable"]
        reads = {role.shard: var.read_value().name for name, var in program.storage.items()
                 if (role := program.roles.get(name)) is not None and role.kind == "variable"}
    local = local_graph(program)
    batches = [_data() for _ in range(3)]
    for step, data in enumerate(batches):
        data["features"] += step
    halves = np.array_split(np.arange(N), 2)
    losses = []
    config = tf.compat.v1.ConfigProto(device_count={"CPU": 2})
    with tf.compat.v1.Session(graph=local, config=config) as session:
        session.run([op.name for op in init])
        session.run([a.name for a in assigns])
        for data in batches:
            feed = {}
            for replica, rows in zip(program.replicas, halves):
                feed.update({replica.inputs[k].name: v[rows] for k, v in data.items()})
                feed[program.outputs.scales[replica.index].name] = len(rows) / N
                if replica.all_sizes is not None:
                    feed[replica.all_sizes.name] = [len(h) for h in halves]
            losses.append(session.run([program.outputs.weighted_loss.name,
                                       program.outputs.train_op.name], feed)[0])
        got = session.run(reads)
    for data, loss in zip(batches, losses):
        want = reference.train_on_batch(
            data["features"], [data["y/reg"], data["y/cls"]],
            sample_weight=[data["sample_weight/reg"], data["sample_weight/cls"]])
        assert loss == pytest.approx(float(np.ravel(want)[0]), rel=1e-5)
    for info, variable in zip(item.variables, reference.trainable_variables):
        np.testing.assert_allclose(got[info.name], variable.numpy(), rtol=0, atol=2e-5,
                                   err_msg=info.name)


def _per_example_column(y_true, y_pred):
    """A loss of shape (batch, 1) per example over targets (batch, 9), as
    `keras.backend.ctc_batch_cost` returns (keras-io's ctc_asr)."""
    target = tf.reduce_mean(tf.cast(y_true, tf.float32), axis=1, keepdims=True)
    return tf.reduce_mean(tf.square(y_pred - target), axis=1, keepdims=True)


def test_a_loss_of_one_column_per_example_over_wider_targets_weighs_each_example_once():
    """Keras trains it; the replicas' unit sample weights took the targets' shape (batch,
    9) where the loss's weights are (batch, 1), and every worker failed building its step
    (found on keras-io's ctc_asr). Two replicas' loss and gradients equal Keras'."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,), name="features")
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    model.compile(keras.optimizers.SGD(0.1), loss=_per_example_column)
    rng = np.random.default_rng(0)
    data = {"features": rng.normal(size=(N, 4)).astype(np.float32),
            "y": rng.integers(0, 5, size=(N, 9)).astype(np.int64)}
    item = capture(model, x=data["features"][:4], y=data["y"][:4])
    spec = autodist.ResourceSpec.local(workers=1, cpu_replicas_per_worker=2)
    (x_info,), (y_info,) = item.model_inputs, item.target_inputs
    feed = {x_info.name: data["features"],
            y_info.name: data["y"].astype(tf.as_dtype(y_info.dtype).as_numpy_dtype)}
    got = _step(item, spec, builders.AllReduce().build(item, spec), feed)
    values = _values(item)
    for variable, info in zip(model.trainable_variables, item.variables):
        variable.assign(values[info.name])
    x, y = tf.constant(data["features"]), tf.constant(data["y"])
    with tf.GradientTape() as tape:
        loss = model.compute_loss(x, y, model(x, training=True), training=True)
    grads = tape.gradient(loss, model.trainable_variables)
    np.testing.assert_allclose(got["loss"], float(loss), rtol=1e-6)
    for info, grad in zip(item.variables, grads):
        np.testing.assert_allclose(got[info.name], grad.numpy(), rtol=1e-5, atol=1e-6)
