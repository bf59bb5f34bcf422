"""Capture of a compiled Keras 3 model's training step."""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from autodist.ir.capture.added_losses import (added_loss_terms, classify_added_losses,
                                              scaled_added_losses)
from autodist.ir.capture.constraints import attach_constraints
from autodist.ir.capture.draw_rows import find_row_blocks
from autodist.ir.capture.example_runs import infer_draw_shapes
from autodist.ir.capture.fixed_lookups import FIXED_ROWS_SCOPE, find_repeated_lookups
from autodist.ir.capture.keras_loss import (check_keras_losses, keras_compute_loss,
                                           record_loss_reductions, sum_scaled_weights)
from autodist.ir.capture.keras_metrics import (build_keras_metrics, keras_metric_variables,
                                               metric_contributions)
from autodist.ir.capture.keras_specs import (build_model, custom_train_step_class,
                                             keras_input_names, keras_input_spec,
                                             keras_target_names, keras_target_spec,
                                             sample_weight_name, sample_weight_spec,
                                             user_override)
from autodist.ir.capture.names import unique_names
from autodist.ir.capture.optimizer import describe_optimizer
from autodist.ir.capture.traced_function import from_concrete_function
from autodist.ir.errors import CaptureError
from autodist.ir.graph_item import LOSS_SCALE_INPUT, GraphItem


def capture_keras(model, x, y, name, batch_size) -> GraphItem:
    """A compiled Keras model's step (see `capture`)."""
    check_compiled(model)
    custom = custom_train_step_class(model)
    if custom is not None:
        raise CaptureError(f"model {model.name!r} overrides train_step (in "
                           f"{custom.__qualname__}): capture it with autodist.capture")
    check_keras_stateful_layers(model)
    x_spec = keras_input_spec(model, x)
    build_model(model, x, x_spec)
    # Compiled without a loss, Keras' step computes only the terms the layers add
    # (`add_loss`); it reads the targets only for compiled metrics or the model's own
    # compute_loss (it hands them over: keras-io's masked language model), else none.
    reads_targets = model.loss is not None or \
        getattr(model, "_compile_metrics", None) is not None or \
        (y is not None and user_override(model, "compute_loss") is not None)
    y_spec = keras_target_spec(model, x_spec, y) if reads_targets else None
    trainable = list(model.trainable_variables)
    if not trainable:
        raise CaptureError(f"model {model.name!r} has no trainable variables")
    check_keras_losses(model)
    check_optimizer_built_for(model, trainable)

    build_keras_metrics(model, x_spec, y_spec)
    metric_variables = keras_metric_variables(model)
    optimizer_info = describe_optimizer(model.optimizer, trainable,
                                     unique_names([v.path for v in trainable]))
    loss_scaling = optimizer_info.HasField("loss_scale")

    def step(inputs, targets, sample_weight):
        # Keras' TensorFlow train step, without the optimizer.
        with tf.GradientTape() as tape:
            if getattr(model, "_call_has_training_arg", True):
                predictions = model(inputs, training=True)
            else:
                predictions = model(inputs)
            terms = added_loss_terms(model)
            # A loss reducing by a sum reads its weights times a scale the runtime feeds.
            loss_weights = sum_scaled_weights(model, y_spec, sample_weight)
            with scaled_added_losses(model, terms):
                loss = keras_compute_loss(model, inputs, targets, predictions, loss_weights)
            # Keras tracks the loss, and differentiates it times the dynamic loss
            # scale (`LOSS_SCALE_INPUT`, 1 unless fed) under a LossScaleOptimizer.
            scaled = loss * tf.cast(tf.compat.v1.placeholder_with_default(
                1.0, [], name=LOSS_SCALE_INPUT), loss.dtype) if loss_scaling else loss
        grads = rows_per_example(tape.gradient(scaled, [v.value for v in trainable]), inputs)
        return (loss, grads, metric_contributions(model, metric_variables, inputs, targets,
                                                   predictions, sample_weight, loss,
                                                   loss_weights), terms)

    target_names = keras_target_names(model, y_spec)
    weight_spec = sample_weight_spec(model, x_spec, y_spec)
    try:
        concrete = tf.function(step, autograph=False).get_concrete_function(x_spec, y_spec,
                                                                             weight_spec)
    except ValueError as e:
        if model.loss is None and "No loss to compute" in str(e):
            raise CaptureError(
                f"model {model.name!r} was compiled without a loss and none of its layers "
                "adds one (add_loss): Keras' fit has no loss to compute either. Pass "
                "compile(loss=...)") from e
        raise
    names = unique_names([v.path for v in trainable])
    state = [v for v in model.variables if not v.trainable]
    input_names = keras_input_names(model, x_spec)
    input_infos = [(n, "x") for n in input_names] + \
        [(n, "y") for n in target_names] + \
        [(sample_weight_name(n), "sample_weight") for n in target_names]
    item = from_concrete_function(
        concrete, trainable, names, state, unique_names([v.path for v in state]),
        input_infos, optimizer_info,
        "keras", name or model.name, batch_size,
        metric_names=unique_names([v.path for v in metric_variables]),
        tables=keras_lookup_tables(model))
    # Keras applies them after each update: traced here, applied by every task.
    attach_constraints(item, trainable, names)
    infer_draw_shapes(item, model)
    find_row_blocks(item, model)
    classify_added_losses(item, model)
    find_repeated_lookups(item, model)
    record_loss_reductions(item, model, y_spec)
    # Keras resolves jit_compile="auto" when compiling: True where XLA serves the model.
    item.proto.jit_compile = getattr(model, "jit_compile", False) is True
    return item


def rows_per_example(gradients: list, inputs) -> list:
    """Sparse gradients whose rows are lookups of the examples, as they are; the others
    (rows looked up at indices that do not depend on the batch, e.g. a position
    embedding's `arange`, each row summed over the batch) as dense tensors.

    A replica's sparse gradient holds its examples' rows; Keras' optimizers square
    each row of the batch's gradient (Adam's second moment), which the replicas'
    rows reproduce only when each row is one example's lookup. Rows summed over the
    batch are summed over the replicas first, as a dense gradient is, which is what
    Keras computes from unique rows.
    """
    sources = {t.op for t in tf.nest.flatten(inputs)}
    out = []
    for grad in gradients:
        if isinstance(grad, tf.IndexedSlices) and not _reads_any(grad.indices, sources):
            with tf.name_scope(FIXED_ROWS_SCOPE):   # found again by `fixed_lookups`
                grad = tf.convert_to_tensor(grad)
        out.append(grad)
    return out


# Ops whose outputs depend on their input's shape, not its values.
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})


def _reads_any(tensor, sources: set) -> bool:
    """Whether `tensor` is computed from the values of any of the ops `sources` (a
    position embedding's `arange` over a variable length reads only their shape)."""
    seen, todo = set(), [tensor.op]
    while todo:
        op = todo.pop()
        if op in sources:
            return True
        if op in seen or op.type in _SHAPE_OPS:
            continue
        seen.add(op)
        todo.extend(t.op for t in op.inputs)
    return False


def check_compiled(model) -> None:
    """Refuses a model that is not compiled (no optimizer to rebuild)."""
    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", False):
        raise CaptureError(f"model {model.name!r} is not compiled: call "
                           "model.compile(optimizer=..., loss=...) before capture")


def check_optimizer_built_for(model, trainable) -> None:
    """An optimizer built (by a fit) for other variables than the trainable ones now: a
    `trainable` flag changed without `compile` again, which Keras' fit ignores (it warns
    and trains the compiled variables) and a capture cannot follow."""
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    known = getattr(optimizer, "_trainable_variables", None)
    if not getattr(optimizer, "built", False) or known is None:
        return
    built_for = {id(v) for v in known}
    if len(known) != len(trainable) or any(id(v) not in built_for for v in trainable):
        raise CaptureError(
            f"model {model.name!r}'s optimizer was built for {len(known)} variables, but "
            f"{len(trainable)} are trainable now: a layer's `trainable` changed since the "
            "model was compiled, which Keras' fit ignores until it is compiled again. Call "
            "model.compile(...) again (a new optimizer, as keras-io's fine-tuning guide "
            "does), then capture")


def check_keras_stateful_layers(model) -> None:
    """A stateful RNN (`stateful=True`) carries each row's final state into the same row
    of the next batch on Keras' one device; replicas splitting the global batch would
    each need exactly their rows' states, carried between steps: refused."""
    flatten = getattr(model, "_flatten_layers", None)
    stateful = sorted(f"{layer.name!r} ({type(layer).__name__})"
                      for layer in (flatten(include_self=False) if flatten else [])
                      if getattr(layer, "stateful", False) is True)
    if stateful:
        raise CaptureError(
            f"model {model.name!r} has stateful recurrent layer(s) {', '.join(stateful)} "
            "(stateful=True): Keras carries each example position's last state into the "
            "next batch on one device, which replicas splitting the batch cannot reproduce. "
            "Use stateful=False (each batch starts from zero states, or pass initial_state), "
            "or train this model with Keras' fit on a single device")


def keras_lookup_tables(model) -> list[tuple[str, Any]]:
    """(layer name, table) of every lookup table the model's layers hold (StringLookup,
    IntegerLookup, TextVectorization's)."""
    out, seen = [], set()
    flatten = getattr(model, "_flatten_layers", None)
    for layer in (flatten(include_self=False) if flatten else []):
        for value in list(vars(layer).values()):
            if hasattr(value, "resource_handle") and hasattr(value, "export") and \
                    hasattr(value, "key_dtype") and id(value) not in seen:
                seen.add(id(value))
                out.append((layer.name, value))
    return out
