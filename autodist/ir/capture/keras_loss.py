"""A Keras model's loss as its train step computes it, and the losses refused."""
from __future__ import annotations


import tensorflow as tf

from autodist.ir import loss_reductions
from autodist.ir.capture.keras_specs import keras_output_names, losses_by_target
from autodist.ir.device_names import op_name
from autodist.ir.errors import CaptureError
from autodist.ir.graph_item import GraphItem
from autodist.proto import graph_item_pb2


def loss_weights_structure(model, sample_weight):
    """Per-output sample weights in the structure Keras' compiled loss resolves its
    losses' paths in (`CompileLoss`: integer paths into a list of outputs, or output
    names; Keras converts the targets to it, not the sample weights)."""
    if not isinstance(sample_weight, (list, tuple, dict)):
        return sample_weight
    compile_loss = getattr(model, "_compile_loss", None)
    losses = getattr(compile_loss, "_flat_losses", None) or []
    paths = [loss.path[0] for loss in losses if loss.path]
    count = len(sample_weight)
    names = keras_output_names(model, count)
    if paths and all(isinstance(p, int) for p in paths) and isinstance(sample_weight, dict):
        return [sample_weight[n] for n in names]
    if paths and all(isinstance(p, str) for p in paths) and \
            isinstance(sample_weight, (list, tuple)):
        return dict(zip(names, sample_weight))
    if not paths and isinstance(sample_weight, (list, tuple)) and isinstance(model.loss, dict):
        return dict(zip(names, sample_weight))
    return sample_weight


def keras_compute_loss(model, inputs, targets, predictions, sample_weight=None):
    """The loss as Keras' train step computes it (a `compute_loss` override included).

    Raises:
        CaptureError: the loss fails on a batch of unknown size (`traced_step_error`).
    """
    sample_weight = loss_weights_structure(model, sample_weight)
    try:
        if hasattr(model, "_compute_loss"):  # handles overrides without a `training` argument
            return model._compute_loss(x=inputs, y=targets, y_pred=predictions,  # noqa: SLF001
                                       sample_weight=sample_weight, training=True)
        return model.compute_loss(x=inputs, y=targets, y_pred=predictions,
                                  sample_weight=sample_weight, training=True)
    except (ValueError, TypeError) as e:
        raise traced_step_error(model, e) from e


def traced_step_error(model, error: Exception) -> CaptureError:
    """The error for a train step (outputs and compiled loss) that fails when traced for
    batches of any size.

    Keras' fit traces its step with the first batch's static size, so a loss whose
    ops need it (keras-io's supervised contrastive loss squeezes its (N, 1) labels
    with `ops.squeeze(labels)`, of unknown rank when N is unknown) trains there while
    batches keep that size; the capture traces one step for every batch size.
    """
    text = str(error).strip().rstrip(".")
    return CaptureError(
        f"the train step of model {model.name!r} (its outputs and compiled loss) failed "
        "when traced for batches of any size (the capture's batch dimension is unknown; "
        f"Keras' fit traces with the first batch's size): {type(error).__name__}: {text}. "
        "A loss whose targets differ in shape from the model's output (class ids for "
        "probabilities, without example targets the capture takes the output's shape) "
        "needs example targets: optimize(model, spec, x=..., y=...) or capture(model, "
        "x=..., y=...), with a batch of arrays, TensorSpecs (None for a length that "
        "varies), or the dataset you fit on (x=dataset). Otherwise, where the error is "
        "about shapes, an op whose result depends on a static batch size, such as "
        "ops.squeeze without an axis (its rank is then unknown), fails so: give it the "
        "axis (ops.squeeze(labels, axis=-1))")


def check_keras_losses(model) -> None:
    """Refuses unreduced losses (`reduction=None` or "none").

    Keras' fit then differentiates the sum of the loss's values over the batch
    and reports their mean: a loss that is no scalar, which the captured step
    (a scalar loss weighted by each replica's share of the batch) has no form for.
    """
    for loss in _compiled_losses(model):
        reduction = getattr(loss, "reduction", "sum_over_batch_size")
        if reduction is None or reduction == "none":
            raise CaptureError(
                f"loss {_loss_name(loss)!r} of model {model.name!r} uses "
                f"reduction={reduction!r}: Keras' fit then trains on the sum of its "
                "unreduced values over the batch and reports their mean, which the "
                "distributed step does not reproduce. Use reduction='sum' (the same "
                "training; History reports the batch's sum) or the default "
                "'sum_over_batch_size'")


def sum_scaled_weights(model, y_spec, sample_weight):
    """The sample weights the compiled loss reads: those of a target whose loss reduces
    by a sum times a scalar input of the step (`loss_reductions.SUM_SCALE`_i, 1 unless
    fed; i the target's flat index), so the runtime can scale the sum and its gradient.
    """
    if sample_weight is None or y_spec is None:
        return sample_weight
    flat = tf.nest.flatten(sample_weight)
    for i, loss in enumerate(losses_by_target(model, y_spec)):
        if getattr(loss, "reduction", None) == "sum":
            flat[i] = flat[i] * tf.compat.v1.placeholder_with_default(
                tf.constant(1.0, flat[i].dtype), [], name=f"{loss_reductions.SUM_SCALE}_{i}")
    return tf.nest.pack_sequence_as(sample_weight, flat)


def record_loss_reductions(item: GraphItem, model, y_spec) -> None:
    """Lists the step's losses reduced by a sum or by a mean over the sample weights
    (`GraphItem.loss_reductions`), or refuses one whose reduction the step does not
    show (a loss class of its own that reduces otherwise)."""
    losses = losses_by_target(model, y_spec) if y_spec is not None else []
    reductions = [getattr(loss, "reduction", None) for loss in losses]
    if "sum" not in reductions and "mean_with_sample_weight" not in reductions:
        return
    graph_def = item.graph_def()
    names = {node.name for node in graph_def.node}
    found = []
    # The scale must reach the loss: a loss class ignoring its weights reduces otherwise.
    for i, (loss, reduction) in enumerate(zip(losses, reductions)):
        scale = f"{loss_reductions.SUM_SCALE}_{i}"
        if reduction == "sum" and scale in names and \
                op_name(item.loss_tensor) in loss_reductions.readers_of(graph_def, {scale}):
            found.append(graph_item_pb2.LossReductionInfo(loss=_loss_name(loss),
                                                          reduction="sum", node=scale))
        elif reduction == "sum":
            _refuse(model, loss, reduction, "does not weigh its values by the sample weights")
    weighted = [loss for loss, r in zip(losses, reductions) if r == "mean_with_sample_weight"]
    if weighted:
        sums = loss_reductions.weight_sums(
            graph_def, [op_name(info.tensor) for info in item.sample_weight_inputs])
        # One in the train step's compiled loss per such loss (and the per-output
        # trackers' own, outside it).
        if sum(s.loss.startswith("compile_loss/") for s in sums) != len(weighted):
            _refuse(model, weighted[0], "mean_with_sample_weight",
                    "the step shows no sum of the sample weights that it divides by")
        found += sums
    item.proto.loss_reductions.extend(found)


def _refuse(model, loss, reduction: str, why: str) -> None:
    raise CaptureError(
        f"loss {_loss_name(loss)!r} of model {model.name!r} uses reduction={reduction!r} "
        f"but {why} (Keras' Loss.__call__ does): the distributed step cannot reproduce "
        "it. Use reduction='sum_over_batch_size' (the default), or a keras.losses.Loss "
        "whose call returns the unreduced values")


def _compiled_losses(model) -> list:
    losses = model.loss
    if isinstance(losses, dict):
        return list(losses.values())
    return list(losses) if isinstance(losses, (list, tuple)) else [losses]


def _loss_name(loss) -> str:
    return getattr(loss, "name", None) or getattr(loss, "__name__", None) or \
        type(loss).__name__
