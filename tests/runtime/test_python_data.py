"""fit's Python inputs read in the driver: a PyDataset and a generator give the batches,
calls and order Keras' own `fit` gives (checked against Keras' fit in this process),
held once each, as a dataset; and what would not train as Keras is refused before
anything is read. No cluster."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import keras
from autodist.ir.errors import AutodistError
from autodist.runtime import python_data, validation
from autodist.runtime.held_batches import HeldBatches, HeldBatchesError
from autodist.runtime.python_data import PythonDataError


class Numbers(keras.utils.PyDataset):
    """Batches of 4 rows of 0..4n-1 (a row i: x = i, y = i). Logs every batch read."""

    def __init__(self, n: int = 5, **kwargs) -> None:
        super().__init__(**kwargs)
        self.n, self.log = n, []
        self.rows = np.arange(4 * n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        self.log.append(i)
        rows = self.rows[4 * i:4 * i + 4]
        return rows[:, None].astype("float32"), rows.astype("float32")


class Reordered(Numbers):
    """`on_epoch_end` reorders the rows (NumPy's global generator), as Keras' data-loading
    examples do; logged."""

    def on_epoch_end(self) -> None:
        self.log.append("end")
        self.rows = np.random.permutation(4 * self.n)


class Endless(keras.utils.PyDataset):
    @property
    def num_batches(self):
        return None

    def __getitem__(self, i):
        return np.full((2, 1), i, "float32"), np.full((2,), i, "float32")


def _keras_reads(dataset, **fit_kwargs) -> list:
    """The calls Keras' own fit makes on `dataset` (seeded as the driver is below)."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(dataset, verbose=0, **fit_kwargs)
    return dataset.log


def _trained_rows(read) -> list[list[float]]:
    return [list(element[1].numpy()) for element in read.batches.to_dataset()]


@pytest.mark.parametrize("steps_per_epoch", [None, 3])
def test_a_py_dataset_is_read_with_keras_calls_in_keras_order(steps_per_epoch):
    """Peeks, the reset's on_epoch_end, each pass shuffled by Python's random as Keras
    shuffles it, epochs cut by steps_per_epoch within a pass (5 batches: 3, 2, 3)."""
    kind = Reordered if steps_per_epoch is None else Numbers   # see the refusals below
    keras_log = _keras_reads(kind(), epochs=3, steps_per_epoch=steps_per_epoch)
    dataset = kind()
    keras.utils.set_random_seed(3)
    keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])   # the same draws as above
    read = python_data.read_like_keras(dataset, epochs=3, steps_per_epoch=steps_per_epoch,
                                       shuffle=True)
    # Keras' prefetch may read on past the last step (untrained): the calls up to it agree.
    assert dataset.log == keras_log[:len(dataset.log)]
    assert read.epoch_lengths == ([5, 5, 5] if steps_per_epoch is None else [3, 2, 3])
    assert len(read.batches.steps) == sum(read.epoch_lengths)


def test_batches_given_again_are_held_once_and_read_back_in_order():
    dataset = Numbers()
    read = python_data.read_like_keras(dataset, epochs=3, steps_per_epoch=None, shuffle=True)
    assert read.batches.num_batches == 5 and len(read.batches.steps) == 15
    rows = _trained_rows(read)
    order = dataset.log[2:]   # after the peeks
    assert rows == [list(np.arange(4 * i, 4 * i + 4, dtype=float)) for i in order]


def test_a_generator_is_read_in_order_across_epochs_of_steps_per_epoch():
    def batches():
        i = 0
        while True:
            yield {"a": np.full((2, 1), i)}, np.full((2,), i, "float64")
            i += 1

    read = python_data.read_like_keras(batches(), epochs=3, steps_per_epoch=2, shuffle=True)
    assert read.epoch_lengths == [2, 2, 2]
    dataset = read.batches.to_dataset()
    x_spec, y_spec = dataset.element_spec
    assert list(x_spec) == ["a"] and y_spec.shape.as_list() == [2]
    assert [float(y[0]) for _, y in dataset] == [0, 1, 2, 3, 4, 5]


def test_batches_of_several_sizes_and_strings_go_through_the_dataset():
    def batches():
        yield np.array([["a"], ["bb"], ["c"]]), np.arange(3)
        yield np.array([["d"], ["e"]]), np.arange(2)

    read = python_data.read_like_keras(batches(), epochs=1, steps_per_epoch=None,
                                       shuffle=False)
    out = [(x.numpy(), y.numpy()) for x, y in read.batches.to_dataset()]
    assert [x.shape for x, _ in out] == [(3, 1), (2, 1)]
    assert out[0][0][1, 0] == b"bb" and list(out[1][1]) == [0, 1]


def test_what_would_not_train_as_keras_is_refused_naming_what_to_do():
    def finite(n):
        for _ in range(n):
            yield np.ones((2, 1)), np.ones((2,))

    with pytest.raises(PythonDataError, match="epochs=2 and no steps_per_epoch"):
        python_data.read_like_keras(finite(3), epochs=2, steps_per_epoch=None, shuffle=True)
    with pytest.raises(PythonDataError, match="ran out after 5 batches.*at most 5"):
        python_data.read_like_keras(finite(5), epochs=3, steps_per_epoch=2, shuffle=True)
    with pytest.raises(PythonDataError, match="class_weight cannot be used with a Python "
                                              "generator"):
        python_data.check_arguments(finite(3), epochs=1, steps_per_epoch=None,
                                    class_weight={0: 1.0})
    with pytest.raises(PythonDataError, match="endless.*give steps_per_epoch"):
        python_data.read_like_keras(Endless(), epochs=1, steps_per_epoch=None, shuffle=True)
    with pytest.raises(PythonDataError, match="defines on_epoch_end.*at least 5"):
        python_data.read_like_keras(Reordered(), epochs=2, steps_per_epoch=3, shuffle=True)
    with pytest.raises(PythonDataError, match="workers=2"):
        python_data.read_like_keras(Numbers(workers=2), epochs=2,
                                    steps_per_epoch=3, shuffle=True)
    with pytest.raises(PythonDataError, match="length 0"):
        python_data.read_like_keras(Numbers(n=0), epochs=1, steps_per_epoch=None,
                                    shuffle=True)
    with pytest.raises(AutodistError, match="generator is not supported"):
        validation.unpack(finite(2))


def test_an_endless_py_dataset_with_steps_per_epoch_reads_on_across_epochs():
    read = python_data.read_like_keras(Endless(), epochs=2, steps_per_epoch=3, shuffle=True)
    assert read.epoch_lengths == [3, 3]
    assert [float(y[0]) for y in (e[1].numpy() for e in read.batches.to_dataset())] == \
        [0, 1, 2, 3, 4, 5]


def test_batches_keras_would_refuse_are_refused():
    first = [(np.ones((2, 3)), np.ones((2,)))] * 2
    held = HeldBatches("the generator", first)
    with pytest.raises(HeldBatchesError, match=r"shape \[2, 4\] where Keras' fit expects "
                                               r"\(None, 3\)"):
        held.add((np.ones((2, 4)), np.ones((2,))))
    with pytest.raises(HeldBatchesError, match="structured as"):
        held.add((np.ones((2, 3)), np.ones((2,)), np.ones((2,))))
    with pytest.raises(HeldBatchesError, match="same number"):
        held.add((np.ones((2, 3)), np.ones((3,))))
    with pytest.raises(HeldBatchesError, match="rank 0"):
        HeldBatches("the generator", [(np.ones((2, 3)), np.float32(1))])
    with pytest.raises(HeldBatchesError, match="must be a tuple"):
        HeldBatches("the PyDataset", ["text"])


def test_the_bytes_held_are_bounded():
    held = HeldBatches("the generator", [(np.ones((4, 8)), np.ones((4,)))], limit_bytes=1000,
                       count_every_read=True)
    with pytest.raises(HeldBatchesError, match="without the generator ending.*steps_per_epoch"):
        for _ in range(10):   # the same batch again: held once, but every read counts
            held.add((np.ones((4, 8)), np.ones((4,))))
    distinct = HeldBatches("the PyDataset", [(np.ones((4, 8)), np.ones((4,)))],
                           limit_bytes=1000)
    for _ in range(10):
        distinct.add((np.ones((4, 8)), np.ones((4,))))
    assert distinct.num_batches == 1
    with pytest.raises(HeldBatchesError, match="MiB of distinct batches held"):
        for i in range(10):
            distinct.add((np.full((4, 8), i), np.ones((4,))))
