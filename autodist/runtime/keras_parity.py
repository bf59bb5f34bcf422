"""What of a model would not train as single-device Keras does: said before launch.

A distributed run computes Keras' step on the global batch. Where a feature
cannot be made equal on a given strategy, `check` warns (the difference is
inherent and documented) or refuses (it would train something else), naming
the layer or feature and the alternative, before any process starts.
"""
from __future__ import annotations

import warnings
from typing import Any

from autodist.ir.graph_item import GraphItem
from autodist.ir.strategy import Strategy


class ParityWarning(UserWarning):
    """A run will differ from single-device Keras in a way that is inherent to it."""


def check(model: Any, graph_item: GraphItem, strategy: Strategy) -> None:
    """Warns or raises, before launch, for what would not train as Keras does.

    Raises:
        AutodistError: a feature the run would silently train differently.
    """
    del model  # the checks so far read the capture
    _random_ops(graph_item, strategy)


def _random_ops(graph_item: GraphItem, strategy: Strategy) -> None:
    if strategy.num_virtual_nodes <= 1:
        return   # one device draws as Keras does
    unmatched = [op for op in graph_item.random_ops if not op.reproducible]
    if not unmatched:
        return
    layers = sorted({op.layer for op in unmatched})
    reasons = sorted({op.reason for op in unmatched})
    warnings.warn(
        f"layer(s) {layers} draw random numbers that a run on {strategy.num_virtual_nodes} "
        f"replicas or virtual nodes cannot draw as one device does ({'; '.join(reasons)}): "
        "their draws, and so the trained weights, will differ from Keras fit. Keras' own "
        "random layers (Dropout, GaussianNoise, the augmentation layers) are drawn exactly; "
        "use keras.random functions with a keras.random.SeedGenerator in custom layers",
        ParityWarning, stacklevel=3)

