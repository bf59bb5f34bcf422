"""Benchmark: overhead of measuring the gradient noise scale inside the step.

Run inside a private network namespace (TF servers bind every interface):

    unshare -n bash -c 'ip link set lo up && python benchmarks/monitoring.py'

Side by side in one run: the same `fit` (AllReduce, 2 workers, global batch
512 as 8 virtual nodes, synthetic data) with and without
`monitor_every=1` (the squared gradient norms of every virtual node and
replica fetched with every step). Median step time after warm-up, three
alternating pairs, median ratio. Target from the policies issue: <= 5%.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile

import numpy as np


def step_time(model_name: str, monitor: bool, batch: int, steps: int, work: str) -> float:
    import autodist
    from autodist import models

    model = (models.mlp(input_dim=256, hidden=(512, 512), optimizer="sgd")
             if model_name == "mlp" else models.cnn(optimizer="sgd"))
    x, y = models.synthetic_data(model, batch * steps)
    spec = autodist.ResourceSpec.local(workers=2)
    strategy = autodist.builders.AllReduce().build(autodist.capture(model), spec)
    run = autodist.distribute(model, strategy.with_virtual_nodes(batch, 8), spec, job_dir=work)
    history = run.fit(x, y, epochs=1, shuffle=False, verbose=0,
                      monitor_every=1 if monitor else 0)
    if monitor:
        assert len(history.noise_scale) == steps
    times = history.step_times
    return float(np.median(times[len(times) // 4:]))


def main() -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None, help="write the markdown table here")
    args = parser.parse_args()
    lines = [f"machine: {platform.machine()}, {os.cpu_count()} cores; command: "
             f"`python benchmarks/monitoring.py {' '.join(sys.argv[1:])}`".rstrip(), "",
             "| model | without ms | with ms | overhead (median of 3 pairs) | each pair | "
             "target <= 5% |", "|---|---:|---:|---:|---|---|"]
    for name in args.models.split(","):
        plain, watched = [], []
        for _ in range(3):
            plain.append(step_time(name, False, args.batch, args.steps,
                                   tempfile.mkdtemp(prefix="autodist-mon-")))
            watched.append(step_time(name, True, args.batch, args.steps,
                                     tempfile.mkdtemp(prefix="autodist-mon-")))
        ratios = [w / p - 1 for p, w in zip(plain, watched)]
        overhead = float(np.median(ratios))
        lines.append(f"| {name} | {np.median(plain) * 1e3:.1f} | {np.median(watched) * 1e3:.1f}"
                     f" | {overhead:+.1%} | {[f'{r:+.1%}' for r in ratios]} | "
                     f"{'met' if overhead <= 0.05 else 'missed'} |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
