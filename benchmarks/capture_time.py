"""Benchmark: time to capture example models, ResNet50 (~25M parameters) included.

Usage: python benchmarks/capture_time.py [--models resnet50,transformer,...] [--repeats 2]

Prints a markdown table (model, parameters, graph nodes, build seconds,
capture seconds: first and best repeat) and the command that produced it.
Capture includes tracing, GraphDef serialization and per-op estimates. The
first capture of a process also pays TensorFlow's one-time tracing warm-up.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time


def main() -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="mlp,cnn,ncf,transformer,resnet50")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from autodist import models
    from autodist.ir.capture import capture

    rows = []
    for name in args.models.split(","):
        t0 = time.perf_counter()
        model = models.build(name)
        build_s = time.perf_counter() - t0
        times = []
        for _ in range(max(1, args.repeats)):
            t0 = time.perf_counter()
            item = capture(model)
            times.append(time.perf_counter() - t0)
        nodes = len(item.graph_def().node)
        rows.append((name, item.num_parameters, len(item.variables), nodes, build_s,
                     times[0], min(times)))
        print(f"{name}: capture {times[0]:.2f}s first, {min(times):.2f}s best", file=sys.stderr)

    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}\n")
    print("| model | parameters | variables | graph nodes | build s | capture s (first) "
          "| capture s (best) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, params, nvars, nodes, build_s, first, best in rows:
        print(f"| {name} | {params:,} | {nvars} | {nodes:,} | {build_s:.2f} | {first:.2f} "
              f"| {best:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
