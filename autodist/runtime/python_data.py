"""`fit` on a Python generator or a `keras.utils.PyDataset`, read as Keras' `fit` reads it.

Such inputs run the user's Python code, which the workers cannot run, so the
driver reads them before launch, making the calls Keras 3's `fit` makes on
the TensorFlow backend, in its order, and holds the batches they give
(`held_batches`), which the workers then read as a dataset:

* A PyDataset (`keras.utils.Sequence` too): the first two batches (`x[0]`,
  `x[1]`), which Keras reads for its element spec; `on_epoch_end()` (Keras'
  reset before training); then each epoch `on_epoch_begin()`, its batches,
  `on_epoch_end()`. Each epoch reads a whole pass of `len(x)` batches; with
  `steps_per_epoch` one pass goes on across epochs until it ends, as for a
  dataset of known length (`batching.dataset_epochs`). With `shuffle` (fit's
  default) each pass reads the indices in the order `random.shuffle` gives,
  drawn from Python's `random` when the pass starts, as Keras draws it (so
  `keras.utils.set_random_seed` gives Keras' order). An endless PyDataset
  (`num_batches` None) is read 0, 1, 2, ... across epochs, unshuffled.
* A generator: its batches in order, `steps_per_epoch` a epoch, one
  iterator across the epochs; without `steps_per_epoch` (one epoch) up to
  its end.

What would not train as Keras does is refused before anything is read:
a generator with several epochs and no `steps_per_epoch` (after running out,
Keras' later epochs re-read the two batches it peeked at), or one that runs
out before `epochs * steps_per_epoch` batches; `class_weight` with a
generator (Keras refuses it); an endless PyDataset without
`steps_per_epoch`; epochs ending inside a pass of a PyDataset that
changes in `on_epoch_begin`/`on_epoch_end` or reads with worker threads or
processes (Keras reads the next batches ahead while the epoch ends, so what
they see depends on timing).

The driver reads every epoch before launch: a callback that stops the run
early does not stop the reading, and one that changes the PyDataset during
`fit` is not seen. With `workers` > 1 or `use_multiprocessing` the driver
reads in one thread, which gives Keras' batches unless `__getitem__` draws
from a random generator the threads share (Keras' own order of those draws
is not fixed).
"""
from __future__ import annotations

import dataclasses
import itertools
import random
import types
from typing import Any

from autodist.ir.errors import AutodistError
from autodist.runtime import batching
from autodist.runtime.held_batches import HeldBatches

# Keras' fit reads this many batches first for its element spec (NUM_BATCHES_FOR_TENSOR_SPEC).
_SPEC_BATCHES = 2


class PythonDataError(AutodistError, ValueError):
    """A generator or PyDataset `fit` cannot read as Keras' `fit` reads it."""


def is_python_data(x: Any) -> bool:
    """Whether `x` is a Python generator or a `keras.utils.PyDataset` (or `Sequence`)."""
    return isinstance(x, types.GeneratorType) or _py_dataset_class(x) is not None


def kind(x: Any) -> str:
    """What `x` is, for messages: "generator" or "PyDataset"."""
    return "generator" if isinstance(x, types.GeneratorType) else "PyDataset"


@dataclasses.dataclass(frozen=True)
class ReadInput:
    """A Python input as read: its batches, and the steps of each epoch.

    Attributes:
        batches: Every step's batch, in order.
        epoch_lengths: Steps of each epoch.
        runs_out: Whether Keras' step after the last finds the input's end (a
            generator read to its end: `autodist.runtime.run_outs`).
    """

    batches: HeldBatches
    epoch_lengths: list[int]
    runs_out: bool = False


def check_arguments(x: Any, *, epochs: int, steps_per_epoch: int | None,
                    class_weight: Any) -> None:
    """Refuses, before anything is read, what cannot train as Keras' fit trains it.

    Raises:
        PythonDataError: naming what was received and what to use instead.
    """
    if not isinstance(x, types.GeneratorType):
        return
    if class_weight is not None:
        raise PythonDataError(
            "class_weight cannot be used with a Python generator (Keras' fit refuses it "
            "too): yield (x, y, sample_weight) batches, or use a keras.utils.PyDataset")
    if steps_per_epoch is None and epochs > 1:
        raise PythonDataError(
            f"a Python generator with epochs={epochs} and no steps_per_epoch: Keras' fit "
            "reads it to its end in the first epoch, and each later epoch re-reads only "
            "the 2 batches it peeked at first, which autodist does not copy. Give "
            "steps_per_epoch (with a generator that yields epochs * steps_per_epoch "
            "batches, e.g. one that loops), or use a keras.utils.PyDataset, whose every "
            "epoch reads it whole")


def read_like_keras(x: Any, *, epochs: int, steps_per_epoch: int | None,
                    shuffle: bool | str) -> ReadInput:
    """Reads `x` (a generator or PyDataset) as Keras' `fit` would over `epochs` epochs.

    Args:
        x: The generator or PyDataset.
        epochs: Epochs of the fit.
        steps_per_epoch: fit's steps_per_epoch (None: every batch).
        shuffle: fit's shuffle (a PyDataset's passes; unused for a generator).

    Raises:
        PythonDataError: what would not train as Keras (see the module).
        HeldBatchesError: a batch Keras would refuse, or more than autodist holds.
    """
    check_arguments(x, epochs=epochs, steps_per_epoch=steps_per_epoch, class_weight=None)
    if isinstance(x, types.GeneratorType):
        return _read_generator(x, epochs, steps_per_epoch)
    return _read_py_dataset(x, epochs, steps_per_epoch, bool(shuffle))


def _read_generator(x: Any, epochs: int, steps_per_epoch: int | None) -> ReadInput:
    first = list(itertools.islice(x, _SPEC_BATCHES))
    if not first:
        raise PythonDataError("the generator yielded no batch (Keras' fit refuses an empty "
                              "generator too)")
    if not isinstance(first[0], tuple):
        raise PythonDataError(
            "a generator must yield tuples (x,), (x, y) or (x, y, sample_weight), as Keras' "
            f"fit needs; its first batch is a {type(first[0]).__name__}")
    wanted = None if steps_per_epoch is None else steps_per_epoch * epochs
    held = HeldBatches("the generator", first, count_every_read=wanted is None)
    batches = itertools.chain(first, x)
    while wanted is None or len(held.steps) < wanted:
        try:
            batch = next(batches)
        except StopIteration:
            break
        held.add(batch)
    if wanted is not None and len(held.steps) < wanted:
        raise PythonDataError(
            f"the generator ran out after {len(held.steps)} batches; with "
            f"steps_per_epoch={steps_per_epoch} and {epochs} epochs Keras' fit reads "
            f"{wanted}, and where a generator runs out early it ends the epoch and re-reads "
            "the 2 batches it peeked at first, which autodist does not copy. Make "
            f"steps_per_epoch * epochs at most {len(held.steps)}, or let the generator "
            "yield more (e.g. loop over the data)")
    lengths = [steps_per_epoch] * epochs if steps_per_epoch is not None else [len(held.steps)]
    return ReadInput(held, lengths, runs_out=steps_per_epoch is None)


def _read_py_dataset(x: Any, epochs: int, steps_per_epoch: int | None,
                     shuffle: bool) -> ReadInput:
    n = x.num_batches
    if n == 0:
        raise PythonDataError("the PyDataset has length 0 (Keras' fit refuses it too)")
    if n is None and steps_per_epoch is None:
        raise PythonDataError(
            "the PyDataset is endless (num_batches is None): give steps_per_epoch, as Keras' "
            "fit needs (without it Keras' first epoch never ends)")
    plan = batching.dataset_epochs(n, True, steps_per_epoch, epochs)
    _check_epoch_ends(x, plan, n, steps_per_epoch)
    first = [x[i] for i in range(_SPEC_BATCHES if n is None else min(_SPEC_BATCHES, n))]
    held = HeldBatches("the PyDataset", first)
    x.on_epoch_end()   # Keras' reset of its epoch iterator, before the first epoch
    order, reading = None, None
    for epoch in plan:
        x.on_epoch_begin()
        if epoch.iterator != reading:   # a new pass draws its order on its first read
            reading = epoch.iterator
            order = list(range(n)) if n is not None else None
            if order is not None and shuffle:
                random.shuffle(order)
        for k in range(epoch.start, epoch.start + epoch.steps):
            held.add(x[order[k] if order is not None else k])
        x.on_epoch_end()
    return ReadInput(held, [e.steps for e in plan])


def _check_epoch_ends(x: Any, plan: list[batching.DatasetEpoch], n: int | None,
                      steps_per_epoch: int | None) -> None:
    """Refuses epochs ending inside a pass of a PyDataset whose batches may change when an
    epoch ends (or that Keras reads with workers): Keras reads the pass's next batches
    ahead (tf.data's prefetch, the enqueuer's threads) while the epoch ends, so which
    state they see depends on timing."""
    inside = [e for e in plan[:-1] if n is None or e.start + e.steps < n]
    if not inside:
        return
    base = _py_dataset_class(x)
    hooks = [name for name in ("on_epoch_begin", "on_epoch_end")
             if getattr(type(x), name) is not getattr(base, name)]
    workers = x.workers > 1 or (x.workers > 0 and x.use_multiprocessing)
    if not hooks and not workers:
        return
    what = f"defines {' and '.join(hooks)}" if hooks else \
        f"is read with workers={x.workers}, use_multiprocessing={x.use_multiprocessing}"
    length = "an endless pass" if n is None else f"a pass of its {n} batches"
    raise PythonDataError(
        f"steps_per_epoch={steps_per_epoch} ends epochs inside {length}, and the PyDataset "
        f"{what}: Keras' fit reads the pass's next batches ahead while an epoch ends, so "
        "whether they see the change depends on timing, and no run can repeat its "
        "numbers. Leave steps_per_epoch out (an epoch reads a whole pass)"
        + ("" if n is None else f" or make it at least {n}")
        + ", or change the batches in __getitem__ alone")


def _py_dataset_class(x: Any) -> type | None:
    """Keras' PyDataset class among `x`'s bases (without importing Keras), or None."""
    for base in type(x).__mro__:
        if base.__name__ == "PyDataset" and base.__module__.startswith("keras"):
            return base
    return None
