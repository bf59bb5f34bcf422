"""The Keras optimizer's state (slots and update count) between a run and the model.

Keras keeps an optimizer's state in the model: a second `fit` goes on with
the momenta, Adam's moments and the update count the first one left (its
bias correction and learning-rate schedule continue). A run does the same:
it starts from the Keras optimizer's state when the optimizer is built, and
the trained state returns into it after the run, under the names a
checkpoint uses (`checkpoint.slot_key`, `checkpoint.ITERATIONS`). Under a
LossScaleOptimizer (the 'mixed_float16' policy) the state is its inner
optimizer's, plus the dynamic scale, its counter and the inner optimizer's
update count (`loss_scaling.NAMES`; steps it skipped are not updates).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from autodist.kernels import loss_scaling
from autodist.runtime import checkpoint

# The Keras optimizer attribute holding each slot (one variable per trainable
# variable, in the order the optimizer was built with).
_SLOT_ATTRIBUTES = {
    "sgd": {"momentum": "momentums"},
    "adam": {"momentum": "_momentums", "velocity": "_velocities",
             "velocity_hat": "_velocity_hats"},
    "adagrad": {"accumulator": "_accumulators"},
    "rmsprop": {"velocity": "_velocities", "momentum": "_momentums",
                "average_gradient": "_average_gradients"},
}
_SLOT_ATTRIBUTES["adamw"] = _SLOT_ATTRIBUTES["adam"]


def _slot_variables(model, graph_item) -> dict[str, Any] | None:
    """Checkpoint key -> the Keras optimizer's variable, or None when the optimizer is
    not a Keras one this maps (or is not built for the model's variables)."""
    optimizer = _inner(getattr(model, "optimizer", None))
    info = graph_item.optimizer
    attributes = _SLOT_ATTRIBUTES.get(info.algorithm)
    if optimizer is None or info.family != "keras" or attributes is None or \
            not getattr(optimizer, "built", False):
        return None
    trainable = list(model.trainable_variables)
    if len(trainable) != len(graph_item.variables):
        return None
    out = {}
    for var, info_var in zip(trainable, graph_item.variables):
        try:
            index = optimizer._get_variable_index(var)  # noqa: SLF001
        except KeyError:
            return None
        for slot in info_var.slots:
            slots = getattr(optimizer, attributes.get(slot, ""), None)
            if not slots or index >= len(slots):
                return None
            out[checkpoint.slot_key(info_var.name, slot)] = slots[index]
    return out


def _inner(optimizer):
    """The optimizer that updates the variables (a LossScaleOptimizer's inner one)."""
    return getattr(optimizer, "inner_optimizer", optimizer)


def _loss_scale_variables(model, graph_item) -> dict[str, Any]:
    """`loss_scaling.NAMES` -> the LossScaleOptimizer's variables (empty without)."""
    optimizer = getattr(model, "optimizer", None)
    if not loss_scaling.enabled(graph_item.optimizer) or \
            getattr(optimizer, "inner_optimizer", None) is None:
        return {}
    return {loss_scaling.SCALE: optimizer.dynamic_scale,
            loss_scaling.COUNTER: optimizer.step_counter,
            loss_scaling.UPDATES: optimizer.inner_optimizer.iterations}


def read(model, graph_item) -> dict[str, np.ndarray]:
    """The Keras optimizer's slots and update count, by checkpoint key (empty while the
    optimizer is not built: a run then starts with fresh slots, as Keras' first fit)."""
    slots = _slot_variables(model, graph_item)
    if slots is None:
        return {}
    values = {key: np.asarray(var.numpy()) for key, var in slots.items()}
    values[checkpoint.ITERATIONS] = np.asarray(model.optimizer.iterations.numpy(), np.int64)
    for key, var in _loss_scale_variables(model, graph_item).items():
        values[key] = np.asarray(var.numpy(), np.float32 if key == loss_scaling.SCALE
                                 else np.int64)
    return values


def write(model, graph_item, values: Mapping[str, Any]) -> bool:
    """Puts a run's trained slots and update count into the Keras optimizer, building
    it for the model's variables first as Keras' `fit` does.

    Returns:
        Whether the state was written (False: not a Keras optimizer this maps,
        or the values hold no optimizer state).
    """
    names = set(values.files if hasattr(values, "files") else values)
    if checkpoint.ITERATIONS not in names:
        return False
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or graph_item.optimizer.family != "keras":
        return False
    if not getattr(optimizer, "built", False):
        optimizer.build(model.trainable_variables)
    slots = _slot_variables(model, graph_item)
    if slots is None:
        return False
    for key, var in slots.items():
        if key in names:
            var.assign(np.asarray(values[key]).astype(var.dtype))
    loss_scale = _loss_scale_variables(model, graph_item)
    if loss_scale and loss_scaling.UPDATES in names:
        for key, var in loss_scale.items():
            var.assign(np.asarray(values[key]).astype(var.dtype))
    else:
        _inner(optimizer).iterations.assign(checkpoint.keras_iterations(values))
    return True
