"""All-reduce builders: AllReduce, PartitionedAR, RandomAxisPartitionAR."""
from __future__ import annotations

import random

from autodist.ir.errors import InvalidArgumentError
from autodist.ir.graph_item import GraphItem, VariableInfo
from autodist.ir.resource_spec import ResourceSpec
from autodist.proto import strategy_pb2
from autodist.search.builders.base import (Builder, GroupAssigner, all_reduce_synchronizer,
                                           compressor_enum, even_sizes, partition_axis,
                                           partitioner, shard_count)

DEFAULT_GROUP_BYTES = 32 * 1024 * 1024
DEFAULT_AR_MIN_SHARD_BYTES = 4 * 1024 * 1024
DEFAULT_AR_MAX_SHARDS = 8


class AllReduce(Builder):
    """Every variable mirrored on the replicas and all-reduced.

    Dense gradients are fused into groups of at most `group_bytes` in backward
    order and ring all-reduced; sparse gradients (embeddings) are all-gathered
    as indices and values, one group each, because summing them densely would
    send the whole table every step.

    Args:
        group_bytes: Largest fused all-reduce buffer.
        compressor: "none", "fp16" or "fp16_error_feedback" (sparse gradients
            get plain "fp16" instead of error feedback).
    """

    name = "AllReduce"

    def __init__(self, group_bytes: int = DEFAULT_GROUP_BYTES, compressor: str = "none") -> None:
        self.group_bytes = group_bytes
        self.compressor = compressor
        self._compressor = compressor_enum(compressor)
        GroupAssigner(group_bytes)  # validates group_bytes

    def _plan(self, var: VariableInfo) -> tuple[int | None, list[int]]:
        """(axis, shard sizes) of a variable; [1] with axis None means whole."""
        return None, [1]

    def variable_configs(self, graph_item: GraphItem,
                         resource_spec: ResourceSpec) -> list[strategy_pb2.VariableConfig]:
        groups = GroupAssigner(self.group_bytes)
        plans = {}
        for v in graph_item.variables:
            axis, sizes = self._plan(v)
            plans[v.name] = (axis, sizes)
            row_bytes = v.byte_size // v.shape[axis] if axis is not None else v.byte_size
            for k, size in enumerate(sizes):
                groups.add(f"{v.name}/{k}", v.gradient_order, row_bytes * size,
                           v.sparse_gradient)
        group_of = groups.assign()
        configs = []
        for v in graph_item.variables:
            axis, sizes = plans[v.name]
            config = strategy_pb2.VariableConfig(var_name=v.name)
            if len(sizes) > 1:
                config.partitioner.CopyFrom(partitioner(axis, sizes))
            config.shards.extend(
                all_reduce_synchronizer(v.sparse_gradient, group_of[f"{v.name}/{k}"],
                                        self._compressor) for k in range(len(sizes)))
            configs.append(config)
        return configs


class PartitionedAR(AllReduce):
    """All-reduce with large variables split into shards (finer fusion and overlap).

    A variable is split along its first partitionable axis into shards of at
    least `min_shard_bytes`, at most `max_shards`; each shard is a separate
    tensor for grouping.
    """

    name = "PartitionedAR"

    def __init__(self, group_bytes: int = DEFAULT_GROUP_BYTES, compressor: str = "none",
                 min_shard_bytes: int = DEFAULT_AR_MIN_SHARD_BYTES,
                 max_shards: int = DEFAULT_AR_MAX_SHARDS) -> None:
        super().__init__(group_bytes, compressor)
        if min_shard_bytes < 1:
            raise InvalidArgumentError("min_shard_bytes must be >= 1. Received: "
                                       f"{min_shard_bytes!r}")
        if max_shards < 1:
            raise InvalidArgumentError(f"max_shards must be >= 1. Received: {max_shards!r}")
        self.min_shard_bytes = min_shard_bytes
        self.max_shards = max_shards

    def _choose_axis(self, var: VariableInfo) -> int | None:
        return partition_axis(var)

    def _plan(self, var: VariableInfo) -> tuple[int | None, list[int]]:
        axis = self._choose_axis(var)
        if axis is None:
            return None, [1]
        n = shard_count(var, axis, self.max_shards, self.min_shard_bytes)
        return (axis, even_sizes(var.shape[axis], n)) if n > 1 else (None, [1])


class RandomAxisPartitionAR(PartitionedAR):
    """PartitionedAR with the axis drawn at random among the partitionable ones.

    Seeded: the same seed and GraphItem give the same strategy. Sparse
    variables only ever split along axis 0.
    """

    name = "RandomAxisPartitionAR"

    def __init__(self, seed: int = 0, group_bytes: int = DEFAULT_GROUP_BYTES,
                 compressor: str = "none", min_shard_bytes: int = DEFAULT_AR_MIN_SHARD_BYTES,
                 max_shards: int = DEFAULT_AR_MAX_SHARDS) -> None:
        super().__init__(group_bytes, compressor, min_shard_bytes, max_shards)
        self.seed = seed
        self._rng = random.Random(seed)

    def variable_configs(self, graph_item: GraphItem,
                         resource_spec: ResourceSpec) -> list[strategy_pb2.VariableConfig]:
        self._rng = random.Random(self.seed)
        return super().variable_configs(graph_item, resource_spec)

    def _choose_axis(self, var: VariableInfo) -> int | None:
        axes = list(var.partitionable_axes)
        return self._rng.choice(axes) if axes else None
