"""Residuals beyond one program: the rule that maps them onto a new set of replicas,
and the chief's wait for every replica's residuals of its last step. Cluster
runs are in tests/runtime/test_compressors.py."""
from __future__ import annotations

import numpy as np
import pytest

from autodist.ir.errors import AutodistError
from autodist.runtime import residuals


def test_checkpoint_keys():
    assert residuals.checkpoint_key("dense/kernel") == "dense/kernel/compressor/residual"
    assert residuals.checkpoint_key("emb", square=True) == "emb/compressor/residual_square"


def test_rows_follow_replicas_and_missing_replicas_go_to_replica_0():
    stacked = np.arange(12, dtype=np.float32).reshape(4, 3)  # 4 replicas' residuals
    # Same replicas: each keeps its own.
    for r in range(4):
        np.testing.assert_array_equal(residuals.replica_value(stacked, r, 4), stacked[r])
    # Two replicas: 2 and 3 are added to replica 0; replica 1 keeps its own.
    np.testing.assert_array_equal(residuals.replica_value(stacked, 0, 2),
                                  stacked[0] + stacked[2] + stacked[3])
    np.testing.assert_array_equal(residuals.replica_value(stacked, 1, 2), stacked[1])
    kept = residuals.replica_value(stacked, 0, 2) + residuals.replica_value(stacked, 1, 2)
    np.testing.assert_array_equal(kept, stacked.sum(axis=0))  # the sum is kept
    # More replicas than rows: the new ones start at zero.
    assert residuals.replica_value(stacked[:1], 1, 2) is None
    assert residuals.replica_value(None, 0, 2) is None
    # The input is not modified.
    np.testing.assert_array_equal(stacked, np.arange(12, dtype=np.float32).reshape(4, 3))


class _Steps:
    """A session whose replicas' residual step counts advance as scripted."""

    def __init__(self, answers):
        self.answers = list(answers)

    def run(self, fetches, options=None):
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def test_wait_until_every_replica_wrote_its_residuals():
    reads = residuals.ResidualReads(tensors={}, steps=["r0", "r1", "r2"], own=0)
    session = _Steps([[5, 4, 5], [5, 4, 5], [5, 5, 5]])
    residuals.wait_until_written(session, reads, timeout_s=10.0, options=None)
    assert session.answers == [[5, 5, 5]]
    with pytest.raises(residuals.ResidualError,
                       match=r"replicas \[1\] did not write their error-feedback residuals of "
                             r"update 7 within 0.01s \(theirs are of updates \[6\]\)"):
        residuals.wait_until_written(_Steps([[7, 6, 7]]), reads, timeout_s=0.01, options=None)
    assert issubclass(residuals.ResidualError, AutodistError)
