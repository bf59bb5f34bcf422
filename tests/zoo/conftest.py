"""The zoo's Keras references, each trained once per test session."""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

from tests.zoo.models import ZOO, keras_reference


@pytest.fixture(scope="session")
def zoo_reference() -> Callable[[str], tuple[list[np.ndarray], dict[str, list[float]]]]:
    """Case name -> `keras_reference` of a freshly built case, computed once: the
    reproducibility test trains a second one against it, the cluster test compares with it."""
    cache: dict[str, tuple[list[np.ndarray], dict[str, list[float]]]] = {}

    def get(name: str) -> tuple[list[np.ndarray], dict[str, list[float]]]:
        if name not in cache:
            cache[name] = keras_reference(ZOO[name]())
        return cache[name]

    return get
