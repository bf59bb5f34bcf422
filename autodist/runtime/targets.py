"""A model's targets (and sample weights) as one array, whatever the number of outputs.

The job stores and ships the targets as one array indexed by example. A
model with one target and no sample weights keeps its array. Otherwise it is
a NumPy structured array with one field per target (`t0`, `t1`, ... in the
GraphItem's order), each with its own dtype and example shape, and the
sample weights of the loss and metrics in field `w` (one array for every
target) or `w0`, `w1`, ... (one per target), so indexing rows, saving and
shipping work unchanged.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from autodist.ir.errors import AutodistError


def pack(arrays: Sequence[np.ndarray], weights: Any = None) -> np.ndarray:
    """The targets (and sample weights) as one array indexed by example.

    Args:
        arrays: One array per target, in the GraphItem's order, already
            converted (`keras_data.fit_arrays`).
        weights: None; one array of weights for every target (field `w`); or
            one per target (fields `w0`, `w1`, ...).

    Raises:
        AutodistError: the arrays have different numbers of examples.
    """
    arrays = list(arrays)
    if len(arrays) == 1 and weights is None:
        return arrays[0]
    lengths = {len(a) for a in arrays}
    if len(lengths) != 1:
        raise AutodistError(f"the targets have different numbers of examples: "
                            f"{[len(a) for a in arrays]}")
    fields = [(f"t{i}", a.dtype, a.shape[1:]) for i, a in enumerate(arrays)]
    if isinstance(weights, (list, tuple)):
        fields += [(f"w{i}", np.float32, w.shape[1:]) for i, w in enumerate(weights)]
    elif weights is not None:
        fields.append(("w", np.float32, weights.shape[1:]))
    packed = np.empty(len(arrays[0]), dtype=fields)
    for i, a in enumerate(arrays):
        packed[f"t{i}"] = a
    if isinstance(weights, (list, tuple)):
        for i, w in enumerate(weights):
            packed[f"w{i}"] = w
    elif weights is not None:
        packed["w"] = weights
    return packed


def unpack(rows: np.ndarray, count: int) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """The per-target arrays and per-target sample weights (or None) of some packed
    rows (weights shared by every target are repeated)."""
    if rows.dtype.names is None:
        return [np.asarray(rows)], None
    names = rows.dtype.names
    targets = [np.ascontiguousarray(rows[f"t{i}"]) for i in range(count)]
    if "w" in names:
        shared = np.ascontiguousarray(rows["w"])
        return targets, [shared] * count
    if "w0" in names:
        return targets, [np.ascontiguousarray(rows[f"w{i}"]) for i in range(count)]
    return targets, None


def class_weights(class_weight: Any, targets: Sequence[np.ndarray]) -> np.ndarray:
    """fit's `class_weight` as per-example float32 weights, as Keras makes them: the
    weight of each example's class (its label, or the argmax of a one-hot target;
    other classes weigh 1).

    Raises:
        AutodistError: a malformed mapping, or a model with several outputs
            (Keras supports one).
    """
    table = class_weight_table(class_weight, len(targets))
    labels = np.asarray(targets[0])
    if labels.ndim > 1:
        labels = np.argmax(labels, axis=-1) if labels.shape[-1] != 1 else labels[..., 0]
    labels = np.round(labels).astype("int32")
    return np.asarray([table.get(int(c), 1.0) for c in labels.reshape(len(labels), -1)[:, 0]],
                      dtype=np.float32)


def class_weight_table(class_weight: Any, num_targets: int) -> dict[int, float]:
    """fit's `class_weight`, checked: class index -> weight (other classes weigh 1).

    Raises:
        AutodistError: not a dict of int -> weight, or a model with several
            outputs (Keras supports one).
    """
    if not isinstance(class_weight, dict) or not all(
            isinstance(k, (int, np.integer)) and not isinstance(k, bool) for k in class_weight):
        raise AutodistError("class_weight must be a dict of class index (int) -> weight. "
                            f"Received: {str(class_weight)[:200]}")
    if num_targets != 1:
        raise AutodistError("class_weight is supported for models with one output, as in "
                            f"Keras; this model has {num_targets}")
    return {int(k): float(v) for k, v in class_weight.items()}
