"""All-reduce synchronizer: collective reduction of mirrored shards' gradients.

Dense gradients of the shards sharing a `group` are flattened into one buffer
and summed with ``CollectiveReduceV2`` across all replicas; sparse gradients
are all-gathered (indices and values, padded to the largest replica), or,
under spec RING or NCCL, densified (rows summed into the shard's shape) and
reduced in their group like dense ones: that moves the shard instead of one
row per lookup, less when a step looks up more rows than the shard has. For
optimizers that square the gradient, a densified shard also reduces the sum of
its rows' squares, so repeated rows are squared one by one as Keras does. Keys are
deterministic functions of the strategy, never hashes: every replica of every
task builds the same collectives with the same keys.

Compressors: ``FP16`` casts the wire buffer to float16 and back;
``FP16_ERROR_FEEDBACK`` also keeps, per replica and group, the rounding error
of the last step in a variable and adds it to the next step's buffer.
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from autodist.ir.strategy import is_gathered
from autodist.kernels.program import Program, Replica, Shard, StorageRole
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


def instance_keys(shards: list[Shard]) -> dict[tuple[str, int], int]:
    """Deterministic instance-key bases.

    A dense group gets one key base per group id; each sparse shard gets its
    own base after all groups, leaving room for the three collectives of an
    all-gather. The shapes of an all-gather change from step to step, and
    TensorFlow keeps the shape of a collective instance, so all-gathers add
    `step * ("stride", 0)` to their base: a new instance every step.
    """
    groups = sorted({s.synchronizer.all_reduce.group for s in shards if not gathers(s)})
    keys: dict[tuple[str, int], int] = {}
    for g in groups:
        keys[("group", g)] = 1 + _KEYS_PER_COLLECTIVE * g
    base = 1 + _KEYS_PER_COLLECTIVE * (max(groups, default=-1) + 1)
    for i, s in enumerate(sorted((s for s in shards if gathers(s)), key=lambda s: s.name)):
        keys[("name", s.name)] = base + _KEYS_PER_COLLECTIVE * i
    keys[("stride", 0)] = _KEYS_PER_COLLECTIVE * max(1, sum(1 for s in shards if gathers(s)))
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
        step: The step number (int64 tensor), for the keys of all-gathers.
        squares: The optimizer squares the gradient: densified sparse shards
            also reduce their rows' squares.

    Returns:
        The summed gradients (and squares) over all replicas.
    """
    keys = instance_keys(shards)
    out = Reduced({}, {})
    groups: dict[int, list[Shard]] = {}
    for s in shards:
        if s.name not in gradients:
            continue
        if gathers(s):
            key = keys[("name", s.name)] + tf.cast(step, tf.int32) * keys[("stride", 0)]
            out.gradients[s.name] = _all_gather(gradients[s.name], s, key, config,
                                                s.synchronizer.all_reduce)
        else:
            groups.setdefault(s.synchronizer.all_reduce.group, []).append(s)
    shapes: dict[tuple[int, ...], tf.Tensor] = {}

    def shape_constant(shape) -> tf.Tensor:
        # One constant per shape (a ResNet has hundreds of shards, few shapes).
        key = tuple(shape)
        if key not in shapes:
            shapes[key] = tf.constant(list(key), tf.int32)
        return shapes[key]

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
        flat = tf.concat([tf.reshape(p, shape_constant([-1])) for p in parts], axis=0)
        reduced = _reduce(program, replica, flat, group, tf.constant(keys[("group", group)]),
                          config, sync)
        sizes = [tf.TensorShape(s.shape).num_elements() for s, _ in places]
        for (s, is_square), part in zip(places, tf.split(reduced, sizes)):
            target = out.squares if is_square else out.gradients
            target[s.name] = tf.reshape(part, shape_constant(s.shape))
    return out


def _densify(values, indices, shape) -> tf.Tensor:
    """Rows (one per lookup, repeats allowed) summed into a dense tensor of `shape`."""
    return tf.math.unsorted_segment_sum(values, indices, shape[0])


def _hint(sync) -> str:
    return "nccl" if sync.spec == ARSync.NCCL else "ring"


def _collective_reduce(tensor, key, config: CollectiveConfig, hint: str):
    if config.group_size == 1:
        return tf.identity(tensor)  # one replica: nothing to reduce
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


def _reduce(program: Program, replica: Replica, flat, group: int, key,
            config: CollectiveConfig, sync):
    dtype = flat.dtype
    if sync.compressor == ARSync.NONE:
        return _collective_reduce(flat, key, config, _hint(sync))
    if sync.compressor == ARSync.FP16:
        wire = tf.cast(flat, tf.float16)
        return tf.cast(_collective_reduce(wire, key, config, _hint(sync)), dtype)
    residual = error_feedback_residual(program, replica, group, flat)
    corrected = flat + residual
    wire = tf.cast(corrected, tf.float16)
    update = residual.assign(corrected - tf.cast(wire, dtype))
    with tf.control_dependencies([update]):
        reduced = _collective_reduce(tf.identity(wire), key, config, _hint(sync))
    return tf.cast(reduced, dtype)


def error_feedback_residual(program: Program, replica: Replica, group: int, flat) -> tf.Variable:
    """The residual variable of one replica's group (created on first use)."""
    name = f"autodist/error_feedback/group_{group}/replica_{replica.index}"
    if name not in program.storage:
        with tf.device(replica.device):
            program.storage[name] = tf.compat.v1.Variable(
                tf.zeros([flat.shape.num_elements()], flat.dtype), name=name, trainable=False,
                use_resource=True)
        program.roles[name] = StorageRole("internal", replica=replica.index)
    return program.storage[name]


def _all_gather(grad, shard: Shard, key, config: CollectiveConfig, sync):
    hint = _hint(sync)
    values, indices = grad.values, grad.indices
    if sync.compressor != ARSync.NONE:
        values = tf.cast(values, tf.float16)
    count = tf.shape(indices, out_type=tf.int32)[:1]
    counts = _collective_gather(count, key, config, hint)
    longest = tf.reduce_max(counts)
    pad = longest - count[0]
    # Padding rows carry index 0 and value 0: they add nothing to the sum.
    values = tf.pad(values, tf.concat([[[0, pad]], tf.zeros([tf.rank(values) - 1, 2],
                                                            tf.int32)], 0))
    indices = tf.pad(indices, [[0, pad]])
    all_values = _collective_gather(values, key + 1, config, hint)
    all_indices = _collective_gather(indices, key + 2, config, hint)
    if sync.compressor != ARSync.NONE:
        all_values = tf.cast(all_values, grad.values.dtype)
    return tf.IndexedSlices(all_values, all_indices, grad.dense_shape)


# Group keys of the version tags: one single-member group per task, far from
# the job's group keys.
_TAG_GROUP_KEY = 1_000_000


def version_tag(task_index: int, version: int, device: str) -> tf.Operation:
    """An op that starts a fresh collective step sequence for `version`.

    TensorFlow numbers the steps of a graph's collectives from a sequence per
    graph key, and a graph with only V2 collectives always gets the same key:
    after a resize, a task that ran fewer collective steps than its peers
    would be out of step with them (their collectives time out). A V1
    collective's static instance key enters the graph key, so one trivial
    V1 collective (a group of one, per task) with the version as instance
    key gives each membership version its own sequence. Run it in every
    step of a program with collectives.
    """
    with tf.device(device):
        return tf.raw_ops.CollectiveReduce(
            input=tf.zeros([], tf.float32), group_size=1,
            group_key=_TAG_GROUP_KEY + task_index, instance_key=version + 1,
            merge_op="Add", final_op="Id", subdiv_offsets=[], timeout_seconds=60.0).op
