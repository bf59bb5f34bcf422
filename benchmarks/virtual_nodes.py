"""Benchmark: virtual nodes — their overhead, and balancing unequal devices.

Run inside a private network namespace (TF servers bind every interface):

    unshare -n bash -c 'ip link set lo up && python benchmarks/virtual_nodes.py'

Side by side in one run, median step time after warm-up (AllReduce builder,
synthetic data, SGD):
  * overhead: 1 worker, global batch B in one batch vs the same B as V
    virtual nodes (B/V each, run one after the other). Target from the
    virtual-nodes issue: <= 10% slower. Smaller batches use the CPU less
    well, so the overhead grows with V.
  * unequal devices: 2 workers, worker 1 slowed to a fraction of its speed
    (SIGSTOP/SIGCONT duty cycle, benchmarks/slowdown.py); V virtual nodes
    mapped evenly vs by `balance` from `Run.measure_throughput`. Ratio =
    even / balanced (> 1: balancing is faster).
On 2 cores, the two workers share the cores, so "worker 1 at 40%" also
frees CPU for worker 0; the ratio is what this machine shows.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from contextlib import nullcontext

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# Unequal devices: one core per worker, so slowing one does not speed up the other.
PIN = {0: {0}, 1: {1}}
sys.path.insert(0, HERE)


def _model_and_data(name: str, examples: int):
    from autodist import models

    if name == "mlp":
        model = models.mlp(input_dim=256, hidden=(512, 512), optimizer="sgd")
    else:
        model = models.cnn(optimizer="sgd")
    x, y = models.synthetic_data(model, examples)
    return model, x, y


def _step_time(model, strategy, spec, graph_item, x, y, job_dir: str, batch: int,
               slow_fraction: float = 1.0) -> float:
    import autodist
    from slowdown import Slowdown

    run = autodist.distribute(model, strategy, spec, graph_item=graph_item, job_dir=job_dir)
    with Slowdown(job_dir, 1, slow_fraction, pin=PIN) if slow_fraction < 1 else nullcontext():
        history = run.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    times = history.step_times
    return float(np.median(times[len(times) // 4:]))


def overhead(model_name: str, batch: int, nodes: list[int], steps: int, work: str) -> list:
    import autodist

    model, x, y = _model_and_data(model_name, batch * steps)
    graph_item = autodist.capture(model)
    spec = autodist.ResourceSpec.local(workers=1)
    plain = autodist.builders.AllReduce().build(graph_item, spec)
    base = _step_time(model, plain, spec, graph_item, x, y, f"{work}/plain_{model_name}", batch)
    rows = []
    for v in nodes:
        t = _step_time(model, plain.with_virtual_nodes(batch, v), spec, graph_item, x, y,
                       f"{work}/vn{v}_{model_name}", batch)
        rows.append({"model": model_name, "batch": batch, "virtual_nodes": v,
                     "plain_ms": base * 1e3, "virtual_ms": t * 1e3, "overhead": t / base - 1})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def unequal(batch: int, nodes: int, fraction: float, steps: int, work: str,
            repeats: int = 3) -> dict:
    import autodist
    from slowdown import Slowdown
    from autodist.search.virtual_nodes import balance

    model, x, y = _model_and_data("mlp", batch * steps)
    graph_item = autodist.capture(model)
    spec = autodist.ResourceSpec.local(workers=2)
    even = autodist.builders.AllReduce().build(graph_item, spec).with_virtual_nodes(batch, nodes)
    probe_dir = f"{work}/probe"
    run = autodist.distribute(model, even, spec, graph_item=graph_item, job_dir=probe_dir)
    with Slowdown(probe_dir, 1, fraction, pin=PIN):
        speeds = run.measure_throughput(x, y, steps=5)
    balanced = balance(even, speeds)
    # Alternating pairs, medians: the duty cycle and the driver's own threads add noise.
    evens, bals = [], []
    for k in range(repeats):
        evens.append(_step_time(model, even, spec, graph_item, x, y, f"{work}/even{k}", batch,
                                fraction))
        bals.append(_step_time(model, balanced, spec, graph_item, x, y, f"{work}/balanced{k}",
                               batch, fraction))
    t_even, t_bal = float(np.median(evens)), float(np.median(bals))
    counts = [balanced.virtual_node_devices.count(r) for r in balanced.replicas]
    row = {"batch": batch, "virtual_nodes": nodes, "slow_fraction": fraction,
           "throughputs": {k.split("/")[2]: round(v, 1) for k, v in speeds.items()},
           "balanced_counts": counts, "even_ms": t_even * 1e3, "balanced_ms": t_bal * 1e3,
           "ratio": t_even / t_bal,
           "ratios": [round(e / b, 2) for e, b in zip(evens, bals)]}
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--nodes", default="2,4,8")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--slow-fraction", type=float, default=0.4)
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--out", default=None, help="write the markdown table here")
    parser.add_argument("--skip-unequal", action="store_true",
                        help="only the overhead tables")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="autodist-vn-bench-")
    nodes = [int(v) for v in args.nodes.split(",")]
    rows = []
    for name in args.models.split(","):
        rows += overhead(name, args.batch, nodes, args.steps, work)
    hetero = None if args.skip_unequal else unequal(args.batch, max(nodes), args.slow_fraction,
                                                    args.steps, work)
    lines = [f"machine: {platform.machine()}, {os.cpu_count()} cores; command: "
             f"`python benchmarks/virtual_nodes.py {' '.join(sys.argv[1:])}`".rstrip(), "",
             "| model | global batch | virtual nodes | one batch ms | virtual nodes ms | "
             "overhead | target <= 10% |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} | {r['virtual_nodes']} | "
                     f"{r['plain_ms']:.1f} | {r['virtual_ms']:.1f} | {r['overhead']:+.1%} | "
                     f"{'met' if r['overhead'] <= 0.10 else 'missed'} |")
    if hetero is not None:
        lines += ["", "| slowed worker 1 | measured examples/s | balanced counts | even ms | "
                  "balanced ms | even / balanced (median) | each pair |",
                  "|---:|---|---|---:|---:|---:|---|",
                  f"| {hetero['slow_fraction']:.0%} | {hetero['throughputs']} | "
                  f"{hetero['balanced_counts']} | {hetero['even_ms']:.1f} | "
                  f"{hetero['balanced_ms']:.1f} | {hetero['ratio']:.2f}x | "
                  f"{hetero['ratios']} |"]
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
