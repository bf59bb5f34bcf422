"""Replicator pass: variable storage and one compute replica per local device.

Storage follows the strategy. A shard synchronized by a parameter server is
one variable on its `reduction_destination`; every task's program creates it
under the same name, so TensorFlow's runtime shares it (the resource lives
on the PS task). A shard synchronized by all-reduce is mirrored: one copy per
replica, on the replica's device. State variables (batch-norm statistics) are
local to each replica.

A PS shard with `local_replication` also gets a local copy on this task's
CPU (not shared with other tasks): the task's replicas read the copy, so
repeated reads and several replicas cost no network. Updates still go to the
PS variable; the synchronizer refreshes the copy from it after each update.

Each local replica imports the (partitioned) step GraphDef on its device,
with the variable placeholders mapped to the storage handles; its inputs
stay placeholders to feed.
"""
from __future__ import annotations

import tensorflow as tf

from autodist.ir.strategy import Strategy
from autodist.kernels.optimizers import slot_initial_value
from autodist.kernels.program import Program, Replica, Shard, Stage
from autodist.kernels.variables import StorageVariable, VariableSpec, create_variables

SCOPE = "autodist"


def storage_device(shard: Shard, replica_device: str) -> str:
    """Where a shard lives for a replica: its PS, or the replica itself."""
    if shard.kind == "ps":
        return shard.synchronizer.ps.reduction_destination
    return replica_device


def storage_name(shard: Shard, replica_index: int | None) -> str:
    """Variable name of a shard (mirrored copies are named by replica)."""
    base = f"{SCOPE}/vars/{shard.name}"
    return base if shard.kind == "ps" else f"{base}/replica_{replica_index}"


def has_local_copy(shard: Shard) -> bool:
    """A PS shard whose replicas read a worker-local copy."""
    return shard.kind == "ps" and shard.synchronizer.ps.local_replication


def local_copy_name(shard: Shard) -> str:
    """Variable name of a shard's local copy (on each task's own CPU)."""
    return f"{SCOPE}/local/{shard.name}"


def apply(program: Program, strategy: Strategy) -> Program:
    """PARTITIONED -> REPLICATED: creates storage and imports the local replicas."""
    program.require(Stage.PARTITIONED, "replicator")
    if program.graph is None:
        program.graph = tf.Graph()
    local = program.local_replica_devices(strategy)
    _create_storage(program, [Replica(index=i, device=d) for i, d in local])
    with program.graph.as_default():
        for index, device in local:
            program.replicas.append(_import_replica(program, index, device))
    program.stage = Stage.REPLICATED
    return program


def get_storage(program: Program, shard: Shard, replica: Replica) -> StorageVariable:
    """The variable holding `shard` as `replica` sees it (created on first use)."""
    key = storage_name(shard, replica.index)
    if key not in program.storage:
        _create(program, _storage_specs(program, shard, replica))
    return program.storage[key]


def get_read_storage(program: Program, shard: Shard, replica: Replica) -> StorageVariable:
    """The variable `replica`'s step reads for `shard`: its local copy, or its storage."""
    storage = get_storage(program, shard, replica)
    if not has_local_copy(shard):
        return storage
    if shard.name not in program.local_copies:
        _create(program, [_local_copy_spec(program, shard)])
        program.local_copies[shard.name] = program.storage[local_copy_name(shard)]
    return program.local_copies[shard.name]


def get_slots(program: Program, shard: Shard, replica: Replica) -> dict[str, tf.Variable]:
    key = storage_name(shard, replica.index)
    info = program.graph_item.variable(shard.var_name)
    return {slot: program.storage[f"{key}/slot/{slot}"] for slot in info.slots}


def _storage_specs(program: Program, shard: Shard, replica: Replica) -> list[VariableSpec]:
    """The shard's variable as `replica` sees it, and its optimizer slots."""
    key = storage_name(shard, replica.index)
    device = storage_device(shard, replica.device)
    dtype = tf.as_dtype(shard.dtype)
    shape = tuple(shard.shape)
    specs = [VariableSpec(key, shape, dtype, device)]
    optimizer = program.graph_item.optimizer
    for slot in program.graph_item.variable(shard.var_name).slots:
        specs.append(VariableSpec(f"{key}/slot/{slot}", shape, dtype, device,
                                  slot_initial_value(optimizer, slot)))
    return specs


def _local_copy_spec(program: Program, shard: Shard) -> VariableSpec:
    return VariableSpec(local_copy_name(shard), tuple(shard.shape), tf.as_dtype(shard.dtype),
                        f"{program.task_prefix}device:CPU:0")


def _state_spec(state, replica: Replica) -> VariableSpec:
    return VariableSpec(f"{SCOPE}/state/{state.name}/replica_{replica.index}",
                        tuple(state.shape), tf.as_dtype(state.dtype), replica.device)


def _create_storage(program: Program, replicas: list[Replica]) -> None:
    """Creates every variable the replicas' steps read, in one import per device.

    Not a Keras variable: plain resource variables whose names (and so
    shared names) are the same in every task's program.
    """
    specs: dict[str, VariableSpec] = {}
    copied = []
    for replica in replicas:
        for var in program.graph_item.variables:
            for shard in program.shards[var.name]:
                if not shard.placeholder:
                    continue
                found = _storage_specs(program, shard, replica)
                if has_local_copy(shard):
                    found.append(_local_copy_spec(program, shard))
                    copied.append(shard)
                for spec in found:
                    specs.setdefault(spec.name, spec)
        for state in program.graph_item.state_variables:
            spec = _state_spec(state, replica)
            specs.setdefault(spec.name, spec)
    _create(program, [s for s in specs.values() if s.name not in program.storage])
    for shard in copied:
        program.local_copies.setdefault(shard.name, program.storage[local_copy_name(shard)])


def _create(program: Program, specs: list[VariableSpec]) -> None:
    """Creates variables into `program.storage`, by name."""
    for spec, var in zip(specs, create_variables(program.graph, specs)):
        program.storage[spec.name] = var


def _import_replica(program: Program, index: int, device: str) -> Replica:
    gi = program.graph_item
    replica = Replica(index=index, device=device)
    input_map = {}
    for var in gi.variables:
        for shard in program.shards[var.name]:
            if shard.placeholder:
                input_map[f"{shard.placeholder}:0"] = get_read_storage(program, shard,
                                                                       replica).handle
    for state in gi.state_variables:
        key = f"{SCOPE}/state/{state.name}/replica_{index}"
        if key not in program.storage:
            _create(program, [_state_spec(state, replica)])
        input_map[f"{state.handle_node}:0"] = program.storage[key].handle
    fetches = [gi.loss_tensor]
    for var in gi.variables:
        g = var.gradient
        fetches += [g.dense] if g.dense else [g.values, g.indices] if g.values else []
    update_ops = [op for state in gi.state_variables for op in state.update_ops]
    graph_def = _strip_devices(program.graph_def)
    with tf.device(device):
        outputs = tf.graph_util.import_graph_def(
            graph_def, input_map=input_map, return_elements=fetches + update_ops,
            name=f"{SCOPE}/replica_{index}")
    replica.loss = outputs[0]
    i = 1
    for var in gi.variables:
        g = var.gradient
        if g.dense:
            replica.gradients[var.name] = outputs[i]
            i += 1
        elif g.values:
            replica.gradients[var.name] = tf.IndexedSlices(
                outputs[i], outputs[i + 1], tf.constant(list(var.shape), outputs[i + 1].dtype))
            i += 2
    replica.state_updates = list(outputs[i:])
    graph = program.graph
    for info in gi.inputs:
        replica.inputs[info.name] = graph.get_tensor_by_name(
            f"{SCOPE}/replica_{index}/{info.tensor}")
    return replica


def _strip_devices(graph_def):
    """Clears devices and colocation constraints: the strategy decides placement.

    Colocation attributes (``_class``) would tie gradient ops to the reads of
    a variable, and so to its parameter server.
    """
    out = tf.compat.v1.GraphDef()
    out.CopyFrom(graph_def)
    for node in out.node:
        node.device = ""
        if "_class" in node.attr:
            del node.attr["_class"]
    return out
