"""Keras' `compile(steps_per_execution=k)`: the steps and batch hooks `fit` shows for k > 1.

Keras 3's `fit` (TensorFlow backend) runs k batches per call of its train
function. Each step is the one it runs for k = 1, so the numbers do not
depend on k (but for data of unknown length: with k = 1 the step that finds
the data's end still advances the seeds and counts an iteration, with k > 1
no step runs there, `autodist.runtime.run_outs`); what the user sees does:

* `on_train_batch_begin(s)` is called at the first batch of each group of k
  (s = 0, k, 2k, ...) and `on_train_batch_end(s + k - 1, logs)` after the
  group, with the logs after its last batch, also where the epoch's last
  group is short (5 batches with k = 2 end with index 5).
* A `steps_per_epoch` that k does not divide runs whole groups: an epoch is
  ceil(steps_per_epoch / k) * k steps, as far as the data goes (Keras'
  `EpochIterator` counts the steps of a pass in groups; fit with k runs the
  same steps as with k = 1 and those steps per epoch, for arrays and datasets
  of known or infinite length).
* The validation pass is Keras' own `evaluate` on the model (compiled with k).

How fast the workers run is not changed: they run one step per session call.
"""
from __future__ import annotations

import math
from typing import Any

from autodist.ir.errors import AutodistError


def of(model: Any) -> int:
    """The model's `steps_per_execution` (1 for anything that is not a compiled Keras model).

    Raises:
        AutodistError: a value Keras would not run (not an integer >= 1).
    """
    k = getattr(model, "steps_per_execution", 1)
    if k is None:
        return 1
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise AutodistError(f"the model's steps_per_execution must be an integer >= 1 "
                            f"(compile(steps_per_execution=...)). Received: {k!r}")
    return k


def steps_run(steps_per_epoch: int | None, k: int) -> int | None:
    """The steps per epoch Keras' `fit` runs with `steps_per_epoch` and k steps a call:
    whole groups of k (None: every batch of the data, whatever k)."""
    if steps_per_epoch is None:
        return None
    return math.ceil(steps_per_epoch / k) * k


def batch_hooks(step: int, k: int, *, last: bool) -> tuple[int | None, int | None]:
    """The batch hooks Keras calls around step `step` of an epoch, with k steps a call.

    Args:
        step: The step's index in its epoch (0-based).
        k: Steps per execution.
        last: The step is the epoch's last.

    Returns:
        (the index `on_train_batch_begin` gets before the step, or None: not called;
        the index `on_train_batch_end` gets after it, or None).
    """
    first = step - step % k
    begin = first if step == first else None
    end = first + k - 1 if last or step % k == k - 1 else None
    return begin, end
