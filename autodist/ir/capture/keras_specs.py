"""The input, target and sample-weight specs of a Keras model's step, and their
names."""
from __future__ import annotations

import re

import numpy as np
import tensorflow as tf

from autodist.ir.capture.names import unique_names
from autodist.ir.device_names import op_name
from autodist.ir.errors import CaptureError


def user_override(model, method: str) -> type | None:
    """The class of `model` whose `method` overrides Keras' own, or None."""
    for klass in type(model).__mro__:
        if method in vars(klass):
            return None if klass.__module__.startswith("keras.") else klass
    return None


def custom_train_step_class(model) -> type | None:
    """The class of `model` whose `train_step` overrides Keras' own, or None."""
    return user_override(model, "train_step")


def build_model(model, x, x_spec) -> None:
    """Builds `model` as Keras' fit does, by calling it on the example batch `x`.

    Raises:
        CaptureError: the model is not built and no example batch says how.
    """
    if not model.built and x is not None and not any(
            isinstance(v, tf.TensorSpec) for v in tf.nest.flatten(x)):
        model(tf.nest.map_structure(lambda v: tf.convert_to_tensor(
            np.asarray(v)[:1], spec_of(v).dtype), x))
    if not model.built:
        given = " (TensorSpecs or a dataset say its shapes, not how to build it)" \
            if x is not None else ""
        raise CaptureError(f"model {model.name!r} is not built{given}: call it on a batch, "
                           "or pass capture(model, x=example_batch) with arrays")


def keras_input_spec(model, x):
    """The step's input specs, in the structure the model is called with.

    A functional model built on a dict of inputs is called with a dict (its
    keys name the inputs); otherwise a list in `model.inputs` order, or the
    structure of the example `x`.
    """
    declared = _declared_input_spec(model)
    if x is not None:
        if isinstance(x, dict):
            spec = {key: _named(spec_of(value), str(key)) for key, value in x.items()}
        else:
            spec = tf.nest.map_structure(spec_of, x)
        return spec if declared is None else _relaxed(spec, declared)
    if declared is not None:
        return declared
    kind = "a Sequential model without keras.Input, which Keras' fit builds on the first " \
        "batch" if type(model).__name__ == "Sequential" else \
        "a subclassed model: Keras keeps no input shape for it, even once called"
    raise CaptureError(f"cannot infer the input shape of model {model.name!r} ({kind}): "
                       "pass an example batch, optimize(model, spec, x=..., y=...) or "
                       "capture(model, x=..., y=...)")


def _relaxed(spec, declared):
    """The example's specs with the dimensions the model's inputs leave unknown unknown
    (a batch of padded sequences fixes a length the model takes any of). A dict's
    inputs are matched by name (keeping its keys as names), others in order (taking
    the inputs' names); left as they are where they do not match."""
    def relax(example: tf.TensorSpec, model_spec: tf.TensorSpec, name: str | None
              ) -> tf.TensorSpec:
        if example.shape.rank is None or example.shape.rank != model_spec.shape.rank:
            return example
        dims = [None if m is None else e
                for e, m in zip(example.shape.as_list(), model_spec.shape.as_list())]
        return tf.TensorSpec(dims, example.dtype, name=name)

    if isinstance(spec, dict):
        by_name = declared if isinstance(declared, dict) else \
            {s.name: s for s in tf.nest.flatten(declared)}
        return {key: relax(value, by_name[key], value.name) if key in by_name else value
                for key, value in spec.items()}
    flat, flat_declared = tf.nest.flatten(spec), tf.nest.flatten(declared)
    if isinstance(declared, dict) or len(flat) != len(flat_declared):
        return spec
    return tf.nest.pack_sequence_as(spec, [
        relax(e, m, m.name or e.name) for e, m in zip(flat, flat_declared)])


def _declared_input_spec(model):
    """The specs of the model's declared inputs (`keras.Input`s), in the structure it is
    called with; None where it declares none (a subclassed model, a Sequential without
    an Input)."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        inputs = None
    if inputs:
        struct = getattr(model, "_inputs_struct", None)
        if isinstance(struct, dict) and all(not tf.nest.is_nested(t) for t in struct.values()):
            return {key: tf.TensorSpec(_batch_free(t.shape), tf.as_dtype(t.dtype),
                                       name=_clean(str(key)))
                    for key, t in struct.items()}
        specs = [tf.TensorSpec(_batch_free(t.shape), tf.as_dtype(t.dtype),
                               name=_input_name(getattr(t, "name", None), i))
                 for i, t in enumerate(inputs)]
        return specs[0] if len(specs) == 1 else specs
    return None


# What Keras names an `Input` the user did not name.
_KERAS_AUTO_NAME = re.compile(r"keras_tensor(_\d+)?")


def _input_name(name: str | None, index: int) -> str:
    """An input's name as the user gave it (`Input(name=...)`), else ``input_<i>``."""
    if not name or _KERAS_AUTO_NAME.fullmatch(op_name(name)):
        return f"input_{index}"
    return _clean(name)


def _named(spec: tf.TensorSpec, name: str) -> tf.TensorSpec:
    return tf.TensorSpec(spec.shape, spec.dtype, name=_clean(name))


def keras_input_names(model, x_spec) -> list[str]:
    """The step's input names, in the flat order of `x_spec`."""
    flat = tf.nest.flatten(x_spec)
    names = [s.name or f"input_{i}" for i, s in enumerate(flat)]
    return unique_names(names) if len(flat) > 1 else [names[0] or "x"]


def sample_weight_name(target_name: str) -> str:
    """The sample-weight input of a target: "sample_weight", or "sample_weight/<output>"."""
    return "sample_weight" if target_name == "y" else "sample_weight" + target_name[1:]


def sample_weight_spec(model, x_spec, y_spec):
    """Per target, the spec of its sample weights, in the targets' structure.

    A weight multiplies each value of the output's unreduced loss (Keras'
    `reduce_weighted_values`), so its shape is that of the loss values: one
    per example, or one per example and timestep for a loss over a sequence
    (a `(N, T)` target of a `(N, T, V)` output, a `(N, T, F)` sequence).
    """
    if y_spec is None:
        return None
    losses = losses_by_target(model, y_spec)
    try:
        outputs = model.compute_output_spec(tf.nest.map_structure(symbolic, x_spec))
    except Exception:  # noqa: BLE001  # Keras raises many types here
        outputs = None
    flat_y = tf.nest.flatten(y_spec)
    flat_out = tf.nest.flatten(outputs) if outputs is not None else []
    specs = []
    for i, target in enumerate(flat_y):
        output = flat_out[i] if len(flat_out) == len(flat_y) else None
        shape = _loss_values_shape(losses[i] if i < len(losses) else None, target, output)
        specs.append(tf.TensorSpec(shape, tf.float32))
    return tf.nest.pack_sequence_as(y_spec, specs)


def losses_by_target(model, y_spec) -> list:
    """The compiled loss of each target, in the flat order of `y_spec` (None: none)."""
    flat_y = tf.nest.flatten(y_spec)
    if isinstance(y_spec, tf.TensorSpec):
        return [model.loss]
    names = keras_target_names(model, y_spec)
    out = []
    for i, name in enumerate(names):
        try:
            out.append(_loss_of(model, name[len("y/"):], i))
        except CaptureError:
            out.append(None)
    return out + [None] * (len(flat_y) - len(out))


def _loss_values_shape(loss, target: tf.TensorSpec, output) -> list[int | None]:
    """The shape of a loss's values before reduction (`Loss.call`), batch unknown;
    one value per example where it cannot be traced."""
    import keras
    from keras.src.trainers import compile_utils

    if loss is None or output is None:
        return [None]
    y_pred = tf.TensorSpec(_batch_free(output.shape), tf.as_dtype(output.dtype))
    try:
        resolved = compile_utils.get_loss(loss, symbolic(target), symbolic(y_pred))
        if not isinstance(resolved, keras.losses.Loss):
            return [None]
        values = tf.function(lambda t, p: resolved.call(t, p), autograph=False) \
            .get_concrete_function(target, y_pred).structured_outputs
    except Exception:  # noqa: BLE001  # a user's loss may raise anything
        return [None]
    if not isinstance(values, tf.Tensor) or values.shape.rank in (None, 0):
        return [None]
    return _batch_free(values.shape)


def keras_target_spec(model, x_spec, y):
    """The step's target specs: from the example `y`, or inferred from the outputs and losses."""
    if y is not None:
        spec = tf.nest.map_structure(spec_of, y)
        if isinstance(spec, tuple):
            spec = list(spec)
        return spec
    try:
        out = model.compute_output_spec(
            tf.nest.map_structure(symbolic, x_spec))
    except Exception as e:  # Keras raises many types here
        raise CaptureError(f"cannot infer the output of model {model.name!r} ({e}); "
                           "pass capture(model, x=..., y=example_targets)") from e
    if isinstance(out, dict):
        return {key: _target_spec_for(out[key], _loss_of(model, key, None)) for key in out}
    if isinstance(out, (list, tuple)):
        names = keras_output_names(model, len(out))
        return [_target_spec_for(o, _loss_of(model, n, i))
                for i, (o, n) in enumerate(zip(out, names))]
    return _target_spec_for(out, model.loss)


def _target_spec_for(output, loss) -> tf.TensorSpec:
    shape = _batch_free(output.shape)
    if _is_sparse_categorical(loss):
        return tf.TensorSpec(shape[:-1], tf.int32)
    dtype = tf.as_dtype(output.dtype)
    if dtype in (tf.float16, tf.bfloat16):
        dtype = tf.float32  # targets stay float32 under mixed precision, as Keras' losses take them
    return tf.TensorSpec(shape, dtype)


def keras_output_names(model, count: int) -> list[str]:
    names = list(getattr(model, "output_names", None) or [])
    return names if len(names) == count else [f"output_{i}" for i in range(count)]


def _loss_of(model, output_name: str, index: int | None):
    """The loss compiled for one output (a single loss applies to every output)."""
    loss = model.loss
    if isinstance(loss, dict):
        if output_name not in loss:
            raise CaptureError(f"model {model.name!r} has no loss for output "
                               f"{output_name!r} (losses for {sorted(loss)}); pass y=")
        return loss[output_name]
    if isinstance(loss, (list, tuple)):
        if index is None or index >= len(loss):
            raise CaptureError(f"cannot match the {len(loss)} losses of model "
                               f"{model.name!r} to its outputs; pass y=")
        return loss[index]
    return loss


def keras_target_names(model, y_spec) -> list[str]:
    """Names of the targets, in the step's input order: "y", or "y/<output>" per output
    (none where the step takes no targets)."""
    if y_spec is None:
        return []
    if isinstance(y_spec, tf.TensorSpec):
        return ["y"]
    if isinstance(y_spec, dict):
        names = [str(k) for k in sorted(y_spec)]
    else:
        flat = tf.nest.flatten(y_spec)
        names = keras_output_names(model, len(flat)) if len(flat) == len(y_spec) else \
            [f"output_{i}" for i in range(len(flat))]
    return unique_names([target_name(n) for n in names])


def symbolic(spec: tf.TensorSpec | None):
    """A Keras symbolic tensor of `spec` (None for None)."""
    import keras
    return None if spec is None else keras.KerasTensor(spec.shape, dtype=spec.dtype.name)


def _is_sparse_categorical(loss) -> bool:
    text = loss if isinstance(loss, str) else getattr(loss, "name", "") or ""
    fn = getattr(loss, "fn", None)
    if fn is not None:
        text += " " + getattr(fn, "__name__", "")
    if not isinstance(loss, str):
        text += " " + type(loss).__name__
    return "sparse_categorical" in text.lower() or "sparsecategorical" in text.lower()


def spec_of(value) -> tf.TensorSpec:
    """The TensorSpec of an example value (batch unknown; float64/int64 narrowed to 32 bits)."""
    if isinstance(value, tf.TensorSpec):
        return value
    arr = np.asarray(value) if not isinstance(value, tf.Tensor) else value
    dtype = tf.as_dtype(arr.dtype)
    if dtype == tf.float64:
        dtype = tf.float32
    if dtype == tf.int64:
        dtype = tf.int32
    return tf.TensorSpec([None] + list(arr.shape[1:]), dtype)


def _batch_free(shape) -> list[int | None]:
    dims = list(shape)
    return [None] + [None if d is None else int(d) for d in dims[1:]]


def target_name(output_name: str) -> str:
    """The step's target input of a model output named `output_name` (of several)."""
    return f"y/{_clean(output_name)}"


def _clean(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", op_name(name)) or "input"
