"""Validation as Keras' `fit` runs it: held-out data evaluated in the driver.

`validation_split` holds out the last fraction of the arrays before any
shuffling; at the end of each epoch `validation_freq` selects, the driver
runs `model.evaluate` on the validation data with the model holding that
epoch's weights, and the results join the epoch's logs as ``val_*``.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from autodist.ir.errors import AutodistError
from autodist.runtime import datasets, python_data
from autodist.runtime.options import FitOptions
from autodist.runtime.sharded_input import ShardedDataset


def split_off(x: Any, y: Any, options: FitOptions) -> tuple[Any, Any]:
    """`fit`'s x and y without `options.validation_split`'s examples, which become
    `options.validation_data` (with the matching sample weights, also split)."""
    if not options.validation_split:
        return x, y
    if datasets.is_dataset(x) or isinstance(x, ShardedDataset) or \
            python_data.is_python_data(x):
        raise AutodistError("validation_split needs arrays (as in Keras); with a dataset, "
                            "a generator or a PyDataset, pass validation_data")
    x, y, options.sample_weight, options.validation_data = _split(
        x, y, options.sample_weight, options.validation_split)
    return x, y


def validator(model: Any, options: FitOptions, batch_size: int | None,
              callbacks: Callable[[], Any]) -> Callable[[int], dict[str, float]]:
    """Epoch -> its ``val_*`` logs: Keras' `evaluate` in this process, on the model
    holding that epoch's weights (as Keras' `fit` runs it), or {} when
    `validation_freq` skips the epoch."""
    val_x, val_y, val_weight = unpack(options.validation_data)

    def validate(epoch: int) -> dict[str, float]:
        if not options.should_validate(epoch):
            return {}
        logs = model.evaluate(
            val_x, val_y, sample_weight=val_weight,
            batch_size=None if datasets.is_dataset(val_x) or python_data.is_python_data(val_x)
            else options.validation_batch_size or batch_size,
            steps=options.validation_steps, callbacks=callbacks(), verbose=0,
            return_dict=True)
        return {f"val_{name}": float(value) for name, value in logs.items()}

    return validate


def _split(x: Any, y: Any, sample_weight: Any, fraction: float
                      ) -> tuple[Any, Any, Any, tuple[Any, ...]]:
    """Keras' `validation_split`: the last `fraction` of the examples, before any shuffling.

    Returns:
        (training x, training y, training sample weights, validation data).
    """
    def split(value, start, end):
        if value is None:
            return None
        if isinstance(value, dict):
            return {k: split(v, start, end) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [split(v, start, end) for v in value]
        return value[start:end]

    first = x
    while isinstance(first, (list, tuple, dict)):
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    n = len(first)
    split_at = int(math.floor(n * (1.0 - fraction)))
    if split_at in (0, n):
        raise AutodistError(f"validation_split={fraction} leaves no examples for training or "
                            f"for validation ({n} examples)")
    validation = (split(x, split_at, n), split(y, split_at, n))
    if sample_weight is not None:
        validation += (split(sample_weight, split_at, n),)
    return (split(x, 0, split_at), split(y, 0, split_at), split(sample_weight, 0, split_at),
            validation)


def unpack(data: Any) -> tuple[Any, Any, Any]:
    """(x, y, sample_weight) of `validation_data`, as Keras unpacks it.

    A PyDataset is evaluated each epoch as Keras' fit evaluates it (a pass
    from its first batch, in order). A generator is refused: Keras' fit keeps one
    adapter of it across epochs (each evaluation re-reads the 2 batches it peeked
    at, then goes on where the last one stopped), which separate `evaluate` calls
    do not repeat.
    """
    if datasets.is_dataset(data) or python_data.is_python_data(data) and \
            python_data.kind(data) == "PyDataset":
        return data, None, None
    if python_data.is_python_data(data):
        raise AutodistError(
            "validation_data as a Python generator is not supported: Keras' fit reads it "
            "through one adapter across epochs (re-reading the 2 batches it peeked at "
            "first each time), which autodist does not copy. Pass a keras.utils.PyDataset, "
            "a tf.data.Dataset, or (x, y[, sample_weight]) arrays")
    if isinstance(data, tuple) and len(data) in (2, 3):
        return data[0], data[1], data[2] if len(data) == 3 else None
    raise AutodistError("validation_data must be (x, y), (x, y, sample_weight), a "
                        "tf.data.Dataset or a keras.utils.PyDataset. Received: "
                        f"{type(data).__name__}"
                        + (f" of {len(data)} items" if isinstance(data, (tuple, list)) else ""))
