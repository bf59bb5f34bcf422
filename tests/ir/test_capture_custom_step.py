"""Models overriding `train_step` (one optimizer, one apply, logs that are metric
results) captured as they run, against Keras' own step; what is not taken is refused,
each naming what was found."""
from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from autodist.ir.capture import capture
from autodist.ir.capture.example_runs import model_variable_handles, run_terms
from autodist.ir.errors import CaptureError
from autodist.runtime.metric_logs import MetricLogs
from tests.custom_steps import IMAGE, guide_model_3, vae_model
from tests.keras_equal import twin_models

LR = 1.0  # SGD: a step's change is its gradient


def _run_captured(item, model, feeds: dict) -> tuple[dict, list]:
    """The captured step on one batch (its draws as the step draws them, the model's
    state restored after): each variable's gradient, and the metric contributions."""
    state = [(v, np.array(v.numpy())) for v in model.variables if not v.trainable]
    inputs = {info.name: info.tensor for info in item.inputs}
    fetches = [v.gradient.dense for v in item.variables] + [m.tensor for m in item.metric_states]
    try:
        values = run_terms(item.graph_def(), model_variable_handles(item, model),
                           {inputs[k]: v for k, v in feeds.items()}, [], fetches)
    finally:
        for variable, value in state:
            variable.assign(value)
    grads = dict(zip([v.name for v in item.variables], values))
    return grads, values[len(item.variables):]


def _keras_step(model, *data) -> tuple[list, object]:
    """One step of Keras' fit on `data` (one batch): each trainable variable's gradient
    (its change over SGD's rate), and the History."""
    before = [np.array(v.numpy()) for v in model.trainable_variables]
    x, y, weights = (list(data) + [None, None])[:3]
    history = model.fit(x, y, sample_weight=weights, batch_size=len(x), epochs=1,
                        shuffle=False, verbose=0)
    return [(b - v.numpy()) / LR for b, v in zip(before, model.trainable_variables)], history


def _assert_as_keras(item, model, reference, feeds, data) -> None:
    grads, contributions = _run_captured(item, model, feeds)
    expected, history = _keras_step(reference, *data)
    for info, grad in zip(item.variables, expected):
        np.testing.assert_allclose(grads[info.name], grad, rtol=0, atol=2e-6,
                                   err_msg=info.name)
    for state, variable in zip(contributions, [v for m in reference.metrics
                                               for v in m.variables]):
        np.testing.assert_allclose(state, variable.numpy(), rtol=1e-6, err_msg=variable.path)
    logs = MetricLogs(model, item)
    assert logs.complete and sorted(logs.keys) == sorted(history.history)
    got = logs(contributions)
    for key, values in history.history.items():
        assert got[key] == pytest.approx(values[0], rel=1e-6), key


def test_vae_trains_as_keras_step():
    """keras-io's VAE: three Mean trackers, a KL term, a draw from a SeedGenerator."""
    model, reference = twin_models(lambda: vae_model(keras.optimizers.SGD(LR)), seed=3)
    x = np.random.default_rng(0).uniform(size=(8,) + IMAGE).astype("float32")
    item = capture(model, x=x[:2])
    info = item.proto.custom_step
    assert info.step_class.endswith("VAE") and info.data == "x"
    assert [log.name for log in info.logs] == ["kl_loss", "loss", "reconstruction_loss"]
    assert [s.name for s in item.state_variables if s.update_ops] == \
        ["seed_generator/seed_generator_state"]
    assert [op.reproducible for op in item.random_ops] == [True]
    _assert_as_keras(item, model, reference, {"input_0": x}, (x,))


@pytest.mark.parametrize("weighted", [True, False])
def test_guide_model_3_trains_as_keras_step(weighted):
    """compute_loss, the sample weights of `len(data) == 3` (unit weights when fit
    passes none: the same numbers), the loss tracker and compiled metrics."""
    model, reference = twin_models(lambda: guide_model_3(keras.optimizers.SGD(LR)), seed=4)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 5)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    weights = rng.uniform(size=(8,)).astype("float32") if weighted else np.ones(8, "float32")
    item = capture(model)
    assert item.proto.custom_step.data == "x,y,sample_weight"
    assert [i.role for i in item.inputs] == ["x", "y", "sample_weight"]
    data = (x, y, weights) if weighted else (x, y)
    _assert_as_keras(item, model, reference, {"input_0": x, "y": y, "sample_weight": weights},
                     data)


def test_a_step_unpacking_two_elements_takes_no_weights():
    """The guide's models 1-2 (`x, y = data`): traced as fit packs (x, y)."""
    class TwoElements(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                                 self.trainable_variables)
            self._loss_tracker.update_state(loss)
            return {"loss": self._loss_tracker.result()}

    inputs = keras.Input((3,))
    model = TwoElements(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    item = capture(model)
    assert item.proto.custom_step.data == "x,y"
    assert [i.role for i in item.inputs] == ["x", "y"]
