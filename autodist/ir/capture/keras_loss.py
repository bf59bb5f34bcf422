"""A Keras model's loss as its train step computes it, and the losses refused."""
from __future__ import annotations


from autodist.ir.capture.keras_specs import keras_output_names
from autodist.ir.errors import CaptureError


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
    """The loss as Keras' train step computes it (a `compute_loss` override included)."""
    sample_weight = loss_weights_structure(model, sample_weight)
    if hasattr(model, "_compute_loss"):  # handles overrides without a `training` argument
        return model._compute_loss(x=inputs, y=targets, y_pred=predictions,  # noqa: SLF001
                                   sample_weight=sample_weight, training=True)
    return model.compute_loss(x=inputs, y=targets, y_pred=predictions,
                              sample_weight=sample_weight, training=True)


def check_keras_losses(model) -> None:
    """Refuses losses summed over the batch: a data-parallel step needs batch means.

    Each replica's loss is weighted by its share of the global batch, which
    reproduces a mean over the batch exactly, not a sum.
    """
    losses = model.loss
    if isinstance(losses, dict):
        losses = list(losses.values())
    elif not isinstance(losses, (list, tuple)):
        losses = [losses]
    for loss in losses:
        reduction = getattr(loss, "reduction", None)
        if reduction == "sum":
            raise CaptureError(
                f"loss {getattr(loss, 'name', type(loss).__name__)!r} of model {model.name!r} "
                f"uses reduction={reduction!r}; distributed training weights each replica's "
                "loss by its share of the batch, which equals Keras only for a mean over the "
                "batch: use reduction='sum_over_batch_size' (the default)")
