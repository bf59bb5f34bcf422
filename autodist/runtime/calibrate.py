"""Calibrates the search's simulator with TensorFlow micro-benchmarks on this machine.

The search layer never runs graphs; the runtime measures, in this process
and in about a second: the matmul FLOP rate, the cost of one small op, the
rate of an optimizer update (bytes of variable per second, dense
``assign_sub``), and the cost of one session run. Latency between tasks
keeps the simulator's default (measuring it needs a cluster).
"""
from __future__ import annotations

import time

import numpy as np

from autodist.search.simulator import Calibration


def measure_calibration(seconds: float = 1.0) -> Calibration:
    """A Calibration measured with TensorFlow, in about `seconds`."""
    import tensorflow as tf

    budget = seconds / 4
    graph = tf.Graph()
    with graph.as_default():
        # Inputs are variables so that nothing is constant-folded away.
        def variable(shape, seed):
            return tf.compat.v1.Variable(tf.random.stateless_normal(shape, seed=[seed, 0]),
                                         use_resource=True)
        a, b = variable([256, 256], 1), variable([256, 256], 2)
        matmul = tf.reduce_sum(tf.matmul(a.read_value(), b.read_value()))
        x = variable([], 3).read_value()
        chain = x
        for _ in range(200):
            chain = chain * x
        var, grad = variable([1 << 20], 4), variable([1 << 20], 5)
        update = var.assign_sub(grad.read_value() * 0.1).op
        noop = tf.no_op()
        init = tf.compat.v1.global_variables_initializer()
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                      inter_op_parallelism_threads=1)
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        session.run(init)
        run_s = _best_time(lambda: session.run(noop), budget)
        flops_s = _best_time(lambda: session.run(matmul), budget)
        chain_s = _best_time(lambda: session.run(chain), budget)
        update_s = _best_time(lambda: session.run(update), budget)
    flops_per_s = 2 * 256 ** 3 / max(flops_s - run_s, 1e-9)
    op_overhead_s = max(chain_s - run_s, 1e-9) / 200
    memory = 4 * (1 << 20) / max(update_s - run_s, 1e-9)
    return Calibration(flops_per_s=flops_per_s, op_overhead_s=op_overhead_s,
                       memory_bytes_per_s=memory, run_overhead_s=run_s,
                       latency_s=Calibration().latency_s)


def _best_time(fn, budget_s: float, max_runs: int = 200) -> float:
    """The fastest of repeated runs (after one warm-up) within `budget_s`."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < max_runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.min(times))
