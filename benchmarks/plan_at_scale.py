"""Benchmark: planning for large simulated clusters — search time, and the pick vs every builder.

Usage: python benchmarks/plan_at_scale.py [--models bert_large,resnet50,dlrm]
       [--gpus 16,64,256] [--gbps 10,25,100] [--search-budget 4000]

For each model (`autodist.bench.synthetic`: BERT-large, ResNet-50 and the
MLPerf DLRM, GraphItems of their real sizes built from the layer shapes;
capturing them through TensorFlow would take minutes to hours on this
machine and adds nothing the search reads) and each cluster (nodes of 8 GPUs
with 32 GB each and 512 GB of host memory, every node also a parameter
server, 16/64/256 GPUs, 10/25/100 Gbit/s per node), runs the tuner as
`autodist.optimize` does (simulator ranking, no measurement) and reports its
wall time, the candidates it scored, its pick's predicted step time and
every builder's, as predicted by the same simulator, or why the builder
cannot be used (a strategy that does not fit the GPUs' memory).

The simulator's machine constants are a GPU's, not this machine's:
10 TFLOP/s sustained (float32 on a V100-class GPU), 800 GB/s for optimizer
updates (HBM), α = 25 µs per message. Predicted times are the simulator's
model, not measurements: the point is the search at scale (does it finish,
in what time, does it beat or match every builder as predicted, does memory
steer it), not absolute step times.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

GPUS_PER_NODE = 8
PER_REPLICA_BATCH = {"bert_large": 32, "resnet50": 64, "dlrm": 2048}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bert_large,resnet50,dlrm")
    parser.add_argument("--gpus", default="16,64,256")
    parser.add_argument("--gbps", default="10,25,100")
    parser.add_argument("--gpu-memory", default="32GB")
    parser.add_argument("--cpu-memory", default="512GB")
    parser.add_argument("--search-budget", type=int, default=4000)
    args = parser.parse_args()

    from autodist.bench import synthetic
    from autodist.ir.resource_spec import ResourceSpec
    from autodist.search.memory import format_bytes
    from autodist.search.simulator import Calibration
    from autodist.search.tuner import Tuner

    calibration = Calibration(flops_per_s=1e13, memory_bytes_per_s=8e11, latency_s=2.5e-5)
    gpus_list = [int(g) for g in args.gpus.split(",")]
    gbps_list = [float(b) for b in args.gbps.split(",")]
    print(f"Command: `python {' '.join(sys.argv)}` on {platform.node()} "
          f"({os.cpu_count()} cores), {time.strftime('%Y-%m-%d')}\n")
    print(f"Nodes of {GPUS_PER_NODE} GPUs ({args.gpu_memory} each, {args.cpu_memory} host "
          "memory, every node also a PS); simulator constants: 10 TFLOP/s, 800 GB/s "
          "updates, α = 25 µs. Predicted step times in ms; ratio = best builder / pick "
          "(> 1: the pick is predicted faster).\n")
    summary = []
    for name in args.models.split(","):
        start = time.perf_counter()
        graph_item = synthetic.GRAPH_ITEM_FACTORIES[name]()
        build_s = time.perf_counter() - start
        sparse = sum(v.byte_size for v in graph_item.variables if v.sparse_gradient)
        print(f"## {name}: {len(graph_item.variables)} variables, "
              f"{graph_item.num_parameters / 1e6:,.1f}M parameters "
              f"({format_bytes(graph_item.total_variable_bytes)}, "
              f"{format_bytes(sparse)} with sparse gradients), optimizer "
              f"{graph_item.optimizer.class_name}, {PER_REPLICA_BATCH[name]} examples per GPU "
              f"(GraphItem built in {build_s:.2f} s)\n")
        columns, table = [], {}
        notes: dict[str, str] = {}  # builder -> why it could not be used, on the first cluster
        for gpus in gpus_list:
            for gbps in gbps_list:
                spec = _spec(ResourceSpec, gpus, gbps, args.gpu_memory, args.cpu_memory)
                start = time.perf_counter()
                tuner = Tuner(graph_item, spec, calibration=calibration,
                              batch_size=PER_REPLICA_BATCH[name] * gpus,
                              search_budget=args.search_budget)
                result = tuner.tune()
                elapsed = time.perf_counter() - start
                column = f"{gpus} GPUs {gbps:g} Gb/s"
                columns.append(column)
                table.setdefault("**pick**", {})[column] = \
                    f"**{result.predicted_step_time_s * 1e3:,.1f}**"
                for builder, seconds in result.builder_step_times_s.items():
                    table.setdefault(builder, {})[column] = f"{seconds * 1e3:,.1f}"
                for builder in result.builder_errors:
                    table.setdefault(builder, {})[column] = "no fit" \
                        if "does not fit in memory" in result.builder_errors[builder] else "error"
                best, best_s = min(result.builder_step_times_s.items(), key=lambda kv: kv[1])
                memory = result.explanation.splitlines()[1]
                summary.append((name, gpus, gbps, elapsed, result.candidates_scored,
                                result.predicted_step_time_s, best, best_s,
                                _layout(result.strategy, graph_item),
                                memory.split(", ", 1)[1].split(" at a")[0]
                                if memory.startswith("memory:") else "-"))
                for builder, error in sorted(result.builder_errors.items()):
                    notes.setdefault(builder, f"{column}: {error}")
        print("| strategy | " + " | ".join(columns) + " |")
        print("|---|" + "---:|" * len(columns))
        for strategy, row in table.items():
            print(f"| {strategy} | " + " | ".join(row.get(c, "-") for c in columns) + " |")
        if notes:
            print("\nBuilders that could not be used (on the first cluster where they could "
                  "not):\n")
            for builder, note in notes.items():
                print(f"- {builder}, {note}")
        print()
    print("## Search time and picks\n")
    print("| model | GPUs | Gbit/s | search s | candidates | pick ms | best builder | its ms | "
          "ratio | pick: variables by kind | fullest device (of capacity) |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---|---|")
    for (name, gpus, gbps, elapsed, scored, pick_s, best, best_s, layout,
         memory) in summary:
        print(f"| {name} | {gpus} | {gbps:g} | {elapsed:.1f} | {scored:,} | {pick_s * 1e3:,.1f} "
              f"| {best} | {best_s * 1e3:,.1f} | {best_s / pick_s:.2f}x | {layout} | {memory} |")
    return 0


def _spec(resource_spec_cls, gpus: int, gbps: float, gpu_memory: str, cpu_memory: str):
    nodes = max(1, gpus // GPUS_PER_NODE)
    return resource_spec_cls.from_dict({"nodes": [
        {"address": f"10.0.{i // 250}.{i % 250 + 1}", "gpus": min(gpus, GPUS_PER_NODE),
         "network_bandwidth": gbps, "gpu_memory": gpu_memory, "cpu_memory": cpu_memory}
        for i in range(nodes)]})


def _layout(strategy, graph_item) -> str:
    """Variables by how their gradients travel, e.g. "all-reduce 386, PS 5"."""
    from autodist.ir.strategy import is_gathered

    sparse = {v.name: v.sparse_gradient for v in graph_item.variables}
    counts: dict[str, int] = {}
    for config in strategy.proto.variables:
        kinds = {s.WhichOneof("kind") for s in config.shards}
        if len(kinds) > 1:
            kind = "split"
        elif kinds == {"ps"}:
            kind = f"PS ({config.partitioner.num_shards or 1} shards)" \
                if config.partitioner.num_shards > 1 else "PS"
        elif is_gathered(config.shards[0].all_reduce, sparse[config.var_name]):
            kind = "all-gather"
        else:
            kind = "all-reduce"
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{k} {n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


if __name__ == "__main__":
    sys.exit(main())
