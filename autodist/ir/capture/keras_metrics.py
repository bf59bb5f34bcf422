"""A Keras model's compiled metrics: built, checked to sum over batches, and
each batch's contribution to their state."""
from __future__ import annotations


import numpy as np
import tensorflow as tf

from autodist.ir.capture.keras_loss import loss_weights_structure, traced_step_error
from autodist.ir.capture.keras_specs import symbolic
from autodist.ir.errors import CaptureError
from autodist.ir.graph_item import BATCH_PART_INPUT


def build_keras_metrics(model, x_spec, y_spec) -> None:
    """Builds the compiled metrics (as Keras' fit does) and checks they can be summed.

    The distributed step returns each batch's contribution to every metric's
    state, and the run sums them over replicas and steps. That is exact for
    state that is a sum over examples, as it is for every Keras metric (sums
    and counts, confusion counts); a metric of another kind is refused.
    """
    import keras

    compiled = model._compile_metrics  # noqa: SLF001
    compile_loss = model._compile_loss  # noqa: SLF001
    # The compiled loss makes its per-output trackers when built: build it (and the
    # metrics) now, so the trace does not create metric state the capture never lists.
    if any(part is not None and not part.built for part in (compiled, compile_loss)):
        try:
            model._symbolic_build(data_batch=(x_spec, y_spec))  # noqa: SLF001
        except (ValueError, TypeError) as e:
            # Keras' own build traces the model in inference mode, which its fit (one
            # device) never does: it builds them in the training step's trace. A model
            # whose inference path does not trace (RandomCrop passes the resized image
            # through uncropped at inference: keras-io's token_learner) is built so.
            try:
                _build_in_training_mode(model, x_spec, y_spec)
            except (ValueError, TypeError):
                raise traced_step_error(model, e) from e
    known = [model._loss_tracker, compiled]  # noqa: SLF001
    known += list(compile_loss.metrics) if compile_loss is not None else []
    for metric in model.metrics:
        if not any(metric is k for k in known):
            raise CaptureError(
                f"model {model.name!r} has metric {metric.name!r} ({type(metric).__name__}) "
                "outside compile(metrics=...): a layer's or the model's own metric is updated "
                "where the distributed step cannot gather it (a tracker updated in "
                "compute_loss, keras-io's masked language model, is one). Pass it to "
                "compile(metrics=...) where it is a metric of y and y_pred, or update it in "
                "the model's own train_step (its trackers are gathered), or compile a "
                "loss and let Keras track it")
    for metric in compiled.metrics if compiled is not None else []:
        _check_not_a_summed_loss(metric, model.name)
        if not type(metric).__module__.startswith("keras.") and \
                not isinstance(metric, (keras.metrics.Mean, keras.metrics.Sum)):
            _check_additive(metric, model.name)


def _build_in_training_mode(model, x_spec, y_spec) -> None:
    """The compiled metrics and loss built on the model's training-mode output spec, as
    the first trace of Keras' train step builds them."""
    from keras.src import backend

    x = tf.nest.map_structure(symbolic, x_spec)
    y = tf.nest.map_structure(symbolic, y_spec)
    y_pred = backend.compute_output_spec(model, x, training=True)
    compiled, compile_loss = model._compile_metrics, model._compile_loss  # noqa: SLF001
    if compiled is not None and not compiled.built:
        backend.compute_output_spec(model.compute_metrics, x, y, y_pred, sample_weight=None)
    if compile_loss is not None and not compile_loss.built:
        backend.compute_output_spec(model._compute_loss, x, y, y_pred,  # noqa: SLF001
                                    sample_weight=None, training=False)


def _check_not_a_summed_loss(metric, model_name: str) -> None:
    """A loss reduced by a sum passed as a metric (`compile(metrics=[keras.losses.X(
    reduction="sum")])`): Keras averages each batch's sum over batches, a replica's
    sum is its part's: refused."""
    loss = getattr(metric, "_fn", None)   # a MeanMetricWrapper's function
    if getattr(loss, "reduction", None) == "sum":
        raise CaptureError(
            f"metric {metric.name!r} of model {model_name!r} is a loss with "
            "reduction='sum': Keras averages each batch's sum over the batches, and each "
            "replica would report the sum of its own part of the batch. Use the loss with "
            "the default reduction (or its keras.metrics counterpart) as the metric")


def _check_additive(metric, model_name: str) -> None:
    """Refuses a metric whose state on two batches is not the sum of its state on each.

    Checked on random values of the metric's own shapes (as built by compile).
    """
    variables = metric.variables
    if any(np.any(np.asarray(v.numpy()) != 0) for v in variables):
        metric.reset_state()
    rng = np.random.default_rng(0)
    zeros = [tf.zeros(v.shape, v.dtype) for v in variables]

    def contribution(y_true, y_pred):
        return [np.asarray(t) for t in metric.stateless_update_state(zeros, y_true, y_pred)]

    try:
        y_pred = rng.uniform(0.05, 0.95, size=(8, 4)).astype("float32")
        y_true = rng.integers(0, 2, size=(8, 4)).astype("float32")
        both = contribution(y_true, y_pred)
        halves = [contribution(y_true[:4], y_pred[:4]), contribution(y_true[4:], y_pred[4:])]
    except Exception as e:
        raise CaptureError(
            f"cannot check that metric {metric.name!r} ({type(metric).__name__}) of model "
            f"{model_name!r} sums over batches ({type(e).__name__}: {e}); the distributed run "
            "sums each batch's metric state over replicas and steps") from e
    for a, b, whole in zip(*halves, both):
        if not np.allclose(a + b, whole, rtol=1e-5, atol=1e-6):
            raise CaptureError(
                f"metric {metric.name!r} ({type(metric).__name__}) of model {model_name!r} "
                "keeps state that is not a sum over examples; the distributed run sums each "
                "batch's metric state over replicas and steps, which would report another "
                "value. Use a metric whose state is sums and counts (e.g. a "
                "keras.metrics.Mean subclass)")


def metric_contributions(model, metric_variables, inputs, targets, predictions,
                          sample_weight, loss, loss_weights=None) -> list:
    """Each metric variable's contribution of the batch: the metrics updated from zero.

    What Keras' train step updates (the loss tracker, the per-output loss
    trackers of `compile(loss=...)`, the compiled metrics), in a stateless
    scope where every metric variable starts at zero. The per-output trackers
    read `loss_weights` (the compiled loss's, `keras_loss.sum_scaled_weights`;
    default `sample_weight`), as the loss does.
    """
    loss_weights = sample_weight if loss_weights is None else loss_weights
    import keras

    zeros = [tf.zeros(v.shape, v.dtype) for v in metric_variables]
    with keras.StatelessScope(state_mapping=list(zip(metric_variables, zeros))) as scope:
        compile_loss = model._compile_loss  # noqa: SLF001
        if compile_loss is not None and compile_loss.metrics:
            # Its per-output trackers.
            compile_loss(targets, predictions, loss_weights_structure(model, loss_weights))
        if model._loss_tracker is not None:  # noqa: SLF001
            model._loss_tracker.update_state(  # noqa: SLF001
                loss, sample_weight=tf.shape(tf.nest.flatten(inputs)[0])[0])
        model.compute_metrics(inputs, targets, predictions, sample_weight=sample_weight)
    values = {}
    for v, zero in zip(metric_variables, zeros):
        value = scope.get_current_value(v)
        values[id(v)] = zero if value is None else value
    trackers = list(compile_loss.metrics) if compile_loss is not None else []
    compiled = model._compile_metrics  # noqa: SLF001
    trackers += [metric for metric in (compiled.metrics if compiled is not None else [])
                 if counts_batches(metric, values)]
    count_batches_once(trackers, values)
    return [tf.identity(values[id(v)]) for v in metric_variables]


def counts_batches(metric, values: dict) -> bool:
    """Whether a compiled metric's count grows by the same for any batch: a mean of one
    value per batch (a `keras.losses.Loss` instance as a metric), not per example."""
    count = getattr(metric, "count", None)
    if count is None or getattr(metric, "total", None) is None or id(count) not in values:
        return False
    seen, pending = set(), [values[id(count)].op]
    while pending:
        op = pending.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.type == "Placeholder":
            return False   # it reads the batch
        pending.extend(t.op for t in op.inputs)
        pending.extend(op.control_inputs)
    return True


def count_batches_once(trackers, values: dict) -> None:
    """Keras' per-output loss trackers (`<output>_loss`) count each batch once: their
    weight is the batch dimension's static size, unknown in `fit`'s traced step (a
    batch's loss is not weighted by its examples, unlike the `loss` tracker's); so
    does a loss instance passed as a metric (one value per batch). A
    replica's or virtual node's update of them counts its part of the global batch
    (`BATCH_PART_INPUT`) with the loss of its part, so the parts add up to one batch
    with the batch's loss."""
    part = None
    for tracker in trackers:
        total, count = getattr(tracker, "total", None), getattr(tracker, "count", None)
        if total is None or count is None or id(total) not in values:
            continue
        if part is None:
            part = tf.compat.v1.placeholder_with_default(1.0, [], name=BATCH_PART_INPUT)
        counted = values[id(count)]
        values[id(total)] = tf.math.divide_no_nan(
            values[id(total)], tf.cast(counted, total.dtype)) * tf.cast(part, total.dtype)
        values[id(count)] = tf.cast(part, count.dtype)


def keras_metric_variables(model) -> list:
    """The variables of `model.metrics` (loss tracker, compiled metrics, ...), in the order
    of a capture's `metric_states`."""
    seen, out = set(), []
    for metric in model.metrics:
        for v in metric.variables:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out
