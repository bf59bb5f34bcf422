"""Transfer learning and fine-tuning, as keras-io's guide does it: a base model frozen
(`base.trainable = False`, called with `training=False`) under a new head, then unfrozen
and compiled again with a lower learning rate.

Frozen variables are state of the capture: the run reads them and never updates them,
and a frozen BatchNormalization runs in inference mode (as in Keras 3), on any number of
workers and virtual nodes. A fit after `compile` again or a `trainable` change is refused
before launch (`autodist.runtime.compile_state`); `autodist.optimize(model)` again
trains the model as it is then, as Keras' second fit does.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import keras
import autodist
from autodist.runtime.compile_state import ModelChangedError
from autodist.runtime.keras_parity import ParityWarning
from autodist.search import builders
from tests.keras_equal import assert_trains_as_keras, twin_models, two_worker_run


def _data(n: int = 64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype("float32"), rng.normal(size=(n,)).astype("float32")


def _base_and_model():
    """The guide's shape: a base (Dense, BatchNormalization) called in inference mode
    under a new head."""
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, use_bias=False, name="base_dense")(inputs)
    hidden = keras.layers.BatchNormalization(name="base_bn")(hidden)
    base = keras.Model(inputs, keras.layers.Activation("relu")(hidden), name="base")
    x = keras.Input((6,))
    head = keras.layers.Dense(1, name="head")(base(x, training=False))
    return base, keras.Model(x, head)


def _frozen_pair():
    """(base, model) twice with the same weights, each base frozen and the model compiled."""
    keras.utils.set_random_seed(3)
    pairs = [_base_and_model(), _base_and_model()]
    pairs[1][1].set_weights(pairs[0][1].get_weights())
    for base, model in pairs:
        base.trainable = False
        model.compile(keras.optimizers.Adam(0.05), "mse", metrics=["mae"])
    return pairs


def _compile_again(model, rate: float = 1e-3) -> None:
    model.compile(keras.optimizers.Adam(rate), "mse", metrics=["mae"])


# ------------------------------------------------------------ without clusters
def test_a_fit_after_compile_again_is_refused_before_launch():
    (base, model), _ = _frozen_pair()
    run = two_worker_run(model)
    base.trainable = True
    _compile_again(model)
    with pytest.raises(ModelChangedError, match=(
            r"the model was compiled again .* and the model's trainable variables changed: "
            r"3 trainable now \(base_dense/kernel, base_bn/gamma, base_bn/beta\)"
            r" since "
            r"this DistributedRun captured it; .* call autodist.optimize\(model\) again")):
        run.fit(*_data(), batch_size=16, verbose=0)


def test_compile_again_alone_and_trainable_alone_are_refused_too():
    (base, model), _ = _frozen_pair()
    run = two_worker_run(model)
    model.optimizer.learning_rate = 0.01   # no change: the run trains with the model's rate
    run._compiled.check(model, "this DistributedRun")
    _compile_again(model)
    with pytest.raises(ModelChangedError, match=r"^the model was compiled again \(its "
                                                r"optimizer, loss and metrics are new\) since"):
        run.fit(*_data(), batch_size=16, verbose=0)

    (base, model), _ = _frozen_pair()
    run = two_worker_run(model)
    model.get_layer("head").trainable = False
    base.get_layer("base_dense").trainable = True
    with pytest.raises(ModelChangedError, match=(
            r"^the model's trainable variables changed: 1 trainable now \(base_dense/kernel\); "
            r"2 frozen now \(head/kernel, head/bias\) since .* compile the model again \("
            r"Keras' fit, too, trains the variables of the last compile until then\)")):
        run.fit(*_data(), batch_size=16, verbose=0)


def test_a_plan_or_a_capture_older_than_the_trainable_flags_is_refused():
    (base, model), _ = _frozen_pair()
    plan = autodist.optimize(model, search_budget=50)
    item = autodist.capture(model)
    base.trainable = True
    with pytest.raises(ModelChangedError, match="since autodist.optimize captured it"):
        plan.fit(*_data(), batch_size=16, verbose=0)
    spec = autodist.ResourceSpec.local(workers=2)
    with pytest.raises(ModelChangedError, match=(
            r"the capture is of other trainable variables than the model's now \(5 trainable; "
            r"3 not in the capture: base_dense/kernel, base_bn/gamma, base_bn/beta; 0 "
            r"of")):
        autodist.distribute(model, plan.strategy, spec, graph_item=item)


def test_a_capture_after_a_trainable_change_without_compile_is_refused():
    """Keras' fit trains the compiled variables until compile is called again (it warns);
    its optimizer, built by a fit for them, cannot update others."""
    (base, model), _ = _frozen_pair()
    model.optimizer.build(model.trainable_variables)   # as after a fit
    base.trainable = True
    with pytest.raises(autodist.CaptureError, match=(
            r"optimizer was built for 2 variables, but 5 are trainable now: a layer's "
            r"`trainable` changed since the model was compiled.*Call model.compile")):
        autodist.capture(model)
    _compile_again(model)
    assert len(autodist.capture(model).variables) == 5


# ------------------------------------------------------------ on clusters
@pytest.mark.cluster
def test_a_frozen_base_then_fine_tuning_train_as_keras():
    """The guide's two phases, 2 epochs each, on 2 workers with a parameter server: the
    frozen base (its kernel and BatchNormalization's statistics) unchanged by the first
    fit, the head as Keras'; then the base unfrozen, compiled again with a lower rate and
    planned again, as Keras' second fit (the new Adam's fresh state included)."""
    x, y = _data()
    (base, model), (ref_base, reference) = _frozen_pair()
    frozen = [w.copy() for w in base.get_weights()]
    run = two_worker_run(model, ps=1, builder=builders.PS)
    history = run.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    keras_history = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(base.get_weights(), frozen):
        np.testing.assert_array_equal(got, want)
    assert_trains_as_keras(model, reference, history, keras_history)

    for b, m in ((base, model), (ref_base, reference)):
        b.trainable = True
        _compile_again(m)
    with pytest.raises(ModelChangedError):
        run.fit(x, y, batch_size=16, verbose=0)
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    history = autodist.optimize(model, spec, search_budget=200).fit(
        x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    keras_history = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert not np.allclose(base.get_weights()[0], frozen[0])
    assert int(model.optimizer.iterations.numpy()) == 8
    assert_trains_as_keras(model, reference, history, keras_history)


@pytest.mark.cluster
def test_a_frozen_batch_normalization_in_a_trainable_model_on_virtual_nodes():
    """A BatchNormalization with trainable=False runs in inference mode (Keras 3): with
    4 virtual nodes no ghost statistics, the moving statistics unchanged, Keras' numbers."""
    def build():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                                  keras.layers.BatchNormalization(name="frozen_bn"),
                                  keras.layers.Dense(1)])
        model.get_layer("frozen_bn").trainable = False
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
        return model

    model, reference = twin_models(build, seed=5)
    statistics = [w.copy() for w in model.get_layer("frozen_bn").get_weights()]
    spec = autodist.ResourceSpec.local(workers=2)
    item = autodist.capture(model)
    strategy = builders.AllReduce().build(item, spec).with_virtual_nodes(32, 4)
    x, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ParityWarning)   # no ghost batch normalization
        run = autodist.distribute(model, strategy, spec, graph_item=item)
    history = run.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    keras_history = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(model.get_layer("frozen_bn").get_weights(), statistics):
        np.testing.assert_array_equal(got, want)
    assert_trains_as_keras(model, reference, history, keras_history)
