"""All-reduce synchronizer: collective reduction of mirrored shards' gradients.

Dense gradients of the shards sharing a `group` are flattened into one buffer
and summed with ``CollectiveReduceV2`` across all replicas; sparse gradients
are all-gathered (indices and values, padded to the largest replica; every
sparse shard of one wire dtype in the same three collectives), or,
under spec RING or NCCL, densified (rows summed into the shard's shape) and
reduced in their group like dense ones: that moves the shard instead of one
row per lookup, less when a step looks up more rows than the shard has. For
optimizers that square the gradient, a densified shard also reduces the sum of
its rows' squares, so repeated rows are squared one by one as Keras does. Keys are
deterministic functions of the strategy, never hashes: every replica of every
task builds the same collectives with the same keys.

Compressors: ``FP16`` casts the wire buffer to float16 and back (the
collective sums in float16). ``FP16_ERROR_FEEDBACK`` also keeps, per replica
and all-reduced shard, a residual variable: the part of its (corrected)
gradient the cast did not send. Each step sends fp16(g + e) and keeps
e' = (g + e) - fp16(g + e), so what a replica has sent over the steps plus
its residual is exactly what it had to send. The residual is written once
the step's collective is done: between two steps every replica's residual
is that of the same step (a checkpoint reads them there), and a step whose
collective fails leaves it unchanged. Residuals are by shard and replica
(`StorageRole` "residual"), not by fused group, so they keep their meaning
when a new strategy groups or partitions the variables differently.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import tensorflow as tf

from autodist.ir.graph_item import optimizer_squares_gradient
from autodist.ir.strategy import is_gathered, sums_by_gathering
from autodist.kernels import loss_scaling
from autodist.kernels.optimizers import ReducedGradient, Slots
from autodist.kernels.program import Program, Replica, Shard, StorageRole
from autodist.kernels.replicator import get_slots, get_storage
from autodist.kernels.sync_lowering import Lowered, StepStart, atomic_updates
from autodist.kernels.variables import StorageVariable, VariableSpec, create_variables
from autodist.proto import strategy_pb2

ARSync = strategy_pb2.AllReduceSynchronizer
GROUP_KEY = 1
_KEYS_PER_COLLECTIVE = 4


def gathers(shard: Shard) -> bool:
    """Whether an all-reduce shard's gradient is all-gathered as rows (else reduced)."""
    return is_gathered(shard.synchronizer.all_reduce, shard.sparse)


@dataclasses.dataclass
class Reduced:
    """Summed gradients of a replica's all-reduce shards.

    Attributes:
        gradients: Shard name -> the sum over all replicas (dense, or
            IndexedSlices for an all-gathered shard).
        squares: Shard name -> the summed squares of the rows of a densified
            sparse shard (only with `squares=True`), the `grad_square` Keras
            would compute from all the rows.
    """

    gradients: dict[str, object]
    squares: dict[str, object]


@dataclasses.dataclass
class CollectiveConfig:
    """Options of the collectives of one program.

    Attributes:
        group_size: Number of replicas in the whole job.
        timeout_s: A collective waiting longer than this fails (no hang).
        version: Membership version of an elastic job: the group key is
            `GROUP_KEY + version`, as TensorFlow aborts every collective of a
            process that joins a known group key with another size.
    """

    group_size: int
    timeout_s: float
    version: int = 0

    @property
    def group_key(self) -> int:
        return GROUP_KEY + self.version


def gather_bucket(shard: Shard) -> tuple[bool, str]:
    """The all-gather a gathered shard's rows travel in: (values cast to float16,
    values dtype). Every sparse shard with the same bucket shares its collectives."""
    return shard.synchronizer.all_reduce.compressor != ARSync.NONE, shard.dtype


def instance_keys(shards: list[Shard]) -> dict[tuple, int]:
    """Deterministic instance-key bases.

    A dense group gets one key base per group id; each all-gather bucket
    (`gather_bucket`: the sparse shards whose rows travel together) gets its
    own base after all groups, leaving room for its three collectives. The
    shapes of an all-gather change from step to step, and TensorFlow keeps
    the shape of a collective instance, so all-gathers add
    `step * ("stride", 0)` to their base: a new instance every step.
    """
    groups = sorted({s.synchronizer.all_reduce.group for s in shards if not gathers(s)})
    keys: dict[tuple, int] = {}
    for g in groups:
        keys[("group", g)] = 1 + _KEYS_PER_COLLECTIVE * g
    base = 1 + _KEYS_PER_COLLECTIVE * (max(groups, default=-1) + 1)
    buckets = sorted({gather_bucket(s) for s in shards if gathers(s)})
    for i, bucket in enumerate(buckets):
        keys[("gather", bucket)] = base + _KEYS_PER_COLLECTIVE * i
    keys[("stride", 0)] = _KEYS_PER_COLLECTIVE * max(1, len(buckets))
    return keys


def reduce_gradients(program: Program, replica: Replica, shards: list[Shard],
                     gradients: dict[str, object], config: CollectiveConfig,
                     step, squares: bool = False) -> Reduced:
    """All-reduces one replica's (scaled) gradients of all-reduce shards.

    Args:
        program: The program (for error-feedback residual variables).
        replica: The local replica the collectives run for.
        shards: Every all-reduce shard of the strategy, in a fixed order.
        gradients: Shard name -> this replica's gradient (dense or IndexedSlices).
        config: Group size and timeout.
        step: The number of updates applied before this step (int64 tensor),
            for the keys of all-gathers and the residuals' step count.
        squares: The optimizer squares the gradient: densified sparse shards
            also reduce their rows' squares.

    Returns:
        The summed gradients (and squares) over all replicas.
    """
    keys = instance_keys(shards)
    out = Reduced({}, {})
    groups: dict[int, list[Shard]] = {}
    buckets: dict[tuple[bool, str], list[Shard]] = {}
    for s in shards:
        if s.name not in gradients:
            continue
        if gathers(s):
            buckets.setdefault(gather_bucket(s), []).append(s)
        else:
            groups.setdefault(s.synchronizer.all_reduce.group, []).append(s)
    for bucket, members in sorted(buckets.items()):
        key = keys[("gather", bucket)] + tf.cast(step, tf.int32) * keys[("stride", 0)]
        out.gradients.update(_all_gather(members, [gradients[s.name] for s in members], key,
                                         config, members[0].synchronizer.all_reduce))
    shapes: dict[tuple[int, ...], tf.Tensor] = {}

    def shape_constant(shape) -> tf.Tensor:
        # One constant per shape (a ResNet has hundreds of shards, few shapes).
        key = tuple(shape)
        if key not in shapes:
            shapes[key] = tf.constant(list(key), tf.int32)
        return shapes[key]

    reduced = []  # per group: (places, sizes, error feedback, the summed buffer)
    for group, members in sorted(groups.items()):
        sync = members[0].synchronizer.all_reduce
        parts, places = [], []  # flat tensors, and (shard, is its square) of each
        for s in members:
            grad = gradients[s.name]
            if isinstance(grad, tf.IndexedSlices):
                parts.append(_densify(grad.values, grad.indices, s.shape))
                places.append((s, False))
                if squares:
                    parts.append(_densify(tf.square(grad.values), grad.indices, s.shape))
                    places.append((s, True))
            else:
                parts.append(grad)
                places.append((s, False))
        if config.group_size == 1 and sync.compressor == ARSync.NONE:
            # One replica: nothing to sum, so nothing to fuse (no concat, no split).
            for (s, is_square), part in zip(places, parts):
                (out.squares if is_square else out.gradients)[s.name] = part
            continue
        residuals = error_feedback_residuals(program, replica, places) \
            if sync.compressor == ARSync.FP16_ERROR_FEEDBACK else None
        sizes = [tf.TensorShape(s.shape).num_elements() for s, _ in places]
        # Each part to its shard's size (not -1): the buffer's static shape, which
        # `_collective_reduce` reads, holds where a gradient's shape is dynamic.
        flat = tf.concat([tf.reshape(p, shape_constant([n])) for p, n in zip(parts, sizes)],
                         axis=0)
        reduced.append((places, sizes, residuals is not None,
                        _reduce(flat, tf.constant(keys[("group", group)]), config, sync,
                                residuals, sizes)))
    kept = [r for _, _, feedback, r in reduced if feedback]
    if kept:
        # Once every residual of the step is written, its step count (see `residual_step`).
        with tf.control_dependencies(kept):
            stamp = residual_step(program, replica).assign(tf.cast(step, tf.int64) + 1,
                                                           read_value=False)
        with tf.control_dependencies([stamp]):
            reduced = [(p, z, f, tf.identity(r) if f else r) for p, z, f, r in reduced]
    for places, sizes, _, summed in reduced:
        for (s, is_square), part in zip(places, tf.split(summed, sizes)):
            target = out.squares if is_square else out.gradients
            target[s.name] = tf.reshape(part, shape_constant(s.shape))
    return out


def _densify(values, indices, shape) -> tf.Tensor:
    """Rows (one per lookup, repeats allowed) summed into a dense tensor of `shape`."""
    return tf.math.unsorted_segment_sum(values, indices, shape[0])


def _hint(sync) -> str:
    return "nccl" if sync.spec == ARSync.NCCL else "ring"


def collective_sum(tensor, key, config: CollectiveConfig, hint: str = "ring"):
    """The sum of `tensor` over the group's replicas (instance `key`)."""
    return _collective_reduce(tensor, key, config, hint)


def _collective_reduce(tensor, key, config: CollectiveConfig, hint: str):
    if config.group_size == 1:
        return tf.identity(tensor)  # one replica: nothing to reduce
    if hint == "ring" and tensor.shape.is_fully_defined() and sums_by_gathering(
            tensor.shape.num_elements() * tensor.dtype.size, config.group_size,
            tensor.dtype.size):
        # Every replica's tensor in one exchange, summed in replica order.
        gathered = _collective_gather(tf.reshape(tensor, [1, -1]), key, config, hint)
        return tf.reshape(tf.reduce_sum(gathered, axis=0), tensor.shape)
    return tf.raw_ops.CollectiveReduceV2(
        input=tensor, group_size=tf.constant(config.group_size),
        group_key=tf.constant(config.group_key), instance_key=key, ordering_token=[],
        merge_op="Add", final_op="Id", communication_hint=hint,
        timeout_seconds=config.timeout_s)


def _collective_gather(tensor, key, config: CollectiveConfig, hint: str):
    if config.group_size == 1:
        return tf.identity(tensor)  # one replica: nothing to gather
    return tf.raw_ops.CollectiveGatherV2(
        input=tensor, group_size=tf.constant(config.group_size),
        group_key=tf.constant(config.group_key), instance_key=key, ordering_token=[],
        communication_hint=hint, timeout_seconds=config.timeout_s)


def _reduce(flat, key, config: CollectiveConfig, sync,
            residuals: list[StorageVariable] | None = None, sizes: list[int] | None = None):
    """Sums a replica's flat buffer over all replicas, through its compressor.

    Args:
        flat: The replica's fused gradients (any static shape).
        key: The collective's instance key.
        config: Group size and timeout.
        sync: The group's AllReduceSynchronizer.
        residuals: With error feedback, the residual variable of each part of
            `flat`, in order.
        sizes: The number of elements of each part (with `residuals`).
    """
    dtype = flat.dtype
    if sync.compressor == ARSync.NONE:
        return _collective_reduce(flat, key, config, _hint(sync))
    if sync.compressor == ARSync.FP16:
        wire = tf.cast(flat, tf.float16)
        return tf.cast(_collective_reduce(wire, key, config, _hint(sync)), dtype)
    corrected = flat + tf.concat([tf.reshape(r.read_value(), [-1]) for r in residuals], axis=0)
    wire = tf.cast(corrected, tf.float16)
    reduced = _collective_reduce(wire, key, config, _hint(sync))
    # Kept only once the step's collective is done (see the module docstring).
    with tf.control_dependencies([reduced]):
        kept = corrected - tf.cast(wire, dtype)
    writes = [r.assign(tf.reshape(part, r.shape), read_value=False)
              for r, part in zip(residuals, tf.split(kept, sizes))]
    with tf.control_dependencies(writes):
        return tf.cast(reduced, dtype)


def has_residual(shard: Shard) -> bool:
    """An all-reduced shard whose compressor keeps an error-feedback residual."""
    return shard.kind == "all_reduce" and not gathers(shard) and \
        shard.synchronizer.all_reduce.compressor == ARSync.FP16_ERROR_FEEDBACK


def residual_spec(shard: Shard, replica: int, device: str,
                  square: bool = False) -> VariableSpec:
    """The residual variable of `shard` kept by replica `replica` (on `device`).

    Its name (the shared name of its resource) depends on the shard and the
    replica only, so any program of the job can name another replica's.

    Args:
        shard: An all-reduced shard with error feedback.
        replica: The replica's index among the strategy's replicas.
        device: The replica's device.
        square: The residual of the shard's summed squares (a densified
            sparse shard under an optimizer that squares the gradient).
    """
    kind = "residual_square" if square else "residual"
    return VariableSpec(f"autodist/{kind}/{shard.name}/replica_{replica}", tuple(shard.shape),
                        tf.as_dtype(shard.dtype), device,
                        role=StorageRole("residual", shard=shard.name, replica=replica,
                                         square=square))


def residual_step_spec(replica: int, device: str) -> VariableSpec:
    """The step count of replica `replica`'s residuals (see `residual_step`)."""
    return VariableSpec(f"autodist/residual_step/replica_{replica}", (), tf.int64, device,
                        role=StorageRole("residual_step", replica=replica))


def residual_step(program: Program, replica: Replica) -> StorageVariable:
    """How many updates had been applied when `replica` last wrote its residuals.

    A replica writes its residuals once its step's collectives are done, so
    its peers may finish the step before it has written them; it writes this
    count after them. A task that reads another replica's residuals between
    steps waits until its count is that of the step (it cannot run ahead: its
    next write waits for the next step's collective).
    """
    spec = residual_step_spec(replica.index, replica.device)
    if spec.name not in program.storage:
        program.storage[spec.name] = create_variables(program.graph, [spec])[0]
        program.roles[spec.name] = spec.role
    return program.storage[spec.name]


def error_feedback_residuals(program: Program, replica: Replica,
                             places: list[tuple[Shard, bool]]) -> list[StorageVariable]:
    """The residual variables of one replica's parts of a group (created on first use).

    Args:
        program: The program (its storage and roles get the new variables).
        replica: The replica that keeps them.
        places: (shard, is its square) of each part of the group's buffer.
    """
    specs = [residual_spec(s, replica.index, replica.device, square) for s, square in places]
    new = [spec for spec in specs if spec.name not in program.storage]
    for spec, var in zip(new, create_variables(program.graph, new)):
        program.storage[spec.name] = var
        program.roles[spec.name] = spec.role
    return [program.storage[spec.name] for spec in specs]


def _all_gather(members: list[Shard], grads: list[tf.IndexedSlices], key, config,
                sync) -> dict[str, tf.IndexedSlices]:
    """Every replica's rows of several sparse shards, in three collectives.

    Each shard's rows are padded to the longest replica's (index 0, value 0:
    nothing added), then the shards' counts, values (flattened) and indices
    (as int64) travel together. Each shard gets back exactly what gathering
    it alone would give: every replica's padded rows, replica after replica.

    Args:
        members: The shards of one `gather_bucket`.
        grads: This replica's gradient of each (IndexedSlices).
        key: The instance key of the first of the three collectives.
        config: Group size and timeout.
        sync: The shards' AllReduceSynchronizer (its compressor).
    """
    hint = _hint(sync)
    counts = tf.stack([tf.shape(g.indices, out_type=tf.int32)[0] for g in grads])
    every_count = tf.reshape(_collective_gather(counts, key, config, hint), [-1, len(grads)])
    longest = tf.reduce_max(every_count, axis=0)  # per shard
    values, indices, widths = [], [], []
    for i, (s, g) in enumerate(zip(members, grads)):
        rows = g.values if sync.compressor == ARSync.NONE else tf.cast(g.values, tf.float16)
        pad = longest[i] - counts[i]
        width = tf.TensorShape(s.shape[1:]).num_elements()
        rows = tf.pad(tf.reshape(rows, [-1, width]), [[0, pad], [0, 0]])
        values.append(tf.reshape(rows, [-1]))
        indices.append(tf.pad(tf.cast(g.indices, tf.int64), [[0, pad]]))
        widths.append(width)
    every_value = _collective_gather(tf.concat(values, 0), key + 1, config, hint)
    every_index = _collective_gather(tf.concat(indices, 0), key + 2, config, hint)
    per_replica_values = tf.reshape(every_value, [config.group_size, -1])
    per_replica_indices = tf.reshape(every_index, [config.group_size, -1])
    value_parts = tf.split(per_replica_values,
                           [longest[i] * w for i, w in enumerate(widths)], axis=1)
    index_parts = tf.split(per_replica_indices, [longest[i] for i in range(len(grads))],
                           axis=1)
    out = {}
    for s, g, rows, ids in zip(members, grads, value_parts, index_parts):
        rows = tf.reshape(rows, [-1] + list(s.shape[1:]))
        if sync.compressor != ARSync.NONE:
            rows = tf.cast(rows, g.values.dtype)
        out[s.name] = tf.IndexedSlices(rows, tf.cast(tf.reshape(ids, [-1]), g.indices.dtype),
                                       g.dense_shape)
    return out


# Group keys of the version tags: one single-member group per task, far from
# the job's group keys.
_TAG_GROUP_KEY = 1_000_000


def version_tag(task_index: int, version: int, device: str,
                timeout_s: float = 60.0) -> tf.Operation:
    """An op that starts a fresh collective step sequence for `version`.

    TensorFlow numbers the steps of a graph's collectives from a sequence per
    graph key, and a graph with only V2 collectives always gets the same key:
    after a resize, a task that ran fewer collective steps than its peers
    would be out of step with them (their collectives time out). A V1
    collective's static instance key enters the graph key, so one trivial
    V1 collective (a group of one, per task) with the version as instance
    key gives each membership version its own sequence. Run it in every
    step of a program with collectives. `timeout_s` as `SyncOptions.timeout_s`.
    """
    with tf.device(device):
        return tf.raw_ops.CollectiveReduce(
            input=tf.zeros([], tf.float32), group_size=1,
            group_key=_TAG_GROUP_KEY + task_index, instance_key=version + 1,
            merge_op="Add", final_op="Id", subdiv_offsets=[], timeout_seconds=timeout_s).op


class AllReduceLowering:
    """All-reduce shards: each replica reduces its gradients, then updates its own copy.

    Every replica holds every all-reduced gradient, so each clips its own
    (one clipping group) and applies the same updates to its mirrored copy.
    Under loss scaling one flag of finite gradients (the first replica's, as
    all are the same) advances the scale.
    """

    def lower(self, step: StepStart, shards: Sequence[Shard]) -> Lowered:
        """Builds the collectives and mirrored updates of `shards` (see `SynchronizerLowering`)."""
        results = []
        for replica in step.program.replicas:
            with tf.device(replica.device):
                results += self._reduce(step, shards, replica)
        updates = []
        with atomic_updates(step.options, [g.grad for _, _, g, _ in results]):
            for replica, shard, gradient, finite in results:
                with tf.device(replica.device):
                    var = get_storage(step.program, shard, replica)
                    updates.append(step.optimizer.apply(
                        var, gradient, Slots(get_slots(step.program, shard, replica)),
                        finite=finite))
        if step.loss_scale is not None and results:
            with tf.device(step.loss_scale.scale.device):
                advances = loss_scaling.advance(step.loss_scale,
                                                step.program.graph_item.optimizer,
                                                results[0][3], after=updates)
            updates = updates + advances
        return Lowered(updates)

    @staticmethod
    def _reduce(step: StepStart, shards: Sequence[Shard], replica: Replica) -> list:
        """One replica's reduced and clipped gradients: (replica, shard, gradient,
        finite flag or None) per shard it has a gradient of."""
        gi = step.program.graph_item
        own = step.gradients[replica.index]
        reduced = reduce_gradients(
            step.program, replica, list(shards),
            {s.name: own[s.name] for s in shards if s.name in own},
            CollectiveConfig(len(step.strategy.replicas), step.options.timeout_s,
                             step.options.version), step.step_value,
            squares=optimizer_squares_gradient(gi.optimizer))
        mine = [s for s in shards if s.name in reduced.gradients]
        finite = None if step.loss_scale is None or not mine else loss_scaling.all_finite(
            [reduced.gradients[s.name] for s in mine],
            [gi.variable(s.var_name).gradient.float16_sum for s in mine],
            loss_scaling.read_scale(step.loss_scale))
        # Clipped per replica: each holds every all-reduced gradient.
        clipped = step.optimizer.clip([ReducedGradient(s.var_name, reduced.gradients[s.name],
                                                       reduced.squares.get(s.name), s.sparse)
                                       for s in mine])
        return [(replica, s, g, finite) for s, g in zip(mine, clipped)]
