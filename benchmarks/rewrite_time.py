"""Benchmark: time to rewrite a captured step into a worker's distributed program.

Usage: python benchmarks/rewrite_time.py [--model resnet50] [--builders AllReduce,PS,...]

For each builder: partitioner + replicator + synchronizer passes building one
worker's program of a 2-worker (+1 PS) cluster, no session. Target from the
runtime issue: <= 2 s for a ResNet50-size graph. The capture itself is timed
by capture_time.py.
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
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--builders", default="AllReduce,PS,PartitionedPS,Parallax")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    import autodist
    from autodist import models
    from autodist.runtime.worker import build_program

    model = models.build(args.model)
    graph_item = autodist.capture(model)
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    nodes = len(graph_item.graph_def().node)
    rows = []
    for name in args.builders.split(","):
        strategy = autodist.builders.get(name)().build(graph_item, spec)
        times = []
        for _ in range(max(1, args.repeats)):
            start = time.perf_counter()
            program = build_program(graph_item, strategy, spec, task_index=0, timeout_s=60)
            times.append(time.perf_counter() - start)
        rows.append((name, len(program.graph.get_operations()), min(times), times[0]))
        print(f"{name}: {min(times):.2f}s", file=sys.stderr)
    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; model {args.model}: "
          f"{graph_item.num_parameters:,} parameters, {len(graph_item.variables)} variables, "
          f"{nodes:,} captured nodes\n")
    print("| builder | program ops (worker 0) | rewrite s (best) | rewrite s (first) "
          "| target 2 s |")
    print("|---|---:|---:|---:|---|")
    for name, ops, best, first in rows:
        print(f"| {name} | {ops:,} | {best:.2f} | {first:.2f} | "
              f"{'met' if best <= 2.0 else 'missed'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
