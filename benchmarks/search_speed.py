"""Benchmark: candidates scored per second, and `optimize` time on the example models.

Usage: python benchmarks/search_speed.py [--variables 200] [--candidates 20000]
       [--models mlp,cnn,ncf,transformer]

Part 1 scores random candidates of a synthetic 200-variable model (a tenth
embeddings) on a 4-worker, 2-PS spec with the simulator alone and with the
features for the cost model, on one thread (target >= 5,000/s). Part 2 runs
`autodist.optimize` (simulator ranking, no measurement) on the captured
example models and reports its time and its predicted step time against
the best builder's. Prints markdown tables and the command that made them.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

# The synthetic 200-variable workload is shared with the search tests.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def main() -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variables", type=int, default=200)
    parser.add_argument("--candidates", type=int, default=20000)
    parser.add_argument("--models", default="mlp,cnn,ncf,transformer")
    args = parser.parse_args()

    import numpy as np

    from autodist.ir.resource_spec import ResourceSpec
    from autodist.search.features import featurize
    from autodist.search.simulator import Simulator
    from autodist.search.space import SearchSpace
    from tests.search.workloads import many_variables

    spec = ResourceSpec.local(workers=4, ps=2, bandwidth_gbps=1)
    gi = many_variables(args.variables)
    space = SearchSpace(gi, spec)
    sim = Simulator(space)
    candidates = space.sample(args.candidates, np.random.default_rng(0))
    sim.predict(candidates[:10])  # compile the tables
    rows = []
    for label, fn in (("simulator", lambda c: sim.predict(c).step_time_s),
                      ("simulator + features", lambda c: featurize(sim, c))):
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            fn(candidates)
            best = min(best, time.perf_counter() - start)
        rows.append((label, args.candidates / best))
    print(f"## Scoring speed ({args.variables} variables, space 10^"
          f"{np.log10(float(space.size)):.0f}, one thread)\n")
    print("| scoring | candidates/s | target |\n|---|---:|---:|")
    for label, rate in rows:
        print(f"| {label} | {rate:,.0f} | 5,000 |")

    import autodist
    from autodist import models

    print("\n## optimize() on the example models (2 workers + 1 PS, simulator ranking)\n")
    print("| model | variables | optimize s | predicted ms/step | best builder | "
          "its ms/step | ratio |\n|---|---:|---:|---:|---|---:|---:|")
    for name in args.models.split(","):
        model = models.build(name)
        gi = autodist.capture(model)
        start = time.perf_counter()
        plan = autodist.optimize(model, ResourceSpec.local(workers=2, ps=1, bandwidth_gbps=1),
                                 graph_item=gi, cost_model="simulator")
        elapsed = time.perf_counter() - start
        builder, seconds = min(plan.builder_step_times_s.items(), key=lambda kv: kv[1])
        print(f"| {name} | {len(gi.variables)} | {elapsed:.2f} | "
              f"{plan.predicted_step_time_s * 1e3:.3f} | {builder} | {seconds * 1e3:.3f} | "
              f"{seconds / plan.predicted_step_time_s:.2f}x |")
    print(f"\nCommand: `python {' '.join(sys.argv)}` on {platform.node()} "
          f"({os.cpu_count()} cores), {time.strftime('%Y-%m-%d')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
