"""Benchmark: the search's memory estimate of a step against TensorFlow's measured peak.

Usage: python benchmarks/memory_estimate.py [--models mlp,cnn,transformer,resnet50]
       [--batches 32,128]

For each example model and batch, on one CPU device: trains two steps with
Keras (`train_on_batch`, which also creates the optimizer's slots and traces
the step), resets the allocator's statistics, trains three more steps and
reads the peak bytes allocated above what was live before them (TensorFlow's BFC allocator on the
CPU, `TF_CPU_ALLOCATOR_USE_BFC=true`, `tf.config.experimental.get_memory_info`).
That peak holds the step's activations, gradients and temporaries; the
variables and slots were live before. It is set against the estimate of the
same part by `autodist.search.memory`: the activation estimate from the
capture's per-op output bytes (`activation_bytes`) plus one gradient per
variable (dense: the variable's bytes; sparse: the looked-up rows and their
indices). On a GPU the picture is the same allocator, so the ratio carries
over; no GPU was measured.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

# Statistics need the BFC allocator, chosen when TensorFlow starts.
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,cnn,transformer,resnet50")
    parser.add_argument("--batches", default="32,128")
    args = parser.parse_args()

    import tensorflow as tf

    import autodist
    from autodist import models
    from autodist.search.memory import INDEX_BYTES, activation_bytes, format_bytes
    from autodist.search.space import lookups_per_example

    print(f"Command: `python {' '.join(sys.argv)}` on {platform.node()} "
          f"({os.cpu_count()} cores), {time.strftime('%Y-%m-%d')}, TensorFlow {tf.__version__}\n")
    print("| model | batch | measured step peak | estimate (activations + gradients) | "
          "activations | gradients | estimate / measured |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        model = models.build(name)
        graph_item = autodist.capture(model)
        rows = lookups_per_example(graph_item)
        for batch in (int(b) for b in args.batches.split(",")):
            x, y = models.synthetic_data(model, batch)
            for _ in range(2):
                model.train_on_batch(x, y)
            tf.config.experimental.reset_memory_stats("CPU:0")
            before = tf.config.experimental.get_memory_info("CPU:0")["current"]
            for _ in range(3):
                model.train_on_batch(x, y)
            peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
            activations = activation_bytes(graph_item, batch)
            gradients = 0.0
            for var in graph_item.variables:
                if var.sparse_gradient:
                    row = var.byte_size / var.shape[0]
                    gradients += rows[var.name] * batch * (row + INDEX_BYTES)
                else:
                    gradients += var.byte_size
            estimate = activations + gradients
            print(f"| {name} | {batch} | {format_bytes(peak)} | {format_bytes(estimate)} | "
                  f"{format_bytes(activations)} | {format_bytes(gradients)} | "
                  f"{estimate / peak:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
