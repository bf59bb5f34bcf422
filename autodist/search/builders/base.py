"""The Builder interface and the placement and partition rules builders share."""
from __future__ import annotations

import abc
import dataclasses
import math
from typing import ClassVar, Sequence

from autodist.ir.errors import InvalidArgumentError, StrategyError
from autodist.ir.graph_item import GraphItem, VariableInfo
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.proto import strategy_pb2

AllReduceSynchronizer = strategy_pb2.AllReduceSynchronizer

_COMPRESSORS = {"none": AllReduceSynchronizer.NONE, "fp16": AllReduceSynchronizer.FP16,
                "fp16_error_feedback": AllReduceSynchronizer.FP16_ERROR_FEEDBACK}


class Builder(abc.ABC):
    """Makes a Strategy for a GraphItem on a ResourceSpec by a fixed rule.

    Subclasses implement `variable_configs`; `build` adds the graph config,
    fingerprints and origin, and validates the result, so a builder never
    returns a strategy that cannot run.
    """

    name: ClassVar[str] = ""

    def build(self, graph_item: GraphItem, resource_spec: ResourceSpec) -> Strategy:
        """Returns the strategy this builder's rule gives for the pair."""
        proto = strategy_pb2.Strategy(origin=self.name,
                                      graph_item_fingerprint=graph_item.fingerprint,
                                      resource_spec_fingerprint=resource_spec.fingerprint)
        proto.graph_config.replicas.extend(resource_spec.replica_devices)
        proto.variables.extend(self.variable_configs(graph_item, resource_spec))
        strategy = Strategy(proto)
        strategy.validate(graph_item, resource_spec)
        return strategy

    @abc.abstractmethod
    def variable_configs(self, graph_item: GraphItem,
                         resource_spec: ResourceSpec) -> list[strategy_pb2.VariableConfig]:
        """One config per trainable variable, in the GraphItem's order."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


# ---------------------------------------------------------------- placement
class LoadBalancer:
    """Places byte loads on devices, minimising the most loaded device's time.

    The time of a device is its load divided by its node's bandwidth, so a
    faster node takes proportionally more. Callers place the largest items
    first (longest-processing-time rule); ties go to the earlier device.
    """

    def __init__(self, resource_spec: ResourceSpec, devices: Sequence[str]) -> None:
        if not devices:
            raise StrategyError("no devices to place variables on: the resource spec has no "
                                "node with the 'ps' role", field="reduction_destination",
                                received=[])
        self.devices = list(devices)
        self.bandwidth = {d: resource_spec.bandwidth_gbps(d) for d in self.devices}
        self.load = {d: 0.0 for d in self.devices}

    def place(self, nbytes: float, exclude: Sequence[str] = ()) -> str:
        """Puts `nbytes` on the device that finishes it first; returns the device.

        Args:
            nbytes: The load to place.
            exclude: Devices to avoid (e.g. those holding other shards of the
                same variable); ignored when it would leave no device.
        """
        candidates = [d for d in self.devices if d not in exclude] or self.devices
        best = min(candidates, key=lambda d: (self.load[d] + nbytes) / self.bandwidth[d])
        self.load[best] += nbytes
        return best

    def split(self, nbytes: float, max_parts: int) -> list[tuple[str, float]]:
        """Splits `nbytes` over at most `max_parts` devices by water-filling.

        Chooses the devices that would finish earliest and gives each the share
        that equalises (load + share) / bandwidth, so the split is uneven where
        loads or bandwidths differ.

        Returns:
            (device, share) pairs with positive shares, in device order.
        """
        ranked = sorted(self.devices, key=lambda d: (self.load[d] / self.bandwidth[d],
                                                     self.devices.index(d)))
        chosen = ranked[:max(1, max_parts)]
        while True:
            level = (nbytes + sum(self.load[d] for d in chosen)) / \
                sum(self.bandwidth[d] for d in chosen)
            shares = {d: level * self.bandwidth[d] - self.load[d] for d in chosen}
            negative = [d for d, s in shares.items() if s <= 0]
            if not negative:
                break
            chosen = [d for d in chosen if d not in negative]
        for d, s in shares.items():
            self.load[d] += s
        return [(d, shares[d]) for d in self.devices if d in shares]


def largest_first(variables: Sequence[VariableInfo]) -> list[VariableInfo]:
    """Variables by decreasing size, ties in graph order."""
    index = {v.name: i for i, v in enumerate(variables)}
    return sorted(variables, key=lambda v: (-v.byte_size, index[v.name]))


# ---------------------------------------------------------------- partition
def partition_axis(var: VariableInfo, axis: int | None = None) -> int | None:
    """The axis to split `var` along: `axis` if allowed, else the first allowed one."""
    axes = list(var.partitionable_axes)
    if not axes:
        return None
    if axis is not None:
        return axis if axis in axes else None
    return axes[0]


def shard_count(var: VariableInfo, axis: int, max_shards: int, min_shard_bytes: int) -> int:
    """How many shards `var` gets: bounded by bytes, by the axis and by `max_shards`.

    Each shard holds at least `min_shard_bytes` (so small variables stay
    whole), never more shards than rows along `axis`; no divisibility is
    needed because shards may differ in size.
    """
    by_bytes = var.byte_size // max(1, min_shard_bytes)
    return max(1, min(max_shards, var.shape[axis], by_bytes))


def even_sizes(dim: int, num_shards: int) -> list[int]:
    """Sizes differing by at most one, larger first (TF's fixed-size rule)."""
    base, extra = divmod(dim, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


def proportional_sizes(dim: int, weights: Sequence[float]) -> list[int]:
    """Integer sizes summing to `dim`, proportional to `weights`, each >= 1.

    Largest-remainder rounding; callers ensure len(weights) <= dim.
    """
    total = float(sum(weights))
    raw = [dim * w / total for w in weights]
    sizes = [max(1, math.floor(r)) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - math.floor(raw[i])), i))
    i = 0
    while sum(sizes) < dim:
        sizes[order[i % len(order)]] += 1
        i += 1
    while sum(sizes) > dim:
        j = max(range(len(sizes)), key=lambda k: (sizes[k] - raw[k], sizes[k]))
        sizes[j] -= 1
    return sizes


def partitioner(axis: int, sizes: Sequence[int]) -> strategy_pb2.Partitioner:
    """A Partitioner; shard sizes are recorded only when not the even split."""
    p = strategy_pb2.Partitioner(axis=axis, num_shards=len(sizes))
    if list(sizes) != even_sizes(sum(sizes), len(sizes)):
        p.shard_sizes.extend(sizes)
    return p


# ------------------------------------------------------------- synchronizers
@dataclasses.dataclass(frozen=True)
class PSOptions:
    """Options of a parameter-server synchronizer.

    Attributes:
        sync: Aggregate all replicas' gradients before one update per step.
        staleness: With sync, how many steps the fastest replica may lead.
        local_replication: Keep a worker-local copy refreshed after updates.
    """

    sync: bool = True
    staleness: int = 0
    local_replication: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise InvalidArgumentError("staleness must be an integer >= 0. Received: "
                                       f"{self.staleness!r}")
        if self.staleness and not self.sync:
            raise InvalidArgumentError(f"staleness={self.staleness} needs sync=True; asynchronous "
                                       "training has no staleness bound")

    def synchronizer(self, device: str) -> strategy_pb2.Synchronizer:
        return strategy_pb2.Synchronizer(ps=strategy_pb2.PSSynchronizer(
            reduction_destination=device, sync=self.sync, staleness=self.staleness,
            local_replication=self.local_replication))


def compressor_enum(name: str) -> int:
    """The AllReduceSynchronizer.Compressor for "none", "fp16" or "fp16_error_feedback"."""
    try:
        return _COMPRESSORS[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown compressor {name!r}; expected one of "
                                   f"{sorted(_COMPRESSORS)}") from None


def all_reduce_synchronizer(sparse: bool, group: int,
                            compressor: int) -> strategy_pb2.Synchronizer:
    """Dense gradients: ring all-reduce; sparse ones: all-gather.

    Error feedback keeps a dense residual, so a sparse gradient gets plain
    fp16 instead of fp16 with error feedback.
    """
    if sparse:
        if compressor == AllReduceSynchronizer.FP16_ERROR_FEEDBACK:
            compressor = AllReduceSynchronizer.FP16
        spec = AllReduceSynchronizer.ALL_GATHER
    else:
        spec = AllReduceSynchronizer.AUTO
    return strategy_pb2.Synchronizer(all_reduce=AllReduceSynchronizer(
        spec=spec, compressor=compressor, group=group))


class GroupAssigner:
    """Fuses dense all-reduce tensors into groups of at most `group_bytes`.

    Tensors are taken in the order their gradients become ready in the
    backward pass, so a group can start reducing as soon as its last gradient
    exists. Sparse tensors are all-gathered one group each. Ids are assigned
    in that order and are therefore deterministic.
    """

    def __init__(self, group_bytes: int) -> None:
        if group_bytes < 1:
            raise InvalidArgumentError(f"group_bytes must be >= 1. Received: {group_bytes!r}")
        self.group_bytes = group_bytes
        self._items: list[tuple[int, int, str, int, bool]] = []

    def add(self, key: str, order: int, nbytes: int, sparse: bool) -> None:
        self._items.append((order, len(self._items), key, nbytes, sparse))

    def assign(self) -> dict[str, int]:
        groups: dict[str, int] = {}
        next_id = 0
        current_bytes = 0
        current_open = False
        for _order, _index, key, nbytes, sparse in sorted(self._items):
            if sparse:
                groups[key] = next_id
                next_id += 1
                continue
            if current_open and current_bytes + nbytes > self.group_bytes:
                current_open = False
            if not current_open:
                current_id = next_id
                next_id += 1
                current_bytes = 0
                current_open = True
            groups[key] = current_id
            current_bytes += nbytes
        return groups
