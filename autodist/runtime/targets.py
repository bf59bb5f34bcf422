"""A model's targets (and sample weights) as one array, whatever the number of outputs.

The job stores and ships the targets as one array indexed by example. A
model with one target and no sample weights keeps its array. Otherwise it is
a NumPy structured array with one field per target (`t0`, `t1`, ... in the
GraphItem's order), each with its own dtype and example shape, and the
per-example weights of the loss and metrics in field `w`, so indexing rows,
saving and shipping work unchanged.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from autodist.ir.errors import AutodistError


def pack(y: Any, infos: Sequence[Any], cast: Callable[[np.ndarray, Any], np.ndarray],
         sample_weight: np.ndarray | None = None) -> np.ndarray:
    """fit's `y` (and sample weights) as one array.

    Args:
        y: One array; or, for several targets, a list/tuple in the model's
            output order or a dict keyed by output name.
        infos: The GraphItem's target TensorInfos ("y", or "y/<output>").
        cast: Checks one array against its TensorInfo and casts it.
        sample_weight: Per-example weights (float32, one per example), or None.

    Raises:
        AutodistError: `y` does not have one array per target.
    """
    if len(infos) == 1:
        if isinstance(y, (list, tuple, dict)) and len(y) == 1:
            y = next(iter(y.values())) if isinstance(y, dict) else y[0]
        if sample_weight is None:
            return cast(np.asarray(y), infos[0])
        return _structured([cast(np.asarray(y), infos[0])], sample_weight)
    names = [info.name[len("y/"):] if info.name.startswith("y/") else info.name
             for info in infos]
    if isinstance(y, dict):
        missing = [n for n in names if n not in y]
        if missing:
            raise AutodistError(f"y is a dict without targets for outputs {missing}; its keys: "
                                f"{sorted(y)[:20]}")
        arrays = [y[n] for n in names]
    elif isinstance(y, (list, tuple)):
        if len(y) != len(infos):
            raise AutodistError(f"the model has {len(infos)} targets ({names}); y has {len(y)}")
        arrays = list(y)
    else:
        raise AutodistError(f"the model has {len(infos)} outputs ({names}): pass y as a list "
                            f"(in output order) or a dict keyed by output name. Received "
                            f"{type(y).__name__}")
    arrays = [cast(np.asarray(a), info) for a, info in zip(arrays, infos)]
    lengths = {len(a) for a in arrays}
    if len(lengths) != 1:
        raise AutodistError(f"the targets have different numbers of examples: "
                            f"{[len(a) for a in arrays]}")
    return _structured(arrays, sample_weight)


def _structured(arrays: list[np.ndarray], sample_weight: np.ndarray | None) -> np.ndarray:
    fields = [(f"t{i}", a.dtype, a.shape[1:]) for i, a in enumerate(arrays)]
    if sample_weight is not None:
        if len(sample_weight) != len(arrays[0]):
            raise AutodistError(f"sample_weight has {len(sample_weight)} weights for "
                                f"{len(arrays[0])} examples")
        fields.append(("w", np.float32))
    packed = np.empty(len(arrays[0]), dtype=fields)
    for i, a in enumerate(arrays):
        packed[f"t{i}"] = a
    if sample_weight is not None:
        packed["w"] = sample_weight
    return packed


def unpack(rows: np.ndarray, count: int) -> tuple[list[np.ndarray], np.ndarray | None]:
    """The per-target arrays and the sample weights (or None) of some packed rows."""
    if rows.dtype.names is None:
        return [np.asarray(rows)], None
    weights = np.ascontiguousarray(rows["w"]) if "w" in rows.dtype.names else None
    return [np.ascontiguousarray(rows[f"t{i}"]) for i in range(count)], weights


def sample_weights(sample_weight: Any, class_weight: Any, y: Any, num_targets: int,
                   num_examples: int) -> np.ndarray | None:
    """fit's `sample_weight` or `class_weight` as per-example float32 weights, as Keras
    makes them (None: neither given).

    Raises:
        AutodistError: both given; a malformed array or mapping; `class_weight`
            with several outputs (Keras supports it for one output only).
    """
    if sample_weight is not None and class_weight is not None:
        raise AutodistError("give sample_weight or class_weight, not both (as Keras)")
    if sample_weight is not None:
        if isinstance(sample_weight, (dict, list, tuple)) and not isinstance(
                sample_weight, np.ndarray):
            raise AutodistError("sample_weight must be one array of per-example weights "
                                "(applied to every output); per-output weights are not "
                                f"supported. Received a {type(sample_weight).__name__}")
        weights = np.asarray(sample_weight, dtype=np.float32)
        if weights.ndim == 2 and weights.shape[1] == 1:
            weights = weights[:, 0]
        if weights.ndim != 1 or len(weights) != num_examples:
            raise AutodistError(f"sample_weight needs one weight per example ({num_examples}); "
                                f"received an array of shape {list(weights.shape)}")
        if not np.all(np.isfinite(weights)):
            raise AutodistError("sample_weight holds values that are not finite")
        return weights
    if class_weight is None:
        return None
    table = class_weight_table(class_weight, num_targets)
    labels = np.asarray(y)
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
