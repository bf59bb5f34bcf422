"""Benchmark: `fit(dataset)` streamed by the workers (whole, or sharded) vs the feed path.

Run as root inside a private network namespace (TF servers bind every
interface):

    unshare -n bash -c 'ip link set lo up && python benchmarks/input_pipeline.py'

Two parts, each fit in a fresh driver process (so its peak RSS is its own),
on TFRecord files the benchmark writes (raw float32 records: features, then
the label), MLP with one hidden layer of 8 units, 2 workers, all-reduce:

(a) Input-bound steps: the dataset's `map` does heavy per-batch
    preprocessing (`--preprocess` rounds of `tanh(x @ W)`). Streaming: each
    worker reads and preprocesses every batch in a background producer,
    overlapped with its steps. Sharded (`autodist.ShardedDataset`): each
    worker reads and preprocesses only its half of the files, in batches of
    its share (half the global batch). Feed path (what `fit(dataset)` did
    before): the driver reads the whole dataset into arrays, which the
    workers are fed from. Rounds interleaved; medians of the time per step
    as the driver sees the steps end (waits for input included) and of the
    fit's wall time (the feed path's includes the driver's read).
(b) The driver's peak RSS as the data grow 100x (same steps trained):
    streaming with the length declared (`assert_cardinality`), streaming
    with it unknown (the driver counts one pass, keeping nothing), and the
    feed path.

Streaming and feed train on the same batches; the benchmark checks that
their step losses agree. The sharded run's global batches hold other
examples (each worker's files), so its losses differ.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

BATCH = 128


def write_records(directory: str, examples: int, dim: int, files: int = 4) -> list[str]:
    """`examples` records of `dim` float32 features and a label, split over files."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    paths = []
    per_file = -(-examples // files)
    for f in range(files):
        path = os.path.join(directory, f"part-{f}.tfrecord")
        count = min(per_file, examples - f * per_file)
        with tf.io.TFRecordWriter(path) as writer:
            for start in range(0, count, 1024):
                n = min(1024, count - start)
                rows = np.concatenate([rng.normal(size=(n, dim)),
                                       rng.integers(0, 3, (n, 1))], axis=1).astype("float32")
                for row in rows:
                    writer.write(row.tobytes())
        paths.append(path)
    return paths


def make_dataset(paths: list[str], dim: int, preprocess: int, examples: int | None,
                 batch: int = BATCH):
    """Batches of (features, label); `preprocess` rounds of tanh(x @ W) per batch;
    `examples` given: the length declared."""
    import tensorflow as tf

    weights = tf.constant(np.random.default_rng(1).normal(
        scale=dim ** -0.5, size=(dim, dim)).astype("float32"))

    def parse(records):
        values = tf.reshape(tf.io.decode_raw(records, tf.float32), [-1, dim + 1])
        x = values[:, :dim]
        for _ in range(preprocess):
            x = tf.tanh(tf.matmul(x, weights))
        return x, tf.cast(values[:, dim], tf.int32)

    ds = tf.data.TFRecordDataset(paths).batch(batch, drop_remainder=True).map(parse)
    if examples is not None:
        ds = ds.apply(tf.data.experimental.assert_cardinality(examples // batch))
    return ds


def child(args) -> None:
    """One fit in this process; prints a JSON line of its measures.

    `train_step_s`: the time between the first and the last step's end as
    the driver sees them (a callback; polled every 0.1 s), per step: what
    a step costs with its input, waits for the input included. (History's
    step times are the chief's session runs only, after its batch is ready.)
    """
    import keras

    import autodist
    from autodist import models

    class StepEnds(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times: list[float] = []

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter())

    ends = StepEnds()

    paths = sorted(os.path.join(args.data, p) for p in os.listdir(args.data))
    model = models.mlp(input_dim=args.dim, hidden=(8,), classes=3)
    spec = autodist.ResourceSpec.local(workers=2)
    graph_item = autodist.capture(model)
    run = autodist.distribute(model, autodist.builders.AllReduce().build(graph_item, spec),
                              spec, graph_item=graph_item)
    ds = make_dataset(paths, args.dim, args.preprocess,
                      None if args.mode == "stream-counted" else args.examples)
    start = time.perf_counter()
    if args.mode == "feed":   # what fit(dataset) did before: read it all in the driver
        xs, ys = zip(*((x.numpy(), y.numpy()) for x, y in ds))
        x, y = np.concatenate(xs), np.concatenate(ys)
        del xs, ys
        history = run.fit(x, y, batch_size=BATCH, shuffle=False, steps_per_epoch=args.steps,
                          verbose=0, callbacks=[ends])
    elif args.mode == "sharded":   # each worker its share of the files, preprocessed there
        def shard(s):
            mine = paths[s.index::s.count]
            return make_dataset(mine, args.dim, args.preprocess,
                                args.examples * len(mine) // len(paths), s.batch_size)

        history = run.fit(autodist.ShardedDataset(shard, global_batch_size=BATCH),
                          steps_per_epoch=args.steps, verbose=0, callbacks=[ends], shuffle=False)
    else:
        history = run.fit(ds, steps_per_epoch=args.steps, verbose=0, callbacks=[ends],
                          shuffle=False)
    wall = time.perf_counter() - start
    print(json.dumps({"wall_s": wall, "step_s": statistics.median(history.step_times[1:]),
                      "train_step_s": (ends.times[-1] - ends.times[0]) / (len(ends.times) - 1),
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "losses": history.step_losses}), flush=True)


def measure(mode: str, data: str, examples: int, dim: int, steps: int, preprocess: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--data", data, "--examples", str(examples),
         "--dim", str(dim), "--steps", str(steps), "--preprocess", str(preprocess)],
        check=True, capture_output=True, text=True, timeout=1800)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(mode, examples, {k: round(v, 4) for k, v in result.items() if k != "losses"},
          flush=True)
    return result


def main() -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--examples", type=int, default=4096, help="part (b)'s 1x size")
    parser.add_argument("--growth", type=int, default=100)
    parser.add_argument("--out", help="write the markdown tables here")
    parser.add_argument("--parts", default="ab", help="a: input-bound steps; b: driver memory")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--dim", type=int, default=512, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=30, help=argparse.SUPPRESS)
    parser.add_argument("--preprocess", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.mode = args.child
        child(args)
        return 0

    from autodist.launch import private_network

    if os.geteuid() != 0 or not private_network.is_private():
        print("run as root inside `unshare -n` (see the docstring)", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="autodist-input-bench-")
    lines = [f"machine: {platform.machine()}, {os.cpu_count()} cores; command: "
             f"`python benchmarks/input_pipeline.py --rounds {args.rounds} --examples "
             f"{args.examples} --growth {args.growth} --parts {args.parts}` (as root inside "
             "`unshare -n`)", ""]
    if "a" in args.parts:
        lines += input_bound(work, args.rounds)
    if "b" in args.parts:
        lines += driver_memory(work, args.examples, args.growth)
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(table + "\n")
    return 0


def input_bound(work: str, rounds: int) -> list[str]:
    """(a): step and fit times of the three paths, interleaved rounds: 150 steps of 128
    examples x 512 features, 30 rounds of preprocessing."""
    steps_a, dim_a, rounds_a = 150, 512, 30
    data_a = os.path.join(work, "a")
    os.mkdir(data_a)
    write_records(data_a, steps_a * BATCH, dim_a)
    runs: dict[str, list[dict]] = {"stream": [], "sharded": [], "feed": []}
    order = ("stream", "sharded", "feed")
    for i in range(rounds):
        for mode in (order if i % 2 == 0 else order[::-1]):
            runs[mode].append(measure(mode, data_a, steps_a * BATCH, dim_a, steps_a, rounds_a))
    gap = max(np.max(np.abs(np.subtract(s["losses"], f["losses"])))
              for s, f in zip(runs["stream"], runs["feed"]))
    step = {m: statistics.median(r["train_step_s"] for r in runs[m]) for m in runs}
    run_s = {m: statistics.median(r["step_s"] for r in runs[m]) for m in runs}
    wall = {m: statistics.median(r["wall_s"] for r in runs[m]) for m in runs}
    return [f"(a) input-bound: {steps_a} steps of {BATCH} x {dim_a} float32, {rounds_a} rounds "
              f"of tanh(x @ W) per batch in the map; median of {rounds} fits each", "",
              "step ms: first to last step end as the driver sees them, per step (input "
              "waits included); session.run ms: the chief's run of a step once its batch is "
              "ready (median)", "",
              "| path | step ms | session.run ms | fit wall s |", "|---|---:|---:|---:|",
              f"| streaming (each worker reads and preprocesses every batch) | "
              f"{step['stream'] * 1e3:.1f} | {run_s['stream'] * 1e3:.1f} | "
              f"{wall['stream']:.1f} |",
              f"| sharded (each worker reads and preprocesses its half of the files) | "
              f"{step['sharded'] * 1e3:.1f} | {run_s['sharded'] * 1e3:.1f} | "
              f"{wall['sharded']:.1f} |",
              f"| feed (driver reads and preprocesses once, then feeds) | "
              f"{step['feed'] * 1e3:.1f} | {run_s['feed'] * 1e3:.1f} | {wall['feed']:.1f} |",
              "",
              f"stream / feed: step {step['stream'] / step['feed']:.2f}x, fit wall "
              f"{wall['stream'] / wall['feed']:.2f}x; sharded / feed: step "
              f"{step['sharded'] / step['feed']:.2f}x, fit wall "
              f"{wall['sharded'] / wall['feed']:.2f}x; sharded / stream: step "
              f"{step['sharded'] / step['stream']:.2f}x. Largest step-loss difference between "
              f"streaming and feed {gap:.2e}", ""]


def driver_memory(work: str, base: int, growth: int) -> list[str]:
    """(b): the driver's peak RSS as the data grow."""
    dim_b, steps_b = 1024, 20
    lines = [f"(b) the driver's peak RSS (MiB), {steps_b} steps of {BATCH} x {dim_b} float32 "
              "(4 KiB examples), no preprocessing", "",
              "| examples (file bytes) | streaming, length declared | streaming, counted | "
              "feed |", "|---|---:|---:|---:|"]
    for factor in (1, growth):
        examples = base * factor
        data_b = os.path.join(work, f"b{factor}")
        os.mkdir(data_b)
        write_records(data_b, examples, dim_b)
        size = sum(os.path.getsize(os.path.join(data_b, p)) for p in os.listdir(data_b))
        peaks = [measure(mode, data_b, examples, dim_b, steps_b, 0)["peak_rss_mib"]
                 for mode in ("stream", "stream-counted", "feed")]
        lines.append(f"| {examples} ({size / 2 ** 20:.0f} MiB) | " +
                     " | ".join(f"{p:.0f}" for p in peaks) + " |")
        for p in os.listdir(data_b):
            os.remove(os.path.join(data_b, p))
    return lines


if __name__ == "__main__":
    sys.exit(main())
