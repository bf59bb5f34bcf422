"""Optimizer options and Keras model kinds on real clusters equal single-device Keras `fit`.

Learning-rate schedules, gradient clipping, weight decay, a model with two
outputs and a subclassed model train on 2 worker processes (+ PS processes
where the strategy uses them): 2 epochs of 3 global batches of 32 (the last
one short). Weights and per-epoch losses must equal Keras `fit` of an
identical model on the same data: |distributed - keras| <= 2e-5. Where an
option is tested, Keras' result without it differs by far more, so the test
sees the option at work.
"""
from __future__ import annotations

import numpy as np
import pytest

import keras
import autodist
from autodist import models
from autodist.search import builders

pytestmark = pytest.mark.cluster

TOLERANCE = 2e-5
EXAMPLES = 90
BATCH = 32
EPOCHS = 2


def _ncf_data():
    rng = np.random.default_rng(0)
    return ([rng.integers(0, 50, (EXAMPLES, 1)).astype("int32"),
             rng.integers(0, 71, (EXAMPLES, 1)).astype("int32")],
            rng.integers(0, 2, (EXAMPLES, 1)).astype("float32"))


def _mlp_data():
    rng = np.random.default_rng(1)
    return (rng.normal(size=(EXAMPLES, 20)).astype("float32"),
            rng.integers(0, 10, EXAMPLES).astype("int32"))


def _keras_fit(make_model, x, y):
    reference = make_model()
    history = reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return reference.get_weights(), history.history["loss"]


def _check(make_model, x, y, build_strategy, spec, job_dir, without=None):
    """Trains make_model() distributed; compares with Keras fit of another make_model().

    Args:
        without: Makes the same model without the option under test: its Keras
            result must differ, so the comparison sees the option.
    """
    expected, keras_losses = _keras_fit(make_model, x, y)
    if without is not None:
        plain, _ = _keras_fit(without, x, y)
        assert max(np.abs(a - b).max() for a, b in zip(plain, expected)) > 1e-3
    model = make_model()
    graph_item = autodist.capture(model)
    strategy = build_strategy(graph_item, spec)
    run = autodist.distribute(model, strategy, spec, graph_item=graph_item, job_dir=job_dir)
    history = run.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False)
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(history.history["loss"], keras_losses, rtol=1e-4)
    return strategy


def _ncf(optimizer):
    return lambda: models.embedding_model(num_users=50, num_items=71, dim=8,
                                          optimizer=optimizer())


# Adam's epsilon is raised from 1e-7 in these cases: with rates this large, an
# element whose gradient is rounding noise (terms that cancel, summed in
# another order by the cluster) moves by up to the rate times noise / epsilon;
# with 1e-7, 3 of 568 embedding entries differed by 4e-5 (the rest by 2e-7).
EPSILON = 1e-3
CASES = {
    # Schedules evaluated per update; clipnorm over a variable's PS shards and
    # a table's looked-up rows.
    "exponential_clipnorm_partitioned_ps": (
        lambda **kw: keras.optimizers.Adam(
            keras.optimizers.schedules.ExponentialDecay(0.05, 2, 0.5), epsilon=EPSILON, **kw),
        {"clipnorm": 0.02},
        lambda gi, spec: builders.PartitionedPS(min_shard_bytes=64).build(gi, spec), 2),
    # global_clipnorm over every all-reduced and all-gathered gradient.
    "piecewise_global_clipnorm_all_reduce": (
        lambda **kw: keras.optimizers.Adam(
            keras.optimizers.schedules.PiecewiseConstantDecay([2, 4], [0.05, 0.02, 0.005]),
            epsilon=EPSILON, **kw),
        {"global_clipnorm": 0.05},
        lambda gi, spec: builders.AllReduce().build(gi, spec), 0),
    # clipvalue: dense gradients after aggregation, looked-up rows before.
    "cosine_clipvalue_ps": (
        lambda **kw: keras.optimizers.SGD(
            keras.optimizers.schedules.CosineDecay(0.0, 6, warmup_target=0.5, warmup_steps=2),
            momentum=0.9, **kw),
        {"clipvalue": 0.002},
        lambda gi, spec: builders.PS().build(gi, spec), 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_schedules_and_clipping_equal_single_device(case, tmp_path):
    optimizer, option, build, ps = CASES[case]
    x, y = _ncf_data()
    _check(_ncf(lambda: optimizer(**option)), x, y, build,
           autodist.ResourceSpec.local(workers=2, ps=ps), str(tmp_path / "job"),
           without=_ncf(lambda: optimizer()))


def _decayed_sgd():
    return models.mlp(input_dim=20, hidden=(32,),
                      optimizer=keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.05))


def _decayed_adam():
    optimizer = keras.optimizers.Adam(0.02, epsilon=EPSILON, weight_decay=0.05)
    model = models.embedding_model(num_users=50, num_items=71, dim=8, optimizer=optimizer)
    optimizer.exclude_from_weight_decay(
        var_list=[model.get_layer("item_embedding").embeddings], var_names=["bias"])
    return model


def test_weight_decay_on_sgd_with_ps_equals_single_device(tmp_path):
    x, y = _mlp_data()
    _check(_decayed_sgd, x, y, lambda gi, spec: builders.PS().build(gi, spec),
           autodist.ResourceSpec.local(workers=2, ps=1), str(tmp_path / "job"),
           without=lambda: models.mlp(input_dim=20, hidden=(32,),
                                      optimizer=keras.optimizers.SGD(0.1, momentum=0.9)))


def test_weight_decay_on_adam_with_exclusions_equals_single_device(tmp_path):
    x, y = _ncf_data()
    _check(_decayed_adam, x, y, lambda gi, spec: builders.Parallax(min_shard_bytes=64)
           .build(gi, spec), autodist.ResourceSpec.local(workers=2, ps=1),
           str(tmp_path / "job"),
           without=_ncf(lambda: keras.optimizers.Adam(0.02, epsilon=EPSILON)))


def _two_outputs():
    keras.utils.set_random_seed(2)
    features = keras.Input((24,), name="features")
    hidden = keras.layers.Dense(32, activation="relu", name="hidden",
                                kernel_regularizer=keras.regularizers.L2(0.01))(features)
    label = keras.layers.Dense(5, name="label")(hidden)
    score = keras.layers.Dense(1, name="score")(hidden)
    model = keras.Model(features, [label, score])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=[keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"],
                  loss_weights=[1.0, 0.3])
    return model


def test_two_output_model_equals_single_device(tmp_path):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(EXAMPLES, 24)).astype("float32")
    y = [rng.integers(0, 5, EXAMPLES).astype("int32"),
         rng.normal(size=(EXAMPLES, 1)).astype("float32")]
    strategy = _check(_two_outputs, x, y,
                      lambda gi, spec: builders.PartitionedPS(min_shard_bytes=64).build(gi, spec),
                      autodist.ResourceSpec.local(workers=2, ps=2), str(tmp_path / "job"))
    assert any(c.partitioner.num_shards > 1 for c in strategy.proto.variables)


class Tower(keras.Model):
    """A subclassed model: its inputs are known only from an example batch."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(32, activation="relu")
        self.dropout_free = keras.layers.LayerNormalization()
        self.out = keras.layers.Dense(10)

    def call(self, x, training=None):
        return self.out(self.dropout_free(self.hidden(x)))


def test_subclassed_model_via_optimize_with_an_example_equals_single_device(tmp_path):
    x, y = _mlp_data()

    def make():
        keras.utils.set_random_seed(3)
        model = Tower()
        model.compile(optimizer=keras.optimizers.RMSprop(0.01, momentum=0.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model(x[:1])
        return model

    expected, keras_losses = _keras_fit(make, x, y)
    model = make()
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    plan = autodist.optimize(model, spec, x=x, y=y, cost_model="simulator", search_budget=200)
    history = plan.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0,
                       job_dir=str(tmp_path / "job"), shuffle=False)
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(history.history["loss"], keras_losses, rtol=1e-4)


def test_a_callback_cannot_change_a_learning_rate_the_strategy_fixes(tmp_path):
    """Callbacks change a fixed rate between epochs (tests/runtime/test_keras_fit_semantics.py),
    but not one the strategy sets: that run stops, naming both."""
    x, y = _mlp_data()
    model = models.mlp(input_dim=20, hidden=(32,), optimizer=keras.optimizers.SGD(0.1))
    spec = autodist.ResourceSpec.local(workers=2, ps=0)
    strategy = builders.AllReduce().build(autodist.capture(model), spec)
    run = autodist.distribute(model, strategy.with_hyperparameters(learning_rate=0.1), spec,
                              job_dir=str(tmp_path / "job"))
    decay = keras.callbacks.LearningRateScheduler(lambda epoch, rate: 0.1 / (1 + epoch))
    with pytest.raises(autodist.AutodistError, match="callback LearningRateScheduler changed "
                                                     "the optimizer's learning rate in "
                                                     "on_epoch_begin \\(from 0.1 to 0.05.*"
                                                     "the strategy sets it"):
        run.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=[decay],
                shuffle=False)


def test_a_schedule_continues_from_a_checkpoints_step(tmp_path):
    """The schedule's step is the update count, restored with the checkpoint."""
    def make():
        return models.embedding_model(
            num_users=50, num_items=71, dim=8, optimizer=keras.optimizers.Adam(
                keras.optimizers.schedules.PiecewiseConstantDecay([3], [0.05, 0.005]),
                epsilon=EPSILON))

    x, y = _ncf_data()
    expected, _ = _keras_fit(make, x, y)
    model = make()
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    graph_item = autodist.capture(model)
    strategy = builders.PS().build(graph_item, spec)
    ckpt = str(tmp_path / "ckpt")
    autodist.distribute(model, strategy, spec, graph_item=graph_item).fit(
        x, y, batch_size=BATCH, epochs=1, verbose=0, checkpoint_dir=ckpt, shuffle=False)
    resumed = make()
    autodist.distribute(resumed, strategy, spec, graph_item=graph_item).fit(
        x, y, batch_size=BATCH, epochs=1, verbose=0, initial_checkpoint=ckpt, shuffle=False)
    for got, want in zip(resumed.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
