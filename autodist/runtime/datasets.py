"""`fit` on a `tf.data.Dataset`: its batches become arrays batched the same way.

As in Keras, each element of the dataset is one (global) batch `(x, y)`. A
finite dataset whose batches all have one size, except possibly a smaller
last one, is read once in the driver and concatenated; batching the arrays
with that size gives back exactly the dataset's batches, so the run trains
on the same batches in the same order as Keras `fit(dataset)` (with
`shuffle` off: a dataset shuffles itself, once here).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from autodist.ir.errors import AutodistError


def is_dataset(x: Any) -> bool:
    """Whether `x` is a tf.data.Dataset (without importing TensorFlow for arrays)."""
    return type(x).__module__.startswith("tensorflow") and hasattr(x, "element_spec")


def dataset_arrays(dataset, input_names: Sequence[str], max_batches: int = 1_000_000
                   ) -> tuple[list[np.ndarray], Any, np.ndarray | None, int]:
    """Reads a finite dataset of (x, y[, sample_weight]) batches into
    (x arrays, y, sample weights or None, batch size).

    y is one array, or a list / dict of arrays where the dataset's y is a
    tuple / dict (a model with several outputs).

    Args:
        dataset: Yields `(x, y)` or `(x, y, sample_weight)`: x a tensor, a
            tuple/list of tensors (one per model input) or a dict keyed by
            the model's input names; sample_weight one weight per example.
        input_names: The model's input names, in order.
        max_batches: Bound on the batches read.

    Raises:
        AutodistError: An infinite dataset, batches of uneven size, or x
            that does not match the model's inputs.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    if dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise AutodistError("fit reads a dataset once in the driver, so it must be finite; "
                            "received an infinite (repeated) dataset: drop .repeat()")
    xs: list[list[np.ndarray]] = []
    ys: list[np.ndarray] = []
    weights: list[np.ndarray] = []
    sizes: list[int] = []
    for i, element in enumerate(dataset):
        if i >= max_batches:
            raise AutodistError(f"the dataset has more than {max_batches} batches")
        if not isinstance(element, tuple) or len(element) not in (2, 3):
            raise AutodistError("each dataset element must be an (x, y) or (x, y, "
                                f"sample_weight) batch; received {_describe(element)}")
        x, y = element[:2]
        arrays = _x_arrays(x, input_names)
        xs.append(arrays)
        ys.append(_y_arrays(y))
        if len(element) == 3:
            weights.append(np.asarray(element[2], np.float32).reshape(-1))
        sizes.append(len(_first(ys[-1])))
    if not sizes:
        raise AutodistError("the dataset is empty")
    batch = sizes[0]
    if any(s != batch for s in sizes[:-1]) or sizes[-1] > batch:
        raise AutodistError(f"dataset batches must all have one size except a smaller last "
                            f"one (as `.batch(n)` makes); received sizes {sizes[:10]}"
                            f"{' ...' if len(sizes) > 10 else ''}")
    inputs = [np.concatenate([b[j] for b in xs]) for j in range(len(input_names))]
    return inputs, _concatenate_y(ys), np.concatenate(weights) if weights else None, batch


def _y_arrays(y) -> Any:
    """A batch's targets: one array, or a list / dict of arrays (one per output)."""
    if isinstance(y, dict):
        return {k: np.asarray(v) for k, v in y.items()}
    if isinstance(y, (tuple, list)):
        return [np.asarray(v) for v in y]
    return np.asarray(y)


def _first(y) -> np.ndarray:
    if isinstance(y, dict):
        return next(iter(y.values()))
    return y[0] if isinstance(y, list) else y


def _concatenate_y(ys: list) -> Any:
    if isinstance(ys[0], dict):
        return {k: np.concatenate([b[k] for b in ys]) for k in ys[0]}
    if isinstance(ys[0], list):
        return [np.concatenate([b[j] for b in ys]) for j in range(len(ys[0]))]
    return np.concatenate(ys)


def _x_arrays(x, input_names: Sequence[str]) -> list[np.ndarray]:
    if isinstance(x, dict):
        missing = [n for n in input_names if n not in x]
        if missing:
            raise AutodistError(f"dataset x is a dict without the model's inputs {missing}; "
                                f"its keys: {sorted(x)}")
        return [np.asarray(x[n]) for n in input_names]
    arrays = [np.asarray(a) for a in x] if isinstance(x, (tuple, list)) else [np.asarray(x)]
    if len(arrays) != len(input_names):
        raise AutodistError(f"the model takes {len(input_names)} inputs ({list(input_names)}); "
                            f"the dataset's x has {len(arrays)}")
    return arrays


def _describe(element: Any) -> str:
    if isinstance(element, tuple):
        return f"a tuple of {len(element)}"
    return type(element).__name__
