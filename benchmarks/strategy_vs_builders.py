"""Benchmark: measured step time of `optimize`'s pick against every builder.

Run inside a private network namespace as root (it shapes `lo` with `tc`):

    unshare -n bash -c 'ip link set lo up && python benchmarks/strategy_vs_builders.py'

An emulated cluster (default 2 workers + 2 PS) runs as local processes with
fixed ports; an `htb` class per task, matched by the task's port (source or
destination), caps the traffic to and from each task's server at the given
bandwidth. The spec tells the search the same bandwidth. For each model and
bandwidth, side by side in one run: every builder, the search's pick
(simulator ranking, no measured trials) and the pick of `optimize(measure=
True, budget=4)` (half the trials on the builders predicted fastest, half on
the search's best) are measured with the same data —
median step time after warm-up, min and max — and the ratio of the best
builder's time to the pick's (> 1: the pick is faster). The 2-core machine
contends compute between the 4 task processes; the capped links make the
communication-bound settings, where strategies differ.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from emulated_cluster import capped_spec, clear_lo, in_private_netns

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODELS = {
    # Embedding-heavy: two large tables (sparse gradients) and a small MLP. With
    # SGD a step touches only the looked-up rows; with Adam (Keras semantics)
    # every row's moments decay each step, so dense updates of the tables dominate.
    "ncf-large": dict(name="ncf", num_users=200_000, num_items=100_000, dim=32,
                      optimizer="sgd"),
    "ncf-large-adam": dict(name="ncf", num_users=200_000, num_items=100_000, dim=32,
                           optimizer="adam"),
    "mlp": dict(name="mlp", hidden=(512, 512)),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="ncf-large")
    parser.add_argument("--mbits", default="100,1000")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--builders", default="all")
    parser.add_argument("--measure-budget", type=int, default=4,
                        help="trials of optimize(measure=True) (0: skip that row)")
    args = parser.parse_args()
    if not in_private_netns():
        print("run me inside `unshare -n` (see the docstring)", file=sys.stderr)
        return 2

    import numpy as np

    import autodist
    from autodist import models
    from autodist.runtime.local_runner import LocalRunner
    from autodist.search import builders

    names = list(builders.STRATEGY_BUILDERS) if args.builders == "all" else args.builders.split(",")
    table = []
    for model_key in args.models.split(","):
        kwargs = dict(MODELS[model_key])
        model = models.build(kwargs.pop("name"), **kwargs)
        gi = autodist.capture(model)
        for mbit in (float(m) for m in args.mbits.split(",")):
            spec, _ = capped_spec(args.workers, args.ps, mbit)
            start = time.perf_counter()
            plan = autodist.optimize(model, spec, graph_item=gi, batch_size=args.batch_size)
            search_s = time.perf_counter() - start
            # One launch per strategy (each measured from the same starting weights).
            runner = LocalRunner(model, spec, graph_item=gi, batch_size=args.batch_size,
                                 steps=args.steps, warmup_steps=args.warmup)
            candidates = {n: builders.get(n)().build(gi, spec) for n in names}
            candidates["optimize"] = plan.strategy
            if args.measure_budget:
                start = time.perf_counter()
                measured_plan = autodist.optimize(model, spec, graph_item=gi,
                                                  batch_size=args.batch_size, measure=True,
                                                  budget=args.measure_budget)
                search_s = (search_s, time.perf_counter() - start)
                candidates["optimize (measured)"] = measured_plan.strategy
                print(f"optimize (measured) picked {measured_plan.strategy.origin}",
                      file=sys.stderr)
            results = {}
            for label, strategy in candidates.items():
                (result,) = runner.run([strategy])
                if result.ok:
                    times = np.array(result.step_times_s)
                    results[label] = (float(np.median(times)), float(times.min()),
                                      float(times.max()))
                else:
                    results[label] = (float("nan"),) * 3
                    print(f"{label}: failed: {result.error}", file=sys.stderr)
                print(f"{model_key} {mbit:g} Mbit/s {label}: "
                      f"{results[label][0] * 1e3:.2f} ms", file=sys.stderr, flush=True)
            best_builder = min((k for k in results if not k.startswith("optimize")),
                               key=lambda k: results[k][0])
            table.append((model_key, mbit, results, best_builder, plan, search_s))
    clear_lo()

    print(f"# optimize's pick vs every builder (measured)\n\n{args.workers} workers + "
          f"{args.ps} PS as local processes, per-task htb cap on lo, global batch "
          f"{args.batch_size}, median of {args.steps} steps after {args.warmup} warm-up "
          f"(min–max), ms/step\n")
    for model_key, mbit, results, best_builder, plan, search_s in table:
        seconds = search_s if isinstance(search_s, tuple) else (search_s,)
        print(f"## {model_key} at {mbit:g} Mbit/s (search {seconds[0]:.2f}s"
              + (f", measured search {seconds[1]:.0f}s" if len(seconds) > 1 else "")
              + f"; predicted {plan.predicted_step_time_s * 1e3:.2f} ms)\n")
        print("| strategy | median | min–max | predicted |\n|---|---:|---:|---:|")
        for label, (median, low, high) in sorted(results.items(), key=lambda kv: kv[1][0]):
            predicted = (plan.predicted_step_time_s if label.startswith("optimize")
                         else plan.builder_step_times_s.get(label, float("nan")))
            print(f"| {label} | {median * 1e3:.2f} | {low * 1e3:.2f}–{high * 1e3:.2f} | "
                  f"{predicted * 1e3:.2f} |")
        ratios = "; ".join(f"best builder / {k} = {results[best_builder][0] / v[0]:.2f}x"
                           for k, v in results.items() if k.startswith("optimize"))
        print(f"\nbest builder {best_builder}; {ratios}\n")
    print(f"Command: `python {' '.join(sys.argv)}` (in `unshare -n`) on {platform.node()}, "
          f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
