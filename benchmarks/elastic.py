"""Benchmark: resize latency, in place vs stop-checkpoint-restart.

Run inside a private network namespace (TF servers bind every interface):

    unshare -n bash -c 'ip link set lo up && python benchmarks/elastic.py'

MLP (256-512-512-10, SGD), AllReduce, global batch 256 as 4 virtual nodes,
2 epochs of 20 steps, a 4-worker local cluster (processes on this machine).
Side by side in one run:
  * in place: one `fit(..., resize_at={20: n})`; the latency is the chief's
    time from the end of step 19 to the start of step 20 (state hand-over,
    new program and session), `History.resizes`.
  * restart: `fit` epoch 1 on the old size with a checkpoint at its end,
    then a new `distribute` on the new size and `fit` epoch 2 from the
    checkpoint. Its latency is the extra time outside steps compared with
    the in-place run: (wall - step time) of both fits minus (wall - step
    time - resize) of the in-place run, i.e. the second launch, the
    checkpoint write and read, and the teardown.
Shrink 4 -> 2 and grow 2 -> 4 (the joiners' processes run from the start:
`fit` starts every worker of the spec). Target from the elastic issue: in
place >= 5x faster. Both runs also end with equal weights (checked).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

import numpy as np

STEPS, BATCH, NODES = 20, 256, 4


def _setup():
    import autodist
    from autodist import models

    model = models.mlp(input_dim=256, hidden=(512, 512), optimizer="sgd")
    x, y = models.synthetic_data(model, STEPS * BATCH)
    return autodist, model, x, y


def _strategy(autodist, model, workers: int):
    spec = autodist.ResourceSpec.local(workers=workers)
    strategy = autodist.builders.AllReduce().build(autodist.capture(model), spec)
    return strategy.with_virtual_nodes(BATCH, NODES), spec


def in_place(before: int, after: int, work: str):
    autodist, model, x, y = _setup()
    strategy, spec = _strategy(autodist, model, max(before, after))
    run = autodist.distribute(model, strategy, spec, job_dir=f"{work}/elastic")
    start = time.perf_counter()
    history = run.fit(x, y, epochs=2, shuffle=False, verbose=0,
                      resize_at={0: before, STEPS: after})
    wall = time.perf_counter() - start
    resize = history.resizes[0].seconds
    return wall - sum(history.step_times) - resize, resize, model.get_weights()


def restart(before: int, after: int, work: str):
    autodist, model, x, y = _setup()
    outside = 0.0
    checkpoint = f"{work}/ckpt"
    for phase, workers in enumerate((before, after)):
        strategy, spec = _strategy(autodist, model, workers)
        run = autodist.distribute(model, strategy, spec, job_dir=f"{work}/restart{phase}")
        start = time.perf_counter()
        history = run.fit(x, y, epochs=1, shuffle=False, verbose=0,
                          checkpoint_dir=checkpoint if phase == 0 else None,
                          initial_checkpoint=checkpoint if phase == 1 else None)
        outside += time.perf_counter() - start - sum(history.step_times)
    return outside, model.get_weights()


def main() -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None, help="write the markdown table here")
    args = parser.parse_args()
    rows = []
    for before, after in ((4, 2), (2, 4)):
        work = tempfile.mkdtemp(prefix="autodist-elastic-bench-")
        base, resize, weights = in_place(before, after, work)
        outside, restarted = restart(before, after, work)
        latency = outside - base
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, restarted))
        rows.append((before, after, resize, latency, latency / resize, diff))
        print(rows[-1], flush=True)
    lines = [f"machine: {platform.machine()}, {os.cpu_count()} cores; command: "
             "`python benchmarks/elastic.py` (inside `unshare -n`)", "",
             "| resize | in place s | stop-checkpoint-restart s | ratio | target >= 5x | "
             "max weight difference |", "|---|---:|---:|---:|---|---:|"]
    for before, after, resize, latency, ratio, diff in rows:
        lines.append(f"| {before} -> {after} workers | {resize:.2f} | {latency:.2f} | "
                     f"{ratio:.1f}x | {'met' if ratio >= 5 else 'missed'} | {diff:.1e} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
