"""Parameter-server builders: PS, PSLoadBalancing, PartitionedPS, UnevenPartitionedPS."""
from __future__ import annotations

from autodist.ir.errors import InvalidArgumentError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.proto import strategy_pb2
from autodist.search.builders.base import (Builder, LoadBalancer, PSOptions, even_sizes,
                                           largest_first, partition_axis, partitioner,
                                           proportional_sizes, shard_count)

DEFAULT_MIN_SHARD_BYTES = 256 * 1024


class PS(Builder):
    """Every variable on one parameter server (the first PS device).

    Args:
        sync: Synchronous updates (one aggregated update per step).
        staleness: With sync, how many steps a replica may run ahead.
        local_replication: Keep a worker-local copy of each variable.
    """

    name = "PS"

    def __init__(self, sync: bool = True, staleness: int = 0,
                 local_replication: bool = False) -> None:
        self.options = PSOptions(sync, staleness, local_replication)

    def variable_configs(self, graph_item: GraphItem,
                         resource_spec: ResourceSpec) -> list[strategy_pb2.VariableConfig]:
        device = LoadBalancer(resource_spec, resource_spec.ps_devices).devices[0]
        return [strategy_pb2.VariableConfig(var_name=v.name,
                                            shards=[self.options.synchronizer(device)])
                for v in graph_item.variables]


class PSLoadBalancing(PS):
    """Whole variables spread over the PS devices, largest first.

    Each variable goes to the PS that would finish its load first (load
    divided by the node's bandwidth), which balances far better than placing
    in graph order.
    """

    name = "PSLoadBalancing"

    def variable_configs(self, graph_item: GraphItem,
                         resource_spec: ResourceSpec) -> list[strategy_pb2.VariableConfig]:
        balancer = LoadBalancer(resource_spec, resource_spec.ps_devices)
        placed = {v.name: balancer.place(v.byte_size) for v in largest_first(graph_item.variables)}
        return [strategy_pb2.VariableConfig(var_name=v.name,
                                            shards=[self.options.synchronizer(placed[v.name])])
                for v in graph_item.variables]


class PartitionedPS(PS):
    """Large variables split into even shards spread over the PS devices.

    A variable is split along its first partitionable axis (axis 0 for a
    sparse gradient) into as many shards as there are PS devices, bounded so
    that each shard holds at least `min_shard_bytes`; shards and whole
    variables are then placed largest first on the least loaded PS.

    Args:
        min_shard_bytes: Smallest shard worth making; smaller variables stay whole.
        max_shards: Upper bound on shards per variable (default: number of PS).
    """

    name = "PartitionedPS"

    def __init__(self, sync: bool = True, staleness: int = 0, local_replication: bool = False,
                 min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
                 max_shards: int | None = None) -> None:
        super().__init__(sync, staleness, local_replication)
        if min_shard_bytes < 1:
            raise InvalidArgumentError("min_shard_bytes must be >= 1. Received: "
                                       f"{min_shard_bytes!r}")
        if max_shards is not None and max_shards < 1:
            raise InvalidArgumentError(f"max_shards must be >= 1. Received: {max_shards!r}")
        self.min_shard_bytes = min_shard_bytes
        self.max_shards = max_shards

    def _max_shards(self, resource_spec: ResourceSpec) -> int:
        return self.max_shards or len(resource_spec.ps_devices)

    def variable_configs(self, graph_item: GraphItem,
                         resource_spec: ResourceSpec) -> list[strategy_pb2.VariableConfig]:
        balancer = LoadBalancer(resource_spec, resource_spec.ps_devices)
        limit = self._max_shards(resource_spec)
        placed: dict[str, strategy_pb2.VariableConfig] = {}
        for v in largest_first(graph_item.variables):
            config = strategy_pb2.VariableConfig(var_name=v.name)
            axis = partition_axis(v)
            n = 1 if axis is None else shard_count(v, axis, limit, self.min_shard_bytes)
            if n == 1:
                config.shards.append(self.options.synchronizer(balancer.place(v.byte_size)))
            else:
                self._split(v, axis, n, balancer, config)
            placed[v.name] = config
        return [placed[v.name] for v in graph_item.variables]

    def _split(self, v, axis: int, n: int, balancer: LoadBalancer,
               config: strategy_pb2.VariableConfig) -> None:
        """Partitions `v` into `n` even shards on distinct, least loaded servers."""
        sizes = even_sizes(v.shape[axis], n)
        config.partitioner.CopyFrom(partitioner(axis, sizes))
        row_bytes = v.byte_size / v.shape[axis]
        used: list[str] = []
        # The shards of one variable go to distinct servers: spreading its
        # traffic is the point of partitioning it.
        for size in sizes:
            used.append(balancer.place(row_bytes * size, exclude=used))
        config.shards.extend(self.options.synchronizer(d) for d in used)


class UnevenPartitionedPS(PartitionedPS):
    """Shards sized to the PS devices: a faster or less loaded PS gets more rows.

    Variables are taken largest first; each partitionable one is split over
    the PS devices that would finish earliest, with shard sizes that equalise
    (load + shard bytes) / bandwidth across them (water-filling). With equal
    bandwidths and loads this is the even split; otherwise shards are uneven.
    """

    name = "UnevenPartitionedPS"

    def _split(self, v, axis: int, n: int, balancer: LoadBalancer,
               config: strategy_pb2.VariableConfig) -> None:
        """Partitions `v` over up to `n` servers with water-filled shard sizes."""
        shares = balancer.split(v.byte_size, n)
        sizes = proportional_sizes(v.shape[axis], [share for _, share in shares])
        if len(sizes) > 1:
            config.partitioner.CopyFrom(partitioner(axis, sizes))
        config.shards.extend(self.options.synchronizer(d) for d, _ in shares)
