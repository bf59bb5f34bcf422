"""A worker's side of `fit(dataset)`: the dataset's global batches, read ahead.

The worker rebuilds the job's dataset from its graph (with seed generators
of its own, `dataset_graph.restore`) and a background thread reads its
elements in the order Keras' `fit` reads them: for each epoch, the pass
Keras reads it from (creating every pass Keras creates, also those it never
reads, since each draws the next shuffle seeds) and as many batches as
Keras reads. The thread turns each element into a `GlobalBatch` and checks
it, at most `depth` batches ahead of the training loop (a bounded queue),
so reading and preprocessing overlap the steps and memory stays bounded.

Every worker reads every element; each trains on its virtual nodes' rows.
With a sharded dataset (`sharded_input`) each worker reads its own shard
instead, whose elements hold only its virtual nodes' rows of each global
batch (`GlobalBatch.held_rows`).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Sequence

import numpy as np

from autodist.ir.graph_item import GraphItem
from autodist.launch.job import DatasetFiles
from autodist.runtime import batching, dataset_graph
from autodist.runtime.datasets import DatasetError
from autodist.runtime.records import DatasetDescription
from autodist.runtime.step_data import GlobalBatch
from autodist.runtime.targets import pack
from autodist.runtime.run_config import RunConfig

_POLL_S = 0.1


class _Failure:
    """What the producer hands the training loop when reading fails."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class DatasetStream:
    """The global batches of the job's dataset, by the step's global index.

    Args:
        files: The job's dataset (graph and description).
        config: The run's config (epochs, steps_per_epoch, probe_steps, timeouts).
        graph_item: The model's capture (what each batch must hold).
        smallest_batch: The fewest examples a batch may have, and why
            (`global_batch.smallest_batch`).
        fixed_batch: The strategy's fixed global batch, or None.
        depth: Batches read ahead of the training loop.
        held_rows: A sharded dataset: the rows of each global batch
            (`config.global_batch_size` examples) this worker's shard holds,
            sorted; None when the worker reads whole global batches.
        task: The worker task (whose shard it reads).
    """

    def __init__(self, files: DatasetFiles, config: RunConfig, graph_item: GraphItem,
                 smallest_batch: tuple[int, str], fixed_batch: int | None, depth: int = 2,
                 held_rows: np.ndarray | None = None, task: int = 0) -> None:
        self.description = DatasetDescription.from_json(files.description)
        self._held_rows = held_rows
        self._task = task
        if held_rows is not None:
            if task >= len(files.shard_graphs) or not files.shard_graphs[task]:
                raise DatasetError(f"the job holds no dataset shard for worker task {task}")
            self._graph = files.shard_graphs[task]
        else:
            self._graph = files.graph
        self.config = config
        d = self.description
        requested = config.steps_per_epoch
        epochs = config.epochs
        if config.probe_steps:   # measure_throughput: the first probe_steps + 1 batches
            requested, epochs = config.probe_steps + 1, 1
        if d.epoch_lengths is not None and not config.probe_steps:
            self.epochs = batching.one_pass_epochs(d.epoch_lengths,   # the driver's reading
                                                   d.runs_out)
        else:
            self.epochs = batching.dataset_epochs(d.batches, d.cardinality_known, requested,
                                                  epochs)
        self.schedule = batching.EpochSchedule(0, epochs, requested, lambda step: fixed_batch or
                                               config.global_batch_size, self.lengths)
        self._infos = list(graph_item.model_inputs) + list(graph_item.target_inputs)
        self._smallest_batch = smallest_batch
        self._fixed_batch = fixed_batch
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next = 0
        self._sizes: list[int] = []

    @property
    def lengths(self) -> list[int]:
        return [e.steps for e in self.epochs]

    def epochs_run_out(self) -> list[bool]:
        if not self.description.end_step:
            return []   # Keras (steps_per_execution > 1) runs no step at the data's end
        return [e.runs_out for e in self.epochs]

    def batch(self, index: int) -> GlobalBatch:
        """The global batch of step `index`; the earlier ones not asked for are skipped.

        Raises:
            DatasetError: a batch the run cannot train on, or reading failed.
        """
        if index < self._next:
            raise DatasetError(f"step {index}'s batch was read already (next: {self._next})")
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, name="autodist-dataset",
                                            daemon=True)
            self._thread.start()
        while True:
            try:
                item = self._queue.get(timeout=self.config.job_timeout_s)
            except queue.Empty:
                raise DatasetError(f"the dataset gave no batch for step {self._next} within "
                                   f"{self.config.job_timeout_s:g}s") from None
            if isinstance(item, _Failure):
                raise item.error
            self._sizes.append(item.size)
            self._next += 1
            if self._next > index:
                return item

    def probe_batch(self, index: int) -> GlobalBatch:
        return self.batch(index)

    def examples(self, index: int) -> int:
        return self._sizes[index]

    def close(self, timeout_s: float = 10.0) -> None:
        """Stops the producer (waiting up to `timeout_s` for a read in progress)."""
        self._stop.set()
        if self._thread is None:
            return
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:   # unblocks a producer waiting to put
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(_POLL_S)

    # ------------------------------------------------------------ producer
    def _produce(self) -> None:
        index = 0
        try:
            import tensorflow as tf

            d = self.description
            spec = tuple(tf.TensorSpec(shape, tf.as_dtype(dtype))
                         for dtype, shape in zip(d.dtypes, d.shapes))
            dataset = dataset_graph.restore(self._graph, spec)
            if not dataset_graph.relies_on_autotune(self._graph):
                dataset = dataset_graph.without_autotune(dataset)   # no stall at a pass's end
            for _ in range(d.passes_before):   # started by the run's earlier fits
                iter(dataset)
            created, iterator = 0, None
            for epoch in self.epochs:
                while created <= epoch.iterator:   # each pass Keras starts, read or not
                    iterator = iter(dataset)
                    created += 1
                for k in range(epoch.steps):
                    try:
                        element = next(iterator)
                    except StopIteration:
                        raise DatasetError(
                            f"the dataset ran out at step {index}, after {epoch.start + k} of "
                            f"the {d.batches} batches of a pass it had when the driver "
                            "prepared the run: did its files change?") from None
                    arrays = [t.numpy() for t in element]
                    if not self._put(self._global_batch(index, arrays)):
                        return
                    index += 1
                if epoch.runs_out:
                    self._find_the_end(iterator, index)
        except Exception as e:  # noqa: BLE001
            if not isinstance(e, DatasetError):
                e = DatasetError(f"reading the dataset failed at step {index} "
                                 f"({type(e).__name__}): {str(e)[:500]}. The workers read "
                                 "the files a dataset names at the same paths as the driver")
            self._put(_Failure(e))

    def _find_the_end(self, iterator, index: int) -> None:
        """Reads on to the pass's end, as Keras' step after an epoch's last finds it:
        what an iterator does there, not before, happens (an in-memory `cache()`
        completes, and the next passes replay it; without this they reshuffled)."""
        try:
            next(iterator)
        except StopIteration:
            return
        raise DatasetError(
            f"the dataset gave another batch after step {index - 1}, where the driver "
            f"found the end of a pass of {self.description.batches} batches when it "
            "prepared the run: did its files change?")

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _global_batch(self, index: int, arrays: Sequence[np.ndarray]) -> GlobalBatch:
        """An element as a checked global batch (a shard's: this worker's rows of it)."""
        d = self.description
        size = len(arrays[0])
        held = self._held_rows
        if held is not None and size != len(held):
            raise DatasetError(
                f"step {index}: worker task {self._task}'s shard gave a batch of {size} "
                f"examples; its share of the global batch of {self.config.global_batch_size} "
                f"is {len(held)} (InputShard.batch_size): batch each shard by its batch_size "
                "with drop_remainder=True")
        for array, info in zip(arrays, self._infos):
            expected = list(info.shape)[1:]
            if len(array) != size or len(array.shape) - 1 != len(expected) or any(
                    e >= 0 and g != e for g, e in zip(array.shape[1:], expected)):
                raise DatasetError(
                    f"step {index}: the dataset's batch gives {info.name!r} shape "
                    f"{list(array.shape)}; the model needs {size} examples of shape {expected}")
        if held is None and size < self._smallest_batch[0]:
            raise DatasetError(
                f"step {index}: the dataset's batch has {size} examples, fewer than "
                f"{self._smallest_batch[0]} ({self._smallest_batch[1]}): drop the short batch "
                "(batch(n, drop_remainder=True)) or batch more examples")
        # A smaller batch is split over the virtual nodes as a short last batch is, also
        # inside a pass (keras-io's traffic forecasting batches, then shuffles the batches).
        if held is None and self._fixed_batch is not None and size > self._fixed_batch:
            raise DatasetError(
                f"step {index}: the dataset's batch has {size} examples; the strategy fixes "
                f"the global batch at {self._fixed_batch} (a batch may be smaller, not "
                "larger)")
        inputs = list(arrays[:d.num_inputs])
        ys = list(arrays[d.num_inputs:d.num_inputs + d.num_targets])
        weights = arrays[-1] if d.weighted else None
        if weights is not None and len(weights) != size:
            raise DatasetError(f"step {index}: the dataset's batch has {len(weights)} sample "
                               f"weights for {size} examples")
        # A model compiled without a loss reads no targets: an empty row per example.
        targets = pack(ys, weights) if ys else np.zeros((size, 0), np.float32)
        if held is not None:
            return GlobalBatch(inputs, targets, np.arange(self.config.global_batch_size), held)
        return GlobalBatch(inputs, targets, np.arange(size))
