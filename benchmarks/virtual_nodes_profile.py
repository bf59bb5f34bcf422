"""Profile: the virtual-node overhead of the small MLP in one process, interleaved.

`benchmarks/virtual_nodes.py` measures each configuration once, in its own
worker process, and that process-to-process noise is as large as the
overhead. Here the programs for V=1 (one batch) and each V are built by the
worker's own `build_program` and run by sessions on one in-process TF server
(gRPC, as a worker runs them), in alternating rounds: each round's V-to-V=1
ratio is paired with its neighbours in time, and the median ratio is
reported. `--trace` adds op time by op type (RunOptions FULL_TRACE).

    unshare -n bash -c 'ip link set lo up && python benchmarks/virtual_nodes_profile.py'
"""
from __future__ import annotations

import argparse
import collections
import os
import time

import numpy as np


def main() -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    import autodist
    from autodist import models
    from autodist.runtime import batching
    from autodist.runtime import worker

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--nodes", default="2,4,8")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--port", type=int, default=23456)
    args = parser.parse_args()
    model = models.mlp(input_dim=256, hidden=(512, 512), optimizer="sgd")
    x, y = models.synthetic_data(model, args.batch)
    item = autodist.capture(model)
    spec = autodist.ResourceSpec.local(workers=1)
    plain = autodist.builders.AllReduce().build(item, spec)
    server = tf.distribute.Server(tf.train.ClusterSpec({"worker": [f"localhost:{args.port}"]}),
                                  job_name="worker", task_index=0,
                                  config=worker.server_config(), start=True)
    runs = {}
    for v in [1] + [int(n) for n in args.nodes.split(",")]:
        strategy = plain if v == 1 else plain.with_virtual_nodes(args.batch, v)
        program = worker.build_program(item, strategy, spec, 0, 60.0)
        session = tf.compat.v1.Session(server.target, graph=program.graph,
                                       config=worker.session_config(strategy, 0))
        session.run([program.outputs.step.initializer]
                    + [var.initializer for var in program.storage.values()])
        (replica,) = program.replicas
        parts = batching.virtual_node_rows(np.arange(args.batch), strategy.num_virtual_nodes)
        mine = [parts[vn.index] for vn in replica.virtual_nodes]
        rows = np.concatenate(mine)
        feed = {program.outputs.scales[replica.index]: 1.0}
        sizes = [len(m) for m in mine]
        if replica.sizes is not None and sizes != getattr(replica, "default_sizes", None):
            feed[replica.sizes] = np.asarray(sizes, np.int32)
        for info, array in zip(item.model_inputs, [x]):
            feed[replica.inputs[info.name]] = np.asarray(array[rows])
        feed[replica.inputs[item.target_inputs[0].name]] = y[rows]
        fetches = {"loss": program.outputs.weighted_loss, "train": program.outputs.train_op}
        for _ in range(10):
            session.run(fetches, feed)
        ops = collections.Counter(node.op for node in program.graph.as_graph_def().node)
        runs[v] = (session, fetches, feed, ops)
        print(f"V={v}: {sum(ops.values())} nodes", flush=True)
    times = {v: [] for v in runs}
    for _ in range(args.rounds):
        for v, (session, fetches, feed, _) in runs.items():
            step = []
            for _ in range(args.steps):
                start = time.perf_counter()
                session.run(fetches, feed)
                step.append(time.perf_counter() - start)
            times[v].append(float(np.median(step)))
    for v in runs:
        paired = np.median([t / b - 1 for t, b in zip(times[v], times[1])])
        print(f"V={v}: median {np.median(times[v]) * 1e3:.2f} ms, paired overhead {paired:+.1%}")
    if args.trace:
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        for v, (session, fetches, feed, _) in runs.items():
            by_type, count = collections.Counter(), collections.Counter()
            for _ in range(15):
                metadata = tf.compat.v1.RunMetadata()
                session.run(fetches, feed, options=options, run_metadata=metadata)
                for device in metadata.step_stats.dev_stats:
                    for node in device.node_stats:
                        label = node.timeline_label
                        kind = label.split(" = ")[1].split("(")[0] if " = " in label \
                            else node.node_name
                        by_type[kind] += node.all_end_rel_micros / 15
                        count[kind] += 1 / 15
            print(f"V={v}: op time {sum(by_type.values()) / 1e3:.2f} ms, "
                  f"{sum(count.values()):.0f} ops/step; " + ", ".join(
                      f"{k} {t / 1e3:.2f} ms x{count[k]:.0f}" for k, t in by_type.most_common(6)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
