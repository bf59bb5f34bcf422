"""Does splitting a variable between parameter servers and all-reduce pay off?

    unshare -n bash -c 'ip link set lo up && python benchmarks/split_variables.py'

On an emulated capped cluster (default: `lm`, 4 workers + 2 PS, 100 Mbit/s
per task), measures side by side in the same launches: the AllReduce,
PartitionedPS and Parallax builders, the pick of a search ranked by a
simulator whose traffic all overlaps (`ps_overlap=1`: it splits the large
softmax kernel between the PS and all-reduce), and the pick of the default
(phased) simulator. Prints each strategy's predicted step time under both
simulators next to its measured median, and writes a markdown table. The
strategies are measured by the search's local runner (all in one launch,
switched in place, then again in reverse order; the timed steps pooled).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

import numpy as np

from emulated_cluster import capped_spec, clear_lo, in_private_netns

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="lm")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--mbit", type=float, default=100.0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/split_variables.md")
    args = parser.parse_args()
    if not in_private_netns():
        print("run inside a private network namespace as root (see the docstring)",
              file=sys.stderr)
        return 2

    from autodist import api, models
    from autodist.ir.capture import capture
    from autodist.runtime.local_runner import LocalRunner
    from autodist.search import builders
    from autodist.search.simulator import Calibration, Simulator
    from autodist.search.space import SearchSpace

    model = models.build_bench(args.model)
    gi = capture(model)
    spec, _ = capped_spec(args.workers, args.ps, args.mbit)
    overlapped, phased = Calibration(ps_overlap=1.0), Calibration()
    strategies = {b: builders.get(b)().build(gi, spec)
                  for b in ("AllReduce", "PartitionedPS", "Parallax")}
    for label, cal in (("search, overlapped simulator", overlapped),
                       ("search, phased simulator (default)", phased)):
        strategies[label] = api.optimize(model, spec, graph_item=gi, batch_size=args.batch_size,
                                         cost_model="simulator", calibration=cal).strategy
    predicted = {}
    for cal in (overlapped, phased):
        sim = Simulator(SearchSpace(gi, spec), cal, batch_size=args.batch_size)
        for name, s in strategies.items():
            predicted.setdefault(name, []).append(
                float(sim.predict_strategy(s).step_time_s[0]) * 1e3)
    # Two launches, the second in reverse order; the timed steps are pooled.
    runner = LocalRunner(model, spec, graph_item=gi, batch_size=args.batch_size,
                         steps=args.steps, warmup_steps=args.warmup, orders=2, timeout_s=900,
                         log=lambda line: print(line, file=sys.stderr, flush=True))
    try:
        results = dict(zip(strategies, runner.run(list(strategies.values()))))
    finally:
        clear_lo()
    failed = {name: r.error for name, r in results.items() if not r.ok}
    if failed:
        print(f"failed to measure: {failed}", file=sys.stderr)
        return 1
    timed = {name: list(r.step_times_s) for name, r in results.items()}
    command = "python benchmarks/split_variables.py " + shlex.join(sys.argv[1:])
    lines = [f"# Splitting variables between PS and all-reduce: {args.model}, "
             f"{args.workers} workers + {args.ps} PS at {args.mbit:g} Mbit/s",
             "", f"`{command.strip()}` on {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')};"
             f" global batch {args.batch_size}, {args.steps} timed steps per strategy after "
             f"{args.warmup} warm-up steps, in each of two launches (forward and reverse "
             "order), pooled.", "",
             "| strategy | split variables | predicted ms, overlapped | predicted ms, phased "
             "| measured ms (median, min–max) |", "|---|---|---:|---:|---:|"]
    for name, strategy in strategies.items():
        split = [c.var_name for c in strategy.variables
                 if {s.WhichOneof("kind") for s in c.shards} == {"ps", "all_reduce"}]
        t = np.array(timed[name]) * 1e3
        lines.append(f"| {name} | {', '.join(split) or '—'} | {predicted[name][0]:.1f} | "
                     f"{predicted[name][1]:.1f} | {np.median(t):.1f} ({t.min():.1f}–"
                     f"{t.max():.1f}) |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
