"""Compressors of the all-reduce synchronizer, with a one-replica group.

With one replica the reduction is the identity, so what is measured is the
compression itself: fp16 error bounded by half an fp16 ulp, and the error
feedback residual persisting across steps (sum of what was sent equals the sum
of the gradients minus the final residual, exactly).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from autodist.kernels import all_reduce_synchronizer as ar
from autodist.kernels.program import Program, Replica
from autodist.proto import strategy_pb2

ARSync = strategy_pb2.AllReduceSynchronizer


def _reducer(compressor):
    graph = tf.Graph()
    with graph.as_default():
        program = Program(graph_item=None, resource_spec=None, task=("worker", 0), graph=graph)
        replica = Replica(index=0, device="/device:CPU:0")
        flat = tf.compat.v1.placeholder(tf.float32, [1000])
        sync = ARSync(compressor=compressor, group=0)
        out = ar._reduce(program, replica, flat, 0, tf.constant(1),
                         ar.CollectiveConfig(group_size=1, timeout_s=10), sync)
        residual = program.storage.get("autodist/error_feedback/group_0/replica_0")
        residual_value = residual.read_value() if residual is not None else None
        init = tf.compat.v1.global_variables_initializer()
    session = tf.compat.v1.Session(graph=graph)
    session.run(init)
    return session, flat, out, residual_value


def test_fp16_error_is_bounded():
    session, flat, out, _ = _reducer(ARSync.FP16)
    g = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    sent = session.run(out, {flat: g})
    # Round to nearest: at most half an ulp of float16 (2^-11 relative).
    assert np.all(np.abs(sent - g) <= np.abs(g) * 2.0 ** -11 + 1e-7)
    assert np.any(sent != g)


def test_error_feedback_residual_persists():
    session, flat, out, residual = _reducer(ARSync.FP16_ERROR_FEEDBACK)
    rng = np.random.default_rng(1)
    grads = [rng.normal(size=1000).astype(np.float32) * 1e-3 for _ in range(5)]
    sent = [session.run(out, {flat: g}) for g in grads]
    r1 = grads[0] - grads[0].astype(np.float16).astype(np.float32)
    final = session.run(residual)
    assert np.any(final != 0)
    # Step 1 keeps exactly the rounding error of the first gradient...
    session2, flat2, out2, residual2 = _reducer(ARSync.FP16_ERROR_FEEDBACK)
    session2.run(out2, {flat2: grads[0]})
    first = session2.run(residual2)
    np.testing.assert_allclose(first, r1, atol=1e-9)
    # ...and nothing is lost over steps: sent + residual == sum of gradients.
    np.testing.assert_allclose(np.sum(sent, axis=0) + final, np.sum(grads, axis=0),
                               rtol=0, atol=1e-6)
