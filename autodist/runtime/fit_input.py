"""What `fit` trains on, behind one protocol: arrays, a streamed dataset or shards.

Keras' `fit` takes arrays (with targets, sample or class weights), a
`tf.data.Dataset` of batches, and autodist adds a `ShardedDataset` (each
worker task reads its own share of every global batch). Each kind is made
ready for the job here, checked against the strategy before anything starts,
and then looks the same to the run (`FitInput`): the global batch, the steps
of each epoch, and the files the workers read (`JobData`). Nothing outside
this module asks which kind it was given.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Protocol

import numpy as np

from autodist.ir.errors import AutodistError
from autodist.ir.graph_item import GraphItem
from autodist.ir.strategy import Strategy
from autodist.kernels import global_batch
from autodist.launch.job import DatasetFiles
from autodist.runtime import (batching, datasets, keras_data, python_data,
                              sharded_input, steps_per_execution, targets)
from autodist.runtime.options import FitOptions
from autodist.runtime.sharded_input import ShardedDataset


@dataclasses.dataclass(frozen=True)
class JobData:
    """The data a job's workers read: arrays (and Keras' order of them) or dataset files.

    Attributes:
        inputs: The input arrays (empty with a dataset).
        targets: Targets and sample weights packed in one array (None with a
            dataset; see `targets.pack`).
        dataset: The dataset files instead of arrays, or None.
        order: Keras' order of the examples in every pass, when known.
    """

    inputs: list[np.ndarray]
    targets: np.ndarray | None
    dataset: DatasetFiles | None = None
    order: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What preparing an input needs to know of the run.

    Attributes:
        model: The user's Keras model (its losses' reductions).
        graph_item: The model's capture.
        strategy: The strategy (its fixed global batch and virtual nodes).
        num_worker_tasks: Worker tasks of the cluster.
        dataset_passes: Where each dataset's seed generators stood after the
            run's last fit on it (passes started, by the generators' names):
            where the next fit's search for them begins; updated after a fit.
    """

    model: Any
    graph_item: GraphItem
    strategy: Strategy
    num_worker_tasks: int
    dataset_passes: dict[tuple[str, ...], int]


class FitInput(Protocol):
    """One kind of training input, made ready for a job.

    Attributes:
        global_batch_size: Examples of one step over all replicas.
        epoch_steps: Steps of each of the job's epochs.
        num_examples: Examples of one pass (None where the workers read a
            dataset, whose size only the pass tells).
        streaming: The workers read a dataset (their batches cannot change
            size during the run).
        shuffle: The `shuffle` the workers apply (False with a dataset, which
            shuffles itself).
        data: The files the workers read.
    """

    global_batch_size: int
    epoch_steps: list[int]
    num_examples: int | None
    streaming: bool
    shuffle: bool | str
    data: JobData

    def after_fit(self, epochs_run: int) -> None:
        """Records what the fit consumed, as Keras' `fit` leaves it (e.g. passes)."""


def prepare(x: Any, y: Any, options: FitOptions, context: InputContext) -> FitInput:
    """`fit`'s `x` and `y` (with `options`' weights and batch) made ready for the job.

    Raises:
        AutodistError: the input does not fit the options or the strategy
            (named, with what was received).
    """
    if isinstance(x, ShardedDataset):
        return ShardedInput(x, y, options, context)
    if python_data.is_python_data(x):
        return PythonInput(x, y, options, context)
    if datasets.is_dataset(x):
        return StreamedInput(x, y, options, context)
    return ArrayInput(x, y, options, context)


class ArrayInput:
    """Arrays in memory, batched and shuffled as Keras' `fit` batches them."""

    streaming = False

    def __init__(self, x: Any, y: Any, options: FitOptions, context: InputContext) -> None:
        inputs, packed, batch = _arrays(x, y, options.batch_size, options.sample_weight,
                                        options.class_weight, context)
        n = len(packed)
        steps = batching.steps_per_epoch(n, batch)
        check_batches([len(batching.batch_rows(np.arange(n), s, batch)) for s in range(steps)],
                      n, batch, context)
        lengths = [e.steps for e in batching.EpochSchedule(
            n, options.job_epochs, options.steps_per_epoch, lambda step: batch).array_epochs()]
        if options.steps_per_epoch and min(lengths) < options.steps_per_epoch:
            # As Keras warns when its step finds the pass at its end.
            warnings.warn(
                f"Your input ran out of data: with steps_per_epoch={options.steps_per_epoch}, "
                f"epochs read {lengths[:8]}{'...' if len(lengths) > 8 else ''} batches "
                f"of a pass's {steps} (a pass goes on across epochs until it ends, "
                "then the next epoch starts a new one), as Keras' fit reads them",
                UserWarning, stacklevel=4)
        self.global_batch_size = batch
        self.epoch_steps = lengths
        self.num_examples: int | None = n
        self.shuffle = options.shuffle
        self.data = JobData(inputs, packed, None,
                            batching.keras_order(n, batch, options.shuffle))

    @classmethod
    def for_probe(cls, x: Any, y: Any, batch_size: int | None,
                  context: InputContext) -> tuple[JobData, int]:
        """The arrays of a throughput probe and its global batch (no weights; one
        batch checked)."""
        inputs, packed, batch = _arrays(x, y, batch_size, None, None, context)
        n = len(packed)
        check_batches([len(batching.batch_rows(np.arange(n), 0, batch))], n, batch, context)
        return JobData(inputs, packed), batch

    def after_fit(self, epochs_run: int) -> None:
        del epochs_run


class StreamedInput:
    """A `tf.data.Dataset` of global batches, which every worker reads whole."""

    streaming = True
    shuffle = False
    num_examples = None

    def __init__(self, x: Any, y: Any, options: FitOptions, context: InputContext,
                 epoch_lengths: list[int] | None = None, runs_out: bool = False) -> None:
        if y is not None or options.sample_weight is not None:
            raise AutodistError("with a dataset, pass neither y nor sample_weight (as Keras): "
                                "the dataset yields (x, y[, sample_weight]) batches. Received "
                                f"y={'an array' if y is not None else None}, sample_weight="
                                f"{'an array' if options.sample_weight is not None else None}")
        strategy = context.strategy
        for step, new in (options.switch_at or {}).items():
            if isinstance(new, Strategy) and new.global_batch_size != strategy.global_batch_size:
                raise AutodistError(
                    f"switch_at[{step}]: with a dataset the global batch is the dataset's "
                    f"batch; a strategy switched to must keep it (global batch "
                    f"{strategy.global_batch_size}); received one with "
                    f"{new.global_batch_size}")
        _check_steps_per_execution(x, options, context)
        targets = bool(context.graph_item.target_inputs)
        read = x if targets else _x_alone(x, options.class_weight)
        # As Keras, batch_size is ignored: the dataset's batches are the batches.
        self._dataset, self._context = x, context
        self._steps_per_epoch = options.steps_per_epoch
        self._streamed = datasets.prepare(
            read, context.graph_item, steps_per_epoch=options.steps_per_epoch,
            epochs=options.job_epochs,
            smallest_batch=global_batch.smallest_batch(context.graph_item, strategy),
            fixed_batch=strategy.global_batch_size,
            class_weight=options.class_weight if targets else None,   # Keras ignores it
            earlier_passes=context.dataset_passes, epoch_lengths=epoch_lengths,
            runs_out=runs_out,
            # With steps_per_execution > 1 Keras runs no step where the data ended.
            end_step=steps_per_execution.of(context.model) == 1)
        if self._streamed.description.weighted:
            check_weighted(None, context)
        self.global_batch_size = strategy.global_batch_size or self._streamed.batch_size or 0
        self.epoch_steps = self._streamed.epoch_steps
        self.data = JobData([], None, DatasetFiles(self._streamed.graph,
                                                   self._streamed.description.to_json()))

    def after_fit(self, epochs_run: int) -> None:
        # As after Keras' fit, a later fit reshuffles anew.
        key = self._streamed.seed_generators
        self._context.dataset_passes[key] = self._streamed.description.passes_before + \
            datasets.start_passes_like_keras(self._dataset, self._streamed,
                                             self._steps_per_epoch, epochs_run)


class PythonInput(StreamedInput):
    """A Python generator or `keras.utils.PyDataset`, read in the driver as Keras' `fit`
    reads it (`python_data`); the workers read the batches it gave as a dataset."""

    def __init__(self, x: Any, y: Any, options: FitOptions, context: InputContext) -> None:
        what = python_data.kind(x)
        if y is not None or options.sample_weight is not None:
            raise AutodistError(f"with a {what}, pass neither y nor sample_weight (as Keras): "
                                f"the {what} gives (x, y[, sample_weight]) batches")
        python_data.check_arguments(x, epochs=options.job_epochs,
                                    steps_per_epoch=options.steps_per_epoch,
                                    class_weight=options.class_weight)
        read = python_data.read_like_keras(x, epochs=options.job_epochs,
                                           steps_per_epoch=options.steps_per_epoch,
                                           shuffle=options.shuffle)
        _check_python_batches(read.batches.batch_sizes(), what, context)
        super().__init__(read.batches.to_dataset(), None, options, context,
                         epoch_lengths=read.epoch_lengths, runs_out=read.runs_out)


def _check_python_batches(sizes: list[int], what: str, context: InputContext) -> None:
    """Every batch holds the examples the step needs (`global_batch.smallest_batch`),
    and, when the strategy fixes the global batch, that many examples (the workers'
    one-pass reading allows no short batch but the last)."""
    strategy = context.strategy
    smallest = min(sizes)
    needed, why = global_batch.smallest_batch(context.graph_item, strategy)
    if smallest < needed:
        raise AutodistError(
            f"the {what} gave a batch of {smallest} examples (step {sizes.index(smallest)}), "
            f"fewer than {needed} ({why}): give every batch at least that many examples")
    fixed = strategy.global_batch_size
    other = next((i for i, size in enumerate(sizes[:-1]) if size != fixed), None) \
        if fixed is not None else None
    if other is not None or fixed is not None and sizes[-1] > fixed:
        step = other if other is not None else len(sizes) - 1
        raise AutodistError(
            f"the strategy fixes the global batch at {fixed} examples; the {what}'s batch "
            f"of step {step} has {sizes[step]}: give every batch {fixed} examples, or "
            "change the strategy's virtual nodes")


class ShardedInput:
    """A `ShardedDataset`: each worker task builds and reads its own share of every batch.

    Each worker's share is fixed for the run, so the workers and the strategy
    cannot change during it: those options are refused here.
    """

    streaming = True
    shuffle = False
    num_examples = None

    def __init__(self, x: ShardedDataset, y: Any, options: FitOptions,
                 context: InputContext) -> None:
        if y is not None or options.batch_size is not None or options.sample_weight is not None:
            raise AutodistError("with a ShardedDataset, pass neither y, sample_weight nor "
                                "batch_size: its shards yield (x, y[, sample_weight]) "
                                "batches of the global batch it names")
        fixed = [name for name, value in (
            ("policies (which may resize or re-plan)", options.policies),
            ("elastic=True", options.elastic), ("resize_at", options.resize_at),
            ("switch_at", options.switch_at),
            ("on_failure='continue'", options.on_failure == "continue")) if value]
        if fixed:
            raise AutodistError(
                f"{fixed[0]} cannot work with a ShardedDataset: each worker task reads a fixed "
                "share of every global batch, so the workers and the strategy cannot change "
                "during the run; pass a tf.data.Dataset (every worker reads every batch) or "
                "arrays")
        shards = sharded_input.prepare(x, context.graph_item, context.strategy,
                                       context.num_worker_tasks,
                                       steps_per_epoch=options.steps_per_epoch,
                                       epochs=options.job_epochs,
                                       class_weight=options.class_weight)
        self.global_batch_size = shards.global_batch_size
        self.epoch_steps = shards.epoch_steps
        self.data = JobData([], None, DatasetFiles(b"", shards.description.to_json(),
                                                   shards.graphs))

    def after_fit(self, epochs_run: int) -> None:
        del epochs_run


def _arrays(x: Any, y: Any, batch_size: int | None, sample_weight: Any, class_weight: Any,
            context: InputContext) -> tuple[list[np.ndarray], np.ndarray, int]:
    """(inputs, targets and sample weights as one array, global batch) from fit's
    arguments, checked."""
    takes_targets = bool(context.graph_item.target_inputs)
    if y is None and takes_targets:
        raise AutodistError("fit needs targets y (or a dataset of (x, y) batches)")
    strategy = context.strategy
    fixed = strategy.global_batch_size
    if fixed is not None and batch_size not in (None, fixed):
        raise AutodistError(
            f"the strategy fixes the global batch at {fixed} examples "
            f"({strategy.num_virtual_nodes} virtual nodes); fit received batch_size "
            f"{batch_size}. Leave batch_size out or change the strategy's virtual nodes")
    batch_size = (fixed or 32) if batch_size is None else batch_size
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
            or batch_size < 1:
        raise AutodistError(f"batch_size must be an integer >= 1. Received: {batch_size!r}")
    if sample_weight is not None and class_weight is not None:
        raise AutodistError("give sample_weight or class_weight, not both (as Keras)")
    if not takes_targets:
        # Compiled without a loss: Keras' loss is the layers' add_loss terms alone, which
        # read neither (its class weights come from y's classes, so it fails without y).
        if class_weight is not None and y is None:
            raise AutodistError(_CLASS_WEIGHT_WITHOUT_Y)
        sample_weight = class_weight = None
    data = keras_data.fit_arrays(x, y, sample_weight, context.graph_item)
    weights = data.weights
    if class_weight is not None:
        weights = targets.class_weights(class_weight, data.targets)
        data = keras_data.fit_arrays(x, y, weights, context.graph_item)
        weights = data.weights
    if weights is not None:
        check_weighted(np.concatenate([np.ravel(w) for w in weights])
                       if isinstance(weights, list) else weights, context)
    if not takes_targets:
        # Compiled without a loss: the step reads no targets (Keras ignores y too).
        return data.inputs, np.zeros((data.num_examples, 0), np.float32), int(batch_size)
    return data.inputs, targets.pack(data.targets, weights), int(batch_size)


def probe_input(x: Any, y: Any, batch_size: int | None, steps: int,
                context: InputContext) -> tuple[JobData, int]:
    """The data of a throughput probe of `steps` timed batches (after one warm-up):
    its files and global batch.

    Raises:
        AutodistError: the input is bad or has fewer than `steps + 1` batches.
    """
    if isinstance(x, ShardedDataset):
        if y is not None or batch_size is not None:
            raise AutodistError("with a ShardedDataset, pass neither y nor batch_size: "
                                "its shards yield (x, y) batches of the global batch it "
                                "names")
    if isinstance(x, ShardedDataset) or datasets.is_dataset(x) or \
            python_data.is_python_data(x):
        ready = prepare(x, y, FitOptions(batch_size=batch_size, steps_per_epoch=steps + 1),
                        context)
        if ready.epoch_steps[0] < steps + 1:
            what = "shards" if isinstance(x, ShardedDataset) else \
                python_data.kind(x) if python_data.is_python_data(x) else "dataset"
            raise AutodistError(f"measuring {steps} steps reads {steps + 1} batches (one "
                                f"to warm up); the {what} has {ready.epoch_steps[0]}")
        return ready.data, ready.global_batch_size
    return ArrayInput.for_probe(x, y, batch_size, context)


_CLASS_WEIGHT_WITHOUT_Y = (
    "class_weight weighs each example by its class in y, so it needs y (Keras' fit fails "
    "without it); this model is compiled without a loss, whose add_loss terms read "
    "neither: leave class_weight out (a weight the layers read is a model input)")


def _x_alone(dataset: Any, class_weight: Any) -> Any:
    """For a model compiled without a loss (its loss is what its layers add): the dataset's
    batches as (x, no targets), as Keras reads them: an element that is a tuple of 1 to 3
    parts is (x[, y[, sample_weight]]) and only x is read; any other element is x.

    Raises:
        AutodistError: class_weight without y (Keras' fit fails on it).
    """
    spec = dataset.element_spec
    unpacks = isinstance(spec, tuple) and 1 <= len(spec) <= 3
    if class_weight is not None and not (unpacks and len(spec) >= 2):
        raise AutodistError(_CLASS_WEIGHT_WITHOUT_Y)
    if unpacks:
        return dataset.map(lambda *element: (element[0], ()))
    return dataset.map(lambda x: (x, ()))


def _check_steps_per_execution(dataset: Any, options: FitOptions,
                               context: InputContext) -> None:
    """A dataset of unknown length with `steps_per_epoch` and `steps_per_execution` > 1:
    Keras' fit then counts the batches of a pass in groups of k and runs epochs
    without steps once the pass ends (loss 0 in its History), which the run cannot
    reproduce: refused."""
    k = steps_per_execution.of(context.model)
    if k == 1 or options.steps_per_epoch is None or int(dataset.cardinality()) != -2:
        return
    raise AutodistError(
        f"the dataset's length is unknown (tf.data cannot tell it, e.g. after filter) and "
        f"the model runs steps_per_execution={k} steps a call with steps_per_epoch given: "
        "Keras' fit then counts the pass's batches in groups of k and runs epochs without "
        "steps after the pass ends, which the run does not reproduce. Give the dataset "
        "its length (dataset.apply(tf.data.experimental.assert_cardinality(n))), repeat "
        "it (dataset.repeat()), leave steps_per_epoch out, or compile with "
        "steps_per_execution=1")


def check_weighted(weights: np.ndarray | None, context: InputContext) -> None:
    """Sample weights need a step that takes them; a loss dividing by their sum
    (`reduction="mean_with_sample_weight"`) needs a capture that found that sum
    (`GraphItem.loss_reductions`, which the run sums over replicas) unless the
    weights are all equal (then every replica's mean is the batch's).

    Args:
        weights: The per-example weights, or None when not known before the
            run (a dataset's).
        context: The run.
    """
    graph_item = context.graph_item
    if graph_item.sample_weight_input is None:
        raise AutodistError(f"the capture of {graph_item.name!r} takes no sample "
                            "weights (a function or v1 graph, or an old capture): capture "
                            "the Keras model again")
    if any(r.reduction == "mean_with_sample_weight" for r in graph_item.loss_reductions):
        return
    losses = getattr(context.model, "loss", None)
    losses = list(losses.values()) if isinstance(losses, dict) else \
        list(losses) if isinstance(losses, (list, tuple)) else [losses]
    for loss in losses:
        if getattr(loss, "reduction", None) == "mean_with_sample_weight" and (
                weights is None or not np.all(weights == weights[0])):
            raise AutodistError(
                f"loss {getattr(loss, 'name', type(loss).__name__)!r} divides by the sum "
                "of the sample weights (reduction='mean_with_sample_weight'), but the "
                f"capture of {graph_item.name!r} does not show that sum (made by an "
                "earlier version): capture the model again")


def check_batches(sizes: list[int], n: int, batch_size: int, context: InputContext) -> None:
    """Every batch must hold the examples the step needs (`global_batch.smallest_batch`):
    one, or one per virtual node where batch normalization computes each one's own
    statistics."""
    smallest, why = global_batch.smallest_batch(context.graph_item, context.strategy)
    if min(sizes) < smallest:
        raise AutodistError(
            f"the last batch of an epoch has {min(sizes)} examples ({n} examples, batch "
            f"{batch_size}), fewer than {smallest} ({why}); drop the remainder "
            "(steps_per_epoch), change the number of examples, or synchronize batch "
            "normalization (one virtual node per replica)")
