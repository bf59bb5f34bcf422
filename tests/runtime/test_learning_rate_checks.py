"""A run never trains with another learning rate than the user's model has, silently."""
from __future__ import annotations

import numpy as np
import pytest

import keras
import autodist
from autodist.ir.capture import capture
from autodist.ir.errors import AutodistError
from autodist.adapt import policy
from autodist.search import builders

from tests.adapt.test_policies import _Run


def _mlp(optimizer):
    return autodist.models.mlp(input_dim=20, hidden=(16,), optimizer=optimizer)


def test_fit_refuses_a_learning_rate_changed_after_capture():
    model = _mlp(keras.optimizers.SGD(0.1))
    spec = autodist.ResourceSpec.local(workers=2, ps=0)
    gi = capture(model)
    strategy = builders.AllReduce().build(gi, spec)
    run = autodist.distribute(model, strategy, spec, graph_item=gi)
    model.optimizer.learning_rate = 0.05
    x = np.zeros((8, 20), np.float32)
    y = np.zeros(8, np.int32)
    with pytest.raises(AutodistError, match="learning rate is 0.05 but it was 0.1 when the "
                                            "model was captured"):
        run.fit(x, y, batch_size=4)
    # An explicit override is what the user asked for: checked no further.
    overridden = autodist.distribute(model, strategy.with_hyperparameters(learning_rate=0.05),
                                     spec, graph_item=gi)
    overridden._check_learning_rate()  # pylint: disable=protected-access


def test_batch_size_rule_refuses_a_scheduled_learning_rate():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    gi = capture(_mlp(keras.optimizers.SGD(schedule)))
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    control = policy.Control(_Run(gi, builders.AllReduce().build(gi, spec)
                                  .with_virtual_nodes(64, 4), spec), 64)
    with pytest.raises(AutodistError, match="learning_rate_rule='linear' scales a fixed "
                                            "learning rate, but the optimizer's is a schedule "
                                            "\\(ExponentialDecay\\)"):
        control.set_batch_size(128)
    strategy = control.set_batch_size(128, learning_rate_rule="none")
    assert strategy.global_batch_size == 128 and "learning_rate" not in strategy.hyperparameters
