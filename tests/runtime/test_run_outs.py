"""Which steps Keras' run-out step follows, and how many it adds (no cluster; the cluster
tests are in `test_datasets.py` and `test_fit_python_data.py`)."""
from __future__ import annotations

import numpy as np

from autodist.runtime import checkpoint
from autodist.runtime.run_outs import _SEED_STATE, RunOuts


def test_no_epoch_running_out_is_nothing_to_do():
    assert RunOuts.of([False, False], lambda: [0, 3, 6]) is None
    assert RunOuts.of([], lambda: [0]) is None


def test_run_outs_before_and_after_each_step():
    """Epochs of 3, 2 and 3 steps; the first and last run out."""
    outs = RunOuts.of([True, False, True], lambda: [0, 3, 5, 8])
    assert [outs.before(i) for i in range(9)] == [0, 0, 0, 1, 1, 1, 1, 1, 2]
    assert [outs.ending_after(i) for i in range(8)] == [0, 0, 1, 0, 0, 0, 0, 1]


def test_every_copy_of_a_seed_generator_is_matched_by_name():
    """The capture suffixes a repeated variable path (`unique_names`)."""
    assert [bool(_SEED_STATE.fullmatch(n)) for n in (
        "seed_generator_state", "seed_generator_state_1", "seed_generator_stateful",
        "moving_mean")] == [True, True, False, False]


def test_saved_values_count_keras_iterations_with_their_run_outs():
    """Checkpoints keep the steps applied (recovery resumes from them) and the run-outs
    apart; a new run, or the Keras optimizer, counts both."""
    saved = {checkpoint.ITERATIONS: np.int64(9), checkpoint.RUN_OUTS: np.int64(3),
             "w": np.ones(2)}
    assert checkpoint.keras_iterations(saved) == 12
    continued = checkpoint.continued(saved)
    assert int(continued[checkpoint.ITERATIONS]) == 12 and checkpoint.RUN_OUTS not in continued
    assert int(saved[checkpoint.ITERATIONS]) == 9   # the loaded values are left as they are
    older = {checkpoint.ITERATIONS: np.int64(9)}    # written before run-outs were kept
    assert checkpoint.keras_iterations(older) == 9
    assert int(checkpoint.continued(older)[checkpoint.ITERATIONS]) == 9
