"""One worker of the MultiWorkerMirroredStrategy baseline (custom training loop).

Started by runtime_vs_baselines.py with TF_CONFIG set; prints the median step
time of steps after warm-up as JSON on its last line.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np


def main() -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    import keras

    steps, warmup, batch = (int(a) for a in sys.argv[1:4])
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * 4, 784)).astype("float32")
    y = rng.integers(0, 10, batch * 4).astype("int32")
    per_replica = batch // strategy.num_replicas_in_sync
    with strategy.scope():
        model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(10)])
        optimizer = keras.optimizers.SGD(0.01)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="sum_over_batch_size")

    @tf.function
    def step(xb, yb):
        def replica_step(xr, yr):
            with tf.GradientTape() as tape:
                loss = loss_fn(yr, model(xr, training=True)) / strategy.num_replicas_in_sync
            grads = tape.gradient(loss, model.trainable_variables)
            # The Keras 3 optimizer all-reduces (sums) the gradients itself in a replica
            # context; an all_reduce here as well would send every gradient twice.
            optimizer.apply(grads, model.trainable_variables)
            return loss
        return strategy.run(replica_step, args=(xb, yb))

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    xs = x[task * per_replica:(task + 1) * per_replica]
    ys = y[task * per_replica:(task + 1) * per_replica]
    times = []
    for i in range(steps):
        start = time.perf_counter()
        step(tf.constant(xs), tf.constant(ys))
        times.append(time.perf_counter() - start)
    print(json.dumps({"median_step_s": float(np.median(times[warmup:]))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
