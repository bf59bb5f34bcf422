"""What couples the examples of a batch, found on random values: compiled losses
and layers that a replica holding part of the batch cannot compute as Keras
does.

A replica computes the compiled loss on its part of the global batch and is
weighted by its share, which equals Keras' loss on the whole batch when the loss
is a mean of per-example values (Keras' default reductions) or a sum of them
(`reduction="sum"`, counted in full). A loss that compares the batch's examples
with each other (keras-io's supervised contrastive loss: a softmax over every
pair of the batch) is neither: each replica would compare only its own examples,
and train something else than Keras. Such a loss is found by evaluating it,
eagerly, on random predictions and targets of one batch and of its two halves,
and again on parts of 3 and 5 examples whose targets and predictions differ from
example to example (a loss normalized by the batch's count of non-padding
tokens, keras-io's NER loss, is its halves' mean to 3e-5 on balanced random
targets; unequal parts with unequal counts tell). The same holds for the model
itself: its outputs in inference mode for one half of a random batch, alone and
within the batch, differ where a layer mixes examples (keras-io's Switch
Transformer routes each token to an expert with a capacity counted over the
whole batch). Batch normalization in training mode, masked losses' counts and
random draws are made global by the runtime; they are not looked at here.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

# Examples in the random batch (split into two halves of equal size).
_BATCH = 8
# A per-example loss's value on the batch equals its halves' mean (or sum) to float32
# rounding; a coupled one differs by far more.
_RTOL = 1e-4
_ATOL = 1e-6
# Outputs (activations of any scale) agree to float32 rounding in another batching.
_OUTPUT_ATOL = 1e-5


def coupled_losses(model: Any, graph_item: Any) -> list[str]:
    """The compiled losses of `model` whose value on a batch is neither the mean nor the
    sum of their values on its two halves ("name (class)"), seen on random values.

    The outputs' shapes are a functional or Sequential model's, or inferred for a
    subclassed model of one input; a loss that fails on random values, or gives a
    value that is not finite, is left alone (nothing can be told from it).
    """
    compile_loss = getattr(model, "_compile_loss", None)
    flat = getattr(compile_loss, "_flat_losses", None) or []
    outputs = _output_specs(model, graph_item)
    if not flat or not outputs:
        return []
    output_names = list(getattr(model, "output_names", None) or [""] * len(outputs))
    targets = _targets_by_output(graph_item, output_names)
    if targets is None:
        return []
    rng = np.random.default_rng(0)
    found = []
    for entry in flat:
        index = _output_index(tuple(entry.path), output_names)
        if index is None or index >= len(outputs) or targets[index] is None:
            continue
        shapes = (list(targets[index].shape), targets[index].dtype, outputs[index].shape)
        if _couples(entry.loss, rng, *shapes):
            loss = entry.loss
            inner = getattr(loss, "fn", None)
            what = getattr(inner, "__name__", None) or type(loss).__name__
            name = getattr(loss, "name", None) or what
            found.append(name if name == what else f"{name} ({what})")
    return found


def _output_specs(model: Any, graph_item: Any) -> list:
    """The model's outputs (KerasTensors): a functional or Sequential model's, or a
    subclassed model's of one input inferred from the capture's input spec; [] if
    unknown."""
    outputs = getattr(model, "outputs", None)
    if outputs:
        return list(outputs)
    inputs = graph_item.model_inputs
    if len(inputs) != 1:
        return []
    import keras

    info = inputs[0]
    try:
        out = model.compute_output_spec(keras.KerasTensor(
            [None if d < 0 else d for d in info.shape], dtype=info.dtype))
    except Exception:  # noqa: BLE001  # Keras raises many types here
        return []
    return [out] if isinstance(out, keras.KerasTensor) else []


def _targets_by_output(graph_item: Any, output_names: list[str]) -> list | None:
    """The step's target input of each output (None where it has none), or None when
    they do not pair up."""
    from autodist.ir.capture.keras_specs import target_name

    targets = graph_item.target_inputs
    if len(output_names) == 1:
        return targets if len(targets) == 1 else None
    by_name = {info.name: info for info in targets}
    return [by_name.get(target_name(name), by_name.get(f"y/output_{i}"))
            for i, name in enumerate(output_names)]


def _output_index(path: tuple, output_names: list[str]) -> int | None:
    """The flat output a compiled loss's path (in Keras' y_pred structure) names."""
    if not path:
        return 0
    key = path[0]
    if isinstance(key, int):
        return key
    return output_names.index(key) if key in output_names else None


def _shape(dims: list[int | None]) -> list[int]:
    """The batch's shape: `_BATCH` examples, other unknown dimensions of length 3."""
    return [_BATCH] + [3 if d is None or d < 0 else int(d) for d in dims[1:]]


def _random_targets(rng: np.random.Generator, shape: list[int], dtype: str,
                    varied: bool = False):
    """Targets a loss accepts: floats in (0, 1) (probabilities, regression values),
    integers 0 or 1 (class ids, one-hot values); None for other dtypes. `varied`: the
    k-th example's integers are 1 with probability (k + 0.5) / `_BATCH` (so parts of the
    batch hold unequal counts of each class)."""
    full = _shape(shape)
    if dtype.startswith("float") or dtype in ("half", "bfloat16"):
        return rng.uniform(0.05, 0.95, full).astype("float32")
    if dtype.startswith(("int", "uint")) or dtype == "bool":
        if not varied:
            return rng.integers(0, 2, full).astype("int32")
        odds = ((np.arange(_BATCH) + 0.5) / _BATCH).reshape([_BATCH] + [1] * (len(full) - 1))
        values = (rng.random(full) < odds).astype("int32")
        first = (0,) * (len(full) - 1)
        values[(1,) + first], values[(_BATCH - 1,) + first] = 1, 0   # each part holds both
        return values
    return None


def _random_predictions(rng: np.random.Generator, shape,
                        varied: bool = False) -> np.ndarray | None:
    """Predictions in (0, 1): valid probabilities and logits alike; `varied`: the k-th
    example's raised to the power 1 + k / 2 (losses that differ from example to example)."""
    try:
        dims = list(shape)
    except TypeError:
        return None
    values = rng.uniform(0.05, 0.95, _shape(dims))
    if varied:
        values = values ** (1.0 + np.arange(_BATCH) / 2.0).reshape(
            [_BATCH] + [1] * (values.ndim - 1))
    return values.astype("float32")


def _couples(loss: Any, rng: np.random.Generator, target_shape: list, target_dtype: str,
             output_shape) -> bool:
    """Whether `loss` of a random batch is neither its parts' example-weighted mean nor
    their sum: on two equal halves of uniform random values, then on parts of 3 and 5
    examples that differ from each other. Not a loss that Keras itself normalizes by the
    batch's count of values not ignored (`ignore_class`): the run sums that count over
    replicas (`autodist.kernels.loss_masks`)."""
    if getattr(loss, "ignore_class", None) is not None:
        return False
    for split, varied in ((_BATCH // 2, False), (3, True)):
        y_true = _random_targets(rng, target_shape, target_dtype, varied)
        y_pred = _random_predictions(rng, output_shape, varied)
        if y_true is None or y_pred is None:
            return False
        values = _loss_values(loss, y_true, y_pred, split)
        if values is not None and not _adds_up(*values, split):
            return True
    return False


def _loss_values(loss: Any, y_true: np.ndarray, y_pred: np.ndarray, split: int
                 ) -> tuple[float, float, float] | None:
    """The loss on the batch and on its parts before and after example `split`, or None
    where it cannot be evaluated."""
    try:
        values = tuple(float(np.asarray(loss(y_true[part], y_pred[part])))
                       for part in (slice(None), slice(0, split), slice(split, None)))
    except Exception:  # noqa: BLE001  # a loss that does not take random values
        return None
    return values if all(math.isfinite(v) for v in values) else None


def _adds_up(whole: float, first: float, second: float, split: int = _BATCH // 2) -> bool:
    """Whether the batch's value is its parts' mean weighted by their examples (a mean
    reduction) or their sum."""
    scale = max(abs(whole), abs(first), abs(second))
    mean = (split * first + (_BATCH - split) * second) / _BATCH
    return any(abs(whole - want) <= _ATOL + _RTOL * scale for want in (mean, first + second))


def coupled_outputs(model: Any) -> bool:
    """Whether the model's outputs for half of a random batch, in inference mode, differ
    from its outputs for that half alone: a layer mixes the batch's examples.

    A functional or Sequential model, or a subclassed one built by a call on
    `keras.Input` (its inputs' structure is known); one that fails on random inputs,
    or whose outputs change from call to call (a layer drawing random numbers in
    inference mode), is left alone. The model's non-trainable state (the seed
    generators such a layer advances) is put back after.
    """
    structure = _input_structure(model)
    if structure is None:
        return False
    return _mixes_examples(model, structure)


def coupling_layer(model: Any) -> str | None:
    """The first layer of a functional or Sequential model whose outputs mix the batch's
    examples (`coupled_outputs` on the model cut after it), for messages; None where
    none is found (a subclassed model, or layers that cannot be cut out)."""
    import keras

    structure = _input_structure(model)
    if structure is None:
        return None
    for layer in getattr(model, "layers", []):
        try:
            cut = keras.Model(structure, layer.output)
        except Exception:  # noqa: BLE001  # an input layer, a layer called several times
            continue
        if _mixes_examples(cut, structure):
            return layer.name
    return None


def _mixes_examples(model: Any, structure) -> bool:
    """`coupled_outputs` for a model called with inputs of `structure`."""
    import keras

    rng = np.random.default_rng(1)
    batch = keras.tree.map_structure(lambda t: _random_inputs(rng, t), structure)
    half = _BATCH // 2
    parts = [keras.tree.map_structure(lambda a, s=s: a[s], batch)
             for s in (slice(None), slice(0, half), slice(half, None))]
    state = [(v, np.array(v.numpy())) for v in model.variables if not v.trainable]
    try:
        # The whole batch twice: a layer drawing random numbers without a `training`
        # gate (a VAE's Sampling) gives other outputs each call, and nothing can be told.
        whole, again, first, second = ([np.asarray(o) for o in
                                        keras.tree.flatten(model(part, training=False))]
                                       for part in parts[:1] + parts)
    except Exception:  # noqa: BLE001  # a model that does not take random inputs
        return False
    finally:
        for variable, value in state:
            variable.assign(value)
    if not all(np.array_equal(a, b, equal_nan=True) for a, b in zip(whole, again)):
        return False
    for out, a, b in zip(whole, first, second):
        if out.shape[:1] != (_BATCH,) or not np.issubdtype(out.dtype, np.number) or \
                not np.all(np.isfinite(out)):
            continue   # not one row per example (or nothing to compare)
        # float16 outputs (mixed precision) round differently in another batching.
        rtol, atol = (1e-2, 1e-3) if out.dtype.itemsize < 4 and \
            np.issubdtype(out.dtype, np.floating) else (_RTOL, _OUTPUT_ATOL)
        if not (np.allclose(out[:half], a, rtol=rtol, atol=atol) and
                np.allclose(out[half:], b, rtol=rtol, atol=atol)):
            return True
    return False


def _input_structure(model: Any):
    """The model's inputs (KerasTensors) in the structure it is called with, or None:
    a functional model's `input`, a Sequential model's one input, a subclassed model's
    input when it was built by a call on `keras.Input`."""
    try:
        return model.input
    except (AttributeError, ValueError):  # a Sequential model built from keras.Input
        inputs = getattr(model, "inputs", None)
    if not inputs:
        return None
    return inputs[0] if len(inputs) == 1 else list(inputs)


def _random_inputs(rng: np.random.Generator, spec) -> np.ndarray:
    """Random values for a model input (a KerasTensor): normal floats, 0/1 integers,
    "" or "a" strings, so that the examples differ."""
    shape = _shape(list(spec.shape))
    dtype = str(spec.dtype)
    if dtype == "string":
        return rng.choice(np.array([b"", b"a"], dtype=object), shape)
    if dtype.startswith(("int", "uint")) or dtype == "bool":
        return rng.integers(0, 2, shape).astype(dtype)
    return rng.normal(size=shape).astype(dtype)
