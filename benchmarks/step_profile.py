"""Profile: one model's distributed step, on real worker processes, side by side.

Each worker task is its own process with its own TF server (as a launched
worker is); it builds its program with the worker's own `build_program`,
runs `--steps` steps on fixed batches (fed, as a worker feeds them) and
reports the median time of a step's session run, the collectives a step
runs, and, for task 0, when each collective starts and how long it takes
(RunOptions FULL_TRACE, median over 20 traced steps).

With several `--trees` (source checkouts, e.g. a `git worktree` of the
commit before a change), the rounds alternate between them, so a change is
compared with its baseline under the same load; the table gives the median
over rounds and the min-max.

    git worktree add /tmp/before HEAD~1
    unshare -n bash -c 'ip link set lo up && \\
        python benchmarks/step_profile.py --model ncf --trees /tmp/before,.'
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time

_COLLECTIVES = ("CollectiveReduceV2", "CollectiveGatherV2", "CollectiveReduce")


def _task(args: argparse.Namespace) -> int:
    """One worker task: build, initialize its variables, time, trace (task 0)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    import autodist
    from autodist import models
    from autodist.launch.server import intra_op_threads
    from autodist.runtime import worker

    ports = [int(p) for p in args.ports.split(",")]
    model = models.build(args.model, seed=0)
    x, y = models.synthetic_data(model, 50 * args.batch)
    item = autodist.capture(model)
    spec = autodist.ResourceSpec.local(workers=len(ports))
    strategy = getattr(autodist.builders, args.builder)().build(item, spec)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    threads = intra_op_threads(cluster, "worker", args.task)  # as a launched task has
    server = tf.distribute.Server(
        tf.train.ClusterSpec(cluster), job_name="worker", task_index=args.task,
        config=worker.server_config(threads=threads), start=True)
    program = worker.build_program(item, strategy, spec, args.task, 60.0)
    session = tf.compat.v1.Session(server.target, graph=program.graph,
                                   config=worker.session_config(strategy, args.task,
                                                                graph_item=item))
    # Every variable of this task's program lives on this task (all-reduce).
    variables = list(program.storage.values()) + [program.outputs.step]
    session.run(list({v.initializer for v in variables if f"task:{args.task}/" in v.device}))
    (replica,) = program.replicas
    inputs = x if isinstance(x, (list, tuple)) else [x]
    share = args.batch // len(ports)

    def feed(step: int) -> dict:
        rows = (np.arange(share) + step * args.batch + args.task * share) % len(y)
        values = {program.outputs.scales[replica.index]: 1.0 / len(ports)}
        for info, array in zip(item.model_inputs, inputs):
            values[replica.inputs[info.name]] = np.asarray(array[rows])
        values[replica.inputs[item.target_inputs[0].name]] = y[rows]
        return values

    fetches = {"loss": program.outputs.weighted_loss, "train": program.outputs.train_op}
    if program.metric_states:
        fetches["metrics"] = program.metric_states
    feeds = [feed(i) for i in range(50)]
    time.sleep(2.0)  # the peer's variables
    for i in range(20):
        session.run(fetches, feeds[i % 50])
    times = []
    for i in range(args.steps):
        start = time.perf_counter()
        session.run(fetches, feeds[i % 50])
        times.append(time.perf_counter() - start)
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    spans: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    traced = 20
    for i in range(traced):
        metadata = tf.compat.v1.RunMetadata()
        session.run(fetches, feeds[i % 50], options=options, run_metadata=metadata)
        nodes = [n for d in metadata.step_stats.dev_stats for n in d.node_stats]
        start = min(n.all_start_micros for n in nodes)
        for n in nodes:
            kind = n.timeline_label.split(" = ")[1].split("(")[0] \
                if " = " in n.timeline_label else ""
            if kind in _COLLECTIVES:
                spans[n.node_name].append(((n.all_start_micros - start) / 1e3,
                                           n.all_end_rel_micros / 1e3))
    print(json.dumps({
        "step_ms": float(np.median(times)) * 1e3,
        "collectives": sum(len(v) for v in spans.values()) / traced,
        "spans": {name: [statistics.median(a for a, _ in v), statistics.median(b for _, b in v)]
                  for name, v in spans.items()}}), flush=True)
    time.sleep(2.0)  # the peer's last traced step
    return 0


def _free_ports(count: int) -> list[int]:
    ports = []
    for _ in range(count):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    return ports


def _measure(tree: pathlib.Path, args: argparse.Namespace) -> dict:
    """One launch of every task with `tree`'s autodist; task 0's report."""
    ports = ",".join(map(str, _free_ports(args.workers)))
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, __file__, "--task-index", "{}", "--ports", ports,
               "--model", args.model, "--builder", args.builder, "--batch", str(args.batch),
               "--steps", str(args.steps)]
    processes = [subprocess.Popen([c.format(t) for c in command], env=env, cwd=tree,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                 for t in range(args.workers)]
    outputs = [p.communicate(timeout=args.timeout_s)[0] for p in processes]
    failed = [t for t, p in enumerate(processes) if p.returncode]
    if failed:
        raise SystemExit(f"tasks {failed} failed with {tree}")
    return json.loads(outputs[0].strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ncf")
    parser.add_argument("--builder", default="AllReduce")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--trees", default=".", help="comma-separated source checkouts")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--task-index", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ports", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.task_index is not None:
        args.task = args.task_index
        return _task(args)
    trees = [pathlib.Path(t).resolve() for t in args.trees.split(",")]
    results: dict[pathlib.Path, list[dict]] = {t: [] for t in trees}
    for round_index in range(args.rounds):
        order = trees if round_index % 2 == 0 else trees[::-1]
        for tree in order:
            results[tree].append(_measure(tree, args))
            print(f"round {round_index + 1} {tree}: {results[tree][-1]['step_ms']:.2f} ms, "
                  f"{results[tree][-1]['collectives']:.0f} collectives", flush=True)
    print(f"\ncommand: python benchmarks/step_profile.py {' '.join(sys.argv[1:])}")
    print(f"{args.model}, {args.builder}, {args.workers} workers, global batch {args.batch}, "
          f"{args.steps} steps per launch, {args.rounds} rounds in alternating order\n")
    print("| tree | step ms: median (min-max) | collectives per step | vs first |")
    print("|---|---:|---:|---:|")
    first = [r["step_ms"] for r in results[trees[0]]]
    for tree in trees:
        steps = [r["step_ms"] for r in results[tree]]
        ratios = [a / b for a, b in zip(first, steps)]
        print(f"| {tree} | {statistics.median(steps):.2f} ({min(steps):.2f}-{max(steps):.2f}) "
              f"| {results[tree][0]['collectives']:.0f} | {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}) |")
    for tree in trees:
        print(f"\n{tree}, task 0's collectives (start, duration in ms, median of a "
              "round's 20 traced steps, last round):")
        spans = results[tree][-1]["spans"]
        for name, (start, duration) in sorted(spans.items(), key=lambda kv: kv[1][0]):
            print(f"  {name[-60:]:<60} {start:6.2f} {duration:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
