"""The zoo is well formed and its Keras references are reproducible (no cluster).

A distributed run is compared with `keras_reference`, so the reference must
be exact: every builder gives the same variables twice (weights and
seed-generator states), and two references train to bitwise-equal weights
and equal History.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

import keras
from tests.zoo.models import (EPOCHS, FEATURES, ZOO, ZooCase, assert_same_variables,
                              keras_reference)

MIN_CASES = 29


@pytest.fixture(scope="module")
def built() -> Callable[[str], ZooCase]:
    """Name -> the case built once for this module (its model is never trained here)."""
    cache: dict[str, ZooCase] = {}

    def get(name: str) -> ZooCase:
        if name not in cache:
            cache[name] = ZOO[name]()
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(ZOO))
def test_case_is_well_formed_and_its_builder_deterministic(
        name: str, built: Callable[[str], ZooCase]) -> None:
    case = built(name)
    assert isinstance(case, ZooCase) and case.name == name
    assert case.source.startswith(("examples/", "guides/")) and case.source.endswith(".py")
    assert case.features and set(case.features) <= FEATURES
    assert case.model.compiled
    assert case.fit_kwargs["epochs"] == EPOCHS
    assert case.fit_kwargs["shuffle"] == ("shuffle" in case.features)
    assert keras.mixed_precision.global_policy().name == "float32"
    assert_same_variables(case.model, ZOO[name]().model)


def test_zoo_covers_every_feature_class(built: Callable[[str], ZooCase]) -> None:
    assert len(ZOO) >= MIN_CASES
    covered = {f for name in ZOO for f in built(name).features}
    assert covered == FEATURES, f"not covered: {sorted(FEATURES - covered)}"


@pytest.mark.parametrize("name", sorted(ZOO))
def test_keras_reference_is_reproducible(name: str, built: Callable[[str], ZooCase],
                                        zoo_reference) -> None:
    case = built(name)
    first_weights, first_history = zoo_reference(name)  # the one the cluster test compares
    second_weights, second_history = keras_reference(case)
    assert len(first_weights) == len(case.model.variables)
    for i, (a, b) in enumerate(zip(first_weights, second_weights)):
        assert np.array_equal(a, b), f"{case.model.variables[i].path} differs between two fits"
    assert first_history == second_history
    assert all(len(values) == EPOCHS for values in first_history.values())
