"""Parallax: sparse variables on parameter servers, dense ones all-reduced."""
from __future__ import annotations

from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.proto import strategy_pb2
from autodist.search.builders.all_reduce import DEFAULT_GROUP_BYTES, AllReduce
from autodist.search.builders.base import Builder
from autodist.search.builders.ps import DEFAULT_MIN_SHARD_BYTES, PartitionedPS


class Parallax(Builder):
    """The hybrid of Parallax (Kim et al., EuroSys 2019).

    Sparse gradients touch few rows, so their variables go to parameter
    servers, partitioned and load-balanced (only the touched rows travel);
    dense gradients are fused and all-reduced.

    Args:
        sync: Synchronous PS updates for the sparse variables.
        staleness: With sync, how far a replica may run ahead on them.
        local_replication: Worker-local copies of the sparse variables.
        group_bytes: Largest fused all-reduce buffer for dense variables.
        compressor: Compressor of the dense all-reduce.
        min_shard_bytes: Smallest PS shard of a sparse variable.
    """

    name = "Parallax"

    def __init__(self, sync: bool = True, staleness: int = 0, local_replication: bool = False,
                 group_bytes: int = DEFAULT_GROUP_BYTES, compressor: str = "none",
                 min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES) -> None:
        self.ps = PartitionedPS(sync, staleness, local_replication, min_shard_bytes)
        self.all_reduce = AllReduce(group_bytes, compressor)

    def variable_configs(self, graph_item: GraphItem,
                         resource_spec: ResourceSpec) -> list[strategy_pb2.VariableConfig]:
        sparse = {v.name for v in graph_item.variables if v.sparse_gradient}
        ps_configs = {}
        if sparse:
            subset = _Subset(graph_item, sparse)
            ps_configs = {c.var_name: c for c in self.ps.variable_configs(subset, resource_spec)}
        ar_configs = {c.var_name: c for c in self.all_reduce.variable_configs(
            _Subset(graph_item, set(graph_item.variable_names) - sparse), resource_spec)}
        return [ps_configs.get(name) or ar_configs[name] for name in graph_item.variable_names]


class _Subset:
    """A view of a GraphItem restricted to some variables (what builders read)."""

    def __init__(self, graph_item: GraphItem, names: set[str]) -> None:
        self.variables = [v for v in graph_item.variables if v.name in names]
        self.variable_names = [v.name for v in self.variables]
