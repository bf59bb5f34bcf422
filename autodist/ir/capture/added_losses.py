"""Loss terms a Keras model's layers add (`add_loss`, activity regularizers):
each scaled by an input of the step, and classified by how it depends on the batch."""
from __future__ import annotations

import contextlib
import math

import numpy as np
import tensorflow as tf

from autodist.ir.capture.example_runs import (every_draw, model_variable_handles,
                                              random_examples, run_terms,
                                              without_batch_statistics)
from autodist.ir.graph_item import GraphItem
from autodist.proto import graph_item_pb2


def added_loss_terms(model) -> list:
    """The terms the model's layers added to the loss in this call (`add_loss`, activity
    regularizers; weight regularizers, which do not depend on the batch, aside)."""
    flatten = getattr(model, "_flatten_layers", None)
    layers = list(flatten(include_self=True)) if flatten else [model]
    return [t for layer in layers for t in layer._get_own_losses()]  # noqa: SLF001


ADDED_LOSS_SCALE = "autodist_added_loss_scale"


@contextlib.contextmanager
def scaled_added_losses(model, terms: list):
    """Within: the model's losses are its added terms each times a scalar input of the
    step (`ADDED_LOSS_SCALE`_i, 1 unless fed), then its weight regularizers, as Keras
    lists them (`Layer.losses`). Keras' own override of the list
    (`_losses_override`, as its stateless trainers use) is restored after."""
    if not terms:
        yield
        return
    scaled = [t * tf.compat.v1.placeholder_with_default(
        tf.constant(1.0, t.dtype), [], name=f"{ADDED_LOSS_SCALE}_{i}")
        for i, t in enumerate(terms)]
    previous = model._losses_override  # noqa: SLF001
    model._losses_override = scaled + model._get_regularization_losses()  # noqa: SLF001
    try:
        yield
    finally:
        model._losses_override = previous  # noqa: SLF001


def classify_added_losses(item: GraphItem, model) -> None:
    """Finds how each added loss term depends on the batch, and drops the constant ones
    (`AddedLossInfo.kind`).

    The captured step runs on random examples (4, and each half; ids 1 and 2 for
    every number where normal values do not suit the model), its random draws
    fixed (uniform ones just under 1, normal ones 0: every row alike) and its
    batch normalizations normalizing each example on its own (batch mean 0,
    variance 1: through batch statistics every term would depend on the whole
    batch), so a term that is a sum over examples is the halves' sum and a mean
    their mean. The trainable weights are perturbed for the probe (where the step
    stays finite): at weights as initialized every example can give the same
    values (a zero kernel: keras-io's PointNet), and a term comparing the batch's
    examples then scales as a sum. A term with several values counts as their
    sum, as Keras adds it to the loss. The step's state updates (moving
    statistics, seed generators) and the perturbation are undone.
    """
    terms = list(item.proto.added_losses)
    if not terms:
        return
    trainable = [(v, np.array(v.numpy())) for v in model.trainable_variables]
    state = [(v, np.array(v.numpy())) for v in model.variables if not v.trainable]
    handles = model_variable_handles(item, model)
    graph_def = without_batch_statistics(item.graph_def(), item.batch_norms)
    draws = every_draw(graph_def, item.random_ops)   # RandomCrop's offsets too
    fetches = [t.tensor for t in terms]
    values = None
    try:
        for perturbed in (True, False):
            for variable, value in trainable:
                variable.assign(_perturbed(value) if perturbed else value)
            values = _term_values(item, graph_def, handles, draws, fetches)
            if values is not None and all(np.isfinite(v).all() for run in values
                                          for v in run):
                break
    finally:
        for variable, value in trainable + state:
            variable.assign(value)
    kept = []
    for i, term in enumerate(terms):
        kind = "unknown" if values is None else _kind(*(float(np.sum(v[i])) for v in values))
        if kind != "constant":
            kept.append(graph_item_pb2.AddedLossInfo(tensor=term.tensor, layer=term.layer,
                                                     kind=kind, scale=term.scale))
    del item.proto.added_losses[:]
    item.proto.added_losses.extend(kept)


def _term_values(item: GraphItem, graph_def, handles, draws, fetches) -> list | None:
    """The terms on 4 random examples and on each half (None where the step fails on
    normal values and on ids)."""
    for ids in (False, True):
        full = random_examples(item, 4, ids=ids)
        batches = [full, {k: v[:2] for k, v in full.items()},
                   {k: v[2:] for k, v in full.items()}]
        try:
            return [run_terms(graph_def, handles, batch, draws, fetches, item.tables)
                    for batch in batches]
        except Exception:  # noqa: BLE001  # examples that do not suit the model
            continue
    return None


def _perturbed(value: np.ndarray) -> np.ndarray:
    """A weight moved by noise a tenth of its spread (at least 0.01), seeded."""
    if not np.issubdtype(value.dtype, np.floating):
        return value
    rng = np.random.default_rng(value.size)
    scale = 0.1 * max(float(np.std(value)), 0.1)
    return (value + scale * rng.normal(size=value.shape)).astype(value.dtype)


def _kind(whole: float, a: float, b: float) -> str:
    """How a term of a batch relates to its two halves' terms."""
    close = lambda u, v: math.isclose(u, v, rel_tol=1e-4, abs_tol=1e-7)  # noqa: E731
    if close(whole, a) and close(a, b):
        return "constant"
    if close(whole, a + b):
        return "sum"
    if close(whole, (a + b) / 2):
        return "mean"
    return "other"


def layer_scope(node_name: str) -> str:
    """The layer scope of a node, e.g. "model/dense" of "model/dense/ActivityRegularizer/mul"."""
    parts = node_name.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else "/".join(parts[:-1]) or node_name
