"""Replicator pass: variable storage and one compute replica per local device.

Storage follows the strategy. A shard synchronized by a parameter server is
one variable on its `reduction_destination`; every task's program creates it
under the same name, so TensorFlow's runtime shares it (the resource lives
on the PS task). A shard synchronized by all-reduce is mirrored: one copy per
replica, on the replica's device. State variables (batch-norm statistics) are
local to each virtual node (each replica without virtual nodes).

A PS shard with `local_replication` also gets a local copy on this task's
CPU (not shared with other tasks): the task's replicas read the copy, so
repeated reads and several replicas cost no network. Updates still go to the
PS variable; the synchronizer refreshes the copy from it after each update.

Each local replica imports the (partitioned) step GraphDef on its device,
once per virtual node it runs (once without virtual nodes), with the
variable placeholders mapped to the storage handles; each virtual node's
inputs are placeholders to feed. A replica's virtual nodes run one after the
other and its gradient is theirs weighted by examples (`_accumulate`), so the
synchronizer sees one gradient per replica whatever the mapping. The weight
seeds each virtual node's backward pass where the step's seed is known
(`gradient_seed`), so no gradient is multiplied after the fact.
"""
from __future__ import annotations

import dataclasses
import re

import tensorflow as tf

from autodist.ir.device_names import input_op, op_name
from autodist.ir.graph_item import LOSS_SCALE_INPUT, GraphItem
from autodist.ir.strategy import Strategy
from autodist.kernels import batch_share, global_batch, loss_scaling
from autodist.kernels.optimizers import slot_initial_value
from autodist.kernels.program import Program, Replica, Shard, Stage, StorageRole, VirtualNode
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
    _create_storage(program, strategy, [Replica(index=i, device=d) for i, d in local])
    with program.graph.as_default():
        _create_tables(program)
        for index, device in local:
            program.replicas.append(_import_replica(program, strategy, index, device))
        program.metric_states = _task_metric_states(program)
    program.stage = Stage.REPLICATED
    return program


def _create_tables(program: Program) -> None:
    """This task's copy of every lookup table the step reads (`GraphItem.tables`), on its
    CPU; filled by `program.table_initializers` (run with the local variables)."""
    from tensorflow.core.framework import tensor_pb2

    def value(data: bytes):
        proto = tensor_pb2.TensorProto()
        proto.ParseFromString(data)
        return tf.constant(tf.make_ndarray(proto))

    with tf.device(f"{program.task_prefix}device:CPU:0"):
        for i, info in enumerate(program.graph_item.tables):
            handle = tf.raw_ops.HashTableV2(
                key_dtype=tf.as_dtype(info.key_dtype), value_dtype=tf.as_dtype(info.value_dtype),
                shared_name=f"{SCOPE}/table_{i}", name=f"{SCOPE}/table_{i}")
            program.tables[info.placeholder] = handle
            program.table_initializers.append(tf.raw_ops.LookupTableImportV2(
                table_handle=handle, keys=value(info.keys), values=value(info.values)))


def get_storage(program: Program, shard: Shard, replica: Replica) -> StorageVariable:
    """The variable holding `shard` as `replica` sees it (created on first use)."""
    key = storage_name(shard, replica.index)
    if key not in program.storage:
        _create(program, _storage_specs(program, shard, replica))
    return program.storage[key]


def state_storage_name(state_name: str, vn_index: int) -> str:
    """Variable name of a state variable's copy for virtual node `vn_index`."""
    return f"{SCOPE}/state/{state_name}/vn_{vn_index}"


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
    mirror = None if shard.kind == "ps" else replica.index
    specs = [VariableSpec(key, shape, dtype, device,
                          role=StorageRole("variable", shard=shard.name, replica=mirror))]
    optimizer = program.graph_item.optimizer
    for slot in program.graph_item.variable(shard.var_name).slots:
        specs.append(VariableSpec(f"{key}/slot/{slot}", shape, dtype, device,
                                  slot_initial_value(optimizer, slot),
                                  role=StorageRole("slot", shard=shard.name, slot=slot,
                                                   replica=mirror)))
    return specs


def _local_copy_spec(program: Program, shard: Shard) -> VariableSpec:
    return VariableSpec(local_copy_name(shard), tuple(shard.shape), tf.as_dtype(shard.dtype),
                        f"{program.task_prefix}device:CPU:0",
                        role=StorageRole("local_copy", shard=shard.name))


def _state_spec(state, vn_index: int, device: str) -> VariableSpec:
    return VariableSpec(state_storage_name(state.name, vn_index), tuple(state.shape),
                        tf.as_dtype(state.dtype), device,
                        role=StorageRole("state", state=state.name, virtual_node=vn_index))


def _create_storage(program: Program, strategy: Strategy, replicas: list[Replica]) -> None:
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
        for vn_index, device in enumerate(strategy.virtual_node_devices):
            if device != replica.device:
                continue
            for state in program.graph_item.state_variables:
                spec = _state_spec(state, vn_index, device)
                specs.setdefault(spec.name, spec)
    _create(program, [s for s in specs.values() if s.name not in program.storage])
    for shard in copied:
        program.local_copies.setdefault(shard.name, program.storage[local_copy_name(shard)])
    if loss_scaling.enabled(program.graph_item.optimizer):
        ps_shards = [s for var in program.graph_item.variables
                     for s in program.shards[var.name] if s.kind == "ps"]
        if ps_shards:
            loss_scaling.create_state(program, ps_shards[0].synchronizer.ps.reduction_destination,
                                      shared=True)
        else:
            loss_scaling.create_state(program, f"{program.task_prefix}device:CPU:0", shared=False)


def _create(program: Program, specs: list[VariableSpec]) -> None:
    """Creates variables into `program.storage`, by name."""
    for spec, var in zip(specs, create_variables(program.graph, specs)):
        program.storage[spec.name] = var
        program.roles[spec.name] = spec.role


def _import_replica(program: Program, strategy: Strategy, index: int,
                    device: str) -> Replica:
    """Imports one copy of the step per virtual node of the replica on `device`.

    The copies run one after the other (a copy's inputs wait for the
    previous copy's loss and gradients), so at most one copy's activations
    are alive. Each virtual node has its own state variables (batch-norm
    moving statistics), so they too do not depend on the mapping.
    """
    gi = program.graph_item
    replica = Replica(index=index, device=device)
    variable_map = _storage_map(program, replica)
    graph_def = global_batch.rewrite(
        _strip_devices(program.graph_def), gi, strategy, version=program.version,
        timeout_s=program.collective_timeout_s,
        hint="nccl" if "/device:GPU:" in device else "ring")
    program.step_collectives = global_batch.sums_over_replicas(gi, strategy)
    vn_indices = [v for v, d in enumerate(strategy.virtual_node_devices) if d == device]
    # Where its examples sit in the global batch: for random draws and sums.
    copies = _StepCopies(graph_def, {node.name: node for node in graph_def.node}, variable_map,
                         draws=batch_share.uses_inputs(graph_def), single=len(vn_indices) == 1)
    # One feed per input for the whole replica (its virtual nodes' examples
    # one after the other), split in the graph: each fed tensor costs a
    # session run over gRPC about as much as a small op.
    with tf.device(device):
        _feed_placeholders(program, strategy, replica, copies)
        if not copies.single:
            _split_by_virtual_node(strategy, replica, copies, vn_indices)
    # Each virtual node's weight seeds its backward pass where the seed is
    # known: its gradients come out weighted, with no multiply per gradient.
    copies.seed = None if copies.single else gradient_seed(
        graph_def, gi.loss_tensor, [v.gradient.dense or v.gradient.values for v in gi.variables
                                    if v.gradient.dense or v.gradient.values])
    gate: list[tf.Operation] = []
    for position, vn_index in enumerate(vn_indices):
        vn = _import_virtual_node(program, replica, copies, position, vn_index, gate)
        gate = _produced(vn)
        replica.virtual_nodes.append(vn)
    _accumulate(replica, copies.single)
    return replica


@dataclasses.dataclass
class _StepCopies:
    """What the imports of the step for one replica's virtual nodes share.

    Attributes:
        graph_def: The step, rewritten for the global batch.
        input_nodes: Its nodes by name.
        variable_map: Its variable and table placeholders -> this replica's
            storage handles and tables (and the loss scale input).
        draws: The step reads where its examples sit in the global batch.
        single: The replica runs one virtual node.
        parts: With several virtual nodes, input name -> each one's part.
        weights: With several virtual nodes, each one's share of the examples.
        seed: The tensor seeding the backward pass, fed each one's weight.
    """

    graph_def: tf.compat.v1.GraphDef
    input_nodes: dict
    variable_map: dict
    draws: bool
    single: bool
    parts: dict[str, list[tf.Tensor]] | None = None
    weights: list[tf.Tensor] | None = None
    seed: str | None = None


def _storage_map(program: Program, replica: Replica) -> dict:
    """The step's variable and table placeholders -> what `replica` reads for them."""
    variable_map = {}
    for var in program.graph_item.variables:
        for shard in program.shards[var.name]:
            if shard.placeholder:
                variable_map[f"{shard.placeholder}:0"] = get_read_storage(program, shard,
                                                                          replica).handle
    for placeholder, handle in program.tables.items():
        variable_map[f"{placeholder}:0"] = handle
    return variable_map


def _feed_placeholders(program: Program, strategy: Strategy, replica: Replica,
                       copies: _StepCopies) -> None:
    """The replica's fed tensors: its share of the global batch (every step), its
    inputs, and where needed the sizes of every virtual node's batch."""
    gi = program.graph_item
    index = replica.index
    replica.scale = tf.compat.v1.placeholder(tf.float32, [], name=f"{SCOPE}/scale_{index}")
    loss_scale = loss_scaling.state_of(program)
    if loss_scale is not None and LOSS_SCALE_INPUT in copies.input_nodes:
        # Each example's part of the backward pass as in Keras' one batch.
        copies.variable_map[f"{LOSS_SCALE_INPUT}:0"] = \
            loss_scaling.read_scale(loss_scale) * replica.scale
    for info in gi.inputs:
        node = copies.input_nodes[op_name(info.tensor)]
        dtype = tf.as_dtype(node.attr["dtype"].type)
        shape = tf.TensorShape(node.attr["shape"].shape)
        name = f"{SCOPE}/replica_{index}/input/{info.name}"
        if info.role == "sample_weight" and gi.model_inputs:
            # Fed only when the data has weights: by default each value of the
            # target's loss weighs 1 (the leading dimensions of its target).
            replica.inputs[info.name] = tf.compat.v1.placeholder_with_default(
                tf.ones(_default_weight_shape(gi, info, replica), dtype), shape,
                name=name)
        else:
            replica.inputs[info.name] = tf.compat.v1.placeholder(dtype, shape, name=name)
    if copies.draws:
        replica.all_sizes = tf.compat.v1.placeholder(
            tf.int32, [strategy.num_virtual_nodes], name=f"{SCOPE}/replica_{index}/all_sizes")


def _split_by_virtual_node(strategy: Strategy, replica: Replica, copies: _StepCopies,
                           vn_indices: list[int]) -> None:
    """Each virtual node's part of the replica's inputs, and its weight."""
    # Fed only when a step's sizes differ (a smaller last batch): one
    # feed fewer per step.
    per = strategy.global_batch_size // strategy.num_virtual_nodes
    replica.default_sizes = [per] * len(vn_indices)
    replica.sizes = tf.compat.v1.placeholder_with_default(
        tf.constant(replica.default_sizes, tf.int32), [len(vn_indices)],
        name=f"{SCOPE}/replica_{replica.index}/vn_sizes")
    copies.parts = {name: tf.split(placeholder, replica.sizes, num=len(vn_indices))
                    for name, placeholder in replica.inputs.items()}
    sizes = tf.cast(replica.sizes, tf.float32)
    copies.weights = tf.unstack(sizes / tf.maximum(tf.reduce_sum(sizes), 1.0),
                                num=len(vn_indices))


def _import_virtual_node(program: Program, replica: Replica, copies: _StepCopies,
                         position: int, vn_index: int, gate: list[tf.Operation]) -> VirtualNode:
    """Imports the step for virtual node `vn_index` (the replica's `position`-th),
    its inputs waiting for `gate`."""
    gi = program.graph_item
    index = replica.index
    scope = f"{SCOPE}/replica_{index}" if copies.single else \
        f"{SCOPE}/replica_{index}/vn_{vn_index}"
    vn = VirtualNode(index=vn_index)
    input_map = dict(copies.variable_map)
    with tf.device(replica.device):
        for info in gi.inputs:
            tensor = replica.inputs[info.name] if copies.single else \
                copies.parts[info.name][position]
            vn.inputs[info.name] = tensor
            input_map[info.tensor] = _after(tensor, gate)
        if not copies.single:
            vn.weight = copies.weights[position]
            if copies.seed is not None:
                input_map[copies.seed] = tf.cast(vn.weight, tf.as_dtype(
                    copies.input_nodes[input_op(copies.seed)].attr["dtype"].type))
                vn.weighted = True
        for state in gi.state_variables:
            key = state_storage_name(state.name, vn_index)
            input_map[f"{state.handle_node}:0"] = program.storage[key].handle
        if copies.draws:
            input_map.update(_draw_rows(replica, vn, vn_index, gi))
        step = _seeded(copies.graph_def, vn_index)
        if gi.jit_compile:
            step = _compiled(step, f"{SCOPE}_jit_{index}_{vn_index}")
        fetches = _fetches(gi)
        outputs = tf.graph_util.import_graph_def(step, input_map=input_map,
                                                 return_elements=fetches, name=scope)
    _unpack(gi, vn, replica, outputs)
    return vn


def _fetches(gi: GraphItem) -> list[str]:
    """What an import of the step returns: the loss, the gradients (dense, or
    values and indices), the metric states and the state updates."""
    fetches = [gi.loss_tensor]
    for var in gi.variables:
        g = var.gradient
        fetches += [g.dense] if g.dense else [g.values, g.indices] if g.values else []
    fetches += [m.tensor for m in gi.metric_states]
    return fetches + [op for state in gi.state_variables for op in state.update_ops]


def _unpack(gi: GraphItem, vn: VirtualNode, replica: Replica, outputs: list) -> None:
    """Sorts an import's `outputs` (as `_fetches` lists them) into `vn` and `replica`."""
    vn.loss = outputs[0]
    i = 1
    for var in gi.variables:
        g = var.gradient
        if g.dense:
            vn.gradients[var.name] = outputs[i]
            i += 1
        elif g.values:
            vn.gradients[var.name] = tf.IndexedSlices(
                outputs[i], outputs[i + 1],
                tf.constant(list(var.shape), outputs[i + 1].dtype))
            i += 2
    vn.metric_states = list(outputs[i:i + len(gi.metric_states)])
    i += len(gi.metric_states)
    replica.state_updates += list(outputs[i:])


def _draw_rows(replica: Replica, vn: VirtualNode, vn_index: int, gi) -> dict[str, tf.Tensor]:
    """Where virtual node `vn_index`'s examples sit in the global batch (`batch_share`):
    the batch's examples, its first one, and its own."""
    sizes = replica.all_sizes
    first_input = vn.inputs[gi.model_inputs[0].name] if gi.model_inputs else None
    local = tf.shape(first_input)[0] if first_input is not None else sizes[vn_index]
    return {f"{batch_share.EXAMPLES}:0": tf.reduce_sum(sizes),
            f"{batch_share.FIRST}:0": tf.reduce_sum(sizes[:vn_index]),
            f"{batch_share.LOCAL}:0": tf.cast(local, tf.int32)}


def _default_weight_shape(gi, info, replica: Replica):
    """The shape of unit sample weights for weight input `info`: its own dimensions
    where the capture fixed them (a loss returning (batch, 1) per example, as
    `ctc_batch_cost`), else its target's (as many as the weights have), else the
    examples."""
    weights = gi.sample_weight_inputs
    targets = gi.target_inputs
    k = next(i for i, w in enumerate(weights) if w.name == info.name)
    if k < len(targets) and targets[k].name in replica.inputs and info.shape:
        target = replica.inputs[targets[k].name]
        if all(d < 0 for d in info.shape[1:]) or target.shape.rank is None:
            return tf.shape(target)[:len(info.shape)]
        dims = [d if d >= 0 else tf.shape(target)[i] if i < target.shape.rank else 1
                for i, d in enumerate(info.shape)]
        return tf.stack([tf.cast(d, tf.int32) for d in dims])
    return tf.shape(replica.inputs[gi.model_inputs[0].name])[:1]


def _task_metric_states(program: Program) -> list:
    """Per metric variable, this task's contribution to its state in a step: the sum
    over its replicas' virtual nodes (each one's batch contribution)."""
    vns = [vn for replica in program.replicas for vn in replica.virtual_nodes]
    if not vns or not vns[0].metric_states:
        return []
    with tf.device(f"{program.task_prefix}device:CPU:0"):
        return [tf.add_n([vn.metric_states[k] for vn in vns]) if len(vns) > 1
                else tf.identity(vns[0].metric_states[k])
                for k in range(len(vns[0].metric_states))]


# What the capture's tape (``ones``, at the top level) and ``tf.gradients``
# (``gradients/grad_ys_0/Const``) name the constant 1 seeding the backward pass.
_SEED_NAME = re.compile(r"ones(_\d+)?|(.*/)?gradients(_\d+)?/grad_ys_\d+/Const")


def gradient_seed(graph_def, loss: str, gradients: list[str]) -> str | None:
    """The tensor seeding the step's backward pass (d loss / d loss = 1), or None.

    Backpropagation is linear in its seed, so feeding a weight ``w`` there
    gives the gradients of ``w * loss`` with no multiply per gradient (only
    a `tf.custom_gradient` that is not linear in its upstream gradient, one
    clipping it say, would tell the difference). The
    seed is recognized conservatively: a scalar floating constant 1 named as
    the tape or ``tf.gradients`` names it, not used to compute the loss, from
    which every gradient is computed; None unless exactly one node fits
    (then the gradients are weighted after the fact).

    Args:
        graph_def: The step.
        loss: The loss tensor's name.
        gradients: The names of the gradient tensors (dense, or the values
            of sparse ones).
    """
    nodes = {node.name: node for node in graph_def.node}
    consumers: dict[str, list[str]] = {}
    for node in graph_def.node:
        for name in node.input:
            consumers.setdefault(input_op(name), []).append(node.name)
    forward = _closure([input_op(loss)], lambda n: [input_op(i) for i in nodes[n].input]
                       if n in nodes else [])
    targets = {input_op(g) for g in gradients}
    found = []
    for node in graph_def.node:
        if (node.op != "Const" or node.name in forward or not _SEED_NAME.fullmatch(node.name)
                or not tf.as_dtype(node.attr["dtype"].type).is_floating):
            continue
        value = tf.make_ndarray(node.attr["value"].tensor)
        if value.shape != () or value != 1:
            continue
        if targets <= _closure([node.name], lambda n: consumers.get(n, [])):
            found.append(node.name)
    return f"{found[0]}:0" if len(found) == 1 else None


def _closure(start: list[str], step) -> set[str]:
    seen, todo = set(), list(start)
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo += step(current)
    return seen


def _after(tensor, gate: list[tf.Operation]):
    """`tensor`, or an identity of it that waits for `gate`."""
    if not gate:
        return tensor
    with tf.control_dependencies(gate):
        return tf.identity(tensor)


def _produced(vn: VirtualNode) -> list[tf.Operation]:
    ops = [vn.loss.op]
    for grad in vn.gradients.values():
        if isinstance(grad, tf.IndexedSlices):
            ops += [grad.values.op, grad.indices.op]
        else:
            ops.append(grad.op)
    return ops


def _accumulate(replica: Replica, single: bool) -> None:
    """The replica's loss and gradients: its virtual nodes', weighted by examples.

    Each virtual node's weight is its share of the replica's examples (from
    the sizes), so the result is the gradient of the replica's mean loss, as
    if it had run all its examples in one batch. Gradients the weight seeded
    are summed as they are; others are multiplied by it first. Sparse
    gradients are concatenated.
    """
    if single:
        vn = replica.virtual_nodes[0]
        replica.loss, replica.gradients = vn.loss, dict(vn.gradients)
        return
    with tf.device(replica.device):
        replica.loss = tf.add_n([tf.cast(vn.loss, tf.float32) * vn.weight
                                 for vn in replica.virtual_nodes])
        for name, first in replica.virtual_nodes[0].gradients.items():
            grads = [_weighted(vn.gradients[name], vn) for vn in replica.virtual_nodes]
            if isinstance(first, tf.IndexedSlices):
                replica.gradients[name] = tf.IndexedSlices(
                    tf.concat([g.values for g in grads], 0),
                    tf.concat([g.indices for g in grads], 0), first.dense_shape)
            else:
                replica.gradients[name] = tf.add_n(grads)


def _weighted(grad, vn: VirtualNode):
    """`vn`'s gradient times its weight (as it is when the weight seeded it)."""
    if vn.weighted:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(vn.weight, grad.values.dtype),
                                grad.indices, grad.dense_shape)
    return grad * tf.cast(vn.weight, grad.dtype)


# Keeps the seeds of different virtual nodes apart (a prime below 2**31).
_SEED_STRIDE = 1_000_003


def _seeded(graph_def, vn_index: int):
    """The step with its random ops seeded by virtual node.

    Ops with a fixed seed get ``seed2`` offset by the virtual-node index, so
    each virtual node draws its own numbers and which device runs it does
    not matter. Virtual node 0 keeps the captured seeds.
    """
    if vn_index == 0 or not any(node.attr["seed2"].i or node.attr["seed"].i
                                for node in graph_def.node if "seed2" in node.attr):
        return graph_def
    out = tf.compat.v1.GraphDef()
    out.CopyFrom(graph_def)
    for node in out.node:
        if "seed2" in node.attr and (node.attr["seed"].i or node.attr["seed2"].i):
            node.attr["seed2"].i = (node.attr["seed2"].i + vn_index * _SEED_STRIDE) % 2 ** 31
    return out


def _compiled(graph_def, scope: str):
    """The step marked for XLA, as Keras' `jit_compile`: every op XLA can compile joins
    the clusters of `scope` (ops it cannot, such as lookups and string ops, stay out;
    the step's own collectives and its variable reads and writes are kept out)."""
    out = tf.compat.v1.GraphDef()
    out.CopyFrom(graph_def)
    for node in out.node:
        if node.op in _NOT_COMPILED or node.op.startswith("Collective") or \
                "Variable" in node.op or "Resource" in node.op:
            continue
        node.attr["_XlaCompile"].b = True
        node.attr["_XlaScope"].s = scope.encode()
    return out


# Ops kept out of XLA clusters: inputs, and reads and writes of variables, which run
# where the variables live (a parameter server, another task).
_NOT_COMPILED = {"Placeholder", "PlaceholderWithDefault"}


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
