"""Strategy: how a GraphItem is distributed over a ResourceSpec.

A wrapper over `strategy.proto` with binary and text forms and validation.
Builders, the search and users all produce the same object.
"""
from __future__ import annotations

import math
import os
import pathlib
import uuid
from typing import Callable, Iterator, Mapping, Sequence

from google.protobuf import text_format
from google.protobuf.message import DecodeError

from autodist.ir.atomic import atomic_write
from autodist.ir.device_names import DeviceName, DeviceNameError
from autodist.ir.errors import StrategyError, UnknownVariableError, short_repr, shorten
from autodist.ir.graph_item import GraphItem, gradient_clipping
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy_text import describe_synchronizer as describe_synchronizer
from autodist.ir.strategy_text import enum_name as enum_name
from autodist.ir.strategy_text import summary_table
from autodist.proto import strategy_pb2

STRATEGY_SCHEMA_VERSION = 1

VariableConfig = strategy_pb2.VariableConfig
Synchronizer = strategy_pb2.Synchronizer
PSSynchronizer = strategy_pb2.PSSynchronizer
AllReduceSynchronizer = strategy_pb2.AllReduceSynchronizer
Partitioner = strategy_pb2.Partitioner

# Optimizer hyper-parameters that decide the update's structure (its slots and
# ops), so a strategy cannot override them.
STRUCTURAL_HYPERPARAMETERS = ("momentum", "nesterov", "amsgrad", "centered", "use_ema")
# Files with these suffixes hold the text form; any other path the binary form.
_TEXT_SUFFIXES = (".txt", ".pbtxt", ".textproto")
# Bounds past which a value is a mistake, not a plan (the runtime would hang,
# allocate without end, or behave as an unbounded asynchronous run).
MAX_STALENESS = 100_000
MAX_VIRTUAL_NODES = 65_536
MAX_GLOBAL_BATCH_SIZE = 2 ** 31 - 1
# Valid ranges of hyper-parameter overrides: (low, high, high included); every
# other hyper-parameter must be finite and >= 0.
_HYPERPARAMETER_RANGES = {
    "beta_1": (0.0, 1.0, False),
    "beta_2": (0.0, 1.0, False),
    "rho": (0.0, 1.0, False),
}


class Strategy:
    """A distribution strategy: replicas, virtual nodes and per-variable configs.

    Example:
        >>> s = autodist.builders.AllReduce().build(gi, spec)   # doctest: +SKIP
        >>> s.save("s.pb"); autodist.Strategy.load("s.pb") == s  # doctest: +SKIP
        True
        >>> print(s.to_text())                                   # doctest: +SKIP
    """

    def __init__(self, proto: strategy_pb2.Strategy | None = None) -> None:
        self._proto = strategy_pb2.Strategy()
        if proto is not None:
            self._proto.CopyFrom(proto)
        if not self._proto.schema_version:
            self._proto.schema_version = STRATEGY_SCHEMA_VERSION
        if not self._proto.id:
            self._proto.id = uuid.uuid4().hex

    # ------------------------------------------------------------ accessors
    @property
    def proto(self) -> strategy_pb2.Strategy:
        """The underlying protobuf (mutable: edits change this strategy)."""
        return self._proto

    @property
    def id(self) -> str:
        return self._proto.id

    @property
    def origin(self) -> str:
        return self._proto.origin

    @property
    def replicas(self) -> list[str]:
        return list(self._proto.graph_config.replicas)

    @property
    def num_virtual_nodes(self) -> int:
        """Virtual nodes of a step; without virtual nodes, one per replica."""
        vn = self._proto.graph_config.virtual_nodes
        return vn.num_virtual_nodes or len(self._proto.graph_config.replicas)

    @property
    def virtual_node_devices(self) -> list[str]:
        """The replica device of each virtual node, in virtual-node order.

        Without virtual nodes, each replica is one virtual node.
        """
        vn = self._proto.graph_config.virtual_nodes
        return list(vn.device) if vn.num_virtual_nodes else self.replicas

    @property
    def global_batch_size(self) -> int | None:
        """The fixed global batch of a virtual-node strategy, else None."""
        vn = self._proto.graph_config.virtual_nodes
        return int(vn.global_batch_size) if vn.num_virtual_nodes else None

    @property
    def hyperparameters(self) -> dict[str, float]:
        """Overrides of the optimizer's hyper-parameters (empty: the GraphItem's)."""
        return dict(self._proto.graph_config.hyperparameters)

    def with_hyperparameters(self, **values: float) -> Strategy:
        """A copy that overrides optimizer hyper-parameters, e.g. `learning_rate=0.2`.

        Structural ones (momentum on/off, nesterov, amsgrad, ...) cannot be
        overridden; `validate` checks the names against the optimizer.
        """
        out = Strategy(self._proto)
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise StrategyError(f"with_hyperparameters: {key} must be a number. "
                                    f"Received: {short_repr(value)}",
                                    field=f"graph_config.hyperparameters[{key!r}]",
                                    received=value)
            check_hyperparameter(key, float(value))
            out.proto.graph_config.hyperparameters[key] = float(value)
        return out

    @property
    def measured_step_times_s(self) -> tuple[float, ...]:
        """Step times measured for this strategy (seconds; empty if never measured)."""
        return tuple(self._proto.performance.measured_step_time_s)

    @property
    def predicted_step_time_s(self) -> float | None:
        """The predicted step time (seconds), or None."""
        return self._proto.performance.predicted_step_time_s or None

    def with_performance(self, *, measured_step_times_s: Sequence[float] | None = None,
                         predicted_step_time_s: float | None = None,
                         lower_bound_step_time_s: float | None = None,
                         predictor: str | None = None) -> Strategy:
        """A copy with these measured or predicted times (the others kept; measured times
        given replace the stored ones)."""
        out = Strategy(self._proto)
        perf = out.proto.performance
        if measured_step_times_s is not None:
            del perf.measured_step_time_s[:]
            perf.measured_step_time_s.extend(float(t) for t in measured_step_times_s)
        if predicted_step_time_s is not None:
            perf.predicted_step_time_s = float(predicted_step_time_s)
        if lower_bound_step_time_s is not None:
            perf.lower_bound_step_time_s = float(lower_bound_step_time_s)
        if predictor is not None:
            perf.predictor = predictor
        return out

    @property
    def batch_norm(self) -> str:
        """How batch normalization computes its statistics: "auto", "sync" or "ghost"."""
        return strategy_pb2.GraphConfig.BatchNorm.Name(
            self._proto.graph_config.batch_norm).lower()

    def with_batch_norm(self, mode: str) -> Strategy:
        """A copy whose batch-normalization layers use `mode`'s statistics.

        Masked losses' counts of unmasked values follow the same mode.

        Args:
            mode: "sync": the global batch's statistics, summed over the replicas
                of each step (equal to one device; needs one virtual node per
                replica); "ghost": each virtual node its own (no communication;
                the result depends on the global batch and the number of virtual
                nodes only); "auto" (the default): "sync" for a strategy without
                virtual nodes of its own, "ghost" with them.

        Raises:
            StrategyError: an unknown mode.
        """
        names = {name.lower(): name for name in strategy_pb2.GraphConfig.BatchNorm.keys()}
        if mode not in names:
            raise StrategyError(f"with_batch_norm: mode must be one of {sorted(names)}. "
                                f"Received: {short_repr(mode)}",
                                field="graph_config.batch_norm", received=mode)
        out = Strategy(self._proto)
        out.proto.graph_config.batch_norm = strategy_pb2.GraphConfig.BatchNorm.Value(
            names[mode])
        return out

    def with_compressor(self, compressor: str, variables: list[str] | None = None) -> Strategy:
        """A copy whose all-reduced dense shards use `compressor`.

        Args:
            compressor: "none", "fp16" or "fp16_error_feedback".
            variables: Only these variables (default: every variable with an
                all-reduce shard). Sparse gradients are all-gathered and
                keep theirs.

        Raises:
            StrategyError: an unknown compressor, or a named variable that
                is not in the strategy or has no all-reduce shard.
        """
        names = AllReduceSynchronizer.Compressor.keys()
        if not isinstance(compressor, str) or compressor.upper() not in names:
            raise StrategyError(f"unknown compressor {compressor!r}; expected one of "
                                f"{[n.lower() for n in names]}", received=compressor)
        value = AllReduceSynchronizer.Compressor.Value(compressor.upper())
        out = Strategy(self._proto)
        configs = {c.var_name: c for c in out.proto.variables}
        for name in variables or []:
            if name not in configs:
                raise StrategyError(f"with_compressor: variable {name!r} is not in the "
                                    "strategy", variable=name, received=name)
        touched = set()
        for name, config in configs.items():
            if variables is not None and name not in variables:
                continue
            for sync in config.shards:
                if sync.WhichOneof("kind") == "all_reduce" and \
                        sync.all_reduce.spec != AllReduceSynchronizer.ALL_GATHER:
                    sync.all_reduce.compressor = value
                    touched.add(name)
        missing = sorted(set(variables or []) - touched)
        if missing:
            raise StrategyError(f"with_compressor: variables {missing} have no dense "
                                "all-reduce shard", variable=missing[0], received=missing)
        return out

    def with_virtual_nodes(self, global_batch_size: int, num_virtual_nodes: int,
                           devices: list[str] | None = None) -> Strategy:
        """A copy whose step runs `num_virtual_nodes` virtual nodes of a fixed batch.

        Each virtual node computes the gradient of `global_batch_size /
        num_virtual_nodes` examples; the virtual nodes of one replica run one
        after the other and their gradients are summed before the step's one
        synchronization. The step's result depends on the global batch and the
        number of virtual nodes only, not on how they are mapped to replicas.

        Args:
            global_batch_size: B, the examples of one step.
            num_virtual_nodes: V, dividing B.
            devices: The replica of each virtual node (length V). Default:
                contiguous, as even as possible (virtual node i on replica
                ``i * R // V`` for R replicas).

        Returns:
            A new Strategy (same id) with `graph_config.virtual_nodes` set. Call
            `validate` to check it.

        Raises:
            StrategyError: V < 1, V < R with the default mapping, or B not a
                positive multiple of V.
        """
        replicas = self.replicas
        if not isinstance(num_virtual_nodes, int) or num_virtual_nodes < 1:
            raise StrategyError(f"num_virtual_nodes must be an integer >= 1. "
                                f"Received: {num_virtual_nodes!r}",
                                field="graph_config.virtual_nodes.num_virtual_nodes",
                                received=num_virtual_nodes)
        if (not isinstance(global_batch_size, int) or global_batch_size < 1
                or global_batch_size % num_virtual_nodes):
            raise StrategyError(
                f"global_batch_size must be a positive multiple of num_virtual_nodes "
                f"({num_virtual_nodes}). Received: {global_batch_size!r}",
                field="graph_config.virtual_nodes.global_batch_size",
                received=global_batch_size)
        if devices is None:
            if num_virtual_nodes < len(replicas):
                raise StrategyError(
                    f"{num_virtual_nodes} virtual nodes cannot cover the {len(replicas)} "
                    "replicas; use at least one virtual node per replica",
                    field="graph_config.virtual_nodes.num_virtual_nodes",
                    received=num_virtual_nodes)
            devices = [replicas[i * len(replicas) // num_virtual_nodes]
                       for i in range(num_virtual_nodes)]
        out = Strategy(self._proto)
        vn = out._proto.graph_config.virtual_nodes
        vn.global_batch_size = global_batch_size
        vn.num_virtual_nodes = num_virtual_nodes
        del vn.device[:]
        vn.device.extend(devices)
        return out

    # ------------------------------------------------------------ transforms
    @property
    def is_asynchronous(self) -> bool:
        """Whether some shard is updated without waiting for every replica (`is_asynchronous`)."""
        return bool(self.asynchronous_shards())

    def asynchronous_shards(self) -> list[tuple[str, int]]:
        """(variable, shard index) of every asynchronous shard (`is_asynchronous`)."""
        return [(config.var_name, i) for config in self._proto.variables
                for i, sync in enumerate(config.shards) if is_asynchronous(sync)]

    def devices(self) -> list[DeviceName]:
        """Every device the strategy names (replicas, virtual nodes' replicas, PS
        destinations), each once, in that order.

        Raises:
            StrategyError: a device name that does not parse, naming its field.
        """
        seen: dict[DeviceName, None] = {}
        for field, name in _device_fields(self._proto):
            seen.setdefault(_parse_device(field, name), None)
        return list(seen)

    def with_devices(self, rename: Callable[[DeviceName], DeviceName]) -> Strategy:
        """A copy with every device `d` the strategy names replaced by `rename(d)`.

        Replicas, virtual nodes' replicas and PS destinations are renamed;
        nothing else changes (not the id, which names the plan, not its devices).

        Raises:
            StrategyError: a device name that does not parse, naming its field.
        """
        out = Strategy(self._proto)
        graph = out._proto.graph_config
        for values, field in ((graph.replicas, "graph_config.replicas"),
                              (graph.virtual_nodes.device, "graph_config.virtual_nodes.device")):
            if not values:
                continue  # an edit of an empty field would still mark its message as set
            renamed = [str(rename(_parse_device(f"{field}[{i}]", d)))
                       for i, d in enumerate(values)]
            del values[:]
            values.extend(renamed)
        for config in out._proto.variables:
            for i, sync in enumerate(config.shards):
                if sync.WhichOneof("kind") == "ps":
                    field = f"variables[{config.var_name!r}].shards[{i}].ps.reduction_destination"
                    sync.ps.reduction_destination = str(rename(_parse_device(
                        field, sync.ps.reduction_destination)))
        return out

    def with_worker_tasks_renumbered(self, new_index: Mapping[int, int]) -> Strategy:
        """A copy whose devices on worker task t are on worker task `new_index[t]`.

        Example: `{0: 0, 1: 2}` moves what worker 1 holds to worker 2.

        Raises:
            StrategyError: a worker task the strategy names is not in `new_index`.
        """
        def rename(device: DeviceName) -> DeviceName:
            if device.job != "worker":
                return device
            if device.index not in new_index:
                raise StrategyError(
                    f"with_worker_tasks_renumbered: {device} is on worker task "
                    f"{device.index}, which the renumbering {short_repr(dict(new_index))} "
                    "does not name", received=dict(new_index))
            return device.on_task(device.task.with_index(new_index[device.index]))
        return self.with_devices(rename)

    def with_replicas(self, replicas: Sequence[str], *, global_batch_size: int | None = None,
                      num_virtual_nodes: int | None = None) -> Strategy:
        """A copy whose replicas are `replicas` (e.g. some of its own: the members of an
        elastic run), its virtual nodes, if it has them, spread evenly over them.

        Args:
            replicas: The replica devices, in order.
            global_batch_size, num_virtual_nodes: B and V of the virtual nodes
                (default: the strategy's own B and V, if it has virtual nodes).

        Raises:
            StrategyError: no replica, one named twice, or a name that does not parse.
        """
        replicas = list(replicas)
        if not replicas or len(set(replicas)) != len(replicas):
            raise StrategyError(f"with_replicas takes distinct replicas, at least one. "
                                f"Received: {short_repr(replicas)}",
                                field="graph_config.replicas", received=replicas)
        for i, name in enumerate(replicas):
            _parse_device(f"graph_config.replicas[{i}]", name)
        out = Strategy(self._proto)
        del out._proto.graph_config.replicas[:]
        out._proto.graph_config.replicas.extend(replicas)
        if global_batch_size is None:
            if self.global_batch_size is None:
                return out
            global_batch_size, num_virtual_nodes = self.global_batch_size, self.num_virtual_nodes
        return out.with_virtual_nodes(global_batch_size,
                                      num_virtual_nodes or self.num_virtual_nodes)

    def distributes_like(self, other: Strategy) -> bool:
        """Whether `other` distributes the same way: the same graph config and variable
        configs (ids, origins, fingerprints and predictions aside)."""
        return self._proto.graph_config == other._proto.graph_config and \
            list(self._proto.variables) == list(other._proto.variables)

    @property
    def variables(self) -> list[VariableConfig]:
        return list(self._proto.variables)

    def variable(self, name: str) -> VariableConfig:
        """The config of variable `name`; KeyError if the strategy has none."""
        for config in self._proto.variables:
            if config.var_name == name:
                return config
        raise UnknownVariableError(f"strategy {self.id} has no config for variable {name!r}")

    def __iter__(self) -> Iterator[VariableConfig]:
        return iter(self._proto.variables)

    def __len__(self) -> int:
        return len(self._proto.variables)

    # ------------------------------------------------------- serialization
    def serialize(self) -> bytes:
        return self._proto.SerializeToString(deterministic=True)

    @classmethod
    def deserialize(cls, data: bytes, source: str = "bytes") -> Strategy:
        proto = strategy_pb2.Strategy()
        try:
            proto.ParseFromString(data)
        except (DecodeError, RecursionError, ValueError, TypeError) as e:
            raise StrategyError(f"{source} is not a Strategy protobuf: "
                                f"{shorten(str(e), 500)}") from e
        if not proto.schema_version or not proto.id:
            raise StrategyError(f"{source} is not a Strategy protobuf "
                                "(no schema_version or id)")
        return cls(proto)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the binary form atomically (the text form for a text suffix, see `load`)."""
        if pathlib.Path(path).suffix in _TEXT_SUFFIXES:
            atomic_write(path, self.to_text().encode())
        else:
            atomic_write(path, self.serialize())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Strategy:
        """Reads a strategy written by `save`: text for a text suffix, else binary."""
        path = pathlib.Path(path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise StrategyError(f"cannot read strategy file {str(path)!r}: {e}") from e
        if path.suffix in _TEXT_SUFFIXES:
            try:
                return cls.from_text(data.decode())
            except (UnicodeDecodeError, StrategyError) as e:
                raise StrategyError(f"strategy file {str(path)!r}: {e}") from e
        return cls.deserialize(data, source=repr(str(path)))

    def to_text(self) -> str:
        return text_format.MessageToString(self._proto)

    @classmethod
    def from_text(cls, text: str) -> Strategy:
        proto = strategy_pb2.Strategy()
        try:
            text_format.Parse(text, proto)
        except (text_format.ParseError, RecursionError, ValueError, TypeError) as e:
            raise StrategyError(f"malformed strategy text: {shorten(str(e), 500)}") from e
        return cls(proto)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Strategy) and self._proto == other._proto

    def __hash__(self) -> int:
        return hash(self.serialize())

    def __repr__(self) -> str:
        return (f"Strategy(id={self.id[:8]}, origin={self.origin!r}, "
                f"replicas={len(self._proto.graph_config.replicas)}, "
                f"variables={len(self._proto.variables)})")

    def summary(self) -> str:
        """A table: variable, partition, synchronizer and placement per shard."""
        return summary_table(self._proto, self.id, self.origin)

    # ------------------------------------------------------------ validation
    def validate(self, graph_item: GraphItem, resource_spec: ResourceSpec, *,
                 check_fingerprints: bool = False) -> None:
        """Checks that this strategy can run `graph_item` on `resource_spec`.

        Args:
            graph_item: The captured step.
            resource_spec: The cluster.
            check_fingerprints: Also require the fingerprints recorded in the
                strategy to match (a strategy re-used on a re-captured model
                usually fails this even when it fits; variables, shapes and
                devices are always checked).

        Raises:
            StrategyError: naming the variable, the field and the value received.
        """
        _Validator(self._proto, graph_item, resource_spec).run(check_fingerprints)


def _device_fields(proto: strategy_pb2.Strategy) -> Iterator[tuple[str, str]]:
    """(field, device name) of every device a strategy names."""
    graph = proto.graph_config
    for i, name in enumerate(graph.replicas):
        yield f"graph_config.replicas[{i}]", name
    for i, name in enumerate(graph.virtual_nodes.device):
        yield f"graph_config.virtual_nodes.device[{i}]", name
    for config in proto.variables:
        for i, sync in enumerate(config.shards):
            if sync.WhichOneof("kind") == "ps":
                yield (f"variables[{config.var_name!r}].shards[{i}].ps."
                       "reduction_destination", sync.ps.reduction_destination)


def is_asynchronous(sync: Synchronizer) -> bool:
    """Whether a shard is updated without waiting for every replica: a PS shard with
    `sync` off, or with a staleness bound (replicas run ahead of each other)."""
    return sync.WhichOneof("kind") == "ps" and (not sync.ps.sync or sync.ps.staleness != 0)


def _parse_device(field: str, name: str) -> DeviceName:
    try:
        return DeviceName.parse(name)
    except DeviceNameError as e:
        raise StrategyError(f"{field}: {e}", field=field, received=name) from None


def _update_group(sync: Synchronizer) -> str:
    """Where a shard's update runs: its clipping group (see _check_gradient_clipping)."""
    if sync.WhichOneof("kind") == "ps":
        return "asynchronous PS" if is_asynchronous(sync) else "synchronous PS"
    return "all-reduce"


def check_hyperparameter(key: str, value: float) -> None:
    """Raises StrategyError unless `value` is a valid value of hyper-parameter `key`."""
    field = f"graph_config.hyperparameters[{short_repr(key, 60)}]"
    low, high, high_included = _HYPERPARAMETER_RANGES.get(key, (0.0, math.inf, False))
    if not math.isfinite(value) or value < low or value > high or \
            (value == high and not high_included):
        bound = f"in [{low:g}, {high:g}{']' if high_included else ')'}" \
            if math.isfinite(high) else f"finite and >= {low:g}"
        raise StrategyError(f"{field} must be {bound}. Received: {value!r}", field=field,
                            received=value)


def is_gathered(sync: AllReduceSynchronizer, sparse_gradient: bool) -> bool:
    """Whether an all-reduce shard's gradient is all-gathered as rows (indices and values).

    A sparse gradient is all-gathered under AUTO and ALL_GATHER; under RING
    or NCCL it is densified (summed into the shard's shape) and all-reduced
    like a dense one, which moves the whole shard instead of one row per
    lookup: cheaper when a step looks up more rows than the table has.
    """
    return sparse_gradient and sync.spec in (AllReduceSynchronizer.AUTO,
                                             AllReduceSynchronizer.ALL_GATHER)


# Largest sum over replicas (bytes per replica, times the other replicas) that
# gathers every replica's tensor and adds them (`sums_by_gathering`).
# TensorFlow 2.21's collectives between task processes cost ~0.5-0.8 ms an
# exchange on 2 shared cores, more than a few hundred KB take to move
# (two tasks: 16 KB 1.15 ms gathered vs 1.7 ms in a ring, 256 KB 1.5 vs 1.9,
# 1 MB no gain; four: 64 KB 3.4-3.7 vs 5.3-5.6 ms, 1 MB 14 vs 9.4).
GATHER_SUM_MAX_BYTES = 256 * 1024


def sums_by_gathering(byte_size, replicas: int, element_size: int = 4):
    """Whether a sum over `replicas` of `byte_size` bytes each is gathered and added.

    A ring all-reduce takes 2 (W-1) exchanges in turn and moves 2 (W-1)/W
    of the tensor per replica; gathering takes W-1 exchanges and moves W-1
    tensors. Where the fixed cost of an exchange outweighs the bytes (small
    tensors, few replicas), the gather wins; under one element per replica
    the ring's chunks are empty and it exchanges less. The sum is in replica
    order on every replica (the same on each, whatever the arrival order); at
    two replicas it is the ring's sum exactly (a + b).

    Args:
        byte_size: The tensor's bytes per replica: an int (the kernels), or
            an array of them (the simulator's fused groups): the answer has
            its shape.
        replicas: Replicas in the sum.
        element_size: Bytes of one element.
    """
    return (replicas >= 2) & (byte_size >= replicas * element_size) & \
        (byte_size * (replicas - 1) <= GATHER_SUM_MAX_BYTES)


class _Validator:
    """Checks one strategy; each check raises StrategyError on the first fault."""

    def __init__(self, proto: strategy_pb2.Strategy, graph_item: GraphItem,
                 spec: ResourceSpec) -> None:
        self.proto = proto
        self.gi = graph_item
        self.spec = spec
        self.devices = set(spec.device_names)

    def run(self, check_fingerprints: bool) -> None:
        if self.proto.schema_version > STRATEGY_SCHEMA_VERSION:
            raise StrategyError(
                f"strategy schema version {self.proto.schema_version} is newer than this "
                f"autodist understands ({STRATEGY_SCHEMA_VERSION})",
                field="schema_version", received=self.proto.schema_version)
        if check_fingerprints:
            self._check_fingerprints()
        replicas = self._check_replicas()
        self._check_virtual_nodes(replicas)
        self._check_variables(replicas)
        self._check_hyperparameters()
        self._check_gradient_clipping()
        self._check_loss_scaling()

    def _check_hyperparameters(self) -> None:
        known = self.gi.optimizer.hyperparameters
        schedule = self.gi.optimizer.learning_rate_schedule.class_name
        for key, value in self.proto.graph_config.hyperparameters.items():
            if key == "learning_rate" and schedule:
                raise StrategyError(
                    f"graph_config.hyperparameters overrides learning_rate, but the optimizer's "
                    f"learning rate is a schedule ({schedule}), which a fixed rate would "
                    "replace; change the schedule in the model instead",
                    field="graph_config.hyperparameters['learning_rate']", received=value)
            if key in STRUCTURAL_HYPERPARAMETERS or key not in known:
                tunable = sorted(k for k in known if k not in STRUCTURAL_HYPERPARAMETERS)
                raise StrategyError(
                    f"graph_config.hyperparameters overrides {short_repr(key, 60)}, which is "
                    f"not a tunable hyper-parameter of the optimizer (tunable: {tunable})",
                    field=f"graph_config.hyperparameters[{short_repr(key, 60)}]",
                    received=value)
            check_hyperparameter(key, value)

    def _check_gradient_clipping(self) -> None:
        """A clipping norm must be computed in one update: within one task's run.

        The chief updates every synchronous PS shard in one run, each replica
        its all-reduced shards in another, and asynchronous shards are updated
        per replica; a norm cannot combine gradients of two of these groups.
        """
        values = dict(self.gi.optimizer.hyperparameters)
        values.update(self.proto.graph_config.hyperparameters)
        clipping = gradient_clipping(values)
        if clipping is None or clipping[0] == "clipvalue":
            return
        option, limit = clipping
        groups: dict[str, set[str]] = {}
        for config in self.proto.variables:
            var = self.gi.variable(config.var_name)
            if var.gradient.dense or var.gradient.values:
                groups[config.var_name] = {_update_group(s) for s in config.shards}
        if option == "clipnorm":
            for name, kinds in groups.items():
                if len(kinds) > 1:
                    raise StrategyError(
                        f"the optimizer clips each variable's gradient by its norm "
                        f"(clipnorm={limit:g}), but variable {name!r} has shards updated "
                        f"by {' and '.join(sorted(kinds))}, whose norms no update sees "
                        "together; give all its shards one kind of synchronizer",
                        variable=name, field="shards", received=sorted(kinds))
            return
        kinds = set().union(*groups.values()) if groups else set()
        if len(kinds) > 1:
            raise StrategyError(
                f"the optimizer clips by the global norm of all gradients "
                f"(global_clipnorm={limit:g}), but the strategy updates variables by "
                f"{' and '.join(sorted(kinds))}, whose norms no update sees together; use one "
                "kind of synchronizer for every variable (all parameter servers, or all "
                "all-reduce)", field="shards", received=sorted(kinds))

    def _check_loss_scaling(self) -> None:
        """Keras' dynamic loss scaling skips a step's every update when any gradient is
        not finite: one check must see every gradient of the step, so all of them
        are all-reduced (each replica sees them all) or all taken by the chief
        (synchronous PS). An error-feedback residual would keep a skipped
        step's infinities."""
        if not self.gi.optimizer.HasField("loss_scale"):
            return
        groups = set()
        for config in self.proto.variables:
            var = self.gi.variable(config.var_name)
            if not (var.gradient.dense or var.gradient.values):
                continue
            for sync in config.shards:
                groups.add(_update_group(sync))
                if sync.WhichOneof("kind") == "all_reduce" and sync.all_reduce.compressor == \
                        AllReduceSynchronizer.FP16_ERROR_FEEDBACK:
                    raise StrategyError(
                        f"variable {config.var_name!r} is all-reduced with the "
                        "FP16_ERROR_FEEDBACK compressor, whose residual would keep the "
                        "infinite gradients of a step that dynamic loss scaling (the "
                        "optimizer is a LossScaleOptimizer, as the 'mixed_float16' policy "
                        "makes) skips; use compressor NONE or FP16",
                        variable=config.var_name, field="shards.all_reduce.compressor",
                        received="FP16_ERROR_FEEDBACK")
        if len(groups) > 1 or groups == {"asynchronous PS"}:
            raise StrategyError(
                "the optimizer scales the loss dynamically (a LossScaleOptimizer, as the "
                "'mixed_float16' policy makes) and skips a step's updates when any gradient "
                f"is not finite, but the strategy updates variables by "
                f"{' and '.join(sorted(groups))}, where no one check sees every gradient of "
                "a step; use all-reduce for every variable, or synchronous parameter "
                "servers for every variable", field="shards", received=sorted(groups))

    def _check_fingerprints(self) -> None:
        for field, actual in (("graph_item_fingerprint", self.gi.fingerprint),
                              ("resource_spec_fingerprint", self.spec.fingerprint)):
            recorded = getattr(self.proto, field)
            if recorded and recorded != actual:
                raise StrategyError(f"strategy {field} is {recorded!r} but the given one is "
                                    f"{actual!r}: it was made for another "
                                    f"{'graph' if 'graph' in field else 'cluster'}",
                                    field=field, received=recorded)

    def _check_replicas(self) -> list[str]:
        replicas = list(self.proto.graph_config.replicas)
        if not replicas:
            raise StrategyError("graph_config.replicas is empty: a strategy needs at least "
                                "one compute replica", field="graph_config.replicas",
                                received=replicas)
        seen = set()
        compute = set(self.spec.replica_devices)
        for device in replicas:
            if device not in self.devices:
                raise StrategyError(
                    f"graph_config.replicas names device {short_repr(device)}, which is not "
                    f"in the resource spec (devices: {sorted(self.devices)})",
                    field="graph_config.replicas", received=device)
            if device not in compute:
                raise StrategyError(
                    f"graph_config.replicas names {device!r}, which is not a compute device "
                    f"of a worker node (compute devices: {sorted(compute)})",
                    field="graph_config.replicas", received=device)
            if device in seen:
                raise StrategyError(f"graph_config.replicas repeats {device!r}",
                                    field="graph_config.replicas", received=device)
            seen.add(device)
        return replicas

    def _check_virtual_nodes(self, replicas: list[str]) -> None:
        vn = self.proto.graph_config.virtual_nodes
        field = "graph_config.virtual_nodes"
        if vn.num_virtual_nodes == 0:
            if vn.global_batch_size or vn.device:
                raise StrategyError(f"{field} sets global_batch_size or device but "
                                    "num_virtual_nodes is 0", field=f"{field}.num_virtual_nodes",
                                    received=0)
            return
        if vn.num_virtual_nodes < 0:
            raise StrategyError(f"{field}.num_virtual_nodes must be >= 1. "
                                f"Received: {vn.num_virtual_nodes}",
                                field=f"{field}.num_virtual_nodes", received=vn.num_virtual_nodes)
        if vn.num_virtual_nodes > MAX_VIRTUAL_NODES:
            raise StrategyError(f"{field}.num_virtual_nodes must be at most {MAX_VIRTUAL_NODES}. "
                                f"Received: {vn.num_virtual_nodes}",
                                field=f"{field}.num_virtual_nodes", received=vn.num_virtual_nodes)
        if vn.global_batch_size > MAX_GLOBAL_BATCH_SIZE:
            raise StrategyError(f"{field}.global_batch_size must be at most "
                                f"{MAX_GLOBAL_BATCH_SIZE}. Received: {vn.global_batch_size}",
                                field=f"{field}.global_batch_size",
                                received=vn.global_batch_size)
        if vn.global_batch_size <= 0 or vn.global_batch_size % vn.num_virtual_nodes:
            raise StrategyError(
                f"{field}.global_batch_size must be a positive multiple of num_virtual_nodes "
                f"({vn.num_virtual_nodes}). Received: {vn.global_batch_size}",
                field=f"{field}.global_batch_size", received=vn.global_batch_size)
        if len(vn.device) != vn.num_virtual_nodes:
            raise StrategyError(
                f"{field}.device must map each of the {vn.num_virtual_nodes} virtual nodes to "
                f"a replica. Received {len(vn.device)} entries",
                field=f"{field}.device", received=list(vn.device))
        for i, device in enumerate(vn.device):
            if device not in replicas:
                raise StrategyError(
                    f"{field}.device[{i}] is {short_repr(device)}, which is not one of the "
                    f"replicas {replicas}", field=f"{field}.device", received=device)
        idle = [r for r in replicas if r not in set(vn.device)]
        if idle:
            raise StrategyError(f"replicas {idle} run no virtual node; drop them from "
                                "graph_config.replicas or assign them virtual nodes",
                                field=f"{field}.device", received=list(vn.device))

    def _check_variables(self, replicas: list[str]) -> None:
        seen: set[str] = set()
        groups: dict[int, tuple[str, int, int, str]] = {}
        for config in self.proto.variables:
            name = config.var_name
            if name not in self.gi:
                raise StrategyError(
                    f"strategy names unknown variable {short_repr(name)}; the GraphItem "
                    f"{self.gi.name!r} has {sorted(self.gi.variable_names)}",
                    variable=name, field="var_name", received=name)
            if name in seen:
                raise StrategyError(f"variable {name!r} is configured twice", variable=name,
                                    field="var_name", received=name)
            seen.add(name)
            var = self.gi.variable(name)
            shards = self._check_partitioner(config, var)
            if len(config.shards) != shards:
                raise StrategyError(
                    f"variable {name!r} has {shards} shard(s) but {len(config.shards)} "
                    "synchronizers in shards (need one per shard)",
                    variable=name, field="shards", received=len(config.shards))
            for i, sync in enumerate(config.shards):
                self._check_synchronizer(name, var, i, sync, replicas, groups)
        missing = [n for n in self.gi.variable_names if n not in seen]
        if missing:
            raise StrategyError(f"strategy has no config for variables {missing}",
                                variable=missing[0], field="variables", received=None)

    def _check_partitioner(self, config: VariableConfig, var) -> int:
        name = config.var_name
        if not config.HasField("partitioner"):
            return 1
        p = config.partitioner
        if p.num_shards < 0:
            raise StrategyError(f"variable {name!r}: partitioner.num_shards must be >= 1. "
                                f"Received: {p.num_shards}", variable=name,
                                field="partitioner.num_shards", received=p.num_shards)
        if p.num_shards <= 1:
            if p.shard_sizes:
                raise StrategyError(f"variable {name!r}: shard_sizes given for "
                                    f"{p.num_shards} shard(s)", variable=name,
                                    field="partitioner.shard_sizes", received=list(p.shard_sizes))
            return 1
        if var.HasField("constraint"):
            raise StrategyError(
                f"variable {name!r} has a constraint ({var.constraint.class_name}), which "
                "Keras applies to the whole variable after each update: it cannot be "
                f"partitioned (partitioner.num_shards {p.num_shards}); keep it in one shard",
                variable=name, field="partitioner.num_shards", received=p.num_shards)
        rank = len(var.shape)
        if not 0 <= p.axis < rank:
            raise StrategyError(
                f"variable {name!r} (shape {list(var.shape)}): partitioner.axis must be in "
                f"[0, {rank}). Received: {p.axis}", variable=name, field="partitioner.axis",
                received=p.axis)
        if p.axis not in var.partitionable_axes:
            why = " (its gradient is sparse: only axis 0)" if var.sparse_gradient else ""
            raise StrategyError(
                f"variable {name!r} cannot be partitioned along axis {p.axis}{why}; "
                f"partitionable axes: {list(var.partitionable_axes)}", variable=name,
                field="partitioner.axis", received=p.axis)
        dim = var.shape[p.axis]
        if p.num_shards > dim:
            raise StrategyError(
                f"variable {name!r}: partitioner.num_shards {p.num_shards} is larger than "
                f"axis {p.axis} (size {dim})", variable=name, field="partitioner.num_shards",
                received=p.num_shards)
        if p.shard_sizes:
            sizes = list(p.shard_sizes)
            if len(sizes) != p.num_shards or any(s <= 0 for s in sizes) or sum(sizes) != dim:
                raise StrategyError(
                    f"variable {name!r}: partitioner.shard_sizes must be {p.num_shards} "
                    f"positive sizes summing to {dim} (axis {p.axis}). "
                    f"Received: {short_repr(sizes)}",
                    variable=name, field="partitioner.shard_sizes", received=sizes)
        return p.num_shards

    def _check_synchronizer(self, name: str, var, index: int, sync: Synchronizer,
                            replicas: list[str],
                            groups: dict[int, tuple[str, int, int, str]]) -> None:
        where = f"shards[{index}]"
        kind = sync.WhichOneof("kind")
        if kind is None:
            raise StrategyError(f"variable {name!r}: {where} has no synchronizer (ps or "
                                "all_reduce)", variable=name, field=where, received=None)
        if kind == "ps":
            ps = sync.ps
            if ps.reduction_destination not in self.devices:
                raise StrategyError(
                    f"variable {name!r}: {where}.ps.reduction_destination "
                    f"{short_repr(ps.reduction_destination)} is not a device of the resource "
                    f"spec (devices: {sorted(self.devices)})", variable=name,
                    field=f"{where}.ps.reduction_destination", received=ps.reduction_destination)
            if ps.staleness < 0:
                raise StrategyError(f"variable {name!r}: {where}.ps.staleness must be >= 0. "
                                    f"Received: {ps.staleness}", variable=name,
                                    field=f"{where}.ps.staleness", received=ps.staleness)
            if ps.staleness > MAX_STALENESS:
                raise StrategyError(f"variable {name!r}: {where}.ps.staleness must be at most "
                                    f"{MAX_STALENESS} steps (sync=false has no bound). "
                                    f"Received: {ps.staleness}", variable=name,
                                    field=f"{where}.ps.staleness", received=ps.staleness)
            if ps.staleness and not ps.sync:
                raise StrategyError(
                    f"variable {name!r}: {where}.ps.staleness is {ps.staleness} but sync is "
                    "false; bounded staleness needs sync=true (async has no bound)",
                    variable=name, field=f"{where}.ps.staleness", received=ps.staleness)
            return
        ar = sync.all_reduce
        if ar.group < 0:
            raise StrategyError(f"variable {name!r}: {where}.all_reduce.group must be >= 0. "
                                f"Received: {ar.group}", variable=name,
                                field=f"{where}.all_reduce.group", received=ar.group)
        for enum, attr in ((AllReduceSynchronizer.Spec, "spec"),
                           (AllReduceSynchronizer.Compressor, "compressor")):
            value = getattr(ar, attr)
            if value not in enum.values():
                raise StrategyError(
                    f"variable {name!r}: {where}.all_reduce.{attr} is {value}, which is not a "
                    f"known value (known: {dict(zip(enum.keys(), enum.values()))}; a strategy "
                    "from a newer autodist?)", variable=name,
                    field=f"{where}.all_reduce.{attr}", received=value)
        spec_name = AllReduceSynchronizer.Spec.Name(ar.spec)
        compressor = AllReduceSynchronizer.Compressor.Name(ar.compressor)
        gathered = is_gathered(ar, var.sparse_gradient)
        if gathered and ar.compressor == AllReduceSynchronizer.FP16_ERROR_FEEDBACK:
            raise StrategyError(
                f"variable {name!r} is all-gathered (spec {spec_name}); compressor {compressor} "
                "keeps a dense residual and cannot take it (use NONE or FP16, or spec RING to "
                "densify the gradient)", variable=name,
                field=f"{where}.all_reduce.compressor", received=compressor)
        if ar.compressor != AllReduceSynchronizer.NONE and not var.dtype.startswith("float"):
            raise StrategyError(f"variable {name!r} of dtype {var.dtype} cannot use compressor "
                                f"{compressor}", variable=name,
                                field=f"{where}.all_reduce.compressor", received=compressor)
        if ar.spec == AllReduceSynchronizer.NCCL:
            cpu = [r for r in replicas if "/device:GPU:" not in r]
            if cpu:
                raise StrategyError(f"variable {name!r}: all-reduce spec NCCL needs GPU replicas; "
                                    f"these are not: {cpu}", variable=name,
                                    field=f"{where}.all_reduce.spec", received=spec_name)
        # A fused group is one flat tensor: its members must agree on how it
        # travels. AUTO on a dense gradient is a ring; a densified sparse
        # gradient fuses with dense ones.
        how = "GATHER" if gathered else "RING" if ar.spec == AllReduceSynchronizer.AUTO \
            else spec_name
        key = (how, ar.compressor, int(gathered), var.dtype)
        first = groups.setdefault(ar.group, (name,) + key)
        if first[1:] != key:
            raise StrategyError(
                f"variable {name!r}: all-reduce group {ar.group} mixes (spec, compressor, "
                f"sparse, dtype) {key} with {first[1:]} of variable {first[0]!r}; fused groups "
                "must agree", variable=name, field=f"{where}.all_reduce.group", received=ar.group)
