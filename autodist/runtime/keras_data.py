"""`fit`'s x, y and sample weights as Keras' data adapters take them.

Keras' `fit` accepts inputs as one array, a list or tuple in the model's
input order, or a dict keyed by input name (`Input(name=...)`, or the keys
of a model built on a dict of inputs); targets as one array, a list in
output order or a dict keyed by output name; sample weights as one array
(applied to every output) or one per output. Arrays may be NumPy arrays,
tensors, pandas objects or nested Python lists; float64 becomes float32
(Keras' `floatx`) and every array is then cast to the dtype the model's
input (or the loss) takes, as Keras converts them. A target or weight may
differ from the capture's shape by a trailing dimension of 1 (a `(N,)` target
for an `(N, 1)` output): Keras' losses and metrics squeeze or expand it
(`squeeze_or_expand_to_same_rank`), as its functional models do an input's
(`_adjust_input_rank`), so it is reshaped, which computes the same.

Everything here is flattened to the capture's order (`GraphItem.inputs`),
checked, and refused with an error naming the input as the user named it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from autodist.ir.errors import AutodistError
from autodist.runtime.keras_parity import warn_of_ordered_inputs


class DataError(AutodistError, ValueError):
    """fit's data does not match the model, as Keras would refuse it."""


@dataclasses.dataclass(frozen=True)
class FitArrays:
    """fit's arrays in the capture's order.

    Attributes:
        inputs: One array per model input.
        targets: One array per target.
        weights: None; one array shared by every target; or one per target.
    """

    inputs: list[np.ndarray]
    targets: list[np.ndarray]
    weights: np.ndarray | list[np.ndarray] | None

    @property
    def num_examples(self) -> int:
        return len(self.targets[0]) if self.targets else len(self.inputs[0])


def input_label(info: Any) -> str:
    """How an input is named in messages: as the user named it."""
    return f"input {info.name!r}"


def target_label(info: Any) -> str:
    """How a target is named in messages: "the target", or that of output X."""
    name = info.name
    return "the target y" if name == "y" else f"the target of output {name[len('y/'):]!r}"


def weight_label(info: Any) -> str:
    name = info.name
    return "sample_weight" if name == "sample_weight" else \
        f"the sample_weight of output {name[len('sample_weight/'):]!r}"


def output_name(info: Any) -> str:
    """The output a target (or weight) TensorInfo belongs to ("" for a single one)."""
    return info.name.split("/", 1)[1] if "/" in info.name else ""


def flatten_inputs(x: Any, infos: Sequence[Any]) -> list[Any]:
    """The model inputs of fit's `x`, in the capture's order (values unconverted).

    Raises:
        DataError: a dict without an input's name, or the wrong number of arrays.
    """
    names = [info.name for info in infos]
    if isinstance(x, dict):
        warn_of_ordered_inputs(x, "x")
        missing = [n for n in names if n not in x]
        if missing:
            if len(infos) == 1 and len(x) == 1:
                return list(x.values())
            raise DataError(
                f"x is a dict without the model's input(s) {missing}; the model's inputs are "
                f"{names} (named by Input(name=...) or the keys of the model's input dict); "
                f"x's keys: {sorted(map(str, x))[:20]}")
        return [x[n] for n in names]
    if isinstance(x, (list, tuple)) and not _is_row_list(x, len(infos)):
        if len(x) != len(infos):
            raise DataError(f"the model takes {len(infos)} input(s) ({names}); x holds "
                            f"{len(x)} arrays")
        return list(x)
    if len(infos) != 1:
        raise DataError(f"the model takes {len(infos)} inputs ({names}): pass x as a list in "
                        f"that order or a dict keyed by those names. Received one "
                        f"{type(x).__name__}")
    return [x]


def flatten_targets(y: Any, infos: Sequence[Any]) -> list[Any]:
    """The targets of fit's `y`, in the capture's order (values unconverted).

    Raises:
        DataError: y does not hold one target per output.
    """
    if not infos:   # a model compiled without a loss: Keras ignores y
        return []
    names = [output_name(info) for info in infos]
    if isinstance(y, dict):
        if len(infos) == 1 and len(y) == 1:
            return list(y.values())
        missing = [n for n in names if n not in y]
        if missing:
            raise DataError(f"y is a dict without targets for output(s) {missing}; the "
                            f"model's outputs are {names}; y's keys: {sorted(map(str, y))[:20]}")
        return [y[n] for n in names]
    if isinstance(y, (list, tuple)) and not _is_row_list(y, len(infos)):
        if len(infos) == 1 and len(y) == 1:
            return list(y)
        if len(y) != len(infos):
            raise DataError(f"the model has {len(infos)} output(s) ({names}); y holds "
                            f"{len(y)} arrays")
        return list(y)
    if len(infos) != 1:
        raise DataError(f"the model has {len(infos)} outputs ({names}): pass y as a list in "
                        f"output order or a dict keyed by output name. Received one "
                        f"{type(y).__name__}")
    return [y]


def flatten_weights(sample_weight: Any, weight_infos: Sequence[Any]) -> Any:
    """fit's `sample_weight`: None, one value for every output, or one per output
    (a list in output order or a dict by output name, as Keras takes them)."""
    if sample_weight is None:
        return None
    names = [output_name(info) for info in weight_infos]
    if isinstance(sample_weight, dict):
        missing = [n for n in names if n not in sample_weight]
        if len(weight_infos) == 1 and len(sample_weight) == 1:
            return next(iter(sample_weight.values()))
        if missing:
            raise DataError(f"sample_weight is a dict without weights for output(s) {missing}; "
                            f"the model's outputs are {names}")
        return [sample_weight[n] for n in names]
    if isinstance(sample_weight, (list, tuple)) and len(weight_infos) > 1 and \
            len(sample_weight) == len(weight_infos) and \
            not _is_row_list(sample_weight, len(weight_infos)):
        return list(sample_weight)
    return sample_weight


def _is_row_list(value: Sequence[Any], parts: int) -> bool:
    """Whether a list is one array written as nested Python lists (rows of numbers or
    strings), not a list of arrays."""
    if not value:
        return False
    first = value[0]
    if isinstance(first, (int, float, str, bytes, np.number, np.bool_)):
        return True
    return parts == 1 and isinstance(first, (list, tuple)) and len(value) > 1 and all(
        isinstance(v, (int, float, str, bytes, np.number)) for v in first)


def to_array(value: Any, what: str) -> np.ndarray:
    """One array as Keras' adapters take it: NumPy, tensors, pandas, Python lists;
    float64 as float32; strings as UTF-8 bytes.

    Raises:
        DataError: objects that are neither numbers nor strings (Keras refuses them).
    """
    if hasattr(value, "to_numpy") and not isinstance(value, np.ndarray):
        value = value.to_numpy()   # pandas
    elif hasattr(value, "numpy") and not isinstance(value, np.ndarray):
        value = value.numpy()      # a tensor
    try:
        array = np.asarray(value)
    except ValueError as e:
        raise DataError(f"{what} cannot be read as one array (rows of different lengths?): "
                        f"{e}") from e
    if array.dtype == object:
        array = _object_array(array, what)
    elif array.dtype.kind == "U":
        array = np.char.encode(array, "utf-8")
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    if array.ndim == 0:
        raise DataError(f"{what} must be an array of examples; received a scalar "
                        f"({array!r})")
    return array


def _object_array(array: np.ndarray, what: str) -> np.ndarray:
    flat = array.reshape(-1)
    if flat.size == 0:
        return array.astype(np.float32)
    if all(isinstance(v, (str, bytes)) for v in flat):
        return np.asarray([v.encode("utf-8") if isinstance(v, str) else v for v in flat],
                          dtype=np.bytes_).reshape(array.shape)
    if all(isinstance(v, (int, float, np.number, bool, np.bool_)) for v in flat):
        return array.astype(np.float32 if any(isinstance(v, (float, np.floating))
                                              for v in flat) else np.int64)
    bad = next(v for v in flat if not isinstance(v, (int, float, np.number, str, bytes)))
    raise DataError(f"{what} holds Python objects that are neither numbers nor strings "
                    f"(first: {bad!r} of type {type(bad).__name__}); Keras refuses such "
                    "arrays too: pass numbers (NaN for missing values) or strings")


def conform(array: np.ndarray, info: Any, what: str, *, squeezable: bool) -> np.ndarray:
    """`array` checked against a TensorInfo of the capture and cast to its dtype.

    Args:
        array: From `to_array`.
        info: The capture's TensorInfo (shape with -1 for unknown dimensions).
        what: How to name it in errors.
        squeezable: A target or weight: a trailing dimension of 1 more or less
            than the capture's is reshaped away (Keras' losses do the same).

    Raises:
        DataError: the examples do not have the captured shape, or strings for a
            numeric input (or the reverse).
    """
    expected = list(info.shape)[1:]
    got = list(array.shape[1:])
    if squeezable and not _matches(got, expected):
        if len(got) == len(expected) + 1 and got[-1] == 1:
            array = array.reshape(array.shape[:-1])
        elif len(got) + 1 == len(expected) and expected[-1] == 1:
            array = array.reshape(array.shape + (1,))
        got = list(array.shape[1:])
    if not _matches(got, expected):
        shown = ", ".join(["N"] + ["None" if d < 0 else str(d) for d in expected])
        hint = ""
        if squeezable and getattr(info, "role", "") == "y":
            # Without example targets the capture takes the model's output's shape.
            hint = (". A loss that takes targets shaped unlike the model's output (class "
                    "ids of a contrastive loss) needs them at capture: "
                    "optimize(model, spec, x=..., y=...) or capture(model, x=..., y=...) "
                    "with a batch of what fit gets")
        raise DataError(f"{what} needs an array of shape ({shown}) for N examples (None: "
                        f"any length); received one of shape {tuple(array.shape)}{hint}")
    dtype = np.dtype(np.bytes_) if info.dtype == "string" else np.dtype(info.dtype)
    if (dtype.kind == "S") != (array.dtype.kind == "S"):
        raise DataError(f"{what} takes {'strings' if dtype.kind == 'S' else info.dtype}; "
                        f"received an array of {array.dtype}")
    if dtype.kind == "S":
        return np.ascontiguousarray(array)
    return np.ascontiguousarray(array.astype(dtype, copy=False))


def _matches(got: list[int], expected: list[int]) -> bool:
    return len(got) == len(expected) and all(e < 0 or g == e for g, e in zip(got, expected))


def fit_arrays(x: Any, y: Any, sample_weight: Any, graph_item: Any) -> FitArrays:
    """fit's arrays, flattened to the capture's order, checked and converted.

    Raises:
        DataError: a structure or shape Keras would refuse, different numbers of
            examples, or no examples.
    """
    x_infos = graph_item.model_inputs
    y_infos = graph_item.target_inputs
    w_infos = graph_item.sample_weight_inputs
    # Keras' functional models adjust an input's rank by a trailing 1 too.
    inputs = [conform(to_array(a, input_label(i)), i, input_label(i), squeezable=True)
              for a, i in zip(flatten_inputs(x, x_infos), x_infos)]
    targets = [conform(to_array(a, target_label(i)), i, target_label(i), squeezable=True)
               for a, i in zip(flatten_targets(y, y_infos), y_infos)]
    weights = flatten_weights(sample_weight, w_infos)
    if weights is not None:
        if not w_infos:
            raise DataError("this capture takes no sample weights (a function or v1 graph, or "
                            "an old capture): capture the Keras model again")
        if isinstance(weights, list):
            weights = [_weight_array(w, info) for w, info in zip(weights, w_infos)]
        else:
            shared = [_weight_array(weights, info) for info in w_infos]
            weights = shared[0] if all(s.shape == shared[0].shape for s in shared) else shared
    counts = {f"{input_label(i)}": len(a) for a, i in zip(inputs, x_infos)}
    counts.update({target_label(i): len(a) for a, i in zip(targets, y_infos)})
    for w, info in zip(weights if isinstance(weights, list) else
                       [weights] if weights is not None else [], w_infos):
        counts[weight_label(info)] = len(w)
    if len(set(counts.values())) > 1:
        raise DataError(f"x, y and sample_weight must have the same number of examples; "
                        f"received {counts}")
    if counts and not next(iter(counts.values())):
        raise DataError("fit received 0 examples")
    return FitArrays(inputs, targets, weights)


def _weight_array(value: Any, info: Any) -> np.ndarray:
    what = weight_label(info)
    array = to_array(value, what)
    if array.dtype.kind not in "fiub":
        raise DataError(f"{what} must hold numbers; received an array of {array.dtype}")
    array = conform(array.astype(np.float32), info, what, squeezable=True)
    if not np.all(np.isfinite(array)):
        raise DataError(f"{what} holds values that are not finite")
    return array
