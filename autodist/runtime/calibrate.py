"""Calibrates the search's simulator with TensorFlow micro-benchmarks on this machine.

The search layer never runs graphs; the runtime measures, in this process
and in about a second: the matmul FLOP rate, the convolutions' FLOP rate (a
3x3 convolution's forward and both backward kernels at a small batch: on a
CPU 2-4x below a matmul's), the cost of one op on an activation-sized
tensor (32x16x32 floats: a layer's elementwise work, about 5x a scalar
op's), the rate of an optimizer update (bytes of variable per second, dense
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

    budget = seconds / 5
    graph = tf.Graph()
    with graph.as_default():
        # Inputs are variables so that nothing is constant-folded away.
        def variable(shape, seed):
            return tf.compat.v1.Variable(tf.random.stateless_normal(shape, seed=[seed, 0]),
                                         use_resource=True)
        a, b = variable([256, 256], 1), variable([256, 256], 2)
        matmul = tf.reduce_sum(tf.matmul(a.read_value(), b.read_value()))
        x = variable(_ACTIVATION_SHAPE, 3).read_value()
        chain = x
        for _ in range(_CHAIN_OPS // 2):
            # Bounded (no subnormals), and not a sum grappler folds into one op.
            chain = chain * 0.999 + x
        chain = tf.reduce_sum(chain)
        images = variable(_CONV_IMAGES, 6).read_value()
        kernel = variable(_CONV_KERNEL, 7).read_value()
        conv_out = tf.nn.conv2d(images, kernel, 1, "SAME")
        # Forward, input gradient and kernel gradient: what a training step runs.
        conv = [tf.reduce_sum(t) for t in [conv_out, *tf.gradients(conv_out, [images, kernel])]]
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
        conv_s = _best_time(lambda: session.run(conv), budget)
        update_s = _best_time(lambda: session.run(update), budget)
    flops_per_s = 2 * 256 ** 3 / max(flops_s - run_s, 1e-9)
    op_overhead_s = max(chain_s - run_s, 1e-9) / _CHAIN_OPS
    conv_flops = 3 * 2 * np.prod(_CONV_IMAGES) * np.prod(_CONV_KERNEL[:3])
    conv_flops_per_s = float(conv_flops / max(conv_s - run_s, 1e-9))
    memory = 4 * (1 << 20) / max(update_s - run_s, 1e-9)
    return Calibration(flops_per_s=flops_per_s, op_overhead_s=op_overhead_s,
                       memory_bytes_per_s=memory, run_overhead_s=run_s,
                       latency_s=Calibration().latency_s, conv_flops_per_s=conv_flops_per_s)


# The op-cost chain: ops on a tensor of a small layer's activations.
_CHAIN_OPS = 200
_ACTIVATION_SHAPE = [32, 16, 32]
# The convolution probe: a batch of 16x16x16 images, a 3x3 kernel of 16 -> 16 channels.
_CONV_IMAGES = [16, 16, 16, 16]
_CONV_KERNEL = [3, 3, 16, 16]


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
