"""Partitioner pass: split variables into shards as the strategy says.

For each partitioned variable the step's GraphDef is rewritten so that it
reads the shards instead of the whole variable:

* ``ReadVariableOp(v)`` becomes the concatenation of the shard reads;
* ``ResourceGather(v, ids)`` (an embedding lookup) becomes a partitioned
  gather: ids are routed to the shard holding their row, each shard gathers
  its rows where it lives, and the rows are stitched back in order. Only the
  rows a step touches travel.

Gradients are split at synchronization time with `split_gradient`: dense
gradients are sliced along the axis; sparse ones (IndexedSlices) are routed
to their shard and re-indexed relative to it.
"""
from __future__ import annotations

from typing import Callable, Sequence

import tensorflow as tf

from autodist.ir.device_names import op_name
from autodist.ir.errors import StrategyError
from autodist.ir.strategy import Strategy
from autodist.kernels import global_batch
from autodist.kernels.lookups import gather_where_tables_live
from autodist.kernels.program import Program, Shard, Stage

_SHARD_SUFFIX = "/autodist_shard_"


def shard_sizes(dim: int, num_shards: int, explicit: Sequence[int]) -> list[int]:
    """Sizes along the axis: explicit ones, else even (larger shards first)."""
    if explicit:
        return list(explicit)
    base, extra = divmod(dim, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


def plan_shards(program: Program, strategy: Strategy) -> dict[str, list[Shard]]:
    """The shards of every variable, in GraphItem order.

    A strategy that all-reduces some shards (or whose step sums batch
    statistics over replicas) reads its PS shards held by worker tasks
    through task-local copies (as `local_replication` does), whatever the
    strategy says; see `_reads_locally`.
    """
    all_reduces = any(sync.WhichOneof("kind") == "all_reduce"
                      for config in strategy.variables for sync in config.shards) or \
        global_batch.sums_over_replicas(program.graph_item, strategy)   # in the step too
    plans = {}
    for var in program.graph_item.variables:
        config = strategy.variable(var.name)
        p = config.partitioner
        n = p.num_shards if config.HasField("partitioner") and p.num_shards > 1 else 1
        axis = p.axis if n > 1 else 0
        sizes = shard_sizes(var.shape[axis], n, list(p.shard_sizes)) if n > 1 else None
        shards = []
        offset = 0
        for k in range(n):
            shape = list(var.shape)
            if n > 1:
                shape[axis] = sizes[k]
            placeholder = var.handle_node if n == 1 else f"{var.handle_node}{_SHARD_SUFFIX}{k}"
            sync = config.shards[k]
            if all_reduces and _reads_locally(sync):
                sync = type(sync).FromString(sync.SerializeToString())
                sync.ps.local_replication = True
            shards.append(Shard(var.name, k, n, axis, offset, shape, var.dtype,
                                var.sparse_gradient, sync, placeholder))
            offset += sizes[k] if n > 1 else 0
        plans[var.name] = shards
    return plans


def _reads_locally(sync) -> bool:
    """A PS shard on a worker task, in a strategy with collectives: read a local copy.

    TensorFlow gives every worker's step of a graph with collectives the same
    step id, so worker A's step running ops on worker B (reading a PS shard
    B holds) shares B's own step's rendezvous, and the first to finish
    cleans it up under the other ("ValidateDevices called before
    initialization"). With a local copy, refreshed in the step's second,
    collective-free run (see `synchronizer`), the collective run touches no
    other task. PS-only tasks run no steps of their own, so their shards are
    read as the strategy says.
    """
    return sync.WhichOneof("kind") == "ps" and not sync.ps.local_replication and \
        sync.ps.reduction_destination.startswith("/job:worker/")


def apply(program: Program, strategy: Strategy) -> Program:
    """CAPTURED -> PARTITIONED: plans shards and rewrites reads of split variables."""
    program.require(Stage.CAPTURED, "partitioner")
    strategy.validate(program.graph_item, program.resource_spec)
    program.shards = plan_shards(program, strategy)
    graph_def = gather_where_tables_live(program.graph_item.graph_def(), program.graph_item)
    for var in program.graph_item.variables:
        shards = program.shards[var.name]
        if len(shards) > 1 and var.handle_node:
            graph_def = _rewrite_reads(graph_def, var.handle_node, shards)
    program.graph_def = graph_def
    program.stage = Stage.PARTITIONED
    return program


def split_gradient(grad, shards: list[Shard]) -> list:
    """Splits a variable's gradient into one gradient per shard.

    Args:
        grad: A dense tensor or a tf.IndexedSlices over the whole variable.
        shards: The variable's shards.

    Returns:
        Per shard: a dense slice, or IndexedSlices re-indexed to the shard.
    """
    if len(shards) == 1:
        return [grad]
    axis = shards[0].axis
    if not isinstance(grad, tf.IndexedSlices):
        return tf.split(grad, [s.shape[axis] for s in shards], axis=axis)
    if axis != 0:
        raise StrategyError(f"variable {shards[0].var_name!r} has a sparse gradient and can only "
                            f"be split on axis 0. Received axis {axis}",
                            variable=shards[0].var_name, field="partitioner.axis", received=axis)
    shard_of, local = _route(grad.indices, [s.offset for s in shards])
    values = tf.dynamic_partition(grad.values, shard_of, len(shards))
    indices = tf.dynamic_partition(local, shard_of, len(shards))
    return [tf.IndexedSlices(v, i, tf.constant(s.shape, tf.int64 if grad.indices.dtype == tf.int64
                                               else tf.int32))
            for v, i, s in zip(values, indices, shards)]


def _route(ids, offsets: Sequence[int]):
    """(shard index, index within the shard) of each id, for shards starting at `offsets`."""
    ids = tf.convert_to_tensor(ids)
    boundaries = tf.constant(list(offsets[1:]), dtype=ids.dtype)
    shard = tf.searchsorted(boundaries, ids, side="right", out_type=tf.int32) \
        if len(offsets) > 1 else tf.zeros_like(ids, tf.int32)
    local = ids - tf.gather(tf.constant(list(offsets), dtype=ids.dtype), shard)
    return shard, local


# ------------------------------------------------------------ GraphDef surgery
def _rewrite_reads(graph_def, handle_node: str, shards: list[Shard]):
    """Replaces every consumer of `handle_node` by a subgraph over the shards."""
    out = tf.compat.v1.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)
    dtype = tf.as_dtype(shards[0].dtype)
    for shard in shards:
        node = out.node.add(name=shard.placeholder, op="Placeholder")
        node.attr["dtype"].type = tf.resource.as_datatype_enum
        node.attr["shape"].shape.CopyFrom(tf.TensorShape([]).as_proto())
    shard_inputs = [s.placeholder for s in shards]
    for node in graph_def.node:
        if node.name == handle_node:
            continue  # the whole-variable handle no longer exists
        data_inputs = [i for i in node.input if not i.startswith("^")]
        reads_var = any(op_name(i) == handle_node for i in data_inputs)
        if not reads_var:
            out.node.add().CopyFrom(_strip_colocation(node, handle_node))
            continue
        if node.op == "ReadVariableOp":
            template = _concat_template(shards, dtype)
            extra_inputs: list[str] = []
        elif node.op == "ResourceGather":
            if node.attr["batch_dims"].i != 0:
                raise StrategyError(f"variable {shards[0].var_name!r} is gathered with batch_dims="
                                    f"{node.attr['batch_dims'].i}; only 0 can be partitioned",
                                    variable=shards[0].var_name, field="partitioner")
            template = _gather_template(shards, dtype, tf.as_dtype(node.attr["Tindices"].type))
            extra_inputs = [data_inputs[1]]
        else:
            raise StrategyError(
                f"variable {shards[0].var_name!r} is used by op {node.name!r} of type {node.op}, "
                "which the partitioner cannot rewrite (only ReadVariableOp and ResourceGather)",
                variable=shards[0].var_name, field="partitioner", received=node.op)
        controls = [i for i in node.input if i.startswith("^")]
        _splice(out, node.name, template, shard_inputs + extra_inputs, controls)
    return out


def _strip_colocation(node, removed: str):
    if "_class" not in node.attr:
        return node
    keep = [c for c in node.attr["_class"].list.s if c != f"loc:@{removed}".encode()]
    copy = tf.compat.v1.NodeDef()
    copy.CopyFrom(node)
    del copy.attr["_class"]
    if keep:
        copy.attr["_class"].list.s.extend(keep)
    return copy


def _concat_template(shards: list[Shard], dtype) -> tuple[Callable, list]:
    axis = shards[0].axis

    def fn(*handles):
        reads = [tf.raw_ops.ReadVariableOp(resource=h, dtype=dtype) for h in handles]
        return tf.concat(reads, axis=axis)

    return fn, [tf.resource] * len(shards)


def _gather_template(shards: list[Shard], dtype, index_dtype) -> tuple[Callable, list]:
    offsets = [s.offset for s in shards]
    n = len(shards)

    def fn(*args):
        handles, ids = args[:n], args[n]
        flat = tf.reshape(ids, [-1])
        shard_of, local = _route(flat, offsets)
        positions = tf.dynamic_partition(tf.range(tf.size(flat)), shard_of, n)
        parts = tf.dynamic_partition(local, shard_of, n)
        rows = [tf.raw_ops.ResourceGather(resource=h, indices=p, dtype=dtype)
                for h, p in zip(handles, parts)]
        stitched = tf.dynamic_stitch(positions, rows)
        row_shape = tf.shape(stitched)[1:]
        return tf.reshape(stitched, tf.concat([tf.shape(ids), row_shape], 0))

    return fn, [tf.resource] * n + [index_dtype]


def _splice(out, name: str, template: tuple[Callable, list], inputs: list[str],
            controls: list[str]) -> None:
    """Adds the template's nodes under `name/`, with an Identity called `name`.

    The template is traced in a scratch graph with one placeholder per input;
    those placeholders are rewired to `inputs`, so consumers of `name:0`
    see the template's output in place of the op it replaces.
    """
    fn, dtypes = template
    scratch = tf.Graph()
    with scratch.as_default():
        placeholders = [tf.compat.v1.placeholder(dt, name=f"in_{i}")
                        for i, dt in enumerate(dtypes)]
        result = fn(*placeholders)
        tf.identity(result, name="result")
    rename = {f"in_{i}": src for i, src in enumerate(inputs)}
    prefix = f"{name}/autodist_"
    for node in scratch.as_graph_def().node:
        if node.name in rename:
            continue
        copy = out.node.add()
        copy.CopyFrom(node)
        copy.name = prefix + node.name
        del copy.input[:]
        for inp in node.input:
            control = inp.startswith("^")
            base, _, port = inp.lstrip("^").partition(":")
            if base in rename:
                target = rename[base]
                if port and port != "0":
                    raise AssertionError("template placeholders have one output")
                copy.input.append(("^" + op_name(target)) if control else target)
            else:
                copy.input.append(("^" if control else "") + prefix + base +
                                  (f":{port}" if port else ""))
        if "_class" in copy.attr:
            del copy.attr["_class"]
    identity = out.node.add(name=name, op="Identity", input=[prefix + "result"] + controls)
    identity.attr["T"].type = result.dtype.as_datatype_enum
