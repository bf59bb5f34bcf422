"""Benchmark: the autoscaler on a bandwidth-capped local cluster.

Run inside a private network namespace as root (it shapes `lo` with `tc`):

    unshare -n bash -c 'ip link set lo up && python benchmarks/autoscaler.py'

An emulated cluster of up to 4 workers (`emulated_cluster.py`: fixed ports,
an htb cap per task on `lo`) trains an MLP with all-reduce and a fixed global
batch split into virtual nodes, so every size trains the same numbers. Side
by side in one run:

1. The measured scaling curve: one run resized in place through every size
   and back (`resize_at`), median examples/s per size after warm-up. The efficient
   size is where the scaling-efficiency heuristic settles on this curve.
2. Trial and error: `builtin_policies.Autoscale` without a prediction, resizing the
   running job until the heuristic settles.
3. Guided: the same with the simulator's predicted curve for the capped
   bandwidth (`autoscaler.simulator_predictor`, calibrated on this machine
   and told that the workers share its cores).

It reports each mode's chosen size, its trials, and the step at which it
settled; `--plot autoscaler.png` also draws the measured curve (every timed
step as a dot, the median per size as a line), the predicted one and the
efficient size (`autodist.plotting.plot_scaling_curve`, needs matplotlib).
Each worker process is pinned to one core (round robin over the
machine's cores), so on the 2-core machine two workers have twice the compute
of one and more add none; the capped links add communication that grows
with the size.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

from emulated_cluster import capped_spec, clear_lo, in_private_netns
from slowdown import pin_workers

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mbit", type=float, default=1000.0)
    parser.add_argument("--max-workers", type=int, default=4)
    parser.add_argument("--theta", type=float, default=0.3)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--virtual-nodes", type=int, default=4)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hidden", default="1024,1024")
    parser.add_argument("--input-dim", type=int, default=64)
    parser.add_argument("--plot", metavar="PNG",
                        help="draw the measured scaling curve to this file (needs matplotlib)")
    args = parser.parse_args()
    if not in_private_netns():
        print("run me inside `unshare -n` (see the docstring)", file=sys.stderr)
        return 2

    import numpy as np

    import autodist
    if args.plot:  # checked now, not after minutes of measuring
        from autodist.plotting import require_matplotlib

        require_matplotlib()
    from autodist import models
    from autodist.adapt import autoscaler, builtin_policies
    from autodist.search import builders

    hidden = tuple(int(h) for h in args.hidden.split(","))
    model = models.mlp(input_dim=args.input_dim, hidden=hidden, optimizer="sgd")
    item = autodist.capture(model)
    spec, _ = capped_spec(args.max_workers, 0, args.mbit)
    strategy = builders.AllReduce().build(item, spec).with_virtual_nodes(
        args.batch_size, args.virtual_nodes)
    per_size = args.warmup + args.window
    steps = per_size * (args.max_workers + 2)  # enough for every trial and the settled size
    rng = np.random.default_rng(0)
    n = args.batch_size * steps
    x = rng.normal(size=(n, args.input_dim)).astype("float32")
    y = rng.integers(0, 10, n).astype("int32")
    weights = model.get_weights()

    cores = os.cpu_count() or 1
    pins = {t: {t % cores} for t in range(args.max_workers)}

    def distribute(job_dir: str):
        """A run whose worker processes get pinned to one core each (round robin)."""
        threading.Thread(target=pin_workers, args=(job_dir, pins), daemon=True).start()
        return autodist.distribute(model, strategy, spec, graph_item=item, job_dir=job_dir)

    work = tempfile.mkdtemp(prefix="autoscaler-bench-")

    def scaler():
        return autoscaler.Autoscaler(autoscaler.ScalingEfficiency(theta=args.theta), 1,
                                     args.max_workers)

    # 1. The measured curve, every size in one run: up and down again, so
    # each size below the largest is measured twice (median of both).
    order = list(range(1, args.max_workers + 1)) + list(range(args.max_workers - 1, 0, -1))
    run = distribute(os.path.join(work, "curve"))
    schedule = {k * per_size: size for k, size in enumerate(order)}
    rows = per_size * len(order) * args.batch_size
    history = run.fit(np.resize(x, (rows, args.input_dim)), np.resize(y, rows), epochs=1,
                      verbose=0, resize_at=schedule, shuffle=False)
    samples: dict[int, list[float]] = {}
    for k, size in enumerate(order):
        times = history.step_times[k * per_size + args.warmup:(k + 1) * per_size]
        samples.setdefault(size, []).extend(times)
    curve = {w: args.batch_size / statistics.median(samples[w]) for w in sorted(samples)}
    offline = scaler().run(lambda w: curve[w], start=1)
    print(f"curve: {', '.join(f'{w}: {t:.0f}/s' for w, t in curve.items())}; "
          f"efficient size {offline.workers}", file=sys.stderr, flush=True)

    # 2 and 3. Online, trial and error and guided.
    # The simulator calibrated on this machine (TensorFlow micro-benchmarks),
    # told that every worker shares this host's cores.
    from autodist.runtime.calibrate import measure_calibration

    predict = autoscaler.simulator_predictor(item, builders.AllReduce().build,
                                             global_batch=args.batch_size,
                                             bandwidth_gbps=args.mbit / 1000,
                                             calibration=measure_calibration(),
                                             host_cores=cores)
    online = {}
    for mode, prediction in (("trial-and-error", None), ("guided", predict)):
        model.set_weights(weights)
        run = distribute(os.path.join(work, mode))
        scale = builtin_policies.Autoscale(scaler(), prediction, window=args.window,
                                           warmup=args.warmup)
        start = time.perf_counter()
        history = run.fit(x, y, epochs=1, verbose=0, resize_at={0: 1}, policies=[scale],
                          shuffle=False)
        seconds = time.perf_counter() - start
        if scale.result is None:
            print(f"{mode}: did not settle ({scale.error})", file=sys.stderr)
            online[mode] = None
            continue
        settled = next((a.step for a in history.actions if a.action == "autoscaled"),
                       None)
        online[mode] = (scale.result, settled, seconds)
        print(f"{mode}: {scale.result.workers} workers after {scale.result.num_trials} trials",
              file=sys.stderr, flush=True)
    clear_lo()

    print(f"# Autoscaler on a capped local cluster\n\nMLP {args.input_dim}-"
          f"{'-'.join(map(str, hidden))}-10 (SGD), all-reduce, global batch "
          f"{args.batch_size} in {args.virtual_nodes} virtual nodes, 1..{args.max_workers} "
          f"workers, every task capped at {args.mbit:g} Mbit/s; scaling efficiency "
          f"θ = {args.theta}; each trial: median of {args.window} steps after "
          f"{args.warmup} warm-up.\n")
    print("| workers | measured examples/s | predicted examples/s |\n|---:|---:|---:|")
    for w, t in curve.items():
        print(f"| {w} | {t:.0f} | {predict(w):.0f} |")
    print(f"\nEfficient size on the measured curve: **{offline.workers}** "
          f"({offline.decision.reason}).\n")
    print("| mode | chosen | trials (size and measured examples/s, in order) "
          "| settled at step |\n|---|---:|---|---:|")
    for mode, outcome in online.items():
        if outcome is None:
            print(f"| {mode} | — | did not settle | — |")
            continue
        result, settled, _ = outcome
        sizes = ", ".join(f"{t.workers} ({t.throughput:.0f}/s)" for t in result.trials)
        print(f"| {mode} | {result.workers} | {result.num_trials} ({sizes}) | {settled} |")
    print(f"\nCommand: `python {' '.join(sys.argv)}` (in `unshare -n`) on {platform.node()}, "
          f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")
    if args.plot:
        from autodist.plotting import plot_scaling_curve

        # Every timed step's examples/s: the spread behind each size's median.
        per_step = {w: [args.batch_size / t for t in samples[w]] for w in sorted(samples)}
        plot_scaling_curve(per_step, predicted={w: predict(w) for w in curve},
                           chosen=offline.workers, path=args.plot,
                           title=f"MLP on 1..{args.max_workers} workers, {args.mbit:g} Mbit/s "
                                 f"per task (efficient size {offline.workers})")
        print(f"\nfigure written to {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
