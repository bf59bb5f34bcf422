"""Models overriding `train_step` (one optimizer, one apply, metric results as logs)
train as Keras' fit on 2 workers.

keras-io's VAE (three Mean trackers counting one value per batch, a KL term, a
draw from a SeedGenerator) on all-reduce with 4 virtual nodes, and the guide's
model 3 (compute_loss with sample weights, the loss tracker and compiled
metrics) on parameter servers; 40 examples in batches of 16: a short last batch
of 8, which the workers and virtual nodes split. The in-process checks against
Keras' step: `tests/ir/test_capture_custom_step.py`.

The VAE learns at 0.003: its KL term (`1 + log_var - exp(log_var)`, a difference of
numbers near 1) loses digits as it shrinks, so float32 sums in another order differ
by ~5e-7 in it: 1.4e-5 relative at 0.037, where Adam(0.01) takes it in two epochs
(weights and the other logs within 5e-7 of Keras').
"""
from __future__ import annotations

import keras
import numpy as np
import pytest

import autodist
from autodist.search import builders
from tests.custom_steps import IMAGE, guide_model_3, vae_model
from tests.keras_equal import assert_trains_as_keras, twin_models

pytestmark = pytest.mark.cluster

EXAMPLES, BATCH = 40, 16


def _data(model: str) -> tuple:
    rng = np.random.default_rng(0)
    if model == "vae":
        return (rng.uniform(size=(EXAMPLES,) + IMAGE).astype(np.float32),)
    x = rng.normal(size=(EXAMPLES, 5)).astype(np.float32)
    y = rng.normal(size=(EXAMPLES, 1)).astype(np.float32)
    return x, y, rng.uniform(0.2, 2.0, size=EXAMPLES).astype(np.float32)


@pytest.mark.parametrize(("model", "ps"), [("vae", 0), ("guide_model_3", 1)],
                         ids=["vae_all_reduce_virtual_nodes", "guide_model_3_ps"])
def test_custom_train_step_trains_as_keras(model, ps):
    data = _data(model)
    build = (lambda: vae_model(keras.optimizers.Adam(0.003))) if model == "vae" else \
        guide_model_3
    distributed, reference = twin_models(build, seed=2)
    spec = autodist.ResourceSpec.local(workers=2, ps=ps)
    item = autodist.capture(distributed, x=data[0][:2])
    if ps:
        strategy = builders.PS().build(item, spec)
    else:
        strategy = builders.AllReduce().build(item, spec).with_virtual_nodes(BATCH, 4)
    run = autodist.distribute(distributed, strategy, spec, graph_item=item)
    x, y, weights = (list(data) + [None, None])[:3]
    history = run.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=2,
                      shuffle=False, verbose=0)
    keras_history = reference.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=2,
                                  shuffle=False, verbose=0)
    assert set(keras_history.history) == ({"loss", "reconstruction_loss", "kl_loss"}
                                          if model == "vae" else {"loss", "mae"})
    assert_trains_as_keras(distributed, reference, history, keras_history)
    # The optimizer's state returns into the model, by the applied variables.
    for got, want in zip(distributed.optimizer.variables, reference.optimizer.variables):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=2e-5,
                                   err_msg=got.path)
