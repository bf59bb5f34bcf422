"""Benchmark: does the all-reduce overlap the backward pass? Buckets vs one fused group.

Two worker tasks, each its own process with its own TF server (as a launched
worker is), on links capped with `tc` (`autodist.bench.capped_links`). Each
task builds one program per configuration, all in the same process, each
with its own collective group key (`build_program`'s `version`), so the
configurations interleave within one launch under the same load:

* `AllReduce(group_bytes=...)`: one fused group (the default 32 MiB), and
  buckets of about 1/4 and 1/8 of the model's dense gradient bytes, reduced
  in backward order;
* `atomic`: whether every update waits for every collective of the step
  (`SyncOptions.atomic`, what `DistributedRun.fit` builds) or each group's
  updates wait only for that group.

Each round sets the cap (alternating the bandwidth order), then runs every
configuration (alternating order): warm-up steps, then timed steps (the
median of a block is the round's number). The table gives the median over
rounds and the min-max. After the rounds, task 0 traces `--traced` steps of
each configuration (RunOptions FULL_TRACE) and reports, relative to the
step's first op: when the backward pass ends (the last gradient op outside
the collectives and updates), when each collective starts and ends, and when
the first and last update start.

Needs root in a private network namespace (tc shapes `lo`):

    unshare -n bash -c 'ip link set lo up && python benchmarks/overlap.py'
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

_COLLECTIVES = ("CollectiveReduceV2", "CollectiveGatherV2")
# None, as a launched worker builds them: each collective with a timeout starts a thread
# that sleeps the timeout out (TF's base_collective_executor.cc), and thousands of such
# threads slow every collective. Each task process ends within the driver's timeout.
_COLLECTIVE_TIMEOUT_S = 0.0
# Optimizer updates of the runtime (ResourceApply*, and the assigns of Keras-style rules).
_UPDATE_PREFIXES = ("ResourceApply", "AssignSubVariableOp", "AssignAddVariableOp",
                    "ResourceScatter")


def _dense_bytes(item) -> int:
    return sum(v.byte_size for v in item.variables if not v.sparse_gradient)


def _configs(item, fractions: list[int]) -> list[tuple[str, int, bool]]:
    """(label, group_bytes, atomic) of every configuration measured."""
    from autodist.search.builders.all_reduce import DEFAULT_GROUP_BYTES

    dense = _dense_bytes(item)
    out = [("one group, atomic", DEFAULT_GROUP_BYTES, True),
           ("one group", DEFAULT_GROUP_BYTES, False)]
    for f in fractions:
        size = max(1, dense // f)
        out.append((f"1/{f} buckets, atomic", size, True))
        out.append((f"1/{f} buckets", size, False))
    return out


def _span_summary(metadata) -> dict:
    """Backward end, collectives and updates of one traced step (ms from its first op)."""
    nodes = [n for d in metadata.step_stats.dev_stats for n in d.node_stats]
    start = min(n.all_start_micros for n in nodes)
    backward_end = 0.0
    collectives = []
    updates = []
    for n in nodes:
        kind = n.timeline_label.split(" = ")[1].split("(")[0] if " = " in n.timeline_label \
            else ""
        begin = (n.all_start_micros - start) / 1e3
        end = begin + n.all_end_rel_micros / 1e3
        if kind in _COLLECTIVES:
            collectives.append((begin, end))
        elif kind.startswith(_UPDATE_PREFIXES):
            updates.append(begin)
        elif "gradient" in n.node_name.lower() and "Collective" not in n.node_name:
            backward_end = max(backward_end, end)
    collectives.sort()
    return {"backward_end": backward_end, "collectives": collectives,
            "first_update": min(updates, default=float("nan")),
            "last_update": max(updates, default=float("nan"))}


def _set_cap(ports: list[int], mbit: float) -> None:
    """Changes the caps of `shape_lo`'s classes in place (a new qdisc would drop the
    connections' queued packets: TF's collectives then abort with "Socket closed")."""
    for i in range(len(ports)):
        subprocess.run(["tc", "class", "change", "dev", "lo", "parent", "1:", "classid",
                        f"1:{10 + i}", "htb", "rate", f"{mbit}mbit", "ceil", f"{mbit}mbit"],
                       check=True, capture_output=True)


def _task(args: argparse.Namespace) -> int:
    """One worker task: every configuration's program, rounds of timed blocks, traces."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    import autodist
    from autodist import models
    from autodist.runtime import worker

    ports = [int(p) for p in args.ports.split(",")]
    mbits = [float(m) for m in args.mbits.split(",")]
    model = models.build_bench(args.model, seed=0)
    x, y = models.synthetic_data(model, 50 * args.batch)
    item = autodist.capture(model)
    spec = autodist.ResourceSpec.local(workers=len(ports))
    server = tf.distribute.Server(
        tf.train.ClusterSpec({"worker": [f"localhost:{p}" for p in ports]}),
        job_name="worker", task_index=args.task, config=worker.server_config(), start=True)
    inputs = x if isinstance(x, (list, tuple)) else [x]
    share = args.batch // len(ports)
    configs = _configs(item, [int(f) for f in args.fractions.split(",")])
    sparse = {v.name for v in item.variables if v.sparse_gradient}
    runs = []
    for version, (label, group_bytes, atomic) in enumerate(configs):
        strategy = autodist.builders.AllReduce(group_bytes=group_bytes).build(item, spec)
        groups = len({s.all_reduce.group for v in strategy.variables for s in v.shards
                      if v.var_name not in sparse})
        program = worker.build_program(item, strategy, spec, args.task, _COLLECTIVE_TIMEOUT_S,
                                       version=version, atomic=atomic)
        session = tf.compat.v1.Session(server.target, graph=program.graph,
                                       config=worker.session_config(strategy, args.task,
                                                                    graph_item=item))
        variables = list(program.storage.values()) + [program.outputs.step]
        with program.graph.as_default():
            session.run([v.initializer for v in variables if f"task:{args.task}/" in v.device])
        (replica,) = program.replicas

        def feed(step: int, program=program, replica=replica) -> dict:
            rows = (np.arange(share) + step * args.batch + args.task * share) % len(y)
            values = {program.outputs.scales[replica.index]: 1.0 / len(ports)}
            for info, array in zip(item.model_inputs, inputs):
                values[replica.inputs[info.name]] = np.asarray(array[rows])
            values[replica.inputs[item.target_inputs[0].name]] = y[rows]
            return values

        fetches = {"loss": program.outputs.weighted_loss, "train": program.outputs.train_op}
        runs.append(dict(label=label, group_bytes=group_bytes, groups=groups, session=session,
                         fetches=fetches, feeds=[feed(i) for i in range(50)]))
    if args.task == 0 and args.shape:
        from autodist.bench.capped_links import shape_lo

        shape_lo(ports, mbits[0])
    time.sleep(2.0)  # the peer's variables
    times: dict[tuple[int, float], list[float]] = {}
    for r in range(args.rounds):
        for mbit in (mbits if r % 2 == 0 else mbits[::-1]):
            if args.task == 0 and args.shape:
                _set_cap(ports, mbit)
            order = list(range(len(runs))) if r % 2 == 0 else list(range(len(runs)))[::-1]
            for i in order:
                run = runs[i]
                block = []
                for s in range(args.warmup + args.steps):
                    start = time.perf_counter()
                    run["session"].run(run["fetches"], run["feeds"][s % 50])
                    block.append(time.perf_counter() - start)
                times.setdefault((i, mbit), []).append(float(np.median(block[args.warmup:])))
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    traces: dict[str, dict] = {}
    for mbit in mbits:
        if args.task == 0 and args.shape:
            _set_cap(ports, mbit)
        for i, run in enumerate(runs):
            for s in range(args.warmup):
                run["session"].run(run["fetches"], run["feeds"][s % 50])
            summaries = []
            for s in range(args.traced):
                metadata = tf.compat.v1.RunMetadata()
                run["session"].run(run["fetches"], run["feeds"][s % 50], options=options,
                                   run_metadata=metadata)
                summaries.append(_span_summary(metadata))
            traces[f"{i}@{mbit:g}"] = _median_summary(summaries)
    print(json.dumps({
        "model": args.model, "dense_bytes": _dense_bytes(item),
        "configs": [{k: run[k] for k in ("label", "group_bytes", "groups")} for run in runs],
        "times": {f"{i}@{m:g}": v for (i, m), v in times.items()}, "traces": traces}),
        flush=True)
    time.sleep(2.0)  # the peer's last traced step
    return 0


def _median_summary(summaries: list[dict]) -> dict:
    """Field by field median of traced steps (collectives by rank in start order)."""
    count = min(len(s["collectives"]) for s in summaries)
    return {
        "backward_end": statistics.median(s["backward_end"] for s in summaries),
        "collectives": [[statistics.median(s["collectives"][k][j] for s in summaries)
                         for j in (0, 1)] for k in range(count)],
        "first_update": statistics.median(s["first_update"] for s in summaries),
        "last_update": statistics.median(s["last_update"] for s in summaries),
    }


def _measure(args: argparse.Namespace, model: str) -> dict:
    """One launch of both tasks for `model`; task 0's report."""
    from autodist.bench.capped_links import BASE_PORT, clear_lo

    ports = ",".join(str(BASE_PORT + i) for i in range(args.workers))
    command = [sys.executable, __file__, "--task-index", "{}", "--ports", ports,
               "--model", model, "--batch", str(args.batch), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--rounds", str(args.rounds),
               "--mbits", args.mbits, "--fractions", args.fractions,
               "--traced", str(args.traced)] + ([] if args.shape else ["--no-shape"])
    processes = [subprocess.Popen([c.format(t) for c in command], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
                 for t in range(args.workers)]
    try:
        outputs = [p.communicate(timeout=args.timeout_s) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
        clear_lo()
    failed = [t for t, p in enumerate(processes) if p.returncode]
    if failed:
        raise SystemExit(f"tasks {failed} failed:\n" + "\n".join(
            f"task {t}: {outputs[t][1][-2000:]}" for t in failed))
    return json.loads(outputs[0][0].strip().splitlines()[-1])


def _predictions(args: argparse.Namespace, model_name: str,
                 configs: list[dict]) -> dict[tuple[str, float, float], float]:
    """(label, Mbit/s, backward_overlap) -> predicted step s of every configuration."""
    import autodist
    from autodist import models
    from autodist.bench.capped_links import capped_spec
    from autodist.search.simulator import Calibration, Simulator
    from autodist.search.space import SearchSpace

    calibration = None
    if args.calibration:
        path, _, key = args.calibration.partition(":")
        with open(path) as f:
            data = json.load(f)
        calibration = Calibration.from_dict(data[key]["calibration"] if key else data)
    model = models.build_bench(model_name, seed=0)
    item = autodist.capture(model)
    out = {}
    for mbit in (float(m) for m in args.mbits.split(",")):
        spec, _ = capped_spec(args.workers, 0, mbit, shape=False)
        space = SearchSpace(item, spec)
        for overlap in (0.0, 1.0):
            sim = Simulator(space, dataclasses.replace(calibration or Calibration(),
                                                       backward_overlap=overlap),
                            batch_size=args.batch)
            for c in configs:
                strategy = autodist.builders.AllReduce(group_bytes=c["group_bytes"]).build(
                    item, spec)
                out[(c["label"], mbit, overlap)] = float(
                    sim.predict_strategy(strategy).step_time_s[0])
    return out


def _spread(values: list[float]) -> str:
    return (f"{statistics.median(values) * 1e3:.2f} "
            f"({min(values) * 1e3:.2f}-{max(values) * 1e3:.2f})")


def _report(result: dict, args: argparse.Namespace) -> None:
    mbits = [float(m) for m in args.mbits.split(",")]
    configs = result["configs"]
    print(f"\n### {result['model']}: {result['dense_bytes'] / 1e3:.0f} kB of dense gradients\n")
    print("| configuration | group_bytes | groups | "
          + " | ".join(f"{m:g} Mbit/s ms/step" for m in mbits) + " | "
          + " | ".join(f"vs first @ {m:g}" for m in mbits) + " |")
    print("|---|---:|---:|" + "---:|" * (2 * len(mbits)))
    for i, c in enumerate(configs):
        cells = [_spread(result["times"][f"{i}@{m:g}"]) for m in mbits]
        ratios = []
        for m in mbits:
            pairs = zip(result["times"][f"0@{m:g}"], result["times"][f"{i}@{m:g}"])
            values = [a / b for a, b in pairs]
            ratios.append(f"{statistics.median(values):.2f} ({min(values):.2f}-"
                          f"{max(values):.2f})")
        print(f"| {c['label']} | {c['group_bytes']} | {c['groups']} | " + " | ".join(cells)
              + " | " + " | ".join(ratios) + " |")
    predicted = _predictions(args, result["model"], configs)
    print(f"\nThe simulator ({args.calibration or 'default calibration'}), the same "
          "configurations (atomic or not alike), predicted ms/step with backward_overlap 0 "
          "(additive) and 1:\n")
    print("| configuration | " + " | ".join(f"{m:g} Mbit/s, overlap {o:g}" for m in mbits
                                           for o in (0.0, 1.0)) + " |")
    print("|---|" + "---:|" * (2 * len(mbits)))
    for c in configs:
        if c["label"].endswith("atomic"):
            continue
        cells = [f"{predicted[(c['label'], m, o)] * 1e3:.2f}" for m in mbits for o in (0.0, 1.0)]
        print(f"| {c['label']} | " + " | ".join(cells) + " |")
    print(f"\nTask 0's traced steps (median of {args.traced}; ms from the step's first op; "
          "collectives in start order as start-end):\n")
    print("| configuration | Mbit/s | backward ends | collectives | first update | "
          "last update |")
    print("|---|---:|---:|---|---:|---:|")
    for m in mbits:
        for i, c in enumerate(configs):
            t = result["traces"][f"{i}@{m:g}"]
            spans = ", ".join(f"{a:.2f}-{b:.2f}" for a, b in t["collectives"])
            print(f"| {c['label']} | {m:g} | {t['backward_end']:.2f} | {spans} | "
                  f"{t['first_update']:.2f} | {t['last_update']:.2f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--model", default="", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per block")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mbits", default="10000,1000", help="link caps, Mbit/s")
    parser.add_argument("--fractions", default="4,8",
                        help="bucket sizes as fractions of the dense gradient bytes")
    parser.add_argument("--traced", type=int, default=10)
    parser.add_argument("--calibration",
                        default="benchmarks/results/calibrated_simulator.json:2x1@100",
                        help="Calibration JSON for the predictions (FILE or FILE:KEY of a "
                             "mapping of them; empty: the defaults)")
    parser.add_argument("--no-shape", dest="shape", action="store_false",
                        help="do not cap the links (no root needed)")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--task-index", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ports", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.task_index is not None:
        args.task = args.task_index
        return _task(args)
    print(f"command: python benchmarks/overlap.py {' '.join(sys.argv[1:])} (private network "
          f"namespace, root)\n{args.workers} workers, global batch {args.batch}, AllReduce; "
          f"{args.rounds} rounds, each: every cap, every configuration (orders alternate), "
          f"{args.warmup} warm-up + {args.steps} timed steps; median (min-max) over rounds "
          f"of a block's median; 'vs first': one group atomic / this, per round.")
    for model in args.models.split(","):
        started = time.perf_counter()
        result = _measure(args, model)
        _report(result, args)
        print(f"\n({model}: {time.perf_counter() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
