"""`fit` on a dataset read in shards: each worker task reads only its part of every batch.

`fit(dataset)` has every worker read (and preprocess) every global batch, so
that the run trains on exactly the batches Keras' `fit` reads; an
input-bound pipeline then does the same work on every worker. A
`ShardedDataset` divides that work instead, as
`tf.distribute.Strategy.distribute_datasets_from_function` does: the user's
function builds, for each worker task, a dataset of that task's *share* of
every global batch (`InputShard.batch_size` examples per element: the rows
of the global batch that the task's virtual nodes train on), typically by
sharding the files (`Dataset.shard(shard.count, shard.index)`) before the
expensive `map`.

The driver calls the function once per worker task and serializes each
dataset's graph into the job (`dataset_graph`; it reads no data); each
worker rebuilds its own and reads it ahead of the steps
(`dataset_stream.DatasetStream`). Step `s`'s global batch is the shards'
`s`-th elements in worker-task order (in virtual-node order when the
strategy maps virtual nodes to tasks unevenly), and the run trains on that
batch exactly as a single device would. Which examples make a global batch
is the user's function's choice, not Keras' reading of one dataset: the
batches differ from `fit(dataset)` on the unsharded dataset.

Each worker's share is fixed for the run, so a sharded run cannot change
its workers or strategy (`elastic`, `resize_at`, `switch_at`) or recover on
fewer workers (`on_failure="continue"`): those are refused before launch.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from autodist.ir.errors import AutodistError
from autodist.ir.graph_item import GraphItem
from autodist.ir.strategy import Strategy
from autodist.kernels import global_batch
from autodist.runtime import batching, datasets
from autodist.runtime.datasets import DatasetError
from autodist.runtime.elastic import replica_task


@dataclasses.dataclass(frozen=True)
class InputShard:
    """What the dataset function of a `ShardedDataset` builds one worker task's input for.

    Attributes:
        index: This shard, from 0 (shard `index` of `count`: pass both to
            `Dataset.shard`).
        count: Shards in the run: the worker tasks that train.
        task: The worker task that reads this shard.
        batch_size: Examples every element of this shard's dataset must hold
            (its virtual nodes' rows of each global batch).
        global_batch_size: Examples of one step, over all shards.
    """

    index: int
    count: int
    task: int
    batch_size: int
    global_batch_size: int


class ShardedDataset:
    """A dataset that every worker task builds and reads for itself, one shard each.

    Example:
        >>> def make(shard):                                     # doctest: +SKIP
        ...     files = tf.data.Dataset.from_tensor_slices(paths)
        ...     return (files.shard(shard.count, shard.index)
        ...             .interleave(tf.data.TFRecordDataset)
        ...             .map(parse).repeat()
        ...             .batch(shard.batch_size, drop_remainder=True))
        >>> run.fit(autodist.ShardedDataset(make, global_batch_size=256),
        ...         epochs=3, steps_per_epoch=100)               # doctest: +SKIP

    Args:
        dataset_fn: `InputShard` -> a `tf.data.Dataset` of `(x, y)` or
            `(x, y, sample_weight)` batches of exactly `shard.batch_size`
            examples, as `fit(dataset)` takes (its graph must be
            serializable and seeded; see `autodist.runtime.dataset_graph`).
            Every shard must have the same number of batches per pass
            (a known cardinality), or repeat forever (with `steps_per_epoch`).
        global_batch_size: Examples of one step over all shards. Default:
            the strategy's fixed global batch (virtual nodes); one of them
            is needed.
    """

    def __init__(self, dataset_fn: Callable[[InputShard], Any],
                 global_batch_size: int | None = None) -> None:
        if not callable(dataset_fn):
            raise AutodistError("ShardedDataset needs a function InputShard -> tf.data.Dataset. "
                                f"Received: {type(dataset_fn).__name__}")
        if global_batch_size is not None and (isinstance(global_batch_size, bool) or
                                              not isinstance(global_batch_size, int) or
                                              global_batch_size < 1):
            raise AutodistError("ShardedDataset: global_batch_size must be an integer >= 1. "
                                f"Received: {global_batch_size!r}")
        self.dataset_fn = dataset_fn
        self.global_batch_size = global_batch_size

    def __repr__(self) -> str:
        name = getattr(self.dataset_fn, "__name__", type(self.dataset_fn).__name__)
        return f"ShardedDataset({name}, global_batch_size={self.global_batch_size})"


@dataclasses.dataclass(frozen=True)
class PreparedShards:
    """A sharded dataset made ready for the workers.

    Attributes:
        graphs: Each worker task's dataset graph, by task index.
        description: How the workers read them (the batch dimension
            unknown: shards may differ by an example).
        epochs: What each epoch of the job reads (the same on every shard).
        global_batch_size: Examples of one step.
    """

    graphs: tuple[bytes, ...]
    description: Any
    epochs: list[batching.DatasetEpoch]
    global_batch_size: int

    @property
    def epoch_steps(self) -> list[int]:
        return [e.steps for e in self.epochs]


def task_rows(strategy: Strategy, global_batch_size: int, num_worker_tasks: int
              ) -> list[np.ndarray]:
    """Per worker task, the sorted rows of each global batch its virtual nodes train on.

    The global batch is split into the strategy's virtual nodes as every
    step splits it (`batching.virtual_node_rows`); a task holds the parts of
    the virtual nodes on its replicas.
    """
    parts = batching.virtual_node_rows(np.arange(global_batch_size),
                                       strategy.num_virtual_nodes)
    owned: list[list[np.ndarray]] = [[] for _ in range(num_worker_tasks)]
    for index, device in enumerate(strategy.virtual_node_devices):
        owned[replica_task(device)].append(parts[index])
    return [np.sort(np.concatenate(p)).astype(np.int64) if p else np.zeros([0], np.int64)
            for p in owned]


def prepare(sharded: ShardedDataset, graph_item: GraphItem, strategy: Strategy,
            num_worker_tasks: int, *, steps_per_epoch: int | None, epochs: int,
            class_weight: Any = None) -> PreparedShards:
    """Builds every worker task's dataset, checks it and serializes its graph.

    Raises:
        DatasetError: no global batch; a batch smaller than the virtual
            nodes; a function that does not return a dataset, or one whose
            elements or batch size do not fit; shards of unknown or
            different lengths; whatever `datasets.prepare` refuses.
    """
    batch = strategy.global_batch_size or sharded.global_batch_size
    if batch is None:
        raise DatasetError("a ShardedDataset needs the global batch, to tell each shard its "
                           "size: give ShardedDataset(..., global_batch_size=n), or use a "
                           "strategy with virtual nodes")
    if strategy.global_batch_size is not None and sharded.global_batch_size not in (None,
                                                                                    batch):
        raise DatasetError(f"the strategy fixes the global batch at {batch} examples; the "
                           f"ShardedDataset asks for {sharded.global_batch_size}")
    if batch < strategy.num_virtual_nodes:
        raise DatasetError(f"the global batch of {batch} examples is smaller than the "
                           f"{strategy.num_virtual_nodes} virtual nodes or replicas that split "
                           "it")
    rows = task_rows(strategy, batch, num_worker_tasks)
    idle = [t for t, r in enumerate(rows) if not len(r)]
    if idle:
        raise DatasetError(
            f"worker task {idle[0]} trains on no rows of the global batch (the strategy gives "
            "it no replica or virtual node), so it has no shard to read: use a strategy "
            "whose replicas cover every worker task, or pass a tf.data.Dataset")
    tasks = list(range(num_worker_tasks))
    graphs = [b""] * num_worker_tasks
    prepared = {}
    for index, task in enumerate(tasks):
        shard = InputShard(index, len(tasks), task, len(rows[task]), batch)
        dataset = sharded.dataset_fn(shard)
        if not datasets.is_dataset(dataset):
            raise DatasetError(f"the ShardedDataset's function returned "
                               f"{type(dataset).__name__} for {shard}; it must return a "
                               "tf.data.Dataset")
        _check_length(dataset, shard, steps_per_epoch)
        _check_batch_size(dataset, shard)
        try:
            streamed = datasets.prepare(dataset, graph_item, steps_per_epoch=steps_per_epoch,
                                        epochs=epochs,
                                        smallest_batch=global_batch.ANY_BATCH,
                                        fixed_batch=shard.batch_size,
                                        class_weight=class_weight)
        except DatasetError as e:
            raise DatasetError(f"shard {shard.index} (worker task {task}, "
                               f"batch_size={shard.batch_size}): {e}") from None
        graphs[task] = streamed.graph
        prepared[task] = streamed
    first = prepared[tasks[0]]
    for task in tasks[1:]:
        if prepared[task].description.batches != first.description.batches:
            raise DatasetError(
                "every shard must have the same number of batches per pass; worker task "
                f"{tasks[0]}'s has {first.description.batches}, worker task {task}'s "
                f"{prepared[task].description.batches}: give each shard as many (e.g. "
                "take(n)), or repeat() them and give steps_per_epoch")
    d = first.description
    description = dataclasses.replace(
        d, shapes=tuple((None,) + tuple(s[1:]) for s in d.shapes))
    return PreparedShards(tuple(graphs), description, first.epochs, batch)


def _check_length(dataset, shard: InputShard, steps_per_epoch: int | None) -> None:
    """Shards are read in step with each other: their length must be known up front
    (counting it would read every shard in the driver)."""
    import tensorflow as tf

    if int(dataset.cardinality()) == tf.data.UNKNOWN_CARDINALITY:
        hint = "" if steps_per_epoch is not None else " and give steps_per_epoch"
        raise DatasetError(
            f"shard {shard.index}'s dataset (worker task {shard.task}) has an unknown length "
            "(a filter, or files): declare it "
            "(dataset.apply(tf.data.experimental.assert_cardinality(n))), or repeat() it"
            f"{hint}")


def _check_batch_size(dataset, shard: InputShard) -> None:
    """A batch dimension the element spec fixes must be the shard's share."""
    import tensorflow as tf

    specs = tf.nest.flatten(dataset.element_spec)
    shape = getattr(specs[0], "shape", None) if specs else None
    static = shape[0] if shape is not None and shape.rank else None
    if static is not None and static != shard.batch_size:
        raise DatasetError(
            f"shard {shard.index}'s batches (worker task {shard.task}) have {static} examples; "
            f"its share of the global batch of {shard.global_batch_size} is "
            f"{shard.batch_size}: batch it by InputShard.batch_size")
