"""Capture of Keras features beyond one output and a plain loss: each trains as Keras does,
or is refused with a message that names it.

The reference is Keras' own train step: the models are compiled with
SGD(learning_rate=1), so one `train_on_batch` moves every weight by minus its
gradient, which must equal the captured step's gradient.
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import keras
import autodist
from autodist.ir.capture import capture
from autodist.ir.errors import CaptureError, StrategyError
from autodist.ir.graph_item import LOSS_SCALE_INPUT
from autodist.ir.resource_spec import ResourceSpec
from autodist.search import builders
from autodist.search.space import SearchSpace

from tests.ir.test_capture import _run_captured_step

BATCH = 16


def _keras_step_gradients(model, x, y) -> tuple[float, dict]:
    """Keras' gradients of one train step (SGD with rate 1), by variable path."""
    before = {v.path: v.numpy().copy() for v in model.trainable_variables}
    loss = model.train_on_batch(x, y)
    after = {v.path: v.numpy() for v in model.trainable_variables}
    for v in model.trainable_variables:  # restore
        v.assign(before[v.path])
    total = np.asarray(loss).reshape(-1)[0]  # several outputs: [total, per-output losses]
    return float(total), {k: before[k] - after[k] for k in before}


def _check_equals_keras_step(model, inputs, targets, feeds, **capture_args):
    gi = capture(model, **capture_args)
    got = _run_captured_step(gi, feeds, {v.path: v.value for v in model.trainable_variables})
    loss, expected = _keras_step_gradients(model, inputs, targets)
    assert got["loss"] == pytest.approx(loss, rel=1e-5)
    for name, grad in expected.items():
        np.testing.assert_allclose(got[name], grad, rtol=1e-4, atol=1e-6, err_msg=name)
    return gi


def _rng_data(rng, classes=5):
    x = rng.normal(size=(BATCH, 12)).astype(np.float32)
    return x, rng.integers(0, classes, BATCH).astype(np.int32), \
        rng.normal(size=(BATCH, 2)).astype(np.float32)


def _two_outputs(as_dict: bool):
    inputs = keras.Input((12,), name="features")
    hidden = keras.layers.Dense(16, activation="relu", name="hidden",
                                kernel_regularizer=keras.regularizers.L2(0.01))(inputs)
    cls = keras.layers.Dense(5, name="cls")(hidden)
    reg = keras.layers.Dense(2, name="reg")(hidden)
    outputs = {"cls": cls, "reg": reg} if as_dict else [cls, reg]
    model = keras.Model(inputs, outputs)
    losses = [keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"]
    weights = [1.0, 0.5]
    if as_dict:
        losses, weights = dict(zip(["cls", "reg"], losses)), dict(zip(["cls", "reg"], weights))
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=losses, loss_weights=weights)
    return model


@pytest.mark.parametrize("as_dict", [False, True], ids=["list", "dict"])
def test_multi_output_model_equals_keras_step(as_dict):
    model = _two_outputs(as_dict)
    x, labels, values = _rng_data(np.random.default_rng(0))
    y = {"cls": labels, "reg": values} if as_dict else [labels, values]
    gi = _check_equals_keras_step(model, x, y,
                                  {"features": x, "y/cls": labels, "y/reg": values})
    targets = [(i.name, i.dtype, list(i.shape)) for i in gi.inputs if i.role == "y"]
    assert targets == [("y/cls", "int32", [-1]), ("y/reg", "float32", [-1, 2])]


def test_compute_loss_override_and_added_losses_equal_keras_step():
    class Weighted(keras.Model):
        # A compute_loss of the user's own, without the `training` argument.
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
            loss = super().compute_loss(x, y, y_pred, sample_weight)
            return 2.0 * loss + 0.1 * tf.reduce_mean(tf.square(y_pred))

    inputs = keras.Input((12,), name="features")
    hidden = keras.layers.Dense(16, activation="tanh",
                                kernel_regularizer=keras.regularizers.L1L2(0.01, 0.02),
                                activity_regularizer=keras.regularizers.L2(0.05))(inputs)
    model = Weighted(inputs, keras.layers.Dense(2)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    x, _, values = _rng_data(np.random.default_rng(1))
    _check_equals_keras_step(model, x, values, {"features": x, "y": values})


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(5)

    def call(self, x, training=None):
        return self.out(self.hidden(x))


def test_subclassed_model_is_built_from_the_example_and_equals_keras_step():
    model = Subclassed()
    model.compile(optimizer=keras.optimizers.SGD(1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, labels, _ = _rng_data(np.random.default_rng(2))
    gi = _check_equals_keras_step(model, x, labels, {"input_0": x, "y": labels}, x=x, y=labels)
    assert [list(v.shape) for v in gi.variables] == [[12, 16], [16], [16, 5], [5]]


def test_mixed_bfloat16_equals_keras_step():
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = keras.Sequential([keras.Input((12,), name="features"),
                                  keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    finally:
        keras.config.set_dtype_policy(previous)
    x, _, values = _rng_data(np.random.default_rng(3))
    gi = _check_equals_keras_step(model, x, values, {"features": x, "y": values})
    assert [i.dtype for i in gi.inputs] == ["float32", "float32", "float32"]


def test_mixed_float16_differentiates_the_scaled_loss():
    # Keras wraps the optimizer in a LossScaleOptimizer: the step differentiates the
    # loss times the dynamic scale (fed by the runtime), and the optimizer is Adam's.
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((12,), name="features"),
                                  keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(2, dtype="float32")])
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    finally:
        keras.config.set_dtype_policy(previous)
    x, _, values = _rng_data(np.random.default_rng(4))
    gi = capture(model)
    assert gi.optimizer.class_name == "SGD"
    assert gi.optimizer.loss_scale.initial_scale == 2.0 ** 15
    assert gi.optimizer.loss_scale.dynamic_growth_steps == 2000
    weights = {v.path: v.value for v in model.trainable_variables}
    feeds = {"features": x, "y": values}
    plain = _run_captured_step(gi, feeds, weights)
    scaled = _run_captured_step(gi, feeds, weights, {LOSS_SCALE_INPUT: 2.0 ** 15})
    loss, expected = _keras_step_gradients(model, x, values)
    assert scaled["loss"] == plain["loss"] == pytest.approx(loss, rel=1e-3)  # unscaled
    for name, grad in expected.items():  # float16 rounding
        np.testing.assert_allclose(scaled[name] / 2.0 ** 15, grad, rtol=1e-2, atol=1e-4,
                                   err_msg=name)
        np.testing.assert_allclose(plain[name], grad, rtol=1e-2, atol=1e-4, err_msg=name)


def test_custom_train_step_of_several_optimizers_is_refused():
    """A train_step of its own is captured as it runs when it applies the compiled
    optimizer once (`tests/ir/test_capture_custom_step.py`); a GAN's two optimizers, as
    the steps beyond (docs/design_custom_train_step.md), are refused, naming them."""
    class Custom(keras.Model):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.second = keras.optimizers.SGD(0.1, name="second")

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = keras.ops.mean(keras.ops.square(self(x, training=True) - y))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads[:1], self.trainable_variables[:1])
            self.second.apply(grads[1:], self.trainable_variables[1:])
            return {}

    inputs = keras.Input((12,))
    model = Custom(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(CaptureError, match=r"train_step of model .* \(in .*Custom\) applies 2 "
                                           r"update\(s\) per step \(sgd.*, second\).*several "
                                           "optimizers"):
        capture(model)


def test_custom_train_step_calling_keras_own_is_captured():
    class Custom(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    inputs = keras.Input((12,))
    model = Custom(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    item = capture(model)
    assert [log.name for log in item.proto.custom_step.logs] == ["loss", "mae"]


@pytest.mark.parametrize("reduction", [None, "none"])
def test_unreduced_loss_is_refused(reduction):
    """Keras' fit trains on the sum of unreduced values and reports their mean."""
    inputs = keras.Input((12,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction=reduction))
    with pytest.raises(CaptureError, match=f"reduction={reduction!r}.*reduction='sum'"):
        capture(model)


def test_a_loss_reduced_by_a_sum_as_a_metric_is_refused():
    inputs = keras.Input((12,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse",
                  metrics=[keras.losses.MeanSquaredError(reduction="sum")])
    with pytest.raises(CaptureError, match="metric 'mean_squared_error'.*reduction='sum'"):
        capture(model)


def test_sum_and_mean_over_the_weights_are_found_and_the_mean_needs_nothing():
    """Trained as Keras: `tests/kernels/test_loss_reductions.py`, on clusters
    `tests/runtime/test_loss_reductions_cluster.py`."""
    inputs = keras.Input((12,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    found = {}
    for reduction in ("sum", "mean_with_sample_weight", "mean", "sum_over_batch_size"):
        model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction=reduction))
        found[reduction] = [(r.reduction, r.node) for r in capture(model).loss_reductions]
    assert found == {"sum": [("sum", "autodist_loss_sum_scale_0")],
                     "mean_with_sample_weight": [("mean_with_sample_weight",
                                                  "compile_loss/mean_squared_error/Sum_1")],
                     "mean": [], "sum_over_batch_size": []}


def test_a_loss_reducing_otherwise_than_it_says_is_refused():
    class OwnSum(keras.losses.Loss):
        def __call__(self, y_true, y_pred, sample_weight=None):   # ignores the weights
            return keras.ops.sum(keras.ops.square(y_true - y_pred))

    inputs = keras.Input((12,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss=OwnSum(reduction="sum", name="own_sum"))
    with pytest.raises(CaptureError, match="'own_sum'.*does not weigh its values"):
        capture(model)


@pytest.mark.parametrize("make_layer", [
    lambda: keras.layers.LSTM(4, stateful=True),
    lambda: keras.layers.GRU(4, stateful=True),
    lambda: keras.layers.SimpleRNN(4, stateful=True),
    lambda: keras.layers.Bidirectional(keras.layers.LSTM(4, stateful=True)),
], ids=["LSTM", "GRU", "SimpleRNN", "Bidirectional"])
def test_a_stateful_rnn_is_refused_naming_the_layer(make_layer):
    """Keras carries a stateful RNN's states from batch to batch per example position,
    which replicas splitting the batch cannot: refused before tracing, naming the layer."""
    inputs = keras.Input(batch_shape=(8, 5, 3))
    layer = make_layer()
    model = keras.Model(inputs, keras.layers.Dense(1)(layer(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(CaptureError, match=f"stateful recurrent layer.*'{layer.name}' "
                                           f"\\({type(layer).__name__}\\).*stateful=False"):
        capture(model)


def _mlp(optimizer):
    return autodist.models.mlp(input_dim=20, hidden=(64,), optimizer=optimizer)


def test_learning_rate_override_of_a_schedule_is_refused():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    gi = capture(_mlp(keras.optimizers.SGD(schedule)))
    spec = ResourceSpec.local(workers=2, ps=0)
    strategy = builders.AllReduce().build(gi, spec).with_hyperparameters(learning_rate=0.2)
    with pytest.raises(StrategyError, match="learning rate is a schedule \\(ExponentialDecay\\)"):
        strategy.validate(gi, spec)


def test_clipnorm_refuses_a_variable_split_between_ps_and_all_reduce():
    gi = capture(_mlp(keras.optimizers.SGD(0.1, clipnorm=1.0)))
    spec = ResourceSpec.local(workers=2, ps=2)
    space = SearchSpace(gi, spec)
    assert space.clipping == "clipnorm"
    assert all(len({s.WhichOneof("kind") for s in option.shards}) == 1
               for options in space.options for option in options)
    from tests.runtime.test_distributed_training import _Hybrid

    plain = capture(_mlp(keras.optimizers.SGD(0.1)))
    hybrid = _Hybrid().build(plain, spec)
    with pytest.raises(StrategyError, match="clipnorm=1.*has shards updated by all-reduce "
                                            "and synchronous PS"):
        hybrid.validate(gi, spec)


def test_global_clipnorm_needs_one_kind_of_synchronizer():
    gi = capture(autodist.models.embedding_model(
        num_users=50, num_items=71, dim=8,
        optimizer=keras.optimizers.Adam(0.01, global_clipnorm=1.0)))
    spec = ResourceSpec.local(workers=2, ps=1)
    with pytest.raises(StrategyError, match="global_clipnorm=1.*all-reduce and synchronous PS"):
        builders.Parallax().build(gi, spec)  # embeddings on the PS, dense all-reduced
    builders.PS().build(gi, spec)
    builders.AllReduce().build(gi, spec)
    plan = autodist.optimize(None, spec, graph_item=gi, cost_model="simulator",
                             search_budget=200)
    kinds = {s.WhichOneof("kind") for v in plan.strategy.proto.variables for s in v.shards}
    assert kinds == {"all_reduce"}


def test_optimize_captures_a_subclassed_model_from_an_example():
    model = Subclassed()
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, labels, _ = _rng_data(np.random.default_rng(4))
    plan = autodist.optimize(model, ResourceSpec.local(workers=2, ps=1), x=x, y=labels,
                             cost_model="simulator", search_budget=200)
    assert plan.graph_item.variable_names == [v.path for v in model.trainable_variables]


class _MaxPrediction(keras.metrics.Metric):
    """Keeps a maximum: not a sum over examples."""

    def __init__(self, name="max_prediction"):
        super().__init__(name=name)
        self.best = self.add_variable(shape=(), initializer="zeros", name="best")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.best.assign(keras.ops.maximum(self.best, keras.ops.max(y_pred)))

    def result(self):
        return self.best


class _MeanAbs(keras.metrics.Mean):
    """A custom metric built on Keras' Mean: sums and counts."""

    def update_state(self, y_true, y_pred, sample_weight=None):
        super().update_state(keras.ops.abs(y_pred), sample_weight=sample_weight)


def test_metric_states_are_captured_and_unsummable_metrics_refused():
    model = autodist.models.mlp(input_dim=12, hidden=(8,), optimizer=keras.optimizers.SGD(0.1))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy", _MeanAbs(name="mean_abs")])
    gi = capture(model)
    assert [t.name for t in gi.metric_states] == [
        "loss/total", "loss/count", "accuracy/total", "accuracy/count", "mean_abs/total",
        "mean_abs/count"]
    assert gi.sample_weight_input.name == "sample_weight"
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                  metrics=[_MaxPrediction()])
    with pytest.raises(autodist.CaptureError, match="metric 'max_prediction' \\(_MaxPrediction\\)"
                                                    " of model .* keeps state that is not a sum"):
        capture(model)


def test_a_metric_outside_compile_is_refused():
    class WithOwnMetric(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)
            self.tracker = keras.metrics.Mean(name="own")

        def call(self, x):
            return self.dense(x)

    model = WithOwnMetric()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = np.zeros((4, 5), np.float32)
    with pytest.raises(autodist.CaptureError, match="metric 'own' \\(Mean\\) outside "
                                                    "compile\\(metrics=...\\)"):
        capture(model, x=x, y=np.zeros((4, 3), np.float32))


def test_metric_logs_refuse_a_model_compiled_again_with_other_metrics():
    from autodist.runtime.metric_logs import MetricLogs

    model = autodist.models.mlp(input_dim=12, hidden=(8,), optimizer=keras.optimizers.SGD(0.1))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    gi = capture(model)
    logs = MetricLogs(model, gi)
    assert logs([6.0, 3.0, 2.0, 4.0]) == \
        {"accuracy": 0.5}
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                  metrics=["sparse_top_k_categorical_accuracy"])
    model._symbolic_build(data_batch=(np.zeros((2, 12), np.float32), np.zeros(2, np.int32)))
    with pytest.raises(autodist.AutodistError, match="not those it was captured with"):
        MetricLogs(model, gi)


def test_metric_logs_are_reused_by_later_fits_until_the_model_is_compiled_again():
    """A run's later fits reuse its MetricLogs (and their traced function: no retracing,
    which TensorFlow warns about after a few fits); a model compiled again gets new
    ones, reading its new metric variables."""
    from autodist.runtime.metric_logs import MetricLogs

    model = autodist.models.mlp(input_dim=12, hidden=(8,), optimizer=keras.optimizers.SGD(0.1))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    gi = capture(model)
    logs = MetricLogs(model, gi)
    for _ in range(3):
        logs = logs.reused(model, gi)
        assert logs([6.0, 3.0, 2.0, 4.0]) == {"accuracy": 0.5}
    assert logs._results.experimental_get_tracing_count() == 1
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    model._symbolic_build(data_batch=(np.zeros((2, 12), np.float32), np.zeros(2, np.int32)))
    again = logs.reused(model, gi)
    assert again is not logs and again([1.0, 4.0, 3.0, 4.0]) == {"accuracy": 0.75}


def test_a_position_embedding_over_a_variable_length_is_captured_dense():
    # keras-io's NMT and text transformers look positions up at arange(length of the
    # batch): the indices read the input's shape, not its ids, so every row is summed
    # over the batch and Adam must square the sum (a sparse capture squared each
    # replica's part: 8e-4 in the weights on 2 workers, silently).
    class TokenAndPosition(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.tokens = keras.layers.Embedding(20, 4, name="tokens")
            self.positions = keras.layers.Embedding(8, 4, name="positions")

        def call(self, ids):
            length = keras.ops.shape(ids)[-1]
            return self.tokens(ids) + self.positions(keras.ops.arange(0, length, 1))

    ids = keras.Input((None,), dtype="int64", name="ids")
    pooled = keras.layers.GlobalAveragePooling1D()(TokenAndPosition(name="embed")(ids))
    model = keras.Model(ids, keras.layers.Dense(2)(pooled))
    model.compile(optimizer="adam", loss="mse")
    sparse = {v.name: v.sparse_gradient for v in capture(model).variables}
    assert sparse["embed/positions/embeddings"] is False
    assert sparse["embed/tokens/embeddings"] is True   # each row one example's lookup


def test_batch_normalization_of_the_model_input_is_summed_forward_only():
    # Nothing trainable before it: the step has no gradient of its moments, and its
    # statistics are summed over replicas in the forward pass alone (it was refused
    # as "not syncable" and each replica normalized with its own half of the batch).
    model = keras.Sequential([keras.Input((6,)), keras.layers.BatchNormalization(name="bn_in"),
                              keras.layers.Dense(4, activation="tanh"),
                              keras.layers.BatchNormalization(name="bn_hidden"),
                              keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    # Named by their name scope in the traced step ("sequential_1/bn_in_1").
    found = {bn.layer.split("/")[-1].rsplit("_", 1)[0]: bn for bn in capture(model).batch_norms}
    assert set(found) == {"bn_in", "bn_hidden"}, list(found)
    assert found["bn_in"].syncable and not found["bn_in"].mean_gradient
    assert found["bn_hidden"].syncable and found["bn_hidden"].mean_gradient


class _TargetsLoss(keras.layers.Layer):
    """An endpoint layer: its loss of targets given as a model input, by add_loss."""

    def call(self, logits, targets):
        self.add_loss(keras.losses.BinaryCrossentropy(from_logits=True)(targets, logits))
        return keras.ops.sigmoid(logits)


def test_a_model_compiled_without_a_loss_trains_on_its_added_loss_without_targets():
    features = keras.Input((12,), name="features")
    targets = keras.Input((1,), name="targets")
    logits = keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(features))
    model = keras.Model([features, targets], _TargetsLoss()(logits, targets))
    model.compile(optimizer=keras.optimizers.SGD(1.0))   # no loss: Keras reads no y
    rng = np.random.default_rng(3)
    x = rng.normal(size=(BATCH, 12)).astype(np.float32)
    t = (rng.random((BATCH, 1)) < 0.5).astype(np.float32)
    gi = _check_equals_keras_step(model, [x, t], None, {"features": x, "targets": t})
    assert gi.target_inputs == [] and gi.sample_weight_inputs == []
    assert [a.kind for a in gi.proto.added_losses] == ["mean"]


def test_a_model_without_any_loss_is_refused():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd")
    with pytest.raises(CaptureError, match="without a loss and none of its layers adds one"):
        capture(model)


_MODULE_SEEDS = keras.random.SeedGenerator(1337)


class _DropPath(keras.layers.Layer):
    """keras-io's drop path (examples/vision/shiftvit.py, cct.py variants): a
    per-example keep draw from `keras.random.uniform` without a seed, or with a
    module-level SeedGenerator (an attribute of the layer would be tracked)."""

    def __init__(self, module_seeds: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.module_seeds = module_seeds

    def call(self, x, training=None):
        if training:
            shape = (keras.ops.shape(x)[0],) + (1,) * (len(x.shape) - 1)
            seed = _MODULE_SEEDS if self.module_seeds else None
            keep = keras.ops.floor(0.8 + keras.random.uniform(shape, 0, 1, seed=seed))
            return x / 0.8 * keep
        return x


@pytest.mark.parametrize("module_seeds", [False, True], ids=["global", "module-level"])
def test_a_draw_from_a_seed_generator_outside_the_model_is_refused_naming_the_fix(
        module_seeds: bool) -> None:
    """Keras' fit trains it (the global or module-level SeedGenerator's state advances in
    Keras' process); the capture names the layer's own SeedGenerator as the fix instead
    of a bare "reads a resource"."""
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1)(_DropPath(module_seeds)(keras.layers.Dense(8)(inputs)))
    model = keras.Model(inputs, outputs)
    model.compile("sgd", "mse")
    with pytest.raises(CaptureError, match=r"drop_path.*self\.seed_generator = "
                                           r"keras\.random\.SeedGenerator"):
        capture(model)


def _ctc_like_model():
    """Spectrogram frames of any number in, per-frame class scores out (keras-io's
    ctc_asr); its loss compares them with label sequences of any length."""
    def loss(y_true, y_pred):
        target = tf.reduce_mean(tf.cast(y_true, tf.float32), axis=1, keepdims=True)
        return tf.reduce_mean(tf.square(tf.reduce_mean(y_pred, axis=1) - target), axis=1,
                              keepdims=True)

    inputs = keras.Input((None, 5), name="frames")
    model = keras.Model(inputs, keras.layers.Dense(4)(inputs))
    model.compile(keras.optimizers.SGD(0.1), loss=loss)
    return model


def test_an_example_batch_fixes_no_length_the_model_takes_any_of():
    """A padded batch as x has one length; the model takes any (keras.Input((None, 5))):
    the capture keeps it unknown (before, the fit's batches of other lengths failed at
    their first step)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 11, 5)).astype(np.float32)
    y = rng.integers(0, 3, size=(4, 7))
    item = capture(_ctc_like_model(), x=x, y=y)
    shapes = {info.name: list(info.shape) for info in item.inputs}
    assert shapes["frames"] == [-1, -1, 5]
    assert shapes["y"] == [-1, 7]   # targets: as the example, unless given as specs


def test_the_dataset_fit_reads_gives_the_inputs_and_targets():
    """capture(model, x=dataset): the batches' specs, lengths padded_batch leaves
    unknown unknown, as Keras' traced step has them."""
    rng = np.random.default_rng(0)

    def examples():
        for n in (6, 9, 4, 8):
            yield (rng.normal(size=(n, 5)).astype(np.float32),
                   rng.integers(0, 3, size=n // 2))

    dataset = tf.data.Dataset.from_generator(examples, output_signature=(
        tf.TensorSpec([None, 5], tf.float32), tf.TensorSpec([None], tf.int64))
    ).padded_batch(2)
    item = capture(_ctc_like_model(), x=dataset)
    shapes = {info.name: (list(info.shape), tf.as_dtype(info.dtype).name)
              for info in item.inputs}
    assert shapes["frames"] == ([-1, -1, 5], "float32")
    assert shapes["y"] == ([-1, -1], "int64")
    assert shapes["sample_weight"] == ([-1, 1], "float32")


class _TableAtFixedRows(keras.layers.Layer):
    """A bias table read through a fixed index of rows (Swin's relative position bias)."""
    def __init__(self, rows, **kwargs):
        super().__init__(**kwargs)
        self.rows = rows

    def build(self, input_shape):
        self.table = self.add_weight(shape=(4,), initializer="ones", name="table")
        self.index = keras.Variable(np.array(self.rows, np.int32), trainable=False,
                                    name="index")

    def call(self, h):
        return h + tf.gather(self.table, self.index)


@pytest.mark.parametrize("rows,optimizer,refused", [
    ([0, 1, 1, 2], "adam", True), ([0, 1, 2, 3], "adam", False), ([0, 1, 1, 2], "sgd", False)])
def test_a_table_read_at_fixed_rows_that_repeat_is_refused_where_squares_differ(
        rows, optimizer, refused):
    """Keras' Adam squares each lookup's gradient over the batch before adding repeats;
    replicas hold parts of every lookup (before: 2e-2 off with Adam, silently; keras-io's
    Swin Transformer). Unique rows, SGD, or one replica train as Keras."""
    from autodist.ir.errors import AutodistError
    from autodist.runtime import keras_parity

    inputs = keras.Input((4,), name="features")
    model = keras.Model(inputs, _TableAtFixedRows(rows)(keras.layers.Dense(4)(inputs)))
    model.compile(optimizer, "mse")
    item = capture(model)
    table = next(v for v in item.variables if v.name.endswith("table"))
    assert table.gradient.repeated_lookups == refused
    strategy = builders.AllReduce().build(item, ResourceSpec.local(workers=1))
    keras_parity.check(model, item, strategy)   # one replica: as Keras
    split = strategy.with_virtual_nodes(8, 2)
    if refused:
        with pytest.raises(AutodistError, match=r"variable\(s\) \['.*table'\] .* fixed index"
                                                r".*\(Adam\) squares the gradient"):
            keras_parity.check(model, item, split)
    else:
        keras_parity.check(model, item, split)


def test_a_model_whose_inference_path_does_not_trace_is_captured_as_fit_builds_it():
    """RandomCrop passes the resized image through uncropped at inference (Keras 3.15),
    so a Reshape sized for the crop fails there; Keras' fit never traces inference mode
    (keras-io's token_learner). The capture built the metrics with Keras' inference-mode
    build and refused the model; it now builds them in training mode, as fit does."""
    inputs = keras.Input((12, 12, 3))
    h = keras.layers.Reshape((64 * 3,))(keras.layers.RandomCrop(8, 8, seed=3)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    item = capture(model)
    assert item.metric_states and item.variables


class OwnLossModel(keras.Model):
    """A model's own compute_loss, compiled without a loss (keras-io's masked language
    model): Keras' step hands it the targets."""
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return keras.ops.mean((y - y_pred) ** 2)


def test_a_compute_loss_override_without_a_compiled_loss_takes_the_targets():
    """Before, the capture took no targets (no compiled loss or metrics) and the step
    failed on `y - y_pred` with y None, asking for y=, which the user had given."""
    inputs = keras.Input((4,), name="features")
    model = OwnLossModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(keras.optimizers.SGD(0.1))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    item = capture(model, x=x, y=x[:, :1])
    assert [info.name for info in item.target_inputs] == ["y"]


class PlainVariableLayer(keras.layers.Layer):
    """A weight made as a plain tf.Variable (keras-io's traffic forecasting GraphConv):
    Keras 3 does not track it."""
    def build(self, input_shape):
        self.weight = tf.Variable(tf.ones((input_shape[-1], 2)))

    def call(self, h):
        return tf.matmul(h, self.weight)


@pytest.mark.parametrize("dropout", [False, True])
def test_a_plain_tf_variable_in_a_layer_is_refused_naming_add_weight(dropout):
    """Before a Dropout (keras-io's small-data ViT: LSA's temperature), whose draw's shape
    follows the layer's output, it was named a seed generator."""
    inputs = keras.Input((4,), name="features")
    h = PlainVariableLayer()(inputs)
    if dropout:
        h = keras.layers.Dropout(0.1)(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile("sgd", "mse")
    with pytest.raises(CaptureError, match=r"not one of the model's variables.*plain "
                                           r"tf.Variable.*self.add_weight"):
        capture(model)


def test_an_untracked_seed_generator_is_refused_naming_the_attribute_to_make():
    """keras-io's Perceiver: the model calls a module-level data_augmentation Sequential
    that is not one of its attributes (its RandomFlip's seed generator is untracked)."""
    augmentation = keras.Sequential([keras.layers.RandomFlip("horizontal", seed=1)])

    class UntrackedAugmentation(keras.Model):
        def __init__(self):
            super().__init__()
            self.head = keras.layers.Dense(1)

        def call(self, x):
            return self.head(keras.layers.Flatten()(augmentation(x)))

    model = UntrackedAugmentation()
    model.compile("sgd", "mse")
    x = np.zeros((4, 3, 3, 1), np.float32)
    with pytest.raises(CaptureError, match=r"seed generator that is not one of the model's "
                                           r"variables .*self.data_augmentation = "):
        capture(model, x=x, y=x[:, 0, 0])


def test_a_dict_of_examples_for_a_model_of_listed_inputs_is_matched_by_name():
    """The zoo's ticket_triage: inputs listed (title, body, tags), x a dict (sorted: body,
    tags, title). The example's dims relaxed in list order took another input's shape."""
    title = keras.Input((None,), name="title")
    tags = keras.Input((6,), name="tags")
    h = keras.layers.Concatenate()([keras.layers.GlobalAveragePooling1D()(
        keras.layers.Embedding(10, 4)(title)), tags])
    model = keras.Model([title, tags], keras.layers.Dense(1)(h))
    model.compile("sgd", "mse")
    x = {"title": np.ones((4, 9), np.int64), "tags": np.ones((4, 6), np.float32)}
    item = capture(model, x=x, y=np.ones((4, 1), np.float32))
    shapes = {info.name: list(info.shape) for info in item.model_inputs}
    assert shapes == {"title": [-1, -1], "tags": [-1, 6]}
