"""Baseline: `tf.distribute.MultiWorkerMirroredStrategy` with a custom training loop.

`measure_mwms` starts one process per worker (`python -m autodist.bench.mwms
CONFIG_JSON` with `TF_CONFIG` set) on given ports; each builds the example
model inside the strategy's scope, trains on its share of the global batch
and worker 0 prints its step times as JSON. The loss is scaled by
1/replicas and the Keras optimizer all-reduces (sums) the gradients itself
(Keras 3 `_all_reduce_sum_gradients`): one all-reduce per step, the global
mean gradient, as a user of MWMS would write it. Its timed loop does nothing
else (no reduce of the loss, no host copy). `intra_op_threads` gives each
worker the thread count autodist gives a task sharing its host
(`autodist.launch.server.intra_op_threads`), for a comparison of the runtimes
alone; by default MWMS runs with TensorFlow's threads, as its users run it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Sequence

from autodist.ir.errors import AutodistError, InvalidArgumentError


def measure_mwms(model_name: str, model_kwargs: dict[str, Any], ports: Sequence[int], *,
                 steps: int, warmup: int, batch_size: int, timeout_s: float = 300.0,
                 seed: int = 0, intra_op_threads: int | None = None) -> list[float]:
    """Step times (seconds, after warm-up) of worker 0 of an MWMS custom loop.

    Args:
        model_name: An example model (`autodist.models.MODEL_FACTORIES`).
        model_kwargs: Its arguments.
        ports: One loopback port per worker (e.g. the capped worker ports).
        steps: Timed steps.
        warmup: Untimed steps first.
        batch_size: Global batch (split evenly across the workers).
        timeout_s: Bound on the whole run.
        seed: Seeds the model and the data.
        intra_op_threads: Threads for one op in each worker; None:
            TensorFlow's default (every core).

    Raises:
        RuntimeError: A worker failed or timed out (its stderr tail included).
        ValueError: The batch does not split across the workers.
    """
    if batch_size % len(ports):
        raise InvalidArgumentError(f"global batch {batch_size} does not split across {len(ports)} "
                                   f"MWMS workers")
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    config = json.dumps({"model": model_name, "kwargs": model_kwargs, "steps": steps,
                         "warmup": warmup, "batch_size": batch_size, "seed": seed,
                         "intra_op_threads": intra_op_threads})
    procs = []
    try:
        for index in range(len(ports)):
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG=json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": index}}))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "autodist.bench.mwms", config], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                stdin=subprocess.DEVNULL))
        outputs = [p.communicate(timeout=timeout_s) for p in procs]
    except subprocess.TimeoutExpired:
        raise AutodistError(f"MWMS baseline did not finish within {timeout_s:g}s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outputs):
        if p.returncode != 0:
            tail = " | ".join(err.strip().splitlines()[-3:])
            raise AutodistError(f"MWMS worker exited with {p.returncode}: {tail}")
    return [float(t) for t in json.loads(outputs[0][0].strip().splitlines()[-1])["step_times_s"]]


def _worker(config: dict[str, Any]) -> int:
    """One MWMS worker: trains and prints its timed step times as JSON."""
    import time

    import keras
    import tensorflow as tf

    from autodist import models

    if config.get("intra_op_threads"):
        tf.config.threading.set_intra_op_parallelism_threads(int(config["intra_op_threads"]))
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    replicas = strategy.num_replicas_in_sync
    batch = int(config["batch_size"])
    per_replica = batch // replicas
    with strategy.scope():
        model = models.build(config["model"], seed=int(config["seed"]), **config["kwargs"])
    loss_fn = model.loss if callable(model.loss) else keras.losses.get(model.loss)
    optimizer = model.optimizer
    x, y = models.synthetic_data(model, batch, seed=int(config["seed"]))
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    part = slice(task * per_replica, (task + 1) * per_replica)
    xs = [tf.constant(a[part]) for a in x] if isinstance(x, list) else tf.constant(x[part])
    ys = tf.constant(y[part])

    @tf.function
    def step(xb, yb):
        def replica_step(xr, yr):
            with tf.GradientTape() as tape:
                loss = loss_fn(yr, model(xr, training=True)) / replicas
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)   # all-reduces (sum) itself
            return loss
        return strategy.run(replica_step, args=(xb, yb))

    times = []
    for _ in range(int(config["warmup"]) + int(config["steps"])):
        start = time.perf_counter()
        # Eager calls are synchronous: the step's work is done when it returns. No
        # reduce of the loss across workers, no host copy: nothing a training loop
        # needs (an earlier version reduced the loss every step, a second collective).
        step(xs, ys)
        times.append(time.perf_counter() - start)
    print(json.dumps({"step_times_s": times[int(config["warmup"]):]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(json.loads(sys.argv[1])))
