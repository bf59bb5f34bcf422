"""Benchmark: autodist's runtime against the baselines a user would pick, side by side.

Run inside a private network namespace (TF servers bind every interface):

    unshare -n bash -c 'ip link set lo up && python benchmarks/runtime_vs_baselines.py'

Per model (the registry's `mlp`, SGD, and `transformer`, Adam; default sizes,
global batch 64, synthetic data), in each of `--rounds` rounds, in alternating order:

  * plain single-process Keras `fit`                  vs autodist, 1 worker (AllReduce)
  * MultiWorkerMirroredStrategy, custom loop, 2 processes
    (`autodist.bench.mwms`: its timed loop runs the step and nothing else)
                                                      vs autodist, 2 workers (AllReduce)

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


def autodist_step_time(name: str, workers: int, steps: int, batch: int) -> float:
    import autodist
    from autodist import models

    model = models.build(name, seed=0)
    x, y = models.synthetic_data(model, steps * batch)
    spec = autodist.ResourceSpec.local(workers=workers)
    graph_item = autodist.capture(model)
    strategy = autodist.builders.AllReduce().build(graph_item, spec)
    history = autodist.distribute(model, strategy, spec, graph_item=graph_item).fit(
        x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    return float(np.median(history.step_times[len(history.step_times) // 5:]))


def mwms_step_time(name: str, steps: int, batch: int) -> float:
    from autodist.bench.mwms import measure_mwms

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    times = measure_mwms(name, {}, ports, steps=steps - steps // 5, warmup=steps // 5,
                         batch_size=batch, timeout_s=600.0)
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
    args = parser.parse_args()
    names = args.models.split(",")
    measures = {
        "keras": lambda n: keras_step_time(n, args.steps, args.batch),
        "autodist_1": lambda n: autodist_step_time(n, 1, args.steps, args.batch),
        "mwms": lambda n: mwms_step_time(n, args.steps, args.batch),
        "autodist_2": lambda n: autodist_step_time(n, 2, args.steps, args.batch),
    }
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
        for base, ours, label in (("keras", "autodist_1", "1 worker vs plain Keras fit"),
                                  ("mwms", "autodist_2",
                                   "2 workers AllReduce vs MultiWorkerMirroredStrategy")):
            ratios = [b / o for b, o in zip(got[(name, base)], got[(name, ours)])]
            print(f"| {name} | {label} | {_spread(got[(name, base)], 1e3)} | "
                  f"{_spread(got[(name, ours)], 1e3)} | {_spread(ratios)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
