"""`fit` on a `tf.data.Dataset`: the workers read it themselves, as Keras would.

As in Keras, each element of the dataset is one global batch `(x, y)` or
`(x, y, sample_weight)`. The driver does not read the data: it flattens
the elements (a `map` that orders the model's inputs and targets and casts
them), serializes the dataset's graph into the job (`dataset_graph`), and
every worker rebuilds it and reads every element, in the order Keras'
`fit(dataset)` reads them (`batching.dataset_epochs`: new passes, and the
shuffle seeds they draw, where Keras starts them), keeping the rows of its
virtual nodes. So every worker agrees on each global batch, at the cost of
each worker reading (and preprocessing) the whole dataset.

The driver reads the data only to count the batches of a dataset whose
cardinality is unknown (a `filter`, or TFRecord files): one pass through
the input pipeline, holding nothing (give the length with
`dataset.apply(tf.data.experimental.assert_cardinality(n))` to skip it);
and, for a dataset that reshuffles each pass, the first batch of a new pass,
to find how many passes were started on it before the fit (`adapt` of a
preprocessing layer reads it once per feature), which Keras' fit goes on from.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Sequence

from autodist.ir.errors import AutodistError
from autodist.ir.graph_item import GraphItem
from autodist.runtime import batching, dataset_graph
from autodist.runtime.keras_parity import warn_of_ordered_inputs
from autodist.runtime.records import DatasetDescription
from autodist.runtime.targets import class_weight_table

logger = logging.getLogger(__name__)

_INT64_MAX = 2 ** 63 - 1


class DatasetError(AutodistError, ValueError):
    """A dataset `fit` cannot read as Keras would, or a batch it cannot train on."""


def is_dataset(x: Any) -> bool:
    """Whether `x` is a tf.data.Dataset (without importing TensorFlow for arrays)."""
    return type(x).__module__.startswith("tensorflow") and hasattr(x, "element_spec")


@dataclasses.dataclass(frozen=True)
class StreamedDataset:
    """A dataset made ready for the workers to read.

    Attributes:
        graph: Its graph, elements flattened (see `DatasetDescription`).
        description: How the workers read it.
        epochs: What each epoch of the job reads.
        batch_size: Examples in every batch, when the element's shape says
            so (`batch(n, drop_remainder=True)`), else None.
        seed_generators: The names of the dataset's seed generators (a
            reshuffling `shuffle`), which each pass advances.
        probed: A pass was started on the user's dataset to find where its
            seed generators stand (the fit's first pass).
    """

    graph: bytes
    description: DatasetDescription
    epochs: list[batching.DatasetEpoch]
    batch_size: int | None
    seed_generators: tuple[str, ...] = ()
    probed: bool = False

    @property
    def epoch_steps(self) -> list[int]:
        return [e.steps for e in self.epochs]


def prepare(dataset, graph_item: GraphItem, *, steps_per_epoch: int | None, epochs: int,
            smallest_batch: tuple[int, str], fixed_batch: int | None,
            class_weight: Any = None,
            earlier_passes: Mapping[tuple[str, ...], int] | None = None,
            epoch_lengths: Sequence[int] | None = None,
            runs_out: bool = False, end_step: bool = True) -> StreamedDataset:
    """Checks `dataset` against the model and Keras' reading of it; serializes it.

    Args:
        dataset: Yields `(x, y)` or `(x, y, sample_weight)` batches: x a
            tensor, a tuple/list of tensors (one per model input) or a dict
            keyed by the model's input names; y a tensor, or a tuple/list
            (in output order) / dict (by output name) for several outputs;
            sample_weight one weight per example.
        graph_item: The model's capture.
        steps_per_epoch: fit's steps_per_epoch (None: every batch).
        epochs: Epochs the job runs.
        smallest_batch: The fewest examples a batch may have, and why
            (`global_batch.smallest_batch`).
        fixed_batch: The strategy's fixed global batch, or None.
        class_weight: fit's class_weight (weights made from y, as Keras).
        earlier_passes: Passes earlier fits started on each dataset, by its
            seed generators' names (`StreamedDataset.seed_generators`): the
            workers start this dataset's unread first, drawing their seeds.
        epoch_lengths: The steps of each epoch, when the dataset's elements
            are already the run's batches in order (read in the driver,
            `python_data`): one pass read across the epochs in turn, instead
            of Keras' reading of a dataset (`steps_per_epoch` is then unused).
        runs_out: With `epoch_lengths`, Keras' step after the last epoch finds
            the input's end (a generator read to its end).
        end_step: Whether Keras runs a step that finds the data's end (with
            `compile(steps_per_execution=k)`, k > 1, it does not: no run-outs).

    Raises:
        DatasetError: elements that do not match the model; a dataset that
            cannot be serialized or would differ between workers; an
            infinite dataset without steps_per_epoch; an epoch Keras would
            run empty; batches too small for the virtual nodes or not the
            strategy's global batch.
    """
    import tensorflow as tf

    flat, description = _flattened(dataset, graph_item, class_weight)
    graph = dataset_graph.serialize(flat)
    dataset_graph.check_reproducible(graph)
    if any(s.shape.rank is None for s in flat.element_spec):
        raise DatasetError("the dataset's batches must have a known rank; received element "
                           f"spec {str(flat.element_spec)[:300]}")
    cardinality = int(flat.cardinality())
    known = cardinality >= 0
    if cardinality == tf.data.INFINITE_CARDINALITY:
        batches, smallest, largest = None, None, None
        if steps_per_epoch is None:
            raise DatasetError("the dataset is infinite (it repeats): give steps_per_epoch, "
                               "as Keras needs")
    elif known:
        batches, smallest, largest = cardinality, None, None
    else:
        batches, smallest, largest = _count(graph, flat.element_spec)
    if batches == 0:
        raise DatasetError("the dataset is empty")
    generators = dataset_graph.seed_generators(graph)
    passes_before = _passes_started_before(flat, graph, (earlier_passes or {}).get(
        generators, 0)) if generators else 0
    if epoch_lengths is not None and (not known or sum(epoch_lengths) != batches):
        raise DatasetError(f"epochs of {list(epoch_lengths)[:8]} steps need a dataset of "
                           f"{sum(epoch_lengths)} batches; this one has {cardinality}")
    plan = batching.one_pass_epochs(epoch_lengths, runs_out) if epoch_lengths is not None else \
        batching.dataset_epochs(batches, known, steps_per_epoch, epochs)
    empty = next((e for e, epoch in enumerate(plan) if epoch.steps == 0), None)
    if empty is not None:
        raise DatasetError(
            f"with steps_per_epoch={steps_per_epoch}, this dataset of unknown cardinality "
            f"({batches} batches, counted) runs out exactly at the end of epoch {empty - 1}, "
            f"and Keras finds that out in epoch {empty}, which then runs no step. Declare "
            f"its length (dataset.apply(tf.data.experimental.assert_cardinality({batches}))) "
            "or change steps_per_epoch")
    static = flat.element_spec[0].shape[0] if flat.element_spec[0].shape.rank else None
    _check_batch_sizes(static, smallest, largest, smallest_batch, fixed_batch)
    return StreamedDataset(graph, dataclasses.replace(description, batches=batches,
                                                      cardinality_known=known,
                                                      passes_before=passes_before,
                                                      epoch_lengths=None if epoch_lengths
                                                      is None else tuple(epoch_lengths),
                                                      runs_out=runs_out, end_step=end_step),
                           plan, static, generators, probed=bool(generators))


# How many passes over a dataset, at most, may have been started before a fit beyond
# those the run knows of (a preprocessing layer's `adapt` reads it once per feature:
# keras-io's FeatureSpace example adapts 6 features and a cross in 12).
MAX_UNKNOWN_PASSES = 64


def _passes_started_before(flat, graph: bytes, known: int) -> int:
    """The passes over `flat`'s reshuffling seed generators started before this fit.

    Each pass draws a new shuffle order from the generators, and Keras' fit goes on
    from where they stand: after the run's earlier fits (`known`), but also after
    anything that read the dataset outside them (`adapt` of a preprocessing layer on
    the training dataset, a loop over it). A new pass over `flat` is read up to its
    first batch and matched with the passes of the dataset rebuilt from `graph` (its
    own generators, from the start); that pass counts as the fit's first
    (`start_passes_like_keras` starts one fewer).

    Raises:
        DatasetError: no pass among the next `MAX_UNKNOWN_PASSES` matches.
    """
    import numpy as np
    import tensorflow as tf

    def first_batch(dataset) -> list:
        return [np.asarray(t) for t in tf.nest.flatten(next(iter(dataset)))]

    probe = first_batch(flat)
    rebuilt = dataset_graph.restore(graph, flat.element_spec)
    for _ in range(known):
        iter(rebuilt)   # a pass started without reading (as start_passes_like_keras)
    for k in range(known, known + MAX_UNKNOWN_PASSES):
        if all(np.array_equal(a, b) for a, b in zip(first_batch(rebuilt), probe)):
            return k
    raise DatasetError(
        f"the dataset's shuffle reshuffles each pass (reshuffle_each_iteration=True), and "
        f"its next pass is none of passes {known}..{known + MAX_UNKNOWN_PASSES - 1} of its "
        "seeds: it was read more often before this fit (or its shuffle's seed changed), "
        "so the workers cannot draw the orders Keras' fit would. Adapt preprocessing "
        "layers on the dataset before shuffle(), or rebuild the dataset before fit")


def start_passes_like_keras(dataset, streamed: StreamedDataset, steps_per_epoch: int | None,
                            epochs: int) -> int:
    """Starts on `dataset` (without reading it) the passes Keras' `fit` starts over
    `epochs` epochs, so that its seed generators stand where Keras' fit leaves them:
    Keras' next fit on it draws new shuffle orders, as after Keras' fit. (Creating an
    iterator may start a `prefetch`'s background reading; it is dropped at once.)

    Returns:
        The passes started (0 for a dataset without seed generators).
    """
    if not streamed.seed_generators or epochs < 1:
        return 0
    d = streamed.description
    passes = batching.dataset_passes(d.batches, d.cardinality_known, steps_per_epoch, epochs)
    for _ in range(passes - 1 if streamed.probed else passes):   # the probe started one
        iter(dataset)
    return passes


def _check_batch_sizes(static: int | None, smallest: int | None, largest: int | None,
                       needed: tuple[int, str], fixed_batch: int | None) -> None:
    """What can be known of the batches before the run (the workers check each one)."""
    smallest = static if static is not None else smallest
    largest = static if static is not None else largest
    if smallest is not None and smallest < needed[0]:
        raise DatasetError(
            f"the dataset has a batch of {smallest} examples, fewer than {needed[0]} "
            f"({needed[1]}): drop the short batch (batch(n, drop_remainder=True)) or batch "
            "more examples")
    if fixed_batch is not None and largest is not None and largest != fixed_batch:
        raise DatasetError(
            f"the strategy fixes the global batch at {fixed_batch} examples; the dataset's "
            f"batches have {largest}: batch the dataset by {fixed_batch}, or change the "
            "strategy's virtual nodes")


def _count(graph: bytes, element_spec) -> tuple[int, int, int]:
    """(batches, smallest, largest batch) of one pass, read in the driver without keeping
    anything (a copy of the dataset with its own seeds: the user's is not advanced)."""
    import tensorflow as tf

    logger.info("counting the dataset's batches (its cardinality is unknown): one pass")
    copy = dataset_graph.restore(graph, element_spec)

    def add(state, element):
        size = tf.shape(element[0], out_type=tf.int64)[0]
        return state[0] + 1, tf.minimum(state[1], size), tf.maximum(state[2], size)

    zero = tf.constant(0, tf.int64)
    count, smallest, largest = copy.reduce(
        (zero, tf.constant(_INT64_MAX, tf.int64), zero), add)
    return int(count), int(smallest), int(largest)


def _flattened(dataset, graph_item: GraphItem, class_weight: Any
               ) -> tuple[Any, DatasetDescription]:
    """The dataset with flat elements (model inputs, targets, weights), cast to the
    model's dtypes, and their description (before counting)."""
    import tensorflow as tf

    spec = dataset.element_spec
    if not isinstance(spec, tuple) or len(spec) not in (2, 3):
        raise DatasetError("each dataset element must be an (x, y) or (x, y, sample_weight) "
                           f"batch; received {_describe(spec)}")
    x_infos = list(graph_item.model_inputs)
    y_infos = list(graph_item.target_inputs)
    x_specs = _x_parts(spec[0], [i.name for i in x_infos])
    warn_of_ordered_inputs(spec[0], "the dataset's x")
    y_specs = _y_parts(spec[1], y_infos)
    for part, info in zip(x_specs, x_infos):
        _check_shape(part, info, squeezable=True)
    for part, info in zip(y_specs, y_infos):
        _check_shape(part, info, squeezable=True)
    weighted = len(spec) == 3 or class_weight is not None
    weight_rank = _weight_rank(graph_item, weighted)
    if len(spec) == 3:
        if class_weight is not None:
            raise DatasetError("give sample_weight or class_weight, not both (as Keras): the "
                               "dataset yields sample weights")
        _check_weight_shape(spec[2], weight_rank)
    table = class_weight_table(class_weight, len(y_infos)) \
        if class_weight is not None else None
    x_dtypes = [tf.as_dtype(i.dtype) for i in x_infos]
    y_dtypes = [tf.as_dtype(i.dtype) for i in y_infos]

    def flatten(*element):
        xs = [_conform_rank(tf.cast(t, d), len(info.shape))
              for t, d, info in zip(_x_parts(element[0], [i.name for i in x_infos]), x_dtypes,
                                    x_infos)]
        ys = [_conform_rank(tf.cast(t, d), len(info.shape))
              for t, d, info in zip(_y_parts(element[1], y_infos), y_dtypes, y_infos)]
        out = xs + ys
        if len(element) == 3:
            out.append(_conform_rank(tf.cast(element[2], tf.float32), weight_rank))
        elif table is not None:
            out.append(_class_weights(ys[0], table))
        return tuple(out)

    flat = dataset.map(flatten)
    description = DatasetDescription(
        dtypes=tuple(s.dtype.name for s in flat.element_spec),
        shapes=tuple(tuple(s.shape.as_list()) if s.shape.rank is not None else ()
                     for s in flat.element_spec),
        num_inputs=len(x_infos), num_targets=len(y_infos), weighted=weighted,
        batches=None, cardinality_known=False)
    return flat, description


def _class_weights(y, table: dict[int, float]):
    """Per-example weights of a batch's classes, as `targets.sample_weights` makes them."""
    import tensorflow as tf

    labels = y
    if labels.shape.rank > 1:
        labels = tf.argmax(labels, axis=-1) if labels.shape[-1] != 1 else labels[..., 0]
    labels = tf.cast(tf.round(tf.cast(labels, tf.float64)), tf.int64)
    labels = tf.reshape(labels, [tf.shape(labels)[0], -1])[:, 0]
    keys = tf.constant(list(table), tf.int64)
    values = tf.constant(list(table.values()), tf.float32)
    match = tf.equal(labels[:, None], keys[None, :])
    found = tf.reduce_sum(tf.where(match, values[None, :], 0.0), axis=1)
    return tf.where(tf.reduce_any(match, axis=1), found, 1.0)


def _x_parts(x, input_names: list[str]) -> list[Any]:
    """The model inputs of an element's x (specs or tensors), in the model's order."""
    if isinstance(x, dict):
        missing = [n for n in input_names if n not in x]
        if missing:
            raise DatasetError(f"dataset x is a dict without the model's inputs {missing}; "
                               f"its keys: {sorted(x)[:20]}")
        return [x[n] for n in input_names]
    parts = list(x) if isinstance(x, (tuple, list)) else [x]
    if len(parts) != len(input_names):
        raise DatasetError(f"the model takes {len(input_names)} inputs ({input_names[:20]}); "
                           f"the dataset's x has {len(parts)}")
    return parts


def _y_parts(y, infos: list[Any]) -> list[Any]:
    """The targets of an element's y, in the GraphItem's order (as `targets.pack`)."""
    names = [i.name[len("y/"):] if i.name.startswith("y/") else i.name for i in infos]
    if isinstance(y, dict):
        if len(infos) == 1 and len(y) == 1:
            return list(y.values())
        missing = [n for n in names if n not in y]
        if missing:
            raise DatasetError(f"dataset y is a dict without targets for outputs {missing}; "
                               f"its keys: {sorted(y)[:20]}")
        return [y[n] for n in names]
    if isinstance(y, (tuple, list)):
        if len(y) != len(infos):
            raise DatasetError(f"the model has {len(infos)} targets ({names[:20]}); the "
                               f"dataset's y has {len(y)}")
        return list(y)
    if len(infos) != 1:
        raise DatasetError(f"the model has {len(infos)} outputs ({names[:20]}): the dataset's "
                           "y must be a tuple (in output order) or a dict keyed by output name")
    return [y]


def _check_shape(spec, info, squeezable: bool = False) -> None:
    """An input's or target's examples must have the captured shape (known dimensions);
    a target may have a trailing dimension of 1 more or less (Keras' losses squeeze or
    expand it)."""
    import tensorflow as tf

    if not isinstance(spec, tf.TensorSpec):
        raise DatasetError(f"dataset component for {info.name!r} must be a dense tensor; "
                           f"received {str(spec)[:200]}")
    expected = list(info.shape)[1:]
    shape = spec.shape
    if shape.rank is None:
        return
    got = shape.as_list()[1:]
    if squeezable and len(got) == len(expected) + 1 and got[-1] in (1, None):
        got = got[:-1]
    elif squeezable and len(got) + 1 == len(expected) and expected[-1] == 1:
        got = got + [1]
    if len(got) != len(expected) or any(g is not None and e >= 0 and g != e
                                        for g, e in zip(got, expected)):
        raise DatasetError(f"input {info.name!r} needs examples of shape {expected}; the "
                           f"dataset's batches have shape {shape.as_list()}")


def _weight_rank(graph_item: GraphItem, weighted: bool) -> int:
    """The rank of the sample weights a dataset's batches give: that of every target's
    loss values (one weight per example: 1; per example and timestep: 2)."""
    ranks = {len(info.shape) or 1 for info in graph_item.sample_weight_inputs}
    if weighted and not ranks:
        raise DatasetError(f"the capture of {graph_item.name!r} takes no sample weights (a "
                           "function or v1 graph, or an old capture): capture the Keras "
                           "model again")
    if weighted and len(ranks) > 1:
        raise DatasetError("a dataset's sample weights apply to every output, and this "
                           "model's outputs weigh their losses' values in different shapes "
                           f"({sorted(ranks)} dimensions): train on arrays with one "
                           "sample_weight per output")
    return ranks.pop() if ranks else 1


def _check_weight_shape(spec, rank: int) -> None:
    shape = spec.shape
    if shape.rank is None:
        return
    dims = shape.as_list()
    fits = shape.rank == rank or shape.rank == rank + 1 and dims[-1] in (1, None) or \
        shape.rank + 1 == rank
    if not fits:
        what = "one weight per example" if rank == 1 else \
            "one weight per example and timestep, as the loss has"
        raise DatasetError(f"sample_weight must be {what} (applied to every output); the "
                           f"dataset's have shape {dims}")


def _conform_rank(tensor, rank: int):
    """A target with the captured rank: a trailing 1 removed or added (Keras' losses
    squeeze or expand it the same way)."""
    import tensorflow as tf

    if tensor.shape.rank == rank + 1:
        return tf.squeeze(tensor, -1)
    if tensor.shape.rank is not None and tensor.shape.rank + 1 == rank:
        return tensor[..., None]
    return tensor


def _describe(element: Any) -> str:
    if isinstance(element, tuple):
        return f"a tuple of {len(element)}"
    return type(element).__name__
