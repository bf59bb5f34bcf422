"""Mixed float16 with dynamic loss scaling trains as Keras `fit` on a real cluster.

The model is built under the 'mixed_float16' policy with a LossScaleOptimizer
that starts at a scale its float16 gradients overflow (2**20) and doubles
after 3 finite steps: Keras skips the first steps, halving the scale, then
updates, doubles, overflows again. On 2 workers (all-reduce, synchronous PS,
and all-reduce with 4 virtual nodes of 8 examples, whose float16 sums alone
would overflow on other steps) the skipped steps, the scale, its counter, the
update count, the weights and the History equal Keras' (float16 rounding
aside), and a second `fit` goes on from the first one's scale and update
count, as Keras' does.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import autodist
import keras
from autodist.runtime.keras_parity import ParityWarning
from autodist.search import builders

pytestmark = pytest.mark.cluster

# Float16 sums of a replica's examples round differently from Keras' one sum.
WEIGHT_ATOL = 1e-4
HISTORY_RTOL = 1e-4


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        inputs = keras.Input((6,), name="features")
        h = keras.layers.Dense(16, activation="relu")(inputs)
        h = keras.layers.Dense(8, activation="relu")(h)
        outputs = keras.layers.Dense(1, dtype="float32")(h)
        model = keras.Model(inputs, outputs)
        optimizer = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(1e-2), initial_scale=2.0 ** 20, dynamic_growth_steps=3)
        model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 6)).astype("float32")
    return x, (x.sum(axis=1) * 3).astype("float32")  # 1-D targets, as users pass them


def _state(model) -> tuple[float, int, int]:
    optimizer = model.optimizer
    return (float(optimizer.dynamic_scale.numpy()), int(optimizer.step_counter.numpy()),
            int(optimizer.iterations.numpy()))


@pytest.mark.parametrize("config", ["AllReduce", "PS", "AllReduceVirtualNodes"])
def test_mixed_float16_equals_keras_fit_through_skipped_steps(config, tmp_path):
    x, y = _data()
    reference = _model()
    fits = [dict(epochs=2), dict(epochs=1)]   # the second goes on from the first
    want = []
    for kwargs in fits:
        keras.utils.set_random_seed(0)
        history = reference.fit(x, y, batch_size=32, shuffle=False, verbose=0, **kwargs)
        want.append((_state(reference), history.history))
    assert want[0][0][2] < 8 and want[1][0][0] != want[0][0][0]  # steps skipped, scale moved

    model = _model()
    graph_item = autodist.capture(model)
    workers_ps = 1 if config == "PS" else 0
    spec = autodist.ResourceSpec.local(workers=2, ps=workers_ps)
    builder = builders.PS() if config == "PS" else builders.AllReduce()
    strategy = builder.build(graph_item, spec)
    if config == "AllReduceVirtualNodes":  # 4 virtual nodes of 8 examples
        strategy = strategy.with_virtual_nodes(32, 4)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        run = autodist.distribute(model, strategy, spec,
                                  graph_item=graph_item, job_dir=str(tmp_path / "job"),
                                  step_timeout_s=60)
    # Said before launch: which steps are skipped can depend on the split of the batch.
    assert any("scales the loss dynamically" in str(w.message) for w in said
               if issubclass(w.category, ParityWarning))
    for kwargs, (want_state, want_history) in zip(fits, want):
        keras.utils.set_random_seed(0)
        history = run.fit(x, y, batch_size=32, shuffle=False, verbose=0, **kwargs)
        assert _state(model) == want_state
        for key, values in want_history.items():
            np.testing.assert_allclose(history.history[key], values, rtol=HISTORY_RTOL,
                                       err_msg=key)
    for got, expected in zip(model.variables, reference.variables):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=WEIGHT_ATOL,
                                   err_msg=got.path)

