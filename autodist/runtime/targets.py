"""A model's targets as one array, whatever the number of outputs.

The job stores and ships the targets as one array indexed by example. A
model with one target keeps its array. A model with several outputs (a
target per output) gets a NumPy structured array with one field per target
(`t0`, `t1`, ... in the GraphItem's order), each with its own dtype and
example shape, so indexing rows, saving and shipping work unchanged.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from autodist.ir.errors import AutodistError


def target_names(graph_item) -> list[str]:
    """The GraphItem's targets (inputs with role "y"), in order."""
    return [info.name for info in graph_item.inputs if info.role == "y"]


def pack(y: Any, infos: Sequence[Any],
         cast: Callable[[np.ndarray, Any], np.ndarray]) -> np.ndarray:
    """fit's `y` as one array.

    Args:
        y: One array; or, for several targets, a list/tuple in the model's
            output order or a dict keyed by output name.
        infos: The GraphItem's target TensorInfos ("y", or "y/<output>").
        cast: Checks one array against its TensorInfo and casts it.

    Raises:
        AutodistError: `y` does not have one array per target.
    """
    if len(infos) == 1:
        if isinstance(y, (list, tuple, dict)) and len(y) == 1:
            y = next(iter(y.values())) if isinstance(y, dict) else y[0]
        return cast(np.asarray(y), infos[0])
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
    packed = np.empty(len(arrays[0]), dtype=[(f"t{i}", a.dtype, a.shape[1:])
                                              for i, a in enumerate(arrays)])
    for i, a in enumerate(arrays):
        packed[f"t{i}"] = a
    return packed


def unpack(rows: np.ndarray, count: int) -> list[np.ndarray]:
    """The per-target arrays of some packed rows (`count` targets)."""
    if count == 1:
        return [np.asarray(rows)]
    return [np.ascontiguousarray(rows[f"t{i}"]) for i in range(count)]
