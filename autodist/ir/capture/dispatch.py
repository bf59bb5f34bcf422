"""capture(): which kind of training step a target is, and its capture."""
from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from autodist.ir.capture.function import capture_function
from autodist.ir.capture.keras_model import capture_keras
from autodist.ir.capture.keras_specs import custom_train_step_class
from autodist.ir.capture.keras_train_step import capture_custom_step
from autodist.ir.capture.v1_graph import capture_v1
from autodist.ir.errors import CaptureError
from autodist.ir.graph_item import GraphItem


DEFAULT_ESTIMATE_BATCH_SIZE = 32


def capture(target: Any, *, x: Any = None, y: Any = None,
            input_signature: Sequence[tf.TensorSpec] | None = None,
            variables: Sequence[Any] | None = None,
            optimizer: Any = None, name: str | None = None,
            estimate_batch_size: int = DEFAULT_ESTIMATE_BATCH_SIZE) -> GraphItem:
    """Traces one training step of `target` into a GraphItem.

    Args:
        target: A compiled `keras.Model`; or a callable computing a scalar loss
            from its inputs (then `variables`, `input_signature` and
            `optimizer` are required); or a scalar loss `tf.Tensor` of a
            `tf.compat.v1` graph (then `optimizer` is a `tf.compat.v1.train`
            optimizer).
        x: Keras only: an example batch of inputs (or a TensorSpec structure);
            needed for subclassed models, otherwise taken from `model.inputs`
            (an example's dimensions count only where the model's inputs leave
            them unknown). Or a `tf.data.Dataset` of (inputs, targets[,
            weights]) batches, as `fit` takes it: its element spec gives both.
        y: Keras only: an example batch of targets (or a TensorSpec); by
            default inferred from the model output and the loss.
        input_signature: Function only: TensorSpecs of the inputs.
        variables: Function: the trainable variables. v1 graph: optional
            subset of the trainable variables.
        optimizer: Function or v1 graph: the optimizer.
        name: Name of the GraphItem (default: model or function name).
        estimate_batch_size: Batch size used for per-op FLOP/byte estimates.

    Returns:
        The GraphItem.

    Raises:
        CaptureError: naming what is missing or unsupported.
    """
    import keras

    if estimate_batch_size < 1:
        raise CaptureError(f"estimate_batch_size must be >= 1. Received: {estimate_batch_size!r}")
    if isinstance(target, keras.Model):
        from_dataset = isinstance(x, tf.data.Dataset)
        x, y, weights = _dataset_specs(x, y)
        if variables is not None or input_signature is not None or optimizer is not None:
            raise CaptureError("a Keras model takes its variables, inputs and optimizer from "
                               "the model and its compile(); pass x=/y= examples instead")
        custom = custom_train_step_class(target)
        if custom is not None:  # the user's own step, as it runs
            # A dataset of inputs alone: fit hands the step x alone, whatever is compiled.
            return capture_custom_step(target, custom, x, y, name, estimate_batch_size,
                                       weights=weights,
                                       targets=not from_dataset or y is not None)
        return capture_keras(target, x, y, name, estimate_batch_size)
    if isinstance(target, tf.Tensor):
        if tf.is_symbolic_tensor(target) and not isinstance(target.graph, _func_graph_type()):
            return capture_v1(target, optimizer, variables, name, estimate_batch_size)
        raise CaptureError("a tensor passed to capture() must be the loss of a "
                           f"tf.compat.v1 graph. Received: {target!r}")
    if callable(target):
        return capture_function(target, variables, input_signature, optimizer, name,
                                 estimate_batch_size)
    raise CaptureError("capture() takes a compiled keras.Model, a loss function, or a "
                       f"tf.compat.v1 loss tensor. Received: {type(target).__name__}")


def _dataset_specs(x: Any, y: Any) -> tuple[Any, Any, Any]:
    """A dataset passed as `x` stands for its batches' specs: inputs, targets unless `y`
    is given, and sample weights where its elements hold them (lengths it leaves unknown
    stay unknown, as in Keras' traced step). The batch dimension is left unknown also
    where the dataset fixes it (`batch(..., drop_remainder=True)`): replicas run parts
    of a batch, and the capture's analyses need it unknown."""
    if not isinstance(x, tf.data.Dataset):
        return x, y, None
    spec = tf.nest.map_structure(_any_batch, x.element_spec)
    if isinstance(spec, tuple) and len(spec) in (2, 3):
        return spec[0], spec[1] if y is None else y, spec[2] if len(spec) == 3 else None
    if isinstance(spec, tuple) and len(spec) == 1:
        spec = spec[0]
    return spec, y, None


def _any_batch(spec: Any) -> Any:
    """`spec` with an unknown first (batch) dimension."""
    if isinstance(spec, tf.TensorSpec) and spec.shape.rank:
        return tf.TensorSpec([None] + spec.shape.as_list()[1:], spec.dtype, spec.name)
    return spec


def _func_graph_type() -> type:
    from tensorflow.python.framework import func_graph
    return func_graph.FuncGraph
