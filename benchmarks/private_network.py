"""Benchmark: what running a local cluster in its own network namespace costs.

Run as root inside a private network namespace (TF servers bind every
interface):

    unshare -n bash -c 'ip link set lo up && python benchmarks/private_network.py'

Side by side, interleaved, in one run: the same short local `fit` (MLP,
2 workers + 1 PS, 3 steps) with an interface of this namespace up (a veth), so
that it is not "only loopback" and autodist makes a private namespace for
the tasks (a holder process, tasks entered through `nsenter`), and with the
interface down, so the tasks run in this namespace as they are. Also the
time to make and remove a namespace alone (`PrivateNetwork.create` + `close`).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

DUMMY = "adbench0"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def main() -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", help="write the markdown table here")
    args = parser.parse_args()

    import autodist
    from autodist import models
    from autodist.launch import private_network

    if os.geteuid() != 0 or not private_network.is_private():
        print("run as root inside `unshare -n` (see the docstring)", file=sys.stderr)
        return 2
    model = models.mlp(input_dim=64, hidden=(64,), optimizer="sgd")
    x, y = models.synthetic_data(model, 3 * 64)
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    graph_item = autodist.capture(model)
    strategy = autodist.builders.PS().build(graph_item, spec)
    work = tempfile.mkdtemp(prefix="autodist-netns-bench-")

    def fit(tag: str) -> float:
        run = autodist.distribute(model, strategy, spec, graph_item=graph_item,
                                  job_dir=f"{work}/{tag}")
        start = time.perf_counter()
        run.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False)
        return time.perf_counter() - start

    _ip("link", "add", DUMMY, "type", "veth", "peer", "name", DUMMY + "p")
    walls: dict[str, list[float]] = {"own namespace": [], "this namespace": []}
    try:
        for i in range(args.rounds):
            order = ("own namespace", "this namespace") if i % 2 == 0 else (
                "this namespace", "own namespace")
            for mode in order:
                _ip("link", "set", DUMMY, "up" if mode == "own namespace" else "down")
                assert private_network.is_private() == (mode == "this namespace")
                walls[mode].append(fit(f"{mode[:3]}{i}"))
                print(mode, f"{walls[mode][-1]:.2f}s", flush=True)
        _ip("link", "set", DUMMY, "down")
        made = []
        for _ in range(20):
            start = time.perf_counter()
            private_network.PrivateNetwork.create().close()
            made.append(time.perf_counter() - start)
    finally:
        subprocess.run(["ip", "link", "del", DUMMY], capture_output=True)

    own = statistics.median(walls["own namespace"])
    this = statistics.median(walls["this namespace"])
    lines = [f"machine: {platform.machine()}, {os.cpu_count()} cores; command: "
             f"`python benchmarks/private_network.py --rounds {args.rounds}` (as root inside "
             "`unshare -n`)", "",
             "| what | median s | min–max s |", "|---|---:|---|",
             f"| local fit, tasks in a namespace of their own | {own:.2f} | "
             f"{min(walls['own namespace']):.2f}–{max(walls['own namespace']):.2f} |",
             f"| local fit, tasks in this (private) namespace | {this:.2f} | "
             f"{min(walls['this namespace']):.2f}–{max(walls['this namespace']):.2f} |",
             f"| make and remove a namespace (20 times) | {statistics.median(made):.3f} | "
             f"{min(made):.3f}–{max(made):.3f} |", "",
             f"own / this: {own / this:.3f}x ({own - this:+.2f} s per fit)"]
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
