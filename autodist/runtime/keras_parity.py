"""What of a model would not train as single-device Keras does: said before launch.

A distributed run computes Keras' step on the global batch. Where a feature
cannot be made equal on a given strategy, `check` warns (the difference is
inherent and documented) or refuses (it would train something else), naming
the layer or feature and the alternative, before any process starts.
"""
from __future__ import annotations

import collections
import re
import warnings
from typing import Any

import numpy as np

from autodist.ir.errors import AutodistError
from autodist.ir.graph_item import GraphItem
from autodist.ir.strategy import Strategy


class ParityWarning(UserWarning):
    """A run will differ from single-device Keras in a way that is inherent to it."""


def check(model: Any, graph_item: GraphItem, strategy: Strategy) -> None:
    """Warns or raises, before launch, for what would not train as Keras does.

    Raises:
        AutodistError: a feature the run would silently train differently.
    """
    _input_names(graph_item)
    _random_ops(graph_item, strategy)
    _batch_norms(model, graph_item, strategy)
    _loss_masks(graph_item, strategy)
    _added_losses(graph_item, strategy)
    _coupled_examples(model, graph_item, strategy)
    _repeated_lookups(graph_item, strategy)
    _loss_scaling(graph_item, strategy)


def warn_of_ordered_inputs(x: Any, what: str) -> None:
    """Keras 3 (3.15) flattens an `OrderedDict` of inputs in its own order, a model built
    on a dict of inputs its inputs by sorted name, and feeds them by position: where the
    orders differ (`make_csv_dataset`'s columns in file order), its fit feeds one
    column to another input. The run feeds by name: said, not copied."""
    if not isinstance(x, collections.OrderedDict) or list(x) == sorted(x):
        return
    warnings.warn(
        f"{what} is an OrderedDict (keys in the order {list(x)[:8]}, e.g. from "
        "tf.data.experimental.make_csv_dataset): for a model built on a dict of inputs, "
        "Keras 3's fit feeds its values by position in that order to the inputs sorted by "
        f"name ({sorted(x)[:8]}), i.e. some columns to other inputs. autodist feeds each "
        "input the column of its name, so its numbers differ from Keras fit's here (or Keras "
        "fails where a column of another dtype reaches an input, e.g. 'Cast int32 to "
        "string is not supported'). "
        "Pass a plain dict (for a dataset: dataset.map(lambda x, y: (dict(x), y))) to "
        "have Keras feed by name too", ParityWarning, stacklevel=4)


def _repeated_lookups(graph_item: GraphItem, strategy: Strategy) -> None:
    """A table read at fixed indices that repeat, under an optimizer that squares each
    lookup of the batch's gradient (`ir.capture.fixed_lookups`): the replicas' parts
    cannot give those squares. Refused where the batch is split."""
    if strategy.num_virtual_nodes <= 1:
        return
    tables = sorted(v.name for v in graph_item.variables if v.gradient.repeated_lookups)
    if tables:
        raise AutodistError(
            f"variable(s) {tables} of {graph_item.name!r} are read at indices that do not "
            "depend on the batch, some row more than once (e.g. a relative position bias "
            "table gathered through a fixed index), and the optimizer "
            f"({graph_item.optimizer.class_name}) squares the gradient: Keras squares each "
            "lookup's gradient over the whole batch before adding the repeats, which "
            f"{strategy.num_virtual_nodes} replicas or virtual nodes, each holding a part "
            "of every lookup, cannot reproduce (the run would train other numbers). SGD "
            "(with or without momentum, without clipnorm) trains it as Keras; or train "
            "this model with Keras' fit on one device")


def _input_names(graph_item: GraphItem) -> None:
    """A model input named as fit's targets or sample weights ("y", "sample_weight")
    cannot be told apart from them by the run: refused."""
    roles: dict[str, set[str]] = {}
    for info in graph_item.inputs:
        roles.setdefault(info.name, set()).add(info.role)
    shared = sorted(name for name, kinds in roles.items() if len(kinds) > 1)
    if shared:
        raise AutodistError(
            f"the model's input(s) {shared} have the name(s) of fit's "
            f"{' and '.join(sorted(set().union(*(roles[n] for n in shared)) - {'x'}))} "
            f"in the capture of {graph_item.name!r}, which the run cannot tell apart. "
            "Rename the input (keras.Input(name=...), or the key of the model's input "
            "dict), e.g. to 'example_weight'")


def _batch_norms(model: Any, graph_item: GraphItem, strategy: Strategy) -> None:
    """Batch statistics: the global batch's where every replica runs one virtual node,
    else each virtual node's own (said here), or refused where asked for but impossible."""
    from autodist.kernels import batch_norm

    layers = _keras_batch_norm_layers(model, graph_item)
    found = graph_item.batch_norms
    if len(strategy.virtual_node_devices) <= 1 or not (layers or found):
        return
    unsynced = sorted(f"{bn.layer} ({bn.reason})" for bn in found if not bn.syncable)
    if unsynced or len(layers) > len(found):
        names = unsynced or sorted(layer.name for layer in layers)
        warnings.warn(
            f"batch normalization layer(s) {names} compute their statistics in a way "
            "the runtime cannot sum over replicas (masked moments, synchronized=True, or not "
            "tf.nn.moments): each replica normalizes with its own part of the batch, so the "
            "run differs from Keras fit. Use keras.layers.BatchNormalization without a mask",
            ParityWarning, stacklevel=3)
    if not batch_norm.syncable(graph_item):
        return
    one_each = strategy.num_virtual_nodes == len(strategy.replicas)
    if strategy.batch_norm == "sync" and not one_each:
        raise AutodistError(
            f"the strategy asks for batch statistics summed over replicas "
            f"(with_batch_norm('sync')), but its {strategy.num_virtual_nodes} virtual nodes run "
            f"on {len(strategy.replicas)} replicas, one after another where a replica has "
            "several: they cannot share statistics within a step. Use one virtual node per "
            "replica, or with_batch_norm('ghost') (each virtual node its own statistics)")
    if strategy.batch_norm == "auto" and strategy.global_batch_size is not None:
        named = sorted(bn.layer for bn in batch_norm.syncable(graph_item))
        shown = f"{named[:6]}" + (f" and {len(named) - 6} more" if len(named) > 6 else "")
        warnings.warn(
            f"batch normalization (layers {shown}): with the strategy's "
            f"{strategy.num_virtual_nodes} virtual nodes each normalizes with its own part "
            "of the batch ("
            f"{_part_sizes(strategy.global_batch_size, strategy.num_virtual_nodes)} of "
            f"{strategy.global_batch_size} examples; 'ghost "
            "batch normalization', the same on any hardware for this global batch and number "
            "of virtual nodes) where Keras uses the whole batch's statistics; the moving "
            "statistics are virtual node 0's. strategy.with_batch_norm('ghost') says this is "
            "intended (no warning); a strategy without virtual nodes, or "
            "with_batch_norm('sync') with one virtual node per replica, gives Keras' numbers",
            ParityWarning, stacklevel=3)


def _part_sizes(global_batch: int, parts: int) -> str:
    """The examples of each of `parts` virtual nodes of a global batch, as text: "4",
    or "4 or 5" where they differ."""
    small, large = global_batch // parts, -(-global_batch // parts)
    return str(small) if small == large else f"{small} or {large}"


def _loss_masks(graph_item: GraphItem, strategy: Strategy) -> None:
    """A loss dividing by a sum over the batch (a masked loss's count of unmasked
    values, a `mean_with_sample_weight` loss's sum of sample weights): summed over
    replicas where each runs one virtual node, else each virtual node's own."""
    from autodist.kernels import global_batch

    if strategy.num_virtual_nodes <= 1 or global_batch.sums_batch_quantities(strategy):
        return
    masked = sorted({m.loss for m in graph_item.loss_masks})
    # The train step's losses (the per-output trackers' copies aside).
    weighted = sorted({r.loss for r in graph_item.loss_reductions
                       if r.reduction == "mean_with_sample_weight" and
                       r.loss.startswith("compile_loss/")})
    for losses, what, own in (
            (masked, "of an output carrying a Keras mask divide by the count of unmasked "
                     "values in the batch", "count"),
            (weighted, "divide by the batch's sum of sample weights "
                       "(reduction='mean_with_sample_weight')", "sum")):
        if not losses:
            continue
        warnings.warn(
            f"loss(es) {losses} {what}; with the strategy's {strategy.num_virtual_nodes} "
            f"virtual nodes each divides by its own {own} (the same on any hardware), so "
            "the run differs from Keras fit when they differ. A strategy without "
            "virtual nodes, or with_batch_norm('sync') with one virtual node per replica, "
            "gives Keras' numbers", ParityWarning, stacklevel=3)


def _added_losses(graph_item: GraphItem, strategy: Strategy) -> None:
    """Loss terms added by layers: a mean or a sum over examples is reproduced; another
    function of the batch cannot be (refused, as a coupled compiled loss is; the terms
    are classified with each batch normalization normalizing each example on its own,
    so its batch statistics do not couple them; a warning where the terms could not be
    evaluated)."""
    if strategy.num_virtual_nodes <= 1:
        return
    layers = {kind: sorted({t.layer for t in graph_item.added_losses if t.kind == kind})
              for kind in ("other", "unknown")}
    fix = ("A mean over examples (keras.ops.mean) or a sum (keras.ops.sum) of per-example "
           "values trains as Keras does")
    if layers["other"]:
        raise AutodistError(
            f"layer(s) {layers['other']} add a loss term (add_loss) that is neither a mean "
            "nor a sum over the batch's examples (seen on random examples: a batch's term "
            "is not that of its two halves), e.g. a load-balancing loss over the batch's "
            f"routing: each of the {strategy.num_virtual_nodes} replicas or virtual nodes "
            "would compute it on its own part of the batch, and train something else than "
            f"Keras fit. {fix}, or train this model with Keras' fit on one device")
    unsure = layers["unknown"]
    if unsure:
        warnings.warn(
            f"layer(s) {unsure} add a loss term (add_loss) that may be neither a mean nor a "
            "sum over the batch's examples (the step failed on random examples, normal "
            "values and ids 1 and 2, so it could not be told): each of the "
            f"{strategy.num_virtual_nodes} replicas or virtual nodes computes it on its "
            "own part of the batch, and the run takes it for a mean over examples (each "
            "part's term weighted by its share of the batch): where it is a sum (add_loss "
            "of per-example values, as a CTC endpoint layer), the run's term and its "
            f"gradients are 1/{strategy.num_virtual_nodes} of Keras'. {fix}; a model the "
            "step runs on with random inputs is classified exactly",
            ParityWarning, stacklevel=3)


def _coupled_examples(model: Any, graph_item: GraphItem, strategy: Strategy) -> None:
    """A compiled loss comparing the batch's examples with each other (a contrastive
    loss over every pair of the batch), or a layer mixing them (a router with a
    capacity per batch), would be computed by each replica or virtual node on its own
    part: refused, as it would train something else."""
    from autodist.runtime.coupled_examples import coupled_losses, coupled_outputs, coupling_layer

    if strategy.num_virtual_nodes <= 1:
        return
    parts = f"each of the strategy's {strategy.num_virtual_nodes} replicas or virtual " \
        "nodes would compute it on its own part of the batch only, and train something " \
        "else than Keras fit"
    coupled = coupled_losses(model, graph_item)
    if coupled:
        raise AutodistError(
            f"compiled loss(es) {coupled} of {graph_item.name!r} are neither a mean nor a "
            "sum of per-example values (seen on random values: the loss of a batch is not "
            "that of its two halves), e.g. a contrastive loss comparing every pair of "
            f"examples in the batch, or one dividing by the batch's count of non-padding "
            f"tokens: {parts}. For a loss over the non-padding tokens use "
            "SparseCategoricalCrossentropy(ignore_class=<padding id>), or "
            "reduction='mean_with_sample_weight' with the padding's sample weights 0 (both "
            "train as Keras); write a pairwise loss over pairs that each example holds (as "
            "a siamese model's two inputs); or train this model with Keras' fit on one "
            "device")
    if coupled_outputs(model):
        layer = coupling_layer(model)
        raise AutodistError(
            f"the outputs of {graph_item.name!r} for an example depend on the other "
            "examples of its batch"
            + (f", first after layer {layer!r}" if layer else "") +
            " (seen in inference mode on random inputs: half a "
            "batch gives other outputs alone than within the batch), e.g. a mixture of "
            "experts whose capacity is counted over the batch, or a custom layer reducing "
            f"over the batch axis: {parts}. Train this model with Keras' fit on one "
            "device, or make each example's output its own (a capacity per example)")


def _loss_scaling(graph_item: GraphItem, strategy: Strategy) -> None:
    """Under dynamic loss scaling, the replicas' and virtual nodes' float16 sums of their
    own examples round differently from Keras' one sum over the batch (float16: about
    1e-3 relative), and one part's sum can overflow where the whole batch's does not."""
    if not graph_item.optimizer.HasField("loss_scale") or strategy.num_virtual_nodes <= 1:
        return
    warnings.warn(
        "the optimizer scales the loss dynamically (a LossScaleOptimizer, as the "
        "'mixed_float16' policy makes) and skips a step whose float16 gradients overflow; "
        f"each of the strategy's {strategy.num_virtual_nodes} replicas or virtual nodes "
        "sums the gradients of its own part of the batch in float16, which rounds "
        "differently from Keras' one sum over the whole batch (about 1e-3 relative). The "
        "step is skipped where the whole batch's float16 sum overflows, as in Keras, and "
        "also where one part's sum alone overflows (rare: Keras' sum would then hold "
        "values that cancel). The 'mixed_bfloat16' policy (no loss scaling) or float32 "
        "avoids the difference",
        ParityWarning, stacklevel=3)


def _keras_batch_norm_layers(model: Any, graph_item: GraphItem) -> list:
    """The model's BatchNormalization layers that use batch statistics in the step:
    trainable, and in training mode (the step updates their moving mean; a layer a
    custom call runs in inference mode normalizes with its moving statistics, as
    Keras' does)."""
    try:
        import keras

        flatten = getattr(model, "_flatten_layers", None)
        layers = list(flatten(include_self=False)) if flatten else list(model.layers)
    except Exception:  # noqa: BLE001  # not a Keras model
        return []
    updated = {s.name for s in graph_item.state_variables if s.update_ops}
    return [layer for layer in layers
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
            and getattr(getattr(layer, "moving_mean", None), "path", None) in updated]


def _random_ops(graph_item: GraphItem, strategy: Strategy) -> None:
    if strategy.num_virtual_nodes <= 1:
        return   # one device draws as Keras does
    unmatched = [op for op in graph_item.random_ops if not op.reproducible]
    if not unmatched:
        return
    layers = sorted({op.layer for op in unmatched})
    reasons = sorted({op.reason for op in unmatched})
    warnings.warn(
        f"layer(s) {layers} draw random numbers that a run on {strategy.num_virtual_nodes} "
        f"replicas or virtual nodes cannot draw as one device does ({'; '.join(reasons)}): "
        "their draws, and so the trained weights, will differ from Keras fit. Keras' own "
        "random layers (Dropout, GaussianNoise, the augmentation layers) are drawn exactly "
        "where their shapes follow from the inputs' shapes (give an input of unknown length "
        "a fixed one, keras.Input((T, ...)), where it is not found); use keras.random "
        "functions with a keras.random.SeedGenerator in custom layers",
        ParityWarning, stacklevel=3)


def check_batch_parts(graph_item: GraphItem, strategy: Strategy, global_batch: int) -> None:
    """A step whose shapes hold with the global batch but not with a replica's or virtual
    node's part of it fixes a shape to the batch size (keras-io's Switch Transformer
    reshapes its tokens to `[batch_size * tokens, d]`): every replica would fail at its
    first step. Refused before launch, naming the op (seen by TensorFlow's shape
    inference on the step, nothing run).

    Args:
        graph_item: The captured step.
        strategy: The strategy the fit starts with (its virtual nodes' parts).
        global_batch: The fit's global batch size (0: unknown, nothing checked).

    Raises:
        AutodistError: naming the op, the batch and the part sizes.
    """
    from autodist.ir.batch_shapes import graphs_at_batches, import_at_batch
    from autodist.runtime.batching import virtual_node_rows

    if strategy.num_virtual_nodes <= 1 or not global_batch:
        return
    parts = virtual_node_rows(np.arange(global_batch), strategy.num_virtual_nodes)
    sizes = sorted({len(p) for p in parts if len(p)})
    graph_def = graph_item.graph_def()
    handles = {v.handle_node: (v.dtype, list(v.shape))
               for v in list(graph_item.variables) + list(graph_item.state_variables)
               if v.handle_node}
    inputs = graph_item.inputs
    imported = graphs_at_batches(graph_def, inputs, [global_batch], handles)
    if imported is None:
        return   # not even the whole batch imports: nothing can be told
    length = imported[0]
    for size in sizes:
        graph, error = import_at_batch(graph_def, inputs, size, handles, length)
        if graph is None:
            node = re.search(r"node ([^\s}]+)", error)
            raise AutodistError(
                f"the step of {graph_item.name!r} fixes a shape to the batch size: it holds "
                f"for the global batch of {global_batch} examples but not for the parts of "
                f"{sizes} examples that the strategy's {strategy.num_virtual_nodes} replicas "
                "or virtual nodes run"
                + (f" (at {node.group(1)!r})" if node else "")
                + f": {error.strip().splitlines()[0][:300]}. Keras' fit runs it on whole "
                "batches only. Compute the shape from the input (keras.ops.shape(x)[0], or "
                "-1 in a reshape), or train this model with Keras' fit on one device")
