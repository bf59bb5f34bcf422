"""How a Strategy reads to a person: one line per synchronizer, and the summary table."""
from __future__ import annotations

from autodist.proto import strategy_pb2

AllReduceSynchronizer = strategy_pb2.AllReduceSynchronizer


def summary_table(proto: strategy_pb2.Strategy, strategy_id: str, origin: str) -> str:
    """A table: variable, partition, synchronizer and placement per shard, under a
    header of the replicas, virtual nodes and measured or predicted step times."""
    rows = [("variable", "partition", "synchronizer")]
    for config in proto.variables:
        part = "-"
        if config.HasField("partitioner") and config.partitioner.num_shards > 1:
            p = config.partitioner
            part = f"axis {p.axis} x{p.num_shards}"
            if p.shard_sizes:
                part += " (" + ",".join(str(s) for s in p.shard_sizes) + ")"
        syncs = [describe_synchronizer(s) for s in config.shards]
        rows.append((config.var_name, part, "; ".join(syncs)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    gc = proto.graph_config
    header = [f"Strategy {strategy_id} (origin: {origin or 'unknown'}, "
              f"schema v{proto.schema_version})",
              f"  replicas: {', '.join(gc.replicas) or 'none'}"]
    if gc.virtual_nodes.num_virtual_nodes:
        vn = gc.virtual_nodes
        header.append(f"  virtual nodes: {vn.num_virtual_nodes} x "
                      f"{vn.global_batch_size // max(vn.num_virtual_nodes, 1)} examples "
                      f"(global batch {vn.global_batch_size})")
    perf = proto.performance
    if perf.measured_step_time_s:   # measured first: it is what the pick rests on
        times = sorted(perf.measured_step_time_s)
        median = (times[(len(times) - 1) // 2] + times[len(times) // 2]) / 2
        header.append(f"  measured step time: {median * 1e3:.3f} ms (median of "
                      f"{len(times)} steps, {times[0] * 1e3:.3f}-{times[-1] * 1e3:.3f})")
    if perf.predicted_step_time_s:
        header.append(f"  predicted step time: {perf.predicted_step_time_s * 1e3:.3f} ms "
                      f"({perf.predictor or 'unknown predictor'})")
    return "\n".join(header + [""] + lines)


def describe_synchronizer(sync: strategy_pb2.Synchronizer) -> str:
    """One line for a synchronizer, e.g. "PS(/job:ps/task:0/device:CPU:0, sync)"."""
    kind = sync.WhichOneof("kind")
    if kind == "ps":
        ps = sync.ps
        mode = "sync" if ps.sync else "async"
        if ps.sync and ps.staleness:
            mode = f"stale<={ps.staleness}"
        extra = ", local copy" if ps.local_replication else ""
        return f"PS({ps.reduction_destination}, {mode}{extra})"
    if kind == "all_reduce":
        ar = sync.all_reduce
        spec = enum_name(AllReduceSynchronizer.Spec, ar.spec)
        comp = enum_name(AllReduceSynchronizer.Compressor, ar.compressor)
        return f"AllReduce({spec}, {comp}, group {ar.group})"
    return "none"


def enum_name(enum, value: int) -> str:
    """The name of an enum value; "UNKNOWN(<number>)" for a number the enum lacks.

    A proto3 enum field keeps any number it is parsed with, so a file from a
    newer autodist (or a damaged one) can hold values this one has no name for.
    """
    try:
        return enum.Name(value)
    except ValueError:
        return f"UNKNOWN({value})"
