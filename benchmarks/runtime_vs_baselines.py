"""Benchmark: autodist's runtime against the baselines a user would pick, side by side.

Run inside a private network namespace (TF servers bind every interface):

    unshare -n bash -c 'ip link set lo up && python benchmarks/runtime_vs_baselines.py'

Per model (the registry's `mlp`, SGD, and `transformer`, Adam; default sizes,
global batch 64, synthetic data), in each of `--rounds` rounds, in alternating order:

  * plain single-process Keras `fit`                  vs autodist, 1 worker (AllReduce)
  * MultiWorkerMirroredStrategy, custom loop, 2 processes
    (`autodist.bench.mwms`: its timed loop runs the step and nothing else)
                                                      vs autodist, 2 workers (AllReduce)
  * the same MWMS with the threads per process autodist gives two tasks
    sharing a host (`autodist.launch.server.intra_op_threads`): the
    runtimes compared alone                           vs autodist, 2 workers
  * with `--compare-threads`: autodist, 2 workers, each with TensorFlow's
    default threads (TF_NUM_INTRAOP_THREADS = every core: the runtime before
    tasks sharing a host split its cores)             vs autodist, 2 workers
  * with `--bound-mbit M` (as root: `tc` caps the tasks' ports on `lo`):
    autodist, 2 workers, each task's link capped at M Mbit/s, against its
    lower bound: one replica's forward and backward passes measured on the
    cluster (`cluster_calibration.measure_compute`, every replica at once)
    plus the ring all-reduce's bytes per task (2 (n-1)/n of the gradients)
    at M Mbit/s, nothing overlapped and no latency

Each measurement is the median step time of one launch after its warm-up
(the first 20% of steps). A round's ratio is baseline / autodist (> 1:
autodist is faster); the table gives the median over rounds and the min-max
of the per-round ratios. On a 2-core machine two worker processes share the
cores: the 2-worker numbers measure overheads, not scaling.
"""
from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import time

import numpy as np


def keras_step_time(name: str, steps: int, batch: int) -> float:
    import keras
    from autodist import models

    model = models.build(name, seed=0)
    x, y = models.synthetic_data(model, steps * batch)
    times = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch_index, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch_index, logs=None):
            times.append(time.perf_counter() - self.start)

    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[Timer()])
    return float(np.median(times[len(times) // 5:]))


def autodist_step_time(name: str, workers: int, steps: int, batch: int, spec=None) -> float:
    """Median step time of `workers` local workers (or of `spec`'s cluster), AllReduce."""
    import autodist
    from autodist import models

    model = models.build(name, seed=0)
    x, y = models.synthetic_data(model, steps * batch)
    spec = spec or autodist.ResourceSpec.local(workers=workers)
    graph_item = autodist.capture(model)
    strategy = autodist.builders.AllReduce().build(graph_item, spec)
    history = autodist.distribute(model, strategy, spec, graph_item=graph_item).fit(
        x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    return float(np.median(history.step_times[len(history.step_times) // 5:]))


def autodist_default_threads_step_time(name: str, steps: int, batch: int) -> float:
    """2 workers whose ops each take every core (the workers inherit the variable)."""
    os.environ["TF_NUM_INTRAOP_THREADS"] = str(os.cpu_count() or 1)
    try:
        return autodist_step_time(name, 2, steps, batch)
    finally:
        del os.environ["TF_NUM_INTRAOP_THREADS"]


def capped_step_and_bound(name: str, steps: int, batch: int, mbit: float) -> tuple[float, float]:
    """2 workers with links capped at `mbit`: (median step time, lower bound), seconds."""
    import autodist
    from autodist import models
    from autodist.bench import capped_links
    from autodist.runtime.cluster_calibration import measure_compute

    model = models.build(name, seed=0)
    compute = measure_compute(model, autodist.ResourceSpec.local(workers=2), batch_size=batch)
    gradient_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    bound = compute.seconds + 2 * (2 - 1) / 2 * gradient_bytes * 8 / (mbit * 1e6)
    spec, _ = capped_links.capped_spec(2, 0, mbit)
    try:
        return autodist_step_time(name, 2, steps, batch, spec=spec), bound
    finally:
        capped_links.clear_lo()


def mwms_step_time(name: str, steps: int, batch: int, same_threads: bool = False) -> float:
    from autodist.bench.mwms import measure_mwms
    from autodist.launch.server import intra_op_threads

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    threads = intra_op_threads({"worker": [f"localhost:{p}" for p in ports]}, "worker", 0) \
        if same_threads else None
    times = measure_mwms(name, {}, ports, steps=steps - steps // 5, warmup=steps // 5,
                         batch_size=batch, timeout_s=600.0, intra_op_threads=threads)
    return float(np.median(times))


def _spread(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    return (f"{statistics.median(values) * scale:.{digits}f} "
            f"({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f})")


def main() -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compare-threads", action="store_true",
                        help="also autodist's 2 workers with TensorFlow's default threads")
    parser.add_argument("--bound-mbit", type=float, default=None,
                        help="also autodist's 2 workers capped at this many Mbit/s per task "
                             "against their lower bound (root, private network namespace)")
    args = parser.parse_args()
    names = args.models.split(",")
    measures = {
        "keras": lambda n: keras_step_time(n, args.steps, args.batch),
        "autodist_1": lambda n: autodist_step_time(n, 1, args.steps, args.batch),
        "mwms": lambda n: mwms_step_time(n, args.steps, args.batch),
        "mwms_threads": lambda n: mwms_step_time(n, args.steps, args.batch, same_threads=True),
        "autodist_2": lambda n: autodist_step_time(n, 2, args.steps, args.batch),
    }
    rows = [("keras", "autodist_1", "1 worker vs plain Keras fit"),
            ("mwms", "autodist_2", "2 workers AllReduce vs MultiWorkerMirroredStrategy"),
            ("mwms_threads", "autodist_2", "2 workers AllReduce vs MWMS with autodist's "
                                           "threads per task")]
    if args.compare_threads:
        measures["autodist_2_tf_threads"] = \
            lambda n: autodist_default_threads_step_time(n, args.steps, args.batch)
        rows.append(("autodist_2_tf_threads", "autodist_2",
                     "2 workers: TensorFlow's default threads per task vs autodist's"))
    bounds: dict[str, list[float]] = {}
    if args.bound_mbit:
        def capped(n: str) -> float:
            step, bound = capped_step_and_bound(n, args.steps, args.batch, args.bound_mbit)
            bounds.setdefault(n, []).append(bound)
            return step
        measures["autodist_2_capped"] = capped
    got: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        order = list(measures) if r % 2 == 0 else list(reversed(measures))
        for name in names:
            for key in order:
                got.setdefault((name, key), []).append(measures[key](name))
                print(f"round {r + 1} {name} {key}: {got[(name, key)][-1] * 1e3:.2f} ms",
                      file=sys.stderr, flush=True)
    print(f"command: python {' '.join(sys.argv)} (in a private network namespace)")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; global batch "
          f"{args.batch}, {args.steps} steps per launch, median after the first 20%; "
          f"{args.rounds} rounds in alternating order: median (min-max)\n")
    print("| model | comparison | baseline ms/step | autodist ms/step | "
          "baseline / autodist |")
    print("|---|---|---:|---:|---:|")
    for name in names:
        for base, ours, label in rows:
            ratios = [b / o for b, o in zip(got[(name, base)], got[(name, ours)])]
            print(f"| {name} | {label} | {_spread(got[(name, base)], 1e3)} | "
                  f"{_spread(got[(name, ours)], 1e3)} | {_spread(ratios)} |")
    if bounds:
        print(f"\n2 workers, each task's link capped at {args.bound_mbit:g} Mbit/s, against the "
              "lower bound (one replica's passes measured on the cluster + the ring's bytes "
              "per task at the cap)\n")
        print("| model | lower bound ms | autodist ms/step | autodist / lower bound |")
        print("|---|---:|---:|---:|")
        for name in names:
            steps_ = got[(name, "autodist_2_capped")]
            print(f"| {name} | {_spread(bounds[name], 1e3)} | {_spread(steps_, 1e3)} | "
                  f"{_spread([t / b for t, b in zip(steps_, bounds[name])])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
