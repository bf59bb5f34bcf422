"""Learning-rate rules that cannot apply are refused before anything runs.

(A run trains with the model's learning rate as `fit` finds it, and with the rates
callbacks set between epochs: `tests/runtime/test_keras_fit_semantics.py`.)
"""
from __future__ import annotations

import pytest

import keras
import autodist
from autodist.ir.capture import capture
from autodist.ir.errors import AutodistError
from autodist.adapt import policy_interface
from autodist.search import builders

from tests.doubles import StandInRun


def _mlp(optimizer):
    return autodist.models.mlp(input_dim=20, hidden=(16,), optimizer=optimizer)


def test_batch_size_rule_refuses_a_scheduled_learning_rate():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    gi = capture(_mlp(keras.optimizers.SGD(schedule)))
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    control = policy_interface.Control(StandInRun(gi, builders.AllReduce().build(gi, spec)
                                  .with_virtual_nodes(64, 4), spec), 64)
    with pytest.raises(AutodistError, match="learning_rate_rule='linear' scales a fixed "
                                            "learning rate, but the optimizer's is a schedule "
                                            "\\(ExponentialDecay\\)"):
        control.set_batch_size(128)
    strategy = control.set_batch_size(128, learning_rate_rule="none")
    assert strategy.global_batch_size == 128 and "learning_rate" not in strategy.hyperparameters
