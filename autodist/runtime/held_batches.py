"""Batches read in the driver, each held once and handed to the workers as a dataset.

`fit`'s Python inputs (a generator, a `keras.utils.PyDataset`) run the user's
code, which no worker can run; the driver reads them (`python_data`) and
keeps here what they gave: every distinct batch once (a PyDataset read for
several epochs gives its batches again, in a new order) and which batch each
step trains on. They become a `tf.data.Dataset` of the steps in order whose
graph holds the batches as constants, which the workers read as any dataset
(`datasets`, `dataset_stream`).

The batches are checked as Keras' fit checks them on the TensorFlow backend:
each is `(x,)`, `(x, y)` or `(x, y, sample_weight)` (a dict or an array is
x alone), of the same structure throughout, and of the shapes and dtypes
Keras' element spec takes from the first two batches it reads (dimensions
they share are fixed; later batches are converted to their dtypes).

Memory is bounded: the distinct batches may hold at most `MAX_HELD_BYTES`
(the driver, the job and every worker hold them), or, for a generator read to
its end, every batch read counts (an endless generator ends in this error).
"""
from __future__ import annotations

import hashlib
from typing import Any, Sequence

import numpy as np

from autodist.ir.errors import AutodistError

MAX_HELD_BYTES = 512 * 2 ** 20
_MIB = 2 ** 20


class HeldBatchesError(AutodistError, ValueError):
    """Batches from Python code that Keras' fit would refuse, or too many to hold."""


class HeldBatches:
    """The batches a Python input gave, deduplicated, and the batch of each step.

    Args:
        source: What gave them, for messages ("the PyDataset", "the generator").
        first: The first batches Keras' fit reads to make its element spec
            (up to two; a PyDataset's are read besides the steps').
        limit_bytes: The most bytes held.
        count_every_read: Count every batch read against the limit (a
            generator read to its end), not only distinct ones.
    """

    def __init__(self, source: str, first: Sequence[Any], limit_bytes: int = MAX_HELD_BYTES,
                 count_every_read: bool = False) -> None:
        self.source = source
        self._limit = limit_bytes
        self._count_every_read = count_every_read
        parts = [self._flattened(batch, "one of its first batches") for batch in first]
        if not parts:
            raise HeldBatchesError(f"{source} gave no batch (Keras' fit refuses it too)")
        self.structure = parts[0][0]
        for structure, _ in parts[1:]:
            self._check_structure(structure, "its second batch")
        leaves = [leaf for _, leaf in parts]
        self.dtypes = [leaf.dtype for leaf in leaves[0]]
        self.shapes = [_merged([batch[j].shape for batch in leaves], batch_axis=False)
                       for j in range(len(self.dtypes))]
        self._batches: list[list[np.ndarray]] = []
        self._by_digest: dict[bytes, int] = {}
        self.steps: list[int] = []
        self.held_bytes = 0
        self.read_bytes = 0

    @property
    def num_batches(self) -> int:
        """Distinct batches held."""
        return len(self._batches)

    def add(self, batch: Any) -> None:
        """Holds `batch` (once) as the next step's.

        Raises:
            HeldBatchesError: a batch Keras' fit would refuse, or the limit.
        """
        where = f"the batch of step {len(self.steps)}"
        structure, leaves = self._flattened(batch, where)
        self._check_structure(structure, where)
        converted = []
        for j, leaf in enumerate(leaves):
            if len(leaf.shape) != len(self.shapes[j]) or any(
                    want is not None and got != want
                    for got, want in zip(leaf.shape, self.shapes[j])):
                raise HeldBatchesError(
                    f"{self.source}'s {where} has an array of shape {list(leaf.shape)} where "
                    f"Keras' fit expects {_shape_text(self.shapes[j])} (the dimensions its "
                    "first two batches share are fixed, as in Keras, which fails on it too)")
            converted.append(self._converted(leaf, j, where))
        sizes = {len(leaf) for leaf in converted}
        if len(sizes) > 1:
            raise HeldBatchesError(f"{self.source}'s {where} has arrays of {sorted(sizes)} "
                                   "examples: every part of a batch needs the same number")
        nbytes = sum(_nbytes(leaf) for leaf in converted)
        self.read_bytes += nbytes
        digest = _digest(converted)
        index = self._by_digest.get(digest)
        if index is None or not all(np.array_equal(a, b) for a, b in
                                    zip(self._batches[index], converted)):
            index = len(self._batches)
            self._batches.append(converted)
            self._by_digest[digest] = index
            self.held_bytes += nbytes
        self.steps.append(index)
        counted = self.read_bytes if self._count_every_read else self.held_bytes
        if counted > self._limit:
            raise HeldBatchesError(self._over_limit(counted))

    def batch_sizes(self) -> list[int]:
        """Examples in each step's batch."""
        return [len(self._batches[i][0]) for i in self.steps]

    def to_dataset(self):
        """A `tf.data.Dataset` of each step's batch in order, in the structure they came in
        (lists as tuples), its graph holding the distinct batches as constants."""
        import tensorflow as tf

        columns = []
        for j in range(len(self.dtypes)):
            parts = [batch[j] for batch in self._batches]
            values = tf.constant(np.concatenate([p.reshape(-1) for p in parts]))
            offsets = tf.constant(np.cumsum([0] + [p.size for p in parts]), tf.int64)
            shapes = tf.constant(np.array([p.shape for p in parts], np.int64))
            merged = _merged([p.shape for p in parts], batch_axis=True)
            columns.append((values, offsets, shapes, merged))

        def element(index):
            leaves = [tf.ensure_shape(tf.reshape(values[offsets[index]:offsets[index + 1]],
                                                 shapes[index]), merged)
                      for values, offsets, shapes, merged in columns]
            return _packed(self.structure, iter(leaves))

        steps = np.asarray(self.steps, np.int64)
        return tf.data.Dataset.from_tensor_slices(steps).map(element)

    # ------------------------------------------------------------ checks
    def _flattened(self, batch: Any, where: str) -> tuple[Any, list[np.ndarray]]:
        """(structure, leaves as arrays) of a batch standardized as Keras' adapters do."""
        if isinstance(batch, dict) or isinstance(batch, np.ndarray):
            batch = (batch,)
        elif isinstance(batch, list):
            batch = tuple(batch)
        if not isinstance(batch, tuple) or len(batch) not in (1, 2, 3):
            raise HeldBatchesError(
                f"{self.source}'s {where} must be a tuple (x,), (x, y) or (x, y, "
                f"sample_weight), as Keras' fit needs; received "
                f"{type(batch).__name__}" + (f" of {len(batch)}" if isinstance(
                    batch, tuple) else ""))
        leaves: list[np.ndarray] = []
        structure = _structure(batch, leaves, self.source, where)
        return structure, leaves

    def _converted(self, leaf: np.ndarray, j: int, where: str) -> np.ndarray:
        """`leaf` in the dtype of the spec's `j`th array, as Keras' generator dataset
        converts it."""
        dtype = self.dtypes[j]
        if leaf.dtype == dtype:
            return leaf
        if (leaf.dtype.kind == "O") != (dtype.kind == "O"):
            raise HeldBatchesError(f"{self.source}'s {where} has an array of {leaf.dtype} "
                                   f"where its first batches had {dtype}")
        return leaf.astype(dtype)

    def _check_structure(self, structure: Any, where: str) -> None:
        if structure != self.structure:
            raise HeldBatchesError(
                f"{self.source}'s {where} is structured as {_structure_text(structure)}; its "
                f"first was {_structure_text(self.structure)}: every batch needs the same "
                "parts (Keras' fit fails on it too)")

    def _over_limit(self, counted: int) -> str:
        what = "read" if self._count_every_read else "of distinct batches held"
        ending = " without the generator ending: an endless generator needs " \
            "steps_per_epoch (as in Keras), and" if self._count_every_read else ":"
        return (
            f"{self.source} gave {counted / _MIB:.0f} MiB {what} by step {len(self.steps)}, "
            f"over the {self._limit / _MIB:.0f} MiB autodist holds{ending} the driver reads "
            "Python inputs and ships every batch they give in the job, which each worker "
            "holds. Train on arrays (fit(x, y)), on a tf.data.Dataset the workers read "
            "themselves (from files, with stateless random ops or Keras preprocessing "
            "layers in the model), or on a ShardedDataset; or fit fewer epochs a call "
            "(fit(..., initial_epoch=...))")


def _structure(value: Any, leaves: list[np.ndarray], source: str, where: str) -> Any:
    """`value`'s nesting with each array replaced by None (lists as tuples, dict keys
    sorted); its arrays appended to `leaves` in that order."""
    if isinstance(value, dict):
        return {key: _structure(value[key], leaves, source, where) for key in sorted(value)}
    if isinstance(value, (tuple, list)):
        return tuple(_structure(v, leaves, source, where) for v in value)
    if value is None:
        raise HeldBatchesError(f"{source}'s {where} holds None where autodist needs arrays: "
                               "leave the part out ((x, y) instead of (x, y, None))")
    if not hasattr(value, "__array__") and not isinstance(value, (int, float, str, bytes)):
        raise HeldBatchesError(f"{source}'s {where} holds a {type(value).__name__}; autodist "
                               "takes dense arrays (NumPy, tensors): densify sparse or ragged "
                               "ones")
    array = np.asarray(value)
    if array.ndim < 1:
        raise HeldBatchesError(f"{source}'s {where} holds an array of rank 0; Keras' fit "
                               "needs arrays of at least rank 1 (one value per example)")
    if array.dtype == object or array.dtype.kind == "U":
        array = np.vectorize(lambda s: s if isinstance(s, bytes) else str(s).encode(),
                             otypes=[object])(array)
    leaves.append(array)
    return None


def _packed(structure: Any, leaves) -> Any:
    """`structure` with its Nones replaced by `leaves` in order."""
    if isinstance(structure, dict):
        return {key: _packed(value, leaves) for key, value in structure.items()}
    if isinstance(structure, tuple):
        return tuple(_packed(value, leaves) for value in structure)
    return next(leaves)


def _merged(shapes: Sequence[tuple[int, ...]], batch_axis: bool) -> list[int | None]:
    """The dimensions all `shapes` share (None where they differ); the batch axis None
    unless `batch_axis` (kept when every batch has the same size)."""
    merged = [dims[0] if len(set(dims)) == 1 else None for dims in zip(*shapes)]
    if not batch_axis and merged:
        merged[0] = None
    return merged


def _digest(leaves: Sequence[np.ndarray]) -> bytes:
    hasher = hashlib.blake2b(digest_size=16)
    for leaf in leaves:
        hasher.update(f"{leaf.dtype.str}{leaf.shape}".encode())
        hasher.update(b"\0".join(leaf.reshape(-1)) if leaf.dtype == object
                      else np.ascontiguousarray(leaf).tobytes())
    return hasher.digest()


def _nbytes(leaf: np.ndarray) -> int:
    if leaf.dtype == object:
        return sum(len(s) for s in leaf.reshape(-1))
    return int(leaf.nbytes)


def _shape_text(shape: Sequence[int | None]) -> str:
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + ")"


def _structure_text(structure: Any) -> str:
    if isinstance(structure, dict):
        return "{" + ", ".join(f"{k!r}: {_structure_text(v)}" for k, v in
                               structure.items()) + "}"
    if isinstance(structure, tuple):
        return "(" + ", ".join(_structure_text(v) for v in structure) + \
            ("," if len(structure) == 1 else "") + ")"
    return "array"
