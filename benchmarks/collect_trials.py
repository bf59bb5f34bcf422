"""Trial data set: measure strategies sampled from the search space, write Database records.

Run inside a private network namespace as root (it shapes `lo` with `tc`):

    unshare -n bash -c 'ip link set lo up && python benchmarks/collect_trials.py'

For every model and cluster shape (a workload) it takes the builders'
strategies and strategies sampled from the search space (seeded; half with
the knowledge prior, half uniform), drops duplicates (same candidate in the
space), and measures them on an emulated cluster (`emulated_cluster.py`:
local task processes, one htb cap per task on `lo`). Many strategies share
one cluster launch: `fit(..., switch_at={step: strategy})` switches the
running job in place, so trial k owns steps [k * (warmup + steps), (k + 1) *
(warmup + steps)) of the launch and its first `warmup` steps (the first
steps of a new program are slow) are not timed. If a launch fails, its
strategies are measured again in halves, down to one strategy per launch; a
strategy that still fails becomes a record with its `error`. With
`--repeats r` every group of strategies is launched r times (every other
launch in reverse order) and a record holds the timed steps of all r
launches: its median is the median over all of them, and `extra` keeps each
launch's median (`launch_medians_s`), so launch-to-launch noise is visible
next to step-to-step noise. Each record
holds the strategy, its features, the simulator's prediction and the command
line (`extra`). Extending the data set is running this again with another
`--seed` and `--append`; strategies the database already holds for a
workload and batch size are skipped.

Shapes are "<workers>x<ps>@<Mbit/s>", e.g. "2x1@100": 2 workers + 1 PS task,
every task's link capped at 100 Mbit/s. Models and their sizes come from the
example-model registry (`autodist.models.bench_kwargs`); the library parts
live in `autodist.bench.trials`.
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time

from emulated_cluster import capped_spec, clear_lo, in_private_netns

from autodist.bench.trials import (Shape, candidate_strategies, make_record,
                                   measure_repeated, measured_keys)
from autodist.models import BENCH_MODELS
from autodist.runtime.local_runner import chunks

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# The default data set's shapes and strategies per workload (a seed adds that many more).
DEFAULT_SHAPES = "2x1@100,2x2@1000,3x1@10000,4x2@1000,6x3@1000"
DEFAULT_DATABASE = "benchmarks/data/trials_runtime_2026_12_07.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(BENCH_MODELS),
                        help=f"comma-separated, from {sorted(BENCH_MODELS)}")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help="comma-separated '<workers>x<ps>@<Mbit/s>'")
    parser.add_argument("--strategies", type=int, default=12,
                        help="strategies per workload (builders included)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per strategy")
    parser.add_argument("--repeats", type=int, default=1,
                        help="separate launches per strategy; its record pools their timed steps")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps after each switch (>= 2)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--per-launch", type=int, default=12,
                        help="strategies measured in one cluster launch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--database", default=DEFAULT_DATABASE)
    parser.add_argument("--append", action="store_true",
                        help="add to an existing database (else it must not exist)")
    parser.add_argument("--timeout", type=float, default=1200.0,
                        help="bound on one launch, seconds")
    args = parser.parse_args()
    if not in_private_netns():
        print("run me inside `unshare -n` (see the docstring)", file=sys.stderr)
        return 2
    model_keys = args.models.split(",")
    unknown = [m for m in model_keys if m not in BENCH_MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {sorted(BENCH_MODELS)}")
    shapes = [Shape.parse(s) for s in args.shapes.split(",")]
    if args.warmup < 2:
        parser.error(f"--warmup must be >= 2 (a new program's first step is slow). "
                     f"Received: {args.warmup}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1. Received: {args.repeats}")
    if os.path.exists(args.database) and os.path.getsize(args.database) and not args.append:
        parser.error(f"{args.database} exists; pass --append to extend it")

    import autodist
    from autodist import models
    from autodist.runtime.local_runner import LocalRunner
    from autodist.search.database import Database
    from autodist.search.features import featurize_strategy
    from autodist.search.simulator import Simulator
    from autodist.search.space import SearchSpace

    database = Database(args.database)
    existing = database.records() if args.append else []
    command = "python benchmarks/collect_trials.py " + shlex.join(sys.argv[1:])
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    totals = {"ok": 0, "failed": 0}
    start_all = time.perf_counter()
    try:
        for model_key in model_keys:
            kwargs = models.bench_kwargs(model_key)
            model = models.build(model_key, **kwargs)
            graph_item = autodist.capture(model)
            for shape in shapes:
                spec, _ = capped_spec(shape.workers, shape.ps, shape.mbit)
                space = SearchSpace(graph_item, spec)
                simulator = Simulator(space, None, batch_size=args.batch_size)
                workload = f"{graph_item.fingerprint}:{spec.fingerprint}"
                skip = measured_keys(existing, workload, args.batch_size, space)
                todo = candidate_strategies(
                    graph_item, spec, space, args.strategies, seed=args.seed, skip=skip,
                    on_builder_error=lambda name, error: log(
                        f"   builder {name} cannot build here: {error.splitlines()[0][:160]}"))
                log(f"== {model_key} on {shape}: {len(todo)} strategies "
                    f"({len(skip)} already in the database)")
                runner = LocalRunner(model, spec, graph_item=graph_item,
                                     batch_size=args.batch_size, steps=args.steps,
                                     warmup_steps=args.warmup, per_launch=args.per_launch,
                                     data_seed=args.seed, timeout_s=args.timeout, log=log)
                for group in chunks(todo, args.per_launch):
                    started = time.perf_counter()
                    outcomes = measure_repeated(runner, [s for _, s, _ in group],
                                                args.repeats)
                    records = []
                    for (origin, strategy, _key), (outcome, launch_medians) in zip(group,
                                                                                   outcomes):
                        features = featurize_strategy(simulator, strategy)
                        predicted = float(simulator.predict_strategy(strategy).step_time_s[0])
                        extra = {"command": command, "shape": str(shape),
                                 "warmup_steps": args.warmup, "steps": args.steps,
                                 "repeats": args.repeats,
                                 "launch_medians_s": launch_medians,
                                 "seed": args.seed, "host": platform.node(),
                                 "cores": os.cpu_count(), "model_kwargs": kwargs,
                                 "builder": origin if origin != "sample" else None}
                        records.append(make_record(
                            graph_item, spec, strategy, outcome, model_key=model_key,
                            batch_size=args.batch_size, features=features,
                            predicted_s=predicted, extra=extra))
                    database.extend(records)
                    ok = sum(r.ok for r in records)
                    totals["ok"] += ok
                    totals["failed"] += len(records) - ok
                    medians = sorted(r.median_step_time_s * 1e3 for r in records if r.ok)
                    span = f"{medians[0]:.1f}-{medians[-1]:.1f} ms" if medians else "-"
                    log(f"   {len(records)} trials in {time.perf_counter() - started:.0f}s: "
                        f"{ok} ok ({span}), {len(records) - ok} failed; total "
                        f"{totals['ok']} ok, {totals['failed']} failed, "
                        f"{time.perf_counter() - start_all:.0f}s")
    finally:
        clear_lo()
    print(f"wrote {totals['ok']} ok and {totals['failed']} failed trials to {args.database}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
